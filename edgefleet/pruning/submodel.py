"""Channel groups, channel selection and physically smaller submodels for CA-HFP.

CA-HFP (arXiv 2603.12591) lets a weak client train a structurally pruned submodel of the global
model: whole output channels of convolutions and output neurons of linear layers are removed,
together with every tensor slice that depends on them (the next layer's input slice,
BatchNorm entries, residual partners and shortcut convolutions). Torch-Pruning's
``DependencyGraph`` finds these coupled slices for any traceable network; :class:`PruningPlan`
wraps it for one model architecture:

- ``groups``: the prunable groups (name -> channels). The classifier's outputs are never a
  group, and the inputs of the first layer cannot be one (they are coupled to the data only).
- ``group_scores`` + ``select``: per-weight scores (``edgefleet.pruning.importance``) summed
  per channel, and the top-scoring channels of every group, as many as the keep ratio allows
  (``channel_counts``).
- ``extract``: a deep copy of the model physically pruned to the kept channels; it trains
  faster and its state dict (same keys, smaller tensors) is what the client uploads.
- ``index_maps``: for every state-dict entry, the flat indices into the full tensor of the
  compact tensor's entries, which the server needs to scatter an update back
  (``edgefleet.pruning.reconstruct``).
- ``validate_kept``: why a client's kept-channel dict is unusable, or None.

What a keep ratio r means (``BUDGETS``, run-config ``pruning.budget``):

- ``"parameters"`` (default): the submodel holds at most a share r of the full model's
  parameters. This is what a device owner's "my device can afford half" means for memory (the
  weights, their gradients and the optimiser state all scale with it) and for the bytes sent
  and received, the two costs CA-HFP sets out to cut and the ones a device cannot exceed. Every
  group keeps the same share c of its channels, c solved for (:meth:`channel_counts`); between
  two pruned layers parameters scale about c^2, so c is about sqrt(r) (r = 0.25 keeps about
  half of the channels).
- ``"compute"``: at most a share r of the multiply-accumulates of one forward pass (of the
  convolutions and linear layers, which hold nearly all of them). For a device whose limit is
  time or energy per round; on the models here it lands within a few points of ``parameters``.
- ``"channels"``: every group keeps round(r n) of its n channels (the earlier meaning); about
  r^2 of the parameters survive between two pruned layers.

The first layer's inputs and the classifier's outputs are never pruned and a group keeps at
least one channel, so the smallest share a plan can reach is above 0; a smaller target gets
that minimum (:meth:`shares` says what a selection achieved).

Group names are stable across processes: a group is named after the first module, in
``model.named_modules()`` order, among the convolutions and linear layers whose output channels
it prunes (so ``conv1``, ``layers.1.conv2``; residual-coupled layers share one group and one
name). Kept channels travel as ``{group name: sorted int64 channel indices}``.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch_pruning as tp
from torch import Tensor, nn

from edgefleet.bounds import names
from edgefleet.pruning.importance import evaluating
from edgefleet.pruning.names import BUDGETS, Budget
from edgefleet.task.datasets import dataset_info
from edgefleet.task.models import build_model

# Index maps are a pure function of the kept channels; clients that keep the same channels
# (every keep-ratio-1 client, or a client whose scores did not change) share one entry.
_MAP_CACHE_SIZE = 64

_ROOT_TYPES = (tp.ops.TORCH_CONV, tp.ops.TORCH_LINEAR)


@dataclass(frozen=True)
class _Slice:
    """Positions ``positions`` along dimension ``dim`` of a state-dict tensor belong to channels
    ``channels`` (same length) of group ``group``."""

    group: str
    dim: int
    positions: np.ndarray
    channels: np.ndarray


def _dependency_graph(model: nn.Module, example_input: Tensor) -> tp.DependencyGraph:
    # Tracing runs a forward pass: in eval mode, so BatchNorm's running statistics stay put
    # (and a batch of one works), with autograd on since Torch-Pruning traces grad_fns.
    with evaluating(model):
        return tp.DependencyGraph().build_dependency(
            model, example_inputs=example_input, verbose=False
        )


def _output_layer(model: nn.Module, example_input: Tensor) -> nn.Module:
    """The convolution or linear layer that runs last in the forward pass: the classifier."""
    called: list[nn.Module] = []
    _forward_with_hook(model, example_input, lambda module, _inp, _out: called.append(module))
    if not called:
        raise ValueError("the model has no convolution or linear layer to prune")
    return called[-1]


def _positions(model: nn.Module, example_input: Tensor) -> dict[nn.Module, int]:
    """Per convolution or linear layer, how many output positions one sample gives it (H x W
    for a 2-D convolution, 1 for a linear layer on flat features): each weight entry costs that
    many multiply-accumulates per sample."""
    counts: dict[nn.Module, int] = {}

    def hook(module: nn.Module, _inp: Any, out: Tensor) -> None:
        # Channels are dimension 1 of a convolution's output, the last of a linear layer's.
        channels = out.shape[-1] if isinstance(module, tp.ops.TORCH_LINEAR) else out.shape[1]
        counts[module] = counts.get(module, 0) + out.numel() // (out.shape[0] * channels)

    _forward_with_hook(model, example_input, hook)
    return counts


def _forward_with_hook(model: nn.Module, example_input: Tensor, hook: Any) -> None:
    """One evaluation-mode forward pass with ``hook`` on every convolution and linear layer."""
    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, _ROOT_TYPES)]
    try:
        with evaluating(model), torch.no_grad():
            model(example_input)
    finally:
        for h in hooks:
            h.remove()


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    """The module's own parameters and buffers (not its children's), by attribute name."""
    own = {**module._parameters, **module._buffers}
    return {name: t for name, t in own.items() if t is not None}


def _item_slices(
    module: nn.Module, handler: Callable[..., Any], idxs: list[int], root_idxs: list[int]
) -> Iterator[tuple[str, int]]:
    """(tensor name, dimension) of every tensor of ``module`` that ``handler`` slices.

    Found generically (whatever the layer type) with the float64 index-valued copy trick: a
    copy of the layer whose entries hold their own flat index is pruned; the dimension that
    shrank is the sliced one, and the surviving values must be exactly ``np.delete`` of the
    removed positions along it, else the slicing is not a plain per-position removal and the
    plan cannot map it.
    """
    positions = np.asarray(idxs, dtype=np.int64)
    channels = np.asarray(root_idxs, dtype=np.int64)
    # Removing only odd channels makes the value check meaningful (something survives).
    removed = positions[channels % 2 == 1]
    if removed.size == 0:
        removed = positions
    probe = copy.deepcopy(module)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in _tensors(probe).items():
        shapes[name] = tuple(t.shape)
        index = torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape)
        if name in probe._parameters:
            probe._parameters[name] = nn.Parameter(index, requires_grad=False)
        else:
            probe._buffers[name] = index
    handler(probe, removed.tolist())
    for name, t in _tensors(probe).items():
        before = shapes[name]
        shrunk = [d for d, (a, b) in enumerate(zip(before, t.shape, strict=True)) if a != b]
        if not shrunk:
            continue
        expected = np.delete(np.arange(np.prod(before)).reshape(before), removed, axis=shrunk[0])
        if len(shrunk) != 1 or not np.array_equal(t.detach().numpy(), expected):
            raise NotImplementedError(
                f"{type(module).__name__}.{name}: {handler} does not remove plain positions "
                "along one dimension; the pruning plan cannot map it"
            )
        yield name, shrunk[0]


class PruningPlan:
    """The prunable channel groups of one architecture (CA-HFP, arXiv 2603.12591).

    ``model`` is a template (not modified; any weights) and ``example_input`` a batch shaped
    like the data (one sample suffices) used to trace the dependency graph.
    """

    def __init__(self, model: nn.Module, example_input: Tensor) -> None:
        self._example = example_input.detach().clone()
        scratch = copy.deepcopy(model)
        self._shapes = {k: tuple(v.shape) for k, v in scratch.state_dict().items()}
        self._param_names = frozenset(n for n, _ in scratch.named_parameters())
        names = {m: n for n, m in scratch.named_modules()}
        order = {n: i for i, n in enumerate(names.values())}
        dg = _dependency_graph(scratch, self._example)
        classifier = _output_layer(scratch, self._example)

        groups: dict[str, int] = {}
        slices: dict[str, list[_Slice]] = {}
        for group in dg.get_all_groups(ignored_layers=[classifier], root_module_types=_ROOT_TYPES):
            roots = [
                names[item.dep.target.module]
                for item in group
                if isinstance(item.dep.target.module, _ROOT_TYPES)
                and dg.is_out_channel_pruning_fn(item.dep.handler)
            ]
            gname = min(roots, key=order.__getitem__)
            groups[gname] = len(group[0].idxs)  # get_all_groups hands out full index lists
            for item in group:
                module = item.dep.target.module
                if module not in names:  # tracing ops (add, flatten, ...): no tensors of ours
                    continue
                prefix = f"{names[module]}." if names[module] else ""
                for tname, dim in _item_slices(module, item.dep.handler, item.idxs, item.root_idxs):
                    key = prefix + tname
                    if any(s.dim == dim and s.group == gname for s in slices.get(key, ())):
                        continue  # the same slice reached twice (e.g. in and out of one op)
                    slices.setdefault(key, []).append(
                        _Slice(
                            gname,
                            dim,
                            np.asarray(item.idxs, dtype=np.int64),
                            np.asarray(item.root_idxs, dtype=np.int64),
                        )
                    )
        self._groups = dict(sorted(groups.items(), key=lambda kv: order[kv[0]]))
        self._slices = slices
        self._maps: OrderedDict[tuple[tuple[str, bytes], ...], dict[str, np.ndarray]] = (
            OrderedDict()
        )
        self._macs_per_entry = {
            f"{names[m]}.weight" if names[m] else "weight": count
            for m, count in _positions(scratch, self._example).items()
        }
        self._full_size = self._size({g: np.arange(n) for g, n in self._groups.items()})
        self._counts: dict[tuple[float, str], dict[str, int]] = {}

    @property
    def groups(self) -> dict[str, int]:
        """Group name -> number of channels, in ``named_modules`` order."""
        return dict(self._groups)

    def full_kept(self) -> dict[str, np.ndarray]:
        """Every channel of every group (what keep ratio 1 selects)."""
        return {g: np.arange(n, dtype=np.int64) for g, n in self._groups.items()}

    # ---------------------------------------------------------------- scores and selection

    def group_scores(self, weight_scores: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
        """Per channel, the sum of ``weight_scores`` over every tensor slice that depends on it
        (the root's output slice and bias entry, consumers' input slices, BatchNorm weight and
        bias entries, residual partners). Buffers carry no score. float64 arrays."""
        out = {g: np.zeros(n) for g, n in self._groups.items()}
        for key, key_slices in self._slices.items():
            if key not in self._param_names:
                continue
            if key not in weight_scores:
                raise ValueError(f"weight scores lack parameter {key!r}")
            score = weight_scores[key].detach().to(torch.float64).cpu().numpy()
            if score.shape != self._shapes[key]:
                raise ValueError(
                    f"weight scores for {key!r} have shape {score.shape}, "
                    f"the parameter {self._shapes[key]}"
                )
            for s in key_slices:
                other = tuple(d for d in range(score.ndim) if d != s.dim)
                per_position = score.sum(axis=other)[s.positions]
                out[s.group] += np.bincount(
                    s.channels, weights=per_position, minlength=self._groups[s.group]
                )
        return out

    def select(
        self, scores: Mapping[str, np.ndarray], keep_ratio: float, budget: str = "parameters"
    ) -> dict[str, np.ndarray]:
        """The highest-scoring ``channel_counts(keep_ratio, budget)[g]`` channels of every
        group ``g`` (ties go to the lower channel index), sorted ascending, int64."""
        counts = self.channel_counts(keep_ratio, budget)
        if set(scores) != set(self._groups):
            raise ValueError(
                f"scores must cover exactly the groups {sorted(self._groups)}, got {sorted(scores)}"
            )
        kept: dict[str, np.ndarray] = {}
        for g, n in self._groups.items():
            s = np.asarray(scores[g], dtype=np.float64)
            if s.shape != (n,) or not np.isfinite(s).all():
                raise ValueError(f"scores of group {g!r} must be {n} finite values")
            kept[g] = np.sort(np.argsort(-s, kind="stable")[: counts[g]]).astype(np.int64)
        return kept

    def channel_counts(self, keep_ratio: float, budget: str = "parameters") -> dict[str, int]:
        """How many channels every group keeps for ``keep_ratio`` (see the module docstring).

        ``channels``: ``max(1, round(keep_ratio * n))`` of a group's n (rounding half up).
        ``parameters`` / ``compute``: the same rule with the largest channel share c whose
        submodel stays within ``keep_ratio`` of the full model's parameters / multiply-
        accumulates; the minimum of one channel a group when no c meets the target. The counts
        change only where some c n crosses a half-integer, so a binary search over those steps
        (the size only grows with c) finds c exactly in about log2(total channels) sizings."""
        if not 0.0 < keep_ratio <= 1.0:
            raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
        if budget not in BUDGETS:
            raise ValueError(f"unknown budget {budget!r}; valid choices: {', '.join(BUDGETS)}")
        cache_key = (keep_ratio, budget)
        if cache_key not in self._counts:
            if budget == Budget.CHANNELS or keep_ratio >= 1.0:
                counts = self._uniform_counts(keep_ratio)
            else:
                limit = keep_ratio * self._full_size[budget]
                steps = sorted(
                    {(k - 0.5) / n for n in self._groups.values() for k in range(2, n + 1)}
                )
                edges = [0.0, *steps, 1.0]
                # One share inside each interval between steps (never on a step, where
                # rounding could land on either side), in increasing order of size.
                inside = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
                low, high = 0, len(inside)  # inside[low] fits (or is the minimum); high does not
                while high - low > 1:
                    mid = (low + high) // 2
                    size = self._size(self._first(self._uniform_counts(inside[mid])))
                    if size[budget] <= limit:
                        low = mid
                    else:
                        high = mid
                counts = self._uniform_counts(inside[low])
            self._counts[cache_key] = counts
        return dict(self._counts[cache_key])

    def shares(self, kept: Mapping[str, np.ndarray]) -> dict[str, float]:
        """The share of the full model's ``parameters`` and ``compute`` (multiply-accumulates of
        the convolutions and linear layers in one forward pass) that the submodel keeping
        ``kept`` has."""
        self._checked(kept)
        size = self._size(kept)
        return {k: size[k] / self._full_size[k] for k in ("parameters", "compute")}

    def _uniform_counts(self, share: float) -> dict[str, int]:
        return {g: max(1, int(np.floor(share * n + 0.5))) for g, n in self._groups.items()}

    @staticmethod
    def _first(counts: Mapping[str, int]) -> dict[str, np.ndarray]:
        # Sizes depend on how many channels a group keeps, not which (a channel owns the same
        # number of positions in every tensor it touches), so the first ones stand for any.
        return {g: np.arange(k, dtype=np.int64) for g, k in counts.items()}

    def _size(self, kept: Mapping[str, np.ndarray]) -> dict[str, int]:
        params = macs = 0
        for key in self._param_names:
            numel = int(np.prod([len(a) for a in self._kept_axes(key, kept)]))
            params += numel
            macs += numel * self._macs_per_entry.get(key, 0)
        return {"parameters": params, "compute": macs}

    def validate_kept(self, kept: Mapping[str, Any]) -> str | None:
        """Why ``kept`` (e.g. a client's reply) cannot be used with this plan, or None."""
        if not isinstance(kept, Mapping):
            return f"kept channels must be a mapping of group name to indices, got {type(kept)}"
        unknown = set(kept) - set(self._groups)
        missing = set(self._groups) - set(kept)
        if unknown:  # a reply's names: listed bounded
            return f"unknown groups {names(unknown)}"
        if missing:
            return f"missing groups {names(missing)}"
        for g, n in self._groups.items():
            idx = kept[g]
            if not isinstance(idx, np.ndarray):
                return f"group {g!r}: indices must be a NumPy array, got {type(idx).__name__}"
            if not np.issubdtype(idx.dtype, np.integer):
                return f"group {g!r}: indices must be integers, got dtype {idx.dtype}"
            if idx.ndim != 1:
                return f"group {g!r}: indices must be 1-D, got shape {idx.shape}"
            if idx.size == 0:
                return f"group {g!r}: keeps no channel"
            if idx.min() < 0 or idx.max() >= n:
                return f"group {g!r}: indices out of bounds for {n} channels"
            if np.any(np.diff(idx) <= 0):
                return f"group {g!r}: indices must be strictly increasing (sorted, no duplicates)"
        return None

    def _checked(self, kept: Mapping[str, Any]) -> None:
        reason = self.validate_kept(kept)
        if reason is not None:
            raise ValueError(reason)

    # ---------------------------------------------------------------- submodels and maps

    def extract(self, model: nn.Module, kept: Mapping[str, np.ndarray]) -> nn.Module:
        """A deep copy of ``model`` (this plan's architecture) with only the ``kept`` channels:
        tensors really shrink (BatchNorm running statistics included), state-dict keys stay.
        ``model`` itself is not modified."""
        self._checked(kept)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if shapes != self._shapes:
            raise ValueError("the model's state dict does not match the plan's architecture")
        compact = copy.deepcopy(model)
        device = next(iter(compact.parameters())).device
        dg = _dependency_graph(compact, self._example.to(device))
        for g, n in self._groups.items():
            removed = np.setdiff1d(np.arange(n), kept[g])
            if removed.size == 0:
                continue
            root = compact.get_submodule(g)
            pruner = dg.get_pruner_of_module(root)
            dg.get_pruning_group(root, pruner.prune_out_channels, removed.tolist()).prune()
        return compact

    def index_maps(self, kept: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """For every state-dict key (parameters and buffers), the int64 flat indices into the full
        tensor of the compact tensor's entries, in the compact tensor's row-major order: the
        compact tensor equals ``full.reshape(-1)[map].reshape(compact_shape)``. 0-d buffers
        (``num_batches_tracked``) map to ``[0]``. The arrays are cached and read-only.

        Computed from the sliced dimensions found once at construction (no dependency graph
        per call); the tests check them against :meth:`extract`.
        """
        self._checked(kept)
        cache_key = tuple((g, np.asarray(kept[g], dtype=np.int64).tobytes()) for g in self._groups)
        if cache_key in self._maps:
            self._maps.move_to_end(cache_key)
            return dict(self._maps[cache_key])
        maps: dict[str, np.ndarray] = {}
        for key, shape in self._shapes.items():
            axes = self._kept_axes(key, kept)
            flat = np.ravel_multi_index(np.ix_(*axes), shape) if shape else np.zeros(1)
            m = np.asarray(flat, dtype=np.int64).reshape(-1)
            m.flags.writeable = False
            maps[key] = m
        self._maps[cache_key] = maps
        if len(self._maps) > _MAP_CACHE_SIZE:
            self._maps.popitem(last=False)
        return dict(maps)

    def compact_shapes(self, kept: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        """The shape of every state-dict tensor of the submodel that keeps ``kept``: what a
        client's compact reply must hold (the server checks it before reconstruction)."""
        self._checked(kept)
        return {key: tuple(len(a) for a in self._kept_axes(key, kept)) for key in self._shapes}

    def _kept_axes(self, key: str, kept: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Per dimension of tensor ``key``, the positions the submodel keeps."""
        shape = self._shapes[key]
        axes = [np.arange(n, dtype=np.int64) for n in shape]
        masks: dict[int, np.ndarray] = {}
        for s in self._slices.get(key, ()):
            mask = masks.setdefault(s.dim, np.ones(shape[s.dim], dtype=bool))
            mask[s.positions] = np.isin(s.channels, kept[s.group])
        for dim, mask in masks.items():
            axes[dim] = np.flatnonzero(mask).astype(np.int64)
        return axes


@functools.cache
def plan_for(model: str, dataset: str) -> PruningPlan:
    """The channel groups of model ``model`` built for ``dataset``'s inputs and classes (what
    the server rebuilds CA-HFP submodels with, a device prunes its copy with, and an attacker
    slices the sent model with).

    One per process and architecture: a plan is a template that holds no weights, and tracing
    it costs forward passes (42-122 ms for SmallCNN), which a Ray actor serving a fleet of
    devices would otherwise pay once per device."""

    info = dataset_info(dataset)
    return PruningPlan(
        build_model(model, info.input_shape, info.num_classes),
        torch.zeros((1, *info.input_shape)),
    )
