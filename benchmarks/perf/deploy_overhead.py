"""What does a round cost a device on the Deployment Engine beyond its training?

One SuperLink and one SuperNode on loopback (own ``FLWR_HOME``, free ports), EdgeFleet's app,
``--rounds`` rounds of FedAvg in which the one device trains ``--local-steps`` SGD steps, run
once per ``--modes`` entry:

- ``subprocess``: ``flower-supernode`` as Flower ships it (``--isolation subprocess``): its
  SuperExec starts a fresh ``flwr-clientapp`` process for every message (the SuperExec polls
  every 0.1 s here, as in the tests; Flower's default is 1 s);
- ``worker``: ``edgefleet supernode`` (``--isolation process`` with EdgeFleet's warm worker
  as the executor, :mod:`edgefleet.client.worker`).

Against them, the same training in a warm Python process: the device built once
(``edgefleet.client.device.get_device``, the same run and node config), then per round the
train handler's compute (``round_model`` + ``train_local``, same seeds), timed after a
warm-up call. ``warm_train_s`` is its median.

Per round, on the device: the window from the moment the SuperNode starts pulling the train
message from the SuperLink to the moment its reply has been sent back (``device_round_s``).
``overhead_per_round_s`` = mean ``device_round_s`` over the steady rounds (2..R; round 1
carries the one-off start-up and is reported as ``first_round_overhead_s``) minus
``warm_train_s``. What the window holds (``breakdown_s``, steady means): ``network_in`` (the
SuperNode pulls the message and its objects), ``dispatch`` (until the ClientApp side starts:
SuperExec's poll and process spawn, or the worker's claim), ``python_start``, ``flwr_import``
(process start to Flower's ``run_clientapp``), ``task_input`` (message, Context and FAB from
the SuperNode), ``app_install`` (FAB unpacked into ``$FLWR_HOME/apps``), ``app_import``
(loading the ClientApp: torch, EdgeFleet), ``device_build`` (data and model), ``train``
(``round_model`` + ``train_local``), ``handler_other`` (the rest of the ClientApp call:
mods, arrays in and out, metrics), ``push_reply`` (reply serialised and handed to the
SuperNode), ``reply_poll`` (until the SuperNode notices it: it looks every 0.5 s),
``network_out`` (reply sent to the SuperLink) and ``other`` (the rest of the window).

Not in the window: the time a message waits at the SuperLink before the SuperNode asks (the
SuperNode polls every 3 s when idle), nor the ServerApp's own 3-s polls for replies; both are
Flower's, cost the device no work, and show in ``server_round_s`` (the ServerApp's
``RoundLoop.run_round``, steady mean), reported for completeness.

CPU: ``cpu_busy_per_round_s`` is the CPU time the node spends handling a message (the
SuperNode's pull and push, the ``flwr-clientapp`` processes the message started, or the
worker's task), ``cpu_overhead_per_round_s`` the same minus the warm training's CPU time;
``cpu_per_round_s`` adds everything else the node's processes spent until the next message
(``cpu_polling_per_round_s``: the SuperExec's or worker's and the SuperNode's polling). On a
shared machine wall times inflate with the load; CPU time much less, and it is what a
battery pays.

Instrumentation without touching the app: the node's processes get a ``sitecustomize.py`` on
``PYTHONPATH`` that timestamps process start and wraps Flower's and EdgeFleet's functions as
they are imported (as ``benchmarks/perf/sim_overhead.py`` does).

For an emulated board: point ``--node-bin`` at a folder holding the node's ``python`` and
``flower-supernode`` (and ``edgefleet`` where the project is installed there; else the worker
runs as ``python -m edgefleet.client.worker``): the SuperLink and ServerApp stay on this
machine's Python, the node and the warm baseline run on the board.
``deploy/emulated-pi.sh node-bin DIR`` writes such a folder for the emulated Pi 5; a board
without the data set gets its own (``--node-set data-path=...``)::

    bash deploy/emulated-pi.sh node-bin /tmp/pi5-bin
    .venv/bin/python -m benchmarks.perf.deploy_overhead --node-bin /tmp/pi5-bin --modes worker \\
        --rounds 4 --local-steps 2 --batch-size 8 --node-set data-path=/tmp/board/data.npz

Emulation slows everything: compare the ratios (``overhead_over_train``, ``speedup``), not
the seconds.

Prints one JSON line on stdout; progress goes to stderr. Example::

    .venv/bin/python -m benchmarks.perf.deploy_overhead                 # 6 rounds, both modes
    .venv/bin/python -m benchmarks.perf.deploy_overhead --modes worker --rounds 10 --local-steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
from benchmarks.lib.provenance import stamp  # noqa: E402
from edgefleet.processes import BIN_DIR, config_arg, free_port  # noqa: E402
from fleetharness.fleet import DeploymentFleet  # noqa: E402

MODES = ("subprocess", "worker")
TRACE_VAR = "EDGEFLEET_DEPLOY_TRACE"
TRACEHOOK = Path(__file__).resolve().parents[1] / "_trace" / "tracehook.py"
PHASES = (
    "network_in",
    "dispatch",
    "python_start",
    "flwr_import",
    "task_input",
    "app_install",
    "app_import",
    "device_build",
    "train",
    "handler_other",
    "push_reply",
    "reply_poll",
    "network_out",
    "other",
)

# Written into a temporary folder first on the node's PYTHONPATH; inert without TRACE_VAR.
# Kept free of heavy imports: it runs at the start of every Python process of the fleet.
SITECUSTOMIZE = r'''
"""Timing hook of benchmarks/perf/deploy_overhead.py; inert unless EDGEFLEET_DEPLOY_TRACE is set.
The machinery is benchmarks/_trace/tracehook.py, copied beside this file."""
import os

if os.environ.get("EDGEFLEET_DEPLOY_TRACE"):
    import atexit
    import sys
    import time

    from tracehook import Tracer

    _tracer = Tracer(os.environ["EDGEFLEET_DEPLOY_TRACE"])

    def _proc_start():
        try:
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rpartition(")")[2].split()[19])
            with open("/proc/uptime") as f:
                boot = time.time() - float(f.read().split()[0])
            return boot + ticks / os.sysconf("SC_CLK_TCK")
        except Exception:
            return None

    def _argv():
        try:
            with open("/proc/self/cmdline", "rb") as f:
                return [a.decode(errors="replace") for a in f.read().split(b"\0")[:3]]
        except OSError:
            return list(sys.argv[:3])

    _tracer.emit("proc", start=_proc_start(), ppid=os.getppid(), argv=_argv())
    atexit.register(lambda: _tracer.emit("exit"))

    def _msg_type(args, kwargs, result):
        msg = kwargs.get("message", args[1] if len(args) > 1 else None)
        try:
            return {"msg": msg.metadata.message_type}
        except Exception:
            return {}

    def _supernode(mod):
        mod._pull_and_store_message = _tracer.timed(
            "sn_pull", mod._pull_and_store_message, keep=lambda a, k, r: r is not None
        )
        mod._push_messages = _tracer.timed("sn_push", mod._push_messages)

    def _nodestate(mod):
        cls = mod.InMemoryNodeState
        cls.get_messages_legacy = _tracer.timed(
            "sn_reply_found",
            cls.get_messages_legacy,
            keep=lambda a, k, r: bool(k.get("is_reply")) and bool(r),
        )

    def _run_clientapp(mod):
        mod.run_clientapp = _tracer.timed("run_clientapp", mod.run_clientapp)
        for name in ("pull_task_input", "push_message", "push_task_output"):
            setattr(mod, name, _tracer.timed(name, getattr(mod, name)))

    def _install(mod):
        mod.install_from_fab = _tracer.timed("install_from_fab", mod.install_from_fab)

    def _object_ref(mod):
        mod.load_app = _tracer.timed("load_app", mod.load_app)

    def _client_app(mod):
        call = mod.ClientApp.__call__
        mod.ClientApp.__call__ = _tracer.timed("clientapp_call", call, info=_msg_type)

    def _superexec(mod):
        launch = mod.SubprocessExecutor.launch
        mod.SubprocessExecutor.launch = _tracer.timed("superexec_launch", launch)

    def _device(mod):
        mod.get_device = _tracer.timed("get_device", mod.get_device)

    def _pruning(mod):
        mod.round_model = _tracer.timed("round_model", mod.round_model)

    def _train(mod):
        mod.train_local = _tracer.timed("train_local", mod.train_local)

    def _loop(mod):
        mod.RoundLoop.run_round = _tracer.timed("server_round", mod.RoundLoop.run_round)

    def _worker(mod):
        mod.run_task = _tracer.timed("worker_task", mod.run_task)

    _PATCHES = {
        "flwr.supernode.start_client_internal": _supernode,
        "flwr.supernode.nodestate.in_memory_nodestate": _nodestate,
        "flwr.supernode.runtime.run_clientapp": _run_clientapp,
        "flwr.cli.install": _install,
        "flwr.supercore.object_ref": _object_ref,
        "flwr.clientapp.client_app": _client_app,
        "flwr.supercore.superexec.executor.subprocess_executor": _superexec,
        "edgefleet.client.device": _device,
        "edgefleet.client.pruning": _pruning,
        "edgefleet.task.train": _train,
        "edgefleet.loop.roundloop": _loop,
        "edgefleet.client.worker": _worker,
    }

    _tracer.install(_PATCHES)
'''


def log(text: str) -> None:
    print(f"[deploy_overhead {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The warm baseline
# ---------------------------------------------------------------------------------------------


def warm_baseline(
    run_config: Mapping[str, Any], node_config: Mapping[str, Any], rounds: int
) -> dict:
    """The train handler's compute in this (warm) process: median wall and CPU seconds."""
    from edgefleet.client.device import get_device
    from edgefleet.client.pruning import round_model
    from edgefleet.config import DEFAULTS
    from edgefleet.task.train import get_arrays, seed_for, train_local

    t0 = time.perf_counter()
    device = get_device({**DEFAULTS, **run_config}, node_config)
    build_s = time.perf_counter() - t0
    cfg, profile = device.config, device.profile
    arrays = get_arrays(device.model)
    walls, cpus = [], []
    for rnd in range(rounds + 1):  # call 0 warms up (first-call costs are start-up, not compute)
        seed = seed_for(cfg.seed, profile.partition_id, max(rnd, 1))
        w0, c0 = time.perf_counter(), time.process_time()
        model, _ = round_model(device, arrays, None, seed)
        train_local(
            model,
            device.train_data,
            steps=cfg.train.local_steps,
            batch_size=cfg.train.batch_size,
            lr=cfg.train.lr,
            momentum=cfg.train.momentum,
            seed=seed,
        )
        if rnd:
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
    return {
        "warm_train_s": statistics.median(walls),
        "warm_train_cpu_s": statistics.median(cpus),
        "warm_device_build_s": build_s,
        "train_samples": len(device.train_data),
    }


