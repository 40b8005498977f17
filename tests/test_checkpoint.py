"""Checkpoint and resume: file round trip, strategy state, and a resumed simulation."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord

from edgefleet.config import ConfigError, parse_run_config
from edgefleet.loop.roundloop import RoundCallback, RoundLoop, RoundResult
from edgefleet.server import checkpoint as ckpt_module
from edgefleet.server.app import build_strategy
from edgefleet.server.checkpoint import (
    FILENAME,
    LEGACY_FILENAME,
    Checkpoint,
    Checkpointer,
    CheckpointError,
    ResumeError,
    apply_checkpoint,
    check_resumable,
    dumps,
    load_checkpoint,
    loads,
    run_identity,
    save_checkpoint,
)
from edgefleet.server.results import MetricsWriter, RunDirError, prepare_run_dir
from edgefleet.simulation.inprocess import InProcessEngine
from edgefleet.simulation.runner import load_scenario, run_scenario
from edgefleet.strategies.energy_selection import EnergyAgeSelection
from edgefleet.strategies.fedsag import FedSAG
from edgefleet.strategies.stopping import TaskVectorStopping
from tests.fakes import FakeGrid, no_eval, rec
from tests.test_ehfedsag import KW, FakeDevice
from tests.test_hostile_replies import W0, honest_reply

ROOT = Path(__file__).resolve().parents[1]


def resume_from(run_dir: Path, strategy: Any, keys: list[str]) -> Checkpoint | None:
    """``run_dir``'s checkpoint loaded into ``strategy`` (None: there is none), as the
    ServerApp resumes a run."""
    path = run_dir / FILENAME
    if not path.exists():
        return None
    ckpt = load_checkpoint(path)
    apply_checkpoint(ckpt, strategy, keys)
    return ckpt


def test_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / FILENAME
    ckpt = Checkpoint(3, {"w": np.arange(4, dtype=np.float32)}, {"a": [1, 2]}, random.getstate())
    save_checkpoint(path, ckpt)
    back = load_checkpoint(path)
    assert back.round == 3 and back.strategy == {"a": [1, 2]}
    np.testing.assert_array_equal(back.arrays["w"], ckpt.arrays["w"])
    assert back.arrays["w"].dtype == np.float32
    assert back.py_random == random.getstate()  # a tuple again, as random.setstate needs
    assert [p.name for p in tmp_path.iterdir()] == [FILENAME]  # no temporary file left
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not an EdgeFleet checkpoint"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.npz")


def test_every_kind_of_state_value_round_trips() -> None:
    """What strategies put in their state: nested dicts and lists, tuples (Python's RNG),
    NumPy arrays of every dtype, NumPy scalars, None, -inf (ValidationStopping's start),
    big ints (NumPy's PCG64 state)."""
    rng = np.random.default_rng(3)
    state = {
        "table": rng.normal(size=(3, 5)).astype(np.float32),
        "sum": rng.normal(size=5),
        "counts": np.arange(4, dtype=np.int64),
        "mask": np.array([True, False]),
        "ids": np.array(["a", "bc"]),
        "nested": {"theta0": {"w": np.ones((2, 2))}, "none": None, "list": [1, 2.5, "x"]},
        "best": -math.inf,
        "scalar": np.float64(0.25),
        "rng": rng.bit_generator.state,
        "tuple": (1, (2, 3), None),
    }
    back = loads(dumps(Checkpoint(1, {}, state, random.getstate()))).strategy
    assert (
        back["best"] == -math.inf and back["scalar"] == 0.25 and back["tuple"] == (1, (2, 3), None)
    )
    assert back["nested"]["none"] is None and back["nested"]["list"] == [1, 2.5, "x"]
    assert back["rng"] == rng.bit_generator.state
    for key in ("table", "sum", "counts", "mask", "ids"):
        np.testing.assert_array_equal(back[key], state[key])
        assert back[key].dtype == state[key].dtype, key
    np.testing.assert_array_equal(back["nested"]["theta0"]["w"], np.ones((2, 2)))


def test_state_that_cannot_be_stored_without_pickle_is_refused_at_save() -> None:
    for bad in ({"x": object()}, {1: "int key"}, {"x": np.array([object()])}):
        with pytest.raises(CheckpointError, match="cannot store"):
            dumps(Checkpoint(1, {}, bad, None))  # type: ignore[arg-type]


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / FILENAME
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
    save_checkpoint(path, Checkpoint(4, arrays, {"m": np.ones(3)}, random.getstate()))
    return path


def _rewrite(path: Path, change) -> None:
    """Rewrite one member of the checkpoint archive, keeping the others as they were."""
    with zipfile.ZipFile(path) as z:
        members = {name: z.read(name) for name in z.namelist()}
    change(members)
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value, allow_pickle=False)
    return buf.getvalue()


def test_an_altered_checkpoint_fails_its_checksum(tmp_path: Path) -> None:
    path = _saved(tmp_path)

    def model(members):  # a weight changed, its npy header intact
        members["m0.npy"] = _npy(np.full((2, 3), 9.0, np.float32))

    def meta(members):  # the round number edited in the JSON
        raw = (
            np.load(io.BytesIO(members["meta.npy"])).tobytes().replace(b'"round": 4', b'"round": 9')
        )
        members["meta.npy"] = _npy(np.frombuffer(raw, np.uint8))

    for change in (model, meta):
        original = path.read_bytes()
        _rewrite(path, change)
        with pytest.raises(CheckpointError, match="fails its checksum"):
            load_checkpoint(path)
        path.write_bytes(original)
    load_checkpoint(path)  # the original still loads
    path.write_bytes(path.read_bytes()[:-100])  # truncated
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


class _Payload:
    """What an attacker plants in a pickle: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_loading_never_unpickles_a_crafted_payload(tmp_path: Path) -> None:
    """A pickle that runs a shell command when loaded: as the old checkpoint.pkl, renamed
    to checkpoint.npz, and hidden inside the archive as an object array. Nothing runs."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"format": 1, "checkpoint": _Payload(marker)})
    pickle.loads(pickle.dumps(_Payload(tmp_path / "control")))  # the payload is live:
    assert (tmp_path / "control").exists()  # unpickling it does run the command
    run = tmp_path / "run"
    run.mkdir()
    (run / LEGACY_FILENAME).write_bytes(payload)
    cfg = parse_run_config({"output-dir": str(tmp_path), "run-name": "run", "resume": True})
    with pytest.raises(ResumeError, match="not loaded, because unpickling"):
        check_resumable(cfg, run)
    (run / FILENAME).write_bytes(payload)
    with pytest.raises(CheckpointError, match="not an EdgeFleet checkpoint"):
        load_checkpoint(run / FILENAME)
    path = _saved(tmp_path)
    obj = np.empty(1, dtype=object)
    obj[0] = _Payload(marker)
    buf = io.BytesIO()
    np.save(buf, obj, allow_pickle=True)

    def plant(members):
        members["s0.npy"] = buf.getvalue()

    _rewrite(path, plant)
    with pytest.raises(CheckpointError, match="not an EdgeFleet checkpoint"):
        load_checkpoint(path)
    assert not marker.exists()


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


def test_a_resumed_runs_rows_count_the_time_of_the_parts_before_it(tmp_path: Path) -> None:
    """The resumed loop's clock starts at zero; its rows (and the summary, from
    ``wall_offset``) go on from the kept rows' time instead of counting the last part only."""
    rows = [{"round": r, "wall_s": 10.0 * r} for r in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    writer = MetricsWriter(tmp_path)
    writer.keep_until(2)
    assert writer.wall_offset == 20.0
    writer.after_round(RoundResult(3, 0, rec(w=np.zeros(1)), [], [], [], 0, 0, 0.0, {}, {}, 4.5))
    assert writer.rows[-1]["wall_s"] == 24.5
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["wall_s"] == 24.5


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
            # the resumed run asks for 3 rounds where the killed one had 2
            "resume-changes": "num-server-rounds" if resume else "",
        }
        scenario = load_scenario(ROOT / "scenarios" / "fedavg.toml", overrides)
        # The in-process engine runs the same ServerApp and ClientApp: resuming is the
        # ServerApp's work, not the engine's (tests/test_deployment_resume.py resumes on
        # Flower's Deployment Engine), and it spares this test three Ray starts.
        return run_scenario(scenario, timeout=200, quiet=True, engine=InProcessEngine(workers=1))

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


@pytest.mark.timeout(600)
def test_a_resume_on_another_fleet_stops_with_the_reason(tmp_path: Path, monkeypatch) -> None:
    """The newcomer's case: a run of 3 devices, resumed on a fleet of 5, used to go on
    (accuracy jumped); the server's census now stops it before the resumed first round."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    def run(devices: int, rounds: int, resume: bool = False) -> Path:
        overrides = {
            "federation.num-supernodes": devices,
            "num-server-rounds": rounds,
            "local-steps": 3,
            "output-dir": str(tmp_path),
            "run-name": "r",
            "resume": resume,
            "resume-changes": "num-server-rounds" if resume else "",
        }
        scenario = load_scenario(ROOT / "scenarios" / "fedavg.toml", overrides)
        return run_scenario(scenario, timeout=240, quiet=True, engine=InProcessEngine(workers=1))

    part = run(3, 2)
    (part / "summary.json").unlink()  # as if the ServerApp had died after round 2
    with pytest.raises(Exception, match="checkpointed on a fleet of 3 partitions"):
        run(5, 3, resume=True)
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]  # nothing of the other fleet was written


def test_array_record_from_checkpoint() -> None:
    ckpt = Checkpoint(1, {"w": np.ones(2, dtype=np.float32)}, {}, None)
    rec = ckpt.array_record()
    assert isinstance(rec["w"], Array) and rec["w"].numpy().tolist() == [1.0, 1.0]


# -- resume: the same run or a clear refusal ------------------------------------------------


def _checkpointed_run(tmp_path: Path, rounds_done: int = 2, **config) -> Path:
    """A run folder as a killed server leaves it: rows and a checkpoint of round 2."""
    cfg = parse_run_config({"output-dir": str(tmp_path), "run-name": "r", **config})
    run_dir = prepare_run_dir(cfg)
    writer = MetricsWriter(run_dir)
    grid = FakeGrid({d + 1: (lambda m, d=d: honest_reply(m, d)) for d in range(3)})
    strategy = build_strategy(cfg)
    checkpointer = Checkpointer(run_dir, strategy, run_identity(cfg))
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=[writer, checkpointer])  # type: ignore[arg-type]
    checkpointer.loop_state = loop.state_dict
    loop.run(rec(W0), rounds_done)
    return run_dir


def _resume(tmp_path: Path, **config):
    cfg = parse_run_config({"output-dir": str(tmp_path), "run-name": "r", "resume": True, **config})
    return check_resumable(cfg, tmp_path / "r")


def test_resume_refuses_another_run_naming_the_keys(tmp_path: Path) -> None:
    _checkpointed_run(tmp_path, **{"num-server-rounds": 4})
    assert _resume(tmp_path, **{"num-server-rounds": 4}).round == 2
    # Where results go and how long to wait are not the run's identity.
    _resume(tmp_path, **{"num-server-rounds": 4, "round-timeout": 5.0, "min-nodes": 1})
    with pytest.raises(ResumeError, match="dataset: 'mnist-5k' -> 'mnist'; seed: 0 -> 1"):
        _resume(tmp_path, **{"num-server-rounds": 4, "dataset": "mnist", "seed": 1})
    with pytest.raises(ResumeError, match="strategy: 'fedavg' -> 'fedsag'"):
        _resume(tmp_path, **{"num-server-rounds": 4, "strategy": "fedsag"})
    with pytest.raises(ResumeError, match="num-server-rounds: 4 -> 6.*name it in resume-changes"):
        _resume(tmp_path, **{"num-server-rounds": 6})
    ok = _resume(tmp_path, **{"num-server-rounds": 6, "resume-changes": "num-server-rounds"})
    assert ok.round == 2
    with pytest.raises(ConfigError, match="only these may change on resume"):
        parse_run_config({"resume-changes": "dataset"})


def test_resume_of_a_finished_run_needs_more_rounds(tmp_path: Path) -> None:
    run_dir = _checkpointed_run(tmp_path, **{"num-server-rounds": 2})
    (run_dir / "summary.json").write_text("{}")
    with pytest.raises(ResumeError, match=r"has finished \(round 2 of 2\).*num-server-rounds > 2"):
        _resume(tmp_path, **{"num-server-rounds": 2})
    more = {"num-server-rounds": 3, "resume-changes": "num-server-rounds"}
    assert _resume(tmp_path, **more).round == 2


def test_resume_refuses_rows_without_checkpoint_and_a_missing_run(tmp_path: Path) -> None:
    run_dir = _checkpointed_run(tmp_path)
    (run_dir / FILENAME).unlink()
    with pytest.raises(ResumeError, match="rows in .* but no checkpoint: continuing would repeat"):
        _resume(tmp_path)
    (tmp_path / "other").mkdir()
    cfg = parse_run_config({"output-dir": str(tmp_path), "run-name": "typo", "resume": True})
    with pytest.raises(
        ResumeError, match="no run 'typo' with a finished round .*runs there: other, r"
    ):
        prepare_run_dir(cfg)
    assert not (tmp_path / "typo").exists()  # a refused resume creates nothing


def test_a_cut_short_last_row_is_dropped_with_a_warning(tmp_path: Path, caplog) -> None:
    run_dir = _checkpointed_run(tmp_path, **{"num-server-rounds": 4})
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"round": 3, "test_acc')  # the server died while writing round 3's row
    writer = MetricsWriter(run_dir)
    writer.keep_until(_resume(tmp_path, **{"num-server-rounds": 4}).round)
    assert [r["round"] for r in writer.rows] == [1, 2]
    assert "dropping its last row, which is incomplete" in caplog.text
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2]
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\nnot json\n{"round": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not a metrics row"):
        MetricsWriter(run_dir).keep_until(2)


def test_device_bindings_are_in_the_checkpoint(tmp_path: Path) -> None:
    run_dir = _checkpointed_run(tmp_path)
    loop_state = load_checkpoint(run_dir / FILENAME).loop
    devices = loop_state["registry"]["devices"]
    assert {d: r["node"] for d, r in devices.items()} == {"0": 1, "1": 2, "2": 3}
    assert all(r["participations"] == 2 for r in devices.values())
    assert len(loop_state["norm_history"]) == 2


def test_an_unusable_output_dir_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for out, why in ((tmp_path / "file", "is a file, not a folder"),
                     (tmp_path / "file" / "sub", "is a file, not a folder")):  # fmt: skip
        cfg = parse_run_config({"output-dir": str(out), "run-name": "r"})
        with pytest.raises(
            RunDirError, match=f"output-dir .* cannot hold the run folder 'r': .*{why}"
        ):
            prepare_run_dir(cfg)


def test_resume_preflight_refuses_before_flower_starts(tmp_path: Path) -> None:
    """`edgefleet run --resume` with another data set stops before any Flower process."""
    _checkpointed_run(tmp_path)
    overrides = {"output-dir": str(tmp_path), "run-name": "r", "resume": True, "dataset": "mnist"}
    scenario = load_scenario(ROOT / "scenarios" / "fedavg.toml", overrides)
    with pytest.raises(ConfigError, match="dataset: 'mnist-5k' -> 'mnist'"):
        run_scenario(scenario, timeout=30, quiet=True)


# -- a failing aggregation: the round is dropped, nothing non-finite is checkpointed ---------


def test_a_nan_or_failing_aggregation_is_rolled_back_and_never_checkpointed(tmp_path: Path) -> None:
    """EdgeFleet's server stack, metrics writer and checkpointer: the aggregator returns a
    NaN model in round 2 and raises in round 3. Both rounds are dropped with the reason in
    the row; the checkpoint after each holds round 1's model."""
    cfg = parse_run_config({"output-dir": str(tmp_path), "run-name": "r"})
    run_dir = prepare_run_dir(cfg)
    strategy = build_strategy(cfg)
    inner = strategy.inner  # type: ignore[attr-defined]  # Flower's FedAvg
    real = inner.aggregate_train
    checkpoints: list[Checkpoint] = []

    def flaky(rnd, replies):
        arrays, metrics = real(rnd, replies)
        if rnd == 2:
            arrays = ArrayRecord(
                {k: Array(np.full_like(v.numpy(), np.nan)) for k, v in arrays.items()}
            )
        if rnd == 3:
            raise ZeroDivisionError("a bug in the aggregator")
        return arrays, metrics

    inner.aggregate_train = flaky

    class Read(RoundCallback):
        def after_round(self, result):
            checkpoints.append(load_checkpoint(run_dir / FILENAME))
            return None

    writer = MetricsWriter(run_dir)
    grid = FakeGrid({d + 1: (lambda m, d=d: honest_reply(m, d)) for d in range(3)})
    callbacks = [writer, Checkpointer(run_dir, strategy, run_identity(cfg)), Read()]
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=callbacks)  # type: ignore[arg-type]
    out = loop.run(rec(W0), 4)
    rows = writer.rows
    assert "round_dropped" not in rows[0] and "round_dropped" not in rows[3]
    assert "non-finite values" in rows[1]["round_dropped"]
    assert "ZeroDivisionError: a bug in the aggregator" in rows[2]["round_dropped"]
    assert rows[1]["participants"] == rows[2]["participants"] == []
    after_1 = checkpoints[0].arrays
    for ckpt in checkpoints[1:3]:
        for key, value in after_1.items():
            np.testing.assert_array_equal(ckpt.arrays[key], value)
    for ckpt in checkpoints:
        assert all(np.isfinite(v).all() for v in ckpt.arrays.values())
    assert all(np.isfinite(v.numpy()).all() for v in out.arrays.values())


def test_serverapp_extends_a_finished_run_only_when_told(tmp_path: Path) -> None:
    """EdgeFleet's ServerApp main(), in-process over the real ClientApp: a finished 2-round
    run resumed as it was is refused, with 3 rounds it is refused until resume-changes
    names num-server-rounds, then round 3 runs and the rows read 1, 2, 3."""
    from flwr.app import Context, MessageType, RecordDict

    from edgefleet.client.app import status, train
    from edgefleet.server.app import main

    def serve(**config: object) -> list[int]:
        run_config = {
            "output-dir": str(tmp_path), "run-name": "main", "local-steps": 2,
            "batch-size": 16, "min-nodes": 3, "eval-samples": 200, **config,
        }  # fmt: skip

        def device(p: int):
            node = {"partition-id": p, "num-partitions": 3}
            ctx = Context(run_id=1, node_id=p + 1, node_config=node, state=RecordDict(),
                          run_config=run_config)  # fmt: skip
            # The ServerApp's census before round 1 asks every node for its status.
            return lambda msg: (
                status(msg, ctx) if msg.metadata.message_type == MessageType.QUERY
                else train(msg, ctx)
            )  # fmt: skip

        grid = FakeGrid({p + 1: device(p) for p in range(3)})
        server = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                         run_config=run_config)  # fmt: skip
        main(grid, server)  # type: ignore[arg-type]
        rows = (tmp_path / "main" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["round"] for x in rows]

    assert serve(**{"num-server-rounds": 2}) == [1, 2]
    with pytest.raises(ResumeError, match="has finished"):
        serve(**{"num-server-rounds": 2, "resume": True})
    with pytest.raises(ResumeError, match="num-server-rounds: 2 -> 3"):
        serve(**{"num-server-rounds": 3, "resume": True})
    more = {"num-server-rounds": 3, "resume": True, "resume-changes": "num-server-rounds"}
    assert serve(**more) == [1, 2, 3]
    summary = json.loads((tmp_path / "main" / "summary.json").read_text())
    assert summary["rounds_run"] == 3
    assert load_checkpoint(tmp_path / "main" / FILENAME).round == 3


