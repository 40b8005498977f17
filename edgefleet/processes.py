"""Real Flower processes on loopback: a SuperLink, SuperNodes and the ``flwr`` CLI.

Used by ``edgefleet run`` (a simulation SuperLink of its own per run, and a Ray head of its
own) and by the tests that run the Deployment Engine. ``FlowerFleet`` owns every process of
one run or test. Each
process runs in a session of its own (``start_new_session=True``), with its own log file,
from the fleet's work folder, and with an environment that carries

- ``FLWR_HOME`` = a private folder whose ``config.toml`` defines the connection to this
  fleet's SuperLink (so ``flwr run <project> <connection>`` and ``flwr supernode ls`` reach
  it and nothing else),
- the variables that keep Flower offline and away from ``uv sync``,
- a per-fleet tag (``EDGEFLEET_FLEET_TAG``), inherited by every descendant.

``stop()`` sends SIGTERM, then SIGKILL, to every process group it started *and* to every
process that carries the tag. The tag matters: the SuperLink starts its ``flower-superexec``
(which starts ``flwr-serverapp``) in a new session, so that child is not in the
SuperLink's process group and would outlive a group kill. ``survivors()`` lists whatever of
ours is still alive (zombies do not count), for a test to assert that it is empty.

Flower 1.42 facts this relies on (checked here): the SuperLink serves the Fleet, Control and
Runtime APIs on one HTTP port (``--host``/``--port``; ``--control-api-address`` is
deprecated and unused), with ``GET /health``; a connection is
``[superlink.<name>] address = "127.0.0.1:<port>"`` plus ``insecure = true`` or
``root-certificates = "<ca.crt>"``; a SuperNode's ``--port`` is its own Runtime API, so
every SuperNode on one machine needs a free one. The ServerApp and ClientApps run from the
FAB that ``flwr run`` builds and installs under ``$FLWR_HOME/apps/``, with the cwd of the
SuperLink / SuperNode: relative paths in a run config resolve against ``workdir``.

Linux only (``/proc``), like the deployment targets.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

BIN_DIR = Path(sys.executable).parent
QUIET_FLOWER_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
}
TAG_VAR = "EDGEFLEET_FLEET_TAG"
POLL_VAR = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # read once, when a SuperExec starts


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> Any:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the process
    that starts it dies, however it dies (``kill -9`` included), instead of being reparented
    to PID 1 and running on. None where that needs what only Linux has (``prctl``).

    SIGTERM, not SIGKILL: a SuperLink or ``ray start --block`` given SIGTERM stops the
    processes it started itself (its SuperExec, its GCS server and raylet); a SIGKILL would
    leave them. Flower carries the signal further down: SuperExec and the ServerApp's
    process (``flwr-simulation``, ``flwr-serverapp``) watch their ``--parent-pid`` and stop
    within 0.2 s once it is gone. The signal comes when the starting *thread* ends: start
    long-lived processes from the main thread (every fleet here does)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:  # between fork and exec: nothing that allocates or locks
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def end_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """In a forked child (no exec): get ``sig`` when ``parent`` (the process that forked
    it) dies; if it is gone already, ``sig`` now. Nothing where ``prctl`` is missing."""
    prctl = _prctl()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


class FleetError(RuntimeError):
    """A Flower process died, or something did not happen before its deadline."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts: it is alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that are free right now. Taken together, every
    socket held open until all are chosen: ports asked for one after another may repeat (the
    kernel can hand a just-closed port out again), and Ray refuses one port for two roles."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def toml_value(value: Any) -> str:
    """``value`` written as in a TOML file / Flower's ``--run-config "k=v ..."``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | Path):
        return json.dumps(str(value))
    return repr(value)


def config_arg(values: Mapping[str, Any]) -> str:
    """``{"a": 1, "b": "x"}`` -> ``'a=1 b="x"'`` (``--run-config``, ``--node-config``)."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in values.items())


