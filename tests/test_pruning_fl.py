"""CA-HFP end to end without Flower's engines: the real ClientApp prunes, the server wrapper
checks and rebuilds the submodels, the round loop aggregates (issue 5)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from edgefleet.arrays import to_numpy, to_record
from edgefleet.client.app import train
from edgefleet.client.device import NodeConfigError, get_profile
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.loop.context import PruningRow
from edgefleet.loop.registry import DeviceRegistry
from edgefleet.loop.roundloop import RoundLoop
from edgefleet.pruning.submodel import PruningPlan
from edgefleet.pruning.wire import KEPT, kept_record
from edgefleet.strategies.reconstruction import SubmodelReconstruction, compact_slice
from edgefleet.task.models import build_model
from edgefleet.task.train import get_arrays
from tests.fakes import FakeGrid, Rows, no_eval, train_reply

COMMON = {"min_available_nodes": 1, "min_train_nodes": 1, "fraction_evaluate": 0.0}
SHAPE = (1, 28, 28)


def _model(name: str = "smallcnn", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(name, SHAPE, 10)


def _plan(name: str = "smallcnn") -> PruningPlan:
    return PruningPlan(_model(name), torch.zeros((1, *SHAPE)))


def _client(partition: int, num: int, **run_config: object):
    """A handler that runs EdgeFleet's real ClientApp ``train`` for one device."""
    cfg = {"local-steps": 2, "batch-size": 16, **run_config}
    ctx = Context(
        run_id=1,
        node_id=partition + 1,
        node_config={"partition-id": partition, "num-partitions": num},
        state=RecordDict(),
        run_config=cfg,
    )
    return lambda msg: train(msg, ctx)


def _wrapper(plan: PruningPlan, **kw) -> SubmodelReconstruction:
    return SubmodelReconstruction(FedAvg(**COMMON), lambda: plan, **kw)


def _reply_to(msg: Message, arrays: dict, n: int, device: int, kept=None) -> Message:
    reply = train_reply(msg, to_record(arrays), n, **{"device-id": device, "kept-fraction": 1.0})
    if kept is not None:
        reply.content[KEPT] = kept_record(kept)
    return reply


def _sends(plan: PruningPlan, kept, delta: float, n: int, device: int):
    """A fake device: the received model plus ``delta``, cut to ``kept`` (None: full)."""

    def handle(msg: Message) -> Message:
        got = {
            k: v + delta if v.dtype.kind == "f" else v
            for k, v in to_numpy(msg.content["arrays"]).items()
        }
        if kept is None:
            return _reply_to(msg, got, n, device)
        part = compact_slice(got, plan.index_maps(kept), plan.compact_shapes(kept))
        return _reply_to(msg, part, n, device, kept)

    return handle


def _run(strategy, grid: FakeGrid, arrays: ArrayRecord, rounds: int = 1):
    callbacks = strategy.round_callbacks() if hasattr(strategy, "round_callbacks") else []
    results = []

    class Keep:
        def on_start(self, arrays, first):
            pass

        def after_round(self, result):
            results.append(result)

    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=[*callbacks, Keep()])
    out = loop.run(arrays, rounds, ConfigRecord())
    return out.arrays, results


def test_clients_train_submodels_and_server_rebuilds_them() -> None:
    FakeGrid({})
    run = {"pruning.keep-ratios": "1.0,0.5,0.25"}
    grid = FakeGrid({i + 1: _client(i, 3, **run) for i in range(3)})
    plan = _plan()
    start = get_arrays(_model())
    arrays, results = _run(_wrapper(plan), grid, start, rounds=2)
    for res in results:
        assert res.rejected == [] and res.declined == []
        assert len(res.participants) == 3
        assert res.context.section(PruningRow).compact_replies == 2
        # A keep ratio is a share of the parameters: (1 + 0.5 + 0.25) / 3 at most, and
        # whole channels land within a few points below.
        assert 0.55 < res.context.section(PruningRow).mean_kept_fraction <= 1.75 / 3
    full_bytes = sum(a.numpy().nbytes for a in start.values())
    # one full reply, one with at most half, one with at most a quarter of the parameters
    assert 1.6 * full_bytes < results[0].bytes_up < 1.76 * full_bytes
    replies = [m for m in grid.sent if m.metadata.dst_node_id == 3]
    assert all("arrays" in m.content.array_records for m in replies)
    new = to_numpy(arrays)
    for key, value in to_numpy(start).items():
        assert new[key].shape == value.shape and np.isfinite(new[key]).all()
        assert not np.array_equal(new[key], value)  # every tensor got trained by someone
    # Each device's resource class reaches the fleet view: the share it last uploaded.
    fleet = {d["device"]: d["kept_fraction"] for d in results[-1].context.registry.snapshot(set())}
    assert fleet["0"] == 1.0 and 0.4 < fleet["1"] <= 0.5 and 0.15 < fleet["2"] <= 0.25


