"""Warm start under device arrival and departure (arXiv 2410.05662): weights, distances,
averaging, the session store and session detection, checked by hand."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from edgefleet.algorithms.tracker import (
    SessionChange,
    SessionError,
    SessionTracker,
    membership_change,
)
from edgefleet.algorithms.warmstart import (
    WARMSTART_MODES,
    SessionStore,
    StoredSession,
    WarmStartError,
    average_states,
    distance_keys,
    pilot_model,
    pseudo_gradient,
    session_distances,
    softmin_weights,
    tensor_distance,
    warm_start_model,
)

# Key names and kinds as in a torch state_dict of Conv2d -> BatchNorm2d -> Linear.
PARAM_KEYS = ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]


def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "conv.weight": f32(4, 1, 3, 3),
        "conv.bias": f32(4),
        "bn.weight": f32(4),
        "bn.bias": f32(4),
        "bn.running_mean": f32(4),
        "bn.running_var": np.abs(f32(4)) + 0.5,
        "bn.num_batches_tracked": np.array(10 * seed + 3, dtype=np.int64),
        "fc.weight": f32(2, 16),
        "fc.bias": f32(2),
    }


def _candidate(session: int) -> StoredSession:
    grad = {k: v for k, v in _model(100 + session).items() if v.dtype.kind == "f"}
    return StoredSession(session, _model(session), grad, [f"dev-{session}", "dev-x"])


def _assert_state_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k])


# -- softmin ------------------------------------------------------------------------------


def test_modes() -> None:
    assert WARMSTART_MODES == ("pilot", "previous", "average", "fresh", "continuous")


def test_softmin_hand_computed() -> None:
    # R = 1, d = [0, ln 2, ln 4]: exp(-d) = [1, 1/2, 1/4], sum 7/4 -> [4/7, 2/7, 1/7]
    w = softmin_weights([0.0, math.log(2), math.log(4)], temperature=1.0)
    np.testing.assert_allclose(w, [4 / 7, 2 / 7, 1 / 7], rtol=1e-12)
    # R = 2 on d / 2 is the same thing; shifting every distance changes nothing
    np.testing.assert_allclose(
        softmin_weights([5.0, 5 + math.log(2) / 2, 5 + math.log(4) / 2], 2.0), w, rtol=1e-12
    )
    assert w.dtype == np.float64


def test_softmin_ties_dominant_and_large_r() -> None:
    w = softmin_weights([0.3, 0.3, 0.3], temperature=7.0)
    assert w[0] == w[1] == w[2]
    np.testing.assert_allclose(w, [1 / 3] * 3)
    # One candidate far nearer than the rest takes (about) all the weight.
    w = softmin_weights([0.0, 1.0, 1.5], temperature=50.0)
    assert w[0] == pytest.approx(1.0, abs=1e-20)
    # Huge R: no overflow, no NaN, exactly one-hot (exp(-1e300) underflows to 0).
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        w = softmin_weights([2.0, 1.0, 1.2], temperature=1e300)
    np.testing.assert_array_equal(w, [0.0, 1.0, 0.0])
    # A single candidate always gets weight 1.
    np.testing.assert_array_equal(softmin_weights([0.7], 3.0), [1.0])


@pytest.mark.parametrize("r", [0.0, -1.0, math.nan, math.inf])
def test_softmin_bad_temperature(r: float) -> None:
    with pytest.raises(WarmStartError, match="temperature"):
        softmin_weights([0.1, 0.2], r)


def test_softmin_bad_distances() -> None:
    with pytest.raises(WarmStartError, match="non-empty"):
        softmin_weights([], 1.0)
    with pytest.raises(WarmStartError, match="finite"):
        softmin_weights([0.1, math.nan], 1.0)


# -- distance -----------------------------------------------------------------------------


def test_distance_keys_drop_biases_and_buffers() -> None:
    state = _model(1)
    assert distance_keys(state, PARAM_KEYS) == ["conv.weight", "bn.weight", "fc.weight"]
    with pytest.raises(WarmStartError, match="not in the model state"):
        distance_keys(state, [*PARAM_KEYS, "head.weight"])


def test_tensor_distance_hand_computed() -> None:
    a = {"w1": np.array([3.0, 4.0]), "w2": np.array([[2.0, 0.0], [0.0, 0.0]])}
    b = {"w1": np.array([4.0, -3.0]), "w2": np.array([[-7.0, 0.0], [0.0, 0.0]])}
    # w1: units [0.6, 0.8] and [0.8, -0.6] are orthogonal -> sqrt(2)
    # w2: units [1, 0, 0, 0] and [-1, 0, 0, 0] are opposite -> 2
    expected = (math.sqrt(2) + 2) / 2
    assert tensor_distance(a, b, ["w1", "w2"]) == pytest.approx(expected, rel=1e-12)
    assert tensor_distance(a, b, ["w1"]) == pytest.approx(math.sqrt(2), rel=1e-12)
    assert tensor_distance(a, a, ["w1", "w2"]) == 0.0
    # float32 inputs give the float64 result
    a32 = {k: v.astype(np.float32) for k, v in a.items()}
    assert tensor_distance(a32, b, ["w1", "w2"]) == pytest.approx(expected, rel=1e-7)


def test_tensor_distance_scale_invariant() -> None:
    a, b = _model(1), _model(2)
    keys = distance_keys(a, PARAM_KEYS)
    base = tensor_distance(a, b, keys)
    scaled_b = {**b, "conv.weight": b["conv.weight"] * 1000.0, "fc.weight": b["fc.weight"] * 0.01}
    scaled_a = {**a, "bn.weight": a["bn.weight"] * 3.5}
    assert tensor_distance(a, scaled_b, keys) == pytest.approx(base, rel=1e-6)
    assert tensor_distance(scaled_a, b, keys) == pytest.approx(base, rel=1e-6)
    assert tensor_distance(a, {**a, "conv.weight": a["conv.weight"] * 7.0}, keys) == (
        pytest.approx(0.0, abs=1e-7)
    )


def test_tensor_distance_ignores_biases_and_buffers() -> None:
    a, b = _model(1), _model(2)
    keys = distance_keys(a, PARAM_KEYS)
    changed = dict(b)
    for k in ("conv.bias", "bn.bias", "fc.bias", "bn.running_mean", "bn.running_var"):
        changed[k] = b[k] + 100.0
    changed["bn.num_batches_tracked"] = np.array(999, dtype=np.int64)
    assert tensor_distance(a, changed, keys) == tensor_distance(a, b, keys)


def test_tensor_distance_zero_tensor_stays_zero() -> None:
    zero = {"w": np.zeros(3)}
    unit = {"w": np.array([0.0, 5.0, 0.0])}
    assert tensor_distance(zero, unit, ["w"]) == 1.0
    assert tensor_distance(zero, zero, ["w"]) == 0.0


def test_tensor_distance_errors() -> None:
    a = {"w": np.ones(3)}
    with pytest.raises(WarmStartError, match="no keys"):
        tensor_distance(a, a, [])
    with pytest.raises(WarmStartError, match="missing"):
        tensor_distance(a, {"v": np.ones(3)}, ["w"])
    with pytest.raises(WarmStartError, match="shapes"):
        tensor_distance(a, {"w": np.ones(4)}, ["w"])
    with pytest.raises(WarmStartError, match="non-finite"):
        tensor_distance(a, {"w": np.array([1.0, np.inf, 0.0])}, ["w"])


# -- averaging ----------------------------------------------------------------------------


def test_pilot_model_averages_params_bn_buffers_and_int_buffer() -> None:
    states = [_model(1), _model(2), _model(3)]
    states[0]["bn.num_batches_tracked"] = np.array(10, dtype=np.int64)
    states[1]["bn.num_batches_tracked"] = np.array(11, dtype=np.int64)
    states[2]["bn.num_batches_tracked"] = np.array(15, dtype=np.int64)
    pilot = pilot_model(states)
    assert list(pilot) == list(states[0])
    for k in pilot:
        assert pilot[k].dtype == states[0][k].dtype, k
        assert pilot[k].shape == states[0][k].shape, k
        if k != "bn.num_batches_tracked":
            expected = sum(s[k].astype(np.float64) for s in states) / 3
            np.testing.assert_allclose(pilot[k], expected, rtol=1e-6, atol=1e-7)
    assert int(pilot["bn.num_batches_tracked"]) == 12  # (10 + 11 + 15) / 3
    np.testing.assert_allclose(  # running statistics are averaged like parameters
        pilot["bn.running_var"],
        (states[0]["bn.running_var"] + states[1]["bn.running_var"] + states[2]["bn.running_var"])
        / 3,
        rtol=1e-6,
    )


def test_average_states_weighted_hand_computed() -> None:
    a: dict[str, np.ndarray] = {"w": np.array([0.0, 3.0], dtype=np.float32)}
    b: dict[str, np.ndarray] = {"w": np.array([3.0, 6.0], dtype=np.float32)}
    a["n"], b["n"] = np.array(10, dtype=np.int64), np.array(20, dtype=np.int64)
    # weights 1 : 2 -> 1/3, 2/3 (normalised); w = [2, 5]; n = 50/3 = 16.67 -> 17
    avg = average_states([a, b], [1.0, 2.0])
    np.testing.assert_allclose(avg["w"], [2.0, 5.0], rtol=1e-7)
    assert avg["w"].dtype == np.float32
    assert avg["n"].dtype == np.int64 and int(avg["n"]) == 17


def test_average_states_errors() -> None:
    a, b = _model(1), _model(2)
    with pytest.raises(WarmStartError, match="no states"):
        average_states([], [])
    with pytest.raises(WarmStartError, match="2 states but 1 weights"):
        average_states([a, b], [1.0])
    with pytest.raises(WarmStartError, match=">= 0"):
        average_states([a, b], [1.0, -0.5])
    with pytest.raises(WarmStartError, match="all zero"):
        average_states([a, b], [0.0, 0.0])
    with pytest.raises(WarmStartError, match="other keys"):
        average_states([a, {k: v for k, v in b.items() if k != "fc.bias"}], [1.0, 1.0])
    with pytest.raises(WarmStartError, match="conv.weight"):
        average_states([a, {**b, "conv.weight": b["conv.weight"][:2]}], [1.0, 1.0])


def test_pseudo_gradient() -> None:
    start, result = _model(1), _model(2)
    g = pseudo_gradient(result, start)
    assert "bn.num_batches_tracked" not in g
    assert list(g) == [k for k in result if k != "bn.num_batches_tracked"]
    for k, v in g.items():
        assert v.dtype == np.float32
        np.testing.assert_allclose(v, result[k].astype(np.float64) - start[k], rtol=1e-6)
    with pytest.raises(WarmStartError, match="keys"):
        pseudo_gradient({"w": np.ones(2)}, {"v": np.ones(2)})


# -- warm start ---------------------------------------------------------------------------


def test_warm_start_hand_computed() -> None:
    new = {"w": np.array([1.0, 0.0])}
    s1 = StoredSession(1, {"w": np.array([4.0, 8.0])}, {"w": np.array([2.0, 0.0])}, ["a"])
    s2 = StoredSession(2, {"w": np.array([8.0, 0.0])}, {"w": np.array([0.0, 0.5])}, ["b"])
    # d = [0, sqrt 2]; R = ln(3) / sqrt(2) -> exp(-R d) = [1, 1/3] -> w = [3/4, 1/4]
    np.testing.assert_allclose(session_distances(new, [s1, s2], ["w"]), [0.0, math.sqrt(2)])
    model, w = warm_start_model(new, [s1, s2], ["w"], math.log(3) / math.sqrt(2))
    np.testing.assert_allclose(w, [0.75, 0.25], rtol=1e-12)
    np.testing.assert_allclose(model["w"], [5.0, 6.0], rtol=1e-12)  # 3/4 [4,8] + 1/4 [8,0]


def test_warm_start_one_weight_gives_exact_stored_model() -> None:
    stored = [_candidate(s) for s in (2, 3, 4)]
    keys = distance_keys(stored[0].final, PARAM_KEYS)
    new_grad = stored[1].pseudo_grad
    assert new_grad is not None
    model, w = warm_start_model(new_grad, stored, keys, temperature=1e6)
    np.testing.assert_array_equal(w, [0.0, 1.0, 0.0])
    _assert_state_equal(model, stored[1].final)


def test_warm_start_errors() -> None:
    with pytest.raises(WarmStartError, match="no stored"):
        warm_start_model({"w": np.ones(2)}, [], ["w"], 1.0)
    pilot = StoredSession(1, {"w": np.ones(2)}, None, ["a"])
    with pytest.raises(WarmStartError, match="pilot"):
        warm_start_model({"w": np.ones(2)}, [pilot], ["w"], 1.0)


# -- session store ------------------------------------------------------------------------


def test_store_eviction_keeps_newest_and_deletes_files(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "store", max_stored=2)
    store.add(StoredSession(1, _model(1), None, ["a", "b"]))
    for s in (2, 3, 4, 5):
        store.add(_candidate(s))
    assert [c.session for c in store.candidates()] == [4, 5]
    assert [p.session for p in store.pilots()] == [1]  # pilots are never evicted
    files = sorted(p.name for p in (tmp_path / "store").iterdir())
    assert files == ["index.json", "session-000001.npz", "session-000004.npz", "session-000005.npz"]
    index = json.loads((tmp_path / "store" / "index.json").read_text())
    assert [e["session"] for e in index["sessions"]] == [1, 4, 5]
    latest = store.latest()
    assert latest is not None and latest.session == 5


def test_store_memory_only_evicts_too() -> None:
    store = SessionStore(None, max_stored=2)
    assert store.latest() is None
    for s in (2, 3, 4, 5):
        store.add(_candidate(s))
    assert [c.session for c in store.candidates()] == [4, 5]
    assert len(store) == 2


def test_store_copies_on_add_and_replaces_same_session() -> None:
    store = SessionStore(None, max_stored=3)
    c = _candidate(2)
    before = c.final["fc.weight"].copy()
    store.add(c)
    c.final["fc.weight"] += 1.0
    np.testing.assert_array_equal(store.candidates()[0].final["fc.weight"], before)
    store.add(StoredSession(2, _model(9), None, ["z"]))  # same number again: replaced
    assert store.candidates() == [] and [p.devices for p in store.pilots()] == [["z"]]


def test_store_restart_round_trip(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    store = SessionStore(directory, max_stored=3)
    pilot = StoredSession(1, _model(1), None, ["a", "b"])
    pilot.final["extra.flag"] = np.array([True, False])
    pilot.final["extra.f64"] = np.arange(3, dtype=np.float64)
    added = [pilot, _candidate(2), _candidate(3)]
    for s in added:
        store.add(s)
    loaded = SessionStore.load(directory, max_stored=3)
    assert [p.session for p in loaded.pilots()] == [1]
    assert [c.session for c in loaded.candidates()] == [2, 3]
    for orig, back in zip(added, loaded.pilots() + loaded.candidates(), strict=True):
        assert back.session == orig.session
        assert back.devices == orig.devices
        _assert_state_equal(back.final, orig.final)
        if orig.pseudo_grad is None:
            assert back.pseudo_grad is None
        else:
            assert back.pseudo_grad is not None
            _assert_state_equal(back.pseudo_grad, orig.pseudo_grad)
    # The restored store carries on: one more candidate evicts session 2 only when over 3.
    loaded.add(_candidate(4))
    loaded.add(_candidate(5))
    assert [c.session for c in SessionStore.load(directory, 3).candidates()] == [3, 4, 5]
    # A smaller limit on load evicts at once, on disk too.
    assert [c.session for c in SessionStore.load(directory, 1).candidates()] == [5]
    assert not (directory / "session-000004.npz").exists()
    assert [c.session for c in SessionStore.load(directory, 3).candidates()] == [5]


def test_store_corrupt_and_missing_files(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    store = SessionStore(directory, max_stored=2)
    store.add(_candidate(2))
    store.add(_candidate(3))
    bad = directory / "session-000003.npz"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(WarmStartError, match="session-000003.npz"):
        SessionStore.load(directory, 2)
    bad.unlink()
    with pytest.raises(WarmStartError, match=r"session-000003.npz is missing"):
        SessionStore.load(directory, 2)
    (directory / "index.json").write_text("{not json")
    with pytest.raises(WarmStartError, match="index.json is corrupt"):
        SessionStore.load(directory, 2)
    with pytest.raises(WarmStartError, match="index.json is missing"):
        SessionStore.load(tmp_path / "nowhere", 2)


def _replace_file(directory: Path, name: str, data: bytes, checksum: bool = True) -> None:
    """Put ``data`` in a store file and (``checksum``) make the index's checksum match it,
    as someone who can write the folder could."""
    (directory / name).write_bytes(data)
    if checksum:
        index = json.loads((directory / "index.json").read_text())
        for entry in index["sessions"]:
            if entry["file"] == name:
                entry["sha256"] = hashlib.sha256(data).hexdigest()
        (directory / "index.json").write_text(json.dumps(index))


def test_store_npz_missing_array_named(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    SessionStore(directory, max_stored=2).add(_candidate(2))
    buf = io.BytesIO()
    np.savez(buf, final_keys=np.array(["w"]))  # valid npz, but final_0 and grad are gone
    _replace_file(directory, "session-000002.npz", buf.getvalue())
    with pytest.raises(WarmStartError, match=r"session-000002.npz.*final_0"):
        SessionStore.load(directory, 2)


def test_store_file_altered_fails_its_checksum_and_never_unpickles(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    SessionStore(directory, max_stored=2).add(_candidate(2))
    path = directory / "session-000002.npz"
    original = path.read_bytes()
    buf = io.BytesIO()
    np.savez(buf, final_keys=np.array(["w"]), final_0=np.zeros(3), grad_keys=np.array(["w"]),
             grad_0=np.zeros(3))  # fmt: skip
    _replace_file(directory, path.name, buf.getvalue(), checksum=False)
    with pytest.raises(WarmStartError, match="session-000002.npz fails its checksum"):
        SessionStore.load(directory, 2)
    # A pickle payload as an object array, with a matching checksum: refused, not run.
    marker = tmp_path / "pwned"
    obj = np.empty(1, dtype=object)
    obj[0] = _Payload(marker)
    buf = io.BytesIO()
    np.savez(buf, final_keys=np.array(["w"]), final_0=obj, grad_keys=np.array(["w"]),
             grad_0=obj, allow_pickle=True)  # fmt: skip
    _replace_file(directory, path.name, buf.getvalue())
    with pytest.raises(WarmStartError, match="is corrupt"):
        SessionStore.load(directory, 2)
    assert not marker.exists()
    # An index that names a file outside the store is refused.
    _replace_file(directory, path.name, original)
    index = json.loads((directory / "index.json").read_text())
    index["sessions"][0]["file"] = "../elsewhere.npz"
    (directory / "index.json").write_text(json.dumps(index))
    with pytest.raises(WarmStartError, match="is not in the store"):
        SessionStore.load(directory, 2)


def test_store_of_index_version_1_still_loads(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    SessionStore(directory, max_stored=2).add(_candidate(2))
    index = json.loads((directory / "index.json").read_text())
    index["version"] = 1
    for entry in index["sessions"]:
        del entry["sha256"]
    (directory / "index.json").write_text(json.dumps(index))
    loaded = SessionStore.load(directory, 2)
    assert [c.session for c in loaded.candidates()] == [2]
    loaded.add(_candidate(3))  # the index is written again, with checksums
    assert json.loads((directory / "index.json").read_text())["version"] == 2


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_store_bad_args(tmp_path: Path) -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(WarmStartError, match="max_stored"):
            SessionStore(None, bad)  # type: ignore[arg-type]
    SessionStore(tmp_path, 2).add(_candidate(2))
    with pytest.raises(WarmStartError, match="SessionStore.load"):
        SessionStore(tmp_path, 2)  # would silently shadow the stored sessions
    with pytest.raises(WarmStartError, match="max_stored"):
        SessionStore.load(tmp_path, 0)
    with pytest.raises(WarmStartError, match="empty"):
        SessionStore(None, 2).add(StoredSession(1, {}, None, []))


# -- session tracker ----------------------------------------------------------------------


def test_tracker_first_call_opens_session_one() -> None:
    t = SessionTracker(change_threshold=0.3, max_rounds=0)
    assert t.update(1, []) is None  # nobody present yet: nothing to found a session on
    assert t.session == 0
    change = t.update(2, ["a", "b", "c"])
    assert change == SessionChange(1, 2, frozenset("abc"), frozenset(), "start")
    assert t.session == 1 and t.founding == frozenset("abc") and t.start_round == 2


def test_tracker_membership_threshold() -> None:
    t = SessionTracker(change_threshold=0.3, max_rounds=0)
    t.update(1, ["a", "b", "c", "d"])
    # {a,b,c,d,e} vs {a,b,c,d}: 1 / 5 = 0.2 <= 0.3 -> continue
    assert t.update(2, ["a", "b", "c", "d", "e"]) is None
    # {a,b,c} vs {a,b,c,d}: 1 / 4 = 0.25 -> continue
    assert t.update(3, ["a", "b", "c"]) is None
    # {a,b,c,e} vs founding {a,b,c,d}: 2 / 5 = 0.4 > 0.3 -> session 2
    change = t.update(4, ["a", "b", "c", "e"])
    assert change == SessionChange(2, 4, frozenset({"e"}), frozenset({"d"}), "membership")
    assert t.founding == frozenset("abce") and t.start_round == 4
    # departures only: {a} vs {a,b,c,e}: 3 / 4 > 0.3
    change = t.update(5, ["a"])
    assert change is not None and change.session == 3
    assert change.arrived == frozenset() and change.left == frozenset("bce")
    # arrivals only
    change = t.update(6, ["a", "x", "y"])
    assert change is not None and change.arrived == frozenset("xy") and change.left == frozenset()


def test_tracker_zero_threshold_any_change() -> None:
    t = SessionTracker(change_threshold=0.0, max_rounds=0)
    t.update(1, ["a", "b"])
    assert t.update(2, ["b", "a"]) is None
    change = t.update(3, ["a", "b", "c"])
    assert change is not None and change.reason == "membership"


def test_tracker_slow_churn_accumulates_against_founding_set() -> None:
    t = SessionTracker(change_threshold=0.3, max_rounds=0)
    t.update(1, [f"d{i}" for i in range(10)])
    # one device swapped per round: against the previous round each step is 2/11 = 0.18,
    # against the founding set the distance grows until it passes 0.3
    assert t.update(2, [f"d{i}" for i in range(1, 11)]) is None  # 2/11
    change = t.update(3, [f"d{i}" for i in range(2, 12)])  # 4/12 = 0.33
    assert change is not None and change.left == frozenset({"d0", "d1"})


def test_tracker_length_limit() -> None:
    t = SessionTracker(change_threshold=0.5, max_rounds=3)
    assert t.update(1, ["a"]) is not None
    assert t.update(2, ["a"]) is None
    assert t.update(3, ["a"]) is None
    change = t.update(4, ["a"])
    assert change == SessionChange(2, 4, frozenset(), frozenset(), "length")
    assert t.update(5, ["a"]) is None
    # both rules at once: membership wins as the reason
    assert t.update(7, ["b"]) == SessionChange(3, 7, frozenset("b"), frozenset("a"), "membership")


def test_tracker_empty_round_keeps_session() -> None:
    t = SessionTracker(change_threshold=0.2, max_rounds=0)
    t.update(1, ["a", "b"])
    assert t.update(2, []) is None
    assert t.session == 1 and t.founding == frozenset("ab")
    assert t.update(3, ["a", "b"]) is None


def test_tracker_state_round_trip() -> None:
    t = SessionTracker(change_threshold=0.3, max_rounds=5)
    t.update(1, ["a", "b", "c"])
    t.update(2, ["x", "y"])
    state = t.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state == {"session": 2, "founding": ["x", "y"], "start_round": 2}
    resumed = SessionTracker(change_threshold=0.3, max_rounds=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for r, present in [(3, ["x", "y"]), (4, ["x", "y", "z"]), (7, ["x", "y"]), (8, ["q"])]:
        assert resumed.update(r, present) == t.update(r, present)
    fresh = SessionTracker(0.3, 5)
    fresh.load_state_dict(SessionTracker(0.3, 5).state_dict())
    assert fresh.update(1, ["a"]) is not None and fresh.session == 1


def test_tracker_bad_args() -> None:
    for threshold in (-0.1, 1.0, math.nan, "x"):
        with pytest.raises(SessionError, match="change_threshold"):
            SessionTracker(threshold, 0)  # type: ignore[arg-type]
    for rounds in (-1, 2.5, True):
        with pytest.raises(SessionError, match="max_rounds"):
            SessionTracker(0.3, rounds)  # type: ignore[arg-type]
    t = SessionTracker(0.3, 0)
    t.update(5, ["a"])
    with pytest.raises(SessionError, match="before"):
        t.update(4, ["a"])
    with pytest.raises(SessionError, match="malformed"):
        t.load_state_dict({"session": 1})
    with pytest.raises(SessionError, match="start_round"):
        t.load_state_dict({"session": 1, "founding": ["a"], "start_round": None})


def test_membership_change() -> None:
    assert membership_change(frozenset(), frozenset()) == 0.0
    assert membership_change(frozenset("ab"), frozenset("cd")) == 1.0
    assert membership_change(frozenset("abc"), frozenset("abd")) == 0.5
