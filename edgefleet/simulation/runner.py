"""Run named experiments (scenario TOML files) on Flower's Simulation Engine, and clean up.

``edgefleet run scenarios/X.toml`` does what ``flwr run .`` does, with differences that
matter for experiments:

- the run config, the federation values and the data set's presence are checked before any
  Flower process starts (a bad value or a missing file is reported in seconds, not after a
  minute of start-up);
- every run gets its own SuperLink on a free port, its own ``FLWR_HOME`` and its own Ray
  cluster (a private temp dir and free ports), so runs, tests and benchmarks can go on side by
  side, and nothing is left behind (see :mod:`edgefleet.processes`);
- the Ray cluster starts first, beside the SuperLink: by the time Flower's Simulation Engine
  calls ``ray.init`` it only connects (``--ray-address`` uses a cluster you already have
  instead, e.g. one spread over several machines);
- when the run fails, the ServerApp's own error (its message and the last lines of its
  traceback) is what the command prints, and ``flower.log`` in the run folder keeps the
  ServerApp's log and the SuperLink's;
- an interrupted run (Ctrl-C, SIGTERM) stops every process and says how to resume.

An :class:`Engine` (one SuperLink, one Ray cluster) runs any number of runs one after the
other: a sweep (:mod:`edgefleet.simulation.sweep`) starts it once.

A scenario file has two tables::

    [federation]            # Flower's --federation-config keys
    num-supernodes = 10
    client-resources-num-cpus = 1

    [run-config]            # any key of pyproject.toml's [tool.flwr.app.config]
    num-server-rounds = 10
"""

from __future__ import annotations

import contextlib
import sys
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefleet.config import (
    DEFAULTS,
    ConfigError,
    RunConfig,
    SessionSchedule,
    parse_run_config,
    shown,
    unknown_keys_message,
)
from edgefleet.simulation.engine import (  # noqa: F401 - the runner's public names
    MAX_RAY_CPUS,
    MAX_RAY_GPUS,
    RAY_ADDRESS_WITH_SIZES,
    Engine,
    Interrupted,
    RunFailed,
    app_copy,
    resume_hint,
    serverapp_error,
)
from edgefleet.simulation.progress import display_mode
from edgefleet.task.accelerator import AcceleratorError, simulation_gpu_share

if TYPE_CHECKING:
    from edgefleet.simulation.inprocess import InProcessEngine

# Flower's Simulation Engine (Ray; the default, and the way to a Ray cluster), or EdgeFleet's
# in-process engine (edgefleet.simulation.inprocess: the same ServerApp, no Ray).
ENGINES = ("simulation", "inprocess")


def check_engine(engine: str, ray_address: str | None, workers: int | None) -> None:
    """``engine`` is one of :data:`~edgefleet.simulation.runner.ENGINES`, and the options
    given are that engine's: a Ray cluster for Flower's, worker processes for the other."""
    if engine not in ENGINES:
        raise ConfigError(f"engine {engine!r}: valid choices: {', '.join(ENGINES)}")
    if engine == "inprocess" and ray_address is not None:
        raise ConfigError(
            "--ray-address runs the ClientApps on a Ray cluster: that is the simulation "
            "engine's (--engine simulation); the in-process engine uses --workers"
        )
    if workers is not None and engine != "inprocess":
        raise ConfigError(
            f"--workers {workers} sizes the in-process engine's worker pool: add "
            "--engine inprocess (Flower's engine has one Ray actor per "
            "client-resources-num-cpus of the cluster instead)"
        )
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers {workers}: must be at least 1")


# Upper bounds (docs/reference/config-limits.md): above them a value is a typo, and it costs
# before it fails: 10^9 supernodes took 21.5 GB and were killed for memory. The Simulation
# Engine keeps a Python object per node and the server a registry row per device; 100,000 is
# far above any fleet simulated here (the largest benchmark has 1,000).
MAX_SUPERNODES = 100_000


