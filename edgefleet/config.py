"""Run config: the flat ``key = value`` table Flower hands to both apps, parsed once.

Flower passes ``context.run_config`` as a flat mapping (``pyproject.toml``'s
``[tool.flwr.app.config]`` fused with ``--run-config`` overrides). :func:`parse_run_config`
turns it into a frozen :class:`RunConfig` and rejects every bad value before any work is
spent, naming the key, the value and what would have been valid.

``DEFAULTS`` is the single source of the defaults; ``tests/test_config.py`` checks that the
``pyproject.toml`` table says the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from edgefleet.client.battery import SOURCES
from edgefleet.pruning.names import CRITERIA, HESSIAN_ESTIMATORS, RECONSTRUCTIONS
from edgefleet.strategies.saga import SAGA_CORRECTIONS, SAGA_ESTIMATORS, SAGA_INITS, SAGA_MEANS
from edgefleet.strategies.selection import SELECTION_ORDERS
from edgefleet.strategies.warmstart import WARMSTART_MODES
from edgefleet.task.data import DATASETS, PARTITIONS
from edgefleet.task.names import MODELS

STRATEGIES: tuple[str, ...] = ("fedavg", "fedprox", "fedsag")
SELECTIONS: tuple[str, ...] = ("all", "energy-age")
# "observe" records both rules' signals every round and never stops (for benchmarks).
STOPPING_MODES: tuple[str, ...] = ("off", "data-free", "validation", "observe")
STOPPING_NORMS: tuple[str, ...] = ("l2", "squared")
SESSION_SCHEDULES: tuple[str, ...] = ("none", "alternate")

DEFAULTS: dict[str, bool | int | float | str] = {
    "num-server-rounds": 5,
    "strategy": "fedavg",
    "proximal-mu": 0.01,
    "fraction-train": 1.0,
    "min-nodes": 2,
    "dataset": "mnist-5k",
    "data-dir": "",
    "partition": "dirichlet",
    "alpha": 0.5,
    "shards-per-device": 2,
    "local-test-fraction": 0.2,
    "model": "smallcnn",
    "lr": 0.05,
    "momentum": 0.9,
    "batch-size": 32,
    "local-steps": 20,
    "client-threads": 1,
    "seed": 0,
    "round-timeout": 600.0,
    "eval-samples": 0,
    "node-wait-timeout": 120.0,
    "output-dir": "runs",
    "run-name": "",
    "resume": False,
    "server-lr": 1.0,
    "saga.init": "zeros",
    "saga.estimator": "saga",
    "saga.memory-mean": "fleet",
    "saga.correction": "channels",
    "selection.mode": "all",
    "selection.order": "age",
    "selection.max-devices": 25,
    "selection.batch-size": 0,
    "energy.source": "bernoulli",
    "energy.capacity": 10.0,
    "energy.harvest-prob": 0.5,
    "energy.harvest-probs": "",
    "energy.harvest-units": 1.0,
    "energy.train-slots": 3,
    "stopping.mode": "off",
    "stopping.tau": 0.005,
    "stopping.patience": 10,
    "stopping.norm": "l2",
    "stopping.validation-fraction": 0.5,
    "pruning.keep-ratio": 1.0,
    "pruning.keep-ratios": "",
    "pruning.criterion": "curvature",
    "pruning.hessian": "fisher",
    "pruning.score-batches": 2,
    "pruning.reconstruction": "global",
    "pruning.compact-download": False,
    "pruning.refresh-rounds": 5,
    "sessions.schedule": "none",
    "sessions.count": 1,
    "sessions.rounds": 0,
    "sessions.groups": 2,
    "sessions.label-overlap": 0.0,
    "sessions.change-threshold": 0.2,
    "sessions.target-accuracy": 0.8,
    "warmstart.mode": "previous",
    "warmstart.pilot-sessions": 1,
    "warmstart.aux-rounds": 1,
    "warmstart.temperature": 10.0,
    "warmstart.max-stored": 10,
}


class ConfigError(ValueError):
    """A run-config value is invalid; the message names the key, value and valid choices."""


def _key(name: str, parse: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field read from run-config key ``name`` (through ``parse`` if given)."""
    return field(metadata={"key": name, "parse": parse})


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _key("dataset")
    data_dir: str = _key("data-dir")
    partition: str = _key("partition")
    alpha: float = _key("alpha")
    shards_per_device: int = _key("shards-per-device")
    local_test_fraction: float = _key("local-test-fraction")


