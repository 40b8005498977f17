"""Run config: the flat ``key = value`` table Flower hands to both apps, parsed once.

Flower passes ``context.run_config`` as a flat mapping (``pyproject.toml``'s
``[tool.flwr.app.config]`` fused with ``--run-config`` overrides). :func:`parse_run_config`
turns it into a frozen :class:`RunConfig` and rejects every bad value before any work is
spent, naming the key, the value and what would have been valid.

Each key is declared once, as a field of one of the section dataclasses below:
``key(name, default, check, help)``. Everything else derives from those declarations:
``DEFAULTS``, the checks, the mapping to fields, :func:`markdown_table` (the README's key
table, kept equal by a test, as is ``pyproject.toml``'s table). To add a key, add a field.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import Field, dataclass, field, fields
from enum import StrEnum
from typing import Any

from edgefleet.algorithms.saga import SAGA_CORRECTIONS, SAGA_ESTIMATORS, SAGA_INITS, SAGA_MEANS
from edgefleet.algorithms.selection import SELECTION_ORDERS
from edgefleet.algorithms.stopping import FORMS as STOPPING_FORMS
from edgefleet.algorithms.stopping import NORMS as STOPPING_NORMS
from edgefleet.algorithms.stopping import VALIDATION_RULES
from edgefleet.algorithms.warmstart import WARMSTART_MODES
from edgefleet.attacks.mods import KINDS as ATTACK_KINDS
from edgefleet.attacks.mods import LIES
from edgefleet.client.battery import SOURCES, SourceKind
from edgefleet.errors import SettingError
from edgefleet.loop.screening import BINDINGS, NORM_FACTOR, NORM_FLOOR
from edgefleet.loop.staleness import STALENESS_FUNCTIONS
from edgefleet.loop.timing import WAIT_MODES
from edgefleet.pruning.names import (
    BUDGETS,
    CRITERIA,
    CURVATURE_SCORES,
    HESSIAN_ESTIMATORS,
    RECONSTRUCTIONS,
)
from edgefleet.strategies.robust import ROBUST_RULES, RULE_PARAMS, RobustRule
from edgefleet.task.datasets import DATASETS
from edgefleet.task.names import ACCELERATORS, MODELS
from edgefleet.task.partition import PARTITIONS


class StrategyName(StrEnum):
    """The inner strategy (``strategy``)."""

    FEDAVG = "fedavg"
    FEDPROX = "fedprox"
    FEDSAG = "fedsag"
    MIFA = "mifa"
    FEDVARP = "fedvarp"
    SCAFFOLD = "scaffold"


# FedSAG and the baselines that are fixed configurations of it (robust rules go inside them).
SAGA_FAMILY: tuple[str, ...] = ("fedsag", "mifa", "fedvarp")
STRATEGIES: tuple[str, ...] = tuple(m.value for m in StrategyName)


class SelectionMode(StrEnum):
    """Who trains each round (``selection.mode``)."""

    ALL = "all"
    ENERGY_AGE = "energy-age"


SELECTIONS: tuple[str, ...] = tuple(m.value for m in SelectionMode)


class StoppingMode(StrEnum):
    """When training stops (``stopping.mode``); ``observe`` records both rules' signals every
    round and never stops (for benchmarks)."""

    OFF = "off"
    DATA_FREE = "data-free"
    VALIDATION = "validation"
    OBSERVE = "observe"


STOPPING_MODES: tuple[str, ...] = tuple(m.value for m in StoppingMode)


class ValidationSplit(StrEnum):
    """Where the validation rule's data comes from (``stopping.validation-split``)."""

    OFFICIAL = "official"
    TEST = "test"


VALIDATION_SPLITS: tuple[str, ...] = tuple(m.value for m in ValidationSplit)


class SessionSchedule(StrEnum):
    """Which devices are present in which session (``sessions.schedule``)."""

    NONE = "none"
    ALTERNATE = "alternate"


SESSION_SCHEDULES: tuple[str, ...] = tuple(m.value for m in SessionSchedule)
ATTACK_CHOICES: tuple[str, ...] = ("off", *ATTACK_KINDS)


class LrSchedule(StrEnum):
    """The learning-rate schedule (``lr-schedule``); ``session-poly``: the reference's
    polynomial decay within each session (arXiv 2410.05662)."""

    CONSTANT = "constant"
    SESSION_POLY = "session-poly"


LR_SCHEDULES: tuple[str, ...] = tuple(m.value for m in LrSchedule)

Value = bool | int | float | str
# A check returns None when the value is fine, else the text "must be ..." for the error.
Check = Callable[[Any], str | None]


class ConfigError(SettingError):
    """A run-config value is invalid; the message names the key, value and valid choices."""


@dataclass(frozen=True)
class KeySpec:
    """One run-config key: its name, default (whose type is the key's type), check, help
    text, and an optional parser from the raw value to the field's value."""

    name: str
    default: Value
    check: Check
    help: str
    parse: Callable[[Any], Any] | None = None


def key(
    name: str,
    default: Value,
    check: Check,
    help: str,
    parse: Callable[[Any], Any] | None = None,
) -> Any:
    """A section field read from run-config key ``name``."""
    return field(metadata={"spec": KeySpec(name, default, check, help, parse)})


# -- bounds every value of a type meets (docs/reference/config-limits.md) --------------------

# Every integer goes to NumPy, torch and Flower's records (64-bit at most; numpy's legacy
# seeding 32-bit): 2^31 - 1 is far above any count a fleet has and below every such limit.
MAX_INT = 2**31 - 1
# A round budget no run reaches (a million rounds of a one-second round is 11 days); above it
# a value is a typo or an attempt to run forever.
MAX_ROUNDS = 1_000_000
MAX_TEXT = 4096  # characters of a string value (a path: Linux's PATH_MAX)
UPPER_BOUNDS: dict[str, int] = {"num-server-rounds": MAX_ROUNDS}


