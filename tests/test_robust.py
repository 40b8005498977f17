"""Robust aggregation (issue 25, item 2): each rule against hand-computed NumPy results (in
the style of Flower's ``fedavgm_test.py``), with and without CA-HFP masks; the wrapper and
Flower's own robust strategies under EdgeFleet's round loop on the fake grid; FedSAG's
robust memory and ``max_age`` with a stale poisoned entry."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Krum, MultiKrum

from edgefleet.loop.context import RobustRow
from edgefleet.loop.roundloop import RoundLoop
from edgefleet.loop.screening import Screening
from edgefleet.strategies import RobustAggregation, TaskVectorStopping
from edgefleet.strategies.robust import (
    RobustRule,
    centered_clip,
    coordinate_median,
    min_keepers,
    multikrum_select,
    robust_aggregate,
    rule_spec,
    trimmed_mean,
)
from tests.fakes import FakeGrid, Rows, no_eval, rec

ONE = {"min_available_nodes": 1, "min_train_nodes": 1, "min_evaluate_nodes": 1}

# Five replies over three coordinates; row 4 is the attacker.
X = np.array(
    [
        [1.0, 2.0, 3.0],
        [2.0, 3.0, 1.0],
        [3.0, 1.0, 2.0],
        [4.0, 5.0, 6.0],
        [100.0, -100.0, 50.0],
    ]
)


# --- the rules, by hand --------------------------------------------------------------------


def test_median_by_hand() -> None:
    # sorted columns: [1,2,3,4,100] [-100,1,2,3,5] [1,2,3,6,50]
    np.testing.assert_allclose(coordinate_median(X), [3.0, 2.0, 3.0])


def test_median_with_a_mask_is_over_the_keepers_only() -> None:
    mask = np.ones_like(X, dtype=bool)
    mask[4, 0] = False  # the attacker did not keep coordinate 0: [1,2,3,4] -> 2.5
    mask[[0, 1], 2] = False  # coordinate 2: [2,6,50] -> 6
    np.testing.assert_allclose(coordinate_median(X, mask), [2.5, 2.0, 6.0])


def test_trimmed_mean_by_hand_equals_flowers() -> None:
    from flwr.serverapp.strategy.fedtrimmedavg import trim_mean

    # beta 0.2 of 5: int(1.0) = 1 cut each end -> the middle three
    np.testing.assert_allclose(trimmed_mean(X, 0.2), [3.0, 2.0, 11 / 3])
    np.testing.assert_allclose(trimmed_mean(X, 0.2), trim_mean(X, 0.2))


def test_trimmed_mean_with_a_mask_cuts_per_coordinate_count() -> None:
    mask = np.ones_like(X, dtype=bool)
    mask[[3, 4], 1] = False  # coordinate 1 kept by 3: int(0.4 * 3) = 1 cut -> median 2
    mask[4, 0] = False  # coordinate 0 kept by 4: int(1.6) = 1 cut -> mean(2, 3)
    np.testing.assert_allclose(trimmed_mean(X, 0.4, mask), [2.5, 2.0, 3.0])


def test_multikrum_selection_by_hand() -> None:
    pts = np.array([[0.0], [1.0], [2.0], [10.0]])
    # n=4, f=1: each row scores its 1 nearest neighbour: 1, 1, 1, 64 -> the first three
    assert multikrum_select(pts, f=1) == [0, 1, 2]
    assert multikrum_select(pts, f=1, m=1) == [0]  # Krum: ties to the lowest index


def test_multikrum_picks_what_flowers_multikrum_picks() -> None:
    from flwr.serverapp.strategy.multikrum import select_multikrum

    rng = np.random.default_rng(0)
    pts = np.vstack([rng.normal(size=(6, 4)), 20 + rng.normal(size=(2, 4))])
    contents = [RecordDict({"arrays": rec(w=p)}) for p in pts]
    theirs = select_multikrum(contents, num_malicious_nodes=2, num_nodes_to_select=5)
    mine = multikrum_select(pts.astype(np.float32).astype(np.float64), f=2, m=5)
    assert [contents.index(c) for c in theirs] == mine
    assert not {6, 7} & set(mine)


def test_centered_clip_by_hand() -> None:
    x = np.array([[3.0, 4.0], [0.0, 1.0]])  # distances 5 and 1 from the origin
    # tau 1, one iteration: (3,4) clipped to (0.6, 0.8); v = mean((0.6,0.8), (0,1))
    v, clipped = centered_clip(x, np.zeros(2), tau=1.0, iterations=1)
    np.testing.assert_allclose(v, [0.3, 0.9])
    assert clipped == 1
    # a huge tau is the plain mean
    v, clipped = centered_clip(x, np.zeros(2), tau=100.0, iterations=1)
    np.testing.assert_allclose(v, [1.5, 2.5])
    assert clipped == 0


def test_centered_clip_with_a_mask_clips_over_own_coordinates() -> None:
    x = np.array([[3.0, 40.0], [1.0, 0.0]])
    mask = np.array([[True, False], [True, True]])
    # row 0 distance over coordinate 0 only: 3 -> scale 1/3 -> step (1, 0); row 1: 1, no clip
    v, _ = centered_clip(x, np.zeros(2), tau=1.0, iterations=1, mask=mask)
    np.testing.assert_allclose(v, [(1.0 + 1.0) / 2, 0.0 / 1])


def test_min_keepers() -> None:
    assert min_keepers(rule_spec("median")) == 3
    assert min_keepers(rule_spec("trimmed-mean", beta=0.2)) == 5  # int(0.2 * 5) = 1
    assert min_keepers(rule_spec("trimmed-mean", beta=0.4)) == 3
    assert min_keepers(rule_spec("multikrum")) == 1


def test_few_keepers_fall_back_to_their_weighted_mean_and_are_counted() -> None:
    mask = np.ones_like(X, dtype=bool)
    mask[2:, 0] = False  # coordinate 0 kept by rows 0, 1 only
    mask[:, 2] = False  # coordinate 2 kept by nobody: the base
    w = np.array([1.0, 3.0, 1.0, 1.0, 1.0])
    out = robust_aggregate(rule_spec("median"), X, w, mask, base=np.array([0.0, 0.0, -7.0]))
    np.testing.assert_allclose(out.vector, [(1 + 6) / 4, 2.0, -7.0])
    assert out.fallback == 1
    # without masks, too few replies for the rule: every coordinate is the mean
    out = robust_aggregate(rule_spec("median"), X[:2])
    np.testing.assert_allclose(out.vector, X[:2].mean(axis=0))
    assert out.fallback == 3


def test_rule_spec_names_the_choices() -> None:
    with pytest.raises(ValueError, match="valid choices: off, median, trimmed-mean"):
        rule_spec("mean")
    with pytest.raises(ValueError, match="unknown parameter.*valid: beta"):
        rule_spec("trimmed-mean", f=1)
    with pytest.raises(ValueError, match=r"beta=0.5 must be in \[0, 0.5\)"):
        rule_spec("trimmed-mean", beta=0.5)
    assert RobustRule("centered-clip") is RobustRule.CENTERED_CLIP


# --- under the round loop, on the fake grid -------------------------------------------------


def _adds(delta: float, n: int = 1):
    def handle(msg: Message) -> Message:
        w = msg.content["arrays"]["w"].numpy() + delta
        metrics = MetricRecord({"num-examples": n, "train-loss": 1.0})
        return Message(RecordDict({"arrays": rec(w=w), "metrics": metrics}), reply_to=msg)

    return handle


DELTAS = [1.0, 2.0, 3.0, 4.0, -9.0]  # the last one an attacker inside a loose norm bound


def _run(strategy, rounds: int = 1, deltas=DELTAS):
    grid = FakeGrid({i + 1: _adds(d) for i, d in enumerate(deltas)})
    rows = Rows()
    loop = RoundLoop(
        strategy, grid, evaluate_fn=no_eval, callbacks=[rows], screening=Screening(norm_factor=0)
    )
    out = loop.run(rec(w=np.zeros(2)), rounds)  # type: ignore[arg-type]
    return out.arrays["w"].numpy(), rows


def test_robust_median_under_the_loop_is_the_hand_median() -> None:
    got, rows = _run(RobustAggregation(FedAvg(fraction_evaluate=0.0, **ONE), rule="median"))
    np.testing.assert_allclose(got, [2.0, 2.0])  # median(1, 2, 3, 4, -9)
    row = rows.last(RobustRow)
    assert (row.robust_rule, row.robust_fallback) == ("median", 0)
    fedavg, _ = _run(FedAvg(fraction_evaluate=0.0, **ONE))
    np.testing.assert_allclose(fedavg, [0.2, 0.2], rtol=1e-6)  # what the attacker does to the mean


def test_task_vector_stopping_over_flowers_trimmed_mean() -> None:
    inner = FedTrimmedAvg(fraction_evaluate=0.0, beta=0.2, **ONE)
    got, rows = _run(TaskVectorStopping(inner, patience=5), rounds=2)
    # each round: sorted (-9, 1, 2, 3, 4) cut 1 each end -> mean(1, 2, 3) = 2
    np.testing.assert_allclose(got, [4.0, 4.0])
    assert len(rows.results[-1].participants) == 5


@pytest.mark.parametrize(
    ("inner", "want"),
    [
        (lambda: FedMedian(fraction_evaluate=0.0, **ONE), 2.0),
        # n=5, f=1: each scores its 2 nearest: 10, 4, 4, 10, ... -> node 2 (a tie with 3)
        (lambda: Krum(fraction_evaluate=0.0, num_malicious_nodes=1, **ONE), 2.0),
        (
            lambda: MultiKrum(
                fraction_evaluate=0.0, num_malicious_nodes=1, num_nodes_to_select=3, **ONE
            ),
            2.0,
        ),
    ],
)
def test_flowers_robust_strategies_under_task_vector_stopping(inner, want: float) -> None:
    got, rows = _run(TaskVectorStopping(inner(), patience=5))
    np.testing.assert_allclose(got, [want, want])
    # FedMedian empties the replies' arrays as it aggregates: the upload is counted before
    assert all(r.bytes_up > 0 for r in rows.results)


@pytest.mark.parametrize(
    ("rule", "params", "want"),
    [
        ("trimmed-mean", {"beta": 0.2}, 2.0),
        ("multikrum", {"f": 1, "m": 3}, 2.0),  # 1, 2, 3 are closest together
        ("centered-clip", {"tau": 100.0, "iterations": 1}, 0.2),  # radius beyond all: mean
    ],
)
def test_each_rule_under_the_loop(rule: str, params: dict, want: float) -> None:
    got, rows = _run(RobustAggregation(FedAvg(fraction_evaluate=0.0, **ONE), rule, **params))
    np.testing.assert_allclose(got, [want, want], rtol=1e-6)
    if rule == "multikrum":
        # scores 10, 4, 4, 10, 338 (2 nearest, both coordinates): best first, ties by order
        assert rows.last(RobustRow).robust_selected == ["node-2", "node-3", "node-1"]


def test_robust_aggregation_refuses_inners_it_cannot_replace() -> None:
    with pytest.raises(ValueError, match="FedMedian aggregates otherwise"):
        RobustAggregation(FedMedian(), rule="median")
    with pytest.raises(ValueError, match="not the wrapper TaskVectorStopping"):
        RobustAggregation(TaskVectorStopping(FedAvg()), rule="median")
    with pytest.raises(ValueError, match="valid choices"):
        RobustAggregation(FedAvg(), rule="krum")


# --- CA-HFP: the rule over the devices that kept each coordinate ----------------------------


class LinePlan:
    """A pruning plan for a 'model' of one vector ``w`` of 4 entries: one channel group
    ``g`` whose channel i is entry i (no torch needed)."""

    def full_kept(self) -> dict[str, np.ndarray]:
        return {"g": np.arange(4, dtype=np.int64)}

    def validate_kept(self, kept) -> str | None:
        return None

    def index_maps(self, kept) -> dict[str, np.ndarray]:
        return {"w": np.asarray(kept["g"], dtype=np.int64)}

    def compact_shapes(self, kept) -> dict[str, tuple[int, ...]]:
        return {"w": (len(kept["g"]),)}


def _keeps(delta: float, kept: list[int] | None, device: int):
    from edgefleet.pruning.wire import KEPT, kept_record

    def handle(msg: Message) -> Message:
        w = msg.content["arrays"]["w"].numpy() + delta
        metrics = MetricRecord({"num-examples": 1, "device-id": device})
        content = RecordDict({"arrays": rec(w=w if kept is None else w[kept]), "m": metrics})
        if kept is not None:
            content[KEPT] = kept_record({"g": np.asarray(kept, dtype=np.int64)})
        return Message(content, reply_to=msg)

    return handle


# device 1 full; 2, 3 keep entries 0-2; 4 keeps 0-1; 5 (the attacker) keeps entry 0 only
PRUNED = {
    1: (1.0, None),
    2: (2.0, [0, 1, 2]),
    3: (3.0, [0, 1, 2]),
    4: (4.0, [0, 1]),
    5: (-9.0, [0]),
}


def _pruned_run(strategy):
    grid = FakeGrid({n: _keeps(d, k, n) for n, (d, k) in PRUNED.items()})
    rows = Rows()
    loop = RoundLoop(
        strategy, grid, evaluate_fn=no_eval, callbacks=[rows], screening=Screening(norm_factor=0)
    )
    out = loop.run(rec(w=np.zeros(4)), 1)  # type: ignore[arg-type]
    return out.arrays["w"].numpy(), rows


def test_median_over_pruned_submodels_counts_only_the_keepers() -> None:
    from edgefleet.strategies import SubmodelReconstruction

    inner = RobustAggregation(FedAvg(fraction_evaluate=0.0, **ONE), rule="median")
    got, rows = _pruned_run(SubmodelReconstruction(inner, LinePlan))
    # entry 0: median(1, 2, 3, 4, -9) = 2; entry 1: median(1, 2, 3, 4) = 2.5;
    # entry 2: median(1, 2, 3) = 2; entry 3 kept by device 1 alone: its value, a fallback
    np.testing.assert_allclose(got, [2.0, 2.5, 2.0, 1.0])
    assert rows.last(RobustRow).robust_fallback == 1
    # the same rule over the rebuilt arrays without masks lets the fill vote: entry 3 is 0
    plain = RobustAggregation(FedAvg(fraction_evaluate=0.0, **ONE), rule="off")
    fedavg, _ = _pruned_run(SubmodelReconstruction(plain, LinePlan))
    np.testing.assert_allclose(fedavg, [0.2, 2.0, 1.2, 0.2], rtol=1e-6)


def test_trimmed_mean_over_pruned_submodels() -> None:
    from edgefleet.strategies import SubmodelReconstruction

    inner = RobustAggregation(FedAvg(fraction_evaluate=0.0, **ONE), "trimmed-mean", beta=0.34)
    got, rows = _pruned_run(SubmodelReconstruction(inner, LinePlan))
    # needs 3 keepers (int(0.34 * 3) = 1): entry 0 of 5 cut 1 each end: mean(1, 2, 3) = 2;
    # entry 1 of 4 cut 1: mean(2, 3); entry 2 of 3 cut 1: 2; entry 3 (1 keeper): fallback
    np.testing.assert_allclose(got, [2.0, 2.5, 2.0, 1.0])
    assert rows.last(RobustRow).robust_fallback == 1


def test_reconstruction_refuses_flowers_robust_strategies_before_round_one() -> None:
    from edgefleet.strategies import SubmodelReconstruction

    with pytest.raises(ValueError, match=r"Flower's FedTrimmedAvg.*robust.rule = 'trimmed-mean'"):
        SubmodelReconstruction(TaskVectorStopping(FedTrimmedAvg()), LinePlan)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Flower's Krum.*'multikrum'"):
        SubmodelReconstruction(Krum(), LinePlan)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reconstruction 'global'"):
        SubmodelReconstruction(
            RobustAggregation(FedAvg(), rule="median"),
            LinePlan,
            reconstruction="elementwise",  # type: ignore[arg-type]
        )


# --- FedSAG: robust memory and max-age against a stale poisoned entry -----------------------


def _stale_poisoner(device: int):
    """Uploads one huge poisoned update (-100) in its first round, then declines forever."""
    from flwr.app import Error

    seen: list[int] = []

    def handle(msg: Message) -> Message:
        seen.append(1)
        if len(seen) > 1:
            return Message(Error(1, "away"), reply_to=msg)
        w = msg.content["arrays"]["w"].numpy() - 100.0
        metrics = MetricRecord({"num-examples": 1, "device-id": device})
        return Message(RecordDict({"arrays": rec(w=w), "m": metrics}), reply_to=msg)

    return handle


def _honest(device: int):
    def handle(msg: Message) -> Message:
        w = msg.content["arrays"]["w"].numpy() + 1.0
        metrics = MetricRecord({"num-examples": 1, "device-id": device})
        return Message(RecordDict({"arrays": rec(w=w), "m": metrics}), reply_to=msg)

    return handle


def _fedsag_run(rounds: int = 3, **kw):
    from edgefleet.strategies import FedSAG

    strategy = FedSAG(correction="participants", fraction_evaluate=0.0, **ONE, **kw)
    grid = FakeGrid({1: _honest(1), 2: _honest(2), 3: _honest(3), 4: _stale_poisoner(4)})
    rows = Rows()
    loop = RoundLoop(
        strategy, grid, evaluate_fn=no_eval, callbacks=[rows], screening=Screening(norm_factor=0)
    )
    out = loop.run(rec(w=np.zeros(2)), rounds)  # type: ignore[arg-type]
    return out.arrays["w"].numpy(), rows


def test_a_stale_poisoned_memory_stays_in_the_mean_without_max_age() -> None:
    got, _ = _fedsag_run()
    # round 1: zero memories, v = (1 + 1 + 1 - 100) / 4 = -24.25; later rounds: the memory
    # mean (1 + 1 + 1 - 100) / 4 and zero corrections: -24.25 again, every round
    np.testing.assert_allclose(got, [-72.75, -72.75])


def test_max_age_expires_the_stale_poisoned_memory() -> None:
    got, rows = _fedsag_run(max_age=1)
    # rounds 1 and 2 as above; in round 3 device 4's memory (round 1) is 2 > 1 rounds old:
    # the mean is (1 + 1 + 1 + 0) / 4 = 0.75 (it still counts in K, with the zero memory)
    np.testing.assert_allclose(got, [-47.75, -47.75])
    assert rows.results[2].context.section(RobustRow).saga_expired == ["4"]
    assert rows.results[1].context.find(RobustRow) is None


def test_the_median_out_votes_the_stale_poisoned_memory() -> None:
    got, rows = _fedsag_run(robust="median")
    # round 1: memories all zero -> 0; corrections' median(1, 1, 1, -100) = 1; v = 1/4 x 4 x 1.
    # later: median of the memories (1, 1, 1, -100) = 1, corrections zero: v = 1 each round
    np.testing.assert_allclose(got, [3.0, 3.0])
    assert rows.last(RobustRow).robust_rule == "median"


def test_robust_fedsag_with_the_mean_rule_is_fedsag() -> None:
    # trimmed mean with beta 0 trims nothing: the formula of the plain memory mean
    plain, _ = _fedsag_run()
    robust, _ = _fedsag_run(robust="trimmed-mean", robust_params={"beta": 0.0})
    np.testing.assert_allclose(robust, plain)


def test_saga_expiry_keeps_the_sum_and_the_checkpoint_consistent() -> None:
    from edgefleet.algorithms.saga import SagaMemory

    mem = SagaMemory(3)
    mem.store({"a": np.ones(3), "b": 2 * np.ones(3)}, round=1)
    mem.store({"c": 4 * np.ones(3)}, round=3)
    assert mem.expire(now=3, max_age=1) == ["a", "b"]
    np.testing.assert_allclose(mem.mean(), mem.recompute_mean())
    np.testing.assert_allclose(mem.mean(), 4 / 3 * np.ones(3))  # K = 3, two zero memories
    again = SagaMemory(3)
    again.load_state_dict(mem.state_dict())
    assert again.stamp("c") == 3 and not again.has_memory("a")


# --- run config, the server's strategy and the attackers of EdgeFleet's ClientApp -----------


def test_robust_and_attack_keys_parse_and_name_their_errors() -> None:
    from edgefleet.config import ConfigError, parse_run_config

    cfg = parse_run_config({"robust.rule": "trimmed-mean", "robust.beta": 0.3})
    assert cfg.robust.params() == {"beta": 0.3}
    with pytest.raises(ConfigError, match="must be one of off, median"):
        parse_run_config({"robust.rule": "krum"})
    with pytest.raises(ConfigError, match="reconstruction 'global'"):
        parse_run_config({"robust.rule": "median", "pruning.reconstruction": "elementwise"})
    with pytest.raises(ConfigError, match="needs 'attack.sybil-ids'"):
        parse_run_config({"attack.kind": "sybil"})
    assert parse_run_config({"attack.sybil-ids": "7,9"}).attack.sybil_ids == (7, 9)


def test_build_strategy_composes_energy_age_fedsag_pruning_and_the_rule() -> None:
    from edgefleet.config import parse_run_config
    from edgefleet.loop.base import find_wrapper
    from edgefleet.server.app import build_strategy
    from edgefleet.strategies import EnergyAgeSelection, FedSAG, SubmodelReconstruction

    cfg = parse_run_config(
        {"strategy": "fedsag", "selection.mode": "energy-age", "robust.rule": "median",
         "saga.max-age": 5, "pruning.keep-ratios": "1.0,0.5"}
    )  # fmt: skip
    s = build_strategy(cfg)
    assert isinstance(s, EnergyAgeSelection) and isinstance(s.inner, SubmodelReconstruction)
    sag = find_wrapper(s, FedSAG)
    assert sag is not None and sag.robust.rule == "median" and sag.max_age == 5
    assert find_wrapper(s, RobustAggregation) is None  # FedSAG takes the rule itself
    s = build_strategy(parse_run_config({"robust.rule": "multikrum", "robust.f": 2}))
    assert isinstance(s, SubmodelReconstruction) and isinstance(s.inner, RobustAggregation)
    assert s.inner.spec.params() == {"f": 2, "m": 0}


def test_attack_keys_are_refused_under_the_deployment_engine() -> None:
    from flwr.superlink.grid import HttpGrid

    from edgefleet.config import DEFAULTS, ConfigError
    from edgefleet.server.app import refuse_attacks_outside_simulation

    deployment = HttpGrid.__new__(HttpGrid)  # the Deployment Engine's grid (not connected)
    raw = {**DEFAULTS, "attack.kind": "sign-flip"}
    with pytest.raises(ConfigError, match=r"'attack.kind'.*Simulation Engine only"):
        refuse_attacks_outside_simulation(raw, deployment)
    refuse_attacks_outside_simulation(DEFAULTS, deployment)  # defaults: no attack asked
    refuse_attacks_outside_simulation(raw, FakeGrid({}))  # type: ignore[arg-type]


def test_attacker_partitions_are_seeded_and_sized() -> None:
    from edgefleet.client.app import attacker_partitions

    assert attacker_partitions(20, 0.2, 0) == attacker_partitions(20, 0.2, 0)
    assert len(attacker_partitions(20, 0.2, 0)) == 4
    assert attacker_partitions(20, 0.2, 0) != attacker_partitions(20, 0.2, 1)
    assert len(attacker_partitions(3, 0.01, 0)) == 1  # at least one


def test_the_clientapp_attacks_from_the_run_config() -> None:
    from flwr.app import ConfigRecord, Context
    from flwr.common import MessageType

    from edgefleet.client.app import attacker_partitions, run_config_attacks

    FakeGrid({})
    sent = np.array([1.0, 2.0, 3.0])
    run = {"attack.kind": "sign-flip", "attack.fraction": 0.5}
    attackers = attacker_partitions(4, 0.5, 0)

    def honest(msg: Message, context: Context) -> Message:
        w = msg.content["arrays"]["w"].numpy() + np.array([1.0, 0.0, -1.0])
        return Message(RecordDict({"arrays": rec(w=w), "metrics": MetricRecord(
            {"num-examples": 1})}), reply_to=msg)  # fmt: skip

    for p in range(4):
        msg = Message(
            RecordDict({"arrays": rec(w=sent), "config": ConfigRecord({"server-round": 1})}),
            dst_node_id=1,
            message_type=MessageType.TRAIN,
        )
        ctx = Context(1, p + 1, {"partition-id": p, "num-partitions": 4}, RecordDict(), run)
        got = run_config_attacks(msg, ctx, honest).content["arrays"]["w"].numpy() - sent
        want = [-1.0, 0.0, 1.0] if p in attackers else [1.0, 0.0, -1.0]
        np.testing.assert_allclose(got, want, atol=1e-6)
