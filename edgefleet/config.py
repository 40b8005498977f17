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
from dataclasses import asdict, dataclass
from typing import Any

from edgefleet.client.battery import SOURCES
from edgefleet.strategies.saga import SAGA_INITS
from edgefleet.task.data import DATASETS, PARTITIONS
from edgefleet.task.names import MODELS

STRATEGIES: tuple[str, ...] = ("fedavg", "fedprox", "fedsag")
SELECTIONS: tuple[str, ...] = ("all", "energy-age")
# "observe" records both rules' signals every round and never stops (for benchmarks).
STOPPING_MODES: tuple[str, ...] = ("off", "data-free", "validation", "observe")
STOPPING_NORMS: tuple[str, ...] = ("l2", "squared")

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
    "node-wait-timeout": 120.0,
    "output-dir": "runs",
    "run-name": "",
    "server-lr": 1.0,
    "saga.init": "zeros",
    "selection.mode": "all",
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
}


class ConfigError(ValueError):
    """A run-config value is invalid; the message names the key, value and valid choices."""


@dataclass(frozen=True)
class DataConfig:
    dataset: str
    data_dir: str
    partition: str
    alpha: float
    shards_per_device: int
    local_test_fraction: float


@dataclass(frozen=True)
class TrainConfig:
    model: str
    lr: float
    momentum: float
    batch_size: int
    local_steps: int
    proximal_mu: float
    client_threads: int


@dataclass(frozen=True)
class ServerConfig:
    num_rounds: int
    strategy: str
    fraction_train: float
    min_nodes: int
    round_timeout: float
    node_wait_timeout: float
    output_dir: str
    run_name: str
    server_lr: float
    saga_init: str


@dataclass(frozen=True)
class EnergyConfig:
    """``selection.*``, ``energy.*``: EH-FedSAG's batteries and energy-aware selection.

    ``harvest_probs`` (simulation) gives partition i the probability
    ``harvest_probs[i % len]``; a SuperNode's ``--node-config harvest-prob=...`` overrides it.
    """

    selection: str
    max_devices: int
    batch_size: int
    source: str
    capacity: float
    harvest_prob: float
    harvest_probs: tuple[float, ...]
    harvest_units: float
    train_slots: int

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

    mode: str
    tau: float
    patience: int
    norm: str
    validation_fraction: float


@dataclass(frozen=True)
class RunConfig:
    data: DataConfig
    train: TrainConfig
    server: ServerConfig
    energy: EnergyConfig
    stopping: StoppingConfig
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """The resolved config, in the run-config key names, for ``summary.json``."""
        flat: dict[str, Any] = {"seed": self.seed}
        for prefix, section in (
            ("", self.data),
            ("", self.train),
            ("", self.server),
            ("energy.", self.energy),
            ("stopping.", self.stopping),
        ):
            flat.update({prefix + k.replace("_", "-"): v for k, v in asdict(section).items()})
        flat["num-server-rounds"] = flat.pop("num-rounds")
        flat["saga.init"] = flat.pop("saga-init")
        flat["energy.harvest-probs"] = ",".join(str(p) for p in self.energy.harvest_probs)
        for key in ("selection", "max-devices", "batch-size"):
            flat[f"selection.{'mode' if key == 'selection' else key}"] = flat.pop(f"energy.{key}")
        return dict(sorted(flat.items()))


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
    "node-wait-timeout": _at_least(0.0),
    "output-dir": lambda v: None if v else "must not be empty",
    "run-name": lambda v: None if "/" not in v else "must not contain '/'",
    "server-lr": _positive,
    "saga.init": _choice(SAGA_INITS),
    "selection.mode": _choice(SELECTIONS),
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
    return RunConfig(
        data=DataConfig(
            dataset=v["dataset"],
            data_dir=v["data-dir"],
            partition=v["partition"],
            alpha=v["alpha"],
            shards_per_device=v["shards-per-device"],
            local_test_fraction=v["local-test-fraction"],
        ),
        train=TrainConfig(
            model=v["model"],
            lr=v["lr"],
            momentum=v["momentum"],
            batch_size=v["batch-size"],
            local_steps=v["local-steps"],
            proximal_mu=v["proximal-mu"],
            client_threads=v["client-threads"],
        ),
        server=ServerConfig(
            num_rounds=v["num-server-rounds"],
            strategy=v["strategy"],
            fraction_train=v["fraction-train"],
            min_nodes=v["min-nodes"],
            round_timeout=v["round-timeout"],
            node_wait_timeout=v["node-wait-timeout"],
            output_dir=v["output-dir"],
            run_name=v["run-name"],
            server_lr=v["server-lr"],
            saga_init=v["saga.init"],
        ),
        energy=EnergyConfig(
            selection=v["selection.mode"],
            max_devices=v["selection.max-devices"],
            batch_size=v["selection.batch-size"],
            source=v["energy.source"],
            capacity=v["energy.capacity"],
            harvest_prob=v["energy.harvest-prob"],
            harvest_probs=tuple(
                float(x) for x in v["energy.harvest-probs"].split(",") if x.strip()
            ),
            harvest_units=v["energy.harvest-units"],
            train_slots=v["energy.train-slots"],
        ),
        stopping=StoppingConfig(
            mode=v["stopping.mode"],
            tau=v["stopping.tau"],
            patience=v["stopping.patience"],
            norm=v["stopping.norm"],
            validation_fraction=v["stopping.validation-fraction"],
        ),
        seed=v["seed"],
    )
