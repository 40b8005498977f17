"""How much slower is EdgeFleet on Flower's Simulation Engine than the same work in plain PyTorch?

The same federated work (``--devices`` devices x ``--rounds`` rounds x ``--local-steps`` local
SGD steps, FedAvg with every device in every round) runs three ways:

(a) ``edgefleet run SCENARIO.toml`` (a subprocess, as a user would type it) on Flower's
    Simulation Engine: our own SuperLink, ``flwr run`` with ``--stream``, Ray actors
    (``num-supernodes`` = devices, ``client-resources-num-cpus`` = ``--client-num-cpus``);
(b) plain PyTorch, one process with ``--plain-threads`` torch threads training the devices one
    after another;
(c) plain PyTorch, ``--plain-procs`` processes with one torch thread each, each training its
    share of the round's devices; the parent averages.

(b) and (c) do exactly what the ClientApp and FedAvg do: the partitions of
``partition_indices`` / ``split_local``, the initial model the ServerApp builds, the same
``train_local`` calls with the same seeds, the average of the returned state dicts weighted by
``num-examples``. The faster of (b) and (c) is the floor: local compute is the physical limit.

Round times are steady-state: the median over rounds 2..R (round 1 carries actor start-up and
the first data load; it is reported apart as ``first_round_s``). EdgeFleet's round time is
the difference of consecutive ``wall_s`` in ``metrics.jsonl`` and includes the server's
central evaluation; the floor's does not (the plain layouts time one evaluation, ``eval_s``,
for the final accuracy). ``ratio_edgefleet_over_floor`` divides the medians.

The machine is shared and its speed drifts by 2x within minutes, so two more figures help to
read the ratio: ``ratio_compute_normalized`` divides, for each side, the round time by the
time the round's slowest worker (actor or plain process) spent inside ``train_local`` in that
same round, then takes the quotient of the two medians (what EdgeFleet adds on top of the
compute it runs, whatever the machine's speed); and ``cores_busy_other_sessions`` (from
/proc/stat minus our own processes) says how much other work shared the cores meanwhile.

Where EdgeFleet's time goes is measured without touching the app: the subprocess tree gets a
``sitecustomize.py`` on ``PYTHONPATH`` (Ray passes the driver's ``sys.path`` on to its
actors) that, when ``EDGEFLEET_BENCH_TRACE`` is set, timestamps every process start and wraps
a few functions as their modules are imported: ``get_device`` (first client train call, cache
misses), ``train_local``, ``set_arrays``/``get_arrays``, ``evaluate`` (the server's central
evaluation), ``RoundLoop.run_round``, ``InMemoryGrid.send_and_receive``,
``RayBackend.process_message`` (driver side of one ClientApp call) and ``ClientApp.__call__``
(actor side), ``ray.init`` and Flower's FAB build. ``--no-trace`` runs without the hook (and
``startup_to_first_client_call_s`` is then an approximation, see ``startup_method``). A
sampler thread reads the CPU time of every process of the run (found by a tag in its
environment) for ``cpu_steady``: CPU seconds per steady round by process (actors, the
ServerApp process, SuperLink, Ray's daemons, ...).

Prints one JSON line on stdout; progress goes to stderr. Example::

    .venv/bin/python benchmarks/sim_overhead.py            # defaults: 10 x 10 x 20, mnist-5k
    .venv/bin/python benchmarks/sim_overhead.py --rounds 3 --only edgefleet \\
        --set client-threads=2 --set federation.client-resources-num-cpus=2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgefleet.config import RunConfig, parse_run_config
from edgefleet.simulation.runner import parse_value
from edgefleet.task.datasets import ArrayDataset, load_dataset
from edgefleet.task.models import build_model
from edgefleet.task.partition import partition_indices, split_local
from edgefleet.task.train import evaluate, seed_for, train_local

log = logging.getLogger("sim_overhead")

TRACE_VAR = "EDGEFLEET_BENCH_TRACE"
TAG_VAR = "EDGEFLEET_BENCH_TAG"
STARTUP_METHOD = (
    "sitecustomize hook (PYTHONPATH, no app change): wall-clock time from just before the "
    "`edgefleet run` subprocess is spawned to the first entry into "
    "edgefleet.client.device.get_device, the first statement of the ClientApp train handler"
)
STARTUP_METHOD_NO_TRACE = (
    "approximation (--no-trace): first round's end (loop start + wall_s of round 1, loop start "
    "taken from the run's metrics.jsonl mtime minus its last wall_s) minus the median steady "
    "round time, minus the command start; counts actor start-up and first data load as start-up"
)

# Written into a temporary folder that goes first on the subprocess tree's PYTHONPATH. Kept
# free of heavy imports: it runs in every Python process of the run (Ray's included).
SITECUSTOMIZE = r'''
"""Timing hook of benchmarks/sim_overhead.py; inert unless EDGEFLEET_BENCH_TRACE is set."""
import os

if os.environ.get("EDGEFLEET_BENCH_TRACE"):
    import functools
    import importlib.abc
    import importlib.util
    import json
    import sys
    import time

    _PATH = os.environ["EDGEFLEET_BENCH_TRACE"]

    def _emit(kind, **fields):
        rec = {"kind": kind, "pid": os.getpid(), "t": time.time()}
        rec.update(fields)
        data = (json.dumps(rec, default=str) + "\n").encode()
        fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _proc_start():
        try:
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rpartition(")")[2].split()[19])
            with open("/proc/uptime") as f:
                btime = time.time() - float(f.read().split()[0])  # /proc/stat's is whole s
            return btime + ticks / os.sysconf("SC_CLK_TCK")
        except Exception:
            return None

    def _cmdline():
        try:
            with open("/proc/self/cmdline", "rb") as f:
                return [a.decode(errors="replace") for a in f.read().split(b"\0")[:4]]
        except OSError:
            return []

    _emit("proc", start=_proc_start(), argv=_cmdline())

    def _pid_of(context):
        try:
            return int(context.node_config["partition-id"])
        except Exception:
            return None

    def _timed(fn, kind, info=None):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.time()
            extra = {}
            try:
                result = fn(*args, **kwargs)
                if info is not None:
                    extra = info(args, kwargs, result)
                return result
            finally:
                _emit(kind, t0=t0, dt=time.time() - t0, **extra)

        return wrapper

    def _patch_device(mod):
        orig = mod.get_device

        @functools.wraps(orig)
        def get_device(run_config, node_config):
            t0 = time.time()
            before = len(mod._DEVICES)
            try:
                return orig(run_config, node_config)
            finally:
                miss = len(mod._DEVICES) > before
                extra = {}
                if miss:
                    import torch

                    extra = {
                        "threads": torch.get_num_threads(),
                        "omp": os.environ.get("OMP_NUM_THREADS"),
                    }
                _emit(
                    "get_device",
                    t0=t0,
                    dt=time.time() - t0,
                    miss=miss,
                    part=int(node_config.get("partition-id", -1)),
                    **extra,
                )

        mod.get_device = get_device

    def _patch_train(mod):
        mod.train_local = _timed(mod.train_local, "train_local")
        mod.set_arrays = _timed(mod.set_arrays, "set_arrays")
        mod.get_arrays = _timed(mod.get_arrays, "get_arrays")
        mod.evaluate = _timed(mod.evaluate, "evaluate")

    def _patch_server_app(mod):
        # The app changes; wrap what is there (a missing name leaves its figure empty).
        for name, kind in (
            ("central_evaluator", "central_setup"),
            ("central_evaluation", "central_setup"),
            ("wait_for_nodes", "wait_for_nodes"),
        ):
            if hasattr(mod, name):
                setattr(mod, name, _timed(getattr(mod, name), kind))

    def _patch_loop(mod):
        mod.RoundLoop.run_round = _timed(
            mod.RoundLoop.run_round, "round", lambda a, k, r: {"round": a[1]}
        )

    def _patch_grid(mod):
        mod.InMemoryGrid.send_and_receive = _timed(
            mod.InMemoryGrid.send_and_receive, "send_and_receive"
        )

    def _patch_raybackend(mod):
        cls = mod.RayBackend
        cls.__init__ = _timed(cls.__init__, "raybackend_init")
        cls.build = _timed(cls.build, "raybackend_build")
        cls.process_message = _timed(
            cls.process_message, "process_message", lambda a, k, r: {"part": _pid_of(a[2])}
        )

    def _patch_client_app(mod):
        cls = mod.ClientApp

        def info(args, kwargs, result):
            context = kwargs.get("context", args[2] if len(args) > 2 else None)
            return {"part": _pid_of(context)}

        cls.__call__ = _timed(cls.__call__, "clientapp_call", info)

    def _patch_ray(mod):
        mod.init = _timed(mod.init, "ray_init")

    def _patch_build(mod):
        mod.build_fab_from_disk = _timed(mod.build_fab_from_disk, "build_fab")

    def _patch_local_superlink(mod):
        mod._start_local_superlink = _timed(mod._start_local_superlink, "flwr_run_own_superlink")

    _PATCHES = {
        "edgefleet.client.device": _patch_device,
        "edgefleet.task.train": _patch_train,
        "edgefleet.server.app": _patch_server_app,
        "edgefleet.strategies.loop": _patch_loop,
        "flwr.superlink.grid.inmemory_grid": _patch_grid,
        "flwr.server.superlink.fleet.vce.backend.raybackend": _patch_raybackend,
        "flwr.clientapp.client_app": _patch_client_app,
        "ray": _patch_ray,
        "flwr.cli.build": _patch_build,
        "flwr.cli.local_superlink": _patch_local_superlink,
    }

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner, patch):
            self.inner, self.patch = inner, patch

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            try:
                self.patch(module)
            except Exception as err:
                _emit("patch_error", module=module.__name__, error=repr(err))

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            patch = _PATCHES.get(name)
            if patch is None:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader, patch)
                    return spec
            return None

    sys.meta_path.insert(0, _Finder())
'''


# ---------------------------------------------------------------------------------------------
# The work, shared by the plain layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    devices: int
    rounds: int
    run_config: dict[str, Any]  # EdgeFleet run config (flat keys); the plain runs read it too

    @property
    def cfg(self) -> RunConfig:
        return parse_run_config(self.run_config)


State = dict[str, np.ndarray]


def device_data(cfg: RunConfig, n_devices: int, pid: int) -> ArrayDataset:
    """A device's local training set, built as ``edgefleet.client.device`` builds it."""
    pool, _, _ = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    idx = partition_indices(
        pool.y,
        n_devices,
        pid,
        cfg.data.partition,
        alpha=cfg.data.alpha,
        shards_per_partition=cfg.data.shards_per_device,
        seed=cfg.seed,
    )
    train, _ = split_local(
        pool.subset(idx), cfg.data.local_test_fraction, seed=seed_for(cfg.seed, pid)
    )
    return train


