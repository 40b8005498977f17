"""Robust aggregation rules, as pure NumPy, and :class:`RobustAggregation`, the wrapper that
puts one in place of a FedAvg-family strategy's weighted mean.

Reply screening (:mod:`edgefleet.loop.screening`) stops replies that break a bound;
an attacker that keeps its update inside the bounds (sign flip at the honest norm, ALIE,
IPM, label flipping: :mod:`edgefleet.attacks`) is averaged in. A robust rule limits what such
a reply does to the aggregate:

- ``median``: the coordinate-wise median (Yin et al. 2018; Flower's ``FedMedian``);
- ``trimmed-mean`` (``beta``): per coordinate, the mean after dropping the
  ``int(beta * n)`` lowest and highest values (Flower's ``FedTrimmedAvg``, same cut);
- ``multikrum`` (``f``, ``m``): the ``m`` replies (0: ``n - f``) whose summed squared
  distance to their ``n - f - 2`` nearest neighbours is lowest (Blanchard et al. 2017,
  Flower's ``MultiKrum`` scoring), then their weighted mean;
- ``centered-clip`` (``tau``, ``iterations``): starting at the model the server sent (no
  update), ``iterations`` times ``v += mean_i (x_i - v) * min(1, tau / ||x_i - v||)``
  (Karimireddy et al. 2021); ``tau = 0`` takes the median of the distances ``||x_i - v||``
  in each iteration, so the radius follows the updates' scale;
- ``off``: the inner strategy's own aggregate.

The median and the trimmed mean are unweighted, as Flower's are; MultiKrum's mean uses the
inner strategy's weights (``num-examples``, or equal weights under ``EqualWeightFedAvg``).

**Masks** (CA-HFP's pruned submodels): every rule takes an optional ``(n, d)`` boolean
``mask``, True where reply i kept coordinate j. The coordinate-wise rules then work, per
coordinate, over the replies that kept it; centered clipping clips each reply's distance
over its own coordinates; MultiKrum scores the replies on their reconstructed full vectors
and averages the chosen ones per coordinate over those that kept it. A coordinate kept by
fewer replies than the rule needs (:func:`min_keepers`: 3 for the median, the smallest n with
``int(beta * n) >= 1`` and at least 3 for the trimmed mean) falls back to the weighted mean
of those that kept it, and the count of such coordinates is reported (``robust_fallback``
in the round's row). A coordinate nobody kept keeps ``base`` (the model the server sent).
Without masks the same rule holds for the whole round: with fewer replies than the rule
needs every coordinate is the weighted mean, and all of them count as fallbacks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from edgefleet.algorithms.saga import flatten, unflatten
from edgefleet.arrays import to_numpy, to_record
from edgefleet.loop.base import LoopStrategy
from edgefleet.loop.context import RobustRow, current_round, round_or_none
from edgefleet.loop.screening import RecordKeys, reply_arrays, reply_device, reply_metrics
from edgefleet.settings import at_least, checked, choice, setting
from edgefleet.strategies.equalweight import EqualWeightFedAvg


class RobustRule(StrEnum):
    """The robust aggregation rules (run config ``robust.rule``)."""

    OFF = "off"
    MEDIAN = "median"
    TRIMMED_MEAN = "trimmed-mean"
    MULTIKRUM = "multikrum"
    CENTERED_CLIP = "centered-clip"


ROBUST_RULES: tuple[str, ...] = tuple(r.value for r in RobustRule)
# The parameters each rule takes (keyword arguments of RobustAggregation and FedSAG).
RULE_PARAMS: dict[RobustRule, tuple[str, ...]] = {
    RobustRule.OFF: (),
    RobustRule.MEDIAN: (),
    RobustRule.TRIMMED_MEAN: ("beta",),
    RobustRule.MULTIKRUM: ("f", "m"),
    RobustRule.CENTERED_CLIP: ("tau", "iterations"),
}


def _trim(v: float) -> str | None:
    return None if 0.0 <= v < 0.5 else "must be in [0, 0.5)"


@dataclass(frozen=True)
class RobustConfig:
    """``robust.*``: a robust rule instead of the weighted mean (README "Attackers and
    defences"; :mod:`edgefleet.strategies.robust`)."""

    rule: str = setting(
        "robust.rule",
        "off",
        choice(ROBUST_RULES),
        "`off`, `median`, `trimmed-mean`, `multikrum`, `centered-clip`: in place of the "
        "weighted mean (fedavg, fedprox; under CA-HFP over the devices that kept each "
        "coordinate) or of FedSAG's memory and correction means",
    )
    beta: float = setting(
        "robust.beta", 0.2, _trim, "`trimmed-mean`: share cut from each end per coordinate"
    )
    f: int = setting("robust.f", 1, at_least(0), "`multikrum`: attackers tolerated")
    m: int = setting("robust.m", 0, at_least(0), "`multikrum`: replies averaged (0 = replies - f)")
    tau: float = setting(
        "robust.tau",
        0.0,
        at_least(0.0),
        "`centered-clip`: clipping radius in update norm (0 = the median distance each iteration)",
    )
    iterations: int = setting("robust.iterations", 3, at_least(1), "`centered-clip`: iterations")

    def params(self) -> dict[str, Any]:
        """The parameters of the chosen rule, as RobustAggregation and FedSAG take them."""
        return {p: getattr(self, p) for p in RULE_PARAMS[RobustRule(self.rule)]}


@dataclass(frozen=True)
class RuleSpec:
    """A rule and its parameters, checked (:func:`rule_spec` builds one)."""

    rule: RobustRule = RobustRule.OFF
    beta: float = 0.2
    f: int = 1
    m: int = 0
    tau: float = 0.0
    iterations: int = 3

    @property
    def on(self) -> bool:
        return self.rule != RobustRule.OFF

    def params(self) -> dict[str, Any]:
        """The rule's own parameters and their values."""
        return {p: getattr(self, p) for p in RULE_PARAMS[self.rule]}


def rule_spec(rule: str | RobustRule = "off", **params: Any) -> RuleSpec:
    """``rule`` with ``params``, or a ValueError naming the valid rules or parameters."""
    try:
        r = RobustRule(rule)
    except ValueError:
        raise ValueError(
            f"robust rule {rule!r} is unknown; valid choices: {', '.join(ROBUST_RULES)}"
        ) from None
    unknown = sorted(set(params) - set(RULE_PARAMS[r]))
    if unknown:
        valid = ", ".join(RULE_PARAMS[r]) or "none"
        raise ValueError(f"robust rule {r.value!r}: unknown parameter(s) {unknown}; valid: {valid}")
    spec = RuleSpec(r, **params)
    if not (isinstance(spec.beta, int | float) and 0.0 <= spec.beta < 0.5):
        raise ValueError(f"robust rule 'trimmed-mean': beta={spec.beta!r} must be in [0, 0.5)")
    for name in ("f", "m"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"robust rule 'multikrum': {name}={value!r} must be an integer >= 0")
    if not (isinstance(spec.tau, int | float) and math.isfinite(spec.tau) and spec.tau >= 0):
        raise ValueError(
            f"robust rule 'centered-clip': tau={spec.tau!r} must be finite and >= 0 (0: the "
            "median distance)"
        )
    it = spec.iterations
    if isinstance(it, bool) or not isinstance(it, int) or it < 1:
        raise ValueError(f"robust rule 'centered-clip': iterations={it!r} must be an int >= 1")
    return spec


# -- the rules, pure NumPy ---------------------------------------------------------------------


@dataclass
class RuleResult:
    """What a rule gave: the aggregate, the coordinates that fell back to the mean of their
    keepers (too few for the rule), and per rule what it chose."""

    vector: np.ndarray
    fallback: int = 0
    selected: list[int] | None = None  # multikrum: the rows chosen, best first
    clipped: int | None = None  # centered-clip: rows clipped in the last iteration


def min_keepers(spec: RuleSpec) -> int:
    """How many values a coordinate needs for ``spec``'s rule to mean anything: 3 for the
    median (of 2 it is their mean) and the trimmed mean (at least the smallest n with
    ``int(beta * n) >= 1``: with fewer nothing is trimmed); 1 for the others."""
    if spec.rule == RobustRule.MEDIAN:
        return 3
    if spec.rule == RobustRule.TRIMMED_MEAN:
        if spec.beta == 0:
            return 1  # beta 0 trims nothing by definition: the plain mean
        n = math.ceil(1.0 / spec.beta)
        while int(spec.beta * n) < 1:  # float rounding of 1/beta
            n += 1
        return max(3, n)
    return 1


def masked_mean(x: np.ndarray, weights: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Per coordinate, the ``weights``-weighted mean over the rows that kept it (NaN where
    no row did, or their weights sum to zero)."""
    w = np.broadcast_to(np.asarray(weights, dtype=np.float64)[:, None], x.shape)
    if mask is not None:
        w = np.where(mask, w, 0.0)
    den = w.sum(axis=0)
    num = (np.where(w > 0, x, 0.0) * w).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def coordinate_median(x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Per coordinate, the median over the rows (that kept it; NaN where none did)."""
    if mask is None:
        return np.median(x, axis=0)
    held = np.where(mask, x, np.nan)
    out = np.full(x.shape[1], np.nan)
    some = mask.any(axis=0)
    out[some] = np.nanmedian(held[:, some], axis=0)
    return out


def trimmed_mean(x: np.ndarray, beta: float, mask: np.ndarray | None = None) -> np.ndarray:
    """Per coordinate, over the ``c`` rows that kept it, the mean after dropping the
    ``int(beta * c)`` lowest and highest values (NaN where none kept it)."""
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean: beta={beta!r} must be in [0, 0.5)")
    if mask is None:
        mask = np.ones(x.shape, dtype=bool)
    count = mask.sum(axis=0)
    cut = (beta * count).astype(np.int64)
    ranked = np.sort(np.where(mask, x, np.inf), axis=0)  # kept values first, in order
    rank = np.arange(x.shape[0])[:, None]
    keep = (rank >= cut) & (rank < count - cut)
    n_kept = keep.sum(axis=0)
    total = np.where(keep, ranked, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_kept > 0, total / np.maximum(n_kept, 1), np.nan)


def multikrum_select(x: np.ndarray, f: int, m: int = 0) -> list[int]:
    """The rows MultiKrum chooses, best first: each row's score is the sum of its squared
    L2 distances to its ``max(1, n - f - 2)`` nearest other rows; the ``m`` lowest scores win
    (``m = 0``: ``n - f``, at least 1). Ties go to the lower row index."""
    n = x.shape[0]
    sq = np.square(x).sum(axis=1)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * x @ x.T, 0.0)
    closest = max(1, n - f - 2)
    scores = []
    for i in range(n):
        others = np.delete(dist[i], i)
        scores.append(float(np.sort(others)[:closest].sum()) if others.size else 0.0)
    take = m if m > 0 else max(1, n - f)
    return [int(i) for i in np.argsort(np.asarray(scores), kind="stable")[: min(take, n)]]


def centered_clip(
    x: np.ndarray,
    center: np.ndarray,
    tau: float = 0.0,
    iterations: int = 3,
    mask: np.ndarray | None = None,
) -> tuple[np.ndarray, int]:
    """Centered clipping from ``center``: ``iterations`` times, ``v += (per coordinate, over
    the rows that kept it) mean of (x_i - v) * min(1, tau / ||x_i - v||)``, the distance
    taken over row i's own coordinates; ``tau = 0``: the median distance of that iteration.
    Returns v and how many rows the last iteration clipped. Coordinates nobody kept stay at
    ``center``."""
    v = np.array(center, dtype=np.float64)
    count = x.shape[0] * np.ones(x.shape[1]) if mask is None else mask.sum(axis=0)
    clipped = 0
    for _ in range(iterations):
        diff = x - v
        if mask is not None:
            diff = np.where(mask, diff, 0.0)
        norms = np.linalg.norm(diff, axis=1)
        radius = float(np.median(norms)) if tau == 0 else float(tau)
        with np.errstate(invalid="ignore", divide="ignore"):
            scale = np.where(norms > radius, radius / np.where(norms > 0, norms, 1.0), 1.0)
        clipped = int((norms > radius).sum())
        step = (diff * scale[:, None]).sum(axis=0)
        v = v + np.where(count > 0, step / np.maximum(count, 1), 0.0)
    return v, clipped


def robust_aggregate(
    spec: RuleSpec,
    x: np.ndarray,
    weights: Sequence[float] | np.ndarray | None = None,
    mask: np.ndarray | None = None,
    base: np.ndarray | None = None,
) -> RuleResult:
    """``spec``'s rule over the rows of ``x`` (n replies x d coordinates), with the fallbacks
    of the module docstring. ``weights`` (default equal) weigh the fallback mean and
    MultiKrum's mean; ``base`` (default zeros) is kept where nobody kept a coordinate and is
    where centered clipping starts."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"robust_aggregate: need an (n >= 1, d) array, got shape {x.shape}")
    n, d = x.shape
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"robust_aggregate: weights must be {n} finite numbers >= 0")
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != x.shape:
            raise ValueError(f"robust_aggregate: mask {mask.shape} does not fit {x.shape}")
        if mask.all():
            mask = None
    start = np.zeros(d) if base is None else np.asarray(base, dtype=np.float64)
    count = np.full(d, n) if mask is None else mask.sum(axis=0)
    mean = masked_mean(x, w, mask)
    if np.all(w == 0):  # FedAvg would fail on zero weights too: take them equal
        mean = masked_mean(x, np.ones(n), mask)
    result = RuleResult(mean)
    if spec.rule == RobustRule.MEDIAN:
        result.vector = coordinate_median(x, mask)
    elif spec.rule == RobustRule.TRIMMED_MEAN:
        result.vector = trimmed_mean(x, spec.beta, mask)
    elif spec.rule == RobustRule.MULTIKRUM:
        chosen = multikrum_select(x, spec.f, spec.m)
        sub_mask = None if mask is None else mask[chosen]
        sub_w = w[chosen] if np.any(w[chosen] > 0) else np.ones(len(chosen))
        picked = masked_mean(x[chosen], sub_w, sub_mask)
        # A coordinate none of the chosen kept: the mean of those that did keep it.
        missing = np.isnan(picked) & (count > 0)
        result.fallback += int(missing.sum())
        result.vector = np.where(missing, mean, picked)
        result.selected = chosen
    elif spec.rule == RobustRule.CENTERED_CLIP:
        result.vector, result.clipped = centered_clip(x, start, spec.tau, spec.iterations, mask)
    few = (count > 0) & (count < min_keepers(spec))
    if spec.on and few.any():
        result.vector = np.where(few, mean, result.vector)
        result.fallback += int(few.sum())
    result.vector = np.where(count > 0, result.vector, start)
    return result


# -- masks handed over by the CA-HFP reconstruction ---------------------------------------------


class _Masks:
    """The round's kept-coordinate masks, by the id of the (full-size) reply they belong to."""

    def __init__(self) -> None:
        self.by_reply: dict[int, dict[str, np.ndarray]] = {}


_MASKS_OWNER = _Masks  # the round context's private slot for them


def offer_masks(masks: Mapping[int, Mapping[str, np.ndarray]]) -> None:
    """Hand this round's masks (``id(reply)`` -> array name -> boolean array of the array's
    full shape, True where the device kept the entry) to a :class:`RobustAggregation` below:
    :class:`~edgefleet.strategies.reconstruction.SubmodelReconstruction` calls it for the replies
    it rebuilt from submodels. A reply without a mask kept everything."""
    current_round().own(_MASKS_OWNER, _Masks).by_reply.update(
        {k: dict(v) for k, v in masks.items()}
    )


def _offered(reply: Message) -> dict[str, np.ndarray] | None:
    ctx = round_or_none()
    return None if ctx is None else ctx.own(_MASKS_OWNER, _Masks).by_reply.get(id(reply))


# -- the wrapper ---------------------------------------------------------------------------------


def plain_mean_inner(inner: Strategy) -> bool:
    """Whether ``inner`` aggregates with FedAvg's weighted mean (FedAvg, FedProx,
    EqualWeightFedAvg, or a subclass that keeps their ``aggregate_train``)."""
    agg = getattr(type(inner), "aggregate_train", None)
    return isinstance(inner, FedAvg) and agg in (
        FedAvg.aggregate_train,
        EqualWeightFedAvg.aggregate_train,
    )


class RobustAggregation(LoopStrategy):
    """``inner``'s messages and metrics; a robust rule instead of its weighted mean.

    ``inner`` must be a FedAvg-family strategy that aggregates with FedAvg's weighted mean
    (``FedAvg``, ``FedProx``, EdgeFleet's ``EqualWeightFedAvg``). Other EdgeFleet wrappers go
    around it; CA-HFP's :class:`~edgefleet.strategies.reconstruction.SubmodelReconstruction` goes
    directly around it and hands it the masks of the submodels (module docstring). For
    FedSAG, give the rule to ``FedSAG(robust=...)``. ``params`` are the rule's
    (:data:`RULE_PARAMS`): ``beta``; ``f``, ``m``; ``tau``, ``iterations``.
    """

    @classmethod
    def from_config(cls, inner: Strategy, cfg: RobustConfig) -> RobustAggregation:
        """The rule ``robust.*`` names, with its parameters."""
        checked(
            cfg,
            "robust.rule",
            cfg.rule,
            tuple(r for r in RobustRule if r != RobustRule.OFF),
            cls.__name__,
        )
        return cls(inner, cfg.rule, **cfg.params())

    def __init__(self, inner: Strategy, rule: str | RobustRule = "median", **params: Any) -> None:
        self.spec = rule_spec(rule, **params)
        if not plain_mean_inner(inner):
            raise ValueError(_inner_error(inner))
        super().__init__(inner)

    @property
    def rule(self) -> RobustRule:
        return self.spec.rule

    def settings(self) -> dict[str, object]:
        return {"Rule": self.spec.rule.value, **self.spec.params()}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        current_round().own(self, _Sent).arrays = arrays  # where centered clipping starts
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        ctx = current_round()
        row = ctx.section(RobustRow)
        row.robust_rule = self.spec.rule.value
        if not self.spec.on or arrays is None:
            return arrays, metrics
        valid = [m for m in replies if not m.has_error() and m.has_content()]
        models = [to_numpy(reply_arrays(m.content)) for m in valid]
        like = models[0]
        x = np.stack([flatten(m) for m in models])
        masks = [_offered(m) for m in valid]
        mask = None
        if any(mk is not None for mk in masks):
            mask = np.stack(
                [
                    np.ones(x.shape[1], dtype=bool) if mk is None else flatten(mk).astype(bool)
                    for mk in masks
                ]
            )
        sent = ctx.own(self, _Sent).arrays
        base = flatten(to_numpy(sent)) if sent is not None else None
        if base is None and (mask is not None or self.spec.rule == RobustRule.CENTERED_CLIP):
            base = coordinate_median(x)  # called by hand without configure_train
        result = robust_aggregate(self.spec, x, self._weights(valid), mask, base)
        row.robust_fallback = result.fallback
        if result.fallback:
            log(WARNING, "Round %d: %s fell back to the mean on %d coordinate(s) kept by "
                "fewer than %d replies", server_round, self.spec.rule.value, result.fallback,
                min_keepers(self.spec))  # fmt: skip
        if result.selected is not None:
            row.robust_selected = [reply_device(valid[i]) for i in result.selected]
        if result.clipped is not None:
            row.robust_clipped = result.clipped
        return to_record(unflatten(result.vector, like)), metrics

    def _weights(self, replies: Sequence[Message]) -> list[float]:
        if isinstance(self.inner, EqualWeightFedAvg):
            return [1.0] * len(replies)
        key = RecordKeys.of(self).weight
        out = []
        for m in replies:
            value = reply_metrics(m.content).get(key, 0.0)
            out.append(float(value) if isinstance(value, int | float) else 0.0)
        return out


@dataclass
class _Sent:
    arrays: ArrayRecord | None = field(default=None)


def _inner_error(inner: Strategy) -> str:
    name = type(inner).__name__
    if isinstance(inner, LoopStrategy):
        return (
            f"RobustAggregation wraps the aggregating strategy itself, not the wrapper {name}: "
            f"write {name}(..., RobustAggregation(FedAvg(), rule=...)) (under CA-HFP: "
            "SubmodelReconstruction(RobustAggregation(FedAvg(), ...), ...))"
        )
    if name == "FedSAG":
        return (
            "RobustAggregation does not wrap FedSAG: give the rule to FedSAG(robust=..., "
            "robust_params=...), which applies it to the round's corrections and the memory "
            "mean (run config: strategy = 'fedsag' with robust.rule)"
        )
    return (
        f"RobustAggregation replaces a FedAvg-family weighted mean; {name} aggregates "
        f"otherwise. Use RobustAggregation(FedAvg(...), rule=...) (or FedProx), or {name} "
        "on its own"
    )


FLOWER_ROBUST = ("FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "Bulyan")


def flower_robust_inner(strategy: object) -> str | None:
    """The name of the first of Flower's robust strategies (``FedMedian``, ``FedTrimmedAvg``,
    ``Krum``, ``MultiKrum``, ``Bulyan``) in ``strategy``'s chain (``.inner`` links), or None."""
    from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, MultiKrum

    while strategy is not None:
        if isinstance(strategy, FedMedian | FedTrimmedAvg | MultiKrum | Bulyan):
            return type(strategy).__name__
        strategy = getattr(strategy, "inner", None)
    return None


def alternative_rule(flower_name: str) -> str:
    """The ``robust.rule`` that does what Flower's ``flower_name`` does, mask-aware."""
    return {
        "FedMedian": "median",
        "FedTrimmedAvg": "trimmed-mean",
        "Krum": "multikrum",
        "MultiKrum": "multikrum",
        "Bulyan": "multikrum",
    }.get(flower_name, "median")