@dataclass(frozen=True)
class TrainConfig:
    model: str = _key("model")
    lr: float = _key("lr")
    momentum: float = _key("momentum")
    batch_size: int = _key("batch-size")
    local_steps: int = _key("local-steps")
    proximal_mu: float = _key("proximal-mu")
    client_threads: int = _key("client-threads")


@dataclass(frozen=True)
class ServerConfig:
    num_rounds: int = _key("num-server-rounds")
    strategy: str = _key("strategy")
    fraction_train: float = _key("fraction-train")
    min_nodes: int = _key("min-nodes")
    round_timeout: float = _key("round-timeout")
    eval_samples: int = _key("eval-samples")
    node_wait_timeout: float = _key("node-wait-timeout")
    output_dir: str = _key("output-dir")
    run_name: str = _key("run-name")
    resume: bool = _key("resume")
    server_lr: float = _key("server-lr")
    saga_init: str = _key("saga.init")
    saga_estimator: str = _key("saga.estimator")
    saga_memory_mean: str = _key("saga.memory-mean")
    saga_correction: str = _key("saga.correction")


@dataclass(frozen=True)
class EnergyConfig:
    """``selection.*``, ``energy.*``: EH-FedSAG's batteries and energy-aware selection.

    ``harvest_probs`` (simulation) gives partition i the probability
    ``harvest_probs[i % len]``; a SuperNode's ``--node-config harvest-prob=...`` overrides it.
    """

    selection: str = _key("selection.mode")
    order: str = _key("selection.order")
    max_devices: int = _key("selection.max-devices")
    batch_size: int = _key("selection.batch-size")
    source: str = _key("energy.source")
    capacity: float = _key("energy.capacity")
    harvest_prob: float = _key("energy.harvest-prob")
    harvest_probs: tuple[float, ...] = _key("energy.harvest-probs", _floats)
    harvest_units: float = _key("energy.harvest-units")
    train_slots: int = _key("energy.train-slots")

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

    mode: str = _key("stopping.mode")
    tau: float = _key("stopping.tau")
    patience: int = _key("stopping.patience")
    norm: str = _key("stopping.norm")
    validation_fraction: float = _key("stopping.validation-fraction")


@dataclass(frozen=True)
class PruningConfig:
    """``pruning.*``: CA-HFP's resource classes and curvature-aware structured pruning.

    ``keep_ratios`` (simulation) gives partition i the keep ratio ``keep_ratios[i % len]``;
    a SuperNode's ``--node-config keep-ratio=...`` overrides both.
    """

    keep_ratio: float = _key("pruning.keep-ratio")
    keep_ratios: tuple[float, ...] = _key("pruning.keep-ratios", _floats)
    criterion: str = _key("pruning.criterion")
    hessian: str = _key("pruning.hessian")
    score_batches: int = _key("pruning.score-batches")
    reconstruction: str = _key("pruning.reconstruction")
    compact_download: bool = _key("pruning.compact-download")
    refresh_rounds: int = _key("pruning.refresh-rounds")

    def ratio_for(self, partition_id: int) -> float:
        if self.keep_ratios:
            return self.keep_ratios[partition_id % len(self.keep_ratios)]
        return self.keep_ratio

    @property
    def enabled(self) -> bool:
        return self.keep_ratio < 1.0 or any(r < 1.0 for r in self.keep_ratios)


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

    schedule: str = _key("sessions.schedule")
    count: int = _key("sessions.count")
    rounds: int = _key("sessions.rounds")
    groups: int = _key("sessions.groups")
    label_overlap: float = _key("sessions.label-overlap")
    change_threshold: float = _key("sessions.change-threshold")
    target_accuracy: float = _key("sessions.target-accuracy")


@dataclass(frozen=True)
class WarmStartConfig:
    """``warmstart.*``: how each new session's initial model is built (arXiv 2410.05662)."""

    mode: str = _key("warmstart.mode")
    pilot_sessions: int = _key("warmstart.pilot-sessions")
    aux_rounds: int = _key("warmstart.aux-rounds")
    temperature: float = _key("warmstart.temperature")
    max_stored: int = _key("warmstart.max-stored")