def _int_between(low: int, high: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        ok = isinstance(v, int) and not isinstance(v, bool) and low <= v <= high
        return None if ok else f"must be an integer in [{low}, {high:,}]"

    return check


def _number_between(low: float, high: float) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and low <= v <= high
        return None if ok else f"must be a number in [{low}, {high:,}]"

    return check


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def _log_level(v: Any) -> str | None:
    levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    return None if v in levels else f"must be one of {', '.join(levels)}"


# Flower 1.42's simulation federation config (flwr/proto/federation_config.proto), with the
# types its fields have there: an integer field given "1.0" or "lots" fails inside Flower,
# about a minute into the start-up.
FEDERATION_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "num-supernodes": _int_between(1, MAX_SUPERNODES),
    "client-resources-num-cpus": _int_between(1, MAX_RAY_CPUS),
    "client-resources-num-gpus": _number_between(0, MAX_RAY_GPUS),
    "init-args-num-cpus": _int_between(1, MAX_RAY_CPUS),
    "init-args-num-gpus": _int_between(0, MAX_RAY_GPUS),
    "init-args-logging-level": _log_level,
    "init-args-log-to-driver": _bool,
    "backend": lambda v: None if v == "ray" else "must be ray",
    "verbose": _bool,
}
FEDERATION_KEYS = tuple(FEDERATION_CHECKS)
# Sizes of the Ray cluster itself: they go to the cluster the runner starts, never to
# Flower's ray.init (which refuses them when it connects to a running cluster).
RAY_CLUSTER_KEYS = ("init-args-num-cpus", "init-args-num-gpus")


@dataclass(frozen=True)
class Scenario:
    name: str
    federation: dict[str, Any] = field(default_factory=dict)
    run_config: dict[str, Any] = field(default_factory=dict)


# A scenario file is a few hundred bytes of settings; one of megabytes is not one.
MAX_SCENARIO_BYTES = 1 << 20
# [run-config.a.b] nests tables three deep; tables nested deeper than this hold no setting.
MAX_DEPTH = 16


