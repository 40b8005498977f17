"""A soak: a link fleet for hundreds of rounds, nodes killed and restarted at random, the
SuperLink and the ServerApp restarted, every process's memory sampled each round (issue 26).

One link fleet (``deploy/linkfleet.py``: the SuperLink with TLS, node auth and ``--database``
in a network namespace, each ``edgefleet supernode`` in its own behind a tbf-shaped veth) on
``--profiles`` (cycled over the nodes) runs one run of ``--rounds`` rounds while, from a
seeded plan fixed before the fleet starts:

- ``--node-kills`` times, after a random round, a random node goes down: half of them lose
  power (SIGKILL of everything in its namespace), half reboot (SIGTERM: the worker stops its
  SuperNode cleanly); each stays down 1-5 rounds, then this script plays the board's
  supervisor (systemd ``Restart=``): it starts the node again with the same key and data, and
  again every ``RESTART_S`` while Flower refuses the key (a node that lost power is let in
  only once the SuperLink has marked it offline, up to 60 s: the SuperNode logs ``Exit Code:
  305`` and exits with status 1);
- ``--serverapp-kills`` times the ``flwr-serverapp`` process is killed (SIGKILL) and the run
  submitted again with ``resume = true``;
- ``--superlink-restarts`` times the server host goes (SuperLink, SuperExec, ServerApp:
  SIGKILL of the link namespace); the SuperLink starts again on the same ``--database`` and
  the run is submitted again with ``resume = true`` (Flower 1.42 restarts no ServerApp by
  itself: ``tests/test_restarts.py``).

Each time a round's row appears, the resident memory (RSS, psutil) of every process of the
fleet is sampled: the SuperLink, its SuperExec, the ServerApp, and per node its worker,
``flower-supernode`` and ClientApp processes. A process's growth is its median RSS over the
last ``WINDOW`` samples over its median over ``WINDOW`` samples from the first round at or
after ``--warmup-rounds`` (and at least ``SETTLE`` rounds after it started); only a process
with at least ``--min-span`` rounds between the two is judged (a restarted one starts over).

Targets (issue 26): every round on record exactly once, no process or namespace left behind,
RSS growth under 5 % for every judged process. Prints one JSON line; progress on stderr. Root
only (network namespaces)::

    python -m benchmarks.soak.soak                                   # 24 nodes, 300 rounds
    python -m benchmarks.soak.soak --nodes 4 --rounds 20 --node-kills 4 --warmup-rounds 2 \\
        --min-span 6                                            # smoke: 5 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
# deploy/ is a folder of scripts, not a package: its fleet helpers are imported from there.
if str(ROOT / "deploy") not in sys.path:
    sys.path.insert(0, str(ROOT / "deploy"))

from linkfleet import PROFILES, LinkFleet, node_configs, running_fleet, unavailable  # noqa: E402

from benchmarks.lib.provenance import dumps  # noqa: E402
from edgefleet.processes import FleetError, FlowerProcess, config_arg  # noqa: E402
from edgefleet.server.checkpoint import checkpointed_round  # noqa: E402
from edgefleet.server.results import read_rows  # noqa: E402
from edgefleet.simulation.runner import app_copy  # noqa: E402

RUN_NAME = "soak"
RESTART_S = 10.0  # a supervisor's pause between restarts (systemd RestartSec=10)
# What flower-supernode logs when its key is still active at the SuperLink; its exit status is
# 1, as for every error (Flower's flwr_exit prints the code and exits with 1).
REFUSED = "Exit Code: 305"
WINDOW = 5  # samples in each median of the growth figure
SETTLE = 10  # rounds a process runs before its memory counts (imports, first allocations)
GROWTH_TARGET = 0.05


@dataclass(frozen=True)
class Event:
    """After round ``after``: ``kind`` (``power`` / ``reboot`` of node ``node``, down for
    ``down`` rounds; ``serverapp``; ``superlink``)."""

    after: int
    kind: str
    node: int = -1
    down: int = 0


def plan(
    rounds: int,
    nodes: int,
    node_kills: int,
    serverapp_kills: int,
    superlink_restarts: int,
    seed: int,
) -> list[Event]:
    """The seeded schedule: server restarts evenly spaced, node kills at random rounds (never
    the last two, so every node can be back before the end)."""
    rng = random.Random(seed)
    events = [
        Event(after=max(1, rounds * (k + 1) // (superlink_restarts + 1)), kind="superlink")
        for k in range(superlink_restarts)
    ]
    events += [
        Event(after=max(1, rounds * (2 * k + 1) // (2 * serverapp_kills + 2)), kind="serverapp")
        for k in range(serverapp_kills)
    ]
    last = max(2, rounds - 2)
    for _ in range(node_kills):
        events.append(
            Event(
                after=rng.randint(1, last),
                kind=rng.choice(("power", "reboot")),
                node=rng.randrange(nodes),
                down=rng.randint(1, 5),
            )
        )
    return sorted(events, key=lambda e: (e.after, e.kind, e.node))


def _rows(path: Path) -> list[dict[str, Any]]:
    """The rows so far (``read_rows`` leaves out a last line still being written)."""
    return read_rows(path) if path.exists() else []


def process_kind(cmd: str) -> str:
    for needle, kind in (
        ("flwr-serverapp", "serverapp"),
        ("flwr-clientapp", "clientapp"),
        ("flower-superexec", "superexec"),
        ("flower-superlink", "superlink"),
        ("flower-supernode", "supernode"),
        ("edgefleet supernode", "worker"),
    ):
        if needle in cmd:
            return kind
    return Path(cmd.split(" ", 1)[0]).name or "?"


def sample_rss(fleet: LinkFleet) -> dict[str, tuple[int, int]]:
    """``{role: (pid, rss bytes)}`` for every live process of the fleet; a node's processes
    are ``node-<i>/<kind>``, the server's by kind; ``flwr`` CLI calls are left out."""
    groups = {p.pid: p.name for p in fleet.processes}
    out: dict[str, tuple[int, int]] = {}
    for info in fleet.members():
        group = groups.get(info.pgid, "")
        if group.startswith("flwr"):
            continue
        kind = process_kind(info.cmd)
        role = f"{group}/{kind}" if group.startswith("node-") else kind
        with contextlib.suppress(psutil.Error):
            rss = psutil.Process(info.pid).memory_info().rss
            if role in out:  # two of a kind (a ClientApp finishing as the next starts)
                role = f"{role}#{info.pid}"
            out[role] = (info.pid, rss)
    return out