def initial_state(cfg: RunConfig) -> State:
    """The ServerApp's seeded initial model (torch.manual_seed(seed), then build_model)."""
    _, _, info = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.train.model, info.input_shape, info.num_classes)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def train_device(
    model: torch.nn.Module, data: ArrayDataset, cfg: RunConfig, state: State, pid: int, rnd: int
) -> tuple[State, int, float]:
    """One ClientApp train call: load the global arrays, ``train_local``, return the arrays."""
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    t0 = time.perf_counter()
    result = train_local(
        model,
        data,
        steps=cfg.train.local_steps,
        batch_size=cfg.train.batch_size,
        lr=cfg.train.lr,
        momentum=cfg.train.momentum,
        seed=seed_for(cfg.seed, pid, rnd),
        proximal_mu=0.0,
    )
    dt = time.perf_counter() - t0
    out = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return out, result.num_examples, dt


def fedavg(updates: Sequence[tuple[State, int]]) -> State:
    """Flower's ``aggregate_arrayrecords``: sum of arrays times num-examples / total."""
    total = sum(n for _, n in updates)
    out: State = {}
    for state, n in updates:
        w = n / total
        for k, v in state.items():
            if k in out:
                out[k] += v * w
            else:
                out[k] = v * w
    return out


def central_accuracy(cfg: RunConfig, state: State) -> tuple[float, float]:
    """Accuracy on the central test set, as the ServerApp evaluates; and its time."""
    _, test, info = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    model = build_model(cfg.train.model, info.input_shape, info.num_classes)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    t0 = time.perf_counter()
    result = evaluate(model, test)
    dt = time.perf_counter() - t0
    # (loss, accuracy) in older versions of the app, an object with .accuracy in newer ones.
    acc = result[1] if isinstance(result, tuple) else result.accuracy
    return float(acc), dt


