"""A fleet on shaped links: a SuperLink and N SuperNodes, each in a network namespace of its own.

Layout (everything in namespaces this module makes; nothing listens in the host's)::

    <prefix><pid>-<k>-link   lo, br0 10.77.0.1/24          SuperLink (TLS, node auth,
                             h0 h1 ... (bridge ports)       --database), its SuperExec and
                                                            ServerApps, every flwr CLI call
    <prefix><pid>-<k>-n0     lo, eth0 10.77.0.2/24          SuperNode 0 (edgefleet supernode)
    <prefix><pid>-<k>-n1     lo, eth0 10.77.0.3/24          SuperNode 1 ...

Each SuperNode's veth pair joins its namespace to the link namespace's bridge. Its link
profile is a token bucket (``tc qdisc ... tbf``) on both ends: on ``eth0`` it limits what the
node sends (uploads), on ``h<i>`` what it receives (downloads), with the profile's queue
latency (``tbf latency``: how long a packet may wait before it is dropped). ``netem`` (delay,
loss) is not in every kernel, so there is no added propagation delay. The addresses repeat
in every fleet: each lives only in its own namespaces, so parallel fleets never collide.

TLS and SuperNode authentication are on as in production: ``deploy/gen-certs.sh`` makes a CA,
a SuperLink certificate for 10.77.0.1 and one key pair per node; every key is registered with
``flwr supernode register`` before its node starts; nodes connect with ``--root-certificates``
and ``--auth-supernode-private-key``.

Stopping: :meth:`LinkFleet.stop` stops every process (by process group, by the fleet's
environment tag, and by namespace: ``ip netns pids``), then deletes every namespace it made.
:meth:`LinkFleet.setup` first removes stale namespaces of this prefix whose owner PID is dead
(a run killed with SIGKILL). Root only (``ip netns``).

As a script (a smoke run: fleet up, a few rounds, bytes per link, everything down)::

    python deploy/linkfleet.py --profiles fast,wifi-edge,cellular --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edgefleet.processes import (  # noqa: E402
    BIN_DIR,
    FleetError,
    FlowerProcess,
    config_arg,
    pid_alive,
)
from fleetharness.fleet import DeploymentFleet  # noqa: E402

PREFIX = "edgefleet-link-"
GEN_CERTS = ROOT / "deploy" / "gen-certs.sh"
SUBNET = "10.77.0"  # /24 inside the fleet's own namespaces only
LINK_IP = f"{SUBNET}.1"
SUPERLINK_PORT = 9092
NODE_RUNTIME_PORT = 9094  # each node's own namespace: the same port for every node
MAX_NODES = 200


@dataclass(frozen=True)
class LinkProfile:
    """A link's speed both ways: tbf ``rate``, ``burst`` (bytes at line rate) and ``latency``
    (the most a packet waits in the queue)."""

    name: str
    rate_kbit: int
    latency_ms: int
    burst_bytes: int

    @property
    def bytes_per_s(self) -> float:
        return self.rate_kbit * 1000 / 8

    def tbf_args(self) -> list[str]:
        return [
            "tbf",
            "rate",
            f"{self.rate_kbit}kbit",
            "burst",
            str(self.burst_bytes),
            "latency",
            f"{self.latency_ms}ms",
        ]


PROFILES: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile("fast", 50_000, 20, 64 * 1024),
        LinkProfile("wifi-edge", 2_000, 100, 16 * 1024),
        LinkProfile("cellular", 512, 300, 8 * 1024),
    )
}


class LinkError(RuntimeError):
    """Namespaces, links or shaping could not be set up (with the command that failed)."""


def profile(name: str) -> LinkProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise LinkError(
            f"unknown link profile {name!r}; valid: {', '.join(sorted(PROFILES))}"
        ) from None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` exited with {proc.returncode}: {proc.stderr.strip()}")
    return proc


def unavailable() -> str | None:
    """Why this machine cannot run a link fleet (None when it can): a reason for a skip."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "openssl", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        _run("ip", "-n", probe, "link", "add", "t0", "type", "veth", "peer", "name", "t1")
        _run("tc", "-n", probe, "qdisc", "add", "dev", "t0", "root", *PROFILES["fast"].tbf_args())
    except LinkError as err:
        return f"veth pairs or tbf do not work here: {err}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _netns_names() -> list[str]:
    out = _run("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns_processes(ns: str) -> None:
    """SIGKILL every process whose network namespace is ``ns`` (``ip netns pids``)."""
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    for word in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(word), signal.SIGKILL)


