"""Per-device round timing, the waits it sets and energy-age selection's deadline (issue 26).

The grid here answers each node after a set delay on a fake clock (the exchange's sleeps
advance it), so the tests are exact and take no wall-clock time."""

from __future__ import annotations

import json
import math
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg

from edgefleet.algorithms.selection import SelectionError
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.dashboard.metrics import render
from edgefleet.loop import timing
from edgefleet.loop.context import ScreeningRow, SelectionRow
from edgefleet.loop.registry import DeviceRegistry, DeviceStatus, screen_telemetry
from edgefleet.loop.roundloop import RoundLoop
from edgefleet.loop.timing import LinkEstimate, RoundWait, TimingError
from edgefleet.strategies.energy_selection import EnergyAgeSelection
from tests.fakes import FakeGrid, Rows, UploadingGrid, by_hand, no_eval, rec, train_reply
from tests.test_ehfedsag import FakeDevice

W0 = {"w": np.ones((4, 4), np.float32)}
NEVER = math.inf


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


class SlowGrid(FakeGrid):
    """Node n's k-th message is answered ``delays[n][k]`` s after its push (inf: never)."""

    synchronous = False

    def __init__(
        self,
        clock: Clock,
        delays: dict[int, Sequence[float]],
        train_s: float = 0.5,
        claims: bool = True,
    ):
        def handler(device: int):
            def handle(msg: Message) -> Message:
                got = msg.content["arrays"]["w"].numpy()
                # claims=False: a Flower user's ClientApp, no device-id and no train time
                metrics = {"device-id": device, "train-time-s": train_s} if claims else {}
                return train_reply(msg, rec(w=got + 1.0), 10, **metrics)

            return handle

        super().__init__({n: handler(n - 1) for n in delays})
        self.clock, self.delays = clock, delays
        self.count: dict[int, int] = {}
        self.due: dict[str, float] = {}

    def push_messages(self, messages: Any) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for m in messages:
            node = m.metadata.dst_node_id
            k = self.count.get(node, 0)
            self.count[node] = k + 1
            self.due[m.metadata.message_id] = self.clock.now + self.delays[node][k]
        return ids

    def pull_messages(self, message_ids: Any) -> list[Message]:
        ready = [i for i in message_ids if i in self._pushed and self.due[i] <= self.clock.now]
        return super().pull_messages(ready)


def _run(grid: SlowGrid, wait: RoundWait, rounds: int) -> tuple[Rows, list[float], RoundLoop]:
    rows, ends = Rows(), []

    class End(Rows):
        def after_round(self, result: Any) -> None:
            ends.append(grid.clock.now)

    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=[rows, End()], wait=wait)  # type: ignore[arg-type]
    loop.run(rec(W0), rounds)
    return rows, ends, loop


def test_a_slow_first_round_is_waited_for_then_the_wait_follows_each_device(clock: Clock) -> None:
    # Device 1's first round takes 80 s (install, imports, data load), later ones 30 s; a
    # fixed 60 s timeout loses it in round 1, as the compose fleet's first round was lost.
    delays = {1: [2, 2, 2], 2: [80, 30, 30], 3: [1, NEVER, NEVER]}
    rows, _, _ = _run(SlowGrid(clock, delays), RoundWait(round_timeout=60.0), 1)
    assert rows.results[0].participants == ["0", "2"]
    assert rows.last(ScreeningRow).missing == ["node-2"]  # never answered: not bound yet

    clock.now = 0.0
    wait = RoundWait(round_timeout=60.0, mode="expected", first_round_timeout=100.0, slack=2.0,
                     margin=5.0)  # fmt: skip
    rows, ends, loop = _run(SlowGrid(clock, delays), wait, 3)
    first, second, third = rows.results
    assert first.participants == ["0", "1", "2"]
    assert first.context.section(ScreeningRow).round_wait_s == 100.0
    # Round 2: device 2 (1 s last time) is dead; it is waited for 2 x 1 + 5 = 7 s, not 60:
    # the round ends when device 1 (80 s last time, so waited 60 s) answers at 30 s.
    assert second.participants == ["0", "1"]
    assert ends[1] - ends[0] == pytest.approx(30.0, abs=0.6)
    assert second.context.section(ScreeningRow).round_wait_s == 60.0
    # Round 3: device 1's estimate is 0.5 x 30 + 0.5 x 80 = 55 s; the dead one's is the 7 s
    # it was waited for, so it is waited for 2 x 7 + 5 = 19 s (a device missed keeps its
    # wait growing, up to round-timeout).
    assert third.participants == ["0", "1"]
    assert third.context.section(ScreeningRow).round_wait_s == 60.0
    dead = loop.registry.link("2")
    assert dead is not None and dead.timeouts == 2 and dead.round_s == pytest.approx(19.0)
    slow = loop.registry.link("1")
    assert slow is not None and slow.round_s == pytest.approx(
        42.5, abs=1.0
    )  # 80, then 55, then 42.5
    assert slow.compute_s == pytest.approx(0.5)
    assert slow.rate_bps is not None and slow.rate_bps > 0