class CpuWindow:
    """Our CPU seconds and the machine's busy seconds from round 2 on (plain layouts)."""

    def __init__(self) -> None:
        self.start: tuple[float, float, float] | None = None
        self.end: tuple[float, float, float] | None = None

    def mark(self, ours_cpu: float) -> None:
        point = (time.time(), _machine_busy_s(), ours_cpu)
        if self.start is None:
            self.start = point
        else:
            self.end = point

    def report(self) -> dict[str, float]:
        if self.start is None or self.end is None:
            return {}
        wall = self.end[0] - self.start[0]
        ours = self.end[2] - self.start[2]
        others = self.end[1] - self.start[1] - ours
        return {
            "cores_busy_ours": round(ours / wall, 3),
            "cores_busy_other_sessions": round(others / wall, 3),
        }


def _summarise_plain(
    name: str,
    cfg: RunConfig,
    round_s: list[float],
    train_s: list[float],
    path_s: list[float],
    state: State,
    cpu: CpuWindow,
) -> dict[str, Any]:
    acc, eval_s = central_accuracy(cfg, state)
    over_path = [r / p for r, p in zip(round_s, path_s, strict=True)]
    return {
        **cpu.report(),
        "layout": name,
        "round_s_median": round(statistics.median(round_s[1:] or round_s), 4),
        "round_over_train_path_median": round(statistics.median(over_path[1:] or over_path), 4),
        "first_round_s": round(round_s[0], 4),
        "round_s": [round(x, 3) for x in round_s],
        "train_local_s_median": round(statistics.median(train_s), 4),
        "eval_s": round(eval_s, 4),
        "final_accuracy": _round(acc),
    }


