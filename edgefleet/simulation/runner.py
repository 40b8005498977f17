"""Run a named experiment (a scenario TOML) on Flower's Simulation Engine, and clean up.

``edgefleet run scenarios/X.toml`` does what ``flwr run .`` does, with three differences
that matter for experiments: the run config is validated before any Flower process starts;
every run gets its own SuperLink on free ports and its own ``FLWR_HOME`` (so runs, tests
and benchmarks can go on side by side, and no SuperLink is left behind, unlike ``flwr
run .``'s detached one); and the command waits for the run and prints its summary.

A scenario file has two tables::

    [federation]            # Flower's --federation-config keys
    num-supernodes = 10
    client-resources-num-cpus = 1

    [run-config]            # any key of pyproject.toml's [tool.flwr.app.config]
    num-server-rounds = 10
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefleet.config import DEFAULTS, ConfigError, RunConfig, parse_run_config
from edgefleet.server.results import default_run_name

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
# The environment Flower's CLI needs to stay offline and not reinstall the app's
# dependencies into the running environment (README, "Run a simulation").
QUIET_FLOWER_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
}


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
    raw["run-name"] = cfg.server.run_name or f"{default_run_name(cfg)}-{scenario.name}"
    n_devices = scenario.federation["num-supernodes"]
    if raw.get("min-nodes", DEFAULTS["min-nodes"]) > n_devices:
        raw["min-nodes"] = n_devices
    return parse_run_config(raw), raw


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _config_args(flag: str, values: Mapping[str, Any]) -> list[str]:
    return [flag, " ".join(f"{k}={_toml_value(v)}" for k, v in values.items())]


@contextmanager
def local_superlink(flwr_home: Path, log_file: Path) -> Iterator[dict[str, str]]:
    """A simulation SuperLink of our own on free ports, stopped (with its process group)
    on exit. Yields the environment under which ``flwr run . local`` talks to it."""
    env = {
        **os.environ,
        **QUIET_FLOWER_ENV,
        "FLWR_HOME": str(flwr_home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    cmd = [
        str(bin_dir / "flower-superlink"),
        "--insecure",
        "--simulation",
        "--isolation",
        "subprocess",
        "--disable-runtime-dependency-installation",
        "--host",
        "127.0.0.1",
        "--port",
        env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"],
        "--control-api-address",
        f"127.0.0.1:{env['FLWR_LOCAL_CONTROL_API_PORT']}",
    ]
    with log_file.open("ab") as log:
        # Own session: the SuperLink's flwr-simulation child is stopped with it.
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        yield env
    finally:
        _stop_group(proc)
        _stop_leftovers(f"FLWR_HOME={flwr_home}")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def processes_with_env(marker: str) -> list[int]:
    """Live (non-zombie) processes whose environment contains ``marker``. Linux only;
    elsewhere an empty list."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie holds nothing (and a container's init may not reap it)
            if marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except (OSError, IndexError):
            continue
    return found


def _stop_leftovers(marker: str, grace: float = 5.0) -> None:
    """Stop what the SuperLink started in sessions of its own (flower-superexec,
    flwr-simulation and its Ray actors). They watch their parent and exit when it is gone,
    but only eventually; they all carry our private FLWR_HOME in their environment."""
    deadline = time.monotonic() + grace
    sig = signal.SIGTERM
    while pids := processes_with_env(marker):
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL:
                return
            sig, deadline = signal.SIGKILL, time.monotonic() + grace
        for pid in pids:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        time.sleep(0.2)


def run_scenario(scenario: Scenario, *, timeout: float = 3600.0, quiet: bool = False) -> Path:
    """Run ``scenario`` to completion on the Simulation Engine; return its run folder."""
    cfg, raw = resolve_run_config(scenario)
    run_dir = Path(cfg.server.output_dir) / cfg.server.run_name
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run folder {run_dir} already holds results; set another run-name")
    run_dir.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="edgefleet-flwr-") as home,
        local_superlink(Path(home), run_dir / "superlink.log") as env,
    ):
        cmd = [
            str(Path(sys.executable).parent / "flwr"),
            "run",
            str(PROJECT_DIR),
            "local",
            "--stream",
            *_config_args("--run-config", raw),
            *_config_args("--federation-config", scenario.federation),
        ]
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=out, timeout=timeout)
        # `--stream` returns when the log stream ends; the summary marks success.
        deadline = time.monotonic() + 30
        while not (run_dir / "summary.json").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    if not (run_dir / "summary.json").exists():
        raise RuntimeError(
            f"run {cfg.server.run_name} ended (flwr exit code {proc.returncode}) without a "
            f"summary; see the log above and {run_dir / 'superlink.log'}"
        )
    return run_dir
