"""A run whose devices cannot take part stops with the cause instead of finishing "done":
after ``run.max-empty-rounds`` rounds in a row without a participant the ServerApp raises
FleetSilent naming why (all declined, all unreachable, none selectable), its checkpoint is
kept and ``resume`` continues once the devices are back; ``edgefleet run`` exits non-zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, Context, Error, Message, MessageType, RecordDict

from edgefleet.loop.context import RoundContext, ScreeningRow, SelectionRow, StoppingRow
from edgefleet.loop.registry import DeviceRegistry
from edgefleet.loop.roundloop import RoundResult
from edgefleet.server.checkpoint import FILENAME, load_checkpoint
from edgefleet.server.emptyrounds import WAITING_FOR_ENERGY, EmptyRoundsStop, FleetSilent
from edgefleet.strategies.energy_selection import EnergyAgeSelection
from tests.fakes import FakeGrid

ROOT = Path(__file__).resolve().parents[1]


def _serve(tmp_path: Path, train_mode: str, **config: object) -> list[int]:
    """EdgeFleet's ServerApp over 3 of EdgeFleet's ClientApps that answer status queries and
    then, asked to train, train (``ok``), decline (``decline``) or never answer (``gone``)."""
    from edgefleet.client.app import status, train
    from edgefleet.server.app import main

    run_config = {
        "output-dir": str(tmp_path), "run-name": "r", "local-steps": 1, "batch-size": 8,
        "min-nodes": 3, "eval-samples": 50, "num-server-rounds": 6, **config,
    }  # fmt: skip

    def device(p: int):
        node = {"partition-id": p, "num-partitions": 3}
        ctx = Context(run_id=1, node_id=p + 1, node_config=node, state=RecordDict(),
                      run_config=run_config)  # fmt: skip

        def handle(msg: Message) -> Message | None:
            if msg.metadata.message_type == MessageType.QUERY:
                return status(msg, ctx)
            if train_mode == "decline":
                return Message(Error(code=0, reason="battery below the round's cost"), reply_to=msg)
            return None if train_mode == "gone" else train(msg, ctx)

        return handle

    grid = FakeGrid({p + 1: device(p) for p in range(3)})
    server = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                     run_config=run_config)  # fmt: skip
    main(grid, server)  # type: ignore[arg-type]
    return _rounds(tmp_path / "r")


def _rounds(run_dir: Path) -> list[int]:
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["round"] for x in rows]


def test_every_device_declining_stops_the_run_and_resume_continues(tmp_path: Path) -> None:
    with pytest.raises(FleetSilent) as err:
        _serve(tmp_path, "decline")
    text = str(err.value)
    assert "no device took part in 3 rounds in a row (rounds 1-3; run.max-empty-rounds = 3)" in text
    assert "every device asked declined (3: " in text and "--resume" in text
    run_dir = tmp_path / "r"
    assert _rounds(run_dir) == [1, 2, 3] and not (run_dir / "summary.json").exists()
    assert load_checkpoint(run_dir / FILENAME).round == 3
    # The devices are back: the same run continues from round 4 to its end.
    assert _serve(tmp_path, "ok", resume=True) == [1, 2, 3, 4, 5, 6]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_run"] == 6


def test_a_fleet_that_never_answers_is_named_unreachable(tmp_path: Path) -> None:
    with pytest.raises(FleetSilent, match=r"rounds 1-2; run.max-empty-rounds = 2\): the devices "
                       r"are unreachable \(no reply to 3 train messages"):  # fmt: skip
        _serve(tmp_path, "gone", **{"run.max-empty-rounds": 2, "round-timeout": 1.0})


def test_zero_max_empty_rounds_runs_to_the_budget(tmp_path: Path) -> None:
    assert _serve(tmp_path, "decline", **{"run.max-empty-rounds": 0, "num-server-rounds": 4}) == [
        1, 2, 3, 4,
    ]  # fmt: skip


def _result(rnd: int, why: str, declined: tuple[str, ...] = ()) -> RoundResult:
    ctx = RoundContext(rnd, DeviceRegistry())
    ctx.section(ScreeningRow).no_participants = why
    return RoundResult(rnd, 0, ArrayRecord(), [], list(declined), [], 0, 0, 0.0, {}, {}, 0.0,
                       context=ctx)  # fmt: skip


def test_rounds_waiting_for_energy_are_not_a_silent_fleet() -> None:
    # Devices that answered but cannot afford a round are there, recharging: no streak.
    why = EnergyAgeSelection._why_nobody(None, [1, 2], {1: None, 2: None})  # type: ignore[arg-type]
    assert WAITING_FOR_ENERGY in why
    stop = EmptyRoundsStop(2)
    for rnd in range(1, 10):
        assert stop.after_round(_result(rnd, why)) is None
    unreachable = EnergyAgeSelection._why_nobody(None, [1, 2], {})  # type: ignore[arg-type]
    assert stop.after_round(_result(10, unreachable)) is None
    with pytest.raises(FleetSilent, match="rounds 10-11.*the devices are unreachable"):
        stop.after_round(_result(11, unreachable))


def test_rounds_that_stopping_rests_are_not_a_silent_fleet() -> None:
    # Data-free stopping rests a session that stopped learning: its configure_train sends
    # nothing, by decision. A session resting longer than the limit must not end the run.
    stop = EmptyRoundsStop(2)
    for rnd in range(1, 6):
        resting = _result(rnd, "the strategy sent no train messages")
        resting.context.section(StoppingRow).stopping_resting = True
        assert stop.after_round(resting) is None
    assert stop.after_round(_result(6, "the strategy sent no train messages")) is None
    with pytest.raises(FleetSilent, match="rounds 6-7"):
        stop.after_round(_result(7, "the strategy sent no train messages"))


def test_rounds_the_deadline_empties_are_neither_silent_nor_heard() -> None:
    # Every board over selection.deadline: the server skips them until deadline-retry lets
    # them back. Under load that outlasted run.max-empty-rounds and stopped a deadline run
    # before any retry (benchmarks/perf/link_fleet.py). Such rounds must not count...
    def skipped(rnd: int) -> RoundResult:
        result = _result(rnd, "energy-age selection: nobody left after selection.deadline")
        result.context.section(SelectionRow).deadline_skipped = ["0", "1"]
        return result

    stop = EmptyRoundsStop(2, deadline_retry=3)
    for rnd in range(1, 6):
        assert stop.after_round(skipped(rnd)) is None
    # ... nor hide a fleet that is gone: retried boards that never answer still end the run.
    assert stop.after_round(_result(6, "nobody answered")) is None
    assert stop.after_round(skipped(7)) is None
    with pytest.raises(FleetSilent, match="rounds 6-8"):
        stop.after_round(_result(8, "nobody answered"))
    # Without a retry a skipped board is never asked again: those rounds are silent.
    never = EmptyRoundsStop(2, deadline_retry=0)
    assert never.after_round(skipped(1)) is None
    with pytest.raises(FleetSilent, match="rounds 1-2"):
        never.after_round(skipped(2))


def test_unreachable_devices_are_named_from_their_column() -> None:
    stop = EmptyRoundsStop(1)
    gone = _result(1, "nobody answered")
    gone.unreachable = ["3", "4"]
    with pytest.raises(FleetSilent, match=r"devices asked are unreachable \(2: 3, 4\)"):
        stop.after_round(gone)


@pytest.mark.timeout(300)
def test_edgefleet_run_exits_non_zero_when_no_device_takes_part(tmp_path: Path) -> None:
    # Batteries smaller than a round's cost and no harvest: every device declines every
    # round. Rounds go by without a participant: the run must stop, not finish "done".
    # A process of its own, as a user runs it (the run's log is its file descriptors').
    proc = subprocess.run(
        [sys.executable, "-m", "edgefleet.cli", "run", str(ROOT / "scenarios" / "fedavg.toml"),
         "--quiet", "--engine", "inprocess",
         "--workers", "1", "--set", "federation.num-supernodes=2",
         "--set", "num-server-rounds=12", "--set", "local-steps=1", "--set", "eval-samples=50",
         "--set", "energy.capacity=0.5", "--set", "energy.harvest-prob=0.0",
         "--set", f"output-dir={tmp_path}", "--set", "run-name=drained", "--timeout", "240"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "FleetSilent: no device took part in 3 rounds in a row (rounds 1-3" in err, err
    assert "every device asked declined (2: " in err and "--resume" in err, err
    rounds = _rounds(tmp_path / "drained")
    assert load_checkpoint(tmp_path / "drained" / FILENAME).round == rounds[-1] < 12
    assert not (tmp_path / "drained" / "summary.json").exists()


def test_more_session_groups_than_devices_is_refused_before_the_run() -> None:
    # Each device refused to build its data ("2 partitions cannot form 3 groups") on every
    # message, and the run went by with nobody until run.max-empty-rounds stopped it,
    # misreading the devices as unreachable.
    from edgefleet.config import ConfigError
    from edgefleet.simulation.runner import load_scenario, resolve_run_config

    scenario = load_scenario(
        ROOT / "scenarios" / "fedavg.toml",
        {
            "federation.num-supernodes": 2,
            "sessions.schedule": "alternate",
            "sessions.groups": 3,
            "sessions.rounds": 3,
            "sessions.count": 2,
            "num-server-rounds": 6,
        },
    )
    with pytest.raises(ConfigError, match=r"'sessions.groups' = 3 .*num-supernodes = 2"):
        resolve_run_config(scenario)


def test_status_errors_are_named_not_taken_for_unreachable_devices() -> None:
    stop = EmptyRoundsStop(1)
    failing = _result(1, "sessions: no device present (0 of 2 nodes answered)")
    failing.context.status_errors.update({1: "code 10: 2 partitions cannot form 3 groups"})
    with pytest.raises(FleetSilent, match="answered the status query with an error .*3 groups"):
        stop.after_round(failing)