def run_plain_sequential(work: Work, threads: int) -> dict[str, Any]:
    """One process, ``threads`` torch threads, devices one after another."""
    cfg = work.cfg
    torch.set_num_threads(threads)
    data = [device_data(cfg, work.devices, pid) for pid in range(work.devices)]
    _, _, info = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    model = build_model(cfg.train.model, info.input_shape, info.num_classes)
    state = initial_state(cfg)
    round_s: list[float] = []
    train_s: list[float] = []
    path_s: list[float] = []  # time inside train_local of the round's slowest worker
    cpu = CpuWindow()
    for rnd in range(1, work.rounds + 1):
        if rnd == 2:
            cpu.mark(time.process_time())
        t0 = time.perf_counter()
        updates = []
        for pid in range(work.devices):
            new, n, dt = train_device(model, data[pid], cfg, state, pid, rnd)
            updates.append((new, n))
            train_s.append(dt)
        state = fedavg(updates)
        round_s.append(time.perf_counter() - t0)
        path_s.append(sum(train_s[-work.devices :]))
        log.info("plain 1 proc x %d threads: round %d %.2f s", threads, rnd, round_s[-1])
    cpu.mark(time.process_time())
    name = f"1proc_{threads}threads"
    return _summarise_plain(name, cfg, round_s, train_s, path_s, state, cpu)


def _plain_worker(conn: Any, work: Work, pids: list[int]) -> None:
    """A plain worker process: one torch thread, its devices' data built once."""
    torch.set_num_threads(1)
    cfg = work.cfg
    data = {pid: device_data(cfg, work.devices, pid) for pid in pids}
    _, _, info = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    model = build_model(cfg.train.model, info.input_shape, info.num_classes)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        rnd, state = msg
        out = [(pid, *train_device(model, data[pid], cfg, state, pid, rnd)) for pid in pids]
        conn.send((out, time.process_time()))
    conn.close()


def run_plain_multiproc(work: Work, procs: int) -> dict[str, Any]:
    """``procs`` processes with one torch thread each; each trains its share of the devices
    of a round (contiguous blocks), the parent averages."""
    cfg = work.cfg
    ctx = mp.get_context("spawn")
    shares = [list(s) for s in np.array_split(np.arange(work.devices), procs) if len(s)]
    workers = []
    for share in shares:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_plain_worker, args=(child, work, [int(p) for p in share]))
        proc.start()
        workers.append((proc, parent))
    try:
        for _, conn in workers:
            if conn.recv() != "ready":
                raise RuntimeError("plain worker failed to start")
        state = initial_state(cfg)
        round_s: list[float] = []
        train_s: list[float] = []
        path_s: list[float] = []  # time inside train_local of the round's slowest worker
        cpu = CpuWindow()
        worker_cpu = [0.0] * len(workers)
        for rnd in range(1, work.rounds + 1):
            if rnd == 2:
                cpu.mark(time.process_time() + sum(worker_cpu))
            t0 = time.perf_counter()
            for _, conn in workers:
                conn.send((rnd, state))
            results = []
            paths = []
            for i, (_, conn) in enumerate(workers):
                out, worker_cpu[i] = conn.recv()
                results.extend(out)
                paths.append(sum(dt for *_, dt in out))
            results.sort(key=lambda r: r[0])
            state = fedavg([(new, n) for _, new, n, _ in results])
            round_s.append(time.perf_counter() - t0)
            train_s.extend(dt for *_, dt in results)
            path_s.append(max(paths))
            log.info("plain %d procs x 1 thread: round %d %.2f s", procs, rnd, round_s[-1])
        cpu.mark(time.process_time() + sum(worker_cpu))
    finally:
        for proc, conn in workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    name = f"{procs}proc_1thread"
    return _summarise_plain(name, cfg, round_s, train_s, path_s, state, cpu)


# ---------------------------------------------------------------------------------------------
# EdgeFleet on the Simulation Engine
# ---------------------------------------------------------------------------------------------


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def write_scenario(
    path: Path, federation: Mapping[str, Any], run_config: Mapping[str, Any]
) -> None:
    lines = ["[federation]"]
    lines += [f"{k} = {_toml(v)}" for k, v in federation.items()]
    lines += ["", "[run-config]"]
    lines += [f"{k} = {_toml(v)}" for k, v in run_config.items()]
    path.write_text("\n".join(lines) + "\n")


def _tagged_processes(tag: str) -> list[tuple[int, str]]:
    """(pid, command) of live processes whose environment carries ``TAG_VAR=tag`` (ours)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
            argv = (entry / "cmdline").read_bytes().split(b"\0")[:2]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state != "Z":
            name = " ".join(os.path.basename(a.decode(errors="replace")) for a in argv)
            found.append((int(entry.name), name))
    return found


def _kill_leftovers(tag: str) -> list[str]:
    """Kill what of our run is still alive 5 s after ``edgefleet run`` returned; say what."""
    deadline = time.monotonic() + 5.0
    while (found := _tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.25)
    for pid, _ in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [name for _, name in found]


def _machine_busy_s() -> float:
    """CPU seconds the machine's processes (all of them, any user) have run since boot:
    user + nice + system + irq + softirq of /proc/stat (not idle, iowait or steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(x) for x in fields]
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")