class _Fleet:
    """A grid whose online nodes follow a schedule on a fake clock."""

    def __init__(self, schedule: list[tuple[float, int]]) -> None:
        self.now = 0.0
        self.schedule = schedule  # (from time t, n nodes online)

    def get_node_ids(self) -> list[int]:
        n = max((k for t, k in self.schedule if t <= self.now), default=0)
        return list(range(n))

    def sleep(self, s: float) -> None:
        self.now += s

    def wait(self, wanted: int, timeout: float, settle: float | None = None) -> int:
        from edgefleet.server.app import wait_for_nodes

        grid: Any = self
        return wait_for_nodes(
            grid, wanted, timeout, settle, clock=lambda: self.now, sleep=self.sleep
        )


def test_a_resumed_run_goes_on_once_the_fleet_stops_growing() -> None:
    from edgefleet.server.app import RESUME_SETTLE_S

    # 3 of 4 nodes come back after a restart, one by one; the fourth is away for good.
    schedule = [(0.0, 1), (4.0, 2), (9.0, 3)]
    fleet = _Fleet(schedule)
    assert fleet.wait(4, 120.0, RESUME_SETTLE_S) == 3
    assert 9.0 + RESUME_SETTLE_S <= fleet.now < 9.0 + RESUME_SETTLE_S + 1.5
    # A new run waits for min-nodes the whole node-wait-timeout.
    fleet = _Fleet(schedule)
    assert fleet.wait(4, 120.0) == 3 and fleet.now >= 120.0
    # The whole fleet back: no settling needed.
    fleet = _Fleet(schedule + [(12.0, 4)])
    assert fleet.wait(4, 120.0, RESUME_SETTLE_S) == 4 and fleet.now < 13.5
    # Nobody at all: settling never starts, and the wait ends in the error.
    with pytest.raises(RuntimeError, match="no node came online"):
        _Fleet([]).wait(4, 30.0, RESUME_SETTLE_S)


