"""Attacks for evaluating defences (issue 25): the pure NumPy attacks against hand
computations, and ``attack_mod`` on hand-built train messages (no Flower run)."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common import MessageType

from edgefleet.arrays import to_numpy
from edgefleet.attacks import (
    FolderBoard,
    InProcessBoard,
    add_trigger,
    alie,
    alie_z,
    attack_mod,
    attack_success_rate,
    backdoored,
    flip_labels,
    ipm,
    label_flipped,
    poison,
    sign_flip,
)
from edgefleet.client.mods import ERR_ABSENT, ERR_BAD_CONFIG
from edgefleet.pruning.reconstruct import compact_slice
from edgefleet.pruning.wire import KEPT, kept_record
from edgefleet.task.datasets import ArrayDataset
from tests.fakes import FakeGrid, rec

# --- the pure functions --------------------------------------------------------------------


@pytest.mark.parametrize("z", [0.0, 0.3853, 1.0, 2.5])
def test_alie_shift_is_z_standard_deviations_down(z: float) -> None:
    rng = np.random.default_rng(1)
    honest = rng.normal(size=(7, 50))
    mean, std = honest.mean(axis=0), honest.std(axis=0)
    np.testing.assert_allclose(alie(mean, std, z) - mean, -z * std)


@pytest.mark.parametrize(
    ("n", "f", "z"),
    [
        # s = floor(20/2 + 1) - 4 = 7; Phi^-1((20 - 7) / 20) = Phi^-1(0.65) = 0.38532 (z-table)
        (20, 4, 0.38532),
        (10, 2, 0.25335),  # s = 6 - 2 = 4: Phi^-1(0.6)
        (2, 1, 0.0),  # s = 2 - 1 = 1: Phi^-1(0.5)
        (50, 24, 1.75069),  # s = 26 - 24 = 2: Phi^-1(0.96)
    ],
)
def test_alie_z_against_hand_computation(n: int, f: int, z: float) -> None:
    assert alie_z(n, f) == pytest.approx(z, abs=1e-5)


@pytest.mark.parametrize(("n", "f"), [(20, 0), (20, 11), (1, 1), (20, 2.5)])
def test_alie_z_refuses_impossible_collusions(n: int, f: float) -> None:
    with pytest.raises(ValueError, match="n_colluders"):
        alie_z(n, f)  # type: ignore[arg-type]


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 100.0])
def test_ipm_is_minus_epsilon_times_the_honest_mean(epsilon: float) -> None:
    mean = np.array([1.0, -2.0, 0.5, 0.0])
    np.testing.assert_allclose(ipm(mean, epsilon), [-epsilon, 2 * epsilon, -0.5 * epsilon, 0])
    assert float(np.dot(ipm(mean, epsilon), mean)) < 0


@pytest.mark.parametrize("epsilon", [0.0, -1.0, math.inf, math.nan])
def test_ipm_refuses_a_bad_epsilon(epsilon: float) -> None:
    with pytest.raises(ValueError, match="epsilon"):
        ipm(np.ones(3), epsilon)


@pytest.mark.parametrize("honest_norm", [None, 0.01, 2.5, 40.0])
def test_sign_flip_points_back_at_the_honest_norm(honest_norm: float | None) -> None:
    update = np.random.default_rng(2).normal(size=30)
    flipped = sign_flip(update, honest_norm)
    want = np.linalg.norm(update) if honest_norm is None else honest_norm
    assert np.linalg.norm(flipped) == pytest.approx(want)
    cosine = np.dot(flipped, update) / (np.linalg.norm(flipped) * np.linalg.norm(update))
    assert cosine == pytest.approx(-1.0)


def test_sign_flip_of_nothing_is_nothing() -> None:
    assert not sign_flip(np.zeros(4), 3.0).any()


def test_flip_labels_maps_y_to_c_minus_1_minus_y() -> None:
    y = np.array([0, 1, 2, 9, 5], dtype=np.int64)
    flipped = flip_labels(y, 10)
    np.testing.assert_array_equal(flipped, [9, 8, 7, 0, 4])
    assert flipped.dtype == np.int64
    data = label_flipped(ArrayDataset(np.zeros((5, 1, 2, 2), np.float32), y), 10)
    np.testing.assert_array_equal(data.y, [9, 8, 7, 0, 4])
    np.testing.assert_array_equal(y, [0, 1, 2, 9, 5])  # the original is left alone
    with pytest.raises(ValueError, match=r"outside \[0, 2\]"):
        flip_labels(y, 3)


def test_add_trigger_sets_the_bottom_right_square_of_every_channel() -> None:
    images = np.zeros((2, 3, 5, 6), dtype=np.float32)
    out = add_trigger(images, pattern_size=2, value=7.0)
    assert not images.any()  # a copy
    np.testing.assert_array_equal(out[:, :, 3:, 4:], 7.0)
    assert out.sum() == 2 * 3 * 4 * 7.0
    default = add_trigger(np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4))
    assert (default[:, :, 1:, 1:] == 31.0).all()  # the largest pixel by default
    for bad in (0, 6, 2.5):
        with pytest.raises(ValueError, match="pattern_size"):
            add_trigger(images, pattern_size=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("n", "fraction"), [(40, 0.25), (40, 0.0), (40, 1.0), (30, 0.1)])
def test_poison_triggers_exactly_the_fraction_asked_and_relabels_them(
    n: int, fraction: float
) -> None:
    rng = np.random.default_rng(3)
    x = rng.uniform(0.0, 1.0, size=(n, 1, 6, 6)).astype(np.float32)
    y = rng.integers(0, 10, size=n)
    x_in, y_in = x.copy(), y.copy()
    out = poison(x, y, target=3, fraction=fraction, rng=np.random.default_rng(4), value=9.0)
    np.testing.assert_array_equal(x, x_in)  # inputs untouched
    np.testing.assert_array_equal(y, y_in)
    assert len(out.poisoned) == round(fraction * n) == len(np.unique(out.poisoned))
    triggered = (out.x[:, 0, -3:, -3:] == 9.0).all(axis=(1, 2))
    np.testing.assert_array_equal(np.flatnonzero(triggered), out.poisoned)
    np.testing.assert_array_equal(out.y[out.poisoned], 3)
    rest = np.setdiff1d(np.arange(n), out.poisoned)
    np.testing.assert_array_equal(out.y[rest], y[rest])
    np.testing.assert_array_equal(out.x[rest], x[rest])
    data = backdoored(ArrayDataset(x, y), 3, fraction, np.random.default_rng(4), value=9.0)
    np.testing.assert_array_equal(data.y, out.y)


@pytest.mark.parametrize("bad", [{"fraction": 1.5}, {"fraction": -0.1}, {"target": -1}])
def test_poison_refuses_bad_settings(bad: dict) -> None:
    args = {"target": 0, "fraction": 0.5, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        poison(np.zeros((4, 1, 4, 4)), np.zeros(4), rng=np.random.default_rng(0), **args)


def test_attack_success_rate_on_a_hand_made_predictor() -> None:
    # 10 test images; 2 are of the target class 0 and do not count. Of the other 8, the
    # predictor falls for the trigger on the 3 marked with a 5 in their top-left pixel.
    x = np.zeros((10, 1, 4, 4), dtype=np.float32)
    y = np.array([0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    x[[2, 5, 9], 0, 0, 0] = 5.0
    x[0, 0, 0, 0] = 5.0  # a target-class image: left out whatever the predictor says

    def predict(images: np.ndarray) -> np.ndarray:
        fooled = (images[:, 0, -1, -1] == 1.0) & (images[:, 0, 0, 0] == 5.0)
        return np.where(fooled, 0, 1)

    assert attack_success_rate(predict, x, y, target=0, value=1.0) == pytest.approx(3 / 8)
    assert attack_success_rate(lambda im: np.eye(10)[predict(im)], x, y, 0, value=1.0) == (
        pytest.approx(3 / 8)
    )  # scores: argmax
    assert attack_success_rate(predict, x, y, target=0, value=2.0) == 0.0  # wrong trigger
    with pytest.raises(ValueError, match="every test label"):
        attack_success_rate(predict, x[:2], y[:2], target=0)


# --- the mods on hand-built messages -------------------------------------------------------

SENT = {"w": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "b": np.array([0.5, -0.5], np.float32)}
STEP = np.array([0.1, -0.2, 0.3, 0.4, -0.5, 0.6])  # partition p's update is (p + 1) * STEP


def _train_msg(rnd: int = 1, kept: bool = False) -> Message:
    FakeGrid({})  # sets the task identity that building messages needs
    content = RecordDict(
        {"global": rec(SENT), "config": ConfigRecord({"server-round": rnd, "lr": 0.1})}
    )
    if kept:
        content[KEPT] = kept_record({"conv1": np.array([1, 4, 6])})
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


def _ctx(partition: int) -> Context:
    return Context(
        run_id=7, node_id=partition + 1, node_config={"partition-id": partition},
        state=RecordDict(), run_config={},
    )  # fmt: skip


def _honest(msg: Message, context: Context) -> Message:
    """A device's honest train: record names of its own, a kept record, an int buffer."""
    p = int(context.node_config["partition-id"])  # type: ignore[arg-type]
    step = (p + 1) * STEP
    arrays = {
        "w": SENT["w"] + step[:4].reshape(2, 2).astype(np.float32),
        "b": SENT["b"] + step[4:].astype(np.float32),
        "batches": np.array(3 + p, dtype=np.int64),
    }
    content = RecordDict(
        {
            "model": ArrayRecord({k: _array(v) for k, v in arrays.items()}),
            "stats": MetricRecord({"num-examples": 32 + p, "device-id": p, "train-loss": 0.5}),
            KEPT: kept_record({"conv1": np.array([1, 4, 6]), "conv2": np.array([0, 1])}),
        }
    )
    return Message(content, reply_to=msg)


