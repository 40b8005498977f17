"""The Simulation Engine for one run or many: a SuperLink, a Ray cluster, the bundled app.

Kept light (the standard library and :mod:`edgefleet.processes` at import time): ``edgefleet
run`` starts the Ray cluster through it before it imports the rest of EdgeFleet and Flower.
See :mod:`edgefleet.simulation.runner` for what a run does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from edgefleet.fileio import NotARegularFile, atomic_write_text
from edgefleet.processes import FleetError, FlowerFleet, FlowerProcess, config_arg

if TYPE_CHECKING:
    from edgefleet.simulation.progress import ProgressReporter
    from edgefleet.simulation.runner import Scenario

PACKAGE_DIR = Path(__file__).resolve().parents[1]
PROJECT_DIR = PACKAGE_DIR.parent
# An installed wheel has no project folder: it carries the project's pyproject.toml (the
# Flower app's components and run config) as package data under this name.
PACKAGED_PYPROJECT = PACKAGE_DIR / "flower-app.toml"
# Bounds on the Ray cluster's size (docs/reference/config-limits.md), here so that
# `edgefleet run` can check them before it starts Ray, without importing the runner.
MAX_RAY_CPUS = 4096
MAX_RAY_GPUS = 1024
SUMMARY_GRACE = 30.0  # seconds the ServerApp may take to write its summary after the stream
RAY_ADDRESS_WITH_SIZES = (
    "init-args-num-cpus / init-args-num-gpus size a Ray cluster that EdgeFleet starts; "
    "with --ray-address the existing cluster's size applies: drop them"
)


def app_copy(dest: Path, clientapp: str | None = None) -> Path:
    """The app's own files (``pyproject.toml`` and the package) in a folder of their own;
    ``clientapp`` (a component string, ``module:attribute``) replaces EdgeFleet's ClientApp
    in the copy (tests and benchmarks: ``fleetharness.faults:faulty_app``).

    ``flwr run DIR`` walks every file under DIR before applying ``.gitignore``; from the
    project root that includes ``.venv`` (50,000 files, about 5 s). The copy takes 30 ms.
    """
    dest.mkdir()
    source = PROJECT_DIR / "pyproject.toml"
    if not source.is_file():
        source = PACKAGED_PYPROJECT
    shutil.copy2(source, dest / "pyproject.toml")
    if clientapp is not None:
        pyproject = dest / "pyproject.toml"
        text, n = re.subn(
            r'^clientapp = ".*"$', f'clientapp = "{clientapp}"', pyproject.read_text(), flags=re.M
        )
        if n != 1:
            raise ValueError(f"{source}: no single clientapp component")
        pyproject.write_text(text)
    shutil.copytree(PACKAGE_DIR, dest / "edgefleet", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


class RunFailed(RuntimeError):
    """A run ended without its summary; the message says why."""

    def __init__(self, message: str, run_dir: Path | None = None) -> None:
        super().__init__(message)
        self.run_dir = run_dir


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a run: every process has been stopped."""

    def __init__(self, run_dir: Path, signal_name: str) -> None:
        super().__init__(signal_name)
        self.run_dir, self.signal_name = run_dir, signal_name

    @property
    def last_round(self) -> int:
        """The last round on record (0: none finished)."""
        rows = self.run_dir / "metrics.jsonl"
        if not rows.exists():
            return 0
        lines = [line for line in rows.read_text().splitlines() if line.strip()]
        try:
            return int(json.loads(lines[-1])["round"]) if lines else 0
        except (ValueError, KeyError):
            return len(lines) - 1


