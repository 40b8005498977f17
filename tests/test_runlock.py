"""One writer per run folder (edgefleet.runlock): a second writer refused, naming the first;
a dead writer's lock taken over; release and take again; another host's lock left alone."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefleet import runlock
from edgefleet.processes import _processes
from edgefleet.runlock import HOST, LOCK_FILE, RunLocked

ROOT = Path(__file__).resolve().parents[1]

# A writer in another process: takes the lock, says so, then waits to be killed.
HOLDER = """
import sys, time
from edgefleet import runlock
runlock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def _holder(run_dir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


# A writer whose main thread has ended while another still runs (as a stopped process's
# last threads end): /proc shows its leader as a zombie, yet it holds its files and flock.
EXITING_HOLDER = """
import ctypes, os, sys, threading
from edgefleet import runlock
runlock.acquire(sys.argv[1])
def last():
    sys.stdin.readline()
    os._exit(0)
threading.Thread(target=last).start()
print("locked", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


@pytest.fixture
def holder(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = _holder(run_dir)
    yield run_dir, proc
    proc.kill()
    proc.wait()


def test_a_second_writer_is_refused_naming_the_first(holder) -> None:
    run_dir, proc = holder
    info = json.loads((run_dir / LOCK_FILE).read_text())
    assert (info["pid"], info["host"]) == (proc.pid, HOST) and info["started"]
    for attempt in (runlock.acquire, runlock.check):
        with pytest.raises(RunLocked) as err:
            attempt(run_dir)
        msg = str(err.value)
        assert f"PID {proc.pid} on host {HOST}, since {info['started']}" in msg
        assert str(run_dir.resolve()) in msg and f"kill {proc.pid}" in msg
        assert "choose another run-name" in msg
    assert (run_dir / LOCK_FILE).exists()  # the refused writer leaves the lock alone


def test_a_dead_writers_lock_is_taken_over_with_a_warning(holder, caplog) -> None:
    run_dir, proc = holder
    proc.send_signal(signal.SIGKILL)  # no chance to release: only the kernel drops it
    proc.wait()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == proc.pid  # left behind
    with caplog.at_level(logging.WARNING, logger="flwr"):
        runlock.acquire(run_dir)
    try:
        assert f"taking over the lock of PID {proc.pid} on host {HOST}" in caplog.text
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        runlock.release(run_dir)
    assert not (run_dir / LOCK_FILE).exists()


def test_a_writer_stopped_by_its_runner_leaves_no_lock_to_warn_about(holder, caplog) -> None:
    """After Ctrl-C the runner has ended the ServerApp itself: it removes the lock file, so
    the resume takes the folder without "taking over the lock ... ended without releasing"."""
    run_dir, proc = holder
    runlock.release_stopped(run_dir, wait=0.2)  # the writer still runs: its lock stays
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == proc.pid
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    runlock.release_stopped(run_dir)
    assert not (run_dir / LOCK_FILE).exists()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        runlock.acquire(run_dir)
    runlock.release(run_dir)
    assert "taking over" not in caplog.text


def test_release_lets_another_process_take_it_and_the_holder_may_retake(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    runlock.acquire(run_dir)
    runlock.acquire(run_dir)  # re-entry: a resume in the same process (the ServerApp in tests)
    runlock.check(run_dir)  # its own lock is no obstacle
    try:
        with pytest.raises(subprocess.CalledProcessError) as err:
            subprocess.run(
                [sys.executable, "-c", "import sys; from edgefleet import runlock; "
                 "runlock.acquire(sys.argv[1])", str(run_dir)],
                env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, capture_output=True,
                text=True,
            )  # fmt: skip
        assert f"RunLocked: run folder {run_dir.resolve()} is being written" in err.value.stderr
        assert f"PID {os.getpid()}" in err.value.stderr
    finally:
        runlock.release(run_dir)
    assert not (run_dir / LOCK_FILE).exists()
    proc = _holder(run_dir)  # free again: another process takes it
    try:
        with pytest.raises(RunLocked, match=f"PID {proc.pid}"):
            runlock.acquire(run_dir)
    finally:
        proc.kill()
        proc.wait()
    runlock.acquire(run_dir)  # and back once that one has ended
    runlock.release(run_dir)
    runlock.release(run_dir)  # a second release is a no-op


def test_a_lock_written_on_another_host_is_refused_with_how_to_clear_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / LOCK_FILE
    lock.write_text(json.dumps({"pid": 4242, "host": "elsewhere", "started": "2026-01-01"}))
    for attempt in (runlock.acquire, runlock.check):
        with pytest.raises(RunLocked) as err:
            attempt(run_dir)
        msg = str(err.value)
        assert "PID 4242 on host elsewhere, since 2026-01-01" in msg
        assert f"this host ({HOST}) cannot check" in msg and f"remove {lock.resolve()}" in msg
    assert lock.exists()
    lock.unlink()  # as the message says
    runlock.acquire(run_dir)
    runlock.release(run_dir)


@pytest.mark.skipif(not runlock.BOOT_ID, reason="no kernel boot id here (not Linux)")
def test_a_dead_lock_of_a_container_on_this_kernel_is_taken_over(tmp_path: Path, caplog) -> None:
    """`docker compose down` and `up`: the ServerApp's new container has another host name,
    but the same kernel, whose flock answer covers the old container too."""
    lock = tmp_path / LOCK_FILE
    old = {"pid": 7, "host": "0a1b2c3d4e5f", "started": "2026-01-01", "boot_id": runlock.BOOT_ID}
    lock.write_text(json.dumps(old))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        runlock.acquire(tmp_path)
    runlock.release(tmp_path)
    assert "taking over the lock of PID 7 on host 0a1b2c3d4e5f" in caplog.text
    old["boot_id"] = "another-kernel"  # the same name on another machine: refused
    lock.write_text(json.dumps(old))
    with pytest.raises(RunLocked, match="cannot check"):
        runlock.acquire(tmp_path)


def test_check_takes_nothing_and_passes_a_missing_folder(tmp_path: Path) -> None:
    runlock.check(tmp_path / "not-yet")
    assert not (tmp_path / "not-yet").exists()
    runlock.check(tmp_path)
    assert not (tmp_path / LOCK_FILE).exists()
    proc = _holder(tmp_path)  # check() held nothing: another process can take it
    proc.kill()
    proc.wait()


def test_a_file_system_without_locks_is_warned_about_not_fatal(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    def no_locks(fd: int, op: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        runlock.acquire(tmp_path)
    runlock.release(tmp_path)
    assert "cannot lock" in caplog.text and "No locks available" in caplog.text
    assert not (tmp_path / LOCK_FILE).exists()


# -- where EdgeFleet takes and checks it ------------------------------------------------------


def test_prepare_run_dir_holds_the_folder_fresh_and_resumed(tmp_path: Path) -> None:
    from edgefleet.config import parse_run_config
    from edgefleet.server.results import prepare_run_dir

    cfg = parse_run_config({"output-dir": str(tmp_path), "run-name": "r"})
    run_dir = prepare_run_dir(cfg)
    try:
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert prepare_run_dir(cfg) == run_dir  # the same process again: re-entry
    finally:
        runlock.release(run_dir)
    assert prepare_run_dir(cfg, lock=False) == run_dir and not (run_dir / LOCK_FILE).exists()
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n')
    proc = _holder(run_dir)  # a writer of this folder that is still going
    try:
        resume = parse_run_config({"output-dir": str(tmp_path), "run-name": "r", "resume": True})
        # Refused for the lock, not for "no checkpoint" (resume) or "already holds results"
        # (fresh), which would send the user the wrong way.
        for config in (resume, cfg):
            with pytest.raises(RunLocked, match=f"PID {proc.pid} on host {HOST}"):
                prepare_run_dir(config)
            with pytest.raises(RunLocked, match=f"PID {proc.pid}"):
                prepare_run_dir(config, lock=False)
    finally:
        proc.kill()
        proc.wait()


def test_a_resume_of_a_folder_being_written_is_refused_before_ray_or_flower(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`edgefleet run --resume` while the run still goes: the CLI refuses in its own words,
    without starting Ray or any Flower process."""
    import time

    from edgefleet import cli
    from edgefleet.simulation.engine import Engine

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started for a refused resume")

    monkeypatch.setattr(cli, "_early_engine", started)
    monkeypatch.setattr(Engine, "start", started)
    monkeypatch.setattr(Engine, "launch_ray", started)
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n')
    proc = _holder(run_dir)
    try:
        t0 = time.monotonic()
        code = cli.main(["run", str(ROOT / "scenarios" / "fedavg.toml"), "--resume",
                         "--set", f"output-dir={tmp_path}", "--set", "run-name=r"])  # fmt: skip
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"edgefleet run: error: run folder {run_dir.resolve()} is being written")
    assert f"PID {proc.pid} on host {HOST}" in err
    assert elapsed < 10, elapsed  # imports and config only (well under a second when warm)