def warm_baseline_via(
    python: Path, run_config: Mapping[str, Any], node_config: Mapping[str, Any], rounds: int
) -> dict:
    """The warm baseline run by another Python (the node's), through this script."""
    out = subprocess.run(
        [
            str(python),
            str(Path(__file__).resolve()),
            "--warm-only",
            json.dumps({"run_config": dict(run_config), "node_config": dict(node_config)}),
            "--rounds",
            str(rounds),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# One Deployment-Engine run
# ---------------------------------------------------------------------------------------------


def run_mode(
    mode: str,
    work: Path,
    hook_dir: Path,
    node_bin: Path,
    run_config: Mapping[str, Any],
    node_config: Mapping[str, Any],
    timeout: float,
) -> tuple[list[dict[str, Any]], int]:
    """Run the app on a real SuperLink and one SuperNode; the trace events and the pid of
    the node's first process."""
    from edgefleet.simulation.runner import app_copy

    trace = work / "trace.jsonl"
    fleet = DeploymentFleet(work / "flower", connection=f"bench-{mode}")
    fleet.env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(hook_dir), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    fleet.env["PATH"] = f"{node_bin}{os.pathsep}{fleet.env['PATH']}"
    fleet.env[TRACE_VAR] = str(trace)
    output_dir = work / "out"
    summary = output_dir / "bench" / "summary.json"
    with fleet:
        fleet.start_superlink(timeout=300)
        node_args = [
            "--insecure",
            "--superlink",
            str(fleet.superlink_address),
            "--port",
            str(free_port()),
            "--node-config",
            config_arg(node_config),
        ]
        if mode == "subprocess":
            node = fleet.start("supernode", [str(node_bin / "flower-supernode"), *node_args])
        else:
            # The `edgefleet` command where the project is installed; else the module, which
            # needs only flwr (a board that got just the ClientApp's requirements).
            command = (
                [str(node_bin / "edgefleet")]
                if (node_bin / "edgefleet").exists()
                else [str(node_bin / "python"), "-m", "edgefleet.client.worker"]
            )
            node = fleet.start("supernode", [*command, "supernode", *node_args])
        config = {**run_config, "output-dir": str(output_dir), "run-name": "bench"}
        flwr_run = fleet.flwr(
            "run",
            str(app_copy(work / "app")),
            fleet.connection,
            "--stream",
            "--run-config",
            config_arg(config),
            name="flwr-run",
        )
        deadline = time.monotonic() + timeout
        while not summary.exists():
            fleet.check_alive()
            rc = flwr_run.popen.poll()
            if rc not in (None, 0):
                raise RuntimeError(f"flwr run exited with {rc}:\n{fleet.report()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: no summary after {timeout:.0f} s:\n{fleet.report()}")
            time.sleep(0.5)
        time.sleep(1.0)  # the last reply's bookkeeping (push_task_output) lands in the trace
    if fleet.survivors():
        raise RuntimeError(f"processes outlived the fleet: {fleet.survivors()}")
    events = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return events, node.pid


# ---------------------------------------------------------------------------------------------
# Reading the trace
# ---------------------------------------------------------------------------------------------


def _end(e: Mapping[str, Any]) -> float:
    return float(e["t0"]) + float(e["dt"])


def _node_pids(events: Sequence[Mapping[str, Any]], root: int) -> set[int]:
    """The node's process tree: ``root`` and every descendant that left a trace."""
    children = defaultdict(set)
    for e in events:
        if e["kind"] == "proc":
            children[e["ppid"]].add(e["pid"])
    tree: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def _first(events: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    return next((e for e in events if e["kind"] == kind), None)


def _total(events: Sequence[Mapping[str, Any]], kind: str) -> float:
    return sum(float(e["dt"]) for e in events if e["kind"] == kind)


def _phases(
    inside: Sequence[Mapping[str, Any]],
    pull: Mapping[str, Any],
    push: Mapping[str, Any],
    new_proc: Mapping[str, Any] | None,
    reply_seen: float | None,
) -> dict[str, float]:
    """One message's window cut into consecutive phases.

    The ClientApp side may start before the SuperNode has all of the message (the
    SuperNode queues the task first, then pulls the message's objects): every boundary is
    taken as the later of its own event and the boundary before it, so the phases never
    overlap and add up to the window; gaps between the events measured go to ``other``."""
    call, pti, push_msg = (
        _first(inside, "clientapp_call"),
        _first(inside, "pull_task_input"),
        _first(inside, "push_message"),
    )
    if call is None or pti is None or push_msg is None:
        raise RuntimeError("incomplete trace: a ClientApp call, its input or its reply missing")
    ph = dict.fromkeys(PHASES, 0.0)
    now = float(pull["t0"])

    def step(phase: str, at: float) -> None:
        nonlocal now
        if at > now:
            ph[phase] += at - now
            now = at

    step("network_in", _end(pull))
    if new_proc is not None and new_proc.get("start"):
        step("dispatch", float(new_proc["start"]))
        step("python_start", float(new_proc["t"]))
        main = _first(inside, "run_clientapp")
        if main is not None:
            step("flwr_import", float(main["t0"]))
    else:
        step("dispatch", float(pti["t0"]))
    step("task_input", _end(pti))
    for kind, phase in (("install_from_fab", "app_install"), ("load_app", "app_import")):
        event = _first(inside, kind)
        if event is not None:
            step("other", float(event["t0"]))
            step(phase, _end(event))
    step("other", float(call["t0"]))
    call_end = max(now, _end(call))
    device_build = _total(inside, "get_device")
    train = _total(inside, "round_model") + _total(inside, "train_local")
    ph["device_build"] += device_build
    ph["train"] += train
    ph["handler_other"] += max(0.0, call_end - now - device_build - train)
    now = call_end
    step("other", float(push_msg["t0"]))
    step("push_reply", _end(push_msg))
    step("reply_poll", reply_seen if reply_seen is not None else now)
    step("network_out", _end(push))
    return ph


def rounds_from_trace(
    events: Sequence[Mapping[str, Any]], root: int
) -> tuple[list[dict], list[float]]:
    """Per message on the device: window, phases, CPU; and the server's round times."""
    node = _node_pids(events, root)
    ev = sorted((e for e in events if e["pid"] in node), key=lambda e: e.get("t0", e["t"]))
    pulls = [e for e in ev if e["kind"] == "sn_pull"]
    pushes = [e for e in ev if e["kind"] == "sn_push"]
    found = [float(e["t0"]) for e in ev if e["kind"] == "sn_reply_found"]
    procs = {e["pid"]: e for e in ev if e["kind"] == "proc"}
    exits = {e["pid"]: e for e in ev if e["kind"] == "exit"}
    per_message = {p for p, e in procs.items() if any("flwr-clientapp" in a for a in e["argv"])}
    long_lived = set(procs) - per_message
    rows = []
    for pull, push in zip(pulls, pushes, strict=False):
        start, end = float(pull["t0"]), _end(push)
        inside = [e for e in ev if start <= e.get("t0", e["t"]) <= end]
        call = _first(inside, "clientapp_call")
        if call is None:
            raise RuntimeError(f"no ClientApp call between {start} and {end}")
        app_pid = call["pid"]
        new_proc = procs.get(app_pid) if app_pid in per_message else None
        seen = next((t for t in found if start <= t <= end), None)
        phases = _phases(inside, pull, push, new_proc, seen)
        # CPU inside the window: the long-lived processes' own timed calls that started in
        # it (their cpu0 -> cpu), and the whole of the message's own process, if any.
        busy = sum(
            float(e["cpu"]) - float(e["cpu0"])
            for e in inside
            if e["pid"] in long_lived and e["kind"] in ("sn_pull", "sn_push", "worker_task")
        )
        # Under load Flower's SuperExec may start a second flwr-clientapp for one message
        # (the first was too slow to take its task): every process started in the window
        # counts.
        started = [p for p in per_message if start <= float(procs[p].get("start") or 0) <= end]
        own = sum(float(exits[p]["cpu"]) for p in started if p in exits)
        rows.append(
            {
                "msg": call.get("msg"),
                "window_s": end - start,
                "train_s": phases["train"],
                "start": start,
                "end": end,
                "phases": phases,
                "clientapp_pid": app_pid,
                "clientapp_processes": len(started),
                "cpu_busy_s": busy + own,
                "cpu_own_s": own,
            }
        )
    _add_cpu_total(rows, ev, long_lived)
    server = [
        float(e["dt"]) for e in sorted(events, key=lambda e: e["t"]) if e["kind"] == "server_round"
    ]
    return rows, server


def _add_cpu_total(
    rows: list[dict],
    ev: Sequence[Mapping[str, Any]],
    long_lived: set[int],
) -> None:
    """Each message's node CPU from its start to the next message's start (idle polling
    included): the long-lived processes' CPU between their own last events before the two
    boundaries, plus the message's own flwr-clientapp process."""
    by_pid = defaultdict(list)
    for e in ev:
        if e["pid"] in long_lived:
            by_pid[e["pid"]].append((float(e["t"]), float(e["cpu"])))

    def cpu_at(pid: int, t: float) -> float:
        before = [c for tt, c in by_pid[pid] if tt <= t]
        return before[-1] if before else 0.0

    for k, row in enumerate(rows):
        if k + 1 == len(rows):
            row["cpu_total_s"] = None  # no next boundary
            continue
        nxt = rows[k + 1]["start"]
        long_cpu = sum(cpu_at(p, nxt) - cpu_at(p, row["start"]) for p in by_pid)
        row["cpu_total_s"] = long_cpu + row["cpu_own_s"]
        row["gap_s"] = nxt - row["start"]


def summarize(rows: list[dict], server: list[float], warm: Mapping[str, float]) -> dict[str, Any]:
    train_rows = [r for r in rows if r["msg"] == "train"]
    if len(train_rows) < 2:
        raise RuntimeError(f"need 2+ train rounds, got {len(train_rows)}")
    first, steady = train_rows[0], train_rows[1:]
    mean = statistics.fmean
    warm_s, warm_cpu = warm["warm_train_s"], warm["warm_train_cpu_s"]
    device_round = mean(r["window_s"] for r in steady)
    busy = mean(r["cpu_busy_s"] for r in steady)
    totals = [r for r in steady if r.get("cpu_total_s") is not None]
    out: dict[str, Any] = {
        "overhead_per_round_s": round(device_round - warm_s, 3),
        "device_round_s": round(device_round, 3),
        "device_round_s_each": [round(r["window_s"], 3) for r in train_rows],
        "non_train_s": round(mean(r["window_s"] - r["train_s"] for r in steady), 3),
        "train_in_round_s": round(mean(r["train_s"] for r in steady), 3),
        "first_round_overhead_s": round(first["window_s"] - warm_s, 3),
        "overhead_over_train": round((device_round - warm_s) / warm_s, 3),
        "breakdown_s": {p: round(mean(r["phases"][p] for r in steady), 4) for p in PHASES},
        "first_round_breakdown_s": {p: round(first["phases"][p], 4) for p in PHASES},
        "cpu_busy_per_round_s": round(busy, 3),
        "cpu_overhead_per_round_s": round(busy - warm_cpu, 3),
        "clientapp_processes": sum(r["clientapp_processes"] for r in train_rows)
        or len({r["clientapp_pid"] for r in train_rows}),
        "server_round_s": round(mean(server[1:]), 3) if len(server) > 1 else None,
        "messages": len(rows),
        "warm": {k: round(v, 4) for k, v in warm.items() if isinstance(v, float)},
    }
    if totals:
        # Everything else the node's processes spent from one message to the next: the
        # executor's and the SuperNode's polling (SuperExec's too while a message runs).
        out["cpu_per_round_s"] = round(mean(r["cpu_total_s"] for r in totals), 3)
        out["cpu_polling_per_round_s"] = round(
            mean(r["cpu_total_s"] - r["cpu_busy_s"] for r in totals), 3
        )
    return out


# ---------------------------------------------------------------------------------------------


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def main(argv: Sequence[str] | None = None) -> int:
    # Here, not at the top: it imports edgefleet, which the traced processes must not pay for.
    from benchmarks.lib.overrides import add_set_arg, parse_sets

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="subprocess,worker")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (round 1 reported apart)")
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default="smallcnn")
    parser.add_argument("--dataset", default="mnist-5k")
    parser.add_argument("--partitions", type=int, default=2, help="the node's num-partitions")
    parser.add_argument("--keep-ratio", type=float, default=1.0, help="the node's keep-ratio")
    parser.add_argument("--seed", type=int, default=0)
    add_set_arg(parser, help="more run config (run-config keys, as `edgefleet run --set`)")
    parser.add_argument(
        "--node-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more node config (e.g. data-path=... for a board without the data set)",
    )
    parser.add_argument(
        "--node-bin",
        type=Path,
        default=BIN_DIR,
        help="folder of the node's python, flower-supernode and edgefleet (default: this Python's)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode")
    parser.add_argument("--keep", type=Path, help="keep the work folder here")
    parser.add_argument("--warm-only", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warm_only:
        spec = json.loads(args.warm_only)
        print(json.dumps(warm_baseline(spec["run_config"], spec["node_config"], args.rounds)))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--modes {args.modes!r}: valid choices are {', '.join(MODES)}")
    if args.rounds < 3:
        parser.error("--rounds must be >= 3 (round 1 is start-up; steady rounds need 2+)")
    from edgefleet.simulation.runner import parse_value

    run_config: dict[str, Any] = {
        "num-server-rounds": args.rounds,
        "local-steps": args.local_steps,
        "batch-size": args.batch_size,
        "model": args.model,
        "dataset": args.dataset,
        "seed": args.seed,
        "min-nodes": 1,
        "node-wait-timeout": 600.0,
        "eval-samples": 100,
    }

    def key_values(flag: str, items: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep:
                parser.error(f"{flag} {item!r}: expected KEY=VALUE")
            out[key.strip()] = parse_value(value.strip())
        return out

    extra = parse_sets(parser, args.set)
    run_config.update(extra)
    from edgefleet.config import parse_run_config

    parse_run_config(run_config)  # a bad key or value fails here, before any process starts
    node_config: dict[str, Any] = {"partition-id": 0, "num-partitions": args.partitions}
    if args.keep_ratio < 1.0:
        node_config["keep-ratio"] = args.keep_ratio
    node_config.update(key_values("--node-set", args.node_set))

    node_python = args.node_bin / "python"
    local = args.node_bin.resolve() == BIN_DIR.resolve()

    def warm_block() -> dict[str, float]:
        if local:
            return warm_baseline(run_config, node_config, args.rounds)
        return warm_baseline_via(node_python, run_config, node_config, args.rounds)

    # The machine's speed drifts within minutes: the warm training is timed right before and
    # right after each mode, and each mode is compared with the mean of its two blocks.
    log(f"warm baseline ({args.rounds} rounds)")
    blocks = [warm_block()]
    log(f"warm train {blocks[0]['warm_train_s']:.3f} s ({blocks[0]['warm_train_cpu_s']:.3f} s CPU)")

    work = Path(tempfile.mkdtemp(prefix="deploy-overhead-"))
    results: dict[str, Any] = {}
    load = {"start": _load()}
    try:
        hook_dir = work / "hook"
        hook_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        shutil.copy2(TRACEHOOK, hook_dir / "tracehook.py")
        for mode in modes:
            log(f"{mode}: {args.rounds} rounds on a SuperLink + 1 SuperNode")
            t0 = time.monotonic()
            events, root = run_mode(
                mode, work / mode, hook_dir, args.node_bin, run_config, node_config, args.timeout
            )
            load[f"after_{mode}"] = _load()
            blocks.append(warm_block())
            before, after = blocks[-2], blocks[-1]
            warm = {k: (before[k] + after[k]) / 2 for k in ("warm_train_s", "warm_train_cpu_s")}
            warm["warm_train_s_before"] = before["warm_train_s"]
            warm["warm_train_s_after"] = after["warm_train_s"]
            rows, server = rounds_from_trace(events, root)
            results[mode] = {
                **summarize(rows, server, warm),
                "wall_s": round(time.monotonic() - t0, 1),
            }
            log(
                f"{mode}: overhead {results[mode]['overhead_per_round_s']} s/round, "
                f"non-train {results[mode]['non_train_s']} s/round; warm train "
                f"{before['warm_train_s']:.3f} -> {after['warm_train_s']:.3f} s"
            )
    finally:
        if args.keep:
            shutil.copytree(work, args.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)

    headline = "worker" if "worker" in results else modes[-1]
    import flwr
    import torch

    line: dict[str, Any] = {
        "benchmark": "deploy_overhead",
        "overhead_per_round_s": results[headline]["overhead_per_round_s"],
        "headline_mode": headline,
        "goal_s": 0.5,
        "warm_train_s": round(statistics.median(b["warm_train_s"] for b in blocks), 4),
        "warm_train_cpu_s": round(statistics.median(b["warm_train_cpu_s"] for b in blocks), 4),
        "warm_device_build_s": round(blocks[0]["warm_device_build_s"], 3),
        "modes": results,
    }
    if "subprocess" in results and "worker" in results:
        line["speedup_device_round"] = round(
            results["subprocess"]["device_round_s"] / results["worker"]["device_round_s"], 2
        )
        line["overhead_ratio"] = round(
            results["subprocess"]["overhead_per_round_s"]
            / max(results["worker"]["overhead_per_round_s"], 1e-3),
            1,
        )
    line["sizes"] = {
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "batch_size": args.batch_size,
        "model": args.model,
        "dataset": args.dataset,
        "train_samples": blocks[0]["train_samples"],
        "keep_ratio": args.keep_ratio,
        "extra_run_config": extra,
        "node_config": node_config,
    }
    line["machine"] = {
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "load_avg": load,
        "python": platform.python_version(),
        "flwr": flwr.__version__ if hasattr(flwr, "__version__") else None,
        "torch": torch.__version__,
        "node_bin": str(args.node_bin),
    }
    print(json.dumps(stamp(line)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