def _array(value: np.ndarray) -> Array:
    return Array(np.asarray(value))


def _declines(msg: Message, context: Context) -> Message:
    return Message(Error(ERR_BAD_CONFIG, "no data"), reply_to=msg)


def _update(reply: Message) -> np.ndarray:
    arrays = to_numpy(reply.content.array_records["model"])
    return np.concatenate([(arrays["w"] - SENT["w"]).ravel(), arrays["b"] - SENT["b"]])


MODS = {
    "sign-flip": {},
    "alie": {"z": 1.0},
    "ipm": {"epsilon": 0.5},
    "sybil": {"ids": [70, 80]},
    "stale-poison": {},
    "pruned-liar": {},
}


@pytest.mark.parametrize("kind", sorted(MODS))
def test_each_mod_changes_only_the_listed_partitions_and_keeps_the_shape(kind: str) -> None:
    mod = attack_mod(kind, [1, 2], **MODS[kind])
    msg = _train_msg()
    for p in range(4):
        honest = _honest(msg, _ctx(p))
        reply = mod(msg, _ctx(p), _honest)
        assert not reply.has_error()
        content = reply.content
        assert list(content.array_records) == ["model", KEPT]
        assert list(content.metric_records) == ["stats"]
        assert content["stats"]["num-examples"] == 32 + p
        assert int(to_numpy(content["model"])["batches"]) == 3 + p  # int buffers untouched
        assert {k: v.dtype for k, v in to_numpy(content["model"]).items()} == {
            k: v.dtype for k, v in to_numpy(honest.content["model"]).items()
        }
        same_arrays = np.array_equal(_update(reply), _update(honest))
        same_kept = all(
            np.array_equal(a.numpy(), b.numpy())
            for a, b in zip(content[KEPT].values(), honest.content[KEPT].values(), strict=True)
        )
        same_id = content["stats"]["device-id"] == p
        if p not in (1, 2):
            assert same_arrays and same_kept and same_id, (kind, p)
            continue
        assert same_kept == (kind != "pruned-liar"), (kind, p)
        assert same_id == (kind != "sybil"), (kind, p)
        # ALIE's first colluder of a round has no one else's update: zero spread, no shift.
        moved = kind in ("sign-flip", "ipm", "stale-poison") or (kind == "alie" and p == 2)
        assert same_arrays != moved, (kind, p)