def test_a_sweep_never_removes_a_folder_that_another_process_writes(tmp_path: Path) -> None:
    """A sweep starts again a run folder without rows (a run that had only just started),
    removing it: not while another sweep of the same folder is starting that run."""
    from edgefleet.config import ConfigError
    from edgefleet.simulation.sweep import Sweep, grid_points
    from tests.test_sweep import _base

    sweep = Sweep(_base(tmp_path), grid_points({"alpha": [0.1]}), [0], tmp_path / "sw")
    run_dir = sweep.runs[0].run_dir
    run_dir.mkdir(parents=True)
    proc = _holder(run_dir)
    try:
        with pytest.raises(ConfigError, match=f"being written by another process: PID {proc.pid}"):
            sweep.check()
        assert run_dir.is_dir()
    finally:
        proc.kill()
        proc.wait()
    sweep.check()  # that writer is gone: the empty folder goes
    assert not run_dir.exists()


def test_a_writer_still_ending_is_waited_for_not_taken_for_gone(tmp_path: Path) -> None:
    """The CI failure of stop 52: the stopper saw the ServerApp's leader thread as a zombie,
    called it gone, and tried the lock once while the last threads still held it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", EXITING_HOLDER, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "locked\n"
        deadline = time.monotonic() + 60
        while Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the main thread did not end"
            time.sleep(0.05)
        states = {info.pid: info.state for info, _ in _processes()}
        assert states[proc.pid] == "exiting"  # not "Z": a stopper waits for it
        runlock.release_stopped(run_dir, wait=0.2)
        assert (run_dir / LOCK_FILE).exists()  # still held: left alone
        proc.stdin.write("\n")  # its last thread ends the process
        proc.stdin.flush()
        runlock.release_stopped(run_dir, wait=60)  # waits for the lock, then removes it
        assert not (run_dir / LOCK_FILE).exists()
    finally:
        proc.kill()
        proc.wait()
