"""CA-HFP pruning core (arXiv 2603.12591): scores, groups, submodels, reconstruction."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch_pruning as tp
from torch import nn
from torch.func import functional_call

from edgefleet.pruning.importance import (
    CRITERIA,
    HESSIAN_ESTIMATORS,
    fisher_diagonal,
    hutchinson_diagonal,
    weight_scores,
)
from edgefleet.pruning.names import BUDGETS, CURVATURE_SCORES
from edgefleet.pruning.reconstruct import FILL_MODES, elementwise_average, scatter
from edgefleet.pruning.submodel import PruningPlan
from edgefleet.task.models import build_model

SHAPES = {"smallcnn": (1, 28, 28), "resnet8": (3, 16, 16), "mlp": (1, 8, 8)}
# For the budget tests: the models at the sizes the claims benchmarks run them.
BUDGET_SHAPES = {"smallcnn": (1, 28, 28), "resnet8": (3, 32, 32), "resnet20": (3, 32, 32)}

# The layers whose output produces each group's channels (hand-listed from models.py, not from
# Torch-Pruning): zeroing their weight and bias entries makes the channel exactly 0 everywhere.
PRODUCERS = {
    "smallcnn": {"conv1": ["conv1"], "conv2": ["conv2"], "fc1": ["fc1"]},
    "resnet8": {
        "conv1": ["bn1", "layers.0.bn2"],
        "layers.0.conv1": ["layers.0.bn1"],
        "layers.1.conv1": ["layers.1.bn1"],
        "layers.1.conv2": ["layers.1.bn2", "layers.1.shortcut.1"],
        "layers.2.conv1": ["layers.2.bn1"],
        "layers.2.conv2": ["layers.2.bn2", "layers.2.shortcut.1"],
    },
}


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = build_model(name, SHAPES[name], 10)
    # Non-trivial BatchNorm state, so that eval-mode BN is not the identity.
    gen = torch.Generator().manual_seed(seed + 1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.weight.data = torch.rand(n, generator=gen) + 0.5
            m.bias.data = torch.randn(n, generator=gen)
            m.running_mean = torch.randn(n, generator=gen)
            m.running_var = torch.rand(n, generator=gen) + 0.5
            m.num_batches_tracked = torch.tensor(7)
    return model.eval()


@pytest.fixture(scope="module")
def plans() -> dict[str, PruningPlan]:
    return {n: PruningPlan(_model(n), torch.zeros(1, *s)) for n, s in SHAPES.items()}


def _random_kept(plan: PruningPlan, model: nn.Module, ratio: float, seed: int = 3):
    scores = plan.group_scores(weight_scores(model, [], "random", seed=seed))
    return plan.select(scores, ratio, "channels")


def _first(counts: dict[str, int]) -> dict[str, np.ndarray]:
    """The first ``counts[g]`` channels of every group (sizes depend only on how many)."""
    return {g: np.arange(k, dtype=np.int64) for g, k in counts.items()}


def _numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- importance


def test_curvature_score_by_hand_on_linear() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    x = torch.randn(3, 3)
    y = torch.tensor([0, 1, 1])
    # Two batches of unequal size: g and the Fisher are means over all three samples.
    scores = weight_scores(layer, [(x[:2], y[:2]), (x[2:], y[2:])], "curvature", "fisher")

    w, b = layer.weight.detach().double().numpy(), layer.bias.detach().double().numpy()
    xs = x.double().numpy()
    per_w, per_b = [], []
    for i in range(3):
        logits = [sum(w[o, j] * xs[i, j] for j in range(3)) + b[o] for o in range(2)]
        exp = [np.exp(v) for v in logits]
        p = [e / sum(exp) for e in exp]
        dlogit = [p[o] - (1.0 if o == y[i] else 0.0) for o in range(2)]
        per_w.append([[dlogit[o] * xs[i, j] for j in range(3)] for o in range(2)])
        per_b.append(dlogit)
    gw, gb = np.mean(per_w, axis=0), np.mean(per_b, axis=0)
    fw, fb = np.mean(np.square(per_w), axis=0), np.mean(np.square(per_b), axis=0)
    # Removing w changes the loss by ~ -g w + 1/2 h w^2; the score is its absolute value.
    np.testing.assert_allclose(scores["weight"].numpy(), np.abs(-gw * w + 0.5 * fw * w**2), 1e-5)
    np.testing.assert_allclose(scores["bias"].numpy(), np.abs(-gb * b + 0.5 * fb * b**2), 1e-5)
    fisher = fisher_diagonal(layer, x, y)
    np.testing.assert_allclose(fisher["weight"].numpy(), fw, rtol=1e-5)
    # The seed's form: g w + h w^2, signed.
    signed = weight_scores(
        layer, [(x[:2], y[:2]), (x[2:], y[2:])], "curvature", "fisher", score="signed"
    )
    np.testing.assert_allclose(signed["weight"].numpy(), gw * w + fw * w**2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(signed["bias"].numpy(), gb * b + fb * b**2, rtol=1e-5, atol=1e-7)
    assert float(signed["weight"].min()) < 0  # signed indeed: some g w outweigh h w^2 here


def test_magnitude_and_random_scores() -> None:
    layer = nn.Linear(3, 2)
    mag = weight_scores(layer, [], "magnitude")
    torch.testing.assert_close(mag["weight"], layer.weight.detach().abs())
    r1 = weight_scores(layer, [], "random", seed=5)
    r2 = weight_scores(layer, [], "random", seed=5)
    r3 = weight_scores(layer, [], "random", seed=6)
    torch.testing.assert_close(r1["weight"], r2["weight"])
    assert not torch.equal(r1["weight"], r3["weight"])
    assert all(float(v.min()) >= 0 and float(v.max()) < 1 for v in r1.values())


def test_unknown_criterion_or_estimator() -> None:
    layer = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="curvature, magnitude, random"):
        weight_scores(layer, [], "taylor")
    with pytest.raises(ValueError, match="fisher, hutchinson"):
        weight_scores(layer, [], "curvature", hessian="kfac")
    with pytest.raises(ValueError, match="taylor, signed"):
        weight_scores(layer, [], "curvature", score="absolute")
    assert CRITERIA == ("curvature", "magnitude", "random", "prefix", "rolling", "ordered-dropout")
    assert CURVATURE_SCORES == ("taylor", "signed")
    assert HESSIAN_ESTIMATORS == ("fisher", "hutchinson")


def test_fisher_matches_per_sample_loop_and_leaves_model_alone() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model[1].running_mean.normal_()
    model.train()
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    before = copy.deepcopy(model.state_dict())

    fisher = fisher_diagonal(model, x, y)

    assert model.training and all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    # The oracle: one backward pass per sample, in eval mode (BN on running statistics).
    oracle = copy.deepcopy(model).eval()
    expected = {n: torch.zeros_like(p) for n, p in oracle.named_parameters()}
    for i in range(len(y)):
        oracle.zero_grad()
        nn.functional.cross_entropy(oracle(x[i : i + 1]), y[i : i + 1]).backward()
        for n, p in oracle.named_parameters():
            assert p.grad is not None
            expected[n] += p.grad.square() / len(y)
    for n, v in expected.items():
        torch.testing.assert_close(fisher[n], v, rtol=1e-4, atol=1e-7)


def test_hutchinson_converges_to_exact_hessian_diagonal() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(flat: torch.Tensor) -> torch.Tensor:
        parts = torch.split(flat, [s.numel() for s in shapes])
        params = {n: t.reshape(s) for n, t, s in zip(names, parts, shapes, strict=True)}
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    hessian = torch.autograd.functional.hessian(loss, flat0)
    samples = 3000
    est = hutchinson_diagonal(model, x, y, samples=samples, seed=0)
    est_flat = torch.cat([est[n].reshape(-1) for n in names])
    # Var of one probe's entry i is sum_{j != i} H_ij^2; allow 5 standard errors.
    off = hessian - torch.diag(torch.diag(hessian))
    tol = 5 * (off.square().sum(1) / samples).sqrt() + 1e-6
    assert torch.all((est_flat - torch.diag(hessian)).abs() <= tol)


def test_curvature_with_hutchinson_and_bn_model_state_unchanged() -> None:
    model = _model("resnet8").train()
    x, y = torch.randn(4, *SHAPES["resnet8"]), torch.randint(0, 10, (4,))
    before = copy.deepcopy(model.state_dict())
    scores = weight_scores(model, [(x, y)], "curvature", "hutchinson", seed=4, hutchinson_samples=1)
    assert set(scores) == {n for n, _ in model.named_parameters()}
    assert all(torch.isfinite(s).all() and (s >= 0).all() for s in scores.values())
    assert all(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---------------------------------------------------------------------------- groups


def test_group_names_exclude_classifier(plans: dict[str, PruningPlan]) -> None:
    assert plans["smallcnn"].groups == {"conv1": 32, "conv2": 64, "fc1": 128}
    assert plans["mlp"].groups == {"fc1": 200, "fc2": 200}
    assert plans["resnet8"].groups == {
        "conv1": 16,
        "layers.0.conv1": 16,
        "layers.1.conv1": 32,
        "layers.1.conv2": 32,
        "layers.2.conv1": 64,
        "layers.2.conv2": 64,
    }
    linear = build_model("linear", (1, 8, 8), 10)
    assert PruningPlan(linear, torch.zeros(1, 1, 8, 8)).groups == {}


def test_smallcnn_group_slices_consistent(plans: dict[str, PruningPlan]) -> None:
    full = _model("smallcnn")
    plan = plans["smallcnn"]
    kept = _random_kept(plan, full, 0.5)
    compact = plan.extract(full, kept)
    k1, k2, kf = kept["conv1"], kept["conv2"], kept["fc1"]
    assert compact.conv1.weight.shape == (16, 1, 3, 3)
    assert compact.conv2.weight.shape == (32, len(k1), 3, 3)
    assert compact.fc1.weight.shape == (64, len(k2) * 49)
    assert compact.fc2.weight.shape == (10, len(kf))
    w = full.state_dict()
    cols = (k2[:, None] * 49 + np.arange(49)).reshape(-1)
    torch.testing.assert_close(compact.conv1.bias, w["conv1.bias"][k1])
    torch.testing.assert_close(compact.conv2.weight, w["conv2.weight"][k2][:, k1])
    torch.testing.assert_close(compact.fc1.weight, w["fc1.weight"][kf][:, cols])
    torch.testing.assert_close(compact.fc2.weight, w["fc2.weight"][:, kf])
    assert compact.fc2.out_features == 10
    assert full.conv1.weight.shape == (32, 1, 3, 3)  # the original is untouched


# ResNet-8's coupling, by hand from models.py: module -> {tensor dim: group}. A BasicBlock's
# output channels are its input's (identity shortcut, stage 1) or its projection's; the stem,
# block 0's conv2 and the next block's inputs therefore share one group.
RESNET8_SLICES = {
    "conv1": {0: "conv1"},
    "bn1": {0: "conv1"},
    "layers.0.conv1": {0: "layers.0.conv1", 1: "conv1"},
    "layers.0.bn1": {0: "layers.0.conv1"},
    "layers.0.conv2": {0: "conv1", 1: "layers.0.conv1"},
    "layers.0.bn2": {0: "conv1"},
    "layers.1.conv1": {0: "layers.1.conv1", 1: "conv1"},
    "layers.1.bn1": {0: "layers.1.conv1"},
    "layers.1.conv2": {0: "layers.1.conv2", 1: "layers.1.conv1"},
    "layers.1.bn2": {0: "layers.1.conv2"},
    "layers.1.shortcut.0": {0: "layers.1.conv2", 1: "conv1"},
    "layers.1.shortcut.1": {0: "layers.1.conv2"},
    "layers.2.conv1": {0: "layers.2.conv1", 1: "layers.1.conv2"},
    "layers.2.bn1": {0: "layers.2.conv1"},
    "layers.2.conv2": {0: "layers.2.conv2", 1: "layers.2.conv1"},
    "layers.2.bn2": {0: "layers.2.conv2"},
    "layers.2.shortcut.0": {0: "layers.2.conv2", 1: "layers.1.conv2"},
    "layers.2.shortcut.1": {0: "layers.2.conv2"},
    "fc": {1: "layers.2.conv2"},
}


def test_resnet8_group_slices_consistent(plans: dict[str, PruningPlan]) -> None:
    full = _model("resnet8")
    plan = plans["resnet8"]
    kept = _random_kept(plan, full, 0.5)
    compact = plan.extract(full, kept).state_dict()
    for key, value in full.state_dict().items():
        module, tensor = key.rsplit(".", 1)
        expected = value
        if tensor != "num_batches_tracked":
            for dim, group in RESNET8_SLICES[module].items():
                if dim < value.ndim:  # fc.bias has no input dimension
                    expected = expected.index_select(dim, torch.from_numpy(kept[group]))
        torch.testing.assert_close(compact[key], expected, rtol=0, atol=0, msg=key)
    assert compact["fc.weight"].shape == (10, len(kept["layers.2.conv2"]))


@pytest.mark.parametrize("name", ["smallcnn", "resnet8"])
def test_group_scores_match_torch_pruning_magnitude(
    plans: dict[str, PruningPlan], name: str
) -> None:
    model = _model(name)
    plan = plans[name]
    scores = plan.group_scores(weight_scores(model, [], "magnitude"))
    # Torch-Pruning's own group L1 (weights, biases, BN affine entries, summed over the group).
    scratch = copy.deepcopy(model)
    dg = tp.DependencyGraph().build_dependency(
        scratch, example_inputs=torch.zeros(1, *SHAPES[name])
    )
    imp = tp.importance.GroupMagnitudeImportance(
        p=1, group_reduction="sum", normalizer=None, bias=True
    )
    for g, n in plan.groups.items():
        root = scratch.get_submodule(g)
        group = dg.get_pruning_group(
            root, dg.get_pruner_of_module(root).prune_out_channels, range(n)
        )
        np.testing.assert_allclose(scores[g], imp(group).double().numpy(), rtol=1e-5)
    # And one by hand: conv1's channel c in the SmallCNN.
    if name == "smallcnn":
        w = {k: v.abs().double().numpy() for k, v in model.state_dict().items()}
        c1 = w["conv1.weight"].sum((1, 2, 3)) + w["conv1.bias"] + w["conv2.weight"].sum((0, 2, 3))
        np.testing.assert_allclose(scores["conv1"], c1, rtol=1e-6)


def test_select(plans: dict[str, PruningPlan]) -> None:
    plan = plans["smallcnn"]
    scores = {g: np.arange(n, dtype=float)[::-1].copy() for g, n in plan.groups.items()}
    kept = plan.select(scores, 0.25, "channels")
    assert {g: k.tolist() for g, k in kept.items()} == {
        "conv1": list(range(8)),
        "conv2": list(range(16)),
        "fc1": list(range(32)),
    }
    assert all(k.dtype == np.int64 for k in kept.values())
    scores["conv1"] = np.array([5.0, 1, 9, 3] + [0.0] * 28)
    assert plan.select(scores, 0.1, "channels")["conv1"].tolist() == [0, 2, 3]  # round(3.2) = 3
    # Signed scores (the seed's form): the lowest, negative ones included, go first.
    scores["conv1"] = np.array([-5.0, 1, -9, 3] + [-20.0] * 28)
    assert plan.select(scores, 0.1, "channels")["conv1"].tolist() == [0, 1, 3]
    assert all(len(k) == 1 for k in plan.select(scores, 1e-6, "channels").values())
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="keep_ratio"):
            plan.select(scores, bad)
    with pytest.raises(ValueError, match="parameters, compute, channels"):
        plan.select(scores, 0.5, "flops")


def _macs(model: nn.Module, x: torch.Tensor) -> int:
    """Multiply-accumulates of the convolutions and linear layers of one forward pass of one
    sample, counted on the model itself: each weight entry once per output position."""
    total = 0

    def hook(module: nn.Module, _inp: object, out: torch.Tensor) -> None:
        nonlocal total
        positions = out[0, 0].numel() if isinstance(module, nn.Conv2d) else 1
        total += module.weight.numel() * positions

    hooks = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, nn.Conv2d | nn.Linear)
    ]
    with torch.no_grad():
        model.eval()(x)
    for h in hooks:
        h.remove()
    return total


@pytest.mark.parametrize("name", sorted(BUDGET_SHAPES))
def test_budget_meets_parameter_and_compute_shares(name: str) -> None:
    shape = BUDGET_SHAPES[name]
    torch.manual_seed(0)
    full = build_model(name, shape, 10)
    x = torch.zeros(1, *shape)
    plan = PruningPlan(full, x)
    scores = plan.group_scores(weight_scores(full, [], "magnitude"))
    full_params = sum(p.numel() for p in full.parameters())
    full_macs = _macs(full, x)
    for budget in ("parameters", "compute"):
        for target in (0.75, 0.5, 0.25, 0.1):
            kept = plan.select(scores, target, budget)
            compact = plan.extract(full, kept)
            params = sum(p.numel() for p in compact.parameters()) / full_params
            macs = _macs(compact, x) / full_macs
            # The plan's own accounting is exact on the submodel it cuts.
            assert plan.shares(kept) == pytest.approx({"parameters": params, "compute": macs})
            achieved = {"parameters": params, "compute": macs}[budget]
            # Within the budget, and as close as whole channels allow: one more step of the
            # shared channel share would overshoot.
            assert target - 0.04 < achieved <= target
            counts = plan.channel_counts(target, budget)
            bigger = {g: min(n, counts[g] + 1) for g, n in plan.groups.items()}
            assert plan.shares(_first(bigger))[budget] > target
    # The earlier meaning: a share of every group's channels, about r^2 of the parameters.
    half = plan.shares(plan.select(scores, 0.5, "channels"))["parameters"]
    assert 0.24 < half < 0.28


def test_budget_below_the_minimum_keeps_one_channel_a_group(
    plans: dict[str, PruningPlan],
) -> None:
    assert BUDGETS == ("parameters", "compute", "channels")
    for plan in plans.values():
        for budget in BUDGETS:
            counts = plan.channel_counts(1e-6, budget)
            assert counts == {g: 1 for g in plan.groups}
            assert 0 < plan.shares(_first(counts))["parameters"] < 0.05
        assert plan.channel_counts(1.0, "parameters") == plan.groups


def test_smallcnn_half_keeps_a_quarter_of_parameters(plans: dict[str, PruningPlan]) -> None:
    full = _model("smallcnn")
    compact = plans["smallcnn"].extract(full, _random_kept(plans["smallcnn"], full, 0.5))
    frac = sum(p.numel() for p in compact.parameters()) / sum(p.numel() for p in full.parameters())
    assert 0.25 <= frac <= 0.30


# ---------------------------------------------------------------------------- submodels


@pytest.mark.parametrize("name", ["smallcnn", "resnet8"])
def test_compact_forward_equals_zeroed_full_forward(
    plans: dict[str, PruningPlan], name: str
) -> None:
    full = _model(name)
    plan = plans[name]
    kept = _random_kept(plan, full, 0.5)
    compact = plan.extract(full, kept).eval()
    # A pruned channel's producers (a conv/linear without BN, or the BNs that end every path
    # into a residual sum) output exactly 0 once their weight and bias entries are 0, whatever
    # the running statistics; consumers then get nothing from it, as if its slice were gone.
    zeroed = copy.deepcopy(full).eval()
    with torch.no_grad():
        for group, producers in PRODUCERS[name].items():
            pruned = torch.from_numpy(np.setdiff1d(np.arange(plan.groups[group]), kept[group]))
            for layer in producers:
                module = zeroed.get_submodule(layer)
                module.weight[pruned] = 0
                module.bias[pruned] = 0
    x = torch.randn(5, *SHAPES[name], generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(compact(x), zeroed(x), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(full(x), zeroed(x), atol=1e-3)  # pruning did something


@pytest.mark.parametrize("name", ["smallcnn", "resnet8", "mlp"])
def test_extract_maps_scatter_is_identity(plans: dict[str, PruningPlan], name: str) -> None:
    full = _model(name)
    plan = plans[name]
    kept = _random_kept(plan, full, 0.4)
    compact = _numpy_state(plan.extract(full, kept))
    maps = plan.index_maps(kept)
    global_arrays = _numpy_state(full)
    assert set(maps) == set(global_arrays)
    for k, m in maps.items():
        assert m.dtype == np.int64
        np.testing.assert_array_equal(compact[k].reshape(-1), global_arrays[k].reshape(-1)[m])
    rebuilt = scatter(global_arrays, compact, maps, fill="global")
    for k, v in global_arrays.items():
        assert rebuilt[k].dtype == v.dtype
        np.testing.assert_array_equal(rebuilt[k], v)


def test_index_maps_float64_trick_oracle(plans: dict[str, PruningPlan]) -> None:
    # DESIGN.md's reference: prune a float64 copy whose entries hold their own flat index.
    plan = plans["resnet8"]
    full = _model("resnet8")
    kept = _random_kept(plan, full, 0.3, seed=11)
    index_model = copy.deepcopy(full).double()
    with torch.no_grad():
        for t in index_model.state_dict().values():
            if t.dtype == torch.float64:
                t.copy_(torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape))
    plan_64 = PruningPlan(index_model, torch.zeros(1, *SHAPES["resnet8"], dtype=torch.float64))
    pruned = plan_64.extract(index_model, kept).state_dict()
    maps = plan.index_maps(kept)
    for k, v in pruned.items():
        if v.dtype == torch.float64:
            np.testing.assert_array_equal(maps[k], v.numpy().reshape(-1).astype(np.int64))
        else:
            assert maps[k].tolist() == [0]


def test_keep_ratio_one_is_identity(plans: dict[str, PruningPlan]) -> None:
    for name, plan in plans.items():
        full = _model(name)
        kept = plan.select(plan.group_scores(weight_scores(full, [], "magnitude")), 1.0)
        assert {g: k.tolist() for g, k in kept.items()} == {
            g: list(range(n)) for g, n in plan.groups.items()
        }
        compact = plan.extract(full, kept)
        for k, v in full.state_dict().items():
            assert torch.equal(compact.state_dict()[k], v)
            np.testing.assert_array_equal(plan.index_maps(kept)[k], np.arange(max(v.numel(), 1)))
        x = torch.randn(2, *SHAPES[name])
        with torch.no_grad():
            assert torch.equal(compact.eval()(x), full(x))


def test_extract_rejects_bad_kept_and_other_architecture(plans: dict[str, PruningPlan]) -> None:
    plan = plans["smallcnn"]
    kept = plan.full_kept()
    kept["conv1"] = np.array([3, 1])
    with pytest.raises(ValueError, match="strictly increasing"):
        plan.extract(_model("smallcnn"), kept)
    with pytest.raises(ValueError, match="architecture"):
        plan.extract(_model("mlp"), plan.full_kept())


def test_validate_kept(plans: dict[str, PruningPlan]) -> None:
    plan = plans["smallcnn"]
    good = plan.full_kept()
    assert plan.validate_kept(good) is None
    cases = {
        "unknown": ({**good, "conv9": np.array([0])}, "unknown"),
        "missing": ({k: v for k, v in good.items() if k != "fc1"}, "missing"),
        "float": ({**good, "conv1": np.array([0.0, 1.0])}, "integers"),
        "2-D": ({**good, "conv1": np.array([[0, 1]])}, "1-D"),
        "empty": ({**good, "conv1": np.array([], dtype=np.int64)}, "no channel"),
        "too big": ({**good, "conv1": np.array([0, 32])}, "out of bounds"),
        "negative": ({**good, "conv1": np.array([-1, 2])}, "out of bounds"),
        "unsorted": ({**good, "conv1": np.array([2, 1])}, "strictly increasing"),
        "duplicate": ({**good, "conv1": np.array([1, 1])}, "strictly increasing"),
        "list": ({**good, "conv1": [0, 1]}, "NumPy array"),
    }
    for case, (kept, word) in cases.items():
        reason = plan.validate_kept(kept)
        assert reason is not None and word in reason, case
    assert plan.validate_kept([1, 2]) is not None  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- reconstruction


def test_scatter_zeros_exactly_the_pruned_entries(plans: dict[str, PruningPlan]) -> None:
    full = _model("resnet8")
    plan = plans["resnet8"]
    kept = _random_kept(plan, full, 0.5)
    compact, maps = _numpy_state(plan.extract(full, kept)), plan.index_maps(kept)
    # A client update: compact + 1 everywhere it trained.
    update = {k: v + np.ones((), dtype=v.dtype) for k, v in compact.items()}
    global_arrays = _numpy_state(full)
    zeros = scatter(global_arrays, update, maps, fill="zeros")
    filled = scatter(global_arrays, update, maps, fill="global")
    for k, g in global_arrays.items():
        mask = np.zeros(g.size, dtype=bool)
        mask[maps[k]] = True
        mask = mask.reshape(g.shape)
        assert zeros[k].dtype == g.dtype
        np.testing.assert_array_equal(zeros[k][~mask], 0)
        np.testing.assert_array_equal(zeros[k][mask], (g + np.ones((), g.dtype))[mask])
        np.testing.assert_array_equal(filled[k][~mask], g[~mask])
        np.testing.assert_array_equal(filled[k][mask], zeros[k][mask])
    assert FILL_MODES == ("global", "zeros")
    with pytest.raises(ValueError, match="global, zeros"):
        scatter(global_arrays, update, maps, fill="mean")


def test_scatter_checks_sizes() -> None:
    g = {"w": np.zeros(4, np.float32)}
    with pytest.raises(ValueError, match="w: compact tensor has 3 entries, its map 2"):
        scatter(g, {"w": np.ones(3, np.float32)}, {"w": np.array([0, 1])})
    with pytest.raises(ValueError, match="w: index map out of bounds"):
        scatter(g, {"w": np.ones(2, np.float32)}, {"w": np.array([0, 4])})
    with pytest.raises(ValueError, match="missing keys"):
        scatter(g, {}, {"w": np.array([0])})
    with pytest.raises(ValueError, match="dtype"):
        scatter(g, {"w": np.ones(2, np.float64)}, {"w": np.array([0, 1])})


def _hand_average(
    global_vec: np.ndarray, updates: list[tuple[np.ndarray, np.ndarray, float]]
) -> np.ndarray:
    out = global_vec.astype(np.float64).copy()
    for i in range(global_vec.size):
        num = den = 0.0
        for values, idx, w in updates:
            for v, j in zip(values, idx, strict=True):
                if j == i:
                    num += w * float(v)
                    den += w
        if den > 0:
            out[i] = num / den
    return out


@pytest.mark.parametrize(
    ("idx_a", "idx_b"),
    [([0, 1, 2], [3, 4]), ([0, 1, 2, 3], [2, 3, 4])],
    ids=["disjoint", "overlap"],
)
def test_elementwise_average_by_hand(idx_a: list[int], idx_b: list[int]) -> None:
    g = {"w": np.arange(6, dtype=np.float32) * 10, "n": np.array(4, dtype=np.int64)}
    rng = np.random.default_rng(0)
    a = {"w": rng.standard_normal(len(idx_a)).astype(np.float32), "n": np.array(10)}
    b = {"w": rng.standard_normal(len(idx_b)).astype(np.float32), "n": np.array(20)}
    maps_a = {"w": np.array(idx_a), "n": np.array([0])}
    maps_b = {"w": np.array(idx_b), "n": np.array([0])}
    out = elementwise_average(g, [(a, maps_a, 1.0), (b, maps_b, 3.0)])
    expected = _hand_average(g["w"], [(a["w"], maps_a["w"], 1.0), (b["w"], maps_b["w"], 3.0)])
    assert out["w"].dtype == np.float32 and out["n"].dtype == np.int64
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6)
    assert out["w"][5] == 50.0  # nobody kept it
    assert int(out["n"]) == 18  # (10 + 3 * 20) / 4 = 17.5, rounded half to even
    assert elementwise_average(g, [])["w"].tolist() == g["w"].tolist()
    with pytest.raises(ValueError, match="weight"):
        elementwise_average(g, [(a, maps_a, -1.0)])


def test_elementwise_average_full_masks_is_fedavg() -> None:
    rng = np.random.default_rng(1)
    g = {"w": rng.standard_normal((3, 4)).astype(np.float32)}
    full = {"w": np.arange(12)}
    clients = [{"w": rng.standard_normal((3, 4)).astype(np.float32)} for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    out = elementwise_average(g, [(c, full, w) for c, w in zip(clients, weights, strict=True)])
    fedavg = sum(w * c["w"].astype(np.float64) for c, w in zip(clients, weights, strict=True)) / 8
    np.testing.assert_allclose(out["w"], fedavg, rtol=1e-6)