def rss_parts(status: str) -> tuple[int, int] | None:
    """(anonymous, file-backed and shared) resident bytes from a ``/proc/PID/status`` text
    (Linux: ``RssAnon``, ``RssFile`` + ``RssShmem``, in kB); None without them. A process's
    heap is anonymous; a file it maps (SQLite's mmap of the SuperLink's database) is not."""
    kb: dict[str, int] = {}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile", "RssShmem") and value.split():
            kb[name] = int(value.split()[0])
    if "RssAnon" not in kb or "RssFile" not in kb:
        return None
    return kb["RssAnon"] * 1024, (kb["RssFile"] + kb.get("RssShmem", 0)) * 1024


def sample_parts(pids: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """``{role: (pid, anonymous bytes, file-backed bytes)}`` of the roles whose process is
    still there (see :func:`rss_parts`)."""
    out: dict[str, tuple[int, int, int]] = {}
    for role, pid in pids.items():
        with contextlib.suppress(OSError):
            parts = rss_parts(Path(f"/proc/{pid}/status").read_text())
            if parts is not None:
                out[role] = (pid, *parts)
    return out


def db_connections(pid: int, database: Path) -> int | None:
    """How many SQLite connections process ``pid`` holds open on ``database``: the file
    descriptors on the database file itself (each connection opens it once; its ``-wal`` and
    ``-shm`` files are apart). None when the process is gone. Flower's SQL link state and object
    store each pool their connections (SQLAlchemy) and give each a page cache of up to 64 MB
    (``SQLITE_PRAGMAS``): a step in the SuperLink's memory that came with new connections
    would show here (in the soaks of 2026-12-05 it did not: README)."""
    target = str(database.resolve())
    fds = Path(f"/proc/{pid}/fd")
    count = 0
    try:
        entries = list(fds.iterdir())
    except OSError:
        return None
    for fd in entries:
        with contextlib.suppress(OSError):
            if os.readlink(fd) == target:
                count += 1
    return count


def connection_steps(samples: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """Per SuperLink process, its connection counts as (round, count) where the count changed
    (the first sample included); ``samples`` are (round, pid, count) in round order."""
    steps: dict[int, list[list[int]]] = {}
    for rnd, pid, count in samples:
        seen = steps.setdefault(pid, [])
        if not seen or seen[-1][1] != count:
            seen.append([rnd, count])
    return [{"pid": pid, "steps": s} for pid, s in steps.items()]


def growth(
    samples: list[tuple[int, str, int, int]], warmup: int, min_span: int
) -> list[dict[str, Any]]:
    """Per process (role and pid), its RSS growth (see the module's doc); ``samples`` are
    (round, role, pid, rss) in round order."""
    series: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for rnd, role, pid, rss in samples:
        series.setdefault((role.split("#")[0], pid), []).append((rnd, rss))
    out = []
    for (role, pid), points in sorted(series.items()):
        start = max(warmup, points[0][0] + SETTLE)
        later = [p for p in points if p[0] >= start]
        entry: dict[str, Any] = {
            "role": role,
            "pid": pid,
            "rounds": [points[0][0], points[-1][0]],
            "rss_mb_first": round(points[0][1] / 2**20, 1),
            "rss_mb_last": round(points[-1][1] / 2**20, 1),
        }
        if len(later) >= 2 * WINDOW and later[-1][0] - later[0][0] >= min_span:
            base = statistics.median(r for _, r in later[:WINDOW])
            end = statistics.median(r for _, r in later[-WINDOW:])
            entry.update(
                judged=True,
                from_round=later[0][0],
                rss_mb_base=round(base / 2**20, 1),
                rss_mb_end=round(end / 2**20, 1),
                growth=round(end / base - 1, 4),
            )
        else:
            entry["judged"] = False
        out.append(entry)
    return out


class SoakRecord:
    """What a soak keeps as it goes (``summarize`` and ``report`` read it): events, memory
    samples, when each round was first seen. benchmarks/soak/compose_soak.py shares it."""

    NAME = "soak"
    # Kinds of process sampled and reported but not judged: the operator's monitoring, not
    # the fleet (issue 26's target names the SuperLink, the ServerApp and the nodes).
    MONITORING: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.submissions = 0
        self.down: dict[int, int] = {}  # node -> the round after which it is started again
        self.log: list[dict[str, Any]] = []
        self.samples: list[tuple[int, str, int, int]] = []  # (round, role, pid, bytes)
        # The same RSS in two parts, where /proc shows them: anonymous and file-backed.
        self.samples_anon: list[tuple[int, str, int, int]] = []
        self.samples_file: list[tuple[int, str, int, int]] = []
        # The SuperLink's open SQLite connections each round: (round, pid, count).
        self.db_conns: list[tuple[int, int, int]] = []
        # When each round's row was first seen: the rows' own ``wall_s`` counts from the
        # start of each ServerApp process, so it starts over at every resume.
        self.seen_at: dict[int, float] = {}
        self.t0 = time.monotonic()

    def note(self, rnd: int, what: str, **extra: Any) -> None:
        entry = {"round": rnd, "event": what, "t_s": round(time.monotonic() - self.t0, 1), **extra}
        self.log.append(entry)
        print(f"{self.NAME}: {entry}", file=sys.stderr, flush=True)


class Soak(SoakRecord):
    """The fleet, the run and the plan, driven from one polling loop."""

    def __init__(self, fleet: LinkFleet, work: Path, args: argparse.Namespace) -> None:
        super().__init__()
        self.fleet = fleet
        self.work = work
        self.args = args
        self.configs = node_configs(args.nodes)
        self.run_dir = work / "out" / RUN_NAME
        self.metrics = self.run_dir / "metrics.jsonl"
        self.run: FlowerProcess | None = None
        self.restarting: dict[int, float] = {}  # node -> when to try again (key refused)
        self.refused = 0

    def config(self, resume: bool) -> dict[str, Any]:
        a = self.args
        return {
            "num-server-rounds": a.rounds,
            "local-steps": a.local_steps,
            "model": a.model,
            "min-nodes": a.nodes,
            "fraction-train": a.fraction_train,
            "timeout-mode": "expected",
            "first-round-timeout": 120.0,
            "round-timeout": 60.0,
            "evaluate-every": a.evaluate_every,
            "eval-samples": 500,
            "seed": a.seed,
            "output-dir": str(self.work / "out"),
            "run-name": RUN_NAME,
            "resume": resume,
        }

    def submit(self, resume: bool) -> None:
        if self.run is not None and self.run.running():
            self.run.popen.kill()
        self.submissions += 1
        app = app_copy(self.work / f"app-{self.submissions}")
        self.run = self.fleet.flwr(
            "run", str(app), self.fleet.connection, "--stream",
            "--run-config", config_arg(self.config(resume)), name="flwr-run",
        )  # fmt: skip

    def apply(self, event: Event, rnd: int) -> None:
        fleet = self.fleet
        if event.kind in ("power", "reboot"):
            node = event.node
            if node in self.down or node in self.restarting:
                self.note(rnd, f"{event.kind} node {node}: already down, skipped")
                return
            if event.kind == "power":
                fleet.kill_node(node)
            else:
                fleet.stop_node(node)
            self.down[node] = rnd + event.down
            self.note(rnd, f"{event.kind} node {node}", back_after=rnd + event.down)
        elif event.kind == "serverapp":
            pids = [p.pid for p in fleet.members() if "flwr-serverapp" in p.cmd]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.note(
                rnd, "serverapp killed", pids=pids, checkpoint=checkpointed_round(self.run_dir)
            )
            self.submit(resume=True)
        elif event.kind == "superlink":
            fleet.kill_superlink()
            self.note(rnd, "superlink killed", checkpoint=checkpointed_round(self.run_dir))
            fleet.start_link()
            up = self.args.nodes - len(self.down) - len(self.restarting)
            self.wait_online(up, timeout=120.0)
            self.note(rnd, "superlink back", nodes_online=up)
            self.submit(resume=True)

    def wait_online(self, count: int, timeout: float) -> None:
        """Until ``count`` nodes are online. Not ``fleet.wait_for_nodes``: it fails on any
        node that has exited, and here the nodes that are down were put down on purpose."""
        deadline = time.monotonic() + timeout
        while (online := len(self.fleet.online_nodes())) < count:
            link = self._latest_superlink()
            if link is not None and not link.running():
                raise FleetError(f"the SuperLink exited:\n{link.tail()}")
            if time.monotonic() > deadline:
                raise FleetError(f"{online} of {count} nodes online after {timeout:.0f} s")
            time.sleep(1.0)

    def supervise(self, rnd: int) -> None:
        """Start downed nodes whose time has come; restart one Flower refused, later."""
        now = time.monotonic()
        for node, back_after in list(self.down.items()):
            if rnd >= back_after:
                del self.down[node]
                self.fleet.start_node(node, self.configs[node])
                self.note(rnd, f"node {node} started")
        for i in range(self.args.nodes):
            proc = self.fleet.nodes[i]
            if i in self.down or i in self.restarting or proc.running():
                continue
            if REFUSED not in proc.tail(80):
                code = proc.popen.returncode
                raise FleetError(f"node-{i} exited with code {code}; log:\n{proc.tail()}")
            self.refused += 1
            self.restarting[i] = now + RESTART_S
        for node, when in list(self.restarting.items()):
            if now >= when:
                del self.restarting[node]
                self.fleet.start_node(node, self.configs[node])
                self.note(rnd, f"node {node} started again (key was refused)")

    def go(self) -> dict[str, Any]:
        a = self.args
        events = plan(
            a.rounds, a.nodes, a.node_kills, a.serverapp_kills, a.superlink_restarts, a.seed
        )
        pending = list(events)
        self.t0 = time.monotonic()
        deadline = self.t0 + a.deadline_s
        self.submit(resume=False)
        seen = 0
        summary = self.run_dir / "summary.json"
        while True:
            assert self.run is not None
            if summary.exists() and checkpointed_round(self.run_dir) >= a.rounds:
                break
            if time.monotonic() > deadline:
                raise FleetError(
                    f"soak: round {seen} of {a.rounds} at the {a.deadline_s:.0f} s deadline"
                )
            link = self._latest_superlink()
            if link is not None and not link.running():
                raise FleetError(f"the SuperLink exited:\n{link.tail()}")
            rows = _rows(self.metrics)
            if len(rows) > seen:
                seen = len(rows)
                rnd = int(rows[-1]["round"])
                for row in rows:
                    self.seen_at.setdefault(int(row["round"]), time.monotonic())
                sampled = sample_rss(self.fleet)
                for role, (pid, rss) in sampled.items():
                    self.samples.append((rnd, role, pid, rss))
                parts = sample_parts({role: pid for role, (pid, _) in sampled.items()})
                for role, (pid, anon, mapped) in parts.items():
                    self.samples_anon.append((rnd, role, pid, anon))
                    self.samples_file.append((rnd, role, pid, mapped))
                if "superlink" in sampled and self.fleet.database is not None:
                    pid = sampled["superlink"][0]
                    conns = db_connections(pid, self.fleet.database)
                    if conns is not None:
                        self.db_conns.append((rnd, pid, conns))
                while pending and pending[0].after <= rnd:
                    self.apply(pending.pop(0), rnd)
            elif self.run.popen.poll() not in (None, 0):
                raise FleetError(f"`flwr run` failed:\n{self.run.tail()}")
            self.supervise(int(rows[-1]["round"]) if rows else 0)
            time.sleep(0.5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.run.popen.wait(timeout=30)
        return {"planned": [asdict(e) for e in events], "wall_s": time.monotonic() - self.t0}

    def _latest_superlink(self) -> FlowerProcess | None:
        links = [p for p in self.fleet.processes if p.name == "superlink"]
        return links[-1] if links else None


def summarize(
    soak: SoakRecord, rows: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    rounds = [int(r["round"]) for r in rows]
    seen = sorted(soak.seen_at.values())
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    per_process = growth(soak.samples, args.warmup_rounds, args.min_span)
    for p in per_process:
        if p["role"].split("/")[-1] in soak.MONITORING:
            p["monitoring"] = True
    judged = [p for p in per_process if p["judged"] and not p.get("monitoring")]
    worst = max(judged, key=lambda p: p["growth"]) if judged else None
    by_role: dict[str, float] = {}
    for p in judged:
        role = p["role"].split("/")[-1]
        by_role[role] = max(by_role.get(role, -1.0), p["growth"])
    # Each node restarted by the supervisor: the first round after it in which its device
    # (device-id = the node's index) trained again, None if it never did.
    rejoined = []
    for event in soak.log:
        words = event["event"].split()
        if len(words) == 3 and words[0] == "node" and words[2] == "started":
            later = [
                int(r["round"])
                for r in rows
                if int(r["round"]) > event["round"] and words[1] in r.get("participants", [])
            ]
            rejoined.append(
                {
                    "node": int(words[1]),
                    "started_after": event["round"],
                    "trained": min(later, default=None),
                }
            )
    return {
        "rounds_on_record": len(rounds),
        "restarted_nodes_trained_again": sum(1 for r in rejoined if r["trained"] is not None),
        "rejoined": rejoined,
        "rounds_exactly_once": rounds == list(range(1, args.rounds + 1)),
        "repeated": sorted({r for r in rounds if rounds.count(r) > 1}),
        "lost": sorted(set(range(1, args.rounds + 1)) - set(rounds)),
        "empty_rounds": [r["round"] for r in rows if not r.get("participants")],
        "participants_per_round": statistics.mean(len(r.get("participants", [])) for r in rows)
        if rows
        else 0,
        "missing_per_round": statistics.mean(len(r.get("missing", [])) for r in rows)
        if rows
        else 0,
        "final_accuracy": rows[-1].get("test_accuracy") if rows else None,
        # Between rows as this script saw them appear (restarts included): the rows' own
        # ``wall_s`` starts over with each ServerApp process.
        "round_s_median": round(statistics.median(gaps), 2) if gaps else None,
        "processes_judged": len(judged),
        "rss_growth_max": worst["growth"] if worst else None,
        "rss_growth_worst": worst,
        "rss_growth_max_by_kind": by_role,
        "rss_growth_ok": bool(judged) and all(p["growth"] < GROWTH_TARGET for p in judged),
        # Reported, not judged (MONITORING): e.g. Prometheus' head block, which grows with
        # every scrape until its first compaction (two hours by default).
        "monitoring_growth": {
            p["role"]: p["growth"] for p in per_process if p.get("monitoring") and p["judged"]
        },
        # Not judged: where the server side's growth lies, heap or mapped files.
        "rss_split_server": split_growth(soak, args),
        "superlink_db_connections": connection_steps(soak.db_conns),
        "per_process": per_process,
    }


SERVER_KINDS = ("superlink", "serverapp", "superexec")


def split_growth(soak: SoakRecord, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per judged process of the server side, its anonymous and its file-backed RSS at the
    start and the end of the judged span and their growth (the same rule as RSS's)."""
    parts = {
        name: {
            (p["role"], p["pid"]): p
            for p in growth(samples, args.warmup_rounds, args.min_span)
            if p["judged"] and p["role"] in SERVER_KINDS
        }
        for name, samples in (("anon", soak.samples_anon), ("file", soak.samples_file))
    }
    out = []
    for key in sorted(parts["anon"].keys() & parts["file"].keys()):
        entry: dict[str, Any] = {"role": key[0], "pid": key[1]}
        for name in ("anon", "file"):
            p = parts[name][key]
            entry |= {
                f"{name}_mb_base": p["rss_mb_base"],
                f"{name}_mb_end": p["rss_mb_end"],
                f"{name}_growth": p["growth"],
            }
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--profiles", default="fast,wifi-edge,fast,cellular", help="cycled over nodes")
    ap.add_argument("--node-kills", type=int, default=30)
    ap.add_argument("--serverapp-kills", type=int, default=1)
    ap.add_argument("--superlink-restarts", type=int, default=1)
    ap.add_argument("--fraction-train", type=float, default=0.5)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--model", default="linear")
    ap.add_argument("--evaluate-every", type=int, default=10)
    ap.add_argument("--warmup-rounds", type=int, default=50)
    ap.add_argument("--min-span", type=int, default=100, help="rounds a judged process spans")
    ap.add_argument("--deadline-s", type=float, default=0.0, help="0: 30 s a round + 10 min")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    profiles = [p for p in args.profiles.split(",") if p]
    bad = [p for p in profiles if p not in PROFILES]
    if bad or not profiles:
        ap.error(f"--profiles: unknown {bad}; valid: {', '.join(PROFILES)}")
    if args.nodes < 2 or args.rounds < 4:
        ap.error("--nodes must be at least 2 and --rounds at least 4")
    if not 0.0 < args.fraction_train <= 1.0:
        ap.error("--fraction-train must be in (0, 1]")
    args.deadline_s = args.deadline_s or 30.0 * args.rounds + 600.0
    why = unavailable()
    if why:
        print(f"soak: {why}", file=sys.stderr)
        return 2
    node_profiles = [profiles[i % len(profiles)] for i in range(args.nodes)]
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    t0 = time.monotonic()
    with running_fleet(
        work / "fleet",
        node_profiles,
        node_configs(args.nodes),
        database=work / "fleet" / "state.db",
    ) as fleet:
        fleet_up_s = round(time.monotonic() - t0, 1)
        soak = Soak(fleet, work, args)
        outcome = soak.go()
    leftovers = fleet.leftovers()
    rows = _rows(soak.metrics)
    summary = json.loads((soak.run_dir / "summary.json").read_text())
    sizes = {
        k: getattr(args, k)
        for k in (
            "nodes", "rounds", "node_kills", "serverapp_kills", "superlink_restarts",
            "fraction_train", "local_steps", "model", "evaluate_every", "warmup_rounds",
            "min_span", "seed",
        )
    }  # fmt: skip
    return report(
        "soak", soak, rows, args, {**sizes, "profiles": node_profiles}, fleet_up_s,
        summary, outcome, leftovers, t0, keys_refused=soak.refused,
    )  # fmt: skip


def report(
    name: str,
    soak: SoakRecord,
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    sizes: dict[str, Any],
    fleet_up_s: float,
    summary: dict[str, Any],
    outcome: dict[str, Any],
    leftovers: list[Any],
    t0: float,
    **extra: Any,
) -> int:
    """Print a soak's JSON line (this one's and benchmarks/soak/compose_soak.py's); its exit
    status: 0 when every target holds."""
    line = {
        "benchmark": name,
        "sizes": sizes,
        "fleet_up_s": fleet_up_s,
        **summarize(soak, rows, args),
        "rounds_run": summary.get("rounds_run"),
        "submissions": soak.submissions,
        "node_restarts": sum(1 for e in soak.log if e["event"].startswith("node ")),
        **extra,
        "planned": outcome["planned"],
        "events": soak.log,
        "leftovers": leftovers,
        "wall_s": round(time.monotonic() - t0, 1),
        "soak_s": round(outcome["wall_s"], 1),
    }
    print(dumps(line))
    ok = line["rounds_exactly_once"] and not leftovers and line["rss_growth_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