@pytest.mark.parametrize("kind", sorted(MODS))
def test_each_mod_passes_an_error_reply_and_other_messages_through(kind: str) -> None:
    mod = attack_mod(kind, [0], **MODS[kind])
    reply = mod(_train_msg(), _ctx(0), _declines)
    assert reply.has_error() and reply.error.reason == "no data"
    FakeGrid({})
    query = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=1,
                    message_type=MessageType.QUERY)  # fmt: skip
    seen = []
    mod(query, _ctx(0), lambda m, c: seen.append(m) or _declines(m, c))
    assert seen == [query]


def test_sign_flip_sends_the_negated_update_at_the_honest_norm() -> None:
    for scale in (1.0, 3.0):
        reply = attack_mod("sign-flip", [0], norm_scale=scale)(_train_msg(), _ctx(0), _honest)
        np.testing.assert_allclose(_update(reply), -scale * STEP, rtol=1e-5, atol=1e-6)


def test_alie_and_ipm_colluders_share_one_estimate() -> None:
    # Partitions 0 and 2 collude; 2 trains after 0 and sees both updates: STEP and 3 STEP,
    # mean 2 STEP and (population) std |STEP|.
    for kind, params, want in [
        ("alie", {"z": 1.5}, 2 * STEP - 1.5 * np.abs(STEP)),
        ("ipm", {"epsilon": 0.1}, -0.1 * 2 * STEP),
    ]:
        mod = attack_mod(kind, [0, 2], **params)
        first = mod(_train_msg(), _ctx(0), _honest)
        second = mod(_train_msg(), _ctx(2), _honest)
        alone = STEP if kind == "alie" else -0.1 * STEP  # its own update, zero spread
        np.testing.assert_allclose(_update(first), alone, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_update(second), want, rtol=1e-5, atol=1e-6)
        # A new round starts a new estimate.
        again = mod(_train_msg(rnd=2), _ctx(2), _honest)
        alone = 3 * STEP if kind == "alie" else -0.1 * 3 * STEP
        np.testing.assert_allclose(_update(again), alone, rtol=1e-5, atol=1e-6)


