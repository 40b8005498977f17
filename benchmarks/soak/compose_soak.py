"""The soak on the docker-compose fleet: containers killed and restarted, the server host
restarted, every container's memory sampled each round through the Docker SDK (issue 26).

``benchmarks/soak/soak.py`` soaks the link fleet (processes in network namespaces, psutil). This
is the same soak for the deployment a user starts with ``docker compose``: the root
docker-compose.yml with the TLS, node-authentication and Prometheus overlays
(``deploy/composefleet.py``: compose brings it up and down, the Docker SDK for Python does
the rest). One run of ``--rounds`` rounds, and from a seeded plan fixed before it starts
(``soak.plan``):

- ``--node-kills`` times, after a random round, a random board goes down: its
  ``supernode-K`` and ``clientapp-K`` containers are killed (``power``: SIGKILL) or stopped
  (``reboot``: SIGTERM, 10 s) and started again 1-5 rounds later. A board that lost power is
  refused by the SuperLink until its key is marked offline; Docker's restart policy
  (``unless-stopped``) is then its supervisor (the line counts those restarts);
- ``--serverapp-kills`` times the ``flwr-serverapp`` process inside the ``serverapp``
  container is killed and the run submitted again with ``resume = true``;
- ``--superlink-restarts`` times the server host goes down: the ``superlink`` and
  ``serverapp`` containers are killed and started again (the SuperLink's state database is
  on its volume, the checkpoint on the results volume), and the run submitted again with
  ``resume = true``.

Each time a round's row appears, the RSS of every process in every running container is
sampled (``docker top``) and judged as ``soak.py`` judges a process (``<service>/<kind>``,
a restarted one starts over); each container's memory (container stats, as ``docker stats``
shows it) is sampled too and reported as ``per_container``, not judged: a ClientApp
container holds its executor and, while a run's ClientApp lives, that process, so its total
swings with when it is sampled. Targets as the soak's: every round on record
exactly once, no container left after ``down -v``, RSS growth under 5 % for every judged
process; Prometheus (the overlay's monitoring, not the fleet) is sampled and its growth
reported as ``monitoring_growth``, not judged. One JSON line on stdout, progress on stderr;
needs a Docker engine and the images (``deploy/build-images.sh``, built here if missing)::

    python -m benchmarks.soak.compose_soak                       # 3 boards, 40 rounds
    python -m benchmarks.soak.compose_soak --rounds 12 --node-kills 2 --warmup-rounds 2 --min-span 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# deploy/ is a folder of scripts, not a package: its fleet helpers are imported from there.
if str(ROOT / "deploy") not in sys.path:
    sys.path.insert(0, str(ROOT / "deploy"))

import composefleet as cf  # noqa: E402

from benchmarks.soak.soak import Event, SoakRecord, growth, plan, process_kind, report  # noqa: E402
from edgefleet.simulation.runner import app_copy  # noqa: E402

RUN_NAME = "soak"


class ComposeSoak(SoakRecord):
    """The compose fleet, the run and the plan, driven from one polling loop."""

    NAME = "compose_soak"
    MONITORING = ("prometheus",)

    def __init__(self, fleet: cf.ComposeFleet, work: Path, args: argparse.Namespace) -> None:
        super().__init__()
        self.fleet, self.work, self.args = fleet, work, args
        self.container_samples: list[tuple[int, str, int, int]] = []

    def config(self, resume: bool) -> dict[str, Any]:
        a = self.args
        return {
            "num-server-rounds": a.rounds,
            "local-steps": a.local_steps,
            "model": a.model,
            "min-nodes": cf.NUM_NODES,
            "node-wait-timeout": 120.0,
            "timeout-mode": "expected",
            "first-round-timeout": 600.0,
            "round-timeout": 150.0,
            "timeout-slack": 10.0,
            "evaluate-every": a.evaluate_every,
            "eval-samples": 500,
            "seed": a.seed,
            "output-dir": cf.RESULTS,
            "run-name": RUN_NAME,
            "resume": resume,
        }

    def submit(self, resume: bool) -> None:
        self.submissions += 1
        app = app_copy(self.work / f"app-{self.submissions}")
        run_id = self.fleet.submit(app, self.config(resume))
        self.note(-1, "submitted", run_id=run_id, resume=resume)

    @staticmethod
    def board(node: int) -> tuple[str, str]:
        return f"supernode-{node + 1}", f"clientapp-{node + 1}"

    def apply(self, event: Event, rnd: int) -> None:
        fleet = self.fleet
        if event.kind in ("power", "reboot"):
            node = event.node
            if node in self.down:
                self.note(rnd, f"{event.kind} node {node}: already down, skipped")
                return
            for service in self.board(node):
                if event.kind == "power":
                    fleet.kill(service)
                else:
                    fleet.stop(service, timeout=10)
            self.down[node] = rnd + event.down
            self.note(rnd, f"{event.kind} node {node}", back_after=rnd + event.down)
        elif event.kind == "serverapp":
            pids = fleet.kill_process("serverapp", "flwr-serverapp")
            self.note(rnd, "serverapp killed", pids=pids)
            self.submit(resume=True)
        elif event.kind == "superlink":
            for service in ("serverapp", "superlink"):
                fleet.kill(service)
            self.note(rnd, "server host killed")
            for service in ("superlink", "serverapp"):
                fleet.start(service)
            up = cf.NUM_NODES - len(self.down)
            fleet.wait_online(up, timeout=180)
            self.note(rnd, "server host back", nodes_online=up)
            self.submit(resume=True)

    def supervise(self, rnd: int) -> None:
        for node, back_after in list(self.down.items()):
            if rnd >= back_after:
                del self.down[node]
                for service in self.board(node):
                    self.fleet.start(service)
                self.note(rnd, f"node {node} started")

    def go(self) -> dict[str, Any]:
        a = self.args
        events = plan(a.rounds, cf.NUM_NODES, a.node_kills, a.serverapp_kills,
                      a.superlink_restarts, a.seed)  # fmt: skip
        pending = list(events)
        self.t0 = time.monotonic()
        deadline = self.t0 + a.deadline_s
        self.submit(resume=False)
        seen, last_new = 0, time.monotonic()
        while True:
            rows = self.fleet.rows(RUN_NAME)
            now = time.monotonic()
            if len(rows) > seen:
                seen, last_new = len(rows), now
                rnd = int(rows[-1]["round"])
                for row in rows:
                    self.seen_at.setdefault(int(row["round"]), now)
                # Judged per process (as soak.py judges the link fleet's); the containers'
                # own memory is kept beside it: a container holds its executor and, while
                # one runs, a ClientApp, so its total swings with when it is sampled.
                for role, (pid, value) in self.fleet.processes(process_kind).items():
                    self.samples.append((rnd, role, pid, value))
                for service, (pid, value) in self.fleet.memory().items():
                    self.container_samples.append((rnd, service, pid, value))
                while pending and pending[0].after <= rnd:
                    self.apply(pending.pop(0), rnd)
                self.supervise(rnd)
            done = rows and int(rows[-1]["round"]) >= a.rounds
            if done and self.fleet.summary(RUN_NAME) is not None:
                break
            if now > deadline:
                raise RuntimeError(
                    f"round {seen} of {a.rounds} at the {a.deadline_s:.0f} s deadline"
                )
            if now - last_new > a.stall_s:
                raise RuntimeError(f"no new round for {a.stall_s:.0f} s after round {seen}")
            time.sleep(2.0)
        return {"planned": [asdict(e) for e in events], "wall_s": time.monotonic() - self.t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--node-kills", type=int, default=4)
    ap.add_argument("--serverapp-kills", type=int, default=1)
    ap.add_argument("--superlink-restarts", type=int, default=1)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--model", default="linear")
    ap.add_argument("--evaluate-every", type=int, default=5)
    ap.add_argument("--warmup-rounds", type=int, default=10)
    ap.add_argument("--min-span", type=int, default=20, help="rounds a judged process spans")
    ap.add_argument("--stall-s", type=float, default=900.0, help="fail after so long without a row")
    ap.add_argument("--deadline-s", type=float, default=0.0, help="0: 60 s a round + 10 min")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.rounds < 4:
        ap.error("--rounds must be at least 4")
    args.deadline_s = args.deadline_s or 60.0 * args.rounds + 600.0
    why = cf.unavailable()
    if why:
        print(f"compose_soak: {why}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    build = cf.build_images()
    if build.returncode != 0:
        print(f"compose_soak: build-images.sh failed:\n{build.stderr[-3000:]}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="compose-soak-"))
    fleet = cf.ComposeFleet(work)
    fleet.run("build", "prometheus", timeout=900)
    fleet.gen_certs(cf.NUM_NODES)
    soak = ComposeSoak(fleet, work, args)
    try:
        fleet.run("up", "-d", timeout=300)
        fleet.wait_online(cf.NUM_NODES, timeout=180)
        fleet_up_s = round(time.monotonic() - t0, 1)
        outcome = soak.go()
        rows = fleet.rows(RUN_NAME)
        summary = fleet.summary(RUN_NAME) or {}
        restarts = {s: fleet.restarts(s) for s in fleet.containers()}
    except BaseException:
        print(fleet.logs(tail=40), file=sys.stderr)
        raise
    finally:
        leftovers = fleet.down()
    sizes = {
        k: getattr(args, k)
        for k in (
            "rounds", "node_kills", "serverapp_kills", "superlink_restarts", "local_steps",
            "model", "evaluate_every", "warmup_rounds", "min_span", "seed",
        )
    }  # fmt: skip
    return report(
        "compose_soak", soak, rows, args, {**sizes, "nodes": cf.NUM_NODES}, fleet_up_s,
        summary, outcome, leftovers, t0, docker_restarts=restarts,
        per_container=growth(soak.container_samples, args.warmup_rounds, args.min_span),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
