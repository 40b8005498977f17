"""Run folders against planted links (docs/reference/service-limits.md): each file EdgeFleet
writes or reads in a run folder, replaced by a symbolic link (or a FIFO) before the writer
runs, is refused with :class:`~edgefleet.fileio.NotARegularFile` and the link's target is left
as it was; a new run starts only in a folder it made itself (or an empty one of its user's)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgefleet import runlock
from edgefleet.config import parse_run_config
from edgefleet.fileio import NotARegularFile, atomic_write_text, open_append, read_regular
from edgefleet.loop.roundloop import RoundResult
from edgefleet.server import fleet as fleet_module
from edgefleet.server.checkpoint import FILENAME as CHECKPOINT
from edgefleet.server.checkpoint import Checkpoint, save_checkpoint
from edgefleet.server.results import MetricsWriter, RunDirError, prepare_run_dir
from tests.fakes import rec

PRECIOUS = "the operator's own file\n"


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """What a planted link points at: a file the run must never write."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text(PRECIOUS)
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    return run


def _result() -> RoundResult:
    return RoundResult(1, 1, rec(w=np.zeros(2)), ["a"], [], [], 10, 20, 1.0, {}, {}, 0.5)


def _metrics_row(run_dir: Path) -> None:
    MetricsWriter(run_dir).after_round(_result())


def _batteries(run_dir: Path) -> None:
    fleet_module.FleetWriter(run_dir).after_round(_result())


def _fleet_json(run_dir: Path) -> None:
    fleet_module.FleetWriter(run_dir).after_round(_result())


def _lock(run_dir: Path) -> None:
    try:
        runlock.acquire(run_dir)
    finally:
        runlock.release(run_dir)


def _lock_check(run_dir: Path) -> None:
    runlock.check(run_dir)


def _flower_log(run_dir: Path) -> None:
    from edgefleet.simulation.inprocess import _write_log

    log = run_dir.parent / "serverapp.log"
    log.write_text("round 1\n")
    _write_log(run_dir, log, "test")


def _checkpoint(run_dir: Path) -> None:
    save_checkpoint(run_dir / CHECKPOINT, Checkpoint(1, {"w": np.zeros(2)}, {}, None))


def _summary(run_dir: Path) -> None:
    atomic_write_text(run_dir / "summary.json", "{}\n")


WRITERS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "writer.lock (acquire)": (runlock.LOCK_FILE, _lock),
    "writer.lock (check)": (runlock.LOCK_FILE, _lock_check),
    "metrics.jsonl": ("metrics.jsonl", _metrics_row),
    "batteries.jsonl": ("batteries.jsonl", _batteries),
    "fleet.json": ("fleet.json", _fleet_json),
    "flower.log": ("flower.log", _flower_log),
    "checkpoint": (CHECKPOINT, _checkpoint),
    "summary.json": ("summary.json", _summary),
}