class CpuSampler(threading.Thread):
    """Samples the CPU time (user + system) of every process of one run, found by the tag in
    its environment, and the machine's busy time, every ``interval`` s."""

    def __init__(self, tag: str, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.needle = f"{TAG_VAR}={tag}".encode()
        self.interval = interval
        self.ours: dict[int, bool] = {}
        self.names: dict[int, str] = {}
        self.samples: list[tuple[float, float, dict[int, float]]] = []
        self.halt = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.interval)
        self.sample()

    def _is_ours(self, pid: int) -> bool:
        if pid not in self.ours:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                return False  # not readable yet (or gone): look again next time
            self.ours[pid] = self.needle in environ.split(b"\0")
        return self.ours[pid]

    def sample(self) -> None:
        now, busy, cpu = time.time(), _machine_busy_s(), {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or not self._is_ours(pid := int(entry.name)):
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:3]
            except OSError:
                continue
            cpu[pid] = (int(fields[11]) + int(fields[12])) / self.tick
            name = " ".join(a.decode(errors="replace") for a in argv).strip()
            if name:  # a zombie's command line reads empty
                self.names[pid] = name
        self.samples.append((now, busy, cpu))

    def window(self, start: float, end: float) -> dict[str, Any]:
        """CPU seconds per process class, ours in total and the machine's, in [start, end]."""
        before = [s for s in self.samples if s[0] <= start]
        after = [s for s in self.samples if s[0] <= end]
        if not before or not after:
            return {}
        (t0, busy0, cpu0), (t1, busy1, cpu1) = before[-1], after[-1]
        by_class: dict[str, float] = defaultdict(float)
        for pid, value in cpu1.items():
            by_class[_process_class(self.names.get(pid, ""))] += value - cpu0.get(pid, 0.0)
        ours = sum(by_class.values())
        return {
            "window_s": t1 - t0,
            "by_class": dict(by_class),
            "ours": ours,
            "machine": busy1 - busy0,
            "others": busy1 - busy0 - ours,
        }


def _process_class(cmd: str) -> str:
    for key, label in (
        ("ClientAppActor", "ray_actors"),
        ("ray::IDLE", "ray_actors"),
        ("default_worker.py", "ray_actors"),
        ("raylet", "ray_raylet"),
        ("gcs_server", "ray_gcs"),
        ("ray::", "ray_agents"),
        ("dashboard", "ray_agents"),
        ("monitor.py", "ray_agents"),
        ("runtime_env", "ray_agents"),
        ("flwr-simulation", "flwr_simulation_serverapp"),
        ("flower-superlink", "flower_superlink"),
        ("flower-superexec", "flower_superexec"),
        ("flwr run", "flwr_run_cli"),
        ("edgefleet", "edgefleet_cli"),
    ):
        if key in cmd:
            return label
    return "other"


def run_edgefleet(
    work: Work, federation: Mapping[str, Any], workdir: Path, trace: bool, timeout: float
) -> dict[str, Any]:
    run_name = f"sim-overhead-{uuid.uuid4().hex[:8]}"
    run_config = {**work.run_config, "output-dir": str(workdir / "runs"), "run-name": run_name}
    scenario = workdir / f"{run_name}.toml"
    write_scenario(scenario, federation, run_config)
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_VAR: tag}
    trace_file = workdir / f"{run_name}.trace.jsonl"
    if trace:
        hook_dir = workdir / "hook"
        hook_dir.mkdir(exist_ok=True)
        (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(hook_dir), env.get("PYTHONPATH", "")) if p
        )
        env[TRACE_VAR] = str(trace_file)
    exe = Path(sys.executable).parent / "edgefleet"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "edgefleet.cli"]
    cmd += ["run", str(scenario)]
    log_path = workdir / f"{run_name}.log"
    log.info("EdgeFleet: %s (log %s)", " ".join(cmd), log_path)
    sampler = CpuSampler(tag)
    sampler.start()
    with log_path.open("wb") as out:
        t_cmd = time.time()
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
        finally:
            t_done = time.time()
            sampler.halt.set()
            sampler.join()
    leftovers = _kill_leftovers(tag)
    run_dir = workdir / "runs" / run_name
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(f"edgefleet run failed ({proc.returncode}):\n" + "\n".join(tail))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    summary = json.loads((run_dir / "summary.json").read_text())
    walls = [r["wall_s"] for r in rows]
    round_s = [walls[0]] + [b - a for a, b in zip(walls, walls[1:], strict=False)]
    steady = statistics.median(round_s[1:] or round_s)
    result: dict[str, Any] = {
        "round_s_median": round(steady, 4),
        "first_round_s": round(round_s[0], 4),
        "round_s": [round(x, 3) for x in round_s],
        "final_accuracy": _round(summary["final_accuracy"]),
        "command_wall_s": round(t_done - t_cmd, 3),
        "loop_wall_s": summary["wall_s"],
        "leftover_processes_killed": leftovers,
        "run_dir": str(run_dir),
    }
    if trace and trace_file.exists():
        events = [json.loads(x) for x in trace_file.read_text().splitlines() if x.strip()]
        result.update(analyse_trace(events, t_cmd))
        result["startup_method"] = STARTUP_METHOD
        steady = [e for e in events if e["kind"] == "round" and e["round"] >= 2]
        if steady:
            start = min(e["t0"] for e in steady)
            end = max(e["t0"] + e["dt"] for e in steady)
            result["cpu_steady"] = _cpu_report(sampler.window(start, end), len(steady), result)
    else:
        # metrics.jsonl is written as each round ends: its mtime is the last round's end.
        loop_start = (run_dir / "metrics.jsonl").stat().st_mtime - walls[-1]
        first_end = loop_start + walls[0]
        result["startup_to_first_client_call_s"] = round(first_end - steady - t_cmd, 3)
        result["startup_method"] = STARTUP_METHOD_NO_TRACE
    return result


