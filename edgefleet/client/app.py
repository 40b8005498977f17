"""EdgeFleet's ClientApp: ``query`` (status), ``train`` and ``evaluate`` handlers, with the
battery as a Flower mod (:mod:`edgefleet.client.mods`, the same one any ClientApp can add).

Train replies carry one ArrayRecord (``arrays``) and one MetricRecord (``metrics``) with the
same keys from every device; a device that trains a CA-HFP submodel adds the ArrayRecord
``kept`` (its channels), which the server's reconstruction wrapper consumes before the
strategy sees the reply. A device that cannot do the work replies with an ``Error``, which
the server counts as declined.

``app`` never spoils a reply on purpose: the test-only lying devices of
:mod:`fleetharness.faults` are a mod that tests and benchmarks add to a ClientApp of
their own (:func:`clientapp`).

Attackers, for evaluating defences (:mod:`edgefleet.attacks`), come from the run config's
``attack.*`` keys, which EdgeFleet's ServerApp accepts on the Simulation Engine only (a
deployment run that sets one is refused before round 1): ``attack.kind`` on the partitions
:func:`attacker_partitions` draws from ``attack.fraction`` and ``seed``. The model-side
kinds run as :func:`~edgefleet.attacks.attack_mod` inside the battery mod
(:func:`run_config_attacks`); ``label-flip`` and ``backdoor`` poison the attacking device's
training set in :func:`train` (a mod never sees the data). ALIE and IPM colluders share
their honest updates through a :class:`~edgefleet.attacks.FolderBoard` in the machine's
temporary folder (Ray actors are separate processes).

Warm start (:mod:`edgefleet.strategies.warmstart_initializer`) may send the round's learning rate
(``lr`` in the config) and, in its ``continuous`` mode, ``kl-lambda``, ``teacher-session`` and
once per session the ``teacher`` ArrayRecord: the device keeps the teacher in
``Context.state`` (replaced by the next session's) and adds the KL term to its local loss.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod

from edgefleet.attacks import FolderBoard, attack_mod, backdoored, label_flipped
from edgefleet.client.battery import (
    SOLAR_SITES,
    EnergySource,
    SourceUnavailableError,
    make_source,
)
from edgefleet.client.mods import (
    ERR_ABSENT,
    ERR_BAD_CONFIG,
    ERR_NO_TEACHER,
    ERR_TRAIN_FAILED,
    BatterySettings,
    energy_mod,
)
from edgefleet.config import RunConfig
from edgefleet.pruning.wire import KEPT, kept_record
from edgefleet.task.cache import CacheUnwritableError
from edgefleet.task.datasets import dataset_info
from edgefleet.wire import (
    CONFIG_KL_LAMBDA,
    CONFIG_LR,
    CONFIG_TEACHER_SESSION,
    DEVICE_ID,
    DISPATCH,
    ENERGY_SPENT,
    KEPT_FRACTION,
    LABELS,
    NUM_EXAMPLES,
    NUM_PARTITIONS,
    PRESENT,
    SCAFFOLD_APPLIED,
    SCAFFOLD_CORRECTION,
    STATUS_RECORD,
    TEACHER_RECORD,
    TRAIN_LOSS,
    TRAIN_TIME,
)

if TYPE_CHECKING:
    from torch import nn

    from edgefleet.client.device import Device, DeviceProfile
    from edgefleet.pruning.submodel import PruningPlan
    from edgefleet.task.datasets import ArrayDataset

# torch, the data layer and the pruning code are imported by the handlers, not here: the
# Simulation Engine loads this module in its own process before it starts Ray (to check
# that the app loads), and every second spent here delays the first round.

# What a device's configuration or battery can raise: each becomes an Error reply (the
# server counts the device as declined or unavailable) instead of a crashed ClientApp.
DEVICE_ERRORS = (ValueError, FileNotFoundError, SourceUnavailableError, CacheUnwritableError)


@functools.cache  # sources hold no state; a trace file is read once per process, not per message
def energy_source(p: DeviceProfile, cfg: RunConfig) -> EnergySource:
    # lazy: torch (task.train); Flower imports this module at app load, the handlers need it
    from edgefleet.task.train import seed_for

    e = cfg.energy
    if p.energy_source == "bernoulli":
        seed = seed_for(cfg.seed, p.device_id, 0xE4E)
        return make_source("bernoulli", seed=seed, prob=p.harvest_prob, units=e.harvest_units)
    if p.energy_source == "trace":
        return make_source("trace", path=p.trace_path)
    if p.energy_source == "solar":  # each device a site and a phase (whole days)
        return make_source(
            "solar",
            site=solar_site(p.device_id),
            phase_hours=24.0 * (seed_for(cfg.seed, p.device_id, 0x50) % 365),
            panel_area=e.panel_area,
            efficiency=e.panel_efficiency,
            slot_seconds=e.slot_seconds,
            unit_joules=e.unit_joules,
        )
    return make_source(p.energy_source)


def solar_site(device_id: int) -> str:
    """The bundled irradiance site of a device under ``energy.source = "solar"``: the sites
    in turn, by device id."""
    sites = list(SOLAR_SITES)
    return sites[device_id % len(sites)]


def battery_settings(context: Context) -> BatterySettings:
    """The device's battery from the run config (``energy.*``) and its node config
    (``capacity``, ``harvest-prob``, ``energy-source``, ``trace-path``)."""
    # lazy: torch (client.device) only when a device is built, not at app load
    from edgefleet.client.device import get_profile

    cfg, profile = get_profile(context.run_config, context.node_config)
    return BatterySettings(profile.capacity, energy_source(profile, cfg), cfg.energy.round_cost)


def status(msg: Message, context: Context) -> Message:
    """The light status query (energy-aware selection, sessions): the device id, presence
    and, when asked (``labels`` in the config), the classes of the local data. The energy
    mod adds the battery level and whether it covers a round."""
    # lazy: torch (client.device) only when a device is built, not at app load
    from edgefleet.client.device import get_device, get_profile, is_present

    config = msg.content.config_records["config"]
    try:
        cfg, profile = get_profile(context.run_config, context.node_config)
        labels = (
            get_device(context.run_config, context.node_config).labels
            if config.get("labels", 0)
            else []
        )
    except DEVICE_ERRORS as err:
        return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
    status: dict[str, int | float | list[int] | list[float]] = {
        DEVICE_ID: profile.device_id,
        PRESENT: int(is_present(cfg, profile, int(config["server-round"]))),  # type: ignore[arg-type]
        # The partitioning the device's data comes from: a resume on another fleet is refused.
        NUM_PARTITIONS: profile.num_partitions,
    }
    if labels:
        status[LABELS] = labels
    return Message(RecordDict({STATUS_RECORD: MetricRecord(status)}), reply_to=msg)


# Where the device keeps warm start's teacher between messages.
TEACHER_STATE = "edgefleet.teacher"
TEACHER_INFO_STATE = "edgefleet.teacher-info"


class TeacherMissingError(ValueError):
    """The server names a teacher session whose model this device does not hold."""


def continuous_teacher(device: Device, msg: Message, context: Context) -> nn.Module | None:
    """The Continuous baseline's teacher for this round, or None when the server asks for
    no KL term. A teacher in the message replaces the one kept in ``context.state``.

    Raises :class:`TeacherMissingError` when the named session's teacher is not held (the
    server sends it again), ValueError when the config or the teacher is malformed."""
    # lazy: torch (task.train) only on the continuous warm start path
    from edgefleet.task.train import set_arrays

    config = msg.content.config_records["config"]
    weight = float(config.get(CONFIG_KL_LAMBDA, 0.0))  # type: ignore[arg-type]
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"train config '{CONFIG_KL_LAMBDA}' = {weight!r}: must be >= 0")
    if weight == 0:
        return None
    if CONFIG_TEACHER_SESSION not in config:
        raise ValueError(f"train config has '{CONFIG_KL_LAMBDA}' but no '{CONFIG_TEACHER_SESSION}'")
    session = int(config[CONFIG_TEACHER_SESSION])  # type: ignore[arg-type]
    sent = msg.content.array_records.get(TEACHER_RECORD)
    if sent is not None:
        context.state[TEACHER_STATE] = sent
        context.state[TEACHER_INFO_STATE] = ConfigRecord({"session": session})
    held = context.state.array_records.get(TEACHER_STATE)
    info = context.state.config_records.get(TEACHER_INFO_STATE)
    held_session = None if info is None else int(info["session"])  # type: ignore[arg-type]
    if held is None or held_session != session:
        raise TeacherMissingError(
            f"no teacher model for session {session} on this device (it holds "
            f"{'none' if held is None else f'session {held_session}'}); the server sends it again"
        )
    try:
        set_arrays(device.teacher, held)
    except RuntimeError as err:  # load_state_dict: keys or shapes do not fit
        raise ValueError(f"the teacher model does not fit this device's model: {err}") from None
    return device.teacher


# -- attackers (attack.*), Simulation Engine only --------------------------------------------

DATA_ATTACKS = ("label-flip", "backdoor")


def attacker_partitions(num_partitions: int, fraction: float, seed: int) -> tuple[int, ...]:
    """The partitions that attack: ``round(fraction x num_partitions)`` of them (at least
    one), drawn without replacement by a generator seeded with ``seed``, sorted. Every
    device (and the server, would it ask) draws the same set."""
    count = min(num_partitions, max(1, round(fraction * num_partitions)))
    rng = np.random.default_rng([seed, 0xA77AC])
    return tuple(sorted(int(p) for p in rng.choice(num_partitions, size=count, replace=False)))


@functools.cache
def _attack(cfg: RunConfig, num_partitions: int) -> Mod:
    a = cfg.attack
    partitions = attacker_partitions(num_partitions, a.fraction, cfg.seed)
    params: dict[str, object] = {}
    if a.kind in ("sign-flip", "stale-poison"):
        params["norm_scale"] = a.norm_scale
    elif a.kind in ("alie", "ipm"):
        import tempfile
        from pathlib import Path

        # One board per run folder: Flower's run id is 1 for every in-process run, so a
        # board keyed by it alone would hand a run an earlier run's posts.
        run = f"{cfg.server.output_dir}/{cfg.server.run_name}".encode()
        board = f"edgefleet-attack-board-{hashlib.sha256(run).hexdigest()[:12]}"
        params["board"] = FolderBoard(Path(tempfile.gettempdir()) / board)
        if a.kind == "ipm":
            params["epsilon"] = a.epsilon
        elif a.z != 0:
            params["z"] = a.z
        else:
            params["n_devices"] = num_partitions
    elif a.kind == "sybil":
        params["ids"] = list(a.sybil_ids)
    elif a.kind == "pruned-liar":
        params.update(lie=a.lie, seed=cfg.seed)
    # Built only if a reply is a submodel the device pruned itself (torch-pruning then).
    plan = functools.partial(_pruning_plan, cfg.train.model, cfg.data.dataset)
    return attack_mod(a.kind, partitions, plan=plan, **params)


def _pruning_plan(model: str, dataset: str) -> PruningPlan:
    # lazy: torch_pruning (pruning.submodel) only for runs that prune
    from edgefleet.pruning.submodel import plan_for

    return plan_for(model, dataset)


def run_config_attacks(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A mod: the model-side attack ``attack.kind`` names, on the partitions that attack
    (the reply of every other device, and of every device with ``attack.kind = "off"``,
    passes untouched). A kind that cannot be built for this fleet (ALIE with more attackers
    than half the devices) answers with an Error naming why."""
    # lazy: torch (client.device) only when a device is built, not at app load
    from edgefleet.client.device import get_profile

    try:
        cfg, profile = get_profile(context.run_config, context.node_config)
    except DEVICE_ERRORS:
        return call_next(msg, context)  # the handler answers with the reason
    if cfg.attack.kind in ("off", *DATA_ATTACKS):
        return call_next(msg, context)
    try:
        mod = _attack(cfg, profile.num_partitions)
    except ValueError as err:
        return Message(Error(ERR_BAD_CONFIG, f"attack.kind: {err}"), reply_to=msg)
    return mod(msg, context, call_next)