def test_a_node_that_never_answers_has_its_first_round_wait_once(clock: Clock) -> None:
    wait = RoundWait(round_timeout=20.0, mode="expected", first_round_timeout=100.0)
    _, ends, _ = _run(SlowGrid(clock, {1: [1, 1], 2: [NEVER, NEVER]}), wait, 2)
    assert ends[0] == pytest.approx(100.0, abs=0.6)
    assert ends[1] - ends[0] == pytest.approx(20.0, abs=0.6)  # round-timeout from then on


def test_a_clientapp_that_claims_no_device_id_is_timed_by_its_node(clock: Clock) -> None:
    wait = RoundWait(round_timeout=60.0, mode="expected", first_round_timeout=100.0, slack=2.0,
                     margin=5.0)  # fmt: skip
    grid = SlowGrid(clock, {1: [2, 2], 2: [1, NEVER]}, claims=False)
    rows, ends, loop = _run(grid, wait, 2)
    assert rows.results[0].participants == ["node-1", "node-2"]
    # Round 2: node 2 (1 s last time) is waited for 2 x 1 + 5 = 7 s, not the first-round 100.
    assert ends[1] - ends[0] == pytest.approx(7.0, abs=0.6)
    assert loop.link_of(1) is not None and loop.link_of(1).compute_s is None


def test_the_fixed_wait_is_flowers_behaviour() -> None:
    wait = RoundWait(round_timeout=42.0)
    timed = LinkEstimate()
    timed.observe(3.0, 1000, 1.0)
    assert wait.budget(None) == wait.budget(timed) == 42.0
    expected = RoundWait(round_timeout=42.0, mode="expected", first_round_timeout=500.0)
    assert expected.budget(None) == 500.0
    assert expected.budget(timed) == 3.0 * 3.0 + 10.0
    missed = LinkEstimate()
    missed.timed_out(500.0)  # its first-round wait passed unanswered
    assert expected.budget(missed) == 42.0


def test_the_estimate_weighs_the_newest_round_and_bounds_what_a_device_claims() -> None:
    est = LinkEstimate()
    assert est.expected_s() is None and est.rate_bps is None
    est.observe(10.0, 8000, 20.0)  # claims 20 s of training in a 10 s round: bounded to 10
    assert est.compute_s == 10.0 and est.rate_bps is None  # no link time left to measure
    est.observe(20.0, 8000, 4.0)
    assert est.round_s == 15.0 and est.compute_s == 7.0
    assert est.rate_bps == pytest.approx(8000 / 8.0)
    assert est.view()["link_kbps"] == pytest.approx(8.0)
    again = LinkEstimate.from_state(est.state_dict())
    assert again == est