def test_alie_z_from_the_fleet_size() -> None:
    mod = attack_mod("alie", [0, 2], n_devices=4)  # f = 2 colluders: s = 1, Phi^-1(3/4)
    mod(_train_msg(), _ctx(0), _honest)
    z = NormalDist().inv_cdf(0.75)
    np.testing.assert_allclose(
        _update(mod(_train_msg(), _ctx(2), _honest)), 2 * STEP - z * np.abs(STEP), rtol=1e-5
    )


def test_a_folder_board_is_shared_between_processes(tmp_path) -> None:
    # Two boards on one folder stand for two Ray actors, each with its own mod.
    first = attack_mod("alie", [0, 2], z=1.0, board=FolderBoard(tmp_path))
    second = attack_mod("alie", [0, 2], z=1.0, board=FolderBoard(tmp_path))
    first(_train_msg(), _ctx(0), _honest)
    reply = second(_train_msg(), _ctx(2), _honest)
    np.testing.assert_allclose(_update(reply), 2 * STEP - np.abs(STEP), rtol=1e-5, atol=1e-6)
    for rnd in (2, 3):
        first(_train_msg(rnd=rnd), _ctx(0), _honest)
    assert sorted(p.name for p in (tmp_path / "run-7").iterdir()) == ["round-2", "round-3"]


def test_in_process_board_leaves_out_updates_of_another_shape() -> None:
    board = InProcessBoard()
    board.share(1, 1, 0, np.ones(3))
    est = board.share(1, 1, 1, np.zeros(4))
    assert est.n_updates == 1 and not est.mean.any() and not est.std.any()


def test_sybil_rewrites_the_device_id() -> None:
    mod = attack_mod("sybil", [1, 2], ids=[7, 8, 9])
    claims = {
        (rnd, p): mod(_train_msg(rnd), _ctx(p), _honest).content["stats"]["device-id"]
        for rnd in (1, 2, 3)
        for p in (1, 2)
    }
    assert claims == {(1, 1): 7, (1, 2): 8, (2, 1): 8, (2, 2): 9, (3, 1): 9, (3, 2): 7}


