"""Attacks as Flower ClientApp mods, for evaluating defences in simulation.

``attack_mod(kind, partitions, **params)`` lets every device train honestly and then, on
the partitions listed (``node_config["partition-id"]``, as Flower's Simulation Engine sets
it), rewrites the train reply. Other devices, other message types and Error replies pass
untouched; ``num-examples``, the other metrics and every record's name stay as they were,
and so does a CA-HFP reply's ``kept`` record (except under ``pruned-liar``). Add it to your
own ClientApp, inside any mod that charges for a reply (such as the energy mod)::

    app = ClientApp(mods=[energy_mod(...), attack_mod("alie", [0, 3], n_devices=20)])

Kinds (``PARAMS`` lists each one's parameters):

- ``sign-flip`` (``norm_scale=1.0``): the honest update negated, at ``norm_scale`` x its
  own norm (:func:`~edgefleet.attacks.updates.sign_flip`).
- ``alie`` (``z`` or ``n_devices`` [, ``n_colluders``], ``board``): the colluders' estimate
  of the honest mean shifted by ``z`` standard deviations
  (:func:`~edgefleet.attacks.updates.alie`); ``z`` defaults to ``alie_z(n_devices,
  n_colluders)``, ``n_colluders`` to the number of attacking partitions.
- ``ipm`` (``epsilon=0.1``, ``board``): ``-epsilon`` x the colluders' estimate of the
  honest mean (:func:`~edgefleet.attacks.updates.ipm`).
- ``sybil`` (``ids``): one attacker behind several device ids: the reply's ``device-id``
  metric becomes ``ids[(round - 1 + i) % len(ids)]``, i = the partition's place in
  ``partitions`` (so two sybil partitions claim different ids in a round). Only the id
  changes: stack it with another attack_mod to poison the update too.
- ``stale-poison`` (``norm_scale=1.0``): one sign-flipped update, once; every later train
  message is declined unanswered with an Error (``ERR_ABSENT``), as a device that stays
  away, so a defence that reuses a device's last update (SAGA memory) keeps the poison.
  The upload is remembered in ``Context.state``, which Flower keeps per node for the run.
- ``pruned-liar`` (``lie="resample"``, ``seed=0``): a CA-HFP submodel reply whose ``kept``
  indices lie about the channels its arrays hold. ``resample``: per group, a different
  sorted set of the same count within ``[0, max(kept)]`` (well-formed: only the arrays'
  values can give it away); a group whose kept channels are exactly ``0..k-1`` has no such
  set and stays true. ``shuffle``: the true indices in a shuffled order (malformed: not
  increasing). A reply without ``kept`` (the full model) passes unchanged.
- ``label-flip``, ``backdoor``: data-side. A mod sees messages, never the device's data, so
  ``attack_mod`` refuses them and names the dataset wrappers in
  :mod:`edgefleet.attacks.data` to use in the ClientApp's train function instead.

The update is the reply's floating-point arrays minus those of the model the train message
carried; the mod sends ``sent + poisoned update`` in each array's dtype. A CA-HFP device that
pruned the full model it was sent replies with a smaller submodel and its ``kept`` channels:
given ``plan`` (a callable returning the model's
:class:`~edgefleet.pruning.submodel.PruningPlan`, built once; EdgeFleet's ClientApp passes
its model's), the mod cuts the same channels from the sent model and attacks the update on
them, as the device itself would; without ``plan`` such a round is answered with an Error
(``ERR_BAD_CONFIG``) naming the array. ALIE and IPM colluders estimate from the updates of
the same length, so on a fleet of keep ratios each ratio's attackers collude among
themselves.
How ALIE and IPM colluders estimate the honest updates: :mod:`edgefleet.attacks.collusion`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import MessageType

from edgefleet.arrays import State, to_numpy, to_record
from edgefleet.attacks.collusion import Board, InProcessBoard
from edgefleet.attacks.updates import alie, alie_z, flatten, float_keys, ipm, sign_flip, unflatten
from edgefleet.client.mods import ERR_ABSENT, ERR_BAD_CONFIG
from edgefleet.errors import SettingError
from edgefleet.pruning.reconstruct import compact_slice
from edgefleet.pruning.wire import KEPT, kept_from_record, kept_record
from edgefleet.settings import at_least, choice, finite, int_list, ints, positive, setting
from edgefleet.settings import fraction as in_0_1  # (a field is named fraction)
from edgefleet.wire import DEVICE_ID

if TYPE_CHECKING:  # the plan imports torch and Torch-Pruning
    from edgefleet.pruning.submodel import PruningPlan

MOD_KINDS: tuple[str, ...] = ("sign-flip", "alie", "ipm", "sybil", "stale-poison", "pruned-liar")
DATA_KINDS: tuple[str, ...] = ("label-flip", "backdoor")
KINDS: tuple[str, ...] = (*MOD_KINDS, *DATA_KINDS)
PARAMS: dict[str, tuple[str, ...]] = {
    "sign-flip": ("norm_scale",),
    "alie": ("z", "n_devices", "n_colluders", "board"),
    "ipm": ("epsilon", "board"),
    "sybil": ("ids",),
    "stale-poison": ("norm_scale",),
    "pruned-liar": ("lie", "seed"),
}


class Lie(StrEnum):
    """What a pruned device lies about the channels it kept (``attack.lie``)."""

    RESAMPLE = "resample"
    SHUFFLE = "shuffle"


LIES: tuple[str, ...] = tuple(m.value for m in Lie)


ATTACK_CHOICES: tuple[str, ...] = ("off", *KINDS)


@dataclass(frozen=True)
class AttackConfig:
    """``attack.*``: attackers for evaluating defences, Simulation Engine only (EdgeFleet's
    ClientApp; :mod:`edgefleet.attacks`). A deployment run that sets any of them is refused
    before its first round."""

    kind: str = setting(
        "attack.kind",
        "off",
        choice(ATTACK_CHOICES),
        "simulation only: `off`, " + ", ".join(f"`{k}`" for k in KINDS),
    )
    fraction: float = setting(
        "attack.fraction",
        0.2,
        in_0_1,
        "share of the partitions that attack (at least one; drawn with `seed`)",
    )
    norm_scale: float = setting(
        "attack.norm-scale", 1.0, positive, "`sign-flip`, `stale-poison`: x the honest norm"
    )
    z: float = setting(
        "attack.z",
        0.0,
        finite,
        "`alie`: the shift in standard deviations (0 = Baruch et al.'s z from the fleet size "
        "and the attackers)",
    )
    epsilon: float = setting("attack.epsilon", 0.1, positive, "`ipm`: -epsilon x the honest mean")
    lie: str = setting(
        "attack.lie", "resample", choice(LIES), "`pruned-liar`: `resample`, `shuffle`"
    )
    sybil_ids: tuple[int, ...] = setting(
        "attack.sybil-ids",
        "",
        int_list,
        "`sybil`: the device ids claimed (comma-separated)",
        ints,
    )
    target: int = setting("attack.target", 0, at_least(0), "`backdoor`: the target class")
    poison_fraction: float = setting(
        "attack.poison-fraction",
        0.5,
        in_0_1,
        "`backdoor`: share of an attacker's training samples triggered and relabelled "
        "(`label-flip` flips every label)",
    )


DATA_WRAPPERS = {
    "label-flip": "edgefleet.attacks.label_flipped(data, num_classes)",
    "backdoor": "edgefleet.attacks.backdoored(data, target, fraction, rng)",
}
STATE_KEY = "edgefleet.attack"  # Context.state record: stale-poison's upload


class AttackError(SettingError):
    """The reply cannot be attacked as asked; the device answers with an Error naming it."""


def attack_mod(
    kind: str,
    partitions: Iterable[int],
    *,
    plan: Callable[[], PruningPlan] | None = None,
    **params: Any,
) -> Mod:
    """A mod that makes the devices of ``partitions`` attack as ``kind`` (see the module
    docstring; ``plan``: the CA-HFP plan of the model, for devices that prune it themselves).
    A bad kind, partition list or parameter raises here, naming the choices."""
    if kind not in KINDS:
        raise ValueError(f"attack_mod kind={kind!r}; valid choices: {', '.join(KINDS)}")
    if kind in DATA_KINDS:
        raise ValueError(
            f"attack_mod kind={kind!r} is a data-side attack: a mod sees messages, not the "
            f"device's data. Poison the attacking partitions' training set in your "
            f"ClientApp with {DATA_WRAPPERS[kind]}; kinds a mod can do: {', '.join(MOD_KINDS)}"
        )
    try:
        attackers = tuple(int(p) for p in partitions)
    except (TypeError, ValueError):
        raise ValueError(
            f"attack_mod({kind!r}): partitions={partitions!r} must be partition ids (ints)"
        ) from None
    if not attackers or min(attackers) < 0:
        raise ValueError(
            f"attack_mod({kind!r}): partitions={attackers}: give the non-negative partition "
            "ids that attack (at least one)"
        )
    unknown = sorted(set(params) - set(PARAMS[kind]))
    if unknown:
        raise ValueError(
            f"attack_mod({kind!r}): unknown parameter(s) {unknown}; valid for {kind}: "
            f"{', '.join(PARAMS[kind])}"
        )
    if plan is not None and not callable(plan):
        raise ValueError(f"attack_mod({kind!r}): plan={plan!r} must be a callable returning "
                         "the model's PruningPlan")  # fmt: skip
    return _AttackMod(kind, attackers, _checked(kind, attackers, params), plan)


def _checked(kind: str, attackers: tuple[int, ...], params: Mapping[str, Any]) -> dict[str, Any]:
    where = f"attack_mod({kind!r})"
    out: dict[str, Any] = {}
    if kind in ("sign-flip", "stale-poison"):
        out["norm_scale"] = _positive(where, "norm_scale", params.get("norm_scale", 1.0))
    elif kind == "alie":
        if "z" in params and ("n_devices" in params or "n_colluders" in params):
            raise ValueError(f"{where}: give z or n_devices [and n_colluders], not both")
        if "z" in params:
            z = params["z"]
            if isinstance(z, bool) or not isinstance(z, int | float) or not math.isfinite(z):
                raise ValueError(f"{where}: z={z!r} must be a finite number")
            out["z"] = float(z)
        elif "n_devices" in params:
            colluders = params.get("n_colluders", len(attackers))
            out["z"] = alie_z(params["n_devices"], colluders)
        else:
            raise ValueError(
                f"{where}: needs z, or n_devices (then z = alie_z(n_devices, n_colluders), "
                "n_colluders defaulting to the number of attacking partitions)"
            )
        out["board"] = _board(where, params)
    elif kind == "ipm":
        out["epsilon"] = _positive(where, "epsilon", params.get("epsilon", 0.1))
        out["board"] = _board(where, params)
    elif kind == "sybil":
        ids = params.get("ids")
        if (
            not isinstance(ids, Sequence)
            or isinstance(ids, str)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            raise ValueError(
                f"{where}: ids={ids!r} must be a non-empty list of device ids (ints >= 0)"
            )
        out["ids"] = tuple(ids)
    elif kind == "pruned-liar":
        lie = params.get("lie", "resample")
        if lie not in LIES:
            raise ValueError(f"{where}: lie={lie!r}; valid choices: {', '.join(LIES)}")
        seed = params.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{where}: seed={seed!r} must be an int")
        out.update(lie=lie, seed=seed)
    return out


def _positive(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {name}={value!r} must be a finite number > 0")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: {name}={value!r} must be a finite number > 0")
    return float(value)


def _board(where: str, params: Mapping[str, Any]) -> Board:
    board = params.get("board")
    if board is None:
        return InProcessBoard()
    if not callable(getattr(board, "share", None)):
        raise ValueError(
            f"{where}: board={board!r} must be an InProcessBoard, a FolderBoard or another "
            "object with share(run_id, server_round, who, update)"
        )
    return board


class _AttackMod:
    def __init__(
        self,
        kind: str,
        attackers: tuple[int, ...],
        params: dict[str, Any],
        plan: Callable[[], PruningPlan] | None = None,
    ) -> None:
        self.kind, self.attackers, self.params = kind, attackers, params
        self._plan_factory = plan
        self._plan: PruningPlan | None = None

    def _sent_submodel(self, sent: State, content: RecordDict) -> State:
        """The sent full model cut to the channels a pruned reply kept (``sent`` itself when
        the reply is full-size or the message was already a compact submodel)."""
        if KEPT not in content.array_records or self._plan_factory is None:
            return sent
        if self._plan is None:
            self._plan = self._plan_factory()
        kept = kept_from_record(content.array_records[KEPT])
        if reason := self._plan.validate_kept(kept):
            raise AttackError(f"{self.kind}: the reply's kept channels: {reason}")
        maps, shapes = self._plan.index_maps(kept), self._plan.compact_shapes(kept)
        if any(k not in sent or sent[k].size <= int(maps[k].max(initial=-1)) for k in maps):
            return sent  # not the full model the plan describes: the shape check below names it
        return compact_slice({k: sent[k] for k in maps}, maps, shapes)

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN or not msg.has_content():
            return call_next(msg, context)
        partition = int(context.node_config.get("partition-id", -1))
        if partition not in self.attackers:
            return call_next(msg, context)
        server_round = _server_round(msg)
        if self.kind == "stale-poison":
            done = context.state.config_records.get(STATE_KEY)
            if done is not None:
                reason = (
                    f"stale-poison: uploaded its one update in round "
                    f"{done['uploaded-round']!r} and stays away"
                )
                return Message(Error(ERR_ABSENT, reason), reply_to=msg)
        reply = call_next(msg, context)
        if reply.has_error() or not reply.has_content():
            return reply
        try:
            self._rewrite(msg, reply.content, context, partition, server_round)
        except AttackError as err:
            return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
        if self.kind == "stale-poison":
            context.state[STATE_KEY] = ConfigRecord({"uploaded-round": server_round})
        return reply

    def _rewrite(
        self, msg: Message, content: RecordDict, context: Context, partition: int, rnd: int
    ) -> None:
        """Rewrites the reply's ``content`` in place."""
        if self.kind == "sybil":
            name, metrics = _one_metric_record(content)
            ids = self.params["ids"]
            place = self.attackers.index(partition)
            content[name] = MetricRecord(
                {**dict(metrics), DEVICE_ID: ids[(rnd - 1 + place) % len(ids)]}
            )
        elif self.kind == "pruned-liar":
            if KEPT in content.array_records:
                rng = np.random.default_rng(_seed(self.params["seed"], partition, rnd))
                kept = kept_from_record(content.array_records[KEPT])
                lie = _shuffled if self.params["lie"] == "shuffle" else _resampled
                content[KEPT] = kept_record({g: lie(idx, rng) for g, idx in kept.items()})
        else:
            self._poison_update(msg, content, context, partition, rnd)

    def _poison_update(
        self, msg: Message, content: RecordDict, context: Context, partition: int, rnd: int
    ) -> None:
        name, reply_rec = _model_record(content, "reply")
        sent = to_numpy(_model_record(msg.content, "train message")[1])
        if KEPT not in msg.content.array_records:  # a full model sent: the device pruned it
            sent = self._sent_submodel(sent, content)
        mine = to_numpy(reply_rec)
        keys = float_keys(mine)
        for k in keys:
            if k not in sent or np.shape(sent[k]) != mine[k].shape:
                got = "missing" if k not in sent else f"shaped {list(np.shape(sent[k]))}"
                raise AttackError(
                    f"{self.kind}: reply array {k!r} {list(mine[k].shape)} has no match in the "
                    f"model sent ({got}): the update (reply - sent) needs both the same shape; "
                    "for a submodel the device pruned itself, give attack_mod the model's "
                    "plan= (its PruningPlan)"
                )
        base = flatten(sent, keys)
        own = flatten(mine, keys) - base
        if self.kind in ("sign-flip", "stale-poison"):
            bad = sign_flip(own, self.params["norm_scale"] * float(np.linalg.norm(own)))
        else:
            est = self.params["board"].share(context.run_id, rnd, partition, own)
            if self.kind == "alie":
                bad = alie(est.mean, est.std, self.params["z"])
            else:
                bad = ipm(est.mean, self.params["epsilon"])
        poisoned = unflatten(base + bad, mine, keys)
        out: State = {k: poisoned.get(k, v) for k, v in mine.items()}
        content[name] = to_record(out)