def _bounds(name: str, value: Value) -> str | None:
    """What no key of ``value``'s type accepts: inf or NaN numbers, integers beyond
    :data:`MAX_INT` (or the key's own bound), strings longer than :data:`MAX_TEXT` or
    holding a NUL."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if isinstance(value, int) and not isinstance(value, bool):
        high = UPPER_BOUNDS.get(name, MAX_INT)
        if not -MAX_INT <= value <= high:
            return f"must be at most {high:,}" if value > 0 else f"must be at least {-MAX_INT:,}"
    if isinstance(value, str) and len(value) > MAX_TEXT:
        return f"must be at most {MAX_TEXT} characters (has {len(value):,})"
    if isinstance(value, str) and "\0" in value:  # no path, name or list holds one
        return "must not contain a NUL character"
    return None


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error names a bad value without
    repeating a megabyte of it."""
    if isinstance(value, int) and abs(value) >= 10**30:  # (repr fails past 4,300 digits)
        return f"{'-' if value < 0 else ''}<an integer of {value.bit_length():,} bits>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text):,} chars)"


# -- checks ---------------------------------------------------------------------------------


def _choice(options: tuple[str, ...]) -> Check:
    return lambda v: None if v in options else f"must be one of {', '.join(options)}"


def _at_least(low: float) -> Check:
    return lambda v: None if v >= low else f"must be >= {low}"


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _fraction(v: Any) -> str | None:
    return None if 0.0 < v <= 1.0 else "must be in (0, 1]"


def _unit_interval(v: Any) -> str | None:
    return None if 0.0 <= v <= 1.0 else "must be in [0, 1]"


def _half_open_fraction(v: Any) -> str | None:
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def _open_fraction(v: Any) -> str | None:
    return None if 0.0 < v < 1.0 else "must be in (0, 1)"


def _any(_: Any) -> str | None:
    return None


def _not_empty(v: str) -> str | None:
    return None if v else "must not be empty"


def _run_name(v: str) -> str | None:
    if "/" in v or "\\" in v:
        return "must not contain '/' or '\\'"
    return "must not be '.' or '..'" if v in (".", "..") else None


def _trim(v: float) -> str | None:
    return None if 0.0 <= v < 0.5 else "must be in [0, 0.5)"


def _finite(v: float) -> str | None:
    return None if v == v and abs(v) != float("inf") else "must be a finite number"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _int_list(v: str) -> str | None:
    try:
        values = _ints(v)
    except ValueError:
        return "must be comma-separated device ids, e.g. '100,101'"
    return None if all(x >= 0 for x in values) else "each id must be >= 0"


def _norm_factor(v: float) -> str | None:
    return None if v == 0 or v >= 1 else "must be 0 (off) or >= 1"


# Keys a resumed run may change when `resume-changes` names them: they change how much is
# run or measured, not what the rounds already on record did.
RESUME_CHANGEABLE: tuple[str, ...] = (
    "num-server-rounds",
    "evaluate-every",
    "eval-samples",
    "fraction-evaluate",
)
# Keys that say where and how long to wait, never what the run is: never compared on resume.
RESUME_OPERATIONAL: tuple[str, ...] = (
    "output-dir",
    "run-name",
    "resume",
    "resume-changes",
    "data-dir",
    "round-timeout",
    "timeout-mode",
    "first-round-timeout",
    "timeout-slack",
    "timeout-margin",
    "node-wait-timeout",
    "min-nodes",
    "client-threads",
    "run.max-empty-rounds",
)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _resume_changes(v: str) -> str | None:
    bad = [k for k in _names(v) if k not in RESUME_CHANGEABLE]
    if bad:
        return f"names {', '.join(bad)}; only these may change on resume: " + ", ".join(
            RESUME_CHANGEABLE
        )
    return None


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _float_list(low: float, high: float, low_open: bool, example: str) -> Check:
    def check(v: str) -> str | None:
        try:
            values = _floats(v)
        except ValueError:
            return f"must be comma-separated numbers, e.g. '{example}'"
        ok = all((low < x if low_open else low <= x) and x <= high for x in values)
        return None if ok else f"each value must be in {'(' if low_open else '['}{low}, {high}]"

    return check


# -- sections ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    num_rounds: int = key("num-server-rounds", 5, _at_least(1), "round budget")
    max_empty_rounds: int = key(
        "run.max-empty-rounds",
        3,
        _at_least(0),
        "stop the run with an error (its checkpoint kept for `--resume`) after this many rounds "
        "in a row without a participant, naming the cause (0 = never)",
    )
    strategy: str = key(
        "strategy",
        "fedavg",
        _choice(STRATEGIES),
        "`fedavg`, `fedprox`, `fedsag` (SAGA memory), and the field's baselines: `mifa`, "
        "`fedvarp`, `scaffold` (needs a ClientApp that applies its correction; "
        "docs/explanation/field-baselines.md)",
    )
    fraction_train: float = key(
        "fraction-train", 1.0, _fraction, "fraction of online nodes asked to train each round"
    )
    fraction_evaluate: float = key(
        "fraction-evaluate",
        0.0,
        _unit_interval,
        "fraction of online nodes asked to evaluate the global model on their own test data "
        "each round (federated evaluation; 0 = none)",
    )
    evaluate_every: int = key(
        "evaluate-every",
        1,
        _at_least(1),
        "central evaluation every N rounds and on the last (rows between say `evaluated: false`)",
    )
    min_nodes: int = key(
        "min-nodes",
        2,
        _at_least(1),
        "nodes to wait for before round 1 (at most `node-wait-timeout` s, then go on; a "
        "resumed run goes on once none has joined for 15 s)",
    )
    round_timeout: float = key(
        "round-timeout",
        600.0,
        _positive,
        "seconds to wait for a round's replies (with `timeout-mode` `expected`: the most a "
        "timed device is waited for)",
    )
    timeout_mode: str = key(
        "timeout-mode",
        "fixed",
        _choice(WAIT_MODES),
        "`fixed` (every reply waited for `round-timeout`) or `expected` (each device for "
        "`timeout-slack` x its observed round + `timeout-margin`, at most `round-timeout`; "
        "`first-round-timeout` before its first timed round)",
    )
    first_round_timeout: float = key(
        "first-round-timeout",
        600.0,
        _positive,
        "`timeout-mode` `expected`: seconds to wait for a device never timed (its first round "
        "installs, imports and loads data); may exceed `round-timeout`",
    )
    timeout_slack: float = key(
        "timeout-slack", 3.0, _at_least(1.0), "`timeout-mode` `expected`: x the observed round"
    )
    timeout_margin: float = key(
        "timeout-margin", 10.0, _at_least(0.0), "`timeout-mode` `expected`: seconds added"
    )
    eval_samples: int = key(
        "eval-samples",
        0,
        _at_least(0),
        "central evaluation on a seeded random subset of this many test images (0 = all)",
    )
    node_wait_timeout: float = key(
        "node-wait-timeout", 120.0, _at_least(0.0), "seconds to wait for `min-nodes`"
    )
    output_dir: str = key("output-dir", "runs", _not_empty, "results go to `output-dir/run-name`")
    run_name: str = key(
        "run-name", "", _run_name, "the run's folder name (made up from time and config if empty)"
    )
    resume: bool = key("resume", False, _any, "continue `run-name` from its last checkpoint")
    resume_changes: tuple[str, ...] = key(
        "resume-changes",
        "",
        _resume_changes,
        "keys a resumed run may change (comma-separated; of "
        + ", ".join(f"`{k}`" for k in RESUME_CHANGEABLE)
        + "); any other change is refused",
        _names,
    )
    server_lr: float = key("server-lr", 1.0, _positive, "FedSAG's server step")
    saga_init: str = key(
        "saga.init", "zeros", _choice(SAGA_INITS), "FedSAG's memory start: `zeros`, `first-update`"
    )
    saga_estimator: str = key(
        "saga.estimator",
        "saga",
        _choice(SAGA_ESTIMATORS),
        "FedSAG's direction: `saga` (memory mean + the participants' corrections) or `sag` "
        "(memory mean after the participants' memories are replaced)",
    )
    saga_memory_mean: str = key(
        "saga.memory-mean",
        "fleet",
        _choice(SAGA_MEANS),
        "what FedSAG's memory mean divides by: `fleet` (all registered devices, one that never "
        "uploaded counting as zero) or `stored` (the devices that have a memory)",
    )
    saga_correction: str = key(
        "saga.correction",
        "channels",
        _choice(SAGA_CORRECTIONS),
        "weight of each participant's correction: `channels` (1/max(participants, M)) or "
        "`participants` (1/participants)",
    )
    saga_max_age: int = key(
        "saga.max-age",
        0,
        _at_least(0),
        "FedSAG: a memory stored more than this many rounds ago expires from the memory mean "
        "(the device counts as zero until it uploads again; 0 = never)",
    )