class Engine:
    """Flower's Simulation Engine on a SuperLink of its own and a Ray cluster, for one run or
    many in a row (a sweep): the SuperLink, the Ray cluster and the bundled app are started
    once and reused; each run still gets a fresh ServerApp process and fresh Ray actors.

    ``ray_address`` runs the ClientApps on an existing Ray cluster instead of one started
    here (every node must be able to import ``edgefleet``, e.g. with ``pip install``);
    ``ray_cpus`` / ``ray_gpus`` size the cluster started here (default: Ray's, all cores);
    ``clientapp`` runs another ClientApp component than EdgeFleet's (see :func:`app_copy`).
    """

    def __init__(
        self,
        *,
        ray_address: str | None = None,
        ray_cpus: int | None = None,
        ray_gpus: int | None = None,
        work_dir: Path | None = None,
        clientapp: str | None = None,
    ) -> None:
        if ray_address is not None and (ray_cpus is not None or ray_gpus is not None):
            raise ValueError(RAY_ADDRESS_WITH_SIZES)
        self.ray_address = ray_address
        self.ray_cpus, self.ray_gpus = ray_cpus, ray_gpus
        self._tmp = None if work_dir else tempfile.TemporaryDirectory(prefix="edgefleet-flwr-")
        self.work_dir = work_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.fleet = FlowerFleet(self.work_dir, connection="edgefleet-sim")
        self.clientapp = clientapp
        self.app: Path | None = None
        self.started = False
        self._log_mark = 0

    def launch_ray(self) -> None:
        """Start the Ray cluster now, without waiting for it (once; nothing to start with
        ``ray_address``). ``edgefleet run`` calls this first thing, before it imports the
        rest of EdgeFleet and Flower, so that Ray's start-up overlaps all of that."""
        if self.ray_address is not None:
            self.fleet.ray_address = self.ray_address
        elif self.fleet.ray_address is None:
            self.fleet.start_ray_head(self.ray_cpus, self.ray_gpus, wait=False)

    def start(self, check: Callable[[], None] = lambda: None) -> None:
        """Start the Ray cluster (unless one was named), then the SuperLink; ``check`` runs
        while Ray starts (the data check) and, when it raises, stops everything."""
        fleet = self.fleet
        # The apps run from a temporary folder: take the data search's "../shared/data"
        # from where the command was typed (an explicit data-dir or $EDGEFLEET_DATA_DIR wins).
        from edgefleet.task.datasets import default_data_dir

        fleet.env.setdefault("EDGEFLEET_DATA_DIR", str(default_data_dir()))
        try:
            self.launch_ray()
            check()
            self.app = app_copy(self.work_dir / "app", self.clientapp)
            fleet.start_superlink(simulation=True)
            if self.ray_address is None:
                fleet.wait_for_ray()
        except FleetError as err:
            self.stop()
            raise RunFailed(
                f"could not start the Simulation Engine: {err}{_ray_hint(err)}"
            ) from None
        except BaseException:
            self.stop()
            raise
        self.started = True

    def stop(self) -> None:
        """Stop every process; a second Ctrl-C meanwhile cannot cut it short."""
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.fleet.stop()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self.started = False

    def alive(self) -> bool:
        """Whether a started engine's SuperLink and Ray head still run."""
        try:
            self.fleet.check_alive()
        except FleetError:
            return False
        return True

    def __enter__(self) -> Engine:
        self.fleet.__enter__()  # SIGTERM -> SystemExit, so that __exit__ runs
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.stop()
        finally:
            self.fleet.__exit__(exc_type, exc, tb)

    def run(
        self,
        scenario: Scenario,
        *,
        timeout: float = 3600.0,
        echo: TextIO | None = None,
        progress: str | None = None,
        progress_stream: TextIO | None = None,
    ) -> Path:
        """Run ``scenario`` to completion; its run folder. ``echo`` gets the ServerApp's log
        as it streams (None: only ``flower.log`` does). ``progress`` (``live`` or ``plain``,
        :mod:`edgefleet.simulation.progress`) shows the run's progress line on
        ``progress_stream`` (default stdout) from its rows as they land."""
        # lazy: this module stays light (docstring); runner imports this module (cycle)
        from edgefleet.config import ConfigError
        from edgefleet.runlock import RunLocked, release_stopped
        from edgefleet.server.results import prepare_run_dir
        from edgefleet.simulation.runner import (
            RAY_CLUSTER_KEYS,
            check_data,
            check_run_folder,
            resolve_run_config,
            with_gpu_share,
        )

        cfg, raw = resolve_run_config(scenario)
        check_run_folder(cfg)
        gpu_federation = with_gpu_share(scenario.federation, cfg.train.accelerator)
        try:
            # Checked, not held: the ServerApp, another process, takes the writer lock.
            run_dir = prepare_run_dir(cfg, lock=False)
        except (ValueError, FileExistsError, RunLocked, NotARegularFile) as err:
            raise ConfigError(str(err)) from None
        if not self.started:
            self.start(lambda: check_data(cfg, run_dir))
        else:
            check_data(cfg, run_dir)  # cached per data set: a sweep pays it once
        assert self.app is not None
        federation = {k: v for k, v in gpu_federation.items() if k not in RAY_CLUSTER_KEYS}
        link = next((p for p in self.fleet.processes if p.name == "superlink"), None)
        link_offset = self._log_mark  # where this run's part of the SuperLink's log starts
        flwr: FlowerProcess | None = None
        # lazy: tqdm, kept off this light module's import (see the docstring)
        from edgefleet.simulation.progress import start_progress

        stream = progress_stream if progress_stream is not None else sys.stdout
        reporter, echo = start_progress(run_dir, cfg.server.num_rounds, progress, stream, echo)
        try:
            flwr = self.fleet.flwr(
                "run",
                str(self.app),
                self.fleet.connection,
                "--stream",
                "--run-config",
                config_arg(raw),
                "--federation-config",
                config_arg(federation),
                name="flwr-run",
                echo=echo,
            )
            try:
                self._wait(flwr, run_dir, timeout, reporter)
            finally:
                if reporter is not None:
                    reporter.close()
        except (KeyboardInterrupt, SystemExit) as err:
            sig = "SIGINT" if isinstance(err, KeyboardInterrupt) else "SIGTERM"
            _write_log(run_dir, flwr, link, link_offset, self.fleet)
            self.stop()
            release_stopped(run_dir)  # its writer is stopped: no stale lock left
            raise Interrupted(run_dir, sig) from None
        except RunFailed:
            _write_log(run_dir, flwr, link, link_offset, self.fleet)
            self._log_mark = _size(link.log_path) if link else 0
            raise
        _write_log(run_dir, flwr, link, link_offset, self.fleet)
        self._log_mark = _size(link.log_path) if link else 0
        return run_dir

    def _wait(
        self,
        flwr: FlowerProcess,
        run_dir: Path,
        timeout: float,
        reporter: ProgressReporter | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        summary = run_dir / "summary.json"
        while flwr.running():
            if reporter is not None:
                reporter.poll()
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"run {run_dir.name} ran past the {timeout:.0f} s timeout "
                    f"(--timeout); its rows so far are in {run_dir}",
                    run_dir,
                )
            try:
                self.fleet.check_alive()
            except FleetError as err:
                raise RunFailed(f"run {run_dir.name}: {err}{_ray_hint(err)}", run_dir) from None
            time.sleep(0.2)
        # The stream ends when the run does; the summary may follow a moment later. A
        # ServerApp that failed never writes one: say why at once.
        stream = flwr.log_path.read_text(errors="replace")
        failed = _FAILED in stream or flwr.popen.returncode
        grace = time.monotonic() + (3.0 if failed else SUMMARY_GRACE)
        while not summary.exists() and time.monotonic() < grace:
            time.sleep(0.2)
        if summary.exists():
            return
        cause = serverapp_error(stream)
        if cause is None:
            cause = (
                f"`flwr run` exited with code {flwr.popen.returncode}: {_last_lines(stream, 8)}"
                if flwr.popen.returncode
                else "the ServerApp ended without a summary and without an error in its log"
            )
        raise RunFailed(f"run {run_dir.name} failed: {cause}", run_dir)


