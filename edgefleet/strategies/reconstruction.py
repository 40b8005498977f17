"""CA-HFP on the server (arXiv 2603.12591): accept submodel replies, rebuild them full size.

A client whose resources allow only part of the model (keep ratio < 1) trains a physically
smaller submodel and replies with its compact tensors (``arrays``) plus the channels it kept
(an ArrayRecord ``kept``: group name -> sorted int64 channel indices, see
:class:`~edgefleet.pruning.submodel.PruningPlan`). :class:`SubmodelReconstruction` wraps the
aggregating strategy (FedAvg, FedProx, FedSAG) and, before it aggregates:

- checks every compact reply on its own (:meth:`check_reply`: known groups, indices in
  bounds, sorted and unique, every tensor of the shape those channels give, finite values);
  the round loop drops a bad one with its reason;
- scatters each compact reply into the full parameter space (``reconstruction``):
  ``global`` fills the pruned entries with the global model the client was sent (CA-HFP),
  ``zeros`` with zeros (the paper's no-reconstruction ablation); ``elementwise`` averages each
  entry over the clients that kept it (HeteroFL style, only for plain weighted means).

With a :class:`~edgefleet.strategies.robust.RobustAggregation` as the aggregating strategy
(``robust.rule``) the rule works coordinate-wise over the devices that kept each
coordinate: this wrapper hands it each rebuilt reply's mask (True where the device kept the
entry), so the fill never votes. A coordinate kept by fewer devices than the rule needs
falls back to the weighted mean of those that kept it (counted in the row's
``robust_fallback``), one nobody kept keeps the global value. Flower's own robust
strategies (``FedMedian``, ``FedTrimmedAvg``, ``Krum``, ``MultiKrum``, ``Bulyan``) see one
ArrayRecord per reply and no masks, so a rebuilt pruned entry would vote with the global
model's value: this wrapper refuses them when it is built, naming the ``robust.rule`` to use.

Full-size replies (keep ratio 1, or a client without pruning) pass through unchanged, so the
wrapper costs nothing until the first compact reply, and deployments may set keep ratios per
SuperNode (``--node-config keep-ratio=0.5``) without the server being told.

Download (``compact_download``, beyond the paper): a node whose last reply was compact is
sent only the slice of the global model its submodel holds, plus its ``kept``; it trains
that submodel without scoring again. Every ``refresh_rounds`` rounds it gets the full model
and scores afresh, so its channel choice follows the model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import WARNING
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefleet.arrays import State, to_numpy, to_record
from edgefleet.bounds import describe
from edgefleet.loop.base import LoopStrategy, find_wrapper
from edgefleet.loop.context import PruningRow, current_round
from edgefleet.loop.hooks import hooks_of
from edgefleet.loop.roundloop import RoundCallback, RoundResult
from edgefleet.loop.screening import (
    RecordKeys,
    check_arrays,
    check_metrics,
    check_records,
    reply_arrays,
    reply_metrics,
    update_norm,
)
from edgefleet.pruning.names import (
    BUDGETS,
    CRITERIA,
    CURVATURE_SCORES,
    HESSIAN_ESTIMATORS,
    RECONSTRUCTIONS,
)
from edgefleet.pruning.reconstruct import compact_slice, elementwise_average, scatter
from edgefleet.pruning.wire import KEPT, kept_from_record, kept_record
from edgefleet.settings import (
    anything,
    at_least,
    checked,
    choice,
    float_list,
    floats,
    fraction,
    setting,
)
from edgefleet.strategies.robust import (
    RobustAggregation,
    alternative_rule,
    flower_robust_inner,
    offer_masks,
)
from edgefleet.wire import KEPT_FRACTION

if TYPE_CHECKING:  # importing the plan imports torch and Torch-Pruning
    from edgefleet.pruning.submodel import PruningPlan


@dataclass(frozen=True)
class PruningConfig:
    """``pruning.*``: CA-HFP's resource classes and curvature-aware structured pruning.

    ``keep_ratios`` (simulation) gives partition i the keep ratio ``keep_ratios[i % len]``;
    a SuperNode's ``--node-config keep-ratio=...`` overrides both. ``budget`` says what a keep
    ratio is a share of (``edgefleet.pruning.submodel`` explains the choices).
    """

    keep_ratio: float = setting(
        "pruning.keep-ratio",
        1.0,
        fraction,
        "share of the model every device keeps (of what: `pruning.budget`)",
    )
    keep_ratios: tuple[float, ...] = setting(
        "pruning.keep-ratios",
        "",
        float_list(0.0, 1.0, True, "1.0,0.75,0.5,0.25"),
        'a list cycled over partitions (`"1.0,0.5"`); a SuperNode\'s `keep-ratio` wins',
        floats,
    )
    criterion: str = setting(
        "pruning.criterion",
        "curvature",
        choice(CRITERIA),
        "channel importance: `curvature` (see `pruning.score`), `magnitude`, `random`; or by "
        "position: `prefix` (HeteroFL's static slice), `rolling` (FedRolex's window), "
        "`ordered-dropout` (FjORD: a width of `pruning.keep-ratios` drawn every local step)",
    )
    score: str = setting(
        "pruning.score",
        "taylor",
        choice(CURVATURE_SCORES),
        "curvature score per weight: `taylor` (\\|g w - h w^2 / 2\\|) or `signed` "
        "(g w + h w^2, lowest channels pruned first, as CA-HFP's seed writes it)",
    )
    budget: str = setting(
        "pruning.budget",
        "parameters",
        choice(BUDGETS),
        "a keep ratio is a share of the model's `parameters`, of its `compute` (forward "
        "multiply-accumulates), or of every group's `channels` (parameters then ~ ratio^2)",
    )
    hessian: str = setting(
        "pruning.hessian",
        "fisher",
        choice(HESSIAN_ESTIMATORS),
        "Hessian diagonal: empirical `fisher` or `hutchinson`",
    )
    score_batches: int = setting(
        "pruning.score-batches", 2, at_least(1), "local mini-batches the score is measured on"
    )
    reconstruction: str = setting(
        "pruning.reconstruction",
        "global",
        choice(RECONSTRUCTIONS),
        "`global` (pruned entries from the global model), `elementwise` (each entry averaged "
        "over the devices that kept it; FedAvg/FedProx only), `zeros` (the paper's ablation)",
    )
    compact_download: bool = setting(
        "pruning.compact-download",
        False,
        anything,
        "send a pruned device only its slice of the model once its channels are known",
    )
    refresh_rounds: int = setting(
        "pruning.refresh-rounds",
        5,
        at_least(1),
        "with compact download: the full model (and a fresh score) every N rounds",
    )

    def ratio_for(self, partition_id: int) -> float:
        if self.keep_ratios:
            return self.keep_ratios[partition_id % len(self.keep_ratios)]
        return self.keep_ratio


class SubmodelReconstruction(LoopStrategy, RoundCallback):
    """Reconstruct CA-HFP submodel replies into the full parameter space for ``inner``.

    ``plan_factory`` builds the :class:`~edgefleet.pruning.submodel.PruningPlan` of the
    global model's architecture; it is called on first need only.
    """

    @classmethod
    def from_config(
        cls, inner: Strategy, cfg: PruningConfig, plan_factory: Callable[[], PruningPlan]
    ) -> SubmodelReconstruction:
        """Reconstruction as ``pruning.*`` sets it (the keep ratios are the devices')."""
        checked(cfg)
        return cls(
            inner, plan_factory, cfg.reconstruction, cfg.compact_download, cfg.refresh_rounds
        )

    def __init__(
        self,
        inner: Strategy,
        plan_factory: Callable[[], PruningPlan],
        reconstruction: str = "global",
        compact_download: bool = False,
        refresh_rounds: int = 5,
    ) -> None:
        if reconstruction not in RECONSTRUCTIONS:
            raise ValueError(
                f"unknown reconstruction {reconstruction!r}; valid choices: "
                f"{', '.join(RECONSTRUCTIONS)}"
            )
        if refresh_rounds < 1:
            raise ValueError(f"refresh_rounds must be >= 1, got {refresh_rounds}")
        flower = flower_robust_inner(inner)
        if flower is not None:
            raise ValueError(
                f"SubmodelReconstruction cannot feed Flower's {flower}: it aggregates one "
                "ArrayRecord per reply and cannot see which device kept which coordinate of "
                "a pruned submodel, so every rebuilt entry would vote with the global model. "
                f"Use RobustAggregation(FedAvg(), rule={alternative_rule(flower)!r}) inside "
                f"SubmodelReconstruction (run config robust.rule = "
                f"{alternative_rule(flower)!r}), which works over the devices that kept each "
                f"coordinate, or {flower} without pruning"
            )
        robust = find_wrapper(inner, RobustAggregation)
        if robust is not None and robust.spec.on and reconstruction == "elementwise":
            raise ValueError(
                f"reconstruction='elementwise' with RobustAggregation(rule="
                f"{robust.spec.rule.value!r}): the per-entry mean would replace the robust "
                "rule's aggregate; use reconstruction 'global' (the rule then works over the "
                "devices that kept each entry)"
            )
        super().__init__(inner)
        self._plan_factory = plan_factory
        self._plan: PruningPlan | None = None
        self.reconstruction = reconstruction
        self.compact_download = compact_download
        self.refresh_rounds = refresh_rounds
        # Compact download's per-device state (the channels of a device's last compact
        # reply, the last round it was sent the full model) lives in the device registry:
        # checkpointed with it, and kept when a device comes back on another node.
        self._full_entries: int | None = None  # entries of the full model (kept_fraction)
        # The last reference model as NumPy: a round's (or a version's) replies share one, so
        # it is converted once, not once per reply.
        self._reference: tuple[ArrayRecord, State] | None = None

    @property
    def plan(self) -> PruningPlan:
        if self._plan is None:
            self._plan = self._plan_factory()
        return self._plan

    def _kept_share(self, kept: dict[str, np.ndarray]) -> float:
        """The share of the model's entries a submodel keeping ``kept`` holds, from the plan's
        index maps alone (the interface every plan has, a user's own included)."""
        if self._full_entries is None:
            full = self.plan.index_maps(self.plan.full_kept())
            self._full_entries = max(1, sum(int(m.size) for m in full.values()))
        kept_entries = sum(int(m.size) for m in self.plan.index_maps(kept).values())
        return kept_entries / self._full_entries

    def settings(self) -> dict[str, object]:
        s: dict[str, object] = {"Reconstruction": self.reconstruction}
        if self.compact_download:
            s["Compact download, full model every N rounds"] = self.refresh_rounds
        return s

    # ------------------------------------------------------------------------ download

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        ctx = current_round()
        sent = ctx.own(self, _Sent)
        sent.model = to_numpy(arrays)
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        compact = 0
        if self.compact_download:
            out = []
            for msg in messages:
                # A node bound to no device (its replies claim no device id) gets the full
                # model: compact state is a device's.
                device = ctx.registry.device_of(msg.metadata.dst_node_id)
                kept, last = (None, None) if device is None else ctx.registry.compact_state(device)
                due = server_round - (-self.refresh_rounds if last is None else last)
                if kept is None or due >= self.refresh_rounds:
                    if device is not None:
                        ctx.registry.note_full_sent(device, server_round)
                    sent.full.add(msg.metadata.dst_node_id)
                    out.append(msg)
                    continue
                out.append(self._compact_message(msg, kept, sent.model))
                compact += 1
            messages = out
        ctx.section(PruningRow).compact_downloads = compact
        return messages

    def _compact_message(self, msg: Message, kept: dict[str, np.ndarray], full: State) -> Message:
        part = compact_slice(full, self.plan.index_maps(kept), self.plan.compact_shapes(kept))
        content = RecordDict(
            {
                RecordKeys.of(self).arrays: to_record(part),
                KEPT: kept_record(kept),
                **{name: rec for name, rec in msg.content.config_records.items()},
            }
        )
        return Message(
            content, dst_node_id=msg.metadata.dst_node_id, message_type=MessageType.TRAIN
        )

    # ------------------------------------------------------------------------ replies

    def check_reply(self, msg: Message, reference: ArrayRecord, keys: RecordKeys) -> str | None:
        content = msg.content
        if KEPT not in content.array_records:
            return super().check_reply(msg, reference, keys)
        reason = check_records(content) or check_metrics(reply_metrics(content), keys)
        if reason:
            return f"a submodel reply: {reason}"
        kept = kept_from_record(content.array_records[KEPT])
        reason = self.plan.validate_kept(kept)
        if reason:
            return f"kept channels: {reason}"
        shapes = self.plan.compact_shapes(kept)
        if set(shapes) != set(reference):
            return "the pruning plan does not match the global model's keys"
        expected = {k: (shapes[k], ref.dtype) for k, ref in reference.items()}
        return check_arrays(reply_arrays(content), expected)

    def update_norm(self, msg: Message, sent: RecordDict | None, reference: ArrayRecord) -> float:
        """A compact reply's update is taken on its own channels: its tensors minus the same
        slice of the full model this wrapper sent (pruned entries carry no update)."""
        if KEPT not in msg.content.array_records:
            return super().update_norm(msg, sent, reference)
        kept = kept_from_record(msg.content.array_records[KEPT])
        # ``reference`` is the model this device was sent: the round's global model, or in
        # the asynchronous loop the version its submodel was cut from.
        if self._reference is None or self._reference[0] is not reference:
            self._reference = (reference, to_numpy(reference))
        full = self._reference[1]
        base = compact_slice(full, self.plan.index_maps(kept), self.plan.compact_shapes(kept))
        return update_norm(reply_arrays(msg.content), base)

    def full_size_reply(self, msg: Message, base: ArrayRecord) -> Message:
        """Asynchronous aggregation: a compact reply scattered to full size against
        ``base``, the version it was cut from (pruned entries keep that version's values,
        so they carry no update). It keeps its ``kept`` record, so :meth:`aggregate_train`
        still counts it as the submodel it was (and takes its full-size arrays as they are)."""
        if KEPT not in msg.content.array_records:
            return hooks_of(self.inner).full_size_reply(msg, base)
        kept = kept_from_record(msg.content.array_records[KEPT])
        return self._full_size(msg, kept, "global", to_numpy(base), keep_kept=True)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        # Each reply's kept channels (None: a full-size reply), decoded once.
        parts = [
            (
                m,
                kept_from_record(m.content.array_records[KEPT])
                if KEPT in m.content.array_records
                else None,
            )
            for m in replies
        ]
        fractions = [_metric(m, KEPT_FRACTION, 1.0) for m, _ in parts]
        # The fleet view's resource class is measured from the reply's kept channels (they
        # passed screening), not the `kept-fraction` the device claims: a device can lie.
        registry = current_round().registry
        for msg, kept in parts:
            device = registry.device_of(msg.metadata.src_node_id)
            if device is not None:
                share = 1.0 if kept is None else self._kept_share(kept)
                registry.note_kept_fraction(device, share)
                registry.note_kept_channels(device, kept)
                # a node first bound to its device by this reply: its full model counts
                if msg.metadata.src_node_id in current_round().own(self, _Sent).full:
                    registry.note_full_sent(device, server_round)
        row = current_round().section(PruningRow)
        row.compact_replies = sum(kept is not None for _, kept in parts)
        row.mean_kept_fraction = float(np.mean(fractions)) if fractions else 1.0
        if all(kept is None for _, kept in parts):
            return self.inner.aggregate_train(server_round, [m for m, _ in parts])
        fill = "zeros" if self.reconstruction == "zeros" else "global"
        sent = self._sent_model()
        full = [m if kept is None else self._full_size(m, kept, fill, sent) for m, kept in parts]
        robust = find_wrapper(self.inner, RobustAggregation)
        if robust is not None and robust.spec.on:
            offer_masks(
                {
                    id(msg): self._mask(kept, sent)
                    for msg, (_, kept) in zip(full, parts, strict=True)
                    if kept is not None
                }
            )
        arrays, metrics = self.inner.aggregate_train(server_round, full)
        if self.reconstruction != "elementwise" or arrays is None:
            return arrays, metrics
        # The inner strategy is a plain weighted mean (the config allows elementwise only
        # then): its metrics stand, its arrays are replaced by the per-entry average.
        updates = [
            (
                to_numpy(reply_arrays(msg.content)),
                self.plan.index_maps(self.plan.full_kept() if kept is None else kept),
                _metric(msg, RecordKeys.of(self).weight, 0.0),
            )
            for msg, kept in parts
        ]
        return to_record(elementwise_average(sent, updates)), metrics

    def _sent_model(self) -> State:
        """The global model this round's train messages carried ({} before any)."""
        return current_round().own(self, _Sent).model

    def _mask(self, kept: dict[str, np.ndarray], like: State) -> dict[str, np.ndarray]:
        """Per array, True at the entries of the full model the submodel ``kept`` holds."""
        out = {}
        for key, index in self.plan.index_maps(kept).items():
            mask = np.zeros(np.asarray(like[key]).size, dtype=bool)
            mask[index] = True
            out[key] = mask.reshape(np.shape(like[key]))
        return out

    def _full_size(
        self,
        msg: Message,
        kept: dict[str, np.ndarray],
        fill: str,
        sent: State,
        keep_kept: bool = False,
    ) -> Message:
        """A copy of the compact reply ``msg`` with its arrays scattered to full size (with
        its ``kept`` record if ``keep_kept``). Arrays that are full size already were
        rebuilt by :meth:`full_size_reply` against their own version and stay as they are."""
        values = to_numpy(reply_arrays(msg.content))
        if all(np.shape(v) == np.shape(sent[k]) for k, v in values.items()):
            full = values
        else:
            full = scatter(sent, values, self.plan.index_maps(kept), fill)
        out = copy.copy(msg)  # the loop still counts the compact reply's bytes
        name = next(n for n in msg.content.array_records if n != KEPT)
        records: dict[str, ArrayRecord | MetricRecord] = dict(msg.content.metric_records)
        if keep_kept:
            records[KEPT] = msg.content.array_records[KEPT]
        out.content = RecordDict({name: to_record(full), **records})
        return out

    def after_round(self, result: RoundResult) -> str | None:
        result.context.section(PruningRow)  # no train message sent: still a row
        return None


@dataclass
class _Sent:
    model: State = field(default_factory=dict)
    full: set[int] = field(default_factory=set)  # nodes sent the full model (compact download)


def _metric(msg: Message, key: str, default: float) -> float:
    value = reply_metrics(msg.content).get(key, default)
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # a list; an int too large for a float
        log(WARNING, "metric %r is not a number: %s", key, describe(value))
        return default
