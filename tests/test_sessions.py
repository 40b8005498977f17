"""The sessions wrapper with warm start, driven by fake devices, and end to end."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from edgefleet.algorithms.tracker import SessionTracker
from edgefleet.algorithms.warmstart import SessionStore
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.loop.context import ClassAccuracy, SelectionRow, SessionRow, StoppingRow
from edgefleet.loop.roundloop import Evaluation, RoundLoop
from edgefleet.server.checkpoint import Checkpoint, dumps, loads
from edgefleet.simulation.runner import load_scenario, run_scenario
from edgefleet.strategies.stopping import TaskVectorStopping
from edgefleet.strategies.warmstart_initializer import WarmStartInitializer
from edgefleet.task.partition import group_classes, group_partition_indices
from tests.fakes import FakeGrid, rec
from tests.test_ehfedsag import KW

ROOT = Path(__file__).resolve().parents[1]
T = 3  # rounds per session


class GroupDevice:
    """Present in sessions of its group (alternating every T rounds); training moves the
    model towards its group's optimum."""

    def __init__(self, device: int, group: int, optimum: float) -> None:
        self.device, self.group, self.optimum = device, group, optimum
        self.trained_from: list[float] = []

    def __call__(self, msg: Message) -> Message:
        rnd = int(msg.content["config"]["server-round"])
        if msg.metadata.message_type == MessageType.QUERY:
            here = ((rnd - 1) // T) % 2 == self.group
            status = {"device-id": self.device, "feasible": 1, "present": int(here)}
            status["labels"] = [self.group]
            return Message(RecordDict({"status": MetricRecord(status)}), reply_to=msg)
        w = msg.content["arrays"]["w"].numpy()
        self.trained_from.append(float(w[0]))
        new = w + 0.5 * (self.optimum - w)
        metrics = MetricRecord({"num-examples": 1, "device-id": self.device})
        return Message(RecordDict({"arrays": rec(w=new), "metrics": metrics}), reply_to=msg)


def _eval(rnd: int, arrays: ArrayRecord) -> Evaluation:
    w = float(arrays["w"].numpy()[0])
    return Evaluation({"test_accuracy": 0.0}, {0: ClassAccuracy(-abs(w + 4), 1.0)})


def _strategy(
    mode: str,
    store: SessionStore,
    stopping: bool = False,
    aux_rounds: int = 1,
    pilot_candidates: bool = False,
):
    inner = FedAvg(**KW)
    if stopping:
        inner = TaskVectorStopping(inner, tau=0.6, patience=1)  # type: ignore[assignment]
    return WarmStartInitializer(
        inner,
        store=store,
        tracker=SessionTracker(0.2, 0),
        initial=rec(w=np.zeros(2)),
        param_keys=["w"],
        mode=mode,
        pilot_sessions=2,
        aux_rounds=aux_rounds,
        temperature=50.0,
        pilot_candidates=pilot_candidates,
    )


def _loop(strategy, devices, arrays: ArrayRecord, first: int, last: int):
    rows = []

    class Keep:
        def on_start(self, arrays, first_round):
            pass

        def after_round(self, result):
            rows.append(result)

    loop = RoundLoop(
        strategy,
        FakeGrid(devices),  # type: ignore[arg-type]
        evaluate_fn=_eval,
        callbacks=[*strategy.round_callbacks(), Keep()],  # type: ignore[list-item]
    )
    return loop.run(arrays, last, ConfigRecord(), first_round=first), rows


def _devices() -> dict[int, GroupDevice]:
    return {1: GroupDevice(0, 0, -4.0), 2: GroupDevice(1, 1, 4.0)}


def _run(mode: str, tmp: Path, sessions: int = 4, stopping: bool = False, aux_rounds: int = 1):
    devices = _devices()
    strategy = _strategy(mode, SessionStore(tmp, max_stored=5), stopping, aux_rounds)
    out, rows = _loop(strategy, devices, rec(w=np.zeros(2)), 1, sessions * T)
    return out, rows, devices, strategy


def test_sessions_follow_presence_and_pilot_runs_aux_rounds(tmp_path: Path) -> None:
    out, rows, devices, strategy = _run("pilot", tmp_path)
    assert [r.session for r in rows] == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    phases = [r.context.section(SessionRow).phase for r in rows]
    assert phases == ["train"] * 6 + ["aux", "train", "train"] * 2
    # session 3 (group 0): its aux round starts from the pilot = mean of sessions 1 and 2
    pilot = np.mean([s.final["w"][0] for s in strategy.store.pilots()])
    assert devices[1].trained_from[3] == pytest.approx(pilot)
    # session 4 (group 1): one stored candidate (session 3), weight 1 -> starts from its final
    assert rows[9].context.section(SessionRow).warmstart_weights == {"3": 1.0}
    final3 = strategy.store.candidates()[0].final["w"][0]
    assert devices[2].trained_from[-2] == pytest.approx(final3)
    assert rows[0].context.section(SessionRow).session_classes == [0]
    assert (tmp_path / "index.json").exists()


def test_pilot_candidates_let_a_group_seen_only_in_the_pilots_start_from_its_own_model(
    tmp_path: Path,
) -> None:
    # Session 4 is group 1, seen before only in pilot session 2. By the reference's rule its
    # only candidate is session 3 (group 0): weight 1 on the other group's model (above).
    # With the pilots as candidates, its aux rounds (from the pilot model towards +4) point
    # the way pilot session 2's final model lies from the pilot model: session 2 wins.
    devices = _devices()
    store = SessionStore(tmp_path, max_stored=5)
    strategy = _strategy("pilot", store, pilot_candidates=True)
    _, rows = _loop(strategy, devices, rec(w=np.zeros(2)), 1, 4 * T)
    weights = rows[9].context.section(SessionRow).warmstart_weights
    assert set(weights) == {"1", "2", "3"}
    assert weights["2"] > 0.99
    final2 = store.pilots()[1].final["w"][0]
    assert final2 > 0 and devices[2].trained_from[-2] == pytest.approx(final2, abs=0.01)
    # session 3 (group 0) weighed the two pilots only, and took group 0's pilot session 1
    assert rows[6].context.section(SessionRow).warmstart_weights["1"] > 0.99


def test_previous_mode_has_no_aux_rounds(tmp_path: Path) -> None:
    _, rows, devices, _ = _run("previous", tmp_path)
    assert all(r.context.section(SessionRow).phase == "train" for r in rows)
    # session 2's first round starts from session 1's last model
    assert devices[2].trained_from[0] == pytest.approx(float(rows[2].arrays["w"].numpy()[0]))


def test_fresh_mode_restarts_from_the_initial_model(tmp_path: Path) -> None:
    _, _, devices, _ = _run("fresh", tmp_path)
    assert devices[2].trained_from[0] == 0.0 and devices[1].trained_from[3] == 0.0


def test_plateau_rests_until_next_session(tmp_path: Path) -> None:
    _, rows, devices, _ = _run("previous", tmp_path, stopping=True)
    assert len(rows) == 4 * T  # never stops the run
    assert any(r.context.section(StoppingRow).stopping_resting for r in rows)
    # every session trains again at its start
    assert all(rows[i].participants for i in (0, 3, 6, 9))


def test_group_classes_and_partitions() -> None:
    assert group_classes(10, 2, 0.0) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert group_classes(10, 2, 1.0)[0] == list(range(10))
    a, b = group_classes(10, 2, 0.4)
    assert len(set(a) & set(b)) == 4
    y = np.repeat(np.arange(10), 50)
    parts = [group_partition_indices(y, 6, i, 2, 0.0, 1.0, seed=1) for i in range(6)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(500))
    assert set(y[np.concatenate(parts[0::2])]) == {0, 1, 2, 3, 4}
    # groups that do not divide the classes: every class still has an owner
    assert sorted(sum(group_classes(10, 3, 0.0), [])) == list(range(10))
    parts = [group_partition_indices(y, 6, i, 3, 0.0, 1.0, seed=1) for i in range(6)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(500))


def test_config_checks_session_lengths() -> None:
    with pytest.raises(ConfigError, match="sessions.count x sessions.rounds"):
        parse_run_config({"sessions.schedule": "alternate", "sessions.rounds": 3})
    with pytest.raises(ConfigError, match="warmstart.aux-rounds"):
        parse_run_config({"warmstart.mode": "pilot", "sessions.rounds": 1})


@pytest.mark.timeout(400)
def test_four_alternating_sessions_end_to_end(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    overrides = {
        "federation.num-supernodes": 4,
        "num-server-rounds": 8,
        "sessions.count": 4,
        "sessions.rounds": 2,
        "warmstart.pilot-sessions": 1,
        "local-steps": 3,
        "output-dir": str(tmp_path),
        "run-name": "ws",
    }
    scenario = load_scenario(ROOT / "scenarios" / "sessions.toml", overrides)
    run_dir = run_scenario(scenario, timeout=300, quiet=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["session"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [r["phase"] for r in rows[2::2]] == ["aux"] * 3
    assert all(r["present"] == 2 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    per_session = summary["sessions"]
    assert [s["aux_rounds"] for s in per_session] == [0, 1, 1, 1]
    assert all(s["bytes"] > 0 for s in per_session)
    assert rows[0]["session_classes"] == [0, 1, 2, 3, 4]


def test_rested_session_still_runs_the_next_aux_round(tmp_path: Path) -> None:
    _, rows, _, _ = _run("pilot", tmp_path, stopping=True)
    aux = [r for r in rows if r.context.section(SessionRow).phase == "aux"]
    assert len(aux) == 2 and all(r.participants for r in aux)


def test_fedsag_forgets_memories_at_a_session_start() -> None:
    from edgefleet.strategies.fedsag import FedSAG

    strategy = FedSAG(**KW)
    strategy.register_devices(["0", "1"])
    strategy.memory = object()  # type: ignore[assignment]
    strategy.on_session(None)
    assert strategy.memory is None and not strategy._known


def test_average_mode_starts_from_the_mean_of_stored_sessions(tmp_path: Path) -> None:
    _, rows, devices, strategy = _run("average", tmp_path)
    assert all(r.context.section(SessionRow).phase == "train" for r in rows)
    finals = [float(rows[i].arrays["w"].numpy()[0]) for i in (2, 5)]
    assert devices[1].trained_from[3] == pytest.approx(np.mean(finals))
    # the three that ended at a boundary, and the one the run ended in (kept at its end)
    assert len(strategy.store.candidates()) == 4


def test_session_change_during_aux_rounds_keeps_the_last_real_model(tmp_path: Path) -> None:
    """Four aux rounds never finish in 3-round sessions: each session after the pilots
    starts its aux rounds from the pilot again, and nothing half-trained is stored."""
    _, rows, devices, strategy = _run("pilot", tmp_path, aux_rounds=4)
    assert [r.context.section(SessionRow).phase for r in rows[6:]] == ["aux"] * 6
    pilot = np.mean([s.final["w"][0] for s in strategy.store.pilots()])
    assert devices[2].trained_from[3] == pytest.approx(pilot)  # session 4's first aux round
    assert strategy.store.candidates() == []


@pytest.mark.parametrize("cut", [7, 8])  # after an aux round / mid-session
def test_restart_with_stored_sessions_matches_uninterrupted(tmp_path: Path, cut: int) -> None:
    """A new server built from the checkpointed state and the on-disk session store goes on
    exactly as the uninterrupted one (pilot mode, stopping inside)."""
    whole, _, _, _ = _run("pilot", tmp_path / "a", sessions=5, stopping=True)
    first = _strategy("pilot", SessionStore(tmp_path / "b", max_stored=5), stopping=True)
    part, _ = _loop(first, _devices(), rec(w=np.zeros(2)), 1, cut)
    # Through the checkpoint's own format (JSON and arrays, no pickle).
    state = loads(dumps(Checkpoint(cut, {}, first.state_dict(), None))).strategy
    second = _strategy("pilot", SessionStore.load(tmp_path / "b", max_stored=5), stopping=True)
    second.load_state_dict(state)
    resumed, _ = _loop(second, _devices(), part.arrays, cut + 1, 5 * T)
    np.testing.assert_array_equal(resumed.arrays["w"].numpy(), whole.arrays["w"].numpy())


def test_session_time_to_target_counts_aux_rounds_and_the_warm_start_row() -> None:
    from edgefleet.server.results import session_summary

    def row(rnd: int, session: int, acc: float, phase: str = "train", **kw: object) -> dict:
        return {"round": rnd, "session": session, "session_accuracy": acc, "phase": phase,
                "bytes_up": 1, "bytes_down": 2, "energy_spent": 0.0, **kw}  # fmt: skip

    rows = [
        row(1, 1, 0.5), row(2, 1, 0.9),
        # V = 2: the first aux row evaluates an aux result (never counts), the last one
        # the warm model the session starts from
        row(3, 2, 0.95, "aux"), row(4, 2, 0.85, "aux", warm_start=True), row(5, 2, 0.9),
        row(6, 3, 0.95, "aux"), row(7, 3, 0.5, "aux", warm_start=True), row(8, 3, 0.7),
    ]  # fmt: skip
    out = session_summary(rows, target=0.8)
    assert [s["rounds_to_target"] for s in out] == [2, 2, None]
    assert [s["aux_rounds"] for s in out] == [0, 2, 2]
    assert out[1]["bytes"] == 9


def test_energy_selection_inside_sessions_reuses_the_presence_answers(tmp_path: Path) -> None:
    from edgefleet.strategies.energy_selection import EnergyAgeSelection
    from edgefleet.strategies.fedsag import FedSAG

    devices = {n: GroupDevice(n - 1, (n - 1) % 2, 4.0 * (-1) ** n) for n in range(1, 5)}
    queries: list[int] = []

    def counted(device: GroupDevice):
        def handle(msg: Message) -> Message:
            if msg.metadata.message_type == MessageType.QUERY:
                queries.append(device.device)
            return device(msg)

        return handle

    fedsag = FedSAG(**KW)
    selection = EnergyAgeSelection(fedsag, max_devices=1, slots_per_round=4)
    strategy = WarmStartInitializer(
        selection,
        store=SessionStore(tmp_path, max_stored=5),
        tracker=SessionTracker(0.2, 0),
        initial=rec(w=np.zeros(2)),
        param_keys=["w"],
        mode="previous",
        slots_per_round=4,
    )
    handlers = {n: counted(d) for n, d in devices.items()}
    out, rows = _loop(strategy, handlers, rec(w=np.zeros(2)), 1, T + 1)
    # round T + 1 opens session 2 (group 1: device ids 1 and 3). FedSAG forgot its devices
    # at the boundary; the presence answers handed down after it count both in its K.
    assert fedsag.memory is not None and sorted(fedsag.memory.device_ids) == ["1", "3"]
    _, more = _loop(strategy, handlers, out.arrays, T + 2, 2 * T)
    rows += more
    assert len(queries) == 2 * T * len(devices)  # the presence query only, never a second one
    assert [r.context.section(SelectionRow).status_queries for r in rows] == [0] * (2 * T)
    assert [r.context.section(SessionRow).presence_queries for r in rows] == [len(devices)] * (
        2 * T
    )
    # session 2 is group 1 (device ids 1 and 3): selection and FedSAG see only those
    assert all(set(r.participants) <= {"1", "3"} for r in rows[T:])
    assert sorted(fedsag._known) == ["1", "3"]


def test_a_users_app_opens_its_store_again_and_continues_it(tmp_path: Path) -> None:
    """Warm start in a user's own ServerApp: one constructor with a folder, defaults for the
    rest. Run twice on one folder (a ServerApp started again), the second opens the store the
    first left instead of failing on its index, numbers its sessions after the stored ones
    and warm-starts from them; it never overwrites a stored session with its initial model."""
    folder = tmp_path / "sessions"

    def app_run() -> tuple[WarmStartInitializer, list]:
        strategy = WarmStartInitializer(
            FedAvg(**KW), store=folder, initial=rec(w=np.zeros(2)), pilot_sessions=2
        )
        _, rows = _loop(strategy, _devices(), rec(w=np.zeros(2)), 1, 4 * T)
        return strategy, rows

    first, rows = app_run()
    assert [r.session for r in rows] == [1] * T + [2] * T + [3] * T + [4] * T
    stored = {s.session: s.final.copy() for s in first.store.pilots() + first.store.candidates()}
    assert sorted(stored) == [1, 2, 3, 4]  # session 4, open at the end, kept then too
    again, rows = app_run()
    assert [r.session for r in rows][:T] == [5] * T  # continues after the stored sessions
    assert rows[0].context.section(SessionRow).phase == "aux"  # pilot model -> warm start
    assert any(r.context.section(SessionRow).warmstart_weights for r in rows)
    for s in again.store.pilots():  # the pilots the first run stored, unchanged
        np.testing.assert_array_equal(s.final["w"], stored[s.session]["w"])
