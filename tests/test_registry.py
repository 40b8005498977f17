"""The device registry (binding, reconnect, strict, retirement, history, state) and the round
context (per-round state kept there, not on the wrappers)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from edgefleet.loop.context import (
    PruningRow,
    RoundContext,
    SelectionRow,
    columns,
    current_round,
    in_round,
)
from edgefleet.loop.registry import DeviceRegistry, DeviceStatus, RegistryError
from edgefleet.loop.status import StatusPhase
from edgefleet.strategies.energy_selection import EnergyAgeSelection
from edgefleet.strategies.fedsag import FedSAG
from tests.fakes import FakeGrid, by_hand, rec
from tests.test_ehfedsag import KW, FakeDevice


def _online(*nodes: int):  # type: ignore[no-untyped-def]
    return lambda: set(nodes)


def test_first_accepted_claim_binds_and_a_second_node_is_refused() -> None:
    reg = DeviceRegistry()
    assert reg.screen({"a": (1, "7")}, _online(1)) == {}
    reg.bind(1, "7")
    assert (reg.device_of(1), reg.node_of("7"), reg.name(1), reg.name(2)) == ("7", 1, "7", "node-2")
    reasons = reg.screen({"b": (2, "7"), "c": (1, "8")}, _online(1, 2))
    assert reasons["b"] == "device-id 7 is bound to node 1, still online"
    assert reasons["c"] == "node 1 speaks for device 7 in this run and now claims device-id 8"


def test_an_id_claimed_twice_in_one_round_is_bound_to_nobody() -> None:
    reg = DeviceRegistry()
    reasons = reg.screen({1: (1, "3"), 2: (2, "3")}, _online(1, 2))
    assert set(reasons) == {1, 2} and "bound to none of them" in reasons[1]


def test_reconnect_moves_the_id_once_the_old_node_is_offline_and_retires_it() -> None:
    reg = DeviceRegistry("reconnect")
    reg.bind(5, "0")
    assert reg.screen({9: (9, "0")}, _online(5, 9))  # node 5 still listed: refused
    assert reg.screen({9: (9, "0")}, _online(9)) == {}
    reg.bind(9, "0")
    assert (reg.node_of("0"), reg.device_of(5), reg.retired) == (9, None, {5})


def test_strict_never_moves_an_id() -> None:
    reg = DeviceRegistry("strict")
    reg.bind(5, "0")
    assert reg.screen({9: (9, "0")}, _online(9)) == {9: "device-id 0 is bound to node 5"}
    with pytest.raises(RegistryError, match="valid: reconnect, strict"):
        DeviceRegistry("loose")


def test_history_and_state_round_trip() -> None:
    reg = DeviceRegistry()
    reg.bind(1, "0")
    reg.bind(2, "1")
    reg.note_status(3, 1, DeviceStatus("0", feasible=True, present=True, labels=(2, 5)))
    reg.note_round(
        3, ["0"], ["1"], [{"device": "1", "reason": "bad"}, {"device": "x", "reason": "?"}]
    )
    reg.unreported.add(4)
    reg.anonymous.add(6)
    reg.heard.update({1, 2, 4, 6})
    reg.bind(7, "1")  # device 1 moved: node 2 retired
    again = DeviceRegistry()
    again.load_state_dict(reg.state_dict())
    assert again.state_dict() == reg.state_dict()
    zero = again.devices["0"]
    seen = zero.participation
    assert (zero.answer.labels, seen.count, seen.last_trained, seen.last_seen) == (
        (2, 5),
        1,
        3,
        3,
    )
    one = again.devices["1"]
    assert (one.node, one.outcomes.declines, one.outcomes.rejections) == (7, 1, [(3, "bad")])
    assert (again.retired, again.unreported, again.anonymous) == ({2}, {4}, {6})
    assert again.known(4) and again.known(6) and again.known(7) and not again.known(2)
    with pytest.raises(RegistryError, match="malformed"):
        again.load_state_dict({"devices": {"0": {"labels": [1]}}})  # no node


def test_a_checkpoint_written_before_the_record_was_split_loads() -> None:
    # A device's entry as the registry wrote it before DeviceRecord held its concerns in
    # parts (flat keys); the format is unchanged, so it loads into the parts and back.
    old = {
        "devices": {
            "0": {
                "node": 3,
                "kept_fraction": 0.5,
                "kept_channels": {"conv1": [0, 2]},
                "full_sent": 4,
                "link": None,
                "labels": [1, 7],
                "last_seen": 6,
                "participations": 2,
                "last_trained": 5,
                "declines": 1,
                "unreachable": 1,
                "rejections": [[6, "nan in w"]],
            }
        },
        "retired": [],
        "unreported": [],
        "anonymous": [],
        "heard": [3],
        "partitions": None,
    }
    reg = DeviceRegistry()
    reg.load_state_dict(old)
    r = reg.devices["0"]
    assert (r.node, r.answer.labels) == (3, (1, 7))
    assert (r.participation.last_seen, r.participation.count) == (6, 2)
    assert r.participation.last_trained == 5
    assert (r.outcomes.declines, r.outcomes.unreachable) == (1, 1)
    assert r.outcomes.rejections == [(6, "nan in w")]
    assert (r.submodel.kept_fraction, r.submodel.full_sent) == (0.5, 4)
    assert r.submodel.kept_channels is not None
    assert r.submodel.kept_channels["conv1"].tolist() == [0, 2]
    assert reg.state_dict() == old


def test_rejections_kept_are_bounded() -> None:
    reg = DeviceRegistry()
    reg.bind(1, "0")
    for rnd in range(1, 60):
        reg.note_round(rnd, [], [], [{"device": "0", "reason": f"r{rnd}"}])
    kept = reg.devices["0"].outcomes.rejections
    assert len(kept) == 20 and kept[-1] == (59, "r59")


def test_wrappers_need_a_round_and_say_how_to_get_one() -> None:
    strategy = FedSAG(**KW)
    with pytest.raises(RuntimeError, match=r"strategy.start\(grid, arrays"):
        strategy.configure_train(1, rec(w=np.zeros(1)), ConfigRecord(), FakeGrid({}))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        current_round()


def test_sections_become_columns_and_optional_ones_only_when_set() -> None:
    row = PruningRow(compact_downloads=2)
    assert columns(row) == {"compact_downloads": 2}
    row.compact_replies = 0
    assert columns(row) == {"compact_downloads": 2, "compact_replies": 0}
    ctx = RoundContext(1, DeviceRegistry())
    ctx.section(SelectionRow).selected.append("3")
    assert ctx.columns() == {"status_queries": 0, "selected": ["3"]}
    assert ctx.find(PruningRow) is None


def test_two_interleaved_runs_on_one_strategy_object_keep_their_rounds_apart() -> None:
    """Per-round state lives in the round's context: two runs that use one wrapper object,
    their calls interleaved (configure A, configure B, aggregate A, aggregate B), each see
    what their own round did. A wrapper that kept it on itself would hand run A the model
    and selection of run B."""
    strategy = EnergyAgeSelection(FedSAG(**KW), max_devices=1, slots_per_round=4)
    grid_a = FakeGrid({1: FakeDevice(0, 1.0)})  # type: ignore[dict-item]
    grid_b = FakeGrid({2: FakeDevice(1, 2.0)})  # type: ignore[dict-item]
    phase = StatusPhase(strategy, strategy.declarations())
    ctx_a = RoundContext(1, DeviceRegistry(), fleet=phase.fleet)
    ctx_b = RoundContext(1, DeviceRegistry(), fleet=phase.fleet)
    with in_round(ctx_a):
        phase.run(grid_a, 1, rec(w=np.zeros(1)))  # type: ignore[arg-type]
    with in_round(ctx_b):
        phase.run(grid_b, 1, rec(w=np.full(1, 10.0)))  # type: ignore[arg-type]
    with in_round(ctx_a):
        sent_a = list(strategy.configure_train(1, rec(w=np.zeros(1)), ConfigRecord(), grid_a))  # type: ignore[arg-type]
    with in_round(ctx_b):
        sent_b = list(strategy.configure_train(1, rec(w=np.full(1, 10.0)), ConfigRecord(), grid_b))  # type: ignore[arg-type]
    with in_round(ctx_a):
        new_a, _ = strategy.aggregate_train(1, grid_a.send_and_receive(sent_a))
    with in_round(ctx_b):
        new_b, _ = strategy.aggregate_train(1, grid_b.send_and_receive(sent_b))
    assert ctx_a.section(SelectionRow).selected == ["0"]
    assert ctx_b.section(SelectionRow).selected == ["1"]
    assert ctx_a.registry.device_of(1) == "0" and ctx_a.registry.device_of(2) is None
    # FedSAG takes each run's deltas against the model that run sent (0 and 10): its
    # memory is run state the two share, the model sent is per round.
    assert new_a is not None and new_b is not None
    np.testing.assert_allclose(new_a["w"].numpy(), [1.0])  # delta +1 from 0
    assert 10.0 < float(new_b["w"].numpy()[0]) < 13.0  # delta +2 from 10, plus A's memory


def test_by_hand_contexts_share_a_registry_when_given_one() -> None:
    reg = DeviceRegistry()
    with by_hand(1, reg) as ctx:
        assert ctx.registry is reg and current_round() is ctx
    with pytest.raises(RuntimeError):
        current_round()


def test_the_fleets_partitioning_is_fixed_by_most_answers_and_checked_on_resume() -> None:
    from edgefleet.loop.registry import FleetMismatch

    reg = DeviceRegistry()
    # Three devices say 3 partitions, one hostile answer says 999: the fleet is 3.
    assert reg.check_fleet({1: 3, 2: 3, 3: 3, 4: 999}) == {
        4: "reports num-partitions 999, this run's fleet has 3"
    }
    assert reg.partitions == 3
    resumed = DeviceRegistry()
    resumed.load_state_dict(reg.state_dict())
    assert resumed.partitions == 3 and resumed.check_fleet({1: 3, 9: 10}) == {
        9: "reports num-partitions 10, this run's fleet has 3"
    }
    with pytest.raises(FleetMismatch, match="checkpointed on a fleet of 3 partitions; 3 of 4"):
        resumed.check_fleet({1: 10, 2: 10, 3: 10, 4: 3})
    # Not resumed: a majority that disagrees later is refused, never adopted.
    assert set(reg.check_fleet({1: 10, 2: 10, 3: 3})) == {1, 2}


def test_a_resume_on_another_fleet_is_refused_before_its_first_round(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The server's census before round 1: a run of 3 devices checkpointed, then resumed on
    a fleet of 10 partitions, stops with the reason; the same fleet resumes."""
    from flwr.app import Message, MessageType, MetricRecord, RecordDict

    from edgefleet.config import parse_run_config
    from edgefleet.loop.registry import FleetMismatch
    from edgefleet.loop.roundloop import RoundLoop
    from edgefleet.server.app import fleet_census

    def device(d: int, n: int):  # type: ignore[no-untyped-def]
        def answer(msg: Message) -> Message:
            assert msg.metadata.message_type == MessageType.QUERY
            status = MetricRecord({"device-id": d, "present": 1, "num-partitions": n})
            return Message(RecordDict({"status": status}), reply_to=msg)

        return answer

    cfg = parse_run_config({})
    first = RoundLoop(FedAvg(**KW), FakeGrid({i + 1: device(i, 3) for i in range(3)}))  # type: ignore[arg-type]
    fleet_census(first, cfg, 1)
    assert first.registry.partitions == 3 and first.registry.node_of("2") == 3
    same = RoundLoop(FedAvg(**KW), FakeGrid({i + 1: device(i, 3) for i in range(3)}))  # type: ignore[arg-type]
    same.load_state_dict(first.state_dict())
    fleet_census(same, cfg, 3)
    other = RoundLoop(FedAvg(**KW), FakeGrid({i + 1: device(i, 10) for i in range(10)}))  # type: ignore[arg-type]
    other.load_state_dict(first.state_dict())
    with pytest.raises(FleetMismatch, match="now report num-partitions 10"):
        fleet_census(other, cfg, 3)