def parse_value(text: str) -> Any:
    """A ``--set key=value`` value as TOML would read it (``0.1``, ``true``, ``"x"``); a bare
    word that is not TOML is taken as a string, so ``--set dataset=mnist`` works. A value
    nested so deep that TOML's parser (recursive) meets Python's recursion limit is a
    :class:`ConfigError`."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError(f"value {shown(text, 40)} nests arrays or tables too deep") from None


def load_scenario(path: str | Path, overrides: Mapping[str, Any] = {}) -> Scenario:
    """Read a scenario file and apply ``--set`` overrides (``federation.KEY`` or run-config).
    Whatever the file holds, the outcome is a scenario or a :class:`ConfigError` naming the
    problem: a directory, bytes that are not UTF-8, TOML nested deeper than its parser
    recurses or tables nested past :data:`MAX_DEPTH`, or a ``federation`` / ``run-config``
    that is not a table."""
    path = Path(path)
    data = _read_toml(path)
    unknown = set(data) - {"federation", "run-config"}
    if unknown:
        listed = sorted(shown(k, 40) for k in unknown)[:5]
        raise ConfigError(
            f"scenario {path}: unknown table(s) {', '.join(listed)}; valid: federation, run-config"
        )
    for table in ("federation", "run-config"):
        if not isinstance(data.get(table, {}), dict):
            raise ConfigError(
                f"scenario {path}: '{table}' = {shown(data[table], 40)} must be a table "
                f"([{table}] with key = value lines)"
            )
    federation = dict(data.get("federation", {}))
    run_config = _flatten(data.get("run-config", {}), where=f"scenario {path}")
    for key, value in overrides.items():
        _check_table(key)
        if key.startswith("federation."):
            federation[key.removeprefix("federation.")] = value
        else:
            run_config[key] = value
    federation.setdefault("num-supernodes", 10)
    check_federation(federation, f"scenario {path}")
    return Scenario(path.stem, federation, run_config)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SCENARIO_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"scenario file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(
            f"scenario {path} is a directory; give a scenario file, e.g. scenarios/default.toml"
        ) from None
    except OSError as err:
        raise ConfigError(f"scenario file {path} cannot be read: {err.strerror}") from None
    if len(raw) > MAX_SCENARIO_BYTES:
        raise ConfigError(f"scenario file {path} is over {MAX_SCENARIO_BYTES:,} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"scenario file {path} is not UTF-8 text (byte {err.start}); TOML files are UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"scenario file {path} is not valid TOML: {err}") from None
    except RecursionError:  # tomllib recurses once per level of an array or inline table
        raise ConfigError(f"scenario file {path} nests arrays or tables too deep") from None


def _check_table(key: str) -> None:
    """An override aimed at the other table (``num-supernodes`` without ``federation.``,
    or ``federation.seed``): say so, instead of "unknown key"."""
    name = key.removeprefix("federation.")
    if key == name and key in FEDERATION_CHECKS and key not in DEFAULTS:
        raise ConfigError(
            f"{key!r} is a federation key, not a run-config key: --set federation.{key}=..."
        )
    if key != name and name in DEFAULTS and name not in FEDERATION_CHECKS:
        raise ConfigError(
            f"{name!r} is a run-config key, not a federation key: --set {name}=... (no federation.)"
        )


def check_federation(federation: Mapping[str, Any], where: str = "federation") -> None:
    """Every key known to Flower's simulation config and of the type Flower needs."""
    bad = set(federation) - set(FEDERATION_KEYS)
    if bad:
        raise ConfigError(
            f"{where}: {unknown_keys_message('federation', bad, FEDERATION_KEYS)} "
            f"(valid: {', '.join(FEDERATION_KEYS)})"
        )
    for key, value in federation.items():
        problem = FEDERATION_CHECKS[key](value)
        if problem:
            raise ConfigError(f"{where}: federation {key!r} = {shown(value)}: {problem}")
    cpus, per_client = (
        federation.get("init-args-num-cpus"),
        federation.get("client-resources-num-cpus", 1),
    )
    if cpus is not None and per_client > cpus:
        raise ConfigError(
            f"{where}: federation client-resources-num-cpus = {per_client} exceeds "
            f"init-args-num-cpus = {cpus}: no ClientApp could ever run"
        )