def test_stale_poison_uploads_once_then_stays_away() -> None:
    mod = attack_mod("stale-poison", [0])
    ctx = _ctx(0)
    trained: list[int] = []

    def honest(msg: Message, context: Context) -> Message:
        trained.append(int(msg.content["config"]["server-round"]))  # type: ignore[arg-type]
        return _honest(msg, context)

    first = mod(_train_msg(1), ctx, honest)
    np.testing.assert_allclose(_update(first), -STEP, rtol=1e-5, atol=1e-6)
    for rnd in (2, 3):
        later = mod(_train_msg(rnd), ctx, honest)
        assert later.has_error() and later.error.code == ERR_ABSENT
        assert "round 1" in later.error.reason
    assert trained == [1]  # it never trains again


def test_stale_poison_that_failed_to_train_tries_again() -> None:
    mod = attack_mod("stale-poison", [0])
    ctx = _ctx(0)
    assert mod(_train_msg(1), ctx, _declines).has_error()
    assert not mod(_train_msg(2), ctx, _honest).has_error()


@pytest.mark.parametrize("lie", ["resample", "shuffle"])
def test_pruned_liar_lies_about_the_kept_channels(lie: str) -> None:
    reply = attack_mod("pruned-liar", [0], lie=lie, seed=3)(_train_msg(), _ctx(0), _honest)
    honest = _honest(_train_msg(), _ctx(0))
    kept = {g: a.numpy() for g, a in reply.content[KEPT].items()}
    true = {"conv1": np.array([1, 4, 6]), "conv2": np.array([0, 1])}
    assert set(kept) == set(true)
    np.testing.assert_array_equal(_update(reply), _update(honest))  # the arrays are the truth
    lied = kept["conv1"]
    assert len(lied) == 3 and lied.dtype == np.int64 and not np.array_equal(lied, true["conv1"])
    if lie == "resample":
        assert (np.diff(lied) > 0).all() and lied.min() >= 0 and lied.max() <= 6
        np.testing.assert_array_equal(kept["conv2"], [0, 1])  # 0..k-1: no other set fits
    else:
        assert sorted(lied) == [1, 4, 6]
        np.testing.assert_array_equal(kept["conv2"], [1, 0])


def test_pruned_liar_leaves_a_full_model_reply_alone() -> None:
    def full(msg: Message, context: Context) -> Message:
        reply = _honest(msg, context)
        reply.content.pop(KEPT)
        return reply

    reply = attack_mod("pruned-liar", [0])(_train_msg(), _ctx(0), full)
    assert list(reply.content.array_records) == ["model"]


def test_an_update_attack_on_a_self_pruned_reply_is_an_error_reply() -> None:
    def pruned(msg: Message, context: Context) -> Message:
        reply = _honest(msg, context)
        arrays = to_numpy(reply.content["model"])
        arrays["w"] = arrays["w"][:1]
        reply.content["model"] = ArrayRecord({k: _array(v) for k, v in arrays.items()})
        return reply

    reply = attack_mod("sign-flip", [0])(_train_msg(), _ctx(0), pruned)
    assert reply.has_error() and reply.error.code == ERR_BAD_CONFIG
    assert "'w'" in reply.error.reason and "pruned" in reply.error.reason


def test_the_mod_leaves_the_sent_kept_record_and_message_alone() -> None:
    msg = _train_msg(kept=True)
    attack_mod("ipm", [0])(msg, _ctx(0), _honest)
    np.testing.assert_array_equal(msg.content[KEPT]["conv1"].numpy(), [1, 4, 6])
    np.testing.assert_array_equal(to_numpy(msg.content["global"])["w"], SENT["w"])