def test_full_masks_equal_fedavg_exactly() -> None:
    # resnet8: BatchNorm statistics and the integer num_batches_tracked included
    plan = _plan("resnet8")
    start = get_arrays(_model("resnet8"))
    fleet = {1: (1.0, 10, 0), 2: (-0.5, 30, 1), 3: (0.25, 60, 2)}
    full = FakeGrid({n: _sends(plan, None, d, k, dev) for n, (d, k, dev) in fleet.items()})
    compact = FakeGrid(
        {n: _sends(plan, plan.full_kept(), d, k, dev) for n, (d, k, dev) in fleet.items()}
    )
    plain, _ = _run(FedAvg(**COMMON), full, start, rounds=2)
    for mode in ("global", "zeros", "elementwise"):
        ours, res = _run(_wrapper(plan, reconstruction=mode), compact, start, rounds=2)
        assert res[0].context.section(PruningRow).compact_replies == 3
        for key, value in to_numpy(plain).items():
            got = to_numpy(ours)[key]
            assert got.dtype == value.dtype, key
            if value.dtype.kind == "f":
                np.testing.assert_allclose(got, value, rtol=1e-6, atol=1e-7, err_msg=key)
            else:
                np.testing.assert_array_equal(got, value, err_msg=key)
    assert to_numpy(plain)["layers.0.bn1.num_batches_tracked"].dtype == np.int64


def test_disjoint_masks_aggregate_as_specified() -> None:
    plan = _plan()
    even = {g: np.arange(0, n, 2) for g, n in plan.groups.items()}
    odd = {g: np.arange(1, n, 2) for g, n in plan.groups.items()}
    start = get_arrays(_model())
    g0 = to_numpy(start)
    grid = FakeGrid({1: _sends(plan, even, 1.0, 10, 0), 2: _sends(plan, odd, 3.0, 10, 1)})
    only_a = np.zeros(g0["conv1.weight"].size, bool)
    only_a[plan.index_maps(even)["conv1.weight"]] = True
    only_a = only_a.reshape(g0["conv1.weight"].shape)  # conv1 channels kept by A alone
    want = {
        "global": g0["conv1.weight"] + 0.5,  # (g + 1 + g) / 2
        "zeros": (g0["conv1.weight"] + 1.0) / 2,  # (g + 1 + 0) / 2
        "elementwise": g0["conv1.weight"] + 1.0,  # A's value alone
    }
    for mode, expected in want.items():
        arrays, _ = _run(_wrapper(plan, reconstruction=mode), grid, start)
        got = to_numpy(arrays)["conv1.weight"]
        np.testing.assert_allclose(got[only_a], expected[only_a], rtol=1e-6, err_msg=mode)
    # the classifier's bias is kept by both: the plain mean of g + 1 and g + 3
    arrays, _ = _run(_wrapper(plan), grid, start)
    bias = [k for k in g0 if k.endswith("bias")][-1]
    np.testing.assert_allclose(to_numpy(arrays)[bias], g0[bias] + 2.0, rtol=1e-6)


def _bad(plan: PruningPlan, kind: str):
    kept = {g: np.arange(0, n, 2) for g, n in plan.groups.items()}
    first = next(iter(kept))

    def handle(msg: Message) -> Message:
        got = to_numpy(msg.content["arrays"])
        part = compact_slice(got, plan.index_maps(kept), plan.compact_shapes(kept))
        bad_kept = {g: v.copy() for g, v in kept.items()}
        if kind == "out-of-range":
            bad_kept[first][-1] = plan.groups[first] + 5
        elif kind == "unsorted":
            bad_kept[first] = bad_kept[first][::-1].copy()
        elif kind == "unknown-group":
            bad_kept["nope"] = np.arange(2)
        elif kind == "wrong-shape":
            part["conv1.weight"] = part["conv1.weight"][:-1]
        elif kind == "nan":
            part["conv1.weight"] = part["conv1.weight"] * np.nan
        return _reply_to(msg, part, 10, 9, bad_kept)

    return handle


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("out-of-range", "out of bounds"),
        ("unsorted", "strictly increasing"),
        ("unknown-group", "unknown groups"),
        ("wrong-shape", "conv1.weight"),
        ("nan", "non-finite"),
    ],
)
def test_bad_submodel_replies_are_dropped_with_a_reason(kind: str, reason: str) -> None:
    plan = _plan()
    start = get_arrays(_model())
    grid = FakeGrid({1: _bad(plan, kind), 2: _sends(plan, None, 1.0, 10, 0)})
    arrays, res = _run(_wrapper(plan), grid, start)
    assert [r["device"] for r in res[0].rejected] == ["9"]
    assert reason in res[0].rejected[0]["reason"]
    assert res[0].participants == ["0"]
    np.testing.assert_allclose(
        to_numpy(arrays)["conv1.weight"], to_numpy(start)["conv1.weight"] + 1.0, rtol=1e-6
    )


