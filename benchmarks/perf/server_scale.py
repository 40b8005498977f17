"""What EdgeFleet's server costs per round as the fleet grows, with devices that answer at once.

The ServerApp's own code paths (``edgefleet.server.app``: ``build_strategy``, ``screening_for``,
``build_loop`` with the metrics, fleet and checkpoint writers, the census before round 1) run
for ``--rounds`` rounds on ``tests/fakes.py``'s in-process grid, whose ``--devices`` devices
answer train messages and status queries the moment they get them (each with a reply built
before the run, so a device costs the server nothing but its messages). Next to it, Flower's
own ``FedAvg.start`` runs the same rounds on the same grid: what a plain Flower server spends.
No Ray, no Simulation Engine, no training: the figures are the server side alone, so they
hold on a loaded machine too (the other side of a round, the Simulation Engine's cost per
message, is counted in messages per round, not timed).

Per fleet size and scenario (``default``: the selection of ``sim_overhead.py``, Flower's
FedAvg sampling ``--participants`` nodes; ``energy-age``: energy-aware selection of M =
``--participants`` devices with status queries), one JSON line on stdout::

    {"sizes": {"100": {"default": {"server_s_per_round": ..., "flower_s_per_round": ...,
      "messages_per_round": ..., "flower_messages_per_round": ..., "phases": {...}}}}}

``server_s_per_round`` is the median over rounds 2..R of the ServerApp's time per round (the
central evaluation a no-op, the devices' reply time excluded); ``phases`` splits the mean
round into the loop's parts and each writer (cProfile-free: ``time.perf_counter`` around
them). Run it at two commits to compare before and after::

    python -m benchmarks.perf.server_scale --devices 10 100 1000 --participants 20
    python -m benchmarks.perf.server_scale --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg


def _root() -> Path:
    """The tree whose ``edgefleet`` and ``tests/fakes.py`` are measured: ``--root`` (how
    ``--against`` runs another commit's code), else this file's."""
    if "--root" in sys.argv:
        return Path(sys.argv[sys.argv.index("--root") + 1]).resolve()
    return Path(__file__).resolve().parents[2]


sys.path.insert(0, str(_root()))

from edgefleet.arrays import to_record  # noqa: E402
from edgefleet.config import RunConfig, parse_run_config  # noqa: E402
from edgefleet.loop.base import build_loop  # noqa: E402
from edgefleet.loop.roundloop import RoundCallback, RoundResult  # noqa: E402
from edgefleet.server import app as server_app  # noqa: E402
from edgefleet.server.checkpoint import Checkpointer, run_identity  # noqa: E402
from edgefleet.server.fleet import FleetWriter  # noqa: E402
from edgefleet.server.results import MetricsWriter  # noqa: E402

try:  # the in-process grid of edgefleet.simulation, where the tree has one
    from edgefleet.simulation.inprocess import InProcessGrid as FakeGrid  # noqa: E402
except ImportError:  # older trees (an --against commit): the test fake it grew from
    from tests.fakes import FakeGrid  # type: ignore[no-redef]  # noqa: E402

SCENARIOS = ("default", "energy-age")


def model_arrays(cfg: RunConfig) -> ArrayRecord:
    """The run's initial model (its shapes are what every message carries)."""
    import torch

    from edgefleet.task.datasets import dataset_info
    from edgefleet.task.models import build_model
    from edgefleet.task.train import get_arrays

    torch.manual_seed(cfg.seed)
    info = dataset_info(cfg.data.dataset)
    return get_arrays(build_model(cfg.train.model, info.input_shape, info.num_classes))


class Fleet:
    """``n`` devices answering at once: node i is device i. A train reply is the global
    model plus a small per-device step (so that the update-norm screening has norms to
    work on), built before the run; a status answer says feasible, with a battery level
    and telemetry, as EdgeFleet's ClientApp with its energy mod does."""

    def __init__(self, n: int, initial: ArrayRecord, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.node_ids = [1000 + i for i in range(n)]  # not 0..n-1: node != device
        self.replies: dict[int, RecordDict] = {}
        self.statuses: dict[int, RecordDict] = {}
        for i, node in enumerate(self.node_ids):
            arrays = {
                k: v.numpy() + (0.01 * rng.standard_normal(v.shape)).astype(v.numpy().dtype)
                if v.numpy().dtype.kind == "f"
                else v.numpy()
                for k, v in initial.items()
            }
            metrics = MetricRecord(
                {
                    "num-examples": 640,
                    "train-loss": 1.0 + 0.01 * i,
                    "device-id": i,
                    "energy-spent": 0.0,
                    "train-time-s": 0.1,
                    "kept-fraction": 1.0,
                }
            )
            self.replies[node] = RecordDict({"arrays": to_record(arrays), "metrics": metrics})
            status = MetricRecord(
                {
                    "device-id": i,
                    "present": 1,
                    "num-partitions": n,
                    "battery-level": 5.0,
                    "feasible": 1,
                }
            )
            telemetry = ConfigRecord(
                {"battery-capacity": 10.0, "harvested": 0.5, "energy-spent": 3.0,
                 "arch": "x86_64", "edgefleet-version": "0.1.0"}
            )  # fmt: skip
            self.statuses[node] = RecordDict({"status": status, "telemetry": telemetry})
        self.reply_s = 0.0  # time spent building replies (excluded from the server's)
        self.sent: dict[str, int] = defaultdict(int)

    def handler(self, node: int) -> Callable[[Message], Message]:
        def answer(msg: Message) -> Message:
            t0 = time.perf_counter()
            kind = msg.metadata.message_type
            self.sent[kind] += 1
            content = self.statuses[node] if kind == MessageType.QUERY else self.replies[node]
            reply = Message(content, reply_to=msg)
            self.reply_s += time.perf_counter() - t0
            return reply

        return answer

    def grid(self) -> FakeGrid:
        return FakeGrid({n: self.handler(n) for n in self.node_ids})


class Clock(RoundCallback):
    """Notes the time at each round's end (first of the callbacks: before the writers)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.ends: list[tuple[float, float]] = []  # (perf_counter, fleet.reply_s)

    def on_start(self, arrays: ArrayRecord, first_round: int) -> None:
        self.ends = [(time.perf_counter(), self.fleet.reply_s)]

    def after_round(self, result: RoundResult) -> str | None:
        self.ends.append((time.perf_counter(), self.fleet.reply_s))
        return None


class Timed(RoundCallback):
    """A callback with its time per call added to ``phases[name]``."""

    def __init__(self, inner: RoundCallback, name: str, phases: dict[str, float]) -> None:
        self.inner, self.name, self.phases = inner, name, phases

    def on_start(self, arrays: ArrayRecord, first_round: int) -> None:
        self.inner.on_start(arrays, first_round)

    def after_round(self, result: RoundResult) -> str | None:
        t0 = time.perf_counter()
        out = self.inner.after_round(result)
        self.phases[self.name] += time.perf_counter() - t0
        return out


def timed_method(obj: Any, name: str, label: str, phases: dict[str, float]) -> None:
    method = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            phases[label] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def per_round(ends: list[tuple[float, float]]) -> list[float]:
    """Each round's server time: wall time minus the devices' reply-building time."""
    return [(b[0] - a[0]) - (b[1] - a[1]) for a, b in zip(ends, ends[1:], strict=False)]


def run_edgefleet(cfg: RunConfig, fleet: Fleet, initial: ArrayRecord, work: Path) -> dict:
    run_dir = work / f"run-{len(fleet.node_ids)}-{cfg.energy.selection}"
    run_dir.mkdir(parents=True)
    random.seed(cfg.seed)
    strategy = server_app.build_strategy(cfg, None, run_dir)
    grid = fleet.grid()
    fleet.sent.clear()
    phases: dict[str, float] = defaultdict(float)
    clock = Clock(fleet)
    checkpointer = Checkpointer(run_dir, strategy, run_identity(cfg))
    writers = [
        Timed(MetricsWriter(run_dir), "metrics_writer", phases),
        Timed(FleetWriter(run_dir, None), "fleet_writer", phases),
        Timed(checkpointer, "checkpoint", phases),
    ]
    loop = build_loop(
        strategy,
        grid,  # type: ignore[arg-type]
        before=[clock],
        after=writers,
        evaluate_fn=lambda rnd, arrays: {"test_accuracy": 0.5, "test_loss": 1.0},
        evaluate_every=cfg.server.evaluate_every,
        round_timeout=cfg.server.round_timeout,
        screening=server_app.screening_for(cfg),
    )
    checkpointer.loop_state = loop.state_dict
    timed_method(loop, "_configure", "configure", phases)
    timed_method(loop, "_screen", "screen", phases)
    timed_method(loop, "_aggregate", "aggregate", phases)
    timed_method(loop.grid, "send_and_receive", "send_and_receive", phases)
    server_app.fleet_census(loop, cfg, 1)
    census = dict(fleet.sent)
    fleet.sent.clear()
    phases.clear()
    fleet.reply_s = 0.0
    loop.run(initial, cfg.server.num_rounds, ConfigRecord())
    rounds = per_round(clock.ends)
    n = cfg.server.num_rounds
    # send_and_receive includes the devices' reply building: take it out of that phase.
    phases["send_and_receive"] -= fleet.reply_s
    return {
        "server_s_per_round": _median(rounds[1:]),
        "first_round_s": round(rounds[0], 5),
        "messages_per_round": {k: v / n for k, v in fleet.sent.items()},
        "census_messages": census,
        "phases": {k: round(v / n, 5) for k, v in sorted(phases.items())},
        "fleet_json_bytes": (run_dir / "fleet.json").stat().st_size,
        "checkpoint_bytes": (run_dir / "checkpoint.npz").stat().st_size,
    }


def run_flower(cfg: RunConfig, fleet: Fleet, initial: ArrayRecord) -> dict:
    """Flower's own FedAvg.start on the same grid, as benchmarks/_flower_app runs it."""
    random.seed(cfg.seed)
    clock = Clock(fleet)
    n = len(fleet.node_ids)

    class TimedFedAvg(FedAvg):
        def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> Any:
            out = super().aggregate_train(server_round, replies)
            clock.after_round(None)  # type: ignore[arg-type]
            return out

    strategy = TimedFedAvg(
        fraction_train=cfg.server.fraction_train,
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=n,
    )
    grid = fleet.grid()
    fleet.sent.clear()
    clock.on_start(initial, 1)
    strategy.start(
        grid=grid,  # type: ignore[arg-type]
        initial_arrays=initial,
        num_rounds=cfg.server.num_rounds,
        evaluate_fn=lambda rnd, arrays: MetricRecord({"accuracy": 0.5}),
    )
    rounds = per_round(clock.ends)
    return {
        "flower_s_per_round": _median(rounds[1:]),
        "flower_messages_per_round": {k: v / cfg.server.num_rounds for k, v in fleet.sent.items()},
    }


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 5) if xs else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """This tree's figures: per fleet size and scenario."""
    out: dict[str, Any] = {"loadavg_start": os.getloadavg()[0]}
    sizes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="server-scale-") as tmp:
        for n in args.devices:
            m = min(args.participants, n)
            raw = {
                "num-server-rounds": args.rounds,
                "dataset": args.dataset,
                "model": args.model,
                "seed": args.seed,
                "min-nodes": n,
                "fraction-train": m / n,
                "output-dir": tmp,
            }
            cfg = parse_run_config(raw)
            initial = load_model(args.model_npz) if args.model_npz else model_arrays(cfg)
            fleet = Fleet(n, initial, args.seed)
            per: dict[str, Any] = {}
            for scenario in args.scenarios:
                sc = cfg
                if scenario == "energy-age":  # batteries that never run out: all feasible
                    sc = parse_run_config(
                        {**raw, "selection.mode": "energy-age", "selection.max-devices": m,
                         "energy.source": "always-on"}
                    )  # fmt: skip
                fig = run_edgefleet(sc, fleet, initial, Path(tmp))
                if scenario == "default":
                    fig |= run_flower(cfg, fleet, initial)
                    fig["ratio_to_flower_server"] = (
                        round(fig["server_s_per_round"] / fig["flower_s_per_round"], 3)
                        if fig["flower_s_per_round"]
                        else None
                    )
                per[scenario] = fig
                print(f"{n} devices, {scenario}: {fig}", file=sys.stderr)
            sizes[str(n)] = per
    out["sizes"] = sizes
    out["loadavg_end"] = os.getloadavg()[0]
    return out