def _cpu_report(win: Mapping[str, Any], n_rounds: int, result: Mapping[str, Any]) -> dict:
    """CPU seconds per steady round by process class; how busy the cores were, and with what."""
    if not win:
        return {}
    per_round = {k: round(v / n_rounds, 3) for k, v in sorted(win["by_class"].items())}
    breakdown = result.get("round_breakdown_steady", {})
    train_wall = breakdown.get("train_local_sum_s_median")
    actors_cpu = per_round.get("ray_actors")
    return {
        "cpu_s_per_round_by_process": per_round,
        "cpu_s_per_round_ours": round(win["ours"] / n_rounds, 3),
        "cores_busy_ours": round(win["ours"] / win["window_s"], 3),
        "cores_busy_other_sessions": round(win["others"] / win["window_s"], 3),
        # < 1: the actors were runnable but waiting for a core during train_local.
        "actor_cpu_over_train_local_wall": round(actors_cpu / train_wall, 3)
        if actors_cpu and train_wall
        else None,
    }


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def _median(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def _classify(argv: list[str]) -> str:
    names = [os.path.basename(a) for a in argv]
    joined = " ".join(names)
    for key, label in (
        ("flower-superlink", "superlink"),
        ("flower-superexec", "superexec"),
        ("flwr-simulation", "simulation"),
        ("default_worker.py", "ray_worker"),
        ("edgefleet", "edgefleet_cli"),
    ):
        if key in joined:
            return label
    if len(names) > 2 and names[1] == "flwr" and names[2] == "run":
        return "flwr_run"
    return "other"


def analyse_trace(events: list[dict[str, Any]], t_cmd: float) -> dict[str, Any]:
    """Start-up phases and the per-round breakdown from the hook's events."""
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_kind[e["kind"]].append(e)

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t_cmd, 3)

    def first(kind: str, key: str = "t0") -> float | None:
        ts = [e[key] for e in by_kind.get(kind, []) if e.get(key) is not None]
        return min(ts) if ts else None

    procs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in by_kind.get("proc", []):
        procs[_classify(e.get("argv", []))].append(e)

    def proc_start(label: str) -> float | None:
        ts = [e.get("start") or e["t"] for e in procs.get(label, [])]
        return min(ts) if ts else None

    client_pids = {e["pid"] for e in by_kind.get("get_device", [])}
    server_pids = {e["pid"] for e in by_kind.get("round", [])}
    ray_init = by_kind.get("ray_init", [])
    fab = by_kind.get("build_fab", [])
    first_call = first("get_device")
    first_miss = [e for e in by_kind.get("get_device", []) if e["miss"]]
    first_miss.sort(key=lambda e: e["t0"])
    rounds = sorted(by_kind.get("round", []), key=lambda e: e["t0"])
    phases = {
        "edgefleet_cli_started": rel(proc_start("edgefleet_cli")),
        "superlink_started": rel(min((e.get("start") or e["t"]) for e in procs["superlink"]))
        if procs.get("superlink")
        else None,
        "flwr_run_started": rel(proc_start("flwr_run")),
        "fab_build_start": rel(fab[0]["t0"]) if fab else None,
        "fab_build_s": round(fab[0]["dt"], 3) if fab else None,
        "superexec_started": rel(proc_start("superexec")),
        "simulation_process_started": rel(proc_start("simulation")),
        "serverapp_main_start": rel(first("central_setup")),
        "wait_for_nodes_s": _median([e["dt"] for e in by_kind.get("wait_for_nodes", [])]),
        "round1_start": rel(rounds[0]["t0"]) if rounds else None,
        "ray_init_start": rel(ray_init[0]["t0"]) if ray_init else None,
        "ray_init_s": round(ray_init[0]["dt"], 3) if ray_init else None,
        "actor_pool_built": rel(
            max((e["t0"] + e["dt"] for e in by_kind.get("raybackend_build", [])), default=None)
        ),
        "first_clientapp_call": rel(first("clientapp_call")),
        "first_client_train_call": rel(first_call),
        "first_device_built_s": round(first_miss[0]["dt"], 3) if first_miss else None,
        "superlink_processes": len(procs.get("superlink", [])),
        "flwr_run_started_own_superlink": bool(by_kind.get("flwr_run_own_superlink")),
    }

    # Per round: [start, end] of run_round in the server process.
    windows = [(e["round"], e["t0"], e["t0"] + e["dt"]) for e in rounds]

    def round_of(t: float) -> int | None:
        for rnd, a, b in windows:
            if a <= t <= b:
                return rnd
        return None

    per_round: dict[int, dict[str, Any]] = {
        rnd: defaultdict(float, round_s=b - a) for rnd, a, b in windows
    }
    busy: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    train_calls: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    dispatch: dict[tuple[int, int], float] = {}
    for e in events:
        rnd = round_of(e.get("t0", e["t"]))
        if rnd is None:
            continue
        kind, pid, dt = e["kind"], e["pid"], e.get("dt", 0.0)
        row = per_round[rnd]
        if kind == "send_and_receive":
            row["send_and_receive_s"] += dt
        elif kind in ("evaluate", "set_arrays") and pid in server_pids:
            row["central_eval_s"] += dt
        elif kind == "clientapp_call":
            busy[rnd][pid] += dt
            key = (rnd, e.get("part"))
            dispatch[key] = dispatch.get(key, 0.0) - dt
        elif kind == "process_message":
            key = (rnd, e.get("part"))
            dispatch[key] = dispatch.get(key, 0.0) + dt
        elif kind == "train_local" and pid in client_pids:
            train_calls[rnd][pid] += dt
            row["train_local_calls"] += 1
            row["train_local_sum_s"] += dt
        elif kind == "get_device" and pid in client_pids:
            row["get_device_s"] += dt
            row["cache_misses"] += int(e["miss"])
        elif kind in ("set_arrays", "get_arrays") and pid in client_pids:
            row[f"client_{kind}_s"] += dt
    for rnd, row in per_round.items():
        n_actors = max(1, len(client_pids))
        row["actor_busy_max_s"] = max(busy[rnd].values(), default=0.0)
        row["actor_idle_frac"] = 1.0 - sum(busy[rnd].values()) / (n_actors * row["round_s"])
        row["train_critical_path_s"] = max(train_calls[rnd].values(), default=0.0)
        if row["train_critical_path_s"] > 0:
            row["round_over_train_path"] = row["round_s"] / row["train_critical_path_s"]
        sr = row["send_and_receive_s"]
        row["server_outside_send_receive_s"] = row["round_s"] - sr
        row["server_other_s"] = row["round_s"] - sr - row["central_eval_s"]
        row["dispatch_gap_s"] = sr - row["actor_busy_max_s"]
        in_actor = [v for (r, _), v in dispatch.items() if r == rnd]
        row["ray_dispatch_per_call_s"] = statistics.median(in_actor) if in_actor else 0.0
        row["in_actor_outside_train_s"] = (
            sum(busy[rnd].values()) - row["train_local_sum_s"] - row["get_device_s"]
        )

    steady = [per_round[r] for r in sorted(per_round) if r >= 2] or list(per_round.values())
    keys = sorted({k for row in steady for k in row})
    breakdown = {f"{k}_median": _median([row[k] for row in steady]) for k in keys}
    misses = first_miss
    miss_by_pid: dict[int, int] = defaultdict(int)
    for e in misses:
        miss_by_pid[e["pid"]] += 1
    train_all = [e["dt"] for e in by_kind.get("train_local", []) if e["pid"] in client_pids]
    steady_train = [
        e["dt"]
        for e in by_kind.get("train_local", [])
        if e["pid"] in client_pids and (round_of(e["t0"]) or 0) >= 2
    ]
    return {
        "startup_to_first_client_call_s": rel(first_call),
        "startup_phases_s": phases,
        "actors": len(client_pids),
        "client_calls": len(by_kind.get("get_device", [])),
        "cache_misses": len(misses),
        "cache_misses_per_actor": sorted(miss_by_pid.values()),
        "cache_miss_s": [round(e["dt"], 3) for e in misses],
        "actor_threads": sorted({e.get("threads") for e in misses if "threads" in e}),
        "train_local_s_median_steady": _median(steady_train),
        "train_local_s_median_all": _median(train_all),
        "round_breakdown_steady": breakdown,
        "round_breakdown": {
            str(r): {k: round(v, 4) for k, v in per_round[r].items()} for r in sorted(per_round)
        },
        "patch_errors": [e for e in events if e["kind"] == "patch_error"],
    }


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--partition", default="dirichlet")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--client-num-cpus", type=float, default=1.0, help="federation client-resources-num-cpus"
    )
    p.add_argument("--client-threads", type=int, default=1, help="run-config client-threads")
    p.add_argument("--plain-threads", type=int, default=2, help="threads of the 1-process layout")
    p.add_argument("--plain-procs", type=int, default=2, help="processes of the 1-thread layout")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra EdgeFleet run-config (or federation.KEY) override; repeatable",
    )
    p.add_argument("--only", choices=("all", "edgefleet", "plain"), default="all")
    p.add_argument("--no-trace", action="store_true", help="run EdgeFleet without the hook")
    p.add_argument("--workdir", default="", help="keep run folders, logs and traces here")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--verbose", action="store_true", help="add per-round breakdowns")
    return p.parse_args(argv)