@dataclass
class FlowerProcess:
    """One process started by a fleet (the leader of its own process group)."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    args: list[str]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log file)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class _ProcInfo:
    pid: int
    state: str
    pgid: int
    cmd: str


def _processes() -> Iterable[tuple[_ProcInfo, bytes]]:
    """(pid, state, group, command line) and the raw environment of every visible process.
    State ``exiting``: the leader thread has ended (the kernel shows it as a zombie) while
    other threads still end, holding the process's files, and so its flocks."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            fields = stat.rpartition(")")[2].split()
            state, source = fields[0], entry
            if state == "Z":
                # A zombie leader's own environ cannot be read; a live thread's can.
                live = [t for t in (entry / "task").iterdir() if t.name != entry.name]
                if live:
                    state, source = "exiting", live[0]
            environ = (source / "environ").read_bytes()
            cmd = (source / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        yield _ProcInfo(int(entry.name), state, int(fields[2]), cmd.strip()), environ


RAY_TEMP_ROOT = "/tmp"
RAY_TEMP_PREFIX = "efray-"
_RAY_OWNER = ".edgefleet-owner"


def _own(temp_dir: Path) -> int:
    """Mark ``temp_dir`` as this process's: a flock on a file in it, which the kernel drops
    when this process ends, however it ends. Not inherited by the processes it starts."""
    fd = os.open(temp_dir / _RAY_OWNER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def sweep_ray_temp_dirs(root: str | Path = RAY_TEMP_ROOT) -> list[Path]:
    """Remove the Ray temp dirs (their logs grow with the run) that a fleet killed before it
    could stop (``kill -9``, a crash) left in ``root``: ours (this user's, with an owner
    file) whose owner's flock is free. Run before each Ray start, so a fleet that lives
    for days and is killed now and then does not fill ``/tmp``. The removed dirs."""
    removed = []
    for temp_dir in Path(root).glob(RAY_TEMP_PREFIX + "*"):
        try:
            if temp_dir.is_symlink() or temp_dir.lstat().st_uid != os.getuid():
                continue
            # Ray has run in it: a dir just made, whose owner file is not locked yet, has none.
            if not (temp_dir / "session_latest").is_symlink():
                continue
            fd = os.open(temp_dir / _RAY_OWNER, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # not one of ours (or an older run's, without an owner file)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # its fleet still runs
            continue
        try:
            shutil.rmtree(temp_dir, ignore_errors=True)
            removed.append(temp_dir)
        finally:
            os.close(fd)
    return removed


class FlowerFleet:
    """Every Flower process of one run or test; stop them all with ``stop()`` (or
    ``with``). SuperNodes and the CLI's listings, which only tests and deploy scripts use,
    are in ``fleetharness.fleet.DeploymentFleet``."""

    def __init__(self, workdir: Path, connection: str = "fleet") -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.flwr_home = workdir / "flwr-home"
        self.flwr_home.mkdir(exist_ok=True)
        self.connection = connection
        self.tag = uuid.uuid4().hex
        self.env: dict[str, str] = {
            **os.environ,
            **QUIET_FLOWER_ENV,
            "FLWR_HOME": str(self.flwr_home),
            # SuperExec checks for new runs once a second by default: up to 1 s of start-up
            # for every run of a deployment fleet. (Not on the simulation: start_superlink.)
            POLL_VAR: os.environ.get(POLL_VAR, "0.1"),
            "PATH": f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}",
            TAG_VAR: self.tag,
        }
        self.processes: list[FlowerProcess] = []
        self._previous_sigterm: Any = None
        self.superlink_address: str | None = None
        self.root_certificates: Path | None = None
        self.ray_address: str | None = None
        self.ray_temp_dirs: list[Path] = []
        self._ray_owners: list[int] = []  # flocked owner files, one a temp dir (_own)
        self._ray_head: FlowerProcess | None = None
        self._ray_head_start: tuple[list[str], dict[str, str]] = ([], {})  # to start it again
        self._ray_head_port = 0  # the head's GCS port, chosen with its other ports
        self._ray_timeout = 120.0
        self._count: dict[str, int] = {}

    # -- starting -------------------------------------------------------------------------

    def start(
        self,
        name: str,
        args: Sequence[str],
        *,
        echo: TextIO | None = None,
        env: Mapping[str, str] | None = None,
        netns: str | None = None,
    ) -> FlowerProcess:
        """Start ``args`` (``args[0]`` an executable next to ``sys.executable``) in its own
        session, stdout and stderr into ``<workdir>/<name>.log`` (and, line by line, to
        ``echo`` too when given). ``env`` replaces the fleet's environment for this one.
        ``netns``: inside that network namespace (``ip netns exec``, which execs the command
        in place: the PID and the group stay the command's own; root only)."""
        n = self._count[name] = self._count.get(name, 0) + 1
        log_path = self.workdir / (f"{name}.log" if n == 1 else f"{name}-{n}.log")
        cmd = [str(BIN_DIR / args[0]), *args[1:]]
        launch = cmd if netns is None else ["ip", "netns", "exec", netns, *cmd]
        with log_path.open("ab") as log:
            log.write(f"$ {' '.join(launch)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                launch,
                cwd=self.workdir,
                env=dict(env) if env is not None else self.env,
                stdin=subprocess.DEVNULL,
                stdout=log if echo is None else subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        if echo is not None:
            threading.Thread(target=_tee, args=(popen, log_path, echo), daemon=True).start()
        proc = FlowerProcess(name, popen, log_path, cmd)
        self.processes.append(proc)
        return proc

    def start_superlink(
        self,
        extra_args: Sequence[str] = (),
        *,
        root_certificates: Path | None = None,
        port: int | None = None,
        timeout: float = 60.0,
        simulation: bool = False,
        superexec_secret: Path | None = None,
        netns: str | None = None,
    ) -> FlowerProcess:
        """A Deployment Engine SuperLink on 127.0.0.1, ServerApps in subprocesses.

        Without ``root_certificates`` it runs ``--insecure``; with it, ``extra_args`` must
        hold the ``--ssl-*`` files. Returns once ``/health`` answers, having written this
        fleet's connection (``self.connection``) into ``$FLWR_HOME/config.toml``. With
        ``simulation`` it runs Flower's Simulation Engine instead of waiting for SuperNodes.

        ``superexec_secret`` (a file holding a secret, mode 0600): the Runtime API
        takes a task claim only when signed with it. Flower ignores the secret in its
        ``subprocess`` isolation (the SuperLink's own child claims unsigned, and so can any
        local process), so the SuperLink then runs ``--isolation process`` and this fleet
        starts the ServerApps' ``flower-superexec`` itself, with the same secret.

        ``netns``: both run inside that network namespace (root only), the SuperLink on every
        address of it (``--host 0.0.0.0``: a namespace of the caller's own, standing for a
        server on a LAN); the connection still names 127.0.0.1, as seen from inside it.
        """
        port = port or free_port()
        args = ["flower-superlink"]
        if root_certificates is None:
            args.append("--insecure")
        if simulation:
            args.append("--simulation")
            # Ray's init connects to the cluster named in /tmp/ray/ray_current_cluster when
            # there is one, and waits forever if that cluster was killed. Without a cluster
            # of our own (start_ray_head) or one the caller named (``ray_address``), start a
            # fresh one.
            self.env["RAY_ADDRESS"] = self.ray_address or "local"
        if superexec_secret is not None:
            extra_args = [
                *extra_args,
                "--superexec-auth-secret-file",
                str(superexec_secret),
            ]
        args += [
            "--isolation",
            "subprocess" if superexec_secret is None else "process",
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1" if netns is None else "0.0.0.0",
            "--port",
            str(port),
            *extra_args,
        ]
        env = self.env
        if simulation and POLL_VAR not in os.environ:
            # Here its SuperExec launches one task a run, and each poll costs the SuperLink
            # and the SuperExec about 4-5 ms of CPU: polling every 0.1 s took ~0.18 CPU-s a
            # round from the Ray actors at 100 devices (docs/benchmarks.md). Flower's default,
            # once a second, costs at most 1 s of a run's start-up instead.
            env = {k: v for k, v in self.env.items() if k != POLL_VAR}
        proc = self.start("superlink", args, env=env, netns=netns)
        self.superlink_address = f"127.0.0.1:{port}"
        self.root_certificates = root_certificates
        self.write_connection()
        if netns is None:
            self.wait_for_health(proc, timeout)
        else:
            self._wait_for_health_in(netns, proc, timeout)
        if superexec_secret is not None:
            tls = (
                ["--insecure"]
                if root_certificates is None
                else ["--root-certificates", str(root_certificates)]
            )
            self.start(
                "superexec",
                [
                    "flower-superexec",
                    *tls,
                    "--runtime-api-address",
                    self.superlink_address,
                    "--superexec-auth-secret-file",
                    str(superexec_secret),
                ],
                env=env,
                netns=netns,
            )
        return proc

    def start_ray_head(
        self,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        timeout: float = 120.0,
        *,
        wait: bool = True,
    ) -> str:
        """A Ray cluster of our own (``ray start --head --block``, a fleet process like any
        other): its own temp dir (so it never reads or writes ``/tmp/ray``, which every
        other local Ray on the machine shares) and free ports. Returns its address, now in
        ``self.env["RAY_ADDRESS"]``, once its GCS accepts connections (at once with
        ``wait=False``: then call :meth:`wait_for_ray` before a driver needs it). A driver's
        ``ray.init`` then waits for the node itself (``RAY_gcs_server_request_timeout_seconds``,
        set here to ``timeout``), so the rest of the start-up overlaps Ray's.

        Started before the SuperLink, the cluster is up by the time the Simulation Engine
        calls ``ray.init``, which then connects (under a second) instead of starting one
        (about 5 s on 2 idle cores); a sweep reuses it for every run.
        """
        self._ray_head = self._start_ray("ray-head", ["--head"], num_cpus, num_gpus)
        port = self._ray_head_port
        self._ray_timeout = timeout
        self.ray_address = f"127.0.0.1:{port}"
        self.env["RAY_ADDRESS"] = self.ray_address
        self.env["RAY_gcs_server_request_timeout_seconds"] = str(int(timeout))
        if wait:
            self.wait_for_ray()
        return self.ray_address

    def start_ray_node(
        self, address: str, num_cpus: int | None = None, num_gpus: int | None = None
    ) -> FlowerProcess:
        """Another node (``ray start --address``) joining the cluster at ``address``, with
        its own temp dir and ports: a second machine, on this one."""
        return self._start_ray("ray-node", [f"--address={address}"], num_cpus, num_gpus)

    def _start_ray(
        self, name: str, role: list[str], num_cpus: int | None, num_gpus: int | None
    ) -> FlowerProcess:
        # Unix socket paths live under the temp dir and may not exceed 107 bytes.
        sweep_ray_temp_dirs()
        temp_dir = Path(tempfile.mkdtemp(prefix=RAY_TEMP_PREFIX, dir=RAY_TEMP_ROOT))
        self._ray_owners.append(_own(temp_dir))
        self.ray_temp_dirs.append(temp_dir)
        head = "--head" in role
        args = ["ray", "start", *role, "--block", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
        ports = free_ports(len(_RAY_PORT_FLAGS) + 2)  # all distinct: Ray checks
        args += [f"{flag}={port}" for flag, port in zip(_RAY_PORT_FLAGS, ports, strict=False)]
        if head:  # no dashboard: its API needs ray[default]
            self._ray_head_port, dashboard = ports[-1], ports[-2]
            args += [f"--port={ports[-1]}", "--include-dashboard=false"]
            args.append(f"--dashboard-port={dashboard}")
        if num_cpus is not None:
            args.append(f"--num-cpus={num_cpus}")
        if num_gpus is not None:
            args.append(f"--num-gpus={num_gpus}")
        env = {k: v for k, v in self.env.items() if k != "RAY_ADDRESS"}
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        if head:
            self._ray_head_start = (args, env)
        return self.start(name, args, env=env)

    def wait_for_log(self, proc: FlowerProcess, text: str, timeout: float) -> None:
        """Until ``text`` appears in ``proc``'s log; fail early if it exits."""
        deadline = time.monotonic() + timeout
        while text not in proc.log_path.read_text(errors="replace"):
            if not proc.running():
                raise FleetError(
                    f"{proc.name} exited with code {proc.popen.returncode}; log:\n{proc.tail()}"
                )
            if time.monotonic() > deadline:
                raise FleetError(f"{proc.name}: no {text!r} within {timeout:.0f} s")
            time.sleep(0.2)

    def wait_for_ray(self) -> None:
        """Until the Ray head started by :meth:`start_ray_head` is up: its node registered
        (``ray start`` prints ``Ray runtime started.``), not only its GCS port open.

        ``ray start`` gives its raylet a fixed 30 s to register (``ray/_private/node.py``; no
        setting moves it), which a machine with many more runnable processes than cores can
        exceed; the head then exits. That exit is a start-up race, not a broken setup: the
        head is started again, on the same ports (nothing has connected to it yet), up to
        :data:`RAY_START_ATTEMPTS` times, each retry logged."""
        if self._ray_head is None or self.ray_address is None:
            raise FleetError("no Ray head started")
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            head = self._ray_head
            try:
                self.wait_for_log(head, RAY_STARTED, self._ray_timeout)
                return
            except FleetError:
                timed_out = RAY_NODE_TIMED_OUT in head.log_path.read_text(errors="replace")
                if head.running() or not timed_out or attempt == RAY_START_ATTEMPTS:
                    raise
            # Its GCS server and raylet may outlive it, holding the ports: end them too.
            temp_dir = next(a for a in head.args if a.startswith("--temp-dir="))[11:]
            orphans = [m for m in self.members() if temp_dir in m.cmd]
            _signal_all([head], orphans, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.popen.wait(timeout=5.0)
            print(
                f"edgefleet: Ray's head timed out registering its node (attempt {attempt} of "
                f"{RAY_START_ATTEMPTS}, load average {os.getloadavg()[0]:.1f}): starting it "
                "again",
                file=sys.stderr,
            )
            args, env = self._ray_head_start
            self._ray_head = self.start("ray-head", args, env=env)

    def write_connection(self) -> Path:
        """``$FLWR_HOME/config.toml`` with one connection, the default, to our SuperLink."""
        if self.superlink_address is None:
            raise FleetError("no SuperLink started")
        lines = [
            "[superlink]",
            f"default = {toml_value(self.connection)}",
            "",
            f"[superlink.{self.connection}]",
            f"address = {toml_value(self.superlink_address)}",
        ]
        if self.root_certificates is None:
            lines.append("insecure = true")
        else:
            lines.append(f"root-certificates = {toml_value(self.root_certificates.resolve())}")
        path = self.flwr_home / "config.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def wait_for_health(self, proc: FlowerProcess, timeout: float) -> None:
        """Poll the SuperLink's ``/health`` until it answers 2xx; fail early if it dies."""
        scheme = "http" if self.root_certificates is None else "https"
        url = f"{scheme}://{self.superlink_address}/health"
        context = None
        if self.root_certificates is not None:
            context = ssl.create_default_context(cafile=str(self.root_certificates))
        deadline = time.monotonic() + timeout
        while True:
            if not proc.running():
                raise FleetError(
                    f"{proc.name} exited with code {proc.popen.returncode} before it was "
                    f"healthy; log:\n{proc.tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                    if 200 <= resp.status < 300:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise FleetError(f"{url} did not answer within {timeout:.0f} s")
            time.sleep(0.25)

    def _wait_for_health_in(self, netns: str, proc: FlowerProcess, timeout: float) -> None:
        """:meth:`wait_for_health` from inside ``netns`` (a poller run there)."""
        scheme = "http" if self.root_certificates is None else "https"
        url = f"{scheme}://{self.superlink_address}/health"
        ca = str(self.root_certificates) if self.root_certificates is not None else ""
        poller = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", _HEALTH_POLLER, url, ca],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        try:
            while poller.poll() is None:
                if not proc.running():
                    raise FleetError(
                        f"{proc.name} exited with code {proc.popen.returncode} before it "
                        f"was healthy; log:\n{proc.tail()}"
                    )
                if time.monotonic() > deadline:
                    raise FleetError(f"{url} in {netns} did not answer within {timeout:.0f} s")
                time.sleep(0.25)
        finally:
            if poller.poll() is None:
                poller.kill()
            poller.wait()
        if poller.returncode != 0:
            raise FleetError(f"polling {url} in {netns} failed (exit {poller.returncode})")

    # -- the flwr CLI ---------------------------------------------------------------------

    def flwr(self, *args: str, name: str = "flwr", echo: TextIO | None = None) -> FlowerProcess:
        """Start ``flwr ARGS`` (the CLI) like any other fleet process; returns at once."""
        return self.start(name, ["flwr", *args], echo=echo)

    def check_alive(self) -> None:
        """Raise if a SuperLink, SuperNode or Ray head has exited."""
        for proc in self.processes:
            if _is_server(proc) and not proc.running():
                raise FleetError(
                    f"{proc.name} exited with code {proc.popen.returncode}; log:\n{proc.tail()}"
                )

    # -- stopping -------------------------------------------------------------------------

    def members(self) -> list[_ProcInfo]:
        """Live (non-zombie) processes of ours: in a group we started, or carrying our tag."""
        groups = {p.pid for p in self.processes}
        marker = f"{TAG_VAR}={self.tag}".encode()
        return [
            info
            for info, environ in _processes()
            if info.state != "Z"
            and info.pid != os.getpid()
            and (info.pgid in groups or marker in environ.split(b"\0"))
        ]

    def stop(self, term_timeout: float = 10.0, kill_timeout: float = 5.0) -> None:
        """SIGTERM every group and tagged process, wait, then SIGKILL whatever is left."""
        for sig, timeout in ((signal.SIGTERM, term_timeout), (signal.SIGKILL, kill_timeout)):
            _signal_all(self.processes, self.members(), sig)
            deadline = time.monotonic() + timeout
            while True:
                for proc in self.processes:
                    proc.popen.poll()  # reap our own children
                if not self.members() or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            if not self.members():
                break
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=1.0)
        if not self.members():
            for temp_dir in self.ray_temp_dirs:
                shutil.rmtree(temp_dir, ignore_errors=True)
            for fd in self._ray_owners:
                os.close(fd)
            self.ray_temp_dirs, self._ray_owners = [], []

    def survivors(self) -> list[str]:
        """``"pid (group g): command"`` for each of our processes still alive."""
        return [f"{i.pid} (group {i.pgid}): {i.cmd}" for i in self.members()]

    def report(self, lines: int = 40) -> str:
        """The tail of every process's log, for a failing test's output."""
        parts = []
        for proc in self.processes:
            if proc.name == "flwr-cli" and proc.popen.returncode == 0:
                continue  # the many successful `flwr supernode ls` polls
            state = "running" if proc.running() else f"exit code {proc.popen.returncode}"
            parts.append(
                f"===== {proc.name} (pid {proc.pid}, {state}): {proc.log_path}\n{proc.tail(lines)}"
            )
        return "\n".join(parts)

    def __enter__(self) -> FlowerFleet:
        # A SIGTERM (``timeout``, ``kill``) would end Python without running ``__exit__``
        # and leave the fleet running; turn it into SystemExit so the fleet is stopped.
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)


# Run inside a network namespace: poll URL (argv[1]) until it answers 2xx, verifying TLS with
# the CA in argv[2] when one is given; the caller bounds the wait.
_HEALTH_POLLER = (
    "import ssl, sys, time, urllib.request\n"
    "ctx = ssl.create_default_context(cafile=sys.argv[2]) if sys.argv[2] else None\n"
    "while True:\n"
    "    try:\n"
    "        with urllib.request.urlopen(sys.argv[1], timeout=1.0, context=ctx) as r:\n"
    "            if 200 <= r.status < 300: break\n"
    "    except OSError: pass\n"
    "    time.sleep(0.25)\n"
)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _is_supernode(proc: FlowerProcess) -> bool:
    name = Path(proc.args[0]).name
    return name == "flower-supernode" or (name == "edgefleet" and proc.args[1:2] == ["supernode"])


def _is_server(proc: FlowerProcess) -> bool:
    return Path(proc.args[0]).name in ("flower-superlink", "ray") or _is_supernode(proc)


def _signal_all(processes: Sequence[FlowerProcess], members: Sequence[_ProcInfo], sig: int) -> None:
    for proc in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
    for info in members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(info.pid, sig)


def _stop_groups(processes: Sequence[FlowerProcess]) -> None:
    """Stop the groups of ``processes`` alone (SIGTERM, 5 s, SIGKILL)."""
    _signal_all(processes, [], signal.SIGTERM)
    for proc in processes:
        try:
            proc.popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            _signal_all([proc], [], signal.SIGKILL)
            proc.popen.wait(timeout=5.0)


# `ray start --head` prints the first when its node is up; its raylet's fixed 30 s to register
# ran out when its log holds the second (ray/_private/node.py).
RAY_STARTED = "Ray runtime started."
RAY_NODE_TIMED_OUT = "timed out during startup"
RAY_START_ATTEMPTS = 3

# Every port `ray start` would otherwise take at a fixed default (the agent's 52365, ...),
# shared with any other Ray on the machine; the head's dashboard port is set apart.
_RAY_PORT_FLAGS = (
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
    "--node-manager-port",
    "--object-manager-port",
)


def _tee(popen: subprocess.Popen[bytes], log_path: Path, echo: TextIO) -> None:
    """Copy a process's output to its log file and to ``echo``, line by line."""
    assert popen.stdout is not None
    with log_path.open("ab") as log:
        for line in popen.stdout:
            log.write(line)
            log.flush()
            with contextlib.suppress(ValueError, OSError):  # echo closed under us
                echo.write(line.decode(errors="replace"))
                echo.flush()