@dataclass(frozen=True)
class DataConfig:
    dataset: str = key(
        "dataset", "mnist-5k", _choice(DATASETS), " ".join(f"`{d}`" for d in DATASETS)
    )
    data_dir: str = key("data-dir", "", _any, "where local copies are looked for (see Data)")
    partition: str = key(
        "partition",
        "dirichlet",
        _choice(PARTITIONS),
        "`iid`, `dirichlet` (with `alpha`), `shards` (with `shards-per-device`)",
    )
    alpha: float = key("alpha", 0.5, _positive, "Dirichlet concentration (small = skewed)")
    shards_per_device: int = key(
        "shards-per-device", 2, _at_least(1), "label shards per device for `shards`"
    )
    local_test_fraction: float = key(
        "local-test-fraction",
        0.2,
        _half_open_fraction,
        "share of each device's data kept for local evaluation",
    )


@dataclass(frozen=True)
class TrainConfig:
    model: str = key("model", "smallcnn", _choice(MODELS), " ".join(f"`{m}`" for m in MODELS))
    lr: float = key("lr", 0.05, _positive, "local SGD learning rate")
    lr_schedule: str = key(
        "lr-schedule",
        "constant",
        _choice(LR_SCHEDULES),
        "`constant`, or `session-poly`: within each session the rate decays from `lr` to "
        "`lr` x `lr-min-ratio` (power 0.9, as arXiv 2410.05662's code; needs "
        "`sessions.rounds`); the server sends each round's rate in the train config",
    )
    lr_min_ratio: float = key(
        "lr-min-ratio", 0.6, _fraction, "`session-poly`: the last rate of a session over `lr`"
    )
    momentum: float = key("momentum", 0.9, _half_open_fraction, "local SGD momentum")
    batch_size: int = key("batch-size", 32, _at_least(1), "local mini-batch size")
    local_steps: int = key("local-steps", 20, _at_least(1), "local SGD steps a round")
    proximal_mu: float = key("proximal-mu", 0.01, _at_least(0.0), "FedProx's mu")
    client_threads: int = key(
        "client-threads", 1, _at_least(1), "torch threads per ClientApp process"
    )
    accelerator: str = key(
        "accelerator",
        "auto",
        _choice(ACCELERATORS),
        "where training, evaluation and pruning scores run: `auto` (cuda, else mps, else "
        "cpu), `cpu`, `cuda`, `mps`; a SuperNode's `--node-config accelerator=...` wins",
    )


@dataclass(frozen=True)
class EnergyConfig:
    """``selection.*``, ``energy.*``: EH-FedSAG's batteries and energy-aware selection.

    ``harvest_probs`` (simulation) gives partition i the probability
    ``harvest_probs[i % len]``; a SuperNode's ``--node-config harvest-prob=...`` overrides it.
    """

    selection: str = key(
        "selection.mode",
        "all",
        _choice(SELECTIONS),
        "`all`, `energy-age` (batteries + energy-aware age-based selection)",
    )
    order: str = key(
        "selection.order",
        "age",
        _choice(SELECTION_ORDERS),
        "energy-age selection's query order: `age` (oldest update first) or `random` (uniform)",
    )
    max_devices: int = key("selection.max-devices", 25, _at_least(1), "M: devices a round")
    batch_size: int = key(
        "selection.batch-size", 0, _at_least(0), "status queries per batch (0 = all at once)"
    )
    deadline: float = key(
        "selection.deadline",
        0.0,
        _at_least(0.0),
        "energy-age selection skips a device whose observed round (download + training + "
        "upload, timed by the server) exceeds this many seconds; never timed = fits (0 = off)",
    )
    deadline_retry: int = key(
        "selection.deadline-retry",
        10,
        _at_least(0),
        "a device skipped by `selection.deadline` this many rounds in a row is selectable "
        "again once, so its round is timed afresh (0 = never tried again)",
    )
    status_max_age: int = key(
        "selection.status-max-age",
        0,
        _at_least(0),
        "energy-age selection takes a device's answer `feasible` from at most this many rounds "
        "ago (a status query, or its last train reply) instead of asking again, saving a round "
        "trip a round; harvesting batteries give the same verdicts (0 = ask every round)",
    )
    source: str = key(
        "energy.source", "bernoulli", _choice(SOURCES), " ".join(f"`{s}`" for s in SOURCES)
    )
    capacity: float = key("energy.capacity", 10.0, _positive, "battery size (units)")
    harvest_prob: float = key(
        "energy.harvest-prob", 0.5, _unit_interval, "P_h: probability of an arrival per slot"
    )
    harvest_probs: tuple[float, ...] = key(
        "energy.harvest-probs",
        "",
        _float_list(0.0, 1.0, False, "0.1,0.5,0.9"),
        "simulation: comma-separated P_h, partition i takes entry i mod n",
        _floats,
    )
    harvest_units: float = key("energy.harvest-units", 1.0, _at_least(0.0), "units per arrival")
    panel_area: float = key(
        "energy.panel-area", 0.001, _positive, "`solar`: panel area in m^2 (0.001 = 10 cm^2)"
    )
    panel_efficiency: float = key(
        "energy.panel-efficiency", 0.2, _fraction, "`solar`: share of the irradiance harvested"
    )
    slot_seconds: float = key(
        "energy.slot-seconds", 60.0, _positive, "`solar`: the length of a slot in seconds"
    )
    unit_joules: float = key(
        "energy.unit-joules", 4.0, _positive, "`solar`: joules in one battery unit"
    )
    train_slots: int = key(
        "energy.train-slots",
        3,
        _at_least(1),
        "Omega: a round costs Omega + 1 units (training + transmission)",
    )

    @property
    def round_cost(self) -> float:
        """Energy units one round costs: Omega slots of training plus one of transmission."""
        return float(self.train_slots + 1)

    @property
    def slots_per_round(self) -> int:
        """The global slot clock advances by one round's duration each round."""
        return self.train_slots + 1


