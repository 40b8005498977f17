"""``kill -9`` of ``edgefleet run`` leaves no process of its run behind: not its SuperLink, Ray
cluster or ``flwr`` CLI (direct children: a parent-death signal), not the SuperExec and the
ServerApp's process that Flower starts under the SuperLink (Flower's own ``--parent-pid``
watch carries the signal down), not the in-process engine's run and worker processes.
Before, the ServerApp went on running rounds, reparented to PID 1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
        assert len(processes_with_env(marker)) > 1
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
    finally:
        for line in processes_with_env(marker):  # whatever a failure left
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