@pytest.fixture(autouse=True)
def _a_battery_to_append(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet writer appends a batteries line only when a device reported a battery.
    real = fleet_module.snapshot

    def with_battery(result: RoundResult, tau: float | None = None) -> dict:
        snap = real(result, tau)
        snap["devices"] = [{"device": "a", "battery": 3.0}]
        return snap

    monkeypatch.setattr(fleet_module, "snapshot", with_battery)


@pytest.mark.parametrize("case", list(WRITERS))
def test_a_planted_link_is_refused_and_its_target_untouched(
    case: str, run_dir: Path, target: Path
) -> None:
    name, write = WRITERS[case]
    (run_dir / name).symlink_to(target)
    with pytest.raises(NotARegularFile, match=f"{name} is a symbolic link .*not a regular file"):
        write(run_dir)
    assert target.read_text() == PRECIOUS
    assert (run_dir / name).is_symlink()  # found as it was, for the operator to look at


@pytest.mark.parametrize("case", list(WRITERS))
def test_each_writer_writes_a_regular_file(case: str, run_dir: Path) -> None:
    name, write = WRITERS[case]
    write(run_dir)
    write(run_dir)  # again: appended, replaced or re-locked in place
    if case.startswith("writer.lock"):
        assert not (run_dir / name).exists()  # released
    else:
        assert (run_dir / name).is_file() and not (run_dir / name).is_symlink()


def test_a_link_to_a_missing_target_is_not_created_through(run_dir: Path, tmp_path: Path) -> None:
    # O_CREAT through a dangling link would create its target (say ~/.ssh/authorized_keys).
    dangling = tmp_path / "elsewhere" / "new-file"
    (run_dir / "batteries.jsonl").symlink_to(dangling)
    with pytest.raises(NotARegularFile):
        open_append(run_dir / "batteries.jsonl")
    (run_dir / runlock.LOCK_FILE).symlink_to(dangling)
    with pytest.raises(NotARegularFile):
        runlock.acquire(run_dir)
    assert not dangling.exists()


def test_a_fifo_is_refused_without_blocking(run_dir: Path) -> None:
    # Opening a FIFO to write blocks until a reader comes; to read, until a writer does.
    fifo = run_dir / "batteries.jsonl"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def write_then_read() -> None:
        try:
            with pytest.raises(NotARegularFile, match="is a FIFO"):
                open_append(fifo)
            with pytest.raises(NotARegularFile, match="is a FIFO"):
                read_regular(fifo)
            outcome.append(None)
        except BaseException as err:  # reported below, in the test's thread
            outcome.append(err)

    worker = threading.Thread(target=write_then_read, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "opening the FIFO blocked"
    assert outcome == [None], outcome


def test_the_dashboard_reads_no_link(run_dir: Path, target: Path) -> None:
    from starlette.testclient import TestClient

    from edgefleet.dashboard.app import create_app

    secret = {"devices": [], "round": 99, "secret": "from elsewhere"}
    target.write_text(json.dumps(secret))
    (run_dir / "fleet.json").symlink_to(target)
    (run_dir / "summary.json").symlink_to(target)
    client = TestClient(create_app(run_dir), base_url="http://127.0.0.1:8050")
    assert client.get("/api/fleet").json() == {}
    assert client.get("/api/summary").json()["summary"] == {}
    assert "edgefleet_round " not in client.get("/metrics").text


# --- new run folders ---------------------------------------------------------------------------


def _cfg(output: Path, name: str = "r", **extra: object) -> object:
    return parse_run_config({"output-dir": str(output), "run-name": name, **extra})


def test_a_new_run_makes_its_folder(tmp_path: Path) -> None:
    run_dir = prepare_run_dir(_cfg(tmp_path / "out"), lock=False)  # type: ignore[arg-type]
    assert run_dir.is_dir() and not run_dir.is_symlink()
    # The ServerApp prepares it again (edgefleet run made it first): empty, its own: taken.
    assert prepare_run_dir(_cfg(tmp_path / "out")) == run_dir  # type: ignore[arg-type]
    runlock.release(run_dir)


def test_a_new_run_refuses_a_folder_with_planted_files(tmp_path: Path, target: Path) -> None:
    run_dir = tmp_path / "out" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "flower.log").symlink_to(target)
    with pytest.raises(RunDirError, match="already holds flower.log.*new folder.*--resume"):
        prepare_run_dir(_cfg(tmp_path / "out"))  # type: ignore[arg-type]
    assert target.read_text() == PRECIOUS


def test_a_new_run_refuses_a_linked_folder(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere-dir").mkdir()
    (tmp_path / "out" / "r").symlink_to(tmp_path / "elsewhere-dir")
    with pytest.raises(RunDirError, match="is a symbolic link"):
        prepare_run_dir(_cfg(tmp_path / "out"))  # type: ignore[arg-type]
    assert list((tmp_path / "elsewhere-dir").iterdir()) == []


def test_a_run_refuses_a_planted_lock_before_it_starts(tmp_path: Path, target: Path) -> None:
    # `edgefleet run` checks the folder's lock before any process starts: the planted link is
    # a clear ConfigError, not a traceback from inside the ServerApp.
    from edgefleet.config import ConfigError
    from edgefleet.simulation.inprocess import InProcessEngine
    from edgefleet.simulation.runner import load_scenario

    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "out" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / runlock.LOCK_FILE).symlink_to(target)
    scenario = load_scenario(
        root / "scenarios" / "fedavg.toml", {"output-dir": str(tmp_path / "out"), "run-name": "r"}
    )
    engine = InProcessEngine(workers=1)
    with pytest.raises(ConfigError, match="writer.lock is a symbolic link"):
        engine.run(scenario, timeout=60)
    assert not engine.started  # no worker was forked
    assert target.read_text() == PRECIOUS


def test_the_latest_run_is_never_a_link(tmp_path: Path) -> None:
    from edgefleet.dashboard.data import latest_run

    runs = tmp_path / "runs"
    (runs / "real").mkdir(parents=True)
    (runs / "real" / "fleet.json").write_text("{}")
    os.utime(runs / "real" / "fleet.json", (1_000, 1_000))
    os.utime(runs / "real", (1_000, 1_000))
    elsewhere = tmp_path / "elsewhere-run"
    elsewhere.mkdir()
    (elsewhere / "fleet.json").write_text('{"secret": 1}')  # newer than the real run
    (runs / "planted").symlink_to(elsewhere)
    assert latest_run(runs) == runs / "real"
