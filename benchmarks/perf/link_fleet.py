"""Rounds on slow and uneven links: seconds and bytes per round, and time to a target accuracy,
per link mix, with full and with CA-HFP's compact download (issue 26, the measurement).

One link fleet (``deploy/linkfleet.py``: the SuperLink with TLS, node auth and ``--database``
in a network namespace, each ``edgefleet supernode`` in its own behind a tbf-shaped veth) is
started once; for each link mix its profiles are set (``tc qdisc replace``, nodes stay up and
warm) and one run per download mode is submitted:

- mixes: ``all-fast``; ``half-wifi`` (half the nodes ``wifi-edge``, 2 Mbit/s); ``quarter-
  cellular`` (a quarter ``cellular``, 512 kbit/s); the rest ``fast`` (50 Mbit/s);
- modes: ``full`` (every node downloads the whole model) and ``compact``
  (``pruning.compact-download = true``: a pruned node gets only its slice, the full model
  every ``pruning.refresh-rounds``);
- selections: ``none`` (every node every round) and ``deadline`` (energy-age selection with
  always-on batteries and M = the fleet, ``selection.deadline = --deadline`` seconds and
  ``timeout-mode = expected``: a device whose observed round exceeds the deadline is skipped),
  with ``--deadline-retry`` (``selection.deadline-retry``) and ``--status-max-age``
  (``selection.status-max-age``: take a device's last "feasible" answer instead of a status
  query). ``--declare-links`` restarts each node with its profile's rate as ``link-kbps`` in
  its node config, which the deadline uses for a device it has not timed yet.

Runs per mix and mode: every combination of ``--selections`` x ``--strategy`` (comma lists;
the first strategy is the baseline's and is left out of run names) x ``--aggregation``
(``sync``, ``async``: FedBuff, its ``async.*`` keys through ``--set``), a combination the run
config refuses (async with the deadline's energy-age selection) left out with its reason in
``skipped_variants``; or ``--variants`` names them (``sync,deadline,fedsag+deadline,async``).
An async run makes ``ceil(X x rounds x nodes / async.buffer-size)`` versions, ``X`` from
``--async-updates`` (1: the device updates of ``rounds`` synchronous rounds; more lets async
spend the wall time its fast devices no longer wait, as accuracy is compared at the all-fast
run's wall time anyway). A run that fails is recorded in ``failed_runs`` and the
line goes on.

Nodes keep ``--keep-ratios`` (cycled over node index; the same in every run) and the slow
links go to the nodes of the lowest keep ratio first (the weak boards on the weak links).

Per run: ``round_s`` (each round's wall time, from the rows' ``wall_s``), ``steady_round_s``
(median of rounds 2..R: round 1 also carries app install and imports), ``wire_bytes`` per
round down and up over all links and for the slowest link (the bridge ports' counters: TLS,
HTTP and polls included; sampled when each round's row appears), ``app_bytes`` (the rows'
``bytes_down`` / ``bytes_up``: the arrays alone), ``missing`` / participants per round (did a
round lose a slow node to ``round-timeout``?), ``slow_link_s`` (the slowest link's bytes per
round over its rate: the floor a round that waits for that node cannot beat) and rounds /
seconds to ``--target`` accuracy (null when not reached); whole-run byte totals, ``updates``,
``device_idle`` (from fleet.json, an estimate) and, for async, ``staleness`` per version.
``ratios`` compare every run with the all-fast synchronous run of its mode (or
``--baseline``'s): time to the target, and the accuracy of its last evaluated row within that
run's wall time (``budget_s``) against that run's final accuracy (issue 45's two targets).

Prints one JSON line; progress on stderr. Root only (network namespaces)::

    python -m benchmarks.perf.link_fleet --smoke
    python -m benchmarks.perf.link_fleet --nodes 8 --rounds 10 --target 0.8
    python -m benchmarks.perf.link_fleet --nodes 4 --rounds 8 --modes full \
        --selections none,deadline
    python -m benchmarks.perf.link_fleet --nodes 4 --rounds 8 --selections none,deadline \\
        --deadline 15 --status-max-age 1 --declare-links   # issue 26's fixes, see README
    python -m benchmarks.perf.link_fleet --nodes 4 --keep-ratios 1.0 --modes full \\
        --variants sync,deadline,fedsag+deadline,async --deadline 7 --declare-links \\
        --set async.buffer-size=2 --set async.concurrency=4   # issue 45
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# deploy/ is a folder of scripts, not a package: its fleet helpers are imported from there.
if str(ROOT / "deploy") not in sys.path:
    sys.path.insert(0, str(ROOT / "deploy"))

from linkfleet import PROFILES, LinkFleet, node_configs, running_fleet, unavailable  # noqa: E402

from benchmarks.lib.overrides import add_set_arg, parse_sets  # noqa: E402
from benchmarks.lib.provenance import dumps  # noqa: E402
from edgefleet.config import STRATEGIES, parse_run_config  # noqa: E402
from edgefleet.processes import FleetError, config_arg  # noqa: E402
from edgefleet.server.results import read_rows  # noqa: E402
from edgefleet.simulation.runner import app_copy  # noqa: E402

MIXES = ("all-fast", "half-wifi", "quarter-cellular")
MODES = ("full", "compact")
# ``none``: every node every round, one wait (``round-timeout``) for all, as before issue 26's
# deadline; ``deadline``: energy-age selection (batteries always on, M = the fleet) with
# ``selection.deadline`` and ``timeout-mode = expected`` (each device waited for after its own
# observed round).
SELECTIONS = ("none", "deadline")
# ``sync``: rounds with a barrier; ``async``: FedBuff (``aggregation.mode = "async"``, the
# ``async.*`` keys from ``--set``), whose run makes ``ceil(rounds x nodes / async.buffer-size)``
# versions so that its device updates match a synchronous run's (see ``async_versions``).
AGGREGATIONS = ("sync", "async")


@dataclass(frozen=True)
class Variant:
    """One run of a mix and mode: its selection, strategy and aggregation."""

    selection: str = "none"
    strategy: str = "fedavg"
    aggregation: str = "sync"

    def suffix(self, default_strategy: str) -> str:
        """The run name's tail: ``-deadline``, ``-fedsag`` (a strategy other than the first
        of ``--strategy``), ``-async``; empty for the plain synchronous run."""
        parts = [
            self.selection if self.selection != "none" else "",
            self.strategy if self.strategy != default_strategy else "",
            self.aggregation if self.aggregation != "sync" else "",
        ]
        return "".join(f"-{p}" for p in parts if p)


def parse_variants(
    text: str, strategies: list[str], selections: list[str], aggregations: list[str]
) -> list[Variant]:
    """``--variants``: comma-separated runs, each ``+``-joined words of a selection, a
    strategy and an aggregation (``sync``, ``deadline``, ``fedsag+deadline``, ``async``;
    what a run leaves out is ``none``, the first ``--strategy`` and ``sync``). Empty: every
    combination of ``--selections`` x ``--strategy`` x ``--aggregation``. Raises ValueError
    naming an unknown word and the valid ones."""
    if not text:
        return [
            Variant(sel, strat, agg)
            for sel in selections
            for strat in strategies
            for agg in aggregations
        ]
    out: list[Variant] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        fields = {"selection": "none", "strategy": strategies[0], "aggregation": "sync"}
        for word in item.split("+"):
            kind = (
                "selection" if word in SELECTIONS
                else "strategy" if word in STRATEGIES
                else "aggregation" if word in AGGREGATIONS
                else None
            )  # fmt: skip
            if kind is None:
                valid = ", ".join((*SELECTIONS, *AGGREGATIONS, *STRATEGIES))
                raise ValueError(f"--variants {item!r}: unknown word {word!r}; valid: {valid}")
            fields[kind] = word
        variant = Variant(**fields)
        if variant in out:
            raise ValueError(f"--variants: {item!r} is given twice")
        out.append(variant)
    if not out:
        raise ValueError("--variants names no run")
    return out


def async_versions(rounds: int, nodes: int, buffer_size: int, updates_x: float = 1.0) -> int:
    """Versions of an asynchronous run whose device updates are ``updates_x`` times those of
    ``rounds`` synchronous rounds of ``nodes`` nodes: ``ceil(updates_x x rounds x nodes /
    buffer_size)``."""
    return max(1, math.ceil(updates_x * rounds * nodes / buffer_size))


def mix_profiles(mix: str, keep_ratios: list[float]) -> list[str]:
    """Per node, its profile under ``mix``: slow links to the lowest keep ratios first."""
    n = len(keep_ratios)
    order = sorted(range(n), key=lambda i: (keep_ratios[i], -i))
    slow, count = {
        "all-fast": ("fast", 0),
        "half-wifi": ("wifi-edge", n // 2),
        "quarter-cellular": ("cellular", max(1, n // 4)),
    }[mix]
    profiles = ["fast"] * n
    for i in order[:count]:
        profiles[i] = slow
    return profiles


def _rows(path: Path) -> list[dict[str, Any]]:
    """The rows written so far (the server's reader: a last line still being written is left
    out), [] before the first."""
    return read_rows(path) if path.exists() else []


def run_one(
    fleet: LinkFleet, workdir: Path, name: str, run_config: dict[str, Any], deadline_s: float
) -> dict[str, Any]:
    """Submit one run; sample the link counters as each round's row appears."""
    run_dir = Path(run_config["output-dir"]) / name
    start = fleet.link_bytes()
    samples = [start]
    run = fleet.flwr(
        "run", str(app_copy(workdir / name)), fleet.connection, "--stream",
        "--run-config", config_arg({**run_config, "run-name": name}), name="flwr-run",
    )  # fmt: skip
    t0 = time.monotonic()
    ended: float | None = None
    while not (run_dir / "summary.json").exists():
        fleet.check_alive()
        code = run.popen.poll()
        if code not in (None, 0):
            raise FleetError(f"`flwr run` for {name} failed:\n{run.tail()}")
        if code == 0:
            # `flwr run --stream` ends with 0 when its ServerApp raised (e.g. FleetSilent):
            # without a summary soon after, the run failed, and waiting on is pointless.
            ended = ended or time.monotonic()
            if time.monotonic() - ended > 30:
                raise FleetError(f"`flwr run` for {name} ended without a summary:\n{run.tail()}")
        if time.monotonic() - t0 > deadline_s:
            raise FleetError(f"{name}: no summary within {deadline_s:.0f} s")
        if len(_rows(run_dir / "metrics.jsonl")) >= len(samples):
            samples.append(fleet.link_bytes())
        time.sleep(0.2)
    rows = _rows(run_dir / "metrics.jsonl")
    while len(samples) <= len(rows):
        samples.append(fleet.link_bytes())
    with contextlib.suppress(subprocess.TimeoutExpired):  # a lingering stream: stopped later
        run.popen.wait(timeout=30)
    walls = [0.0] + [float(r["wall_s"]) for r in rows]
    round_s = [round(b - a, 2) for a, b in zip(walls, walls[1:], strict=False)]
    down = [
        [b[0] - a[0] for a, b in zip(s0, s1, strict=True)]
        for s0, s1 in zip(samples, samples[1:], strict=False)
    ]
    up = [
        [b[1] - a[1] for a, b in zip(s0, s1, strict=True)]
        for s0, s1 in zip(samples, samples[1:], strict=False)
    ]
    fleet_view = json.loads((run_dir / "fleet.json").read_text())
    links = {d["device"]: d.get("link") for d in fleet_view.get("devices", [])}
    return {
        "rows": rows,
        "round_s": round_s,
        "down": down[: len(rows)],
        "up": up[: len(rows)],
        "links": links,
    }