def test_timing_is_kept_in_the_registry_its_checkpoint_and_fleet_view(tmp_path: Path) -> None:
    registry = DeviceRegistry()
    registry.bind(5, "a")
    registry.note_timing("a", 12.0, 4096, 2.0)
    registry.note_timing("nobody", 1.0, 1, None)  # not bound: nothing to keep it on
    (view,) = registry.snapshot({5})
    assert view["link"]["round_s"] == 12.0 and view["link"]["timed_rounds"] == 1
    loaded = DeviceRegistry()
    loaded.load_state_dict(registry.state_dict())
    assert loaded.link("a") == registry.link("a")
    assert loaded.link("nobody") is None
    # ... and Prometheus reads it from fleet.json, one gauge per field.
    (tmp_path / "fleet.json").write_text(json.dumps({"devices": registry.snapshot({5})}))
    text = render(tmp_path).decode()
    assert 'edgefleet_device_link_round_s{device="a"} 12.0' in text


def test_energy_age_selection_skips_devices_whose_rounds_exceed_the_deadline() -> None:
    registry = DeviceRegistry()
    for node, (device, seconds) in enumerate([("0", 5.0), ("1", 50.0), ("2", None)]):
        registry.bind(node, device)
        if seconds is not None:
            registry.note_timing(device, seconds, 1000, None)
    selection = EnergyAgeSelection(FedAvg(), max_devices=3, slots_per_round=4, deadline=20.0)
    with by_hand(1, registry):
        fits, skipped, retried = selection._within_deadline(["1", "2", "0"], 10**6)
    assert fits == ["2", "0"]  # age order kept; never timed = fits
    assert skipped == ["1"] and retried == []


def test_a_device_never_timed_is_judged_by_the_link_it_declares() -> None:
    # A board on a 512 kbit/s modem: 1 MB down and 1 MB up take 31 s, over a 20 s deadline,
    # so it is skipped before its first round holds the fleet's; one on 2 Mbit/s (8 s) fits.
    # Once timed, the observation counts, not the declaration.
    registry = DeviceRegistry()
    for node, (device, kbps) in enumerate([("0", 512.0), ("1", 2000.0), ("2", None)]):
        registry.bind(node, device)
        status = DeviceStatus(device, True, True, telemetry=screen_telemetry(
            ConfigRecord({} if kbps is None else {"link-kbps": kbps})))  # fmt: skip
        registry.note_status(1, node, status)
    selection = EnergyAgeSelection(FedAvg(), max_devices=3, slots_per_round=4, deadline=20.0)
    with by_hand(1, registry):
        fits, skipped, _ = selection._within_deadline(["0", "1", "2"], 10**6)
    assert fits == ["1", "2"] and skipped == ["0"]
    registry.note_timing("0", 9.0, 2 * 10**6, None)  # it was faster than declared
    with by_hand(2, registry):
        fits, skipped, _ = selection._within_deadline(["0", "1", "2"], 10**6)
    assert fits == ["0", "1", "2"] and skipped is None


def test_the_energy_mod_reports_the_declared_link_and_the_registry_keeps_it() -> None:
    from flwr.app import Context, RecordDict
    from flwr.clientapp import ClientApp

    from edgefleet.client.mods import energy_mod, status_query
    from edgefleet.loop.base import StatusQuery

    app = ClientApp(mods=[energy_mod(capacity=4, harvest_prob=0.5, train_slots=2)])
    app.query()(status_query)
    contexts = {
        1: Context(1, 1, {"device-id": 0, "link-kbps": 512}, RecordDict(), {}),
        2: Context(1, 2, {"device-id": 1, "link-kbps": "fast"}, RecordDict(), {}),  # not a rate
    }
    grid = FakeGrid({n: (lambda m, c=c: app(m, c)) for n, c in contexts.items()})  # type: ignore[misc]
    registry = DeviceRegistry()
    with by_hand(1, registry):
        StatusQuery(4, 5).ask(grid, [1, 2], 1)  # type: ignore[arg-type]
    assert registry.declared_kbps("0") == 512.0
    assert registry.declared_kbps("1") is None


