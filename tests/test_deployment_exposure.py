"""A SuperLink's Runtime API seen from the LAN: a task claim from another network namespace.

Flower 1.42 serves its Runtime API (``/v1/runtime/``: a SuperExec claims the next ServerApp
task there and gets the token that reads the run's inputs and writes its results) on the same
port as the Fleet API the devices dial, and checks no caller unless the SuperLink has a
SuperExec secret (``--superexec-auth-secret-file``, honoured only with ``--isolation
process``). Here two loopback fleets' SuperLinks (:meth:`DeploymentFleet.start_superlink`) run in
a network namespace of their own (``fleet``), listening on its every address, and the
attacker sends ``deploy/runtime_claim.py``'s claim from a second namespace (``lan``) joined
to it by a veth pair:

- the SuperLink without a secret (Flower's default) hands the claim an answer: the hole;
- the SuperLink with the secret, which the fleet starter now sets (with its own
  ``flower-superexec``), refuses the unsigned claim and one signed with a wrong secret, and
  answers one signed with the right secret (so the refusal is the secret's doing).

The compose fleet closes the same hole twice (the Runtime API is not forwarded to the
devices' network at all, and the secret is set): tests/test_compose.py. Root only (``ip
netns``); the namespaces and the veth pair are deleted in a ``finally``. About 15 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fleetharness.fleet import DeploymentFleet, write_superexec_secret

ROOT = Path(__file__).resolve().parents[1]
CLAIM = ROOT / "deploy" / "runtime_claim.py"
FLEET_IP, LAN_IP = "10.79.0.1", "10.79.0.2"  # inside this test's namespaces only

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2 (`ip netns`)",
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _claim(netns: str, address: str, secret: Path | None = None) -> dict[str, Any]:
    """deploy/runtime_claim.py run inside ``netns``: its JSON answer."""
    cmd = ["ip", "netns", "exec", netns, sys.executable, str(CLAIM), address]
    if secret is not None:
        cmd += ["--secret-file", str(secret)]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no answer from runtime_claim.py:\n{proc.stdout}\n{proc.stderr[-2000:]}"
    answer: dict[str, Any] = json.loads(lines[-1])
    assert proc.returncode == (0 if answer["claimed"] else 1), (proc.returncode, answer)
    return answer


@pytest.mark.timeout(180)
def test_runtime_claim_from_the_lan_needs_the_superexec_secret(tmp_path: Path) -> None:
    tag = f"{os.getpid() % 100000}"
    ns_fleet, ns_lan = f"ef-exp{tag}-fleet", f"ef-exp{tag}-lan"
    veth_fleet, veth_lan = f"efx{tag}f", f"efx{tag}l"
    open_fleet = DeploymentFleet(tmp_path / "open", connection="open")
    closed_fleet = DeploymentFleet(tmp_path / "closed", connection="closed")
    made: list[str] = []
    try:
        for ns in (ns_fleet, ns_lan):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", veth_fleet, "type", "veth", "peer", "name", veth_lan)
        _ip("link", "set", veth_fleet, "netns", ns_fleet)
        _ip("link", "set", veth_lan, "netns", ns_lan)
        for ns, dev, addr in ((ns_fleet, veth_fleet, FLEET_IP), (ns_lan, veth_lan, LAN_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

        # Flower's default: no secret (subprocess isolation ignores one anyway).
        open_fleet.start_superlink(netns=ns_fleet, timeout=60.0)
        open_port = (open_fleet.superlink_address or "").rsplit(":", 1)[1]
        secret = write_superexec_secret(tmp_path / "superexec.secret")
        assert (secret.stat().st_mode & 0o777) == 0o600
        closed_fleet.start_superlink(netns=ns_fleet, superexec_secret=secret, timeout=60.0)
        closed_port = (closed_fleet.superlink_address or "").rsplit(":", 1)[1]
        wrong = tmp_path / "wrong.secret"
        wrong.write_text("0" * 64)

        # From the LAN: the open SuperLink answers anyone's claim ...
        assert _claim(ns_lan, f"{FLEET_IP}:{open_port}")["claimed"] is True
        # ... the one with the secret refuses an unsigned or wrongly signed one ...
        for key in (None, wrong):
            answer = _claim(ns_lan, f"{FLEET_IP}:{closed_port}", key)
            assert answer["claimed"] is False, answer
            assert "401" in answer["error"], answer
        # ... and answers a claim signed with the secret (what its SuperExec sends).
        assert _claim(ns_fleet, f"127.0.0.1:{closed_port}", secret)["claimed"] is True
        # That SuperExec runs, with the secret, inside the fleet's namespace.
        superexec = [p for p in closed_fleet.processes if p.name == "superexec"]
        assert len(superexec) == 1 and superexec[0].running(), closed_fleet.report()
        assert str(secret) in superexec[0].args
        time.sleep(0.5)
        assert superexec[0].running(), superexec[0].tail()
    except BaseException:
        print(f"\n----- logs -----\n{open_fleet.report()}\n{closed_fleet.report()}")
        raise
    finally:
        open_fleet.stop()
        closed_fleet.stop()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    assert open_fleet.survivors() == [] and closed_fleet.survivors() == []
    assert not any(ns in made for ns in _namespaces())


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