@dataclass(frozen=True)
class StoppingConfig:
    """``stopping.*``: data-free early stopping (or the validation baseline)."""

    mode: str = key(
        "stopping.mode",
        "off",
        _choice(STOPPING_MODES),
        "`off`, `data-free`, `validation` (baseline, needs server data), `observe` (record "
        "both, never stop)",
    )
    tau: float = key("stopping.tau", 0.005, _at_least(0.0), "growth threshold")
    patience: int = key("stopping.patience", 10, _at_least(1), "rounds in a row below it")
    norm: str = key(
        "stopping.norm",
        "l2",
        _choice(STOPPING_NORMS),
        "`l2` or `squared` (then use tau' = (1+tau)^2 - 1, about 2 tau)",
    )
    form: str = key(
        "stopping.form",
        "reference",
        _choice(STOPPING_FORMS),
        "`reference` (the reference code's rule: patience counts rounds in a row, on "
        "`stopping.norm`) or `seed` (the seed's: squared norm, a counter never reset)",
    )
    validation_rule: str = key(
        "stopping.validation-rule",
        "reference",
        _choice(VALIDATION_RULES),
        "the validation baseline's rule: `reference` (the paper's: patience on validation "
        "loss and accuracy improving by more than `stopping.validation-min-delta`, ends with "
        "the stop round's model) or `best` (patience after the best accuracy, keeps that model)",
    )
    validation_min_delta: float = key(
        "stopping.validation-min-delta",
        0.005,
        _at_least(0.0),
        "the `reference` rule's minimum improvement of validation loss or accuracy",
    )
    validation_split: str = key(
        "stopping.validation-split",
        "official",
        _choice(VALIDATION_SPLITS),
        "the baselines' validation data: `official` (the data set's own validation split where "
        "it has one, PneumoniaMNIST; else as `test`) or `test` (a held-out share of the "
        "central test set, `stopping.validation-fraction`)",
    )
    validation_fraction: float = key(
        "stopping.validation-fraction",
        0.5,
        _open_fraction,
        "share of the central test set held out for `validation`/`observe`",
    )


@dataclass(frozen=True)
class PruningConfig:
    """``pruning.*``: CA-HFP's resource classes and curvature-aware structured pruning.

    ``keep_ratios`` (simulation) gives partition i the keep ratio ``keep_ratios[i % len]``;
    a SuperNode's ``--node-config keep-ratio=...`` overrides both. ``budget`` says what a keep
    ratio is a share of (``edgefleet.pruning.submodel`` explains the choices).
    """

    keep_ratio: float = key(
        "pruning.keep-ratio",
        1.0,
        _fraction,
        "share of the model every device keeps (of what: `pruning.budget`)",
    )
    keep_ratios: tuple[float, ...] = key(
        "pruning.keep-ratios",
        "",
        _float_list(0.0, 1.0, True, "1.0,0.75,0.5,0.25"),
        'a list cycled over partitions (`"1.0,0.5"`); a SuperNode\'s `keep-ratio` wins',
        _floats,
    )
    criterion: str = key(
        "pruning.criterion",
        "curvature",
        _choice(CRITERIA),
        "channel importance: `curvature` (see `pruning.score`), `magnitude`, `random`; or by "
        "position: `prefix` (HeteroFL's static slice), `rolling` (FedRolex's window), "
        "`ordered-dropout` (FjORD: a width of `pruning.keep-ratios` drawn every local step)",
    )
    score: str = key(
        "pruning.score",
        "taylor",
        _choice(CURVATURE_SCORES),
        "curvature score per weight: `taylor` (\\|g w - h w^2 / 2\\|) or `signed` "
        "(g w + h w^2, lowest channels pruned first, as CA-HFP's seed writes it)",
    )
    budget: str = key(
        "pruning.budget",
        "parameters",
        _choice(BUDGETS),
        "a keep ratio is a share of the model's `parameters`, of its `compute` (forward "
        "multiply-accumulates), or of every group's `channels` (parameters then ~ ratio^2)",
    )
    hessian: str = key(
        "pruning.hessian",
        "fisher",
        _choice(HESSIAN_ESTIMATORS),
        "Hessian diagonal: empirical `fisher` or `hutchinson`",
    )
    score_batches: int = key(
        "pruning.score-batches", 2, _at_least(1), "local mini-batches the score is measured on"
    )
    reconstruction: str = key(
        "pruning.reconstruction",
        "global",
        _choice(RECONSTRUCTIONS),
        "`global` (pruned entries from the global model), `elementwise` (each entry averaged "
        "over the devices that kept it; FedAvg/FedProx only), `zeros` (the paper's ablation)",
    )
    compact_download: bool = key(
        "pruning.compact-download",
        False,
        _any,
        "send a pruned device only its slice of the model once its channels are known",
    )
    refresh_rounds: int = key(
        "pruning.refresh-rounds",
        5,
        _at_least(1),
        "with compact download: the full model (and a fresh score) every N rounds",
    )

    def ratio_for(self, partition_id: int) -> float:
        if self.keep_ratios:
            return self.keep_ratios[partition_id % len(self.keep_ratios)]
        return self.keep_ratio