def load_model(path: str) -> ArrayRecord:
    with np.load(path) as npz:
        return ArrayRecord({k: Array(npz[k]) for k in npz.files})


def compare(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """``--against COMMIT``: this tree and that commit's, ``--repeat`` times interleaved
    (the machine's speed drifts), each in a process of its own; medians per variant."""
    here = _root()
    with tempfile.TemporaryDirectory(prefix="server-scale-base-") as tmp:
        base = Path(tmp) / "tree"
        base.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(here), "archive", args.against], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        npz = Path(tmp) / "model.npz"
        cfg = parse_run_config({"dataset": args.dataset, "model": args.model, "seed": args.seed})
        np.savez(npz, **{k: v.numpy() for k, v in model_arrays(cfg).items()})
        runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
        for _ in range(args.repeat):
            for name, root in (("base", base), ("head", here)):
                cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--root", str(root),
                       "--model-npz", str(npz)]  # fmt: skip
                env = {**os.environ, "PYTHONPATH": str(root)}
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    commit = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", args.against],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip

    def med(name: str, n: str, scenario: str, key: str) -> float | None:
        xs = [r["sizes"][n][scenario].get(key) for r in runs[name]]
        return _median([x for x in xs if x is not None])

    table: dict[str, Any] = {}
    for n in map(str, args.devices):
        for scenario in args.scenarios:
            row = {
                f"{v}_server_s_per_round": med(v, n, scenario, "server_s_per_round") for v in runs
            }
            if scenario == "default":
                row["flower_s_per_round"] = _median(
                    [r["sizes"][n][scenario]["flower_s_per_round"] for v in runs for r in runs[v]]
                )
                for v in runs:
                    row[f"{v}_ratio_to_flower_server"] = med(
                        v, n, scenario, "ratio_to_flower_server"
                    )
            table.setdefault(n, {})[scenario] = row
    return {"against": commit, "sizes": table, "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--participants", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="10 devices, 3 rounds: does it run")
    p.add_argument("--against", help="also run this commit's code, interleaved, and compare")
    p.add_argument("--repeat", type=int, default=1, help="with --against: interleaved runs")
    p.add_argument("--root", help=argparse.SUPPRESS)  # read before the imports (_root)
    p.add_argument("--model-npz", help=argparse.SUPPRESS)  # the model, built once by --against
    args = p.parse_args()
    if args.smoke:
        args.devices, args.rounds = [10], 3
    params = {
        k: getattr(args, k) for k in ("devices", "participants", "rounds", "dataset", "model")
    }
    if args.against:
        argv = [a for a in sys.argv[1:]]
        i = argv.index("--against")
        del argv[i : i + 2]
        line = {"benchmark": "server_scale", "params": params, **compare(args, argv)}
    else:
        line = {"benchmark": "server_scale", "params": params, **measure(args)}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