_POISONED: dict[int, ArrayDataset] = {}  # id(clean training set) -> its poisoned copy


def attacked_train_data(device: Device) -> ArrayDataset:
    """The device's training set, poisoned when ``attack.kind`` is a data-side attack and
    its partition attacks (built once per device and process)."""
    cfg, profile = device.config, device.profile
    a = cfg.attack
    if a.kind not in DATA_ATTACKS:
        return device.train_data
    attackers = attacker_partitions(profile.num_partitions, a.fraction, cfg.seed)
    if profile.partition_id not in attackers:
        return device.train_data
    key = id(device.train_data)
    if key not in _POISONED:
        # lazy: torch (task.train) only for poisoning attackers
        from edgefleet.task.train import seed_for

        if a.kind == "label-flip":
            classes = dataset_info(cfg.data.dataset).num_classes
            _POISONED[key] = label_flipped(device.train_data, classes)
        else:
            rng = np.random.default_rng(seed_for(cfg.seed, profile.partition_id, 0xBAD))
            _POISONED[key] = backdoored(device.train_data, a.target, a.poison_fraction, rng)
    return _POISONED[key]


def train(msg: Message, context: Context) -> Message:
    # lazy: torch (client.device, client.pruning, task.train) only in the handlers
    from edgefleet.client.device import get_device, is_present
    from edgefleet.client.pruning import ordered_dropout_round, parameter_fraction, round_model
    from edgefleet.task.train import get_arrays, seed_for, train_local

    try:
        device = get_device(context.run_config, context.node_config)
    except DEVICE_ERRORS as err:
        return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
    cfg, profile = device.config, device.profile
    config = msg.content.config_records["config"]
    server_round = int(config["server-round"])  # type: ignore[arg-type]
    mu = float(config.get("proximal-mu", 0.0))  # type: ignore[arg-type]
    lr = float(config.get(CONFIG_LR, cfg.train.lr))  # type: ignore[arg-type]
    if not is_present(cfg, profile, server_round):
        return Message(Error(ERR_ABSENT, "device is not present this session"), reply_to=msg)
    if len(device.train_data) == 0:  # an Error reply: the energy mod spends nothing
        return Message(Error(ERR_TRAIN_FAILED, "no local training data"), reply_to=msg)
    if not (math.isfinite(lr) and lr > 0):
        reason = f"train config '{CONFIG_LR}' = {lr!r}: must be finite and > 0"
        return Message(Error(ERR_BAD_CONFIG, reason), reply_to=msg)
    try:
        teacher = continuous_teacher(device, msg, context)
    except TeacherMissingError as err:
        return Message(Error(ERR_NO_TEACHER, str(err)), reply_to=msg)
    except (ValueError, TypeError, KeyError) as err:
        return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
    seed = seed_for(cfg.seed, profile.partition_id, server_round)
    if DISPATCH in config:  # asynchronous aggregation: one seed per train message
        seed = seed_for(seed, int(config[DISPATCH]))  # type: ignore[arg-type]
    start = time.perf_counter()
    try:
        if cfg.pruning.criterion == "ordered-dropout":  # FjORD: steps of its own
            if teacher is not None or mu > 0 or SCAFFOLD_CORRECTION in msg.content.array_records:
                reason = "ordered dropout trains with plain SGD steps only (no FedProx, "
                reason += "Continuous warm start or SCAFFOLD term)"
                return Message(Error(ERR_BAD_CONFIG, reason), reply_to=msg)
            model, kept, result = ordered_dropout_round(
                device, msg.content.array_records["arrays"], attacked_train_data(device), seed, lr
            )
            correction = None
        else:
            model, kept = round_model(
                device,
                msg.content.array_records["arrays"],
                msg.content.array_records.get(KEPT),
                seed,
                server_round,
            )
            correction = scaffold_correction(msg, model)
            result = train_local(
                model,
                attacked_train_data(device),
                steps=cfg.train.local_steps,
                batch_size=cfg.train.batch_size,
                lr=lr,
                momentum=cfg.train.momentum,
                seed=seed,
                proximal_mu=mu,
                teacher=teacher,
                kl_lambda=float(config.get(CONFIG_KL_LAMBDA, 0.0)),  # type: ignore[arg-type]
                correction=correction,
            )
    except ValueError as err:  # no data, or a compact download that does not fit
        return Message(Error(ERR_TRAIN_FAILED, str(err)), reply_to=msg)
    metrics = MetricRecord(
        {
            NUM_EXAMPLES: result.num_examples,
            TRAIN_LOSS: result.loss,
            DEVICE_ID: profile.device_id,
            # The energy mod replaces it with the round's cost under energy-aware selection.
            ENERGY_SPENT: 0.0,
            TRAIN_TIME: time.perf_counter() - start,
            KEPT_FRACTION: parameter_fraction(model, device.model),
        }
    )
    if correction is not None:
        metrics[SCAFFOLD_APPLIED] = 1
    content = RecordDict({"arrays": get_arrays(model), "metrics": metrics})
    if kept is not None:  # a CA-HFP submodel: the server needs its channels to rebuild it
        content[KEPT] = kept_record(kept)
    return Message(content=content, reply_to=msg)


