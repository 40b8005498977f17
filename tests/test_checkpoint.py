"""Checkpoint and resume: file round trip, strategy state, and a resumed simulation."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord

from edgefleet.server.checkpoint import (
    FILENAME,
    Checkpoint,
    Checkpointer,
    CheckpointError,
    load_checkpoint,
    resume_from,
    save_checkpoint,
)
from edgefleet.server.results import MetricsWriter
from edgefleet.simulation.runner import load_scenario, run_scenario
from edgefleet.strategies.energy import EnergyAgeSelection
from edgefleet.strategies.fedsag import FedSAG
from edgefleet.strategies.loop import RoundLoop
from edgefleet.strategies.stopping import TaskVectorStopping
from tests.fakes import FakeGrid, no_eval, rec
from tests.test_ehfedsag import KW, FakeDevice

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / FILENAME
    ckpt = Checkpoint(3, {"w": np.arange(4, dtype=np.float32)}, {"a": [1, 2]}, random.getstate())
    save_checkpoint(path, ckpt)
    back = load_checkpoint(path)
    assert back.round == 3 and back.strategy == {"a": [1, 2]}
    np.testing.assert_array_equal(back.arrays["w"], ckpt.arrays["w"])
    assert back.arrays["w"].dtype == np.float32
    assert not (tmp_path / (FILENAME + ".tmp")).exists()
    path.write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pkl")


def test_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / FILENAME, Checkpoint(1, {"w": np.zeros(1)}, {}, random.getstate()))
    with pytest.raises(CheckpointError, match="another model"):
        resume_from(tmp_path, FedSAG(**KW), ["conv.weight"])


def _fleet() -> FakeGrid:
    # Feasibility changes from round to round, so selection, ages and SAGA memory all matter.
    plans = [[True, False, True, True], [True, True, False, True], [False, True, True, True]]
    devices = {n: FakeDevice(n - 1, float(n), plans[n % 3]) for n in range(1, 6)}
    return FakeGrid(devices)  # type: ignore[arg-type]


def _strategy() -> TaskVectorStopping:
    inner = EnergyAgeSelection(FedSAG(server_lr=0.7, **KW), max_devices=2, slots_per_round=4)
    return TaskVectorStopping(inner, tau=0.0, patience=50)


def _run(strategy, arrays, first: int, last: int, run_dir: Path) -> ArrayRecord:
    run_dir.mkdir(exist_ok=True)
    loop = RoundLoop(
        strategy,
        _fleet(),  # type: ignore[arg-type]
        evaluate_fn=no_eval,
        callbacks=[*strategy.round_callbacks(), Checkpointer(run_dir, strategy)],
    )
    return loop.run(arrays, last, ConfigRecord(), first_round=first).arrays


def test_resumed_loop_equals_uninterrupted(tmp_path: Path) -> None:
    """EH-FedSAG with stopping: 4 rounds in one go == 2 rounds, a new server, 2 more."""
    start = rec(w=np.zeros(3))
    random.seed(0)
    whole = _run(_strategy(), start, 1, 4, tmp_path / "a")
    random.seed(0)
    _run(_strategy(), start, 1, 2, tmp_path / "b")
    random.seed(12345)  # the resumed server starts with another global RNG state
    fresh = _strategy()
    ckpt = resume_from(tmp_path / "b", fresh, ["w"])
    assert ckpt is not None and ckpt.round == 2
    resumed = _run(fresh, ckpt.array_record(), 3, 4, tmp_path / "b")
    np.testing.assert_array_equal(resumed["w"].numpy(), whole["w"].numpy())
    a, b = load_checkpoint(tmp_path / "a" / FILENAME), load_checkpoint(tmp_path / "b" / FILENAME)
    assert a.round == b.round == 4
    assert a.strategy["inner"]["ages"] == b.strategy["inner"]["ages"]
    assert a.strategy["rule"] == b.strategy["rule"]


def test_metrics_writer_drops_rounds_after_the_checkpoint(tmp_path: Path) -> None:
    rows = [{"round": r, "test_accuracy": r / 10} for r in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    writer = MetricsWriter(tmp_path)
    writer.keep_until(2)
    assert [r["round"] for r in writer.rows] == [1, 2]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2]


@pytest.mark.timeout(400)
def test_resumed_simulation_ends_with_the_same_model(tmp_path: Path, monkeypatch) -> None:
    """A seeded run killed after round 2 (its summary never written) and resumed ends with
    the model of an uninterrupted 3-round run."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    def run(name: str, rounds: int, resume: bool = False) -> Path:
        overrides = {
            "federation.num-supernodes": 3,
            "num-server-rounds": rounds,
            "local-steps": 5,
            "output-dir": str(tmp_path),
            "run-name": name,
            "resume": resume,
        }
        scenario = load_scenario(ROOT / "scenarios" / "fedavg.toml", overrides)
        return run_scenario(scenario, timeout=200, quiet=True)

    whole = run("whole", 3)
    part = run("part", 2)
    (part / "summary.json").unlink()  # as if the ServerApp had died after round 2
    run("part", 3, resume=True)
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    a, b = load_checkpoint(whole / FILENAME), load_checkpoint(part / FILENAME)
    assert a.round == b.round == 3
    for key, value in a.arrays.items():
        np.testing.assert_allclose(b.arrays[key], value, rtol=1e-6, atol=1e-7)
    assert json.loads((part / "summary.json").read_text())["rounds_run"] == 3


def test_array_record_from_checkpoint() -> None:
    ckpt = Checkpoint(1, {"w": np.ones(2, dtype=np.float32)}, {}, None)
    rec = ckpt.array_record()
    assert isinstance(rec["w"], Array) and rec["w"].numpy().tolist() == [1.0, 1.0]
