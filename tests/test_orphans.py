"""``kill -9`` of ``edgefleet run`` leaves no process of its run behind: not its SuperLink, Ray
cluster or ``flwr`` CLI (direct children: a parent-death signal), not the SuperExec and the
ServerApp's process that Flower starts under the SuperLink (Flower's own ``--parent-pid``
watch carries the signal down), not the in-process engine's run and worker processes.
Before, the ServerApp went on running rounds, reparented to PID 1. The Ray temp dir it could
not remove goes at the next Ray start."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefleet.processes import _own, sweep_ray_temp_dirs
from fleetharness.fleet import processes_with_env

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["simulation", "inprocess"])
def test_kill_9_of_edgefleet_run_leaves_no_process_of_its_run(tmp_path: Path, engine: str) -> None:
    (tmp_path / "tmp").mkdir()
    marker = f"TMPDIR={tmp_path / 'tmp'}"  # every process of the run inherits it
    cmd = [sys.executable, "-m", "edgefleet.cli", "run", str(ROOT / "scenarios" / "fedavg.toml"),
           "--quiet", "--engine", engine, "--set", "federation.num-supernodes=2",
           "--set", "num-server-rounds=500", "--set", "local-steps=1",
           "--set", f"output-dir={tmp_path}", "--set", "run-name=k9"]  # fmt: skip
    if engine == "inprocess":
        cmd += ["--workers", "2"]
    proc = subprocess.Popen(
        cmd, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    rows = tmp_path / "k9" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 420
        while _rows(rows) < 1:  # the ServerApp runs rounds
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no round within 420 s"
            time.sleep(0.2)
        running = processes_with_env(marker)
        assert len(running) > 1
        ray_dirs = {Path(a.split("=", 1)[1]) for line in running for a in line.split()
                    if a.startswith("--temp-dir=")}  # fmt: skip
        assert len(ray_dirs) == (engine == "simulation")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # Generous: a loaded machine stops a Ray cluster slowly; an idle one in ~10 s.
        deadline = time.monotonic() + 120
        while (left := processes_with_env(marker)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"processes outlived `edgefleet run` (kill -9): {left}"
        done = _rows(rows)
        time.sleep(2.0)
        assert _rows(rows) == done, "rounds went on after the run was killed"
        assert all(d.is_dir() for d in ray_dirs)  # nobody was left to remove it
        removed = sweep_ray_temp_dirs()  # what the next Ray start does
        assert ray_dirs <= set(removed) and not any(d.exists() for d in ray_dirs)
    finally:
        for line in processes_with_env(marker):  # whatever a failure left
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


def test_only_a_dead_fleets_ray_dir_is_swept(tmp_path: Path) -> None:
    def ray_dir(name: str, owner: bool = True, ran: bool = True) -> Path:
        d = tmp_path / f"efray-{name}"
        (d / "session_x" / "logs").mkdir(parents=True)
        if owner:
            os.close(os.open(d / ".edgefleet-owner", os.O_CREAT | os.O_RDWR, 0o600))
        if ran:
            (d / "session_latest").symlink_to(d / "session_x")
        return d

    dead, old, fresh = ray_dir("dead"), ray_dir("old", owner=False), ray_dir("new", ran=False)
    live = ray_dir("live")
    fd = _own(live)  # its fleet runs: the owner's flock is held
    try:
        (tmp_path / "other").mkdir()
        (tmp_path / "efray-link").symlink_to(tmp_path / "other")
        assert sweep_ray_temp_dirs(tmp_path) == [dead]
        assert not dead.exists() and old.is_dir() and fresh.is_dir() and live.is_dir()
        assert (tmp_path / "other").is_dir()
    finally:
        os.close(fd)
    assert sweep_ray_temp_dirs(tmp_path) == [live]  # its fleet ended, however it ended
