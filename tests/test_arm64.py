"""An emulated Raspberry Pi 4 and Pi 5 join a live SuperLink, set up by deploy/EDGE.md's steps.

Opt-in (``EDGEFLEET_ARM64_TEST=1``, or ``make test-arm64``): the first build of the board's
root file system and venv took 105 minutes here (debootstrap 15, apt + venv + pip 90, under
a load average of about 25 on 2 cores). CI builds them beside pytest (``.ci/arm64-prep``)
and runs this test afterwards when time allows, only with ``EDGEFLEET_CI_ARM64=1``.
Skips, saying why, where this host cannot emulate arm64 (not x86-64 Linux, not root, no
binfmt_misc, no mount namespaces) or lacks openssl.

``deploy/emulated-pi.sh`` is the board: a Debian bookworm arm64 root (Raspberry Pi OS 64-bit's
base, Python 3.11.2) under qemu-user, with the Pi 4's CPU (Cortex-A72, ARMv8.0; the
PyTorch builds that need ARMv8.1 atomics die there with SIGILL) or the Pi 5's (Cortex-A76).
The root and the venv are cached outside the repository (``$EDGEFLEET_ARM64_CACHE``,
default ``~/.cache/edgefleet/arm64``) and rebuilt when EDGE.md's install block or
``deploy/pi/`` changes; each board of a test runs on an overlay of its own over that root.

1. ``emulated-pi.sh build``: EDGE.md's ``<!-- board: install -->`` block as user ``pi`` on the
   Pi 4's CPU (apt-get, venv, pip, ``check-torch.py``), a no-op when cached;
2. a TLS SuperLink with ``--enable-supernode-auth`` on the host, two x86-64 SuperNodes with
   registered keys;
3. per board, what its owner does: the files the operator hands over (``ca.crt``, a
   ``node.env``, the board's own ``.npz`` data) copied in, EDGE.md's ``<!-- board: keygen -->``
   block, the public key registered with ``flwr supernode register``, then EDGE.md's
   ``<!-- board: start -->`` block (``~/edgefleet/supernode.sh``);
4. all four nodes online, a two-round run (one local step, 8-image batches) completes with
   the two boards' device ids in both rounds' ``participants``, nothing rejected;
5. the fleet and both boards stopped in a ``finally`` (their mounts live in mount namespaces
   of their own and go with them).

Status (2026-12-01, idle 2-core machine): passes in 167 s with the root and venv cached: both
boards online 95 s after start (the warm worker's torch import takes about 60 s emulated),
two rounds in 39 and 64 s. Before the boards ran the warm worker (``supernode.sh`` started a
plain ``flower-supernode``), step 4 never completed: Flower 1.42 gives a ClientApp 30 s from
claiming a task to pulling its input, an emulated ``flwr-clientapp`` took minutes to get
there, and SuperExec kept starting new ones (32 after 9 minutes); ``_no_clientapp_pileup``
still fails the test at once, saying so, should a board fall back to that.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from edgefleet.processes import TAG_VAR, FlowerProcess, config_arg, free_port
from edgefleet.task.datasets import load_dataset
from fleetharness.fleet import DeploymentFleet
from tests.flower_runs import stopped_after, submit, summary_and_rows, wait_for_summary

REPO = Path(__file__).resolve().parents[1]
EMULATED_PI = REPO / "deploy" / "emulated-pi.sh"
EDGE_MD = REPO / "deploy" / "EDGE.md"
GEN_CERTS = REPO / "deploy" / "gen-certs.sh"
PI_DIR = REPO / "deploy" / "pi"
BOARDS = {"pi4": 104, "pi5": 105}  # board -> device-id
X86_NODES = 2
ROUNDS = 2
RUN_NAME = "arm64"
BUILD_TIMEOUT = 60 * 60.0  # a cold build: debootstrap and pip under emulation
ONLINE_TIMEOUT = 420.0  # flwr's import alone takes 20-60 s on an emulated core
RUN_TIMEOUT = 1500.0  # the first message loads the app and builds the device, emulated
BOARD_SAMPLES = 40
# One ClientApp per board at a time is normal, a second while the first exits; more means
# Flower's task-claim window is being missed (_no_clientapp_pileup).
MAX_CLIENTAPPS = 3 * len(BOARDS)


def _skip_reason() -> str | None:
    if os.environ.get("EDGEFLEET_ARM64_TEST") != "1":
        return (
            "opt-in: set EDGEFLEET_ARM64_TEST=1 (or run `make test-arm64`); the first build "
            "of the emulated board took 105 minutes on a loaded 2-core machine"
        )
    if shutil.which("openssl") is None:
        return "openssl is not installed (deploy/gen-certs.sh needs it)"
    setup = subprocess.run(
        ["bash", str(EMULATED_PI), "setup"], capture_output=True, text=True, timeout=900
    )
    if setup.returncode == 3:  # the script's "this host cannot emulate", with the reason
        return setup.stderr.strip().splitlines()[-1]
    if setup.returncode != 0:
        pytest.fail(f"deploy/emulated-pi.sh setup failed:\n{setup.stderr[-3000:]}")
    return None


def doc_block(name: str) -> str:
    """The fenced block after ``<!-- board: NAME -->`` in EDGE.md: what the test runs."""
    match = re.search(
        rf"^<!-- board: {re.escape(name)} -->\n```\w*\n(.*?)^```", EDGE_MD.read_text(), re.S | re.M
    )
    assert match, f"EDGE.md has no <!-- board: {name} --> block"
    return match.group(1)


def build_board() -> None:
    """The cached root and venv (EDGE.md's install block); built here when missing."""
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            ["bash", str(EMULATED_PI), "build"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"deploy/emulated-pi.sh build ran past {BUILD_TIMEOUT:.0f} s")
    if out.returncode != 0:
        pytest.fail(f"deploy/emulated-pi.sh build failed:\n{out.stderr[-4000:]}")
    print(f"\nboard build (cached or not): {time.monotonic() - t0:.0f} s\n{out.stderr[-600:]}")


def on_board(board: str, layer: Path, script: str, *extra: str, timeout: float = 300.0) -> str:
    """Run ``script`` with bash as ``pi`` on ``board`` (its own overlay ``layer``)."""
    cmd = ["bash", str(EMULATED_PI), "run", "--board", board, "--layer", str(layer), *extra]
    out = subprocess.run(
        [*cmd, "--", "bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"on {board}: {script!r} exited {out.returncode}:\n{out.stderr}"
    return out.stdout


def start_board(fleet: DeploymentFleet, board: str, layer: Path) -> FlowerProcess:
    """EDGE.md's start block on ``board``, as a member of ``fleet`` (stopped with it)."""
    start = doc_block("start")
    log_path = fleet.workdir / f"board-{board}.log"
    cmd = [
        "bash",
        str(EMULATED_PI),
        "run",
        "--board",
        board,
        "--layer",
        str(layer),
        # env -i on the board drops the fleet's tag; pass it on, so stop() finds the board's
        # processes whatever process group they end up in.
        "--env",
        f"{TAG_VAR}={fleet.tag}",
        "--",
        "bash",
        "-euo",
        "pipefail",
        "-c",
        start,
    ]
    with log_path.open("ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            cmd,
            cwd=fleet.workdir,
            env=fleet.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # Listed under the SuperNode's name, so that check_alive() fails the test if it exits.
    proc = FlowerProcess(f"board-{board}", popen, log_path, ["flower-supernode", *cmd])
    fleet.processes.append(proc)
    return proc


def board_data(path: Path, seed: int) -> None:
    """The board's own data: a few mnist-5k training images as raw pixels in an .npz."""
    pool, _, _ = load_dataset("mnist-5k")
    idx = np.random.default_rng(seed).choice(len(pool), BOARD_SAMPLES, replace=False)
    # The pool is normalised; the board's file holds pixels, as a camera would give.
    x = np.clip(pool.x[idx, 0] * 0.3081 + 0.1307, 0.0, 1.0) * 255.0
    np.savez(path, x=x.round().astype(np.uint8), y=pool.y[idx])


def _no_clientapp_pileup(fleet: DeploymentFleet) -> None:
    """Fail at once, saying why, when a board's ClientApps pile up. Flower 1.42's SuperNode
    gives a ClientApp 30 s (``HEARTBEAT_DEFAULT_INTERVAL``, fixed in ``claim_task``) from
    claiming a task to pulling its input; one that is slower loses the task, SuperExec starts
    another, and on a slow (emulated) board none ever gets there."""
    apps = [
        p for p in fleet.members() if "flwr-clientapp" in p.cmd and "/home/pi/edgefleet" in p.cmd
    ]
    if len(apps) > MAX_CLIENTAPPS:
        pytest.fail(
            f"{len(apps)} ClientApp processes on the emulated boards: each starts slower than "
            "the 30 s Flower 1.42 gives it to pick up its task, so SuperExec keeps starting "
            "new ones and no board reply arrives (see deploy/EDGE.md)"
        )


@pytest.mark.timeout(BUILD_TIMEOUT + RUN_TIMEOUT + 600)
def test_emulated_pis_join_a_live_superlink(tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    build_board()
    t_built = time.monotonic()

    certs = tmp_path / "certs"
    subprocess.run(
        ["bash", str(GEN_CERTS), "-o", str(certs), "-n", str(X86_NODES)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    output_dir = tmp_path / "out"
    fleet = DeploymentFleet(tmp_path / "flower", connection="arm64")
    with stopped_after(fleet, tmp_path):
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
        )
        for i in range(X86_NODES):
            key = certs / "keys" / f"node-{i + 1}"
            pub = certs / "pubkeys" / f"node-{i + 1}.pub"  # gen-certs keeps them apart
            fleet.flwr_output("supernode", "register", str(pub), fleet.connection)
            fleet.start_supernode(
                {"partition-id": i, "num-partitions": X86_NODES, "device-id": i},
                ["--auth-supernode-private-key", str(key)],
                name=f"x86-{i}",
            )

        keygen = doc_block("keygen")
        layers = {b: tmp_path / f"layer-{b}" for b in BOARDS}
        for board, device_id in BOARDS.items():
            # What the operator hands the board (scp): the CA, its settings, its data.
            handed = tmp_path / f"to-{board}"
            handed.mkdir()
            shutil.copy(certs / "ca.crt", handed / "ca.crt")
            # deploy/pi as it is now (the cached root holds the copy it was built with; only
            # the install files are part of its cache key).
            for name in (
                "supernode.sh",
                "worker.py",
                "flower_private.py",
                "edgefleet-supernode.service",
            ):
                shutil.copy(PI_DIR / name, handed / name)
            board_data(handed / "data.npz", seed=device_id)
            node_config = {
                "partition-id": 0,
                "num-partitions": 1,
                "device-id": device_id,
                "data-path": "/home/pi/edgefleet/data.npz",
            }
            (handed / "node.env").write_text(
                f"SUPERLINK={fleet.superlink_address}\n"
                f"NODE_CONFIG='{config_arg(node_config)}'\n"
                f"RUNTIME_PORT={free_port()}\n"
            )
            on_board(
                board,
                layers[board],
                f"cp /mnt/handed/* ~/edgefleet/\n{keygen}",
                "--bind",
                f"{handed}:/mnt/handed",
            )
            pub = layers[board] / "upper" / "home" / "pi" / "edgefleet" / "node.key.pub"
            assert pub.read_text().rstrip().endswith(f"{board}-emulated"), pub.read_text()
            out = fleet.flwr_output("supernode", "register", str(pub), fleet.connection)
            assert "registered successfully" in out, out
        boards = {b: start_board(fleet, b, layers[b]) for b in BOARDS}
        fleet.wait_for_nodes(X86_NODES + len(BOARDS), timeout=ONLINE_TIMEOUT)
        t_online = time.monotonic()
        for proc in boards.values():
            assert "SuperNode ID" in proc.log_path.read_text(errors="replace"), proc.tail()

        run_config = {
            "num-server-rounds": ROUNDS,
            "local-steps": 1,
            "batch-size": 8,
            "eval-samples": 100,
            "min-nodes": X86_NODES + len(BOARDS),
            "round-timeout": RUN_TIMEOUT / ROUNDS,
            "seed": 0,
            "output-dir": str(output_dir),
            "run-name": RUN_NAME,
        }
        flwr_run = submit(fleet, tmp_path, run_config)
        run_dir = output_dir / RUN_NAME
        wait_for_summary(
            fleet,
            flwr_run,
            run_dir / "summary.json",
            time.monotonic() + RUN_TIMEOUT + 120,
            on_poll=lambda: _no_clientapp_pileup(fleet),
        )
        t_done = time.monotonic()

        summary, rows = summary_and_rows(run_dir)
        assert summary["rounds_run"] == ROUNDS
        expected = sorted([str(i) for i in range(X86_NODES)] + [str(d) for d in BOARDS.values()])
        for row in rows:
            assert sorted(row["participants"]) == expected, row
            assert row["rejected"] == [] and row["declined"] == [], row
        for board, proc in boards.items():
            assert proc.running(), f"{board} exited:\n{proc.tail()}"
            text = proc.log_path.read_text(errors="replace")
            assert "Illegal instruction" not in text, text[-3000:]
        print(
            f"arm64 test took {t_done - t0:.0f} s: board build {t_built - t0:.0f} s, "
            f"all online {t_online - t_built:.0f} s later, {ROUNDS} rounds "
            f"{t_done - t_online:.0f} s; round wall times "
            f"{[row['wall_s'] for row in rows]}"
        )


def test_node_bin_writes_the_boards_commands_for_the_overhead_benchmark(tmp_path: Path) -> None:
    """``emulated-pi.sh node-bin`` (benchmarks/perf/deploy_overhead.py --node-bin) needs no board:
    it writes wrappers that run the board's own python and flower-supernode, and refuses a
    board it does not know, naming the valid ones."""
    out = subprocess.run(
        ["bash", str(EMULATED_PI), "node-bin", str(tmp_path / "bin"), "--board", "pi4"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    for name in ("python", "flower-supernode"):
        wrapper = tmp_path / "bin" / name
        assert os.access(wrapper, os.X_OK)
        assert subprocess.run(["bash", "-n", str(wrapper)], capture_output=True).returncode == 0
        text = wrapper.read_text()
        assert "run --board pi4 " in text and f"/home/pi/edgefleet/venv/bin/{name} " in text
        assert "EDGEFLEET_DEPLOY_TRACE" in text  # the benchmark's trace reaches the board
    bad = subprocess.run(
        ["bash", str(EMULATED_PI), "node-bin", str(tmp_path / "x"), "--board", "pi9"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode != 0 and "valid: pi4, pi5" in bad.stderr
    assert not (tmp_path / "x").exists()