_STALE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")


def cleanup_stale(prefix_re: re.Pattern[str] = _STALE) -> list[str]:
    """Delete the namespaces of fleets whose owner process is dead (and stop what still runs
    in them). Returns the names deleted."""
    gone = []
    for ns in _netns_names():
        match = prefix_re.match(ns)
        if match and not pid_alive(int(match.group(1))):
            _kill_netns_processes(ns)
            _run("ip", "netns", "del", ns, check=False)
            gone.append(ns)
    return gone


_sequence = iter(range(1_000_000))


class LinkFleet(DeploymentFleet):
    """A :class:`DeploymentFleet` whose SuperLink and SuperNodes sit in namespaces on shaped
    links.

    Use as a context manager (``with LinkFleet(...) as fleet:``) or call :meth:`stop` in a
    ``finally``; :meth:`setup` makes the namespaces, :meth:`start_link` the SuperLink,
    :meth:`start_nodes` the SuperNodes."""

    def __init__(
        self,
        workdir: Path,
        profiles: Sequence[str],
        *,
        database: Path | None = None,
        connection: str = "linkfleet",
        warm: bool = True,
    ) -> None:
        if not 1 <= len(profiles) <= MAX_NODES:
            raise LinkError(f"a link fleet has 1 to {MAX_NODES} nodes, not {len(profiles)}")
        self.profiles = [profile(p) for p in profiles]
        super().__init__(workdir, connection=connection)
        self.fleet_id = f"{os.getpid()}-{next(_sequence)}"
        self.link_ns = f"{PREFIX}{self.fleet_id}-link"
        self.node_ns = [f"{PREFIX}{self.fleet_id}-n{i}" for i in range(len(profiles))]
        self.database = database
        self.warm = warm  # edgefleet supernode (warm worker), else flower-supernode
        self.certs = workdir / "certs"
        self.port = SUPERLINK_PORT
        self._made: list[str] = []  # namespaces, in creation order
        self.nodes: dict[int, FlowerProcess] = {}

    # -- namespaces and links -------------------------------------------------------------

    def setup(self) -> None:
        """Stale namespaces removed; the link namespace with its bridge; one namespace per
        node with its veth pair and shaping; certificates and node keys."""
        cleanup_stale()
        self._add_ns(self.link_ns)
        ln = self.link_ns
        _run("ip", "-n", ln, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", ln, "addr", "add", f"{LINK_IP}/24", "dev", "br0")
        _run("ip", "-n", ln, "link", "set", "br0", "up")
        for i, ns in enumerate(self.node_ns):
            self._add_ns(ns)
            _run("ip", "-n", ln, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0",
                 "netns", ns)  # fmt: skip
            _run("ip", "-n", ln, "link", "set", f"h{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.node_ip(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            self.set_profile(i, self.profiles[i].name)
        subprocess.run(
            [
                "bash",
                str(GEN_CERTS),
                "-o",
                str(self.certs),
                "-n",
                str(len(self.node_ns)),
                LINK_IP,
            ],  # fmt: skip
            check=True,
            capture_output=True,
            timeout=120,
        )

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def node_ip(i: int) -> str:
        return f"{SUBNET}.{i + 2}"

    def set_profile(self, i: int, name: str) -> None:
        """Shape node ``i``'s link both ways with profile ``name`` (now, mid-run too)."""
        prof = profile(name)
        # Delete, then add, never `replace`: a replaced tbf keeps its backlog, and a packet
        # queued under a larger burst than the new one never gets the tokens to leave, which
        # wedges the link for good (seen going wifi-edge -> cellular with a dead connection's
        # data queued: ARP replies stuck behind it, the node never reconnected). Deleting drops
        # what is queued; TCP resends it.
        for ns, dev in ((self.node_ns[i], "eth0"), (self.link_ns, f"h{i}")):
            # check=False: a link not shaped yet has no root qdisc to delete
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, check=False)  # fmt: skip
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *prof.tbf_args())
        self.profiles[i] = prof

    def link_bytes(self) -> list[tuple[int, int]]:
        """Per node, (bytes down, bytes up) that crossed its link so far: TLS, HTTP and
        polling included (the bridge port's tx / rx counters)."""
        out = _run("ip", "-n", self.link_ns, "-j", "-s", "link", "show").stdout
        stats = {d["ifname"]: d["stats64"] for d in json.loads(out) if "stats64" in d}
        return [
            (int(stats[f"h{i}"]["tx"]["bytes"]), int(stats[f"h{i}"]["rx"]["bytes"]))
            for i in range(len(self.node_ns))
        ]

    # -- processes ------------------------------------------------------------------------

    def start(
        self,
        name: str,
        args: Sequence[str],
        *,
        echo: TextIO | None = None,
        env: Mapping[str, str] | None = None,
        netns: str | None = None,
    ) -> FlowerProcess:
        """Like :meth:`DeploymentFleet.start`, in the link namespace unless ``netns`` says
        otherwise: the SuperLink, its ServerApps and every ``flwr`` call live there."""
        return super().start(name, args, echo=echo, env=env, netns=netns or self.link_ns)

    def start_link(self, timeout: float = 60.0) -> FlowerProcess:
        """The SuperLink in the link namespace (all its addresses: lo and br0), TLS and
        node auth on, ``--database`` when the fleet has one; same port on every restart."""
        extra = [
            "--host",
            "0.0.0.0",  # the last --host wins; inside the link namespace: lo and br0 only
            "--ssl-ca-certfile",
            str(self.certs / "ca.crt"),
            "--ssl-certfile",
            str(self.certs / "server.pem"),
            "--ssl-keyfile",
            str(self.certs / "server.key"),
            "--enable-supernode-auth",
        ]
        if self.database is not None:
            extra += ["--database", str(self.database)]
        return self.start_superlink(
            extra, root_certificates=self.certs / "ca.crt", port=self.port, timeout=timeout
        )

    def wait_for_health(self, proc: FlowerProcess, timeout: float) -> None:
        """``/health`` polled from inside the link namespace (the host cannot reach it)."""
        probe = (
            "import ssl, sys, time, urllib.request\n"
            "ctx = ssl.create_default_context(cafile=sys.argv[2])\n"
            "end = time.monotonic() + float(sys.argv[3])\n"
            "while time.monotonic() < end:\n"
            "    try:\n"
            "        urllib.request.urlopen(sys.argv[1], timeout=1.0, context=ctx)\n"
            "        sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.25)\n"
            "sys.exit(1)\n"
        )
        url = f"https://{self.superlink_address}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.running():
                raise FleetError(
                    f"{proc.name} exited with code {proc.popen.returncode} before it was "
                    f"healthy; log:\n{proc.tail()}"
                )
            rc = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.link_ns,
                    sys.executable,
                    "-c",
                    probe,
                    url,
                    str(self.certs / "ca.crt"),
                    "2",
                ],  # fmt: skip
                capture_output=True,
                timeout=30,
            ).returncode
            if rc == 0:
                return
        raise FleetError(f"{url} (in {self.link_ns}) did not answer within {timeout:.0f} s")

    def register_keys(self) -> None:
        """``flwr supernode register`` every node's public key (idempotent across restarts:
        a key the SuperLink's database already holds is fine)."""
        for i in range(len(self.node_ns)):
            out = self.flwr_output(
                "supernode", "register", str(self.certs / "pubkeys" / f"node-{i + 1}.pub"),
                self.connection, "--format", "json",
            )  # fmt: skip
            if '"success": true' not in out and "already in use" not in out.lower():
                raise FleetError(f"could not register node {i}'s key:\n{out}")

    def start_node(self, i: int, node_config: Mapping[str, Any]) -> FlowerProcess:
        """SuperNode ``i`` (``edgefleet supernode``, the warm worker; ``flower-supernode``
        when the fleet is not ``warm``) in its namespace, with its key; it reaches the
        SuperLink only across its shaped link."""
        args = [
            *(["edgefleet", "supernode"] if self.warm else ["flower-supernode"]),
            "--root-certificates",
            str(self.certs / "ca.crt"),
            "--auth-supernode-private-key",
            str(self.certs / "keys" / f"node-{i + 1}"),
            "--superlink",
            f"{LINK_IP}:{self.port}",
            "--port",
            str(NODE_RUNTIME_PORT),
            "--node-config",
            config_arg(node_config),
        ]
        proc = super().start(f"node-{i}", args, netns=self.node_ns[i])
        self.nodes[i] = proc
        return proc

    def start_nodes(
        self, node_configs: Sequence[Mapping[str, Any]], timeout: float = 90.0
    ) -> list[FlowerProcess]:
        procs = [self.start_node(i, cfg) for i, cfg in enumerate(node_configs)]
        self.wait_for_nodes(len(procs), timeout=timeout)
        return procs

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i`` and everything in its namespace (its worker, ClientApps): a
        board losing power. Its namespace and link stay. Flower 1.42 refuses the same key
        again (activation 412: the SuperNode logs ``Exit Code: 305`` and exits with status 1)
        until the SuperLink has marked the node offline: up to 2 x 30 s after its last
        heartbeat."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.nodes[i].pid, signal.SIGKILL)
        _kill_netns_processes(self.node_ns[i])
        self.nodes[i].popen.wait(timeout=10)

    def stop_node(self, i: int, timeout: float = 20.0) -> None:
        """A clean shutdown of node ``i``: SIGTERM to ``edgefleet supernode`` alone, which
        stops its ``flower-supernode`` with one SIGTERM of its own (so the SuperNode can
        deactivate itself at the SuperLink and come back at once). Not the whole group:
        Flower's handler takes the first SIGTERM and restores the default action, so a
        second one, from the worker, would kill it mid-shutdown. SIGKILL whatever is left
        after ``timeout``."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.nodes[i].pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.nodes[i].popen.wait(timeout=timeout)
        self.kill_node(i)

    def kill_superlink(self) -> None:
        """SIGKILL the SuperLink, its SuperExec and every ServerApp (everything in the link
        namespace): the server host losing power."""
        for proc in self.processes:
            if proc.name == "superlink" and proc.running():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        _kill_netns_processes(self.link_ns)
        for proc in self.processes:
            if proc.name == "superlink":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=10)

    def check_alive(self) -> None:
        """Raise if a SuperLink or SuperNode has exited (superseded ones do not count: a
        process restarted under the same name replaces its predecessor)."""
        latest: dict[str, FlowerProcess] = {}
        for proc in self.processes:
            if proc.name == "superlink" or proc.name.startswith("node-"):
                latest[proc.name] = proc
        for proc in latest.values():
            if not proc.running():
                raise FleetError(
                    f"{proc.name} exited with code {proc.popen.returncode}; log:\n{proc.tail()}"
                )

    # -- stopping -------------------------------------------------------------------------

    def stop(self, term_timeout: float = 10.0, kill_timeout: float = 5.0) -> None:
        """Every process stopped (groups, tag, namespaces), then every namespace deleted."""
        try:
            super().stop(term_timeout, kill_timeout)
        finally:
            for ns in reversed(self._made):
                _kill_netns_processes(ns)
            for ns in reversed(self._made):
                _run("ip", "netns", "del", ns, check=False)
            self._made = [ns for ns in self._made if ns in _netns_names()]

    def leftovers(self) -> list[str]:
        """Our namespaces that still exist and our processes still alive ([] when clean)."""
        mine = set(self.node_ns) | {self.link_ns}
        return [f"netns {ns}" for ns in _netns_names() if ns in mine] + self.survivors()


@contextlib.contextmanager
def running_fleet(
    workdir: Path,
    profiles: Sequence[str],
    node_configs: Sequence[Mapping[str, Any]],
    *,
    database: Path | None = None,
    timeout: float = 90.0,
    warm: bool = True,
) -> Iterator[LinkFleet]:
    """A link fleet up (namespaces, SuperLink, keys registered, every node online), stopped
    and torn down however the body ends; on an error every process's log is printed."""
    fleet = LinkFleet(workdir, profiles, database=database, warm=warm)
    # ``with``: a SIGTERM (``timeout``, ``kill``) becomes SystemExit, so the namespaces go too.
    with fleet:
        try:
            fleet.setup()
            fleet.start_link(timeout=timeout)
            fleet.register_keys()
            fleet.start_nodes(node_configs, timeout=timeout)
            yield fleet
        except BaseException:
            print(f"\n----- link fleet logs ({workdir}) -----\n{fleet.report()}", file=sys.stderr)
            raise


