"""``edgefleet`` command line: ``run`` a scenario on the Simulation Engine, ``sweep`` it over a
grid of settings and seeds, ``report`` runs, ``supernode``/``worker``: a SuperNode whose
ClientApp messages run in one warm process (:mod:`edgefleet.client.worker`), ``dashboard``: a live
web page and Prometheus metrics for a run folder (:mod:`edgefleet.dashboard`)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgefleet.simulation.engine import Engine

# Only the standard library at import time: `edgefleet run` starts its Ray cluster before it
# imports the rest of EdgeFleet and Flower (about a second of CPU), so that Ray's start-up
# overlaps those imports.

COMMANDS = {
    "run": "run a scenario",
    "sweep": "run a scenario over a grid of settings and seeds",
    "report": "plot and compare run folders (or sweeps)",
    "supernode": "flower-supernode with its ClientApp kept warm in one process",
    "worker": "the warm ClientApp executor of a `flower-supernode --isolation process`",
    "dashboard": "a live web page and Prometheus /metrics for a run folder",
}


def version_text() -> str:
    """EdgeFleet's version and those of what it runs on, read from the installed packages'
    metadata (importing torch to ask would take seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    python = ".".join(map(str, sys.version_info[:3]))
    return (
        f"edgefleet {of('edgefleet')} (Flower {of('flwr')}, torch {of('torch')}, Python {python})"
    )


def top_parser() -> argparse.ArgumentParser:
    """``edgefleet`` itself: its commands, ``--version`` and ``--help`` (a command's own
    arguments are its own parser's)."""
    parser = argparse.ArgumentParser(
        prog="edgefleet",
        description="Federated learning for fleets of edge devices, on Flower.",
        epilog="Run `edgefleet COMMAND --help` for a command's arguments and options.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=version_text(),
        help="print the versions of EdgeFleet, Flower, torch and Python, and exit",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, text in COMMANDS.items():
        commands.add_parser(name, help=text, add_help=False)
    return parser


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, by command (what docs/reference/cli.md lists)."""
    # lazy: flwr/httpx (worker) and matplotlib (report), for the parser listing only
    from edgefleet.client.worker import supernode_parser, worker_parser
    from edgefleet.simulation.report import report_parser

    return {
        "run": run_parser(),
        "sweep": sweep_parser(),
        "report": report_parser(),
        "supernode": supernode_parser(),
        "worker": worker_parser(),
        "dashboard": dashboard_parser(),
    }


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario TOML file, e.g. scenarios/default.toml")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run-config key (or federation.KEY); repeatable",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds per run (default 3600)"
    )
    parser.add_argument("--quiet", action="store_true", help="hide Flower's log stream")
    parser.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="run the ClientApps on this existing Ray cluster (HOST:PORT of its head) instead "
        "of one started for the run",
    )
    parser.add_argument(
        "--engine",
        choices=("simulation", "inprocess"),
        default="simulation",
        help="simulation: Flower's Simulation Engine (Ray; the default); inprocess: the same "
        "ServerApp and ClientApps in worker processes on this machine, without Ray",
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="--engine inprocess: worker processes for the ClientApps (default: one per core; "
        "1: every message in the run's own process)",
    )


def parse_overrides(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as a run-config mapping (values parsed as TOML values, see
    ``parse_value``); a malformed item is ``parser``'s usage error. Shared with the benchmarks
    that take ``--set`` (``benchmarks/lib/overrides.py``)."""
    # lazy: config and runner pull in flwr and ~60 EdgeFleet modules (~1 s)
    from edgefleet.config import ConfigError, shown
    from edgefleet.simulation.runner import parse_value

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error(f"--set {shown(item)}: expected KEY=VALUE")
        try:
            out[key.strip()] = parse_value(value.strip())
        except ConfigError as err:
            parser.error(f"--set {key.strip()[:60]}: {err}")
    return out


def _early_engine(scenario: str, sets: list[str], ray_address: str | None) -> Engine | None:
    """An engine whose Ray cluster is already starting, sized from the scenario file and the
    ``--set federation.init-args-*`` overrides; None when those cannot be read yet (the run
    then validates them and starts its engine itself)."""
    # lazy: cli.py imports only the standard library (see the module comment)
    from edgefleet.simulation.engine import MAX_RAY_CPUS, MAX_RAY_GPUS, Engine

    try:  # anything odd is left to the run's own checks, which name it
        path = Path(scenario)
        if not path.is_file() or path.stat().st_size > 1 << 20:
            return None
        federation = dict(tomllib.loads(path.read_text()).get("federation", {}))
        for item in sets:
            key, _, value = item.partition("=")
            if key.strip().startswith("federation.") and len(value) < 100:
                federation[key.strip().removeprefix("federation.")] = tomllib.loads(
                    f"v = {value.strip()}"
                )["v"]
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return None  # (tomllib's and UTF-8's errors are ValueErrors)
    cpus, gpus = federation.get("init-args-num-cpus"), federation.get("init-args-num-gpus")
    if any(v is not None and (type(v) is not int or v < 0) for v in (cpus, gpus)):
        return None
    if (cpus or 0) > MAX_RAY_CPUS or (gpus or 0) > MAX_RAY_GPUS:
        return None
    if ray_address is not None and (cpus is not None or gpus is not None):
        return None
    engine = Engine(ray_address=ray_address, ray_cpus=cpus, ray_gpus=gpus)
    engine.launch_ray()
    return engine


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgefleet run",
        description="Run a scenario (scenarios/*.toml) on Flower's Simulation Engine (or "
        "--engine inprocess).",
    )
    _common(parser)
    parser.add_argument("--report", action="store_true", help="draw the plots when done")
    parser.add_argument(
        "--json", action="store_true", help="print summary.json instead of the run's story"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue run-name from its last checkpoint"
    )
    parser.add_argument(
        "--dashboard",
        action="store_true",
        help="serve the run's dashboard on http://127.0.0.1:8050/ (a free port if that one is "
        "taken) while it runs",
    )
    return parser


def _run(argv: list[str]) -> int:
    parser = run_parser()
    args = parser.parse_args(argv)
    # From here on a SIGTERM must unwind (and stop the Ray cluster), not end Python at once.
    previous = signal.signal(signal.SIGTERM, _sigterm)
    engine = None
    try:
        # A resume is checked (its run folder's writer, its config) before Ray starts: it is
        # refused often, and then in a second.
        if not args.resume and args.engine == "simulation":
            engine = _early_engine(args.scenario, args.set, args.ray_address)
        return _run_with(parser, args, engine)
    except SystemExit as exc:  # SIGTERM before the run began
        if exc.code != 143:
            raise
        print("edgefleet run: SIGTERM before the run started", file=sys.stderr)
        return 143
    finally:
        if engine is not None:
            engine.stop()  # (nothing left to stop after a run: it stops its engine itself)
        signal.signal(signal.SIGTERM, previous)


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _run_with(parser: argparse.ArgumentParser, args: argparse.Namespace, engine: Any) -> int:
    # lazy: flwr and the rest of EdgeFleet only after Ray's start (see the module comment)
    from edgefleet.config import ConfigError
    from edgefleet.simulation.runner import (
        Interrupted,
        RunFailed,
        RunFolderTaken,
        load_scenario,
        resume_hint,
        run_scenario,
    )

    overrides = parse_overrides(parser, args.set)
    if args.resume:
        overrides["resume"] = True
    dashboard = None
    try:
        engine = _inprocess_engine(args) or engine
        scenario = load_scenario(args.scenario, overrides)
        if args.dashboard:
            scenario, dashboard = _start_dashboard(args.scenario, overrides, scenario)
        run_dir = run_scenario(
            scenario,
            timeout=args.timeout,
            quiet=args.quiet,
            ray_address=args.ray_address,
            engine=engine,
        )
    except RunFolderTaken as err:
        print(
            f"edgefleet run: error: run folder {err.run_dir} already holds results.\n"
            f"  continue it:     {resume_hint(args.scenario, err.run_dir, args.set)}\n"
            "  or start anew:   the same command with another --set run-name=NAME (or none: "
            "a new dated name), or remove the folder",
            file=sys.stderr,
        )
        return 2
    except ConfigError as err:
        print(f"edgefleet run: error: {err}", file=sys.stderr)
        return 2
    except RunFailed as err:
        where = f"\n(full log: {err.run_dir / 'flower.log'})" if err.run_dir else ""
        print(f"edgefleet run: failed: {err}{where}", file=sys.stderr)
        return 1
    except Interrupted as err:
        hint = resume_hint(args.scenario, err.run_dir, args.set)
        print(
            f"edgefleet run: {err.signal_name}: stopped {err.run_dir.name} after round "
            f"{err.last_round}, every process ended; resume with: {hint}",
            file=sys.stderr,
        )
        return 130 if err.signal_name == "SIGINT" else 143
    except KeyboardInterrupt:
        print("edgefleet run: interrupted before the run started", file=sys.stderr)
        return 130
    finally:
        if dashboard is not None:
            dashboard.stop()
    if args.json:
        summary = json.loads((run_dir / "summary.json").read_text())
        summary.pop("config")
        print(json.dumps(summary, indent=2))
    elif not args.report:  # the report begins with the story: print it once
        from edgefleet.simulation.story import story

        print(story(run_dir))
    print(f"results: {run_dir} (summary.json, metrics.jsonl)")
    if args.report:
        # lazy: matplotlib (~0.5 s) only with --report
        from edgefleet.simulation.report import main as report_main

        return report_main([str(run_dir)])
    print(f"plots:   edgefleet report {run_dir}")
    return 0


def _start_dashboard(path: str, overrides: dict[str, Any], scenario: Any) -> tuple[Any, Any]:
    """The scenario with its run folder's name fixed (the default one is dated), and a
    dashboard of that folder serving in a thread of this process until the run ends."""
    # lazy: starlette/prometheus_client only with --dashboard; runner pulls in flwr
    from edgefleet.dashboard.app import DEFAULT_PORT, Dashboard, DashboardError, token_from
    from edgefleet.simulation.runner import load_scenario, resolve_run_config

    _, raw = resolve_run_config(scenario)
    scenario = load_scenario(path, {**overrides, "run-name": raw["run-name"]})
    run_dir = Path(raw["output-dir"]) / raw["run-name"]
    token = token_from(None)
    try:
        dashboard = Dashboard(run_dir, port=DEFAULT_PORT, token=token)
    except DashboardError:  # port 8050 taken: any free one
        dashboard = Dashboard(run_dir, port=0, token=token)
    dashboard.start()
    print(
        f"dashboard: {dashboard.url} (until the run ends; after it: edgefleet dashboard {run_dir})",
        file=sys.stderr,  # stdout may be --json's
        flush=True,
    )
    return scenario, dashboard


def dashboard_parser() -> argparse.ArgumentParser:
    # lazy: starlette and prometheus_client only for `edgefleet dashboard`
    from edgefleet.dashboard.app import DEFAULT_HOST, DEFAULT_PORT, TOKEN_ENV, TRUSTED_PROXIES
    from edgefleet.dashboard.metrics import MAX_DEVICES, OFFLINE_ROUNDS

    parser = argparse.ArgumentParser(
        prog="edgefleet dashboard",
        description="Serve a web page of a run folder (live or finished, simulation or "
        "deployment): the fleet, batteries, accuracy, rejections, sessions and the stopping "
        "signal, refreshed after every round; and /metrics for Prometheus.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder, e.g. runs/NAME")
    parser.add_argument(
        "--latest",
        action="store_true",
        help="RUN_DIR is an output-dir (e.g. runs): show the run folder in it written to last, "
        "and switch to each new run as it starts",
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}: this machine only; any other "
        "needs --token)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free)"
    )
    parser.add_argument(
        "--token",
        help=f"password every request must carry (default ${TOKEN_ENV}): header "
        "`Authorization: Bearer TOKEN`, or open /?token=TOKEN once in a browser",
    )
    parser.add_argument(
        "--trusted-proxies",
        default=TRUSTED_PROXIES,
        metavar="ADDRESSES",
        help="the TLS proxy in front (comma-separated addresses; default "
        f"{TRUSTED_PROXIES}) whose X-Forwarded-Proto: https marks the cookie Secure",
    )
    parser.add_argument(
        "--metrics-max-devices",
        type=_positive_int,
        default=MAX_DEVICES,
        metavar="N",
        help=f"devices /metrics exports at most (default {MAX_DEVICES}; online first, then "
        "the most recently seen; edgefleet_devices still counts all)",
    )
    parser.add_argument(
        "--metrics-offline-rounds",
        type=_positive_int,
        default=OFFLINE_ROUNDS,
        metavar="ROUNDS",
        help=f"a device offline for more rounds than this leaves /metrics (default "
        f"{OFFLINE_ROUNDS})",
    )
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _dashboard(argv: list[str]) -> int:
    # lazy: starlette and prometheus_client only for `edgefleet dashboard`
    from edgefleet.dashboard.app import Dashboard, DashboardError, token_from

    args = dashboard_parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(
            f"edgefleet dashboard: error: no run folder {run_dir} (a run's folder under its "
            "output-dir, e.g. runs/NAME; `edgefleet run` prints it; or an output-dir with "
            "--latest)",
            file=sys.stderr,
        )
        return 2
    token = token_from(args.token)
    try:
        dashboard = Dashboard(
            run_dir,
            args.host,
            args.port,
            token,
            latest=args.latest,
            trusted_proxies=args.trusted_proxies,
            metrics_max_devices=args.metrics_max_devices,
            metrics_offline_rounds=args.metrics_offline_rounds,
        )
    except DashboardError as err:
        print(f"edgefleet dashboard: error: {err}", file=sys.stderr)
        return 2
    how = " (send Authorization: Bearer TOKEN, or open it once as ?token=TOKEN)" if token else ""
    what = f"the latest run in {run_dir}" if args.latest else run_dir
    print(f"dashboard of {what}: {dashboard.url}{how}; metrics: {dashboard.url}metrics", flush=True)
    dashboard.serve()
    return 0