def summarize(result: dict[str, Any], profiles: list[str], target: float) -> dict[str, Any]:
    rows = result["rows"]
    slowest = min(range(len(profiles)), key=lambda i: PROFILES[profiles[i]].rate_kbit)
    rate = PROFILES[profiles[slowest]].bytes_per_s
    steady = result["round_s"][1:] or result["round_s"]
    hit = next((r for r in rows if (r.get("test_accuracy") or 0) >= target), None)
    per_round_slow = [
        d[slowest] + u[slowest] for d, u in zip(result["down"], result["up"], strict=True)
    ]
    walls = [round(float(r["wall_s"]), 2) for r in rows]
    run_s = walls[-1] if walls else 0.0
    return {
        "round_s": result["round_s"],
        "row_wall_s": walls,
        "run_s": run_s,
        "steady_round_s": round(statistics.median(steady), 2),
        "wire_bytes_down_per_round": round(statistics.mean(sum(d) for d in result["down"])),
        "wire_bytes_up_per_round": round(statistics.mean(sum(u) for u in result["up"])),
        "slowest_link": profiles[slowest],
        "slowest_link_bytes_per_round": round(statistics.mean(per_round_slow)),
        "slow_link_s": round(statistics.mean(per_round_slow) / rate, 2),
        "app_bytes_down_per_round": round(statistics.mean(r["bytes_down"] for r in rows)),
        "app_bytes_up_per_round": round(statistics.mean(r["bytes_up"] for r in rows)),
        # whole-run totals: an asynchronous run's "rounds" are versions of fewer updates
        "wire_bytes_down_total": sum(sum(d) for d in result["down"]),
        "wire_bytes_up_total": sum(sum(u) for u in result["up"]),
        "app_bytes_down_total": sum(int(r["bytes_down"]) for r in rows),
        "app_bytes_up_total": sum(int(r["bytes_up"]) for r in rows),
        "updates": sum(len(r["participants"]) for r in rows),
        "device_idle": device_idle(result["links"], run_s),
        "staleness": staleness(rows),
        "compact_downloads": [r.get("compact_downloads", 0) for r in rows],
        "deadline_skipped": [r.get("deadline_skipped") or [] for r in rows],
        # status messages sent each round, and the answers taken from earlier ones instead
        "status_queries": [r.get("status_queries") for r in rows],
        "status_reused": [r.get("status_reused") or 0 for r in rows],
        "device_links": result["links"],  # fleet.json's timing per device at the end
        "round_wait_s": [r.get("round_wait_s") for r in rows],
        "participants": [len(r["participants"]) for r in rows],
        "missing": [r.get("missing", []) for r in rows],
        "accuracy": [r.get("test_accuracy") for r in rows],
        "rounds_to_target": hit["round"] if hit else None,
        "seconds_to_target": round(float(hit["wall_s"]), 1) if hit else None,
    }


