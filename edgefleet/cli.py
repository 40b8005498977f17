"""``edgefleet`` command line: ``run`` a scenario on the Simulation Engine, ``report`` runs,
``supernode``/``worker``: a SuperNode whose ClientApp messages run in one warm process
(:mod:`edgefleet.client.worker`)."""

from __future__ import annotations

import argparse
import json
import sys

from edgefleet.config import ConfigError


def _run(argv: list[str]) -> int:
    from edgefleet.simulation.runner import load_scenario, parse_value, run_scenario

    parser = argparse.ArgumentParser(
        prog="edgefleet run",
        description="Run a scenario (scenarios/*.toml) on Flower's Simulation Engine.",
    )
    parser.add_argument("scenario", help="scenario TOML file, e.g. scenarios/default.toml")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run-config key (or federation.KEY); repeatable",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds (default 3600)")
    parser.add_argument("--quiet", action="store_true", help="hide Flower's log stream")
    parser.add_argument("--report", action="store_true", help="draw the plots when done")
    parser.add_argument(
        "--resume", action="store_true", help="continue run-name from its last checkpoint"
    )
    args = parser.parse_args(argv)
    overrides: dict[str, object] = {"resume": True} if args.resume else {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = parse_value(value.strip())
    try:
        run_dir = run_scenario(
            load_scenario(args.scenario, overrides), timeout=args.timeout, quiet=args.quiet
        )
    except ConfigError as err:
        print(f"edgefleet run: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"edgefleet run: failed: {err}", file=sys.stderr)
        return 1
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("config")
    print(json.dumps(summary, indent=2))
    print(f"results: {run_dir}")
    if args.report:
        from edgefleet.simulation.report import main as report_main

        return report_main([str(run_dir)])
    print(f"plots:   edgefleet report {run_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "run": "run a scenario",
        "report": "plot and compare run folders",
        "supernode": "flower-supernode with its ClientApp kept warm in one process",
        "worker": "the warm ClientApp executor of a `flower-supernode --isolation process`",
    }
    if not argv or argv[0] not in commands:
        usage = "\n".join(f"  edgefleet {c:<9} {h}" for c, h in commands.items())
        print(f"usage:\n{usage}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "run":
        return _run(argv[1:])
    if argv[0] in ("supernode", "worker"):
        from edgefleet.client.worker import main as worker_main

        return worker_main(argv)
    from edgefleet.simulation.report import main as report_main

    return report_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