@dataclass(frozen=True)
class SessionsConfig:
    """``sessions.*``: device arrival and departure.

    Sessions are on when ``schedule = "alternate"``, ``rounds > 0`` or ``warmstart.mode`` is
    not ``"previous"``; otherwise every round belongs to one run-long stretch.
    ``schedule = "alternate"`` (simulation): devices form ``groups`` groups (partition i is
    in group ``i % groups``) with label sets overlapping by ``label_overlap``; group
    ``s % groups`` is present in session s, each session lasting ``rounds`` rounds, for
    ``count`` sessions. ``"none"``: every device is present whenever it is online, as in a
    deployment; a new session starts when the present set changes by more than
    ``change_threshold`` or after ``rounds`` rounds (0 = no length limit).
    """

    schedule: str = key(
        "sessions.schedule",
        "none",
        _choice(SESSION_SCHEDULES),
        "`none` (presence = online), `alternate` (simulation: groups take turns)",
    )
    count: int = key("sessions.count", 1, _at_least(1), "S sessions (`alternate`)")
    rounds: int = key(
        "sessions.rounds",
        0,
        _at_least(0),
        "T rounds a session (`alternate`: num-server-rounds must be S x T); 0 = no limit",
    )
    groups: int = key(
        "sessions.groups", 2, _at_least(1), "device groups (partition i in group i mod groups)"
    )
    label_overlap: float = key(
        "sessions.label-overlap",
        0.0,
        _unit_interval,
        "the share of the other groups' classes each group also holds",
    )
    change_threshold: float = key(
        "sessions.change-threshold",
        0.2,
        _half_open_fraction,
        "a new session when the present set differs from the founding set by more than this "
        "(Jaccard distance)",
    )
    target_accuracy: float = key(
        "sessions.target-accuracy",
        0.8,
        _fraction,
        "per-session time to this accuracy on the session's classes",
    )


@dataclass(frozen=True)
class WarmStartConfig:
    """``warmstart.*``: how each new session's initial model is built (arXiv 2410.05662)."""

    mode: str = key(
        "warmstart.mode",
        "previous",
        _choice(WARMSTART_MODES),
        "`pilot` (the paper), `previous`, `average`, `fresh`, `continuous` (the paper's "
        "baseline: `previous` + a KL term to the last session's model; EdgeFleet's ClientApp)",
    )
    pilot_sessions: int = key("warmstart.pilot-sessions", 1, _at_least(1), "P pilot sessions")
    aux_rounds: int = key(
        "warmstart.aux-rounds", 1, _at_least(1), "V auxiliary rounds per later session"
    )
    temperature: float = key("warmstart.temperature", 10.0, _positive, "softmin R")
    aux_lr_scale: float = key(
        "warmstart.aux-lr-scale",
        0.5,
        _fraction,
        "`pilot`: auxiliary rounds train at `lr` x this, constant (the reference: half)",
    )
    kl_lambda: float = key(
        "warmstart.kl-lambda",
        0.5,
        _at_least(0.0),
        "`continuous`: weight of KL(last session's model || local model) in the local loss",
    )
    reset_after_pilot: bool = key(
        "warmstart.reset-after-pilot",
        False,
        _any,
        "the first post-pilot session starts from the initial model in every mode, as the "
        "reference's experiments do (false: from the last model)",
    )
    pilot_candidates: bool = key(
        "warmstart.pilot-candidates",
        True,
        _any,
        "`pilot`: the pilot sessions' own models are candidates too (fingerprint: final "
        "minus pilot model; needs P >= 2); false: only averaged into the pilot model, as "
        "the reference does",
    )
    max_stored: int = key(
        "warmstart.max-stored", 10, _at_least(1), "stored session models kept (oldest evicted)"
    )


@dataclass(frozen=True)
class ScreeningConfig:
    """``screening.*``: what one device's reply may do (README "Hostile devices")."""

    max_examples: int = key(
        "screening.max-examples",
        0,
        _at_least(0),
        "the most `num-examples` a reply may claim (0 = `local-steps` x `batch-size`, the "
        "most a device of EdgeFleet's ClientApp sees in a round)",
    )
    norm_factor: float = key(
        "screening.norm-factor",
        NORM_FACTOR,
        _norm_factor,
        "reject an update whose norm is above this many times the round's median (0 = off)",
    )
    norm_floor: float = key(
        "screening.norm-floor",
        NORM_FLOOR,
        _at_least(0),
        "an update at most this share of the global model's norm is never rejected by "
        "`norm-factor` (0 = no floor)",
    )
    device_binding: str = key(
        "screening.device-binding",
        "reconnect",
        _choice(BINDINGS),
        "`reconnect` (a device id moves to a new node once its node is offline) or `strict` "
        "(never; with SuperNode authentication)",
    )


@dataclass(frozen=True)
class RobustConfig:
    """``robust.*``: a robust rule instead of the weighted mean (README "Attackers and
    defences"; :mod:`edgefleet.strategies.robust`)."""

    rule: str = key(
        "robust.rule",
        "off",
        _choice(ROBUST_RULES),
        "`off`, `median`, `trimmed-mean`, `multikrum`, `centered-clip`: in place of the "
        "weighted mean (fedavg, fedprox; under CA-HFP over the devices that kept each "
        "coordinate) or of FedSAG's memory and correction means",
    )
    beta: float = key(
        "robust.beta", 0.2, _trim, "`trimmed-mean`: share cut from each end per coordinate"
    )
    f: int = key("robust.f", 1, _at_least(0), "`multikrum`: attackers tolerated")
    m: int = key("robust.m", 0, _at_least(0), "`multikrum`: replies averaged (0 = replies - f)")
    tau: float = key(
        "robust.tau",
        0.0,
        _at_least(0.0),
        "`centered-clip`: clipping radius in update norm (0 = the median distance each iteration)",
    )
    iterations: int = key("robust.iterations", 3, _at_least(1), "`centered-clip`: iterations")

    def params(self) -> dict[str, Any]:
        """The parameters of the chosen rule, as RobustAggregation and FedSAG take them."""
        return {p: getattr(self, p) for p in RULE_PARAMS[RobustRule(self.rule)]}


