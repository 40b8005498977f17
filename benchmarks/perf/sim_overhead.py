"""How much slower is EdgeFleet on Flower's Simulation Engine than the same work in plain PyTorch?

The same federated work (``--devices`` devices, ``--participants`` of them trained each round,
``--rounds`` rounds of ``--local-steps`` SGD steps, FedAvg) runs as:

- **plain 1 proc**: one process with ``--plain-threads`` torch threads trains the round's
  devices one after another;
- **plain N procs**: ``--plain-procs`` processes with one torch thread each train their share
  of the round's devices; the parent averages;
- **plain Flower** (``--flower``, default on): ``benchmarks/_flower_app``, the same task code
  in a Flower app with Flower's FedAvg and central evaluation every round, run the way a
  Flower user runs it (``flwr run APP`` on its local SuperLink): what Flower's engine costs
  before EdgeFleet adds anything;
- **EdgeFleet**: ``edgefleet run SCENARIO`` as a user types it (a subprocess), one Ray actor
  per core, with central evaluation every round and, as a second figure, every
  ``--evaluate-every-also`` rounds;
- **EdgeFleet in-process** (``--inprocess``, default on): the same command with ``--engine
  inprocess --workers N`` (``--workers``, default one per core): the same ServerApp and
  ClientApp on EdgeFleet's in-process engine, no Ray. Issue 27's targets for its round time:
  1.10x the floor at 10 devices, 1.20x at 100 devices with 20 a round (``targets``).

The plain layouts do what the ClientApp and FedAvg do (the same partitions, initial model,
``train_local`` calls and seeds, the average weighted by ``num-examples``); the faster of the
two is the floor. Round times are medians over rounds 2..R (round 1 carries actor start-up and
the first data load); EdgeFleet's come from its rows' ``wall_s`` and include its central
evaluation, the floor's round has none. The floor also runs EdgeFleet's central evaluation
(``edgefleet.server.app.central_evaluation``) on each round's average, timed apart
(``central_eval_s``): ``ratio_same_work_*`` divides an EdgeFleet round by the floor's round
plus that evaluation where the run evaluated in most rounds (so its median round has one),
the engine's cost over the same work. The
layouts run interleaved ``--repeat`` times and each ratio divides an EdgeFleet figure by the
floor measured next to it, because the machine's speed drifts; ``ratio_compute_normalized``
divides each side's round time by its slowest worker's time inside ``train_local`` that round
first (what EdgeFleet adds on top of the compute, whatever the machine's speed).

Start-up is the wall time from spawning ``edgefleet run`` to the first call of
``edgefleet.client.device.get_device`` (the first statement of the ClientApp's handlers),
timed by ``benchmarks/_trace/sitecustomize.py`` on the run's ``PYTHONPATH`` (no app change);
for plain Flower, from spawning ``flwr run`` to its ClientApp's first call.

Where the CPU goes: each run's processes are sampled (psutil, every 0.5 s) and their CPU
seconds per steady round reported by kind (``cpu_per_round_s``: actors, the simulation
process, SuperLink, SuperExec, Ray's own); ``engine_cpu_per_round_s`` is the SuperLink's and
the SuperExec's, which on 2 cores is taken from the actors. ``--poll-also S`` runs EdgeFleet a
second time per repeat with its SuperExec polling for tasks every S seconds (0.1 was
EdgeFleet's setting before 2026-12-05), side by side with the default.

One JSON line on stdout, progress on stderr::

    python -m benchmarks.perf.sim_overhead                                # 10 x 10 x 20, mnist-5k
    python -m benchmarks.perf.sim_overhead --devices 100 --participants 20  # the fleet line
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from flwr.app import Array, ArrayRecord

from benchmarks._flower_app.flower_app import (  # the same task code as the app
    device_data,
    new_model,
)
from benchmarks.lib.provenance import stamp
from edgefleet.config import RunConfig, parse_run_config
from edgefleet.processes import POLL_VAR, config_arg, toml_value
from edgefleet.server.app import central_evaluation
from edgefleet.task.train import seed_for, train_local
from fleetharness.fleet import processes_with_env

log = logging.getLogger("sim_overhead")
HOOK_DIR = Path(__file__).resolve().parents[1] / "_trace"
ENGINE_KEYS = {"simulation": "edgefleet", "inprocess": "inprocess"}  # a repeat's figure keys
FLOWER_APP = Path(__file__).resolve().parents[1] / "_flower_app"
State = dict[str, np.ndarray]


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# -- the plain-PyTorch floor ------------------------------------------------------------------


def round_devices(args: argparse.Namespace, rnd: int) -> list[int]:
    """The devices a plain round trains: all, or ``--participants`` of them in turn (the
    work is the same whichever they are: steps x batch size each)."""
    k, m = args.devices, args.participants or args.devices
    return sorted({(rnd * m + i) % k for i in range(m)})


def train_one(model: torch.nn.Module, data: Any, cfg: RunConfig, state: State, pid: int, rnd: int):
    """One ClientApp train call: load the global model, train, return (state, n, seconds)."""
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    t0 = time.perf_counter()
    t = cfg.train
    res = train_local(model, data, steps=t.local_steps, batch_size=t.batch_size, lr=t.lr,
                      momentum=t.momentum, seed=seed_for(cfg.seed, pid, rnd))  # fmt: skip
    dt = time.perf_counter() - t0
    return (
        {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
        res.num_examples,
        dt,
    )


def fedavg(updates: list[tuple[State, int]]) -> State:
    total = sum(n for _, n in updates)
    return {k: sum(s[k] * (n / total) for s, n in updates) for k in updates[0][0]}


def _worker(conn: Any, raw: dict[str, Any], n: int) -> None:
    """A plain worker process: one torch thread; trains the devices it is sent."""
    torch.set_num_threads(1)
    cfg = parse_run_config(raw)
    model, data = new_model(cfg), {pid: device_data(cfg, n, pid) for pid in range(n)}
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        rnd, pids, state = msg
        conn.send([(pid, *train_one(model, data[pid], cfg, state, pid, rnd)) for pid in pids])


def run_plain(args: argparse.Namespace, raw: dict[str, Any], procs: int) -> dict[str, Any]:
    """The floor: ``procs`` = 0 is one process with ``--plain-threads`` threads, else that
    many one-thread worker processes."""
    cfg = parse_run_config(raw)
    workers = []
    if procs:
        ctx = mp.get_context("spawn")
        for _ in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, raw, args.devices))
            proc.start()
            workers.append((proc, parent))
        assert all(conn.recv() == "ready" for _, conn in workers)
    else:
        torch.set_num_threads(args.plain_threads)
        model = new_model(cfg)
        data = {pid: device_data(cfg, args.devices, pid) for pid in range(args.devices)}
    state = {k: v.detach().numpy().copy() for k, v in new_model(cfg).state_dict().items()}
    # EdgeFleet's own central evaluation (the function its ServerApp calls every round), run
    # on the averaged model after the round and timed apart: the floor's round is training
    # and averaging alone, and round + evaluation is the same work as an EdgeFleet round that
    # evaluates.
    central = central_evaluation(cfg).evaluate
    rounds, paths, evals = [], [], []
    try:
        for rnd in range(1, args.rounds + 1):
            t0 = time.perf_counter()
            pids = round_devices(args, rnd)
            if procs:
                shares = [list(s) for s in np.array_split(pids, procs)]
                for (_, conn), share in zip(workers, shares, strict=True):
                    conn.send((rnd, [int(p) for p in share], state))
                out = [conn.recv() for _, conn in workers]
                paths.append(max(sum(r[3] for r in share) for share in out))
                results = sorted((r for share in out for r in share), key=lambda r: r[0])
            else:
                results = [
                    (pid, *train_one(model, data[pid], cfg, state, pid, rnd)) for pid in pids
                ]
                paths.append(sum(r[3] for r in results))
            state = fedavg([(s, n) for _, s, n, _ in results])
            rounds.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            central(rnd, ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in state.items()}))
            evals.append(time.perf_counter() - t1)
    finally:
        for proc, conn in workers:
            conn.send(None)
            proc.join(timeout=10)
    torch.set_num_threads(os.cpu_count() or 1)
    steady = slice(1, None) if len(rounds) > 1 else slice(None)
    return {
        "round_s": median(rounds[steady]),
        "central_eval_s": median(evals[steady]),
        "round_over_train_path": median(
            [r / p for r, p in zip(rounds, paths, strict=True)][steady]
        ),
    }


# -- EdgeFleet ----------------------------------------------------------------------------


def run_edgefleet(
    args: argparse.Namespace,
    raw: dict[str, Any],
    work: Path,
    engine: str = "simulation",
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``edgefleet run`` (on ``engine``) in a subprocess with the timing hook; its figures.
    ``extra_env``: environment variables for this run only."""
    name = f"simovh-{uuid.uuid4().hex[:8]}"
    federation = {"num-supernodes": args.devices, "client-resources-num-cpus": 1}
    scenario = work / f"{name}.toml"
    scenario.write_text(
        "[federation]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in federation.items())
        + "[run-config]\n" + "".join(f'"{k}" = {toml_value(v)}\n' for k, v in raw.items())
        + f'"output-dir" = {toml_value(str(work))}\n"run-name" = "{name}"\n'
    )  # fmt: skip
    trace, tag = work / f"{name}.trace.jsonl", uuid.uuid4().hex
    env = {**os.environ, **(extra_env or {})}
    env |= {"EDGEFLEET_BENCH_TRACE": str(trace), "EDGEFLEET_BENCH_TAG": tag}
    if args.cold_cache:  # an empty data and partition cache, as on a machine's first run
        env["EDGEFLEET_CACHE_DIR"] = str(Path(tempfile.mkdtemp(prefix="cache-", dir=work)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOK_DIR), env.get("PYTHONPATH")]))
    cmd = [str(Path(sys.executable).parent / "edgefleet"), "run", str(scenario), "--quiet"]
    if engine == "inprocess":
        cmd += ["--engine", "inprocess"]
        cmd += ["--workers", str(args.workers)] if args.workers else []
    t_cmd = time.time()
    with CpuSampler(f"EDGEFLEET_BENCH_TAG={tag}") as cpu:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    # `edgefleet run` stops its processes itself: anything left with our tag is a bug.
    left = processes_with_env(f"EDGEFLEET_BENCH_TAG={tag}")
    for entry in left:
        os.kill(int(entry.split(":")[0]), signal.SIGKILL)
    run_dir = work / name
    if proc.returncode != 0:
        raise RuntimeError(f"edgefleet run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    walls = [r["wall_s"] for r in rows]
    rounds = [walls[0]] + [b - a for a, b in zip(walls, walls[1:], strict=False)]
    events = [json.loads(x) for x in trace.read_text().splitlines() if x.strip()]
    return {
        "round_s": median(rounds[1:]),
        "first_round_s": round(rounds[0], 3),
        "final_accuracy": json.loads((run_dir / "summary.json").read_text())["final_accuracy"],
        "evaluated_rounds": sum(bool(r.get("evaluated")) for r in rows),
        **trace_figures(events, t_cmd),
        **cpu_figures(cpu, sorted(e["t0"] + e["dt"] for e in events if e["kind"] == "round")),
        "leftover_processes": left,
    }


def trace_figures(events: list[dict[str, Any]], t_cmd: float) -> dict[str, Any]:
    """Start-up and per-round figures from the hook's events."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by[e["kind"]].append(e)
    devices = sorted(by["get_device"], key=lambda e: e["t0"])
    builds = [e["dt"] for e in devices if e["miss"]]
    windows = [(e["round"], e["t0"], e["t0"] + e["dt"]) for e in by["round"]]
    path: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for e in by["train_local"]:  # each worker's time in train_local, per round
        rnd = next((r for r, a, b in windows if a <= e["t0"] <= b), None)
        if rnd is not None:
            path[rnd][e["pid"]] += e["dt"]
    steady = [(r, b - a) for r, a, b in windows if r >= 2 and path[r]]
    evals = [e["dt"] for e in by["central_eval"]]
    ray = by["ray_init"][0] if by["ray_init"] else None
    return {
        "startup_to_first_client_call_s": round(devices[0]["t0"] - t_cmd, 3) if devices else None,
        "ray_init_s": round(ray["dt"], 3) if ray else None,
        "ray_init_start_s": round(ray["t0"] - t_cmd, 3) if ray else None,
        "first_device_build_s": round(builds[0], 3) if builds else None,
        "device_builds": len(builds),
        "central_eval_s": median(evals),
        "round_over_train_path": median([dt / max(path[r].values()) for r, dt in steady]),
    }


# -- where the CPU goes --------------------------------------------------------------------

# A process's kind from its command line, first match wins.
KINDS = (
    ("ClientAppActor", "actor"),
    ("flwr-simulation", "simulation"),
    ("flower-superlink", "superlink"),
    ("flower-superexec", "superexec"),
    ("raylet", "ray"),
    ("gcs_server", "ray"),
    ("ray", "ray"),
)


def process_kind(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    return next((kind for needle, kind in KINDS if needle in text), "other")


class CpuSampler:
    """CPU seconds (user + system) of every process of one run, sampled every ``interval``
    s while it runs: how much of the 2 cores the engine's own processes take from the
    actors that train. A process is the run's when its environment holds ``marker`` (each
    new PID's environment is read once); one that ended keeps its last reading."""

    def __init__(self, marker: str, interval: float = 0.5) -> None:
        self.marker, self.interval = marker.encode(), interval
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._procs: dict[int, psutil.Process | None] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in psutil.pids():
                if pid not in self._procs:
                    self._procs[pid] = self._claim(pid)
            for pid, proc in self._procs.items():
                if proc is not None:
                    with contextlib.suppress(psutil.Error):
                        # the kind read again: a Ray worker becomes an actor after it starts
                        t, kind = proc.cpu_times(), process_kind(proc.cmdline())
                        self._last[pid] = (kind, t.user + t.system)
            self.samples.append((time.time(), dict(self._last)))
            self._stop.wait(self.interval)

    def _claim(self, pid: int) -> psutil.Process | None:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return psutil.Process(pid) if self.marker in f.read() else None
        except (OSError, psutil.Error):
            return None

    def per_round(self, t0: float, t1: float, rounds: int) -> dict[str, float]:
        """CPU seconds per round by kind between wall times ``t0`` and ``t1``."""

        def at(t: float) -> dict[str, float]:
            snap = max((s for s in self.samples if s[0] <= t), key=lambda s: s[0], default=None)
            out: dict[str, float] = defaultdict(float)
            for kind, cpu in (snap[1] if snap else {}).values():
                out[kind] += cpu
            return out

        a, b = at(t0), at(t1)
        return {k: round((b[k] - a.get(k, 0.0)) / rounds, 3) for k in sorted(b)}


def cpu_figures(cpu: CpuSampler, round_ends: list[float]) -> dict[str, Any]:
    """CPU per steady round (rounds 3..R: round 1 carries start-up, round 2 the first
    builds of many devices), by kind; ``engine_cpu_per_round_s``: the SuperLink's and the
    SuperExec's, which train nothing."""
    if len(round_ends) < 4:
        return {}
    by_kind = cpu.per_round(round_ends[1], round_ends[-1], len(round_ends) - 2)
    engine = by_kind.get("superlink", 0.0) + by_kind.get("superexec", 0.0)
    return {"cpu_per_round_s": by_kind, "engine_cpu_per_round_s": round(engine, 3)}


# -- the same app on plain Flower --------------------------------------------------------


def run_flower(args: argparse.Namespace, raw: dict[str, Any], work: Path) -> dict[str, Any]:
    """``benchmarks/_flower_app`` (Flower's FedAvg, the same task code, central evaluation
    every round) the way a Flower user runs it: ``flwr run APP`` on its local SuperLink."""
    tag = uuid.uuid4().hex
    trace, home = work / f"flower-{tag}.trace.jsonl", work / f"flwr-home-{tag}"
    venv_bin = str(Path(sys.executable).parent)  # `flwr run` starts `flower-superlink` by name
    env = {
        **os.environ,
        "PATH": os.pathsep.join([venv_bin, os.environ.get("PATH", "")]),
        "FLWR_HOME": str(home),
        "EDGEFLEET_BENCH_TAG": tag,
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    keys = ("num-server-rounds", "min-nodes", "fraction-train", "dataset", "model", "local-steps")
    run_config = {k: raw[k] for k in keys} | {"seed": raw["seed"], "trace-path": str(trace)}
    federation = {"num-supernodes": args.devices, "client-resources-num-cpus": 1}
    cmd = [str(Path(venv_bin) / "flwr"), "run", str(FLOWER_APP), "--stream", "--federation-config",
           config_arg(federation), "--run-config", config_arg(run_config)]  # fmt: skip
    t_cmd = time.time()
    try:
        with CpuSampler(f"EDGEFLEET_BENCH_TAG={tag}") as cpu:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
    finally:  # `flwr run` leaves its local SuperLink running, by design
        for entry in processes_with_env(f"EDGEFLEET_BENCH_TAG={tag}"):
            os.kill(int(entry.split(":")[0]), signal.SIGKILL)
    events = [json.loads(x) for x in trace.read_text().splitlines()] if trace.exists() else []
    ends = sorted(e["t"] for e in events if e["kind"] == "round")
    if proc.returncode != 0 or len(ends) != args.rounds:
        raise RuntimeError(
            f"flwr run failed ({proc.returncode}, {len(ends)} rounds):\n{proc.stdout[-3000:]}"
        )
    first_calls = sorted(e["t"] for e in events if e["kind"] == "first_client_call")
    rounds = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return {
        "round_s": median(rounds),
        "startup_to_first_client_call_s": round(first_calls[0] - t_cmd, 3),
        **cpu_figures(cpu, ends),
    }


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", type=int, default=10)
    p.add_argument("--participants", type=int, default=0, help="trained a round (0: all)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plain-threads", type=int, default=2)
    p.add_argument("--plain-procs", type=int, default=2)
    p.add_argument("--evaluate-every-also", type=int, default=5, help="0: skip that figure")
    p.add_argument(
        "--flower",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the same work as a plain Flower app (benchmarks/_flower_app)",
    )
    p.add_argument(
        "--inprocess",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run EdgeFleet on its in-process engine (edgefleet run --engine inprocess)",
    )
    p.add_argument(
        "--workers", type=int, default=0, help="the in-process engine's workers (0: one per core)"
    )
    p.add_argument(
        "--poll-also",
        type=float,
        default=0.0,
        help="also run EdgeFleet (every round) with its SuperExec polling for tasks every this "
        "many seconds (FLWR_SUPEREXEC_TASK_POLL_INTERVAL; 0: not run), beside the default",
    )
    p.add_argument("--repeat", type=int, default=1, help="interleaved repetitions")
    p.add_argument(
        "--cold-cache",
        action="store_true",
        help="EdgeFleet runs on an empty data/partition cache (default: the one the floor filled)",
    )
    p.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    raw = {
        "num-server-rounds": args.rounds,
        "dataset": args.dataset,
        "model": args.model,
        "local-steps": args.local_steps,
        "seed": args.seed,
        "min-nodes": args.devices,
        "fraction-train": (args.participants or args.devices) / args.devices,
    }
    parse_run_config(raw)  # fail before any work
    variants = {"every_round": 1, f"every_{args.evaluate_every_also}": args.evaluate_every_also}
    variants = {k: v for k, v in variants.items() if v}
    engines = ["simulation", *(["inprocess"] if args.inprocess else [])]
    reps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="simovh-") as tmp:
        for rep in range(args.repeat):
            fig: dict[str, Any] = {"loadavg_start": loadavg()}
            fig["plain_1proc"] = run_plain(args, raw, 0)
            fig["plain_nproc"] = run_plain(args, raw, args.plain_procs)
            floor = min(fig["plain_1proc"], fig["plain_nproc"], key=lambda f: f["round_s"])
            if args.flower:
                fig["flower"] = run_flower(args, raw, Path(tmp))
                fig["flower"]["ratio"] = round(fig["flower"]["round_s"] / floor["round_s"], 3)
                log.info("repeat %d, plain Flower: %s", rep + 1, fig["flower"])
            for name, every in variants.items():
                for engine in engines:
                    ef = run_edgefleet(args, {**raw, "evaluate-every": every}, Path(tmp), engine)
                    ef["ratio"] = round(ef["round_s"] / floor["round_s"], 3)
                    # The floor doing the same work as this run's median round, which has
                    # an evaluation when more than half the rounds had one.
                    evaluated = ef["evaluated_rounds"] > args.rounds / 2
                    same = floor["round_s"] + (floor["central_eval_s"] if evaluated else 0.0)
                    ef["ratio_same_work"] = round(ef["round_s"] / same, 3)
                    ef["ratio_compute_normalized"] = round(
                        ef["round_over_train_path"] / floor["round_over_train_path"], 3
                    )
                    if args.flower:
                        ef["ratio_to_flower"] = round(ef["round_s"] / fig["flower"]["round_s"], 3)
                    fig[f"{ENGINE_KEYS[engine]}_{name}"] = ef
                    log.info("repeat %d, %s %s: %s", rep + 1, engine, name, ef)
            if args.poll_also:
                env = {POLL_VAR: str(args.poll_also)}
                ef = run_edgefleet(args, {**raw, "evaluate-every": 1}, Path(tmp), extra_env=env)
                ef["ratio"] = round(ef["round_s"] / floor["round_s"], 3)
                ef["ratio_to_default"] = round(
                    ef["round_s"] / fig["edgefleet_every_round"]["round_s"], 3
                )
                if args.flower:
                    ef["ratio_to_flower"] = round(ef["round_s"] / fig["flower"]["round_s"], 3)
                fig["edgefleet_poll_also"] = ef
                log.info("repeat %d, SuperExec poll %g s: %s", rep + 1, args.poll_also, ef)
            fig["loadavg_end"] = loadavg()
            reps.append(fig)

    def over_reps(key: str, field: str) -> float | None:
        return median([r[key][field] for r in reps if r[key].get(field) is not None])

    headline = {
        "floor_round_s": median(
            [min(r["plain_1proc"]["round_s"], r["plain_nproc"]["round_s"]) for r in reps]
        ),
        **{f"edgefleet_round_s_{n}": over_reps(f"edgefleet_{n}", "round_s") for n in variants},
        **{f"ratio_{n}": over_reps(f"edgefleet_{n}", "ratio") for n in variants},
        "floor_central_eval_s": median(
            [
                min((r["plain_1proc"], r["plain_nproc"]), key=lambda f: f["round_s"])[
                    "central_eval_s"
                ]
                for r in reps
            ]
        ),
        **{
            f"ratio_same_work_{n}": over_reps(f"edgefleet_{n}", "ratio_same_work") for n in variants
        },
        **{
            f"ratio_compute_normalized_{n}": over_reps(f"edgefleet_{n}", "ratio_compute_normalized")
            for n in variants
        },  # fmt: skip
        "startup_to_first_client_call_s": over_reps(
            "edgefleet_every_round", "startup_to_first_client_call_s"
        ),
        "engine_cpu_per_round_s": over_reps("edgefleet_every_round", "engine_cpu_per_round_s"),
        **(
            {
                "flower_round_s": over_reps("flower", "round_s"),
                "ratio_flower": over_reps("flower", "ratio"),
                **{
                    f"ratio_to_flower_{n}": over_reps(f"edgefleet_{n}", "ratio_to_flower")
                    for n in variants
                },
                "flower_startup_to_first_client_call_s": over_reps(
                    "flower", "startup_to_first_client_call_s"
                ),
                "flower_engine_cpu_per_round_s": over_reps("flower", "engine_cpu_per_round_s"),
            }
            if args.flower
            else {}
        ),
        **(
            {
                **{
                    f"inprocess_round_s_{n}": over_reps(f"inprocess_{n}", "round_s")
                    for n in variants
                },
                **{f"ratio_inprocess_{n}": over_reps(f"inprocess_{n}", "ratio") for n in variants},
                **{
                    f"ratio_same_work_inprocess_{n}": over_reps(f"inprocess_{n}", "ratio_same_work")
                    for n in variants
                },
                **{
                    f"ratio_compute_normalized_inprocess_{n}": over_reps(
                        f"inprocess_{n}", "ratio_compute_normalized"
                    )
                    for n in variants
                },
                "inprocess_startup_to_first_client_call_s": over_reps(
                    "inprocess_every_round", "startup_to_first_client_call_s"
                ),
            }
            if args.inprocess
            else {}
        ),
        **(
            {
                "poll_also_s": args.poll_also,
                "poll_also_ratio_to_flower": over_reps("edgefleet_poll_also", "ratio_to_flower"),
                "poll_also_engine_cpu_per_round_s": over_reps(
                    "edgefleet_poll_also", "engine_cpu_per_round_s"
                ),
                # its rounds over the default's, side by side in each repeat
                "poll_also_ratio_to_default": over_reps("edgefleet_poll_also", "ratio_to_default"),
            }
            if args.poll_also
            else {}
        ),
        "targets": {
            "ratio_every_round": 1.10,
            "startup_to_first_client_call_s": 10.0,
            # issue 27: 1.10x at 10 devices, 1.20x at 100 devices with 20 a round
            "ratio_inprocess_every_round": 1.10 if args.devices <= 10 else 1.20,
        },
    }
    if args.inprocess:
        target = headline["targets"]["ratio_inprocess_every_round"]
        ratio = headline["ratio_inprocess_every_round"]
        headline["inprocess_meets_target"] = ratio is not None and ratio <= target
        same = headline["ratio_same_work_inprocess_every_round"]
        headline["inprocess_meets_target_same_work"] = same is not None and same <= target
    sizes = {k: getattr(args, k) for k in ("devices", "participants", "rounds", "local_steps")}
    sizes |= {k: getattr(args, k) for k in ("dataset", "model", "plain_threads", "plain_procs")}
    sizes |= {
        "cpus": os.cpu_count(),
        "repeat": args.repeat,
        "cold_cache": args.cold_cache,
        "flower": args.flower,
        "inprocess": args.inprocess,
        "workers": args.workers or os.cpu_count(),
        "poll_also": args.poll_also,
        "federation": config_arg({"client-resources-num-cpus": 1}),
    }
    line = {"benchmark": "sim_overhead", "sizes": sizes, **headline, "repeats": reps}
    print(json.dumps(stamp(line)))


if __name__ == "__main__":
    main()