def device_idle(links: dict[str, Any], run_s: float) -> dict[str, Any]:
    """Each device's idle seconds in a run of ``run_s`` seconds: the run's time less its busy
    time, estimated as ``timed_rounds`` x ``round_s`` (fleet.json's count of timed replies
    and its push-to-reply average, newest half-weighted: an estimate, not a sum), and the
    fleet's idle share (idle device-seconds over device-seconds)."""
    per: dict[str, float] = {}
    for device, link in sorted(links.items()):
        if not isinstance(link, dict) or run_s <= 0:
            continue
        busy = float(link.get("timed_rounds") or 0) * float(link.get("round_s") or 0.0)
        per[device] = round(max(0.0, run_s - busy), 1)
    share = sum(per.values()) / (len(per) * run_s) if per and run_s > 0 else None
    return {"idle_s": per, "idle_share": round(share, 3) if share is not None else None}


def staleness(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """An asynchronous run's staleness: per version ``[min, median, max]`` (its row's
    ``staleness_*``), and over the run the least, the median of the medians and the most;
    None for a synchronous run (no such columns)."""
    per = [
        [r["staleness_min"], r["staleness_median"], r["staleness_max"]]
        for r in rows
        if r.get("staleness_max") is not None
    ]
    if not per:
        return None
    return {
        "per_version": per,
        "min": min(v[0] for v in per),
        "median": statistics.median(v[1] for v in per),
        "max": max(v[2] for v in per),
        "in_flight": [r.get("in_flight") for r in rows],
    }


def accuracy_at(walls: list[float], accuracy: list[Any], budget_s: float) -> Any:
    """The test accuracy of the last evaluated row whose wall time is within ``budget_s``
    (nothing interpolated); None when no evaluated row is."""
    within = [a for w, a in zip(walls, accuracy, strict=True) if w <= budget_s and a is not None]
    return within[-1] if within else None


def deadline_config(
    nodes: int, deadline: float, retry: int = 10, status_max_age: int = 0
) -> dict[str, Any]:
    """Energy-age selection as a deadline filter alone: every battery always on, M = the
    fleet, so the deadline is the only thing that leaves a device out."""
    return {
        "selection.mode": "energy-age",
        "energy.source": "always-on",
        "selection.max-devices": nodes,
        "selection.deadline": deadline,
        "selection.deadline-retry": retry,
        "selection.status-max-age": status_max_age,
        "timeout-mode": "expected",
    }


def variant_config(v: Variant, args: argparse.Namespace, versions: int) -> dict[str, Any]:
    """The run-config keys that make a run ``v`` (on top of the shared ones and --set)."""
    cfg: dict[str, Any] = {
        "strategy": v.strategy,
        "aggregation.mode": v.aggregation,
        "num-server-rounds": versions if v.aggregation == "async" else args.rounds,
    }
    if v.selection == "deadline":
        cfg.update(
            deadline_config(args.nodes, args.deadline, args.deadline_retry, args.status_max_age)
        )
    return cfg


def declare_links(
    fleet: LinkFleet, configs: list[dict[str, Any]], profiles: list[str], declared: list[Any]
) -> None:
    """Restart each node whose declared link (``link-kbps`` in its node config) is not its
    profile's rate, declaring it: a node config is fixed when a SuperNode starts."""
    changed = [
        i for i, prof in enumerate(profiles) if declared[i] != float(PROFILES[prof].rate_kbit)
    ]
    if not changed:
        return
    for i in changed:
        fleet.stop_node(i)
    # A node stopped while its reply to the last run was still crawling up a slow link can
    # exit without deactivating; the SuperLink then refuses its key (the new SuperNode exits
    # with code 305) until it marks the old one offline, up to 2 x 30 s after its last
    # heartbeat. So wait for the stopped nodes to leave the online list before starting them.
    deadline = time.monotonic() + 120
    while len(fleet.online_nodes()) > len(profiles) - len(changed):
        if time.monotonic() > deadline:
            raise FleetError(f"nodes {changed} still online 120 s after they were stopped")
        time.sleep(2.0)
    for i in changed:
        rate = float(PROFILES[profiles[i]].rate_kbit)
        fleet.start_node(i, {**configs[i], "link-kbps": rate})
        declared[i] = rate
    fleet.wait_for_nodes(len(profiles), timeout=120)
    print(f"link_fleet: nodes {changed} restarted to declare their links", file=sys.stderr)


def ratios(
    results: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Per run, against the all-fast synchronous run of its download mode (``all-fast-MODE``:
    no deadline, the first strategy): seconds to the target over that run's (the 1.5x target);
    the accuracy of its last evaluated row within that run's wall time (the *budget*, the
    same for every run) minus that run's final accuracy (the 1-point target); and its final
    accuracy minus that of the same mix without a deadline (issue 26's comparison).
    ``baseline``: the runs of another results file whose ``all-fast-MODE`` stands in where
    ``results`` has none (a sweep of one variant against an earlier line's baseline)."""
    out: dict[str, Any] = {}
    for name, res in results.items():
        mix, mode, *_ = _parts(name)
        base = results.get(f"all-fast-{mode}") or (baseline or {}).get(f"all-fast-{mode}")
        same_mix = results.get(f"{mix}-{mode}")
        t, t0 = res["seconds_to_target"], base and base["seconds_to_target"]
        acc = res["accuracy"][-1] if res["accuracy"] else None
        acc0 = same_mix["accuracy"][-1] if same_mix and same_mix["accuracy"] else None
        budget = base["run_s"] if base and base.get("run_s") else None
        at = accuracy_at(res["row_wall_s"], res["accuracy"], budget) if budget else None
        fast_acc = base["accuracy"][-1] if base and base["accuracy"] else None
        time_ratio = round(t / t0, 2) if t and t0 else None
        gap = round(at - fast_acc, 4) if at is not None and fast_acc is not None else None
        out[name] = {
            "time_to_target_vs_all_fast": time_ratio,
            "budget_s": budget,
            "accuracy_at_budget": at,
            "accuracy_at_budget_minus_all_fast": gap,
            "meets_time": time_ratio is not None and time_ratio <= 1.5,
            "meets_accuracy": gap is not None and gap >= -0.01,
            "final_accuracy_minus_no_deadline": (
                round(acc - acc0, 4) if acc is not None and acc0 is not None else None
            ),
        }
    return out


def _parts(name: str) -> list[str]:
    """A run's name as (mix, mode, selection...)."""
    for mix in MIXES:
        if name.startswith(mix + "-"):
            return [mix, *name[len(mix) + 1 :].split("-")]
    raise ValueError(f"run name {name!r} starts with no mix of {MIXES}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--model", default="mlp", help="mlp (0.8 MB) is prunable; smallcnn 1.7 MB")
    ap.add_argument("--keep-ratios", default="1.0,0.5", help="cycled over node index")
    ap.add_argument("--target", type=float, default=0.7, help="test accuracy to reach")
    ap.add_argument("--round-timeout", type=float, default=300.0)
    ap.add_argument("--eval-samples", type=int, default=1000)
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--selections", default="none", help=f"of {', '.join(SELECTIONS)}")
    ap.add_argument("--deadline", type=float, default=20.0, help="selection.deadline, seconds")
    ap.add_argument("--deadline-retry", type=int, default=10, help="selection.deadline-retry")
    ap.add_argument(
        "--status-max-age", type=int, default=0,
        help="selection.status-max-age of the deadline runs (0: a status query every round)",
    )  # fmt: skip
    ap.add_argument(
        "--declare-links", action="store_true",
        help="each node declares its profile's rate (node config link-kbps), restarted per mix",
    )  # fmt: skip
    ap.add_argument(
        "--strategy", default="fedavg",
        help=f"strategies, comma-separated, of {', '.join(STRATEGIES)} (fedsag: a skipped "
        "device's last update stays in the server's SAGA memory); the first is the baseline's",
    )  # fmt: skip
    ap.add_argument(
        "--aggregation", default="sync",
        help=f"of {', '.join(AGGREGATIONS)} (async: FedBuff, its knobs from --set async.*)",
    )  # fmt: skip
    ap.add_argument(
        "--variants", default="",
        help="the runs per mix and mode instead of every combination of --selections x "
        "--strategy x --aggregation: comma-separated, each +-joined words "
        "(e.g. sync,deadline,fedsag+deadline,async)",
    )  # fmt: skip
    add_set_arg(ap)
    ap.add_argument(
        "--baseline", type=Path, default=None, metavar="RESULTS.json",
        help="a results file whose all-fast-MODE run is the ratios' baseline where this "
        "invocation runs none (e.g. a sweep of --variants async on the mixed fleets)",
    )  # fmt: skip
    ap.add_argument(
        "--async-updates", type=float, default=1.0, metavar="X",
        help="an async run's device updates as a multiple of a sync run's (1: the same "
        "work; more: async may use the wall time its fast devices no longer spend waiting; "
        "accuracy is compared at the all-fast run's wall time either way)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="4 nodes, 3 rounds, 3 local steps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.nodes, args.rounds, args.local_steps = 4, 3, 3
    mixes = [m for m in args.mixes.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    selections = [m for m in args.selections.split(",") if m]
    strategies = [m for m in args.strategy.split(",") if m]
    aggregations = [m for m in args.aggregation.split(",") if m]
    for value, valid, what in (
        (mixes, MIXES, "--mixes"),
        (modes, MODES, "--modes"),
        (selections, SELECTIONS, "--selections"),
        (strategies, STRATEGIES, "--strategy"),
        (aggregations, AGGREGATIONS, "--aggregation"),
    ):
        bad = [v for v in value if v not in valid]
        if bad or not value:
            ap.error(f"{what}: unknown {bad or 'nothing'}; valid: {', '.join(valid)}")
    try:
        variants = parse_variants(args.variants, strategies, selections, aggregations)
    except ValueError as e:
        ap.error(str(e))
    sets = parse_sets(ap, args.set)
    baseline = None
    if args.baseline is not None:
        try:
            baseline = json.loads(args.baseline.read_text().strip().splitlines()[-1])["runs"]
        except (OSError, ValueError, KeyError, IndexError) as e:
            ap.error(f"--baseline {args.baseline}: not a link_fleet results file ({e})")
    try:  # a bad key or value fails here, before a fleet starts
        parse_run_config({**sets, **deadline_config(args.nodes, args.deadline, 0)})
    except ValueError as e:
        ap.error(str(e))
    # Each variant's own settings, checked before a fleet starts: a combination that the run
    # config refuses (async with the deadline's energy-age selection) is an error when named
    # in --variants and left out, with its reason, of an axes product.
    buffer = int(parse_run_config(sets).aggregation.buffer_size)
    if not 0 < args.async_updates <= 10:
        ap.error(f"--async-updates {args.async_updates}: must be in (0, 10]")
    versions = async_versions(args.rounds, args.nodes, buffer, args.async_updates)
    skipped: dict[str, str] = {}
    kept: list[Variant] = []
    for v in variants:
        try:
            parse_run_config({**sets, **variant_config(v, args, versions), "min-nodes": args.nodes})
        except ValueError as e:
            if args.variants:
                ap.error(f"variant {v.suffix(strategies[0]) or 'sync'}: {e}")
            skipped[v.suffix(strategies[0])] = str(e)
            continue
        kept.append(v)
    variants = kept
    why = unavailable()
    if why:
        print(f"link_fleet: {why}", file=sys.stderr)
        return 2
    keep = [float(k) for k in args.keep_ratios.split(",")]
    keep_ratios = [keep[i % len(keep)] for i in range(args.nodes)]
    work = Path(tempfile.mkdtemp(prefix="link-fleet-bench-"))
    base = {
        "num-server-rounds": args.rounds,
        "local-steps": args.local_steps,
        "model": args.model,
        "min-nodes": args.nodes,
        "round-timeout": args.round_timeout,
        "eval-samples": args.eval_samples,
        "seed": args.seed,
        "output-dir": str(work / "out"),
        **sets,
    }
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    configs = node_configs(args.nodes, keep_ratios)
    fast = float(PROFILES["fast"].rate_kbit)
    declared: list[Any] = [fast if args.declare_links else None] * args.nodes
    start = [{**c, "link-kbps": fast} if args.declare_links else c for c in configs]
    with running_fleet(
        work / "fleet", ["fast"] * args.nodes, start, database=work / "fleet" / "state.db"
    ) as fleet:
        fleet_up_s = round(time.monotonic() - t0, 1)
        for mix in mixes:
            profiles = mix_profiles(mix, keep_ratios)
            for i, prof in enumerate(profiles):
                fleet.set_profile(i, prof)
            if args.declare_links:
                declare_links(fleet, configs, profiles, declared)
            for mode in modes:
                for v in variants:
                    name = f"{mix}-{mode}{v.suffix(strategies[0])}"
                    print(f"link_fleet: {name} {profiles}", file=sys.stderr, flush=True)
                    cfg = {
                        **base,
                        "pruning.compact-download": mode == "compact",
                        **variant_config(v, args, versions),
                    }
                    limit = args.round_timeout * (int(cfg["num-server-rounds"]) + 2)
                    load = os.getloadavg()[0]
                    try:
                        res = run_one(fleet, work, name, cfg, limit)
                    except FleetError as e:  # one run's failure is a result, not the end
                        failed[name] = {**asdict(v), "profiles": profiles, "error": str(e)[-3000:]}
                        print(f"link_fleet: {name} FAILED: {str(e)[-500:]}", file=sys.stderr)
                        continue
                    results[name] = {
                        # the 1-minute load average at the run's start and end (2 cores,
                        # shared: wall times move with it)
                        "load_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
                        "profiles": profiles,
                        **asdict(v),
                        "num_server_rounds": cfg["num-server-rounds"],
                        **summarize(res, profiles, args.target),
                    }
                    print(f"link_fleet: {name} {results[name]['round_s']}", file=sys.stderr)
                    # Every node trains every round without a deadline: fewer participants
                    # mean a node never rejoined (the run waited min-nodes out without it),
                    # and the run's times are not the mix's.
                    short = (
                        v.selection == "none"
                        and v.aggregation == "sync"
                        and any(n < args.nodes for n in results[name]["participants"])
                    )
                    results[name]["short_fleet"] = short
                    if short:
                        print(f"link_fleet: {name}: a round ran short of {args.nodes} nodes "
                              f"{results[name]['participants']}", file=sys.stderr)  # fmt: skip
    leftovers = fleet.leftovers()
    sizes = {
        "nodes": args.nodes,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "model": args.model,
        "keep_ratios": keep_ratios,
        "target": args.target,
        "round_timeout": args.round_timeout,
        "mixes": mixes,
        "modes": modes,
        "selections": selections,
        "deadline": args.deadline,
        "deadline_retry": args.deadline_retry,
        "status_max_age": args.status_max_age,
        "declare_links": args.declare_links,
        "strategy": strategies[0] if len(strategies) == 1 else strategies,
        "aggregations": aggregations,
        "variants": [asdict(v) for v in variants],
        "skipped_variants": skipped,
        "async_versions": versions,
        "async_updates": args.async_updates,
        "budget": (
            "an async run makes ceil(async_updates x rounds x nodes / async.buffer-size) "
            "versions (async_updates 1: its device updates match a sync run's); every run's "
            "accuracy is compared at the wall time of the all-fast sync run of its mode "
            "(ratios.budget_s): its last evaluated row within that time"
        ),
        "set": sets,
        "seed": args.seed,
    }
    line = {
        "benchmark": "link_fleet",
        **sizes,  # also at top level, where the earlier results files have them
        "sizes": sizes,
        "profiles": {
            p.name: {"rate_kbit": p.rate_kbit, "latency_ms": p.latency_ms}
            for p in PROFILES.values()
        },
        "fleet_up_s": fleet_up_s,
        "runs": results,
        "failed_runs": failed,
        "ratios": ratios(results, baseline),
        "baseline_file": str(args.baseline) if args.baseline else None,
        "leftovers": leftovers,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(dumps(line))
    return 0 if not leftovers and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