@dataclass(frozen=True)
class AttackConfig:
    """``attack.*``: attackers for evaluating defences, Simulation Engine only (EdgeFleet's
    ClientApp; :mod:`edgefleet.attacks`). A deployment run that sets any of them is refused
    before its first round."""

    kind: str = key(
        "attack.kind",
        "off",
        _choice(ATTACK_CHOICES),
        "simulation only: `off`, " + ", ".join(f"`{k}`" for k in ATTACK_KINDS),
    )
    fraction: float = key(
        "attack.fraction",
        0.2,
        _fraction,
        "share of the partitions that attack (at least one; drawn with `seed`)",
    )
    norm_scale: float = key(
        "attack.norm-scale", 1.0, _positive, "`sign-flip`, `stale-poison`: x the honest norm"
    )
    z: float = key(
        "attack.z",
        0.0,
        _finite,
        "`alie`: the shift in standard deviations (0 = Baruch et al.'s z from the fleet size "
        "and the attackers)",
    )
    epsilon: float = key("attack.epsilon", 0.1, _positive, "`ipm`: -epsilon x the honest mean")
    lie: str = key("attack.lie", "resample", _choice(LIES), "`pruned-liar`: `resample`, `shuffle`")
    sybil_ids: tuple[int, ...] = key(
        "attack.sybil-ids",
        "",
        _int_list,
        "`sybil`: the device ids claimed (comma-separated)",
        _ints,
    )
    target: int = key("attack.target", 0, _at_least(0), "`backdoor`: the target class")
    poison_fraction: float = key(
        "attack.poison-fraction",
        0.5,
        _fraction,
        "`backdoor`: share of an attacker's training samples triggered and relabelled "
        "(`label-flip` flips every label)",
    )


AGGREGATION_MODES: tuple[str, ...] = ("sync", "async")


@dataclass(frozen=True)
class AsyncConfig:
    """``aggregation.mode`` and ``async.*``: buffered asynchronous aggregation (FedBuff;
    :mod:`edgefleet.loop.asyncloop`, docs/how-to/async-aggregation.md). In async mode
    ``num-server-rounds`` counts global model versions and ``round-timeout`` bounds one
    device's training."""

    mode: str = key(
        "aggregation.mode",
        "sync",
        _choice(AGGREGATION_MODES),
        "`sync` (rounds with a barrier) or `async` (FedBuff: a new model every "
        "`async.buffer-size` replies, no barrier)",
    )
    concurrency: int = key("async.concurrency", 10, _at_least(1), "async: devices training at once")
    buffer_size: int = key(
        "async.buffer-size", 5, _at_least(1), "async: accepted replies per new global model (K)"
    )
    staleness: str = key(
        "async.staleness",
        "polynomial",
        _choice(STALENESS_FUNCTIONS),
        "async: staleness weight, `polynomial` (1+s)^-a, `constant` 1, `hinge` (1 up to b, "
        "then 1/(a(s-b)+1))",
    )
    staleness_a: float = key(
        "async.staleness-a", 0.5, _at_least(0.0), "async: `a` of the polynomial and hinge weights"
    )
    staleness_b: int = key(
        "async.staleness-b", 4, _at_least(0), "async: `b` of the hinge weight (versions)"
    )
    server_lr: float = key(
        "async.server-lr", 1.0, _positive, "async: server learning rate of each version's step"
    )
    max_staleness: int = key(
        "async.max-staleness",
        0,
        _at_least(0),
        "async: drop replies more than this many versions old (0 = keep all)",
    )

    @property
    def enabled(self) -> bool:
        return self.mode == "async"


@dataclass(frozen=True)
class RunConfig:
    server: ServerConfig
    data: DataConfig
    train: TrainConfig
    energy: EnergyConfig
    stopping: StoppingConfig
    pruning: PruningConfig
    sessions: SessionsConfig
    warmstart: WarmStartConfig
    screening: ScreeningConfig
    robust: RobustConfig
    attack: AttackConfig
    aggregation: AsyncConfig
    seed: int = key("seed", 0, _at_least(0), "seeds partitions, initial model, sampling, batches")

    @property
    def sessions_enabled(self) -> bool:
        s = self.sessions
        return s.schedule != "none" or s.rounds > 0 or self.warmstart.mode != "previous"

    def to_dict(self) -> dict[str, Any]:
        """The resolved config, in the run-config key names, for ``summary.json``."""
        flat: dict[str, Any] = {}
        for spec, owner, f in _walk(self):
            value = getattr(owner, f.name)
            flat[spec.name] = ",".join(str(x) for x in value) if isinstance(value, tuple) else value
        return dict(sorted(flat.items()))


def _walk(cfg: Any = RunConfig) -> Iterator[tuple[KeySpec, Any, Field[Any]]]:
    """(spec, owner, field) for every key, in declaration order; ``owner`` is the section
    instance (or class, when walking the class)."""
    for f in fields(cfg):
        if "spec" in f.metadata:
            yield f.metadata["spec"], cfg, f
        else:
            section = getattr(cfg, f.name) if not isinstance(cfg, type) else f.type
            if isinstance(section, str):  # postponed annotations: resolve the class by name
                section = _SECTIONS[section]
            yield from _walk(section)


_SECTIONS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ServerConfig,
        DataConfig,
        TrainConfig,
        EnergyConfig,
        StoppingConfig,
        PruningConfig,
        SessionsConfig,
        WarmStartConfig,
        ScreeningConfig,
        RobustConfig,
        AttackConfig,
        AsyncConfig,
    )
}

KEYS: dict[str, KeySpec] = {spec.name: spec for spec, _, _ in _walk()}
DEFAULTS: dict[str, Value] = {name: spec.default for name, spec in KEYS.items()}


