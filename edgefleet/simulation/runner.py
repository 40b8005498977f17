"""Run a named experiment (a scenario TOML) on Flower's Simulation Engine, and clean up.

``edgefleet run scenarios/X.toml`` does what ``flwr run .`` does, with three differences
that matter for experiments: the run config is validated before any Flower process starts;
every run gets its own SuperLink on a free port and its own ``FLWR_HOME`` (so runs, tests
and benchmarks can go on side by side, and no SuperLink is left behind, unlike ``flwr
run .``'s detached one: see :mod:`edgefleet.processes`); and the command waits for the run
and prints its summary.

A scenario file has two tables::

    [federation]            # Flower's --federation-config keys
    num-supernodes = 10
    client-resources-num-cpus = 1

    [run-config]            # any key of pyproject.toml's [tool.flwr.app.config]
    num-server-rounds = 10
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.config import DEFAULTS, ConfigError, RunConfig, parse_run_config
from edgefleet.processes import BIN_DIR, FleetError, FlowerFleet, config_arg
from edgefleet.server.results import default_run_name, prepare_run_dir
from edgefleet.task.accelerator import AcceleratorError, simulation_gpu_share
from edgefleet.task.data import default_data_dir

PROJECT_DIR = Path(__file__).resolve().parents[2]
FEDERATION_KEYS = (
    "num-supernodes",
    "client-resources-num-cpus",
    "client-resources-num-gpus",
    "init-args-num-cpus",
    "init-args-num-gpus",
    "backend",
    "verbose",
)


@dataclass(frozen=True)
class Scenario:
    name: str
    federation: dict[str, Any] = field(default_factory=dict)
    run_config: dict[str, Any] = field(default_factory=dict)


def parse_value(text: str) -> Any:
    """A ``--set key=value`` value as TOML would read it (``0.1``, ``true``, ``"x"``); a bare
    word that is not TOML is taken as a string, so ``--set dataset=mnist`` works."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_scenario(path: str | Path, overrides: Mapping[str, Any] = {}) -> Scenario:
    """Read a scenario file and apply ``--set`` overrides (``federation.KEY`` or run-config)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"scenario file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"scenario file {path} is not valid TOML: {err}") from None
    unknown = set(data) - {"federation", "run-config"}
    if unknown:
        raise ConfigError(
            f"scenario {path}: unknown table(s) {sorted(unknown)}; valid: federation, run-config"
        )
    federation = dict(data.get("federation", {}))
    run_config = _flatten(data.get("run-config", {}))
    for key, value in overrides.items():
        if key.startswith("federation."):
            federation[key.removeprefix("federation.")] = value
        else:
            run_config[key] = value
    bad = sorted(set(federation) - set(FEDERATION_KEYS))
    if bad:
        raise ConfigError(
            f"scenario {path}: unknown federation key(s) {bad}; valid: {', '.join(FEDERATION_KEYS)}"
        )
    n = federation.get("num-supernodes", 10)
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"federation 'num-supernodes' = {n!r}: must be an integer >= 1")
    federation["num-supernodes"] = n
    return Scenario(path.stem, federation, run_config)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables to Flower's dotted keys (``[run-config.energy] capacity`` ->
    ``energy.capacity``)."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
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
            "resume = true needs the run-name of the run to continue (--set run-name=...)"
        )
    raw["run-name"] = cfg.server.run_name or f"{default_run_name(cfg)}-{scenario.name}"
    n_devices = scenario.federation["num-supernodes"]
    if raw.get("min-nodes", DEFAULTS["min-nodes"]) > n_devices:
        raw["min-nodes"] = n_devices
    return parse_run_config(raw), raw


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


def app_copy(dest: Path) -> Path:
    """The app's own files (``pyproject.toml`` and the package) in a folder of their own.

    ``flwr run DIR`` walks every file under DIR before applying ``.gitignore``; from the
    project root that includes ``.venv`` (50,000 files, about 5 s). The copy takes 30 ms.
    """
    dest.mkdir()
    shutil.copy2(PROJECT_DIR / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(
        PROJECT_DIR / "edgefleet", dest / "edgefleet", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


def run_scenario(scenario: Scenario, *, timeout: float = 3600.0, quiet: bool = False) -> Path:
    """Run ``scenario`` to completion on the Simulation Engine; return its run folder."""
    cfg, raw = resolve_run_config(scenario)
    federation = with_gpu_share(scenario.federation, cfg.train.accelerator)
    try:
        run_dir = prepare_run_dir(cfg)
    except (ValueError, FileExistsError) as err:
        raise ConfigError(str(err)) from None
    with (
        tempfile.TemporaryDirectory(prefix="edgefleet-flwr-") as work,
        FlowerFleet(Path(work), connection="edgefleet-sim") as fleet,
    ):
        # The apps run from a temporary folder: take the data search's "../shared/data"
        # from where the command was typed (an explicit data-dir or $EDGEFLEET_DATA_DIR wins).
        fleet.env.setdefault("EDGEFLEET_DATA_DIR", str(default_data_dir()))
        try:
            fleet.start_superlink(simulation=True)
        except FleetError as err:
            raise RuntimeError(f"could not start a SuperLink: {err}") from None
        cmd = [
            str(BIN_DIR / "flwr"),
            "run",
            str(app_copy(Path(work) / "app")),
            fleet.connection,
            "--stream",
            "--run-config",
            config_arg(raw),
            "--federation-config",
            config_arg(federation),
        ]
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.run(cmd, env=fleet.env, stdout=out, stderr=out, timeout=timeout)
        # `--stream` can end a moment before the ServerApp has written its summary.
        deadline = time.monotonic() + (30 if proc.returncode == 0 else 5)
        while not (run_dir / "summary.json").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        if not (run_dir / "summary.json").exists():
            (run_dir / "flower.log").write_text(fleet.report(lines=200))
            raise RuntimeError(
                f"run {cfg.server.run_name} ended (flwr exit code {proc.returncode}) without a "
                f"summary; see the log above and {run_dir / 'flower.log'}"
            )
    return run_dir