# -- failures ---------------------------------------------------------------------------------

_TRACEBACK = "Traceback (most recent call last):"
# What Flower's simulation process logs when the ServerApp (or the engine) raised; tracebacks
# before it are ClientApp errors the engine turned into error replies.
_FAILED = "Simulation raised an exception"
# Flower's own wrappers around the ServerApp's exception: not the cause.
_WRAPPERS = ("An error was encountered. Ending simulation.", "Simulation Runtime crashed.")


def serverapp_error(log: str, frames: int = 3) -> str | None:
    """The ServerApp's own error in a run's log: the exception Flower logged as ending the
    run (the first of its chain that is not Flower's wrapper), with its last ``frames``
    stack frames; without Flower's line, the log's last traceback; None without any."""
    lines = [_strip_log_prefix(line) for line in log.splitlines()]
    marks = [i for i, line in enumerate(lines) if _FAILED in line]
    start_at = marks[-1] if marks else 0
    blocks = []
    for start, line in enumerate(lines):
        if start < start_at or line.strip() != _TRACEBACK:
            continue
        end = start + 1
        while end < len(lines) and (lines[end].startswith(" ") or not lines[end].strip()):
            end += 1
        if end < len(lines):
            blocks.append((lines[start + 1 : end], lines[end].strip()))
    if not blocks:
        return None
    if not marks:
        blocks = blocks[-1:]
    useful = [b for b in blocks if not any(w in b[1] for w in _WRAPPERS)] or blocks
    stack, message = useful[0]
    where = [s.strip() for s in stack if s.strip().startswith("File ")][-frames:]
    return "\n".join([message, *(f"  {w}" for w in where)])