def test_a_device_the_deadline_skipped_is_tried_again_and_comes_back_once_fast() -> None:
    # Device 1 was timed at 50 s (a 20 s deadline); it has since moved closer to its access
    # point and now answers at once. With deadline-retry 2 it is skipped two rounds, selected
    # in the third (its estimate falls to 0.5 x 50 = 25 s, still over), skipped two more,
    # selected again (12.5 s): from then on it fits and is selected like the others.
    devices = {n: FakeDevice(n - 1, 1.0) for n in (1, 2, 3)}
    selection = EnergyAgeSelection(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1),
        max_devices=3, slots_per_round=4, deadline=20.0, deadline_retry=2,
    )  # fmt: skip
    rows = Rows()
    loop = RoundLoop(selection, FakeGrid(devices), evaluate_fn=no_eval,  # type: ignore[arg-type]
                     callbacks=[*selection.round_callbacks(), rows])  # fmt: skip
    for node in devices:
        loop.registry.bind(node, str(node - 1))
    loop.registry.note_timing("1", 50.0, 1000, None)
    w = rec(w=np.zeros(1))
    for rnd in range(1, 9):
        w = loop.run(w, rnd, first_round=rnd).arrays
    sections = [r.context.section(SelectionRow) for r in rows.results]
    assert [s.deadline_skipped for s in sections] == [["1"], ["1"], None, ["1"], ["1"], None,
                                                      None, None]  # fmt: skip
    assert [s.deadline_retried for s in sections] == [None, None, ["1"], None, None, ["1"],
                                                      None, None]  # fmt: skip
    assert [sorted(s.selected) for s in sections][5:] == [["0", "1", "2"]] * 3
    link = loop.registry.link("1")
    assert link is not None and link.round_s < 20.0
    # The skip count is checkpointed with the ages, and a checkpoint without it loads.
    state = selection.state_dict()
    selection._skips["1"] = 1
    selection.load_state_dict(state)
    assert selection._skips == {}
    del state["deadline_skips"]
    selection.load_state_dict(state)
    with pytest.raises(SelectionError, match="deadline_retry"):
        EnergyAgeSelection(FedAvg(), max_devices=1, slots_per_round=4, deadline_retry=-1)


def test_bad_wait_settings_name_the_choices() -> None:
    with pytest.raises(TimingError, match="valid: fixed, expected"):
        RoundWait(mode="adaptive")
    with pytest.raises(TimingError, match="slack"):
        RoundWait(slack=0.5)
    with pytest.raises(ConfigError, match="selection.mode = 'energy-age'"):
        parse_run_config({"selection.deadline": 30.0})
    with pytest.raises(ConfigError, match="must be one of fixed, expected"):
        parse_run_config({"timeout-mode": "auto"})
    cfg = parse_run_config({"timeout-mode": "expected", "selection.mode": "energy-age",
                            "selection.deadline": 30.0})  # fmt: skip
    assert cfg.server.timeout_mode == "expected" and cfg.energy.deadline == 30.0


def test_a_deadline_round_does_not_wait_out_a_slow_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Flower's deployment grid (stood in for by UploadingGrid) node 2's reply has
    announced itself but its arrays do not arrive within the round's 0.5 s: the exchange
    ends at the wait with node 1's reply alone, stamped when it came, not after node 2's
    download. (Pulled in the loop's thread, the call would wait out the upload: the test
    then fails after ``limit`` seconds.)"""
    monkeypatch.setitem(sys.modules, "flwr.superlink.grid.http_grid",
                        types.SimpleNamespace(HttpGrid=UploadingGrid))  # fmt: skip
    grid = UploadingGrid({n: lambda m: train_reply(m, ArrayRecord(), 1) for n in (1, 2)},
                         slow=2, limit=10.0)  # fmt: skip
    messages = [
        Message(
            RecordDict({"config": ConfigRecord({})}), dst_node_id=n, message_type=MessageType.TRAIN
        )  # fmt: skip
        for n in (1, 2)
    ]
    try:
        ex = timing.exchange(grid, messages, [0.5, 0.5], poll_s=0.01)
    finally:
        grid.uploaded.set()
    assert [r.metadata.src_node_id for r in ex.replies] == [1]
    assert ex.arrived_s[messages[0].metadata.message_id] < 0.5
