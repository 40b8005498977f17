"""TLS and SuperNode authentication on loopback, with real Flower processes.

``deploy/gen-certs.sh`` makes a CA, a SuperLink certificate (localhost, 127.0.0.1) and five
SuperNode key pairs. A real ``flower-superlink`` runs with ``--ssl-*`` and
``--enable-supernode-auth``; ``flwr supernode register`` (over TLS) registers keys 1-4
(key 4 belongs to no node: registering a key does not make a node).

- three SuperNodes with registered keys come online and a seeded one-round run completes
  with exactly them in every round;
- a SuperNode with an unregistered key (key 5) never comes online, and the run completes
  without it;
- the SuperLink has a SuperExec secret (the fleet starter runs its ``flower-superexec`` with
  it): the run trains through it, and an unsigned Runtime task claim
  (``deploy/runtime_claim.py``) is refused with 401;
- plaintext is refused: an HTTP request to the TLS port gets no answer, the ``flwr`` CLI over
  an ``insecure = true`` connection fails, and a SuperNode that connects with ``--insecure``
  never comes online. (A SuperNode given a key *and* ``--insecure`` does not even start:
  Flower exits with code 303, node authentication needs TLS.)

Skips when ``openssl`` or ``ssh-keygen`` is missing. About 40-70 s on an idle 2-core machine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from edgefleet.processes import config_arg, free_port, toml_value
from fleetharness.fleet import DeploymentFleet, write_superexec_secret
from tests.flower_runs import SUMMARY_GRACE, submit, summary_and_rows, wait_for_summary

GEN_CERTS = Path(__file__).resolve().parents[1] / "deploy" / "gen-certs.sh"
CLAIM = Path(__file__).resolve().parents[1] / "deploy" / "runtime_claim.py"
NUM_NODES = 3
NUM_ROUNDS = 1
RUN_NAME = "tls-auth"
STARTUP_TIMEOUT = 60.0
RUN_DEADLINE = 200.0  # from the test start; about 60 s on an idle machine

pytestmark = [
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
    pytest.mark.skipif(
        shutil.which("ssh-keygen") is None,
        reason="ssh-keygen (openssh-client) is not installed: it makes the SuperNode keys",
    ),
]


def make_certs(dest: Path, nodes: int) -> Path:
    subprocess.run(
        ["bash", str(GEN_CERTS), "-o", str(dest), "-n", str(nodes)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return dest


@pytest.mark.timeout(240)
def test_tls_with_registered_supernodes(tmp_path: Path) -> None:
    t0 = time.monotonic()
    certs = make_certs(tmp_path / "certs", nodes=NUM_NODES + 2)
    keys = certs / "keys"
    output_dir = tmp_path / "out"
    run_dir = output_dir / RUN_NAME
    fleet = DeploymentFleet(tmp_path / "flower", connection="tls-auth")
    try:
        fleet.start_superlink(
            [
                "--ssl-ca-certfile",
                str(certs / "ca.crt"),
                "--ssl-certfile",
                str(certs / "server.pem"),
                "--ssl-keyfile",
                str(certs / "server.key"),
                "--enable-supernode-auth",
            ],
            root_certificates=certs / "ca.crt",
            timeout=STARTUP_TIMEOUT,
            superexec_secret=write_superexec_secret(tmp_path / "superexec.secret"),
        )
        port = fleet.superlink_address.rsplit(":", 1)[1] if fleet.superlink_address else ""

        # A Runtime task claim without the secret: refused (Flower's default answers it).
        claim = subprocess.run(
            [sys.executable, str(CLAIM), fleet.superlink_address or "",
             "--root-certificates", str(certs / "ca.crt")],
            capture_output=True, text=True, timeout=60, env=fleet.env,
        )  # fmt: skip
        assert claim.returncode == 1 and '"claimed": false' in claim.stdout, claim
        assert "401" in claim.stdout, claim.stdout

        # Plaintext against the TLS port: no HTTP answer.
        with pytest.raises((urllib.error.URLError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5.0)
        # The flwr CLI over a plaintext connection is refused too.
        config = fleet.flwr_home / "config.toml"
        config.write_text(
            config.read_text()
            + f"\n[superlink.plain]\naddress = {toml_value(fleet.superlink_address)}\n"
            + "insecure = true\n"
        )
        refused = _json_output(
            fleet.flwr_output("supernode", "ls", "plain", "--format", "json", timeout=30.0)
        )
        assert refused["success"] is False, refused
        assert "unavailable" in refused["error-message"], refused

        # Register keys 1..NUM_NODES+1 (over TLS); key NUM_NODES+2 stays unregistered.
        for i in range(1, NUM_NODES + 2):
            out = fleet.flwr_output(
                "supernode", "register", str(certs / "pubkeys" / f"node-{i}.pub"), fleet.connection
            )
            assert "registered successfully" in out, out

        honest = [
            fleet.start_supernode(
                {"partition-id": i, "num-partitions": NUM_NODES, "device-id": i},
                ["--auth-supernode-private-key", str(keys / f"node-{i + 1}")],
                name=f"node-{i + 1}",
            )
            for i in range(NUM_NODES)
        ]
        fleet.wait_for_nodes(NUM_NODES, timeout=STARTUP_TIMEOUT)
        t_online = time.monotonic() - t0

        # An unregistered key, and a registered key over plaintext: neither comes online.
        rogue_cfg = {"partition-id": 0, "num-partitions": NUM_NODES}
        unregistered = fleet.start_supernode(
            {**rogue_cfg, "device-id": 90},
            ["--auth-supernode-private-key", str(keys / f"node-{NUM_NODES + 2}")],
            name="unregistered",
        )
        plaintext = fleet.start(
            "plaintext",
            [
                "flower-supernode",
                "--insecure",
                "--superlink",
                fleet.superlink_address or "",
                "--port",
                str(free_port()),
                "--node-config",
                config_arg({**rogue_cfg, "device-id": 91}),
            ],
        )

        run_config = {
            "num-server-rounds": NUM_ROUNDS,
            "local-steps": 3,
            "min-nodes": NUM_NODES,
            "seed": 0,
            "output-dir": str(output_dir),
            "run-name": RUN_NAME,
        }
        flwr_run = submit(fleet, tmp_path, run_config)
        summary_path = run_dir / "summary.json"
        wait_for_summary(fleet, flwr_run, summary_path, t0 + RUN_DEADLINE)
        t_summary = time.monotonic() - t0

        summary, rows = summary_and_rows(run_dir)
        assert summary["rounds_run"] == NUM_ROUNDS
        assert [row["round"] for row in rows] == list(range(1, NUM_ROUNDS + 1))
        for row in rows:
            assert sorted(row["participants"]) == [str(i) for i in range(NUM_NODES)], row
            assert row["rejected"] == [], row

        # Still exactly the registered, TLS-connected nodes online.
        online = fleet.online_nodes()
        assert len(online) == NUM_NODES, online
        assert all(p.running() for p in honest), fleet.report()
        # The SuperLink turned the unregistered key away; the plaintext node never got in.
        link_log = next(p for p in fleet.processes if p.name == "superlink").log_path
        assert "No SuperNode found with the given public key" in link_log.read_text(), (
            "the SuperLink did not log the unregistered node's refused activation"
        )
        assert "Connection attempt failed" in plaintext.log_path.read_text(errors="replace")
        try:
            flwr_run.popen.wait(timeout=SUMMARY_GRACE)
        except subprocess.TimeoutExpired:
            pytest.fail("`flwr run --stream` still attached after the summary was written")
        assert flwr_run.popen.returncode == 0, flwr_run.tail()
        print(f"\n{NUM_NODES} nodes online after {t_online:.1f} s, summary after {t_summary:.1f} s")
        print(f"unregistered node log:\n{unregistered.tail(5)}")
        print(f"plaintext node log:\n{plaintext.tail(5)}")
    except BaseException:
        print(f"\n----- Flower process logs ({tmp_path}) -----\n{fleet.report()}")
        raise
    finally:
        fleet.stop()
        print(f"test took {time.monotonic() - t0:.1f} s")
    assert fleet.survivors() == [], "Flower processes outlived the test"


def _json_output(output: str) -> dict[str, Any]:
    """The JSON object that ``flwr ... --format json`` printed (after any log lines)."""
    start = output.find("{")
    assert start >= 0, output
    data: dict[str, Any] = json.loads(output[start:])
    return data
