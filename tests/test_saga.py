"""SAGA server memory (EH-FedSAG, arXiv 2606.18758)."""

from __future__ import annotations

import numpy as np
import pytest

from edgefleet.algorithms.saga import (
    SagaError,
    SagaMemory,
    flatten,
    unflatten,
)


def saga_step(
    memory_mean: np.ndarray, deltas: list[np.ndarray], memories: list[np.ndarray]
) -> np.ndarray:
    """v = memory_mean + mean over participants of (delta_k - m_k); no participant -> 0.

    The reference form of :meth:`SagaMemory.direction`, from explicit inputs (the
    seed's, weight 1/|S|), which the memory must reproduce.
    """
    if not deltas:
        return np.zeros_like(memory_mean, dtype=np.float64)
    correction = np.zeros(memory_mean.shape, dtype=np.float64)
    for d, m in zip(deltas, memories, strict=True):
        correction += np.asarray(d, dtype=np.float64) - np.asarray(m, dtype=np.float64)
    return np.asarray(memory_mean, dtype=np.float64) + correction / len(deltas)


def _vec(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=np.float64)


def test_hand_computed_two_rounds_zeros_init() -> None:
    # Three devices a, b, c; D = 2; memories start at zero.
    mem = SagaMemory(dim=2, init="zeros", dtype=np.float64)
    for i in ("a", "b", "c"):
        mem.register(i)
    # Round 1: a and b participate.
    #   mean of memories = 0
    #   correction = mean([2,4] - 0, [4,0] - 0) = [3, 2]
    #   v1 = [3, 2]; then a = [2,4], b = [4,0], c = 0
    v1 = mem.direction({"a": _vec(2, 4), "b": _vec(4, 0)})
    np.testing.assert_allclose(v1, [3.0, 2.0])
    # Round 2: b and c participate.
    #   mean of memories = ([2,4] + [4,0] + [0,0]) / 3 = [2, 4/3]
    #   correction = mean([1,1] - [4,0], [3,6] - [0,0]) = mean([-3,1], [3,6]) = [0, 3.5]
    #   v2 = [2, 4/3 + 7/2] = [2, 29/6]; then b = [1,1], c = [3,6]
    v2 = mem.direction({"b": _vec(1, 1), "c": _vec(3, 6)})
    np.testing.assert_allclose(v2, [2.0, 29 / 6])
    np.testing.assert_allclose(mem.memory("a"), [2, 4])
    np.testing.assert_allclose(mem.memory("b"), [1, 1])
    np.testing.assert_allclose(mem.memory("c"), [3, 6])
    np.testing.assert_allclose(mem.mean(), [2.0, 11 / 3])  # ([2,4]+[1,1]+[3,6]) / 3
    # the reference function from the same explicit inputs
    np.testing.assert_allclose(
        saga_step(_vec(2, 4 / 3), [_vec(1, 1), _vec(3, 6)], [_vec(4, 0), _vec(0, 0)]), v2
    )


def test_hand_computed_two_rounds_first_update_init() -> None:
    # Same data; a device's first delta becomes its memory before v is formed.
    mem = SagaMemory(dim=2, init="first-update", dtype=np.float64)
    for i in ("a", "b", "c"):
        mem.register(i)
    # Round 1: a, b new: a = [2,4], b = [4,0]; corrections zero.
    #   v1 = mean of memories = ([2,4] + [4,0] + [0,0]) / 3 = [2, 4/3]
    v1 = mem.direction({"a": _vec(2, 4), "b": _vec(4, 0)})
    np.testing.assert_allclose(v1, [2.0, 4 / 3])
    # Round 2: c new: c = [3,6] first, correction 0; b: [1,1] - [4,0] = [-3, 1].
    #   mean of memories = ([2,4] + [4,0] + [3,6]) / 3 = [3, 10/3]
    #   correction = ([-3,1] + [0,0]) / 2 = [-1.5, 0.5]
    #   v2 = [1.5, 23/6]; then b = [1,1]
    v2 = mem.direction({"b": _vec(1, 1), "c": _vec(3, 6)})
    np.testing.assert_allclose(v2, [1.5, 23 / 6])
    np.testing.assert_allclose(mem.memory("b"), [1, 1])
    np.testing.assert_allclose(mem.mean(), [2.0, 11 / 3])