@dataclass(frozen=True)
class RunConfig:
    data: DataConfig
    train: TrainConfig
    server: ServerConfig
    energy: EnergyConfig
    stopping: StoppingConfig
    pruning: PruningConfig
    sessions: SessionsConfig
    warmstart: WarmStartConfig
    seed: int

    @property
    def sessions_enabled(self) -> bool:
        s = self.sessions
        return s.schedule != "none" or s.rounds > 0 or self.warmstart.mode != "previous"

    def to_dict(self) -> dict[str, Any]:
        """The resolved config, in the run-config key names, for ``summary.json``."""
        flat: dict[str, Any] = {"seed": self.seed}
        for section in _sections(self):
            for f in fields(section):
                value = getattr(section, f.name)
                if isinstance(value, tuple):
                    value = ",".join(str(x) for x in value)
                flat[f.metadata["key"]] = value
        return dict(sorted(flat.items()))


def _sections(cfg: RunConfig) -> list[Any]:
    return [getattr(cfg, f.name) for f in fields(cfg) if f.name != "seed"]


# A check returns None when the value is fine, else the text "must be ..." for the error.
Check = Callable[[Any], str | None]


def _choice(options: tuple[str, ...]) -> Check:
    return lambda v: None if v in options else f"must be one of {', '.join(options)}"


def _at_least(low: float) -> Check:
    return lambda v: None if v >= low else f"must be >= {low}"


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _fraction(v: Any) -> str | None:
    return None if 0.0 < v <= 1.0 else "must be in (0, 1]"


def _half_open_fraction(v: Any) -> str | None:
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def _any(_: Any) -> str | None:
    return None


def _probability_list(v: str) -> str | None:
    try:
        probs = [float(x) for x in v.split(",") if x.strip()]
    except ValueError:
        return "must be comma-separated numbers, e.g. '0.1,0.5,0.9'"
    return None if all(0.0 <= p <= 1.0 for p in probs) else "each value must be in [0, 1]"


def _fraction_list(v: str) -> str | None:
    try:
        values = _floats(v)
    except ValueError:
        return "must be comma-separated numbers, e.g. '1.0,0.75,0.5,0.25'"
    return None if all(0.0 < x <= 1.0 for x in values) else "each value must be in (0, 1]"


_CHECKS: dict[str, Check] = {
    "num-server-rounds": _at_least(1),
    "strategy": _choice(STRATEGIES),
    "proximal-mu": _at_least(0.0),
    "fraction-train": _fraction,
    "min-nodes": _at_least(1),
    "dataset": _choice(DATASETS),
    "data-dir": _any,
    "partition": _choice(PARTITIONS),
    "alpha": _positive,
    "shards-per-device": _at_least(1),
    "local-test-fraction": _half_open_fraction,
    "model": _choice(MODELS),
    "lr": _positive,
    "momentum": _half_open_fraction,
    "batch-size": _at_least(1),
    "local-steps": _at_least(1),
    "client-threads": _at_least(1),
    "seed": _at_least(0),
    "round-timeout": _positive,
    "eval-samples": _at_least(0),
    "node-wait-timeout": _at_least(0.0),
    "output-dir": lambda v: None if v else "must not be empty",
    "run-name": lambda v: None if "/" not in v else "must not contain '/'",
    "resume": _any,
    "server-lr": _positive,
    "saga.init": _choice(SAGA_INITS),
    "saga.estimator": _choice(SAGA_ESTIMATORS),
    "saga.memory-mean": _choice(SAGA_MEANS),
    "saga.correction": _choice(SAGA_CORRECTIONS),
    "selection.mode": _choice(SELECTIONS),
    "selection.order": _choice(SELECTION_ORDERS),
    "selection.max-devices": _at_least(1),
    "selection.batch-size": _at_least(0),
    "energy.source": _choice(SOURCES),
    "energy.capacity": _positive,
    "energy.harvest-prob": lambda v: None if 0.0 <= v <= 1.0 else "must be in [0, 1]",
    "energy.harvest-probs": _probability_list,
    "energy.harvest-units": _at_least(0.0),
    "energy.train-slots": _at_least(1),
    "stopping.mode": _choice(STOPPING_MODES),
    "stopping.tau": _at_least(0.0),
    "stopping.patience": _at_least(1),
    "stopping.norm": _choice(STOPPING_NORMS),
    "stopping.validation-fraction": lambda v: None if 0.0 < v < 1.0 else "must be in (0, 1)",
    "pruning.keep-ratio": _fraction,
    "pruning.keep-ratios": _fraction_list,
    "pruning.criterion": _choice(CRITERIA),
    "pruning.hessian": _choice(HESSIAN_ESTIMATORS),
    "pruning.score-batches": _at_least(1),
    "pruning.reconstruction": _choice(RECONSTRUCTIONS),
    "pruning.compact-download": _any,
    "pruning.refresh-rounds": _at_least(1),
    "sessions.schedule": _choice(SESSION_SCHEDULES),
    "sessions.count": _at_least(1),
    "sessions.rounds": _at_least(0),
    "sessions.groups": _at_least(1),
    "sessions.label-overlap": lambda v: None if 0.0 <= v <= 1.0 else "must be in [0, 1]",
    "sessions.change-threshold": _half_open_fraction,
    "sessions.target-accuracy": _fraction,
    "warmstart.mode": _choice(WARMSTART_MODES),
    "warmstart.pilot-sessions": _at_least(1),
    "warmstart.aux-rounds": _at_least(1),
    "warmstart.temperature": _positive,
    "warmstart.max-stored": _at_least(1),
}