def _ray_hint(err: Exception) -> str:
    """Why Ray may not have started: it gives its own processes fixed start-up times (the
    raylet about 15 s for its agents, `ray start` 30 s for the raylet), which a machine with
    far more runnable processes than cores exceeds."""
    if "ray-" not in str(err) or "timed out" not in str(err):
        return ""
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    return (
        f"\nRay did not start in its fixed start-up time; load average {load} on "
        f"{os.cpu_count()} cores: try again on a less loaded machine"
    )


def _strip_log_prefix(line: str) -> str:
    # Flower prefixes a logged line with its level ("ERROR :   "), continuation lines not.
    return re.sub(r"^(?:\x1b\[[0-9;]*m)*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s*", "", line)


def _last_lines(text: str, n: int) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _write_log(
    run_dir: Path,
    flwr: FlowerProcess | None,
    link: FlowerProcess | None,
    link_offset: int,
    fleet: FlowerFleet,
) -> None:
    """``flower.log``: the ServerApp's log (the stream), the SuperLink's log of this run,
    and the Ray head's output."""
    parts = []
    if flwr is not None and flwr.log_path.exists():
        parts.append(("ServerApp (flwr run --stream)", flwr.log_path.read_text(errors="replace")))
    if link is not None and link.log_path.exists():
        with link.log_path.open("rb") as f:
            f.seek(link_offset)
            parts.append(("SuperLink", f.read().decode(errors="replace")))
    head = next((p for p in fleet.processes if p.name == "ray-head"), None)
    if head is not None:
        parts.append(("Ray head (ray start)", head.tail(60)))
    text = "".join(f"===== {title} =====\n{body.rstrip()}\n\n" for title, body in parts)
    if run_dir.exists():
        atomic_write_text(run_dir / "flower.log", text)  # never through a planted link


def resume_hint(scenario_path: str, run_dir: Path, overrides: list[str]) -> str:
    """The command that continues an interrupted run."""
    # run-name and output-dir are named below, from the run folder itself
    named = ("run-name", "output-dir", "resume")
    keep = [o for o in overrides if o.split("=", 1)[0].strip() not in named]
    sets = " ".join(f"--set {o}" for o in keep)
    return (
        f"edgefleet run {scenario_path} {sets + ' ' if sets else ''}"
        f"--set run-name={run_dir.name} --set output-dir={run_dir.parent} --resume"
    )