def test_a_resume_whose_named_devices_are_all_new_is_refused() -> None:
    from edgefleet.loop.registry import FleetMismatch

    reg = DeviceRegistry()
    for node, device in ((1, "pi-a"), (2, "pi-b")):
        reg.bind(node, device)
    resumed = DeviceRegistry()
    resumed.load_state_dict(reg.state_dict())
    with pytest.raises(FleetMismatch, match=r"checkpointed with 2 devices \(pi-a, pi-b\); none "
                       r"of the 3 devices answering now \(x, y, z\)"):  # fmt: skip
        resumed.check_devices(["x", "y", "z"])
    again = DeviceRegistry()
    again.load_state_dict(reg.state_dict())
    again.check_devices([])  # nobody named itself yet (anonymous answers): not checked
    again.check_devices(["pi-b", "new"])  # one known device: the same fleet, grown
    again.check_devices(["x"])  # checked once: later arrivals are new devices
    DeviceRegistry().check_devices(["x"])  # a fresh run has nothing to compare


def test_a_devices_kept_fraction_is_kept_checked_and_checkpointed() -> None:
    registry = DeviceRegistry()
    registry.bind(3, "a")
    registry.note_kept_fraction("a", 0.48731)
    registry.note_kept_fraction("a", float("nan"))  # device input: out of range is not kept
    registry.note_kept_fraction("a", 7.0)
    registry.note_kept_fraction("nobody", 0.5)
    (view,) = registry.snapshot({3})
    assert view["kept_fraction"] == 0.4873
    loaded = DeviceRegistry()
    loaded.load_state_dict(registry.state_dict())
    assert loaded.snapshot({3})[0]["kept_fraction"] == 0.4873
    old = registry.state_dict()
    del old["devices"]["a"]["kept_fraction"]  # a checkpoint from before the field
    loaded.load_state_dict(old)
    assert loaded.snapshot({3})[0]["kept_fraction"] is None


def test_the_version_a_device_joined_at_is_kept_once_and_checked_on_load() -> None:
    reg = DeviceRegistry()
    reg.bind(1, "0")
    reg.note_joined("0", 7)
    reg.note_joined("0", 9)  # the first is kept
    reg.note_joined("unbound", 3)  # no record to keep it in
    state = reg.state_dict()
    assert state["devices"]["0"]["joined"] == 7 and set(state["devices"]) == {"0"}
    again = DeviceRegistry()
    again.load_state_dict(state)
    assert again.devices["0"].participation.joined == 7
    state["devices"]["0"]["joined"] = -1
    with pytest.raises(RegistryError, match="a version must be an integer >= 0, not -1"):
        again.load_state_dict(state)
    for bad in (float("inf"), 2.5, "7", True):  # a damaged file: refused with the reason
        state["devices"]["0"]["joined"] = bad
        with pytest.raises(RegistryError, match="a version must be an integer >= 0"):
            again.load_state_dict(state)