def test_compact_download_sends_the_kept_slice_and_refreshes() -> None:
    FakeGrid({})
    run = {"pruning.keep-ratios": "1.0,0.25", "pruning.compact-download": True}
    grid = FakeGrid({i + 1: _client(i, 2, **run) for i in range(2)})
    plan = _plan()
    strategy = _wrapper(plan, compact_download=True, refresh_rounds=3)
    _, res = _run(strategy, grid, get_arrays(_model()), rounds=4)
    to_pruned = [m for m in grid.sent if m.metadata.dst_node_id == 2]
    got_kept = [KEPT in m.content.array_records for m in to_pruned]
    assert got_kept == [False, True, True, False]  # full, compact, compact, refresh
    assert [r.context.section(PruningRow).compact_downloads for r in res] == [0, 1, 1, 0]
    # the full model and a slice of at most a quarter of the parameters, against two full ones
    assert res[1].bytes_down < 0.63 * res[0].bytes_down
    assert all(r.rejected == [] and r.declined == [] and len(r.participants) == 2 for r in res)
    # the client trained what it was sent: its reply keeps the same channels; the device
    # registry holds them (device 1 is node 2), checkpointed with the rest of it
    registry = res[-1].context.registry
    kept = registry.devices["1"].submodel.kept_channels
    assert kept is not None and kept.keys() == plan.groups.keys()
    assert registry.devices["0"].submodel.kept_channels is None  # keep ratio 1.0: full-size replies
    assert registry.devices["1"].submodel.full_sent == 4
    again = DeviceRegistry()
    again.load_state_dict(json.loads(json.dumps(registry.state_dict())))
    back = again.devices["1"].submodel.kept_channels
    assert back is not None and all(np.array_equal(back[g], kept[g]) for g in kept)
    assert again.devices["1"].submodel.full_sent == 4


def test_compact_download_follows_a_device_to_its_new_node() -> None:
    """A device back on another node (a reboot) keeps its kept channels: once the registry
    knows the new node, its next download is compact, not a full model."""
    run = {"pruning.keep-ratios": "1.0,0.25", "pruning.compact-download": True}
    handlers = {i + 1: _client(i, 2, **run) for i in range(2)}
    grid = FakeGrid(dict(handlers))
    plan = _plan()
    strategy = _wrapper(plan, compact_download=True, refresh_rounds=10)
    rows = Rows()
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=[rows])
    arrays = loop.run(get_arrays(_model()), 2).arrays
    assert [KEPT in m.content.array_records for m in grid.sent if m.metadata.dst_node_id == 2] == [
        False, True
    ]  # fmt: skip
    grid.handlers[3] = grid.handlers.pop(2)  # device 1 reboots and comes back as node 3
    # Its first status answer binds the new node (energy-age selection asks every round;
    # without status queries the node is bound by its first reply and gets the full model).
    loop.registry.bind(3, "1")
    grid.sent.clear()
    loop.run(arrays, 3, first_round=3)
    to_new = [m for m in grid.sent if m.metadata.dst_node_id == 3]
    assert [KEPT in m.content.array_records for m in to_new] == [True]
    last = rows.results[-1]
    assert last.rejected == [] and sorted(last.participants) == ["0", "1"]


def test_pruning_config_errors_name_the_choices() -> None:
    with pytest.raises(ConfigError, match="fedavg"):
        parse_run_config({"pruning.reconstruction": "elementwise", "strategy": "fedsag"})
    with pytest.raises(ConfigError, match="pruning.keep-ratio"):
        parse_run_config({"pruning.keep-ratio": 0.0})
    with pytest.raises(ConfigError, match="taylor, signed"):
        parse_run_config({"pruning.score": "abs"})
    with pytest.raises(ConfigError, match="parameters, compute, channels"):
        parse_run_config({"pruning.budget": "flops"})
    with pytest.raises(NodeConfigError, match="keep-ratio"):
        get_profile({}, {"partition-id": 0, "num-partitions": 2, "keep-ratio": 1.5})
    _, profile = get_profile(
        {"pruning.keep-ratios": "1.0,0.5"}, {"partition-id": 1, "num-partitions": 2}
    )
    assert profile.keep_ratio == 0.5
    _, profile = get_profile(
        {"pruning.keep-ratios": "1.0,0.5"},
        {"partition-id": 1, "num-partitions": 2, "keep-ratio": 0.75},
    )
    assert profile.keep_ratio == 0.75  # the SuperNode's own resource class wins