# -- malformed files: each a CheckpointError with its reason, never a traceback -------------


def _zip_bytes(members: dict[str, bytes], deflated: str = "") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            method = zipfile.ZIP_DEFLATED if name == deflated else zipfile.ZIP_STORED
            z.writestr(name, data, compress_type=method)
    return buf.getvalue()


def _members(tmp_path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(_saved(tmp_path)) as z:
        return {name: z.read(name) for name in z.namelist()}


def _patch_member(data: bytes, name: str, **fields: int) -> bytes:
    """``data`` with the local and central headers of member ``name`` altered: ``flags``
    (offset 6 / 8) and ``method`` (offset 8 / 10), as a crafted file would have them."""
    out = bytearray(data)
    at = {"flags": (6, 8), "method": (8, 10)}
    for sig, which in ((b"PK\x03\x04", 0), (b"PK\x01\x02", 1)):
        start = 0
        while (start := out.find(sig, start)) >= 0:
            name_at = start + (30 if which == 0 else 46)
            if out[name_at : name_at + len(name)] == name.encode():
                for field_name, value in fields.items():
                    offset = start + at[field_name][which]
                    out[offset : offset + 2] = value.to_bytes(2, "little")
            start += 4
    return bytes(out)


def _meta_nested(depth: int) -> bytes:
    return b'{"format": 4, "x": ' + b"[" * depth + b"]" * depth + b"}"


def test_an_encrypted_member_is_a_checkpoint_error(tmp_path: Path) -> None:
    data = _patch_member(_zip_bytes(_members(tmp_path)), "m0.npy", flags=0x1)
    with pytest.raises(CheckpointError, match="'m0.npy' is encrypted"):
        loads(data)


def test_an_unknown_compression_method_is_a_checkpoint_error(tmp_path: Path) -> None:
    data = _patch_member(_zip_bytes(_members(tmp_path)), "meta.npy", method=99)
    with pytest.raises(CheckpointError, match=r"'meta.npy' is compressed \(method 99\)"):
        loads(data)


def test_a_corrupt_deflate_stream_is_a_checkpoint_error(tmp_path: Path) -> None:
    data = bytearray(_zip_bytes(_members(tmp_path), deflated="s0.npy"))
    start = data.index(b"s0.npy") + len(b"s0.npy")
    data[start + 2 : start + 40] = b"\xff" * 38  # the member's deflate stream, wrecked
    with pytest.raises(CheckpointError, match=r"'s0.npy' is compressed \(method 8\)"):
        loads(bytes(data))


def test_a_header_declaring_1e13_elements_is_refused_before_allocation(tmp_path: Path) -> None:
    members = _members(tmp_path)
    header = np.lib.format.header_data_from_array_1_0(np.zeros(3, np.float32))
    header["shape"] = (10**13,)
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    members["m0.npy"] = buf.getvalue() + b"\0" * 12
    with pytest.raises(CheckpointError, match=r"declares 10000000000000 elements"):
        loads(_zip_bytes(members))


def test_metadata_nested_100k_deep_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    # The checksum matches (a forged file can carry a right one): the depth bound catches it.
    # A shallow one is parsed, and refused for what it lacks, not for its depth.
    for depth, match in ((100_000, "nests 100001 levels deep"), (30, "is malformed")):
        meta = np.frombuffer(_meta_nested(depth), np.uint8)
        checksum = np.frombuffer(ckpt_module._checksum(meta.tobytes(), {}).encode(), np.uint8)
        buf = io.BytesIO()
        np.savez(buf, meta=meta, checksum=checksum)
        with pytest.raises(CheckpointError, match=match):
            loads(buf.getvalue())
    # Unchecked, the same meta is read only after its checksum: an altered one stops there.
    members = _members(tmp_path)
    members["meta.npy"] = _npy(np.frombuffer(_meta_nested(100_000), np.uint8))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        loads(_zip_bytes(members))


def test_overlapping_or_oversized_members_are_refused(tmp_path: Path) -> None:
    data = _zip_bytes(_members(tmp_path))
    for cut in (len(data) // 2, 30):
        with pytest.raises(CheckpointError, match="not an EdgeFleet checkpoint"):
            loads(data[:cut])
    with pytest.raises(CheckpointError, match="not one array"):
        loads(_zip_bytes({**_members(tmp_path), "evil.txt": b"x"}))