def _coerce(key: str, value: Any) -> bool | int | float | str:
    """Match the default's type; TOML and ``--run-config`` give ints where floats are meant."""
    want = type(DEFAULTS[key])
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(
            f"run config '{key}' = {value!r}: must be a {want.__name__} (default {DEFAULTS[key]!r})"
        )
    return value


def parse_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """Validate ``raw`` (missing keys take their defaults) and build a :class:`RunConfig`.

    Keys this version does not know are an error too: a typo would otherwise be ignored.
    """
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise ConfigError(
            f"unknown run config key(s) {', '.join(unknown)}; valid keys: {', '.join(DEFAULTS)}"
        )
    v: dict[str, Any] = {}
    for key, default in DEFAULTS.items():
        value = _coerce(key, raw.get(key, default))
        problem = _CHECKS[key](value)
        if problem:
            raise ConfigError(f"run config '{key}' = {value!r}: {problem}")
        v[key] = value
    built: dict[str, Any] = {}
    for name, cls in _SECTION_TYPES.items():
        kwargs = {}
        for f in fields(cls):
            parse = f.metadata["parse"]
            value = v[f.metadata["key"]]
            kwargs[f.name] = parse(value) if parse else value
        built[name] = cls(**kwargs)
    cfg = RunConfig(**built, seed=v["seed"])
    _check_together(cfg)
    return cfg


_SECTION_TYPES: dict[str, type] = {
    "data": DataConfig,
    "train": TrainConfig,
    "server": ServerConfig,
    "energy": EnergyConfig,
    "stopping": StoppingConfig,
    "pruning": PruningConfig,
    "sessions": SessionsConfig,
    "warmstart": WarmStartConfig,
}


def _check_together(cfg: RunConfig) -> None:
    """Rules that involve more than one key."""
    s = cfg.sessions
    if s.schedule == "alternate":
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
    if e.selection == "energy-age" and e.source != "always-on" and e.capacity < e.round_cost:
        raise ConfigError(
            f"run config 'energy.capacity' = {e.capacity}: below one round's cost "
            f"{e.round_cost:g} (energy.train-slots + 1), so no device could ever train"
        )
    p = cfg.pruning
    if p.reconstruction == "elementwise" and cfg.server.strategy not in ("fedavg", "fedprox"):
        raise ConfigError(
            f"run config 'pruning.reconstruction' = 'elementwise' with strategy = "
            f"{cfg.server.strategy!r}: the per-entry average replaces a plain weighted mean; "
            "use strategy 'fedavg' or 'fedprox', or reconstruction 'global' or 'zeros'"
        )
    w = cfg.warmstart
    if w.mode == "pilot" and s.rounds and w.aux_rounds >= s.rounds:
        raise ConfigError(
            f"run config 'warmstart.aux-rounds' = {w.aux_rounds}: must be below "
            f"sessions.rounds = {s.rounds}, or no round of a session is left to train"
        )