# What a value of each key type is called in an error (a float key takes any number).
TYPE_NAMES: dict[type, str] = {
    bool: "a boolean (true or false)",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _coerce(spec: KeySpec, value: Any) -> Value:
    """Match the default's type; TOML and ``--run-config`` give ints where floats are meant."""
    want = type(spec.default)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # beyond any float: 10**400
            raise ConfigError(
                f"run config '{spec.name}' = {shown(value)}: must be a finite number"
            ) from None
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(
            f"run config '{spec.name}' = {shown(value)}: must be {TYPE_NAMES[want]} "
            f"(default {_toml(spec.default)})"
        )
    return value


def _toml(value: Value) -> str:
    """A value as it is written in TOML and ``--set`` (``false``, not ``False``)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def close_names(name: str, known: Iterable[str]) -> list[str]:
    """The known names closest to a misspelt ``name`` (best first; ties kept), or none."""
    close = difflib.get_close_matches(name, list(known), n=3)
    ratio = [difflib.SequenceMatcher(None, name, c).ratio() for c in close]
    return [c for c, r in zip(close, ratio, strict=True) if r >= ratio[0] - 0.05]


def unknown_keys_message(what: str, unknown: Iterable[str], known: Iterable[str]) -> str:
    """``unknown WHAT key 'k'; did you mean 'x'?`` (several keys: each with its guess)."""
    known = list(known)
    names = sorted(unknown)
    guesses = {n: " or ".join(repr(c) for c in close_names(n, known)) for n in names}
    if len(names) == 1:
        name, guess = names[0], guesses[names[0]]
        return f"unknown {what} key {name!r}" + (f"; did you mean {guess}?" if guess else "")
    listed = ", ".join(
        f"{n!r}" + (f" (did you mean {g}?)" if g else "") for n, g in guesses.items()
    )
    return f"unknown {what} keys {listed}"


def _build(cls: type, values: Mapping[str, Value]) -> Any:
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if "spec" in f.metadata:
            spec: KeySpec = f.metadata["spec"]
            value = values[spec.name]
            kwargs[f.name] = spec.parse(value) if spec.parse else value
        else:
            kwargs[f.name] = _build(_SECTIONS[str(f.type)], values)
    return cls(**kwargs)


def parse_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """Validate ``raw`` (missing keys take their defaults) and build a :class:`RunConfig`.

    Keys this version does not know are an error too: a typo would otherwise be ignored.
    """
    unknown = set(raw) - set(KEYS)
    if unknown:
        # Suggestions, not the ~90 keys: those are one command away.
        raise ConfigError(
            f"{unknown_keys_message('run-config', unknown, KEYS)} "
            "(`python -m edgefleet.config` lists every key)"
        )
    values: dict[str, Value] = {}
    for name, spec in KEYS.items():
        value = _coerce(spec, raw.get(name, spec.default))
        problem = _bounds(name, value) or spec.check(value)
        if problem:
            raise ConfigError(f"run config '{name}' = {shown(value)}: {problem}")
        values[name] = value
    cfg: RunConfig = _build(RunConfig, values)
    _check_together(cfg)
    _check_harvest(values)
    _check_async(cfg)
    return cfg


def markdown_table() -> str:
    """The README's table of every key, its default and its meaning."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for spec in KEYS.values():
        default = spec.default
        shown = str(default).lower() if isinstance(default, bool) else default
        text = f'`"{shown}"`' if isinstance(default, str) else f"{shown}"
        lines.append(f"| `{spec.name}` | {text} | {spec.help} |")
    return "\n".join(lines) + "\n"


def _check_harvest(values: Mapping[str, Value]) -> None:
    """A per-partition list would silently win over a single P_h, so a run that sets both is
    refused. Flower hands every key, its default included, so "sets" means "differs from the
    default": an explicit 0.5 beside a list cannot be told apart and the list applies."""
    prob, probs = values["energy.harvest-prob"], values["energy.harvest-probs"]
    if probs and prob != KEYS["energy.harvest-prob"].default:
        raise ConfigError(
            f"run config 'energy.harvest-prob' = {prob!r} with 'energy.harvest-probs' = "
            f"{probs!r}: the per-partition list wins, so {prob!r} would not be used; set "
            f'energy.harvest-probs = "" to give every device {prob!r}, or put the rates in '
            "energy.harvest-probs alone"
        )


def attack_keys_set(raw: Mapping[str, Any]) -> list[str]:
    """The ``attack.*`` keys of ``raw`` whose value differs from the default (Flower hands
    every key, defaults included, so a key at its default cannot be told from an absent one)."""
    return sorted(
        k for k, v in raw.items() if k.startswith("attack.") and k in KEYS and v != KEYS[k].default
    )


def _check_together(cfg: RunConfig) -> None:
    """Rules that involve more than one key."""
    s = cfg.sessions
    if s.schedule == SessionSchedule.ALTERNATE:
        if s.rounds < 1:
            raise ConfigError(
                "run config 'sessions.rounds' = 0: must be >= 1 with sessions.schedule = "
                "'alternate' (the length of each session)"
            )
        if cfg.server.num_rounds != s.count * s.rounds:
            raise ConfigError(
                f"run config 'num-server-rounds' = {cfg.server.num_rounds}: must equal "
                f"sessions.count x sessions.rounds = {s.count} x {s.rounds} = "
                f"{s.count * s.rounds} with sessions.schedule = 'alternate'"
            )
    if cfg.sessions_enabled and cfg.stopping.mode in ("validation", "observe"):
        raise ConfigError(
            f"run config 'stopping.mode' = {cfg.stopping.mode!r}: the validation baseline "
            "cannot run within sessions; use 'data-free' or 'off'"
        )
    e = cfg.energy
    if e.status_max_age and e.selection != "energy-age":
        raise ConfigError(
            f"run config 'selection.status-max-age' = {e.status_max_age!r} with selection.mode "
            f"= {e.selection!r}: it is energy-age selection's; set selection.mode = "
            "'energy-age' or selection.status-max-age = 0"
        )
    if e.deadline and e.selection != "energy-age":
        raise ConfigError(
            f"run config 'selection.deadline' = {e.deadline!r} with selection.mode = "
            f"{e.selection!r}: the deadline is energy-age selection's; set selection.mode = "
            "'energy-age' or selection.deadline = 0"
        )
    if (
        e.selection == SelectionMode.ENERGY_AGE
        and e.source != SourceKind.ALWAYS_ON
        and e.capacity < e.round_cost
    ):
        raise ConfigError(
            f"run config 'energy.capacity' = {e.capacity}: below one round's cost "
            f"{e.round_cost:g} (energy.train-slots + 1), so no device could ever train"
        )
    _check_baselines(cfg)
    p = cfg.pruning
    if p.reconstruction == "elementwise" and cfg.server.strategy not in ("fedavg", "fedprox"):
        raise ConfigError(
            f"run config 'pruning.reconstruction' = 'elementwise' with strategy = "
            f"{cfg.server.strategy!r}: the per-entry average replaces a plain weighted mean; "
            "use strategy 'fedavg' or 'fedprox', or reconstruction 'global' or 'zeros'"
        )
    if cfg.robust.rule != "off" and p.reconstruction == "elementwise":
        raise ConfigError(
            f"run config 'robust.rule' = {cfg.robust.rule!r} with 'pruning.reconstruction' = "
            "'elementwise': the per-entry mean would replace the rule; use reconstruction "
            "'global' (the rule then works over the devices that kept each entry)"
        )
    a = cfg.attack
    if a.kind == "sybil" and not a.sybil_ids:
        raise ConfigError(
            "run config 'attack.kind' = 'sybil': needs 'attack.sybil-ids', the device ids the "
            "attacker claims (e.g. '100,101')"
        )
    w = cfg.warmstart
    if cfg.train.lr_schedule == LrSchedule.SESSION_POLY and not (cfg.sessions_enabled and s.rounds):
        raise ConfigError(
            "run config 'lr-schedule' = 'session-poly': needs sessions of a known length "
            "(sessions.rounds >= 1); use 'constant' or set sessions.rounds"
        )
    if w.mode == "pilot" and s.rounds and w.aux_rounds >= s.rounds:
        raise ConfigError(
            f"run config 'warmstart.aux-rounds' = {w.aux_rounds}: must be below "
            f"sessions.rounds = {s.rounds}, or no round of a session is left to train"
        )


def _check_baselines(cfg: RunConfig) -> None:
    """MIFA and FedVARP fix FedSAG's form; FedRolex's window moves every round; SCAFFOLD's
    correction fits only the full model and replaces the aggregation a robust rule would."""
    srv, strategy = cfg.server, cfg.server.strategy
    if strategy in ("mifa", "fedvarp"):
        form = ("saga.init", "saga.estimator", "saga.memory-mean", "saga.correction")
        values = (srv.saga_init, srv.saga_estimator, srv.saga_memory_mean, srv.saga_correction)
        changed = [k for k, v in zip(form, values, strict=True) if v != KEYS[k].default]
        if changed:
            raise ConfigError(
                f"run config {', '.join(repr(k) for k in changed)} with strategy = "
                f"{strategy!r}: {strategy} fixes FedSAG's form; use strategy 'fedsag' to "
                "choose it, or leave these keys at their defaults"
            )
    p = cfg.pruning
    if p.criterion == "rolling" and p.compact_download:
        raise ConfigError(
            "run config 'pruning.criterion' = 'rolling' with pruning.compact-download = true: "
            "FedRolex's window moves every round, the compact download sends last round's "
            "slice; set pruning.compact-download = false"
        )
    if p.criterion == "ordered-dropout":
        clash = []
        if p.compact_download:
            clash.append("pruning.compact-download = true (the device needs the full model)")
        if strategy in ("fedprox", "scaffold"):
            clash.append(f"strategy = {strategy!r} (its local term)")
        if cfg.sessions_enabled and cfg.warmstart.mode == "continuous":
            clash.append("warmstart.mode = 'continuous' (its distillation term)")
        if clash:
            raise ConfigError(
                "run config 'pruning.criterion' = 'ordered-dropout' with "
                + "; ".join(clash)
                + ": FjORD's local steps are plain SGD steps on nested widths"
            )
    if strategy == "scaffold":
        if p.keep_ratio < 1 or any(r < 1 for r in p.keep_ratios):
            raise ConfigError(
                "run config strategy = 'scaffold' with pruning.keep-ratio(s) below 1: "
                "SCAFFOLD's correction is a full-size model and fits no pruned submodel; "
                "use keep ratio 1 or another strategy"
            )
        if cfg.robust.rule != "off":
            raise ConfigError(
                f"run config 'robust.rule' = {cfg.robust.rule!r} with strategy = 'scaffold': "
                "SCAFFOLD's step updates its control variates from the same mean the rule "
                "would replace; use robust.rule = 'off' or another strategy"
            )


def _check_async(cfg: RunConfig) -> None:
    """What asynchronous aggregation does not support yet is refused before the run starts,
    naming the key (docs/how-to/async-aggregation.md says why each is not there yet)."""
    if not cfg.aggregation.enabled:
        return
    p = cfg.pruning
    refused = {
        "selection.mode = 'energy-age'": (
            cfg.energy.selection == SelectionMode.ENERGY_AGE,
            "energy-age selection picks a round's devices from one status query; the "
            "asynchronous loop starts devices one at a time as slots free",
        ),
        "pruning.keep-ratio(s) < 1 (CA-HFP)": (
            p.keep_ratio < 1 or any(r < 1 for r in p.keep_ratios),
            "submodel reconstruction against the model version each submodel was cut from "
            "is not wired into the asynchronous loop",
        ),
        "sessions (sessions.schedule, sessions.rounds or warmstart.mode)": (
            cfg.sessions_enabled,
            "session boundaries and warm start are defined between synchronous rounds",
        ),
        f"stopping.mode = {cfg.stopping.mode!r}": (
            cfg.stopping.mode in (StoppingMode.VALIDATION, StoppingMode.OBSERVE),
            "the validation baseline's best-round model is not kept across versions; "
            "'data-free' and 'off' work",
        ),
        "strategy = 'scaffold'": (
            cfg.server.strategy == "scaffold",
            "SCAFFOLD's control variates are updated from one synchronous round's replies, "
            "all made from the same model; a stale reply's correction does not hold",
        ),
        f"fraction-evaluate = {cfg.server.fraction_evaluate!r}": (
            cfg.server.fraction_evaluate > 0,
            "federated evaluation needs a round barrier; use central evaluation",
        ),
    }
    for what, (hit, why) in refused.items():
        if hit:
            raise ConfigError(
                f"run config: aggregation.mode = 'async' does not yet support {what}: {why}. "
                "Use aggregation.mode = 'sync' for it, or turn it off"
            )


if __name__ == "__main__":  # python -m edgefleet.config: print the README's key table
    print(markdown_table(), end="")