def _flatten(
    table: Mapping[str, Any], prefix: str = "", where: str = "scenario", depth: int = 0
) -> dict[str, Any]:
    """Nested TOML tables to Flower's dotted keys (``[run-config.energy] capacity`` ->
    ``energy.capacity``)."""
    if depth > MAX_DEPTH:
        raise ConfigError(f"{where}: run-config tables nest deeper than {MAX_DEPTH} levels")
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}.", where, depth + 1))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resolve_run_config(scenario: Scenario) -> tuple[RunConfig, dict[str, Any]]:
    """Validate the scenario's run config and make its paths absolute.

    Relative paths are taken from the current directory, as a user typing the command
    expects; the ServerApp and ClientApps run elsewhere (from an installed copy of the app).
    """
    raw = dict(scenario.run_config)
    cfg = parse_run_config(raw)  # fail before any process starts
    raw["output-dir"] = str(Path(cfg.server.output_dir).resolve())
    if cfg.data.data_dir:
        raw["data-dir"] = str(Path(cfg.data.data_dir).resolve())
    if cfg.server.resume and not cfg.server.run_name:
        raise ConfigError(
            "--resume (resume = true) needs the run-name of the run to continue: "
            "--set run-name=NAME (NAME: its folder under output-dir)"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")  # as edgefleet.server.results names runs
    default = f"{stamp}-{cfg.server.strategy}-{cfg.data.dataset}-s{cfg.seed}"
    raw["run-name"] = cfg.server.run_name or f"{default}-{scenario.name}"
    n_devices = scenario.federation["num-supernodes"]
    if cfg.sessions.schedule == SessionSchedule.ALTERNATE and cfg.sessions.groups > n_devices:
        # Each device would refuse to build its data on every message: the run went by
        # with nobody taking part until run.max-empty-rounds stopped it.
        raise ConfigError(
            f"run config 'sessions.groups' = {cfg.sessions.groups} with sessions.schedule = "
            f"'alternate' needs at least that many devices (partition i is in group i mod "
            f"groups); federation.num-supernodes = {n_devices}: set sessions.groups <= "
            f"{n_devices} or more supernodes"
        )
    if raw.get("min-nodes", DEFAULTS["min-nodes"]) > n_devices:
        raw["min-nodes"] = n_devices
    return parse_run_config(raw), raw


class RunFolderTaken(ConfigError):
    """The run's folder already holds results and the run is not a resume; ``run_dir`` is
    that folder (the CLI words the fix as the commands to type)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(
            f"run folder {run_dir} already holds results; continue it with --resume "
            "(resume = true), or start a new run: another --set run-name=NAME, or remove "
            "the folder"
        )
        self.run_dir = run_dir


def check_run_folder(cfg: RunConfig) -> None:
    """Refuse to start over a finished or interrupted run, before any Flower process starts
    (the ServerApp refuses it too, but only after a minute of start-up)."""
    run_dir = Path(cfg.server.output_dir) / cfg.server.run_name
    if not cfg.server.resume and (run_dir / "metrics.jsonl").exists():
        raise RunFolderTaken(run_dir)


def with_gpu_share(federation: Mapping[str, Any], accelerator: str) -> dict[str, Any]:
    """``federation`` plus a ``client-resources-num-gpus`` share when the ClientApps are to
    use a GPU that Ray would otherwise hide from them (see :mod:`edgefleet.task.accelerator`);
    unchanged on a CPU-only machine or when the scenario sets its own share."""

    out = dict(federation)
    if "client-resources-num-gpus" in out:
        return out
    try:  # Flower's Ray backend gives an actor 2 CPUs unless told otherwise
        share = simulation_gpu_share(accelerator, out.get("client-resources-num-cpus", 2))
    except AcceleratorError as err:
        raise ConfigError(f"run config 'accelerator' = {accelerator!r}: {err}") from None
    if share:
        out["client-resources-num-gpus"] = share
    return out


def check_data(cfg: RunConfig, run_dir: Path | None = None) -> None:
    """Load the run's data set here, once, as the apps will: a missing copy is reported now,
    with every place looked in, instead of from inside the ServerApp a minute later. A
    refused start leaves no run folder behind: ``run_dir``, made for this run and still
    empty, is removed (it would show among the resumable runs)."""
    from edgefleet.task.datasets import load_dataset  # the data layer only when a run starts

    try:
        load_dataset(cfg.data.dataset, cfg.data.data_dir)
    except FileNotFoundError as err:
        if run_dir is not None and not cfg.server.resume:
            with contextlib.suppress(OSError):  # not empty (or gone): leave it as it is
                run_dir.rmdir()
        raise ConfigError(str(err)) from None


def run_scenario(
    scenario: Scenario,
    *,
    timeout: float = 3600.0,
    quiet: bool = False,
    ray_address: str | None = None,
    engine: Engine | InProcessEngine | None = None,
) -> Path:
    """Run ``scenario`` to completion on an engine of its own (``engine``: one made, and
    maybe launched, beforehand: an :class:`Engine` or an
    :class:`~edgefleet.simulation.inprocess.InProcessEngine`); return its run folder. Its
    progress shows on stdout as a line redrawn in place on a terminal, else (or ``quiet``) as
    a plain line per round."""
    cpus = scenario.federation.get("init-args-num-cpus")
    gpus = scenario.federation.get("init-args-num-gpus")
    if engine is None:
        if ray_address is not None and (cpus is not None or gpus is not None):
            raise ConfigError(RAY_ADDRESS_WITH_SIZES)
        engine = Engine(ray_address=ray_address, ray_cpus=cpus, ray_gpus=gpus)

    mode = display_mode(sys.stdout.isatty(), quiet)
    with engine:
        echo = None if quiet else sys.stdout
        return engine.run(scenario, timeout=timeout, echo=echo, progress=mode)