def _server_round(msg: Message) -> int:
    config = msg.content.config_records.get("config")
    value = config.get("server-round") if config is not None else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(msg.metadata.group_id)
    except ValueError:
        return 0


def _model_record(content: RecordDict, what: str) -> tuple[str, ArrayRecord]:
    names = [n for n in content.array_records if n != KEPT]
    if len(names) != 1:
        raise AttackError(f"the {what} holds {len(names)} model ArrayRecords {names}; want one")
    return names[0], content.array_records[names[0]]


def _one_metric_record(content: RecordDict) -> tuple[str, MetricRecord]:
    names = list(content.metric_records)
    if len(names) != 1:
        raise AttackError(f"the reply holds {len(names)} MetricRecords {names}; want one")
    return names[0], content.metric_records[names[0]]


def _seed(*parts: object) -> int:
    # Stable across processes (Ray actors), unlike hash().
    return zlib.crc32(":".join(map(str, parts)).encode())


def _shuffled(idx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if len(idx) < 2:
        return idx
    out = rng.permutation(idx)
    while np.array_equal(out, idx):  # odds 1/k! each: ends fast
        out = rng.permutation(idx)
    return out


def _resampled(idx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    width = int(idx.max()) + 1  # within the group's channels, whatever its full width
    if width == len(idx):
        return idx  # kept 0..k-1: no other set of k fits under max(kept)
    out = np.sort(rng.choice(width, size=len(idx), replace=False))
    if np.array_equal(out, idx):  # swap one kept channel for one the device dropped
        missing = np.setdiff1d(np.arange(width), idx)
        out[rng.integers(len(out))] = rng.choice(missing)
        out = np.sort(out)
    return out.astype(np.int64)
