"""Energy-aware age-based selection (EH-FedSAG, arXiv 2606.18758)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from edgefleet.algorithms.selection import (
    AgeTracker,
    SelectionError,
    query_order,
    select_by_age,
    select_in_batches,
)
from edgefleet.client.battery import Battery, BernoulliSource


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_at_most_m_only_feasible_largest_age_first() -> None:
    ages = {"a": 5, "b": 9, "c": 1, "d": 7, "e": 3, "f": 8}
    feasible = {"a", "c", "d", "e", "f"}  # b is the oldest but cannot afford a round
    assert select_by_age(ages, feasible, 3, _rng()) == ["f", "d", "a"]
    assert select_by_age(ages, feasible, 10, _rng()) == ["f", "d", "a", "e", "c"]
    assert select_by_age(ages, feasible, 0, _rng()) == []
    assert select_by_age(ages, set(), 3, _rng()) == []


def test_ties_random_but_seeded() -> None:
    ages = {f"d{i}": (1 if i < 20 else 0) for i in range(30)}  # twenty tied at age 1
    feasible = list(ages)
    picks = [tuple(select_by_age(ages, feasible, 5, _rng(s))) for s in range(200)]
    # same seed, same pick; input order does not matter
    assert picks[0] == tuple(select_by_age(ages, list(reversed(feasible)), 5, _rng(0)))
    assert all(i in {f"d{j}" for j in range(20)} for p in picks for i in p)
    # different seeds pick differently, and every tied device is picked about equally
    assert len(set(picks)) > 150
    counts = Counter(i for p in picks for i in p)
    assert set(counts) == {f"d{j}" for j in range(20)}
    # each is picked with probability 5/20 per draw: 50 of 200 expected
    assert all(25 <= c <= 75 for c in counts.values())


def test_random_order_is_a_uniform_sample_of_the_feasible_whatever_their_age() -> None:
    # a is by far the oldest; age order always takes it first, random order does not
    ages = {"a": 50, "b": 0, "c": 0, "d": 1}
    feasible = ["a", "b", "c"]  # d cannot afford a round
    assert all(select_by_age(ages, feasible, 1, _rng(s))[0] == "a" for s in range(50))
    picks = Counter(
        select_by_age(ages, feasible, 1, _rng(s), order="random")[0] for s in range(300)
    )
    assert set(picks) == {"a", "b", "c"}
    assert all(70 <= c <= 130 for c in picks.values())  # 100 each expected
    # the random order is the tie order of a draw, the same with or without ages
    same = {i: 0 for i in ages}
    assert query_order(ages, ages, _rng(7), "random") == query_order(same, same, _rng(7))
    # and the batched walk still returns what selection over everyone returns
    order = query_order(ages, ages, _rng(8), "random")
    batched, _ = select_in_batches(order, lambda b: {i: i in feasible for i in b}, 2, 1)
    assert batched == select_by_age(ages, feasible, 2, _rng(8), order="random")
    with pytest.raises(SelectionError, match="valid: age, random"):
        query_order(ages, ages, _rng(), "oldest")


def test_query_order_draws_one_number_whatever_the_input() -> None:
    a, b = _rng(3), _rng(3)
    query_order({"x": 1, "y": 1}, ["x", "y"], a)
    query_order({}, [], b)
    assert a.random() == b.random()


def test_missing_age_and_bad_arguments() -> None:
    with pytest.raises(SelectionError, match="no age for 1 device"):
        select_by_age({"a": 1}, ["a", "zz"], 2, _rng())
    with pytest.raises(SelectionError, match="max_devices=-1"):
        select_by_age({"a": 1}, ["a"], -1, _rng())
    with pytest.raises(SelectionError, match="batch_size=0"):
        select_in_batches(["a"], lambda b: {}, 1, 0)


def test_age_tracker_resets_on_upload_and_ages_the_rest() -> None:
    t = AgeTracker()
    t.register(["a", "b", "c"])
    assert dict(t.ages) == {"a": 0, "b": 0, "c": 0}
    t.on_round(uploaded=["a"], known=["a", "b", "c"])
    assert dict(t.ages) == {"a": 0, "b": 1, "c": 1}
    t.on_round(uploaded=["b"], known=["a", "b"])  # c offline: it still ages
    assert dict(t.ages) == {"a": 1, "b": 0, "c": 2}
    # newcomers first: a device first seen now ranks with those that never uploaded
    t.register(["n"])
    assert t.ages["n"] == 2
    assert select_by_age(t.ages, ["a", "b", "n"], 1, _rng()) == ["n"]
    t.on_round(uploaded=[], known=["a", "b", "c", "n"])
    assert dict(t.ages) == {"a": 2, "b": 1, "c": 3, "n": 3}
    with pytest.raises(TypeError):
        t.ages["a"] = 0  # type: ignore[index]


def test_age_tracker_fixed_newcomer_age_and_state_round_trip() -> None:
    t = AgeTracker(newcomer_age=0)
    t.on_round(uploaded=["a"], known=["a", "b"])
    t.on_round(uploaded=[], known=["a", "b", "late"])
    assert dict(t.ages) == {"a": 1, "b": 2, "late": 1}
    state = json.loads(json.dumps(t.state_dict()))  # JSON-able
    u = AgeTracker()
    u.load_state_dict(state)
    assert dict(u.ages) == dict(t.ages) and u.rounds == 2 and u.newcomer_age == 0
    with pytest.raises(SelectionError, match="malformed"):
        u.load_state_dict({"ages": {}})
    with pytest.raises(SelectionError):
        AgeTracker(newcomer_age=-1)


def _status_query(
    feasible: set[str], online: set[str], calls: list[list[str]]
) -> Callable[[list[str]], dict[str, bool]]:
    def ask(batch: list[str]) -> dict[str, bool]:
        calls.append(batch)
        # a device that does not answer (offline) is simply missing from the reply
        return {i: i in feasible for i in batch if i in online}

    return ask


def test_batched_selection_equals_full_selection_and_queries_fewer() -> None:
    rng = _rng(42)
    for trial in range(50):
        k = int(rng.integers(20, 200))
        ids = [f"dev-{i}" for i in range(k)]
        ages = {i: int(rng.integers(0, 6)) for i in ids}  # few distinct ages: many ties
        online = [i for i in ids if rng.random() < 0.9]
        feasible = {i for i in online if rng.random() < 0.5}
        m = int(rng.integers(1, 30))
        seed = int(rng.integers(2**31))
        full = select_by_age(ages, feasible, m, _rng(seed))
        calls: list[list[str]] = []
        ask = _status_query(feasible, set(online), calls)
        order = query_order(ages, ids, _rng(seed))
        batched, queried = select_in_batches(order, ask, m, batch_size=8)
        assert batched == full, trial
        assert queried == sum(len(c) for c in calls)
        assert all(len(c) <= 8 for c in calls)
    # a large fleet where most devices can afford a round: far fewer status messages
    ids = [f"dev-{i}" for i in range(1000)]
    ages = {i: n % 7 for n, i in enumerate(ids)}
    feasible = {i for n, i in enumerate(ids) if n % 3}
    seed = 5
    order = query_order(ages, ids, _rng(seed))
    batched, queried = select_in_batches(
        order, lambda b: {i: i in feasible for i in b}, 25, batch_size=32
    )
    assert batched == select_by_age(ages, feasible, 25, _rng(seed))
    assert len(batched) == 25 and queried <= 96


def test_batched_selection_with_too_few_feasible_queries_everyone() -> None:
    ages = {"a": 3, "b": 2, "c": 1}
    selected, queried = select_in_batches(
        query_order(ages, ages, _rng()), lambda b: {"b": True} if "b" in b else {}, 2, 2
    )
    assert selected == ["b"] and queried == 3


def test_fairness_every_harvesting_device_uploads() -> None:
    # 42 devices with a mix of harvest probabilities, some never harvesting; rounds of
    # Omega + 1 slots; the M oldest feasible devices upload and pay for it.
    omega, m, rounds = 3, 5, 200
    probs = [0.0, 0.02, 0.05, 0.1, 0.3, 0.6, 1.0] * 6
    ids = [f"dev-{i}" for i in range(len(probs))]
    batteries = {
        i: Battery(10.0, BernoulliSource(seed=n, prob=p), level=0.0)
        for n, (i, p) in enumerate(zip(ids, probs, strict=True))
    }
    cost = Battery.round_cost(omega)
    tracker = AgeTracker()
    tracker.register(ids)
    rng = _rng(0)
    uploads: Counter[str] = Counter()
    for r in range(rounds):
        slot = r * (omega + 1)
        feasible = [i for i in ids if batteries[i].advance(slot) >= cost]
        selected = select_by_age(tracker.ages, feasible, m, rng)
        assert len(selected) <= m and set(selected) <= set(feasible)
        ages_now = [tracker.ages[i] for i in selected]
        assert ages_now == sorted(ages_now, reverse=True)
        # no unselected feasible device is older than a selected one
        if len(selected) == m:
            rest = [tracker.ages[i] for i in feasible if i not in selected]
            assert not rest or max(rest) <= min(ages_now)
        for i in selected:
            batteries[i].spend(cost)
        uploads.update(selected)
        tracker.on_round(uploaded=selected, known=ids)
    last_slot = (rounds - 1) * (omega + 1)
    for n, (i, p) in enumerate(zip(ids, probs, strict=True)):
        harvested = BernoulliSource(n, p).arrivals(0, last_slot).sum()
        # energy bounds participation: nobody uploads more than its harvest pays for
        assert uploads[i] * cost <= harvested
        if p > 0:
            # every harvesting device got there (and these seeds give each one enough)
            assert harvested >= cost and uploads[i] >= 1, (i, p)
        else:
            assert uploads[i] == 0
    # age priority spreads the uploads: the rarely charged devices upload about as often as
    # their harvest allows, not starved by the always-charged ones
    for n, (i, p) in enumerate(zip(ids, probs, strict=True)):
        if 0 < p <= 0.05:
            harvested = BernoulliSource(n, p).arrivals(0, last_slot).sum()
            assert uploads[i] >= harvested // cost - 1, (i, p, uploads[i], harvested)