def node_configs(count: int, keep_ratios: Sequence[float] = ()) -> list[dict[str, Any]]:
    """``partition-id=i num-partitions=count device-id=i`` (and a keep ratio when given)."""
    configs: list[dict[str, Any]] = []
    for i in range(count):
        cfg: dict[str, Any] = {"partition-id": i, "num-partitions": count, "device-id": i}
        if keep_ratios:
            cfg["keep-ratio"] = float(keep_ratios[i % len(keep_ratios)])
        configs.append(cfg)
    return configs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="A SuperLink and SuperNodes on shaped links in network namespaces (root); "
        "runs a few rounds, prints per-link bytes as JSON, tears everything down."
    )
    parser.add_argument(
        "--profiles",
        default="fast,wifi-edge,cellular",
        help=f"one per node, comma-separated; of {', '.join(PROFILES)}",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--local-steps", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp folder")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    why = unavailable()
    if why:
        print(f"linkfleet: {why}", file=sys.stderr)
        return 2
    import tempfile

    from edgefleet.simulation.runner import app_copy

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="linkfleet-"))
    t0 = time.monotonic()
    try:
        with running_fleet(
            workdir, profiles, node_configs(len(profiles)), database=workdir / "state.db"
        ) as fleet:
            t_up = time.monotonic() - t0
            out = workdir / "out"
            run_config = {
                "num-server-rounds": args.rounds,
                "local-steps": args.local_steps,
                "min-nodes": len(profiles),
                "output-dir": str(out),
                "run-name": "linkfleet",
            }
            run = fleet.flwr(
                "run", str(app_copy(workdir / "app")), fleet.connection, "--stream",
                "--run-config", config_arg(run_config), name="flwr-run",
            )  # fmt: skip
            summary = out / "linkfleet" / "summary.json"
            while not summary.exists():
                fleet.check_alive()
                if run.popen.poll() not in (None, 0):
                    raise FleetError(f"`flwr run` failed:\n{run.tail()}")
                time.sleep(0.5)
            print(
                json.dumps(
                    {
                        "profiles": profiles,
                        "fleet_up_s": round(t_up, 1),
                        "run_s": round(time.monotonic() - t0 - t_up, 1),
                        "link_bytes_down_up": fleet.link_bytes(),
                        "summary": json.loads(summary.read_text()).get("final_accuracy"),
                    }
                )
            )
        return 0
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "BIN_DIR",
    "PROFILES",
    "LinkError",
    "LinkFleet",
    "LinkProfile",
    "cleanup_stale",
    "node_configs",
    "running_fleet",
    "unavailable",
]