def scaffold_correction(msg: Message, model: Any) -> dict[str, Any] | None:
    """SCAFFOLD's c - c_i from a train message (None without one), as tensors by parameter
    name; a ValueError when it does not fit the model (a pruned submodel, another model)."""
    import torch

    record = msg.content.array_records.get(SCAFFOLD_CORRECTION)
    if record is None:
        return None
    params = dict(model.named_parameters())
    out = {}
    for name, p in params.items():
        if name not in record or tuple(record[name].shape) != tuple(p.shape):
            raise ValueError(
                f"'{SCAFFOLD_CORRECTION}' does not fit this device's model at {name!r} "
                "(SCAFFOLD does not work with pruned submodels)"
            )
        values = torch.from_numpy(np.asarray(record[name].numpy(), dtype=np.float32))
        if not torch.isfinite(values).all():
            raise ValueError(f"'{SCAFFOLD_CORRECTION}' has non-finite entries at {name!r}")
        out[name] = values.to(p.device)
    return out


def evaluate(msg: Message, context: Context) -> Message:
    # lazy: torch (client.device, task.train) only in the handlers
    from edgefleet.client.device import get_device
    from edgefleet.task.train import evaluate as evaluate_model
    from edgefleet.task.train import set_arrays

    try:
        device = get_device(context.run_config, context.node_config)
    except DEVICE_ERRORS as err:
        return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
    set_arrays(device.model, msg.content.array_records["arrays"])
    res = evaluate_model(device.model, device.test_data)
    metrics = MetricRecord(
        {
            NUM_EXAMPLES: len(device.test_data),
            "eval-loss": res.loss,
            "eval-accuracy": res.accuracy,
            DEVICE_ID: device.profile.device_id,
        }
    )
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


def clientapp(*inner_mods: Mod) -> ClientApp:
    """A ClientApp with EdgeFleet's handlers and battery mod; ``inner_mods`` run inside the
    battery mod and the run config's attacks (:func:`run_config_attacks`), next to the
    handlers (how tests and benchmarks add :func:`fleetharness.faults.fault_mod`;
    EdgeFleet's own ``app`` adds none)."""
    # The battery is the same mod any Flower ClientApp can add (edgefleet.client.mods).
    out = ClientApp(mods=[energy_mod(settings=battery_settings), run_config_attacks, *inner_mods])
    out.query()(status)
    out.train()(train)
    out.evaluate()(evaluate)
    return out


app = clientapp()