def _loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s"
    )
    run_config: dict[str, Any] = {
        "num-server-rounds": args.rounds,
        "strategy": "fedavg",
        "fraction-train": 1.0,
        "min-nodes": args.devices,
        "dataset": args.dataset,
        "partition": args.partition,
        "alpha": args.alpha,
        "model": args.model,
        "local-steps": args.local_steps,
        "batch-size": args.batch_size,
        "client-threads": args.client_threads,
        "seed": args.seed,
    }
    federation: dict[str, Any] = {
        "num-supernodes": args.devices,
        # Flower wants an int here when the value is whole ("1.0" fails in ray.init).
        "client-resources-num-cpus": int(args.client_num_cpus)
        if float(args.client_num_cpus).is_integer()
        else args.client_num_cpus,
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        if key.startswith("federation."):
            federation[key.removeprefix("federation.")] = parse_value(value)
        else:
            run_config[key] = parse_value(value)
    work = Work(args.devices, args.rounds, run_config)
    work.cfg  # noqa: B018 -- validate before spending any time

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="simovh-"))
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "benchmark": "sim_overhead",
        "sizes": {
            "devices": args.devices,
            "rounds": args.rounds,
            "local_steps": args.local_steps,
            "batch_size": args.batch_size,
            "dataset": args.dataset,
            "model": args.model,
            "partition": args.partition,
            "alpha": args.alpha,
            "seed": args.seed,
            "client_resources_num_cpus": federation["client-resources-num-cpus"],
            "client_threads": run_config["client-threads"],
            "plain_threads": args.plain_threads,
            "plain_procs": args.plain_procs,
            "cpus": os.cpu_count(),
            "overrides": args.set,
        },
        "loadavg_1min": {"start": _loadavg()},
    }
    plain: dict[str, dict[str, Any]] = {}
    if args.only in ("all", "plain"):
        log.info("plain, 1 process x %d threads", args.plain_threads)
        plain["1proc"] = run_plain_sequential(work, args.plain_threads)
        out["loadavg_1min"]["after_plain_1proc"] = _loadavg()
        log.info("plain, %d processes x 1 thread", args.plain_procs)
        plain["nproc"] = run_plain_multiproc(work, args.plain_procs)
        out["loadavg_1min"]["after_plain_nproc"] = _loadavg()
        floor = min(plain.values(), key=lambda r: r["round_s_median"])
        out["plain_1proc_round_s"] = plain["1proc"]["round_s_median"]
        out["plain_nproc_round_s"] = plain["nproc"]["round_s_median"]
        out["floor_layout"] = floor["layout"]
        out["floor_round_s"] = floor["round_s_median"]
        out["final_accuracy_plain"] = floor["final_accuracy"]
        out["final_accuracy_plain_other_layout"] = next(
            r["final_accuracy"] for r in plain.values() if r is not floor
        )
    ef: dict[str, Any] = {}
    if args.only in ("all", "edgefleet"):
        log.info("EdgeFleet on the Simulation Engine")
        ef = run_edgefleet(work, federation, workdir, not args.no_trace, args.timeout)
        out["loadavg_1min"]["after_edgefleet"] = _loadavg()
        out["edgefleet_round_s"] = ef["round_s_median"]
        out["first_round_s"] = ef["first_round_s"]
        out["startup_to_first_client_call_s"] = ef["startup_to_first_client_call_s"]
        out["startup_method"] = ef.pop("startup_method")
        out["final_accuracy_edgefleet"] = ef["final_accuracy"]
    if plain and ef:
        out["ratio_edgefleet_over_floor"] = round(ef["round_s_median"] / out["floor_round_s"], 3)
        # The machine's speed drifts (shared, noisy): each side's round time over the time
        # its slowest worker spent inside train_local in that same round, then the quotient.
        ef_path = ef.get("round_breakdown_steady", {}).get("round_over_train_path_median")
        if ef_path:
            fl_path = min(plain.values(), key=lambda r: r["round_s_median"])
            out["ratio_compute_normalized"] = round(
                ef_path / fl_path["round_over_train_path_median"], 3
            )
        eval_s = ef.get("round_breakdown_steady", {}).get("central_eval_s_median")
        if eval_s is not None:
            out["ratio_edgefleet_minus_central_eval_over_floor"] = round(
                (ef["round_s_median"] - eval_s) / out["floor_round_s"], 3
            )
    if not args.verbose:
        ef.pop("round_breakdown", None)
        for r in plain.values():
            r.pop("round_s", None)
    out["edgefleet"] = ef
    out["plain"] = plain
    out["workdir"] = str(workdir)
    if not args.workdir:
        shutil.rmtree(workdir / "hook", ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