@pytest.mark.parametrize(
    ("kind", "partitions", "params", "named"),
    [
        ("flip", [0], {}, "valid choices: sign-flip, alie, ipm"),
        ("label-flip", [0], {}, "label_flipped(data, num_classes)"),
        ("backdoor", [0], {}, "backdoored(data, target, fraction, rng)"),
        ("sign-flip", [], {}, "at least one"),
        ("sign-flip", [-1], {}, "non-negative partition ids"),
        ("sign-flip", ["a"], {}, "must be partition ids"),
        ("sign-flip", [0], {"epsilon": 1.0}, "valid for sign-flip: norm_scale"),
        ("sign-flip", [0], {"norm_scale": 0}, "norm_scale=0 must be a finite number > 0"),
        ("alie", [0], {}, "needs z, or n_devices"),
        ("alie", [0], {"z": 1.0, "n_devices": 10}, "not both"),
        ("alie", [0], {"z": math.nan}, "z=nan must be a finite number"),
        ("alie", [0, 1], {"n_devices": 3}, "floor"),  # 2 of 3 collude: a majority already
        ("alie", [0], {"board": "shared"}, "needs z"),
        ("alie", [0], {"z": 1.0, "board": "shared"}, "must be an InProcessBoard, a FolderBoard"),
        ("ipm", [0], {"epsilon": -0.1}, "epsilon=-0.1"),
        ("ipm", [0], {"z": 1.0}, "valid for ipm: epsilon, board"),
        ("sybil", [0], {}, "ids=None must be a non-empty list"),
        ("sybil", [0], {"ids": [1, -2]}, "device ids"),
        ("pruned-liar", [0], {"lie": "swap"}, "valid choices: resample, shuffle"),
        ("pruned-liar", [0], {"seed": "x"}, "seed='x' must be an int"),
    ],
)
def test_bad_kinds_and_parameters_raise_naming_the_choices(
    kind: str, partitions: list, params: dict, named: str
) -> None:
    with pytest.raises(ValueError) as err:
        attack_mod(kind, partitions, **params)
    assert named in str(err.value)


def test_a_clientapp_with_the_mod_attacks_through_flower() -> None:
    """As a Flower user adds it: ClientApp(mods=[...]) around their own train function."""
    from flwr.clientapp import ClientApp

    app = ClientApp(mods=[attack_mod("sign-flip", [1])])
    app.train()(_honest)
    np.testing.assert_allclose(_update(app(_train_msg(), _ctx(0))), STEP, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_update(app(_train_msg(), _ctx(1))), -2 * STEP, rtol=1e-5, atol=1e-6)


def test_an_update_attack_on_a_self_pruned_reply_cuts_the_sent_model_with_the_plan() -> None:
    # A CA-HFP device sent the full model prunes it itself and replies with a smaller
    # submodel and its kept channels; given the model's plan, the mod takes the update on the
    # kept channels (as the device's own pruning did) and flips it there.
    from edgefleet.pruning.submodel import plan_for
    from edgefleet.task.models import build_model

    plan = plan_for("mlp", "digits")
    model = build_model("mlp", (1, 8, 8), 10)
    full = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    kept = {g: np.arange(0, n, 2, dtype=np.int64) for g, n in plan.groups.items()}
    sub = compact_slice(full, plan.index_maps(kept), plan.compact_shapes(kept))
    assert sum(v.size for v in sub.values()) < sum(v.size for v in full.values())
    step = {k: np.full_like(v, 0.01) for k, v in sub.items()}

    def pruned(msg: Message, context: Context) -> Message:
        content = RecordDict({
            "model": ArrayRecord({k: _array(sub[k] + step[k]) for k in sub}),
            "stats": MetricRecord({"num-examples": 32, "device-id": 0}),
            KEPT: kept_record(kept),
        })  # fmt: skip
        return Message(content, reply_to=msg)

    FakeGrid({})
    msg = Message(
        RecordDict({"global": rec(full), "config": ConfigRecord({"server-round": 1})}),
        dst_node_id=1, message_type=MessageType.TRAIN,
    )  # fmt: skip
    calls = []

    def factory() -> Any:
        calls.append(1)
        return plan

    mod = attack_mod("sign-flip", [0], plan=factory)
    for _ in range(2):
        reply = mod(msg, _ctx(0), pruned)
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        got = to_numpy(reply.content["model"])
        for k in sub:
            np.testing.assert_allclose(got[k], sub[k] - step[k], atol=1e-6)
    assert calls == [1]  # the plan is built once
    assert attack_mod("sign-flip", [0])(msg, _ctx(0), pruned).has_error()  # no plan: refused
    with pytest.raises(ValueError, match="plan="):
        attack_mod("sign-flip", [0], plan="mlp")  # type: ignore[arg-type]