def _inprocess_engine(args: argparse.Namespace) -> Any:
    """The in-process engine ``--engine inprocess`` asks for (None: Flower's); options of
    the other engine are refused."""
    # lazy: runner pulls in flwr and ~60 EdgeFleet modules (~1 s)
    from edgefleet.simulation.runner import check_engine

    check_engine(args.engine, args.ray_address, args.workers)
    if args.engine != "inprocess":
        return None
    # lazy: flwr; only for --engine inprocess
    from edgefleet.simulation.inprocess import InProcessEngine

    return InProcessEngine(workers=args.workers)


def sweep_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgefleet sweep",
        description="Run a scenario over a grid of settings and seeds (one SuperLink and one "
        "Ray cluster for all runs), skip runs that finished before, then compare the grid "
        "points (mean and spread over the seeds) with `edgefleet report`.",
    )
    _common(parser)
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="values of a run-config key (or federation.KEY) to sweep; repeatable (product)",
    )
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument(
        "--name", help="the sweep's folder under output-dir (default: SCENARIO-sweep)"
    )
    parser.add_argument("--no-report", action="store_true", help="skip the table and plots")
    return parser


def _sweep(argv: list[str]) -> int:
    # lazy: flwr and ~60 EdgeFleet modules (~1 s) only for `edgefleet sweep`
    from edgefleet.config import ConfigError
    from edgefleet.simulation.runner import load_scenario
    from edgefleet.simulation.sweep import Sweep, grid_points, parse_grid, parse_seeds

    parser = sweep_parser()
    args = parser.parse_args(argv)
    try:
        base = load_scenario(args.scenario, parse_overrides(parser, args.set))
        points = grid_points(parse_grid(args.grid))
        seeds = parse_seeds(args.seeds)
        out = Path(str(base.run_config.get("output-dir", "runs"))) / (
            args.name or f"{base.name}-sweep"
        )
        sweep = Sweep(
            base,
            points,
            seeds,
            out,
            timeout=args.timeout,
            ray_address=args.ray_address,
            echo=None if args.quiet else sys.stdout,
            engine=args.engine,
            workers=args.workers,
        )
        runs = sweep.run()
    except ConfigError as err:
        print(f"edgefleet sweep: error: {err}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit) as err:
        if isinstance(err, SystemExit) and err.code != 143:
            raise
        where = getattr(err, "run_dir", None)
        signal_name = getattr(
            err, "signal_name", "SIGTERM" if isinstance(err, SystemExit) else "SIGINT"
        )
        print(
            f"edgefleet sweep: {signal_name}{f' during {where.name}' if where else ''}; every "
            "process ended; the same command resumes the sweep (finished runs are skipped, "
            "the interrupted one continues from its checkpoint)",
            file=sys.stderr,
        )
        return 130 if signal_name == "SIGINT" else 143
    failed = [r for r in runs if r.status == "failed"]
    if not args.no_report:
        # lazy: matplotlib (~0.5 s) only when the sweep reports
        from edgefleet.simulation.report import main as report_main

        report_main([str(sweep.out), "--out", str(sweep.out / "report")])
    for run in failed:
        print(f"edgefleet sweep: {run.run_dir.name} failed: {run.error}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser = top_parser()
        if not argv:
            parser.print_help(sys.stderr)
            return 2
        try:
            parser.parse_args(argv)  # --help, --version, or an error naming the commands
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 2
        return 2
    if argv[0] == "run":
        return _run(argv[1:])
    if argv[0] == "sweep":
        return _sweep(argv[1:])
    if argv[0] == "dashboard":
        return _dashboard(argv[1:])
    if argv[0] in ("supernode", "worker"):
        # lazy: flwr, httpx and starlette (~1 s) only for `supernode` and `worker`
        from edgefleet.client.worker import main as worker_main

        return worker_main(argv)
    # lazy: matplotlib (~0.5 s) only for `edgefleet report`
    from edgefleet.simulation.report import main as report_main

    return report_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