def test_first_update_correction_is_exactly_zero_in_float32() -> None:
    # 0.1 is not a float32 number; the newcomer's correction must not be delta - f32(delta)
    mem = SagaMemory(dim=1, init="first-update", dtype=np.float32)
    v = mem.direction({"a": _vec(0.1)})
    assert v[0] == np.float64(np.float32(0.1))  # = mean of memories, K = 1


def test_default_init_is_zeros() -> None:
    assert SagaMemory(dim=3).init == "zeros"
    assert SagaMemory(dim=3).dtype == np.float32


def test_no_participants_gives_zero_direction() -> None:
    mem = SagaMemory(dim=4)
    mem.direction({"a": np.ones(4)})
    before = mem.state_dict()
    v = mem.direction({})
    np.testing.assert_array_equal(v, np.zeros(4))
    np.testing.assert_array_equal(mem.state_dict()["table"], before["table"])


@pytest.mark.parametrize("init", ["zeros", "first-update"])
def test_full_participation_with_filled_memory_equals_fedavg(init: str) -> None:
    rng = np.random.default_rng(0)
    ids = [f"d{i}" for i in range(6)]
    mem = SagaMemory(dim=50, init=init, dtype=np.float64)
    mem.direction({i: rng.normal(size=50) for i in ids})  # fills every memory
    for _ in range(3):
        deltas = {i: rng.normal(size=50) for i in ids}
        v = mem.direction(deltas)
        np.testing.assert_allclose(v, np.mean(list(deltas.values()), axis=0), atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_running_mean_equals_recomputed_mean(dtype: type) -> None:
    rng = np.random.default_rng(1)
    ids = [f"d{i}" for i in range(40)]
    mem = SagaMemory(dim=30, dtype=dtype, initial_rows=1)  # forces several doublings
    ref_memories: dict[str, np.ndarray] = {}
    for r in range(300):
        part = [str(i) for i in rng.choice(ids, size=int(rng.integers(0, 8)), replace=False)]
        deltas = {i: rng.normal(scale=10.0, size=30) for i in part}
        # reference: the explicit formula over the memories the test keeps itself
        for i in part:
            mem.register(i)
        k = mem.num_devices
        mean_before = sum(ref_memories.values(), np.zeros(30)) / max(k, 1)
        expected = saga_step(
            mean_before,
            [deltas[i] for i in part],
            [ref_memories.get(i, np.zeros(30)) for i in part],
        )
        v = mem.direction(deltas)
        tol = 1e-4 if dtype is np.float32 else 1e-9
        np.testing.assert_allclose(v, expected, atol=tol, err_msg=f"round {r}")
        for i in part:
            ref_memories[i] = deltas[i].astype(dtype).astype(np.float64)
    np.testing.assert_allclose(mem.mean(), mem.recompute_mean(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(
        mem.recompute_mean(), sum(ref_memories.values()) / mem.num_devices, atol=1e-10
    )


def test_registration_grows_k_and_dilutes_the_mean() -> None:
    mem = SagaMemory(dim=1, dtype=np.float64)
    mem.direction({"a": _vec(6.0)})
    assert mem.num_devices == 1
    np.testing.assert_allclose(mem.mean(), [6.0])
    mem.register("b")
    mem.register("c")
    mem.register("a")  # known: no change
    assert mem.num_devices == 3 and mem.device_ids == ["a", "b", "c"]
    np.testing.assert_allclose(mem.mean(), [2.0])
    assert mem.has_memory("a") and not mem.has_memory("b")
    np.testing.assert_array_equal(mem.memory("b"), [0.0])


def test_state_round_trip_resumes_bit_for_bit() -> None:
    rng = np.random.default_rng(2)
    ids = [f"d{i}" for i in range(12)]
    a = SagaMemory(dim=20, init="first-update")
    for _ in range(15):
        part = rng.choice(ids, size=4, replace=False)
        a.direction({str(i): rng.normal(size=20) for i in part})
    state = a.state_dict()
    assert isinstance(state["device_ids"], list) and isinstance(state["table"], np.ndarray)
    b = SagaMemory(dim=20)
    b.load_state_dict(state)
    assert b.init == "first-update" and b.device_ids == a.device_ids
    assert b.nbytes == a.nbytes
    for _ in range(5):
        part = rng.choice(ids + ["new"], size=5, replace=False)
        deltas = {str(i): rng.normal(size=20) for i in part}
        np.testing.assert_array_equal(a.direction(deltas), b.direction(deltas))
    with pytest.raises(SagaError, match="dim 20, this memory has 21"):
        SagaMemory(dim=21).load_state_dict(state)
    with pytest.raises(SagaError, match="malformed"):
        SagaMemory(dim=20).load_state_dict({"dim": 20})


def test_nbytes_counts_rows_in_use() -> None:
    mem = SagaMemory(dim=1000, dtype=np.float32, initial_rows=1)
    base = 1000 * 8  # the float64 running sum
    assert mem.nbytes == base
    mem.direction({f"d{i}": np.ones(1000) for i in range(5)})
    assert mem.nbytes == 5 * 1000 * 4 + base
    assert mem.allocated_nbytes == 8 * 1000 * 4 + base  # 1 -> 2 -> 4 -> 8 rows


def test_bad_input() -> None:
    with pytest.raises(SagaError, match="init='warm' is unknown; valid: zeros, first-update"):
        SagaMemory(dim=2, init="warm")
    with pytest.raises(SagaError, match="float16"):
        SagaMemory(dim=2, dtype=np.float16)
    mem = SagaMemory(dim=2)
    with pytest.raises(SagaError, match=r"device 'a': delta of shape \(3,\), expected \(2,\)"):
        mem.direction({"a": np.ones(3)})
    with pytest.raises(SagaError, match="non-finite"):
        mem.direction({"a": _vec(1.0, np.nan)})
    assert mem.num_devices == 0  # rejected rounds register nothing
    with pytest.raises(SagaError, match="not registered"):
        mem.memory("zz")


def test_flatten_unflatten_round_trip() -> None:
    arrays: dict[str, np.ndarray] = {
        "conv.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bn.num_batches_tracked": np.array(7, dtype=np.int64),
        "fc.bias": np.array([0.5, -1.5], dtype=np.float64),
    }
    vec = flatten(arrays)
    assert vec.dtype == np.float64 and vec.shape == (9,)
    np.testing.assert_array_equal(vec, [0, 1, 2, 3, 4, 5, 7, 0.5, -1.5])
    back = unflatten(vec, arrays)
    assert list(back) == list(arrays)
    for key, a in arrays.items():
        assert back[key].dtype == a.dtype and back[key].shape == a.shape
        np.testing.assert_array_equal(back[key], a)
    # integers are rounded, not truncated
    nudged = vec.copy()
    nudged[6] = 7.9
    assert unflatten(nudged, arrays)["bn.num_batches_tracked"] == 8
    with pytest.raises(SagaError, match="does not fit arrays of 9 entries"):
        unflatten(vec[:-1], arrays)
    assert flatten({}).shape == (0,)


def test_hand_computed_two_rounds_mean_over_stored_memories() -> None:
    # The seed's form: the memory mean runs over the devices that have a memory.
    mem = SagaMemory(dim=2, init="zeros", dtype=np.float64, mean_over="stored")
    for i in ("a", "b", "c"):
        mem.register(i)
    # Round 1: nothing stored yet, mean 0; v1 = mean([2,4], [4,0]) = [3, 2].
    np.testing.assert_allclose(mem.direction({"a": _vec(2, 4), "b": _vec(4, 0)}), [3.0, 2.0])
    np.testing.assert_allclose(mem.mean(), [3.0, 2.0])  # ([2,4] + [4,0]) / 2, c not counted
    # Round 2: mean of the stored a, b = [3, 2];
    #   correction = mean([1,1] - [4,0], [3,6] - 0) = [0, 3.5]; v2 = [3, 5.5]
    v2 = mem.direction({"b": _vec(1, 1), "c": _vec(3, 6)})
    np.testing.assert_allclose(v2, [3.0, 5.5])
    np.testing.assert_allclose(mem.mean(), [2.0, 11 / 3])  # ([2,4]+[1,1]+[3,6]) / 3
    np.testing.assert_allclose(mem.recompute_mean(), mem.mean())
    with pytest.raises(SagaError, match="valid: stored, fleet"):
        SagaMemory(dim=2, mean_over="all")


def test_hand_computed_sag_over_stored_memories() -> None:
    mem = SagaMemory(dim=2, dtype=np.float64, mean_over="stored")
    mem.register("c")  # registered, never uploads: not in the stored mean
    # v = the mean of the stored memories once the participants' are replaced
    v1 = mem.direction({"a": _vec(2, 4), "b": _vec(4, 0)}, estimator="sag")
    np.testing.assert_allclose(v1, [3.0, 2.0])
    v2 = mem.direction({"b": _vec(1, 1)}, estimator="sag")
    np.testing.assert_allclose(v2, [1.5, 2.5])  # ([2,4] + [1,1]) / 2
    with pytest.raises(SagaError, match="valid: saga, sag"):
        mem.direction({"b": _vec(1, 1)}, estimator="svrg")


def test_hand_computed_correction_weight() -> None:
    # Same rounds as the zeros-init test, each correction entering at weight 1/4 instead of
    # 1/|S| = 1/2 (as with a correction floor of 4 participants).
    mem = SagaMemory(dim=2, dtype=np.float64)
    for i in ("a", "b", "c"):
        mem.register(i)
    # Round 1: mean 0; v1 = ([2,4] + [4,0]) / 4 = [1.5, 1]
    v1 = mem.direction({"a": _vec(2, 4), "b": _vec(4, 0)}, correction_weight=0.25)
    np.testing.assert_allclose(v1, [1.5, 1.0])
    # Round 2: mean = [2, 4/3]; corrections [-3,1] + [3,6] = [0, 7]; v2 = [2, 4/3 + 7/4]
    v2 = mem.direction({"b": _vec(1, 1), "c": _vec(3, 6)}, correction_weight=0.25)
    np.testing.assert_allclose(v2, [2.0, 4 / 3 + 7 / 4])
    # the memories are replaced as before: the weight changes only the direction
    np.testing.assert_allclose(mem.mean(), [2.0, 11 / 3])


@pytest.mark.parametrize("mean_over", ["stored", "fleet"])
@pytest.mark.parametrize("estimator", ["saga", "sag"])
def test_direction_without_commit_changes_nothing_and_store_commits(
    mean_over: str, estimator: str
) -> None:
    rng = np.random.default_rng(3)
    a = SagaMemory(dim=8, init="first-update", mean_over=mean_over)
    b = SagaMemory(dim=8, init="first-update", mean_over=mean_over)
    for _ in range(6):
        deltas = {f"d{i}": rng.normal(size=8) for i in rng.choice(5, size=2, replace=False)}
        before = a.state_dict()
        v = a.direction(deltas, estimator=estimator, commit=False)
        after = a.state_dict()
        for key in ("device_ids", "row_ids"):
            assert after[key] == before[key]
        np.testing.assert_array_equal(after["table"], before["table"])
        np.testing.assert_array_equal(after["sum"], before["sum"])
        a.store(deltas)
        np.testing.assert_array_equal(v, b.direction(deltas, estimator=estimator))
        np.testing.assert_array_equal(a.state_dict()["sum"], b.state_dict()["sum"])
        np.testing.assert_array_equal(a.state_dict()["table"], b.state_dict()["table"])
    np.testing.assert_allclose(a.mean(), a.recompute_mean(), atol=1e-12)


def test_delta_beyond_float32_range_is_rejected_before_any_change() -> None:
    # finite in float64, inf once stored in the float32 table
    mem = SagaMemory(dim=2)
    with pytest.raises(SagaError, match="exceeds the float32 memory's range"):
        mem.direction({"a": _vec(1.0, 1e39)})
    assert mem.num_devices == 0
    np.testing.assert_array_equal(mem.mean(), [0.0, 0.0])
    SagaMemory(dim=2, dtype=np.float64).direction({"a": _vec(1.0, 1e39)})  # fits float64


def test_state_round_trip_with_stored_mean() -> None:
    rng = np.random.default_rng(4)
    a = SagaMemory(dim=6, mean_over="stored")
    b = SagaMemory(dim=6, mean_over="stored")
    for i in range(10):
        a.register(f"d{i}")
    for _ in range(8):
        a.direction({f"d{i}": rng.normal(size=6) for i in rng.choice(10, size=3, replace=False)})
    b.load_state_dict(a.state_dict())
    deltas = {"d1": rng.normal(size=6), "new": rng.normal(size=6)}
    np.testing.assert_array_equal(a.direction(deltas), b.direction(deltas))
    np.testing.assert_allclose(b.mean(), b.recompute_mean(), atol=1e-12)
