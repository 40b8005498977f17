"""The root docker-compose fleet, driven from Python: for tests/test_compose.py and
benchmarks/soak/compose_soak.py.

``docker compose`` (or Debian's ``docker-compose`` 1.29) builds, brings the project up and
takes it down: the Docker SDK for Python has no compose. Everything else goes through the
SDK (``docker`` on PyPI), not through parsed CLI output: the project's containers by their
compose labels, each container's memory (container stats: what ``docker stats`` shows, the
cgroup's usage less its inactive page cache), kill / stop / start / restart, logs, a file read
inside a container, a process killed inside one, and the containers left after ``down``.

The ``flwr`` CLI (from the host, over TLS, through ``control-proxy`` on 127.0.0.1) submits
and lists runs and nodes, as a user does. :meth:`ComposeFleet.attack` plays a LAN host that
holds ``ca.crt`` (``deploy/lan_attacker.py`` in a container on a network of its own).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from edgefleet.processes import BIN_DIR, QUIET_FLOWER_ENV, config_arg, free_port, toml_value

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CONNECTION = "edgefleet-compose"
RESULTS = "/app/runs"  # the `results` volume in the serverapp container
NUM_NODES = 3  # supernode-1..3 in docker-compose.yml, device-ids 0..2
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
OVERLAYS = (
    "docker-compose.yml",
    "deploy/compose.tls.yml",
    "deploy/compose.auth.yml",
    "deploy/compose.prometheus.yml",
)


def run_cmd(cmd: Sequence[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)


def compose_command() -> list[str] | None:
    """``docker compose`` (v2) where it works, else ``docker-compose`` (1.x), else None."""
    if shutil.which("docker"):
        try:
            if run_cmd(["docker", "compose", "version"], 20).returncode == 0:
                return ["docker", "compose"]
        except subprocess.TimeoutExpired:
            pass
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def unavailable() -> str | None:
    """Why no compose fleet can run here, or None."""
    try:
        import docker
    except ImportError:
        return "the Docker SDK for Python is not installed (`pip install docker`)"
    try:
        docker.from_env(timeout=20).ping()
    except Exception as e:  # noqa: BLE001 - any failure to reach the engine is the reason
        return f"no Docker engine answers ({type(e).__name__}: {str(e)[-300:]})"
    if compose_command() is None:
        return "neither `docker compose` (v2) nor `docker-compose` is installed"
    return None


def versions() -> dict[str, str]:
    """deploy/versions.env as a dict (compose reads the same file)."""
    values = {}
    for line in (DEPLOY / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def build_images() -> subprocess.CompletedProcess[str]:
    """What is missing of the base and app images (a no-op where they exist)."""
    return run_cmd(["bash", str(DEPLOY / "build-images.sh")], 1800, cwd=ROOT)


def memory_bytes(stats: dict[str, Any]) -> int | None:
    """A container's memory as ``docker stats`` reports it: usage less the inactive page
    cache (cgroup v2 ``inactive_file``, v1 ``total_inactive_file``); None when the engine
    gives no usage (a stopped container)."""
    mem = stats.get("memory_stats") or {}
    usage = mem.get("usage")
    if usage is None:
        return None
    inner = mem.get("stats") or {}
    cache = inner.get("inactive_file", inner.get("total_inactive_file", 0))
    return int(usage - cache) if cache < usage else int(usage)


def top_processes(
    service: str, top: dict[str, Any], kind: Callable[[str], str]
) -> dict[str, tuple[int, int]]:
    """``{"<service>/<kind>": (host pid, rss bytes)}`` from a container's ``docker top``
    answer run with ``ps -o pid,rss,args``; two of a kind get ``#<pid>`` after the name.
    A row that does not parse is left out."""
    titles = [str(t).upper() for t in top.get("Titles") or []]
    try:
        ipid, irss = titles.index("PID"), titles.index("RSS")
        iargs = titles.index("COMMAND") if "COMMAND" in titles else titles.index("ARGS")
    except ValueError:
        return {}
    out: dict[str, tuple[int, int]] = {}
    for row in top.get("Processes") or []:
        try:
            pid, rss, cmd = int(row[ipid]), int(row[irss]) * 1024, str(row[iargs])
        except (IndexError, TypeError, ValueError):
            continue
        role = f"{service}/{kind(cmd)}"
        out[f"{role}#{pid}" if role in out else role] = (pid, rss)
    return out


# Run inside a container with its own Python: SIGKILL every process whose command line holds
# the needle, print their pids. The images have no procps (pkill), every one has Python.
_KILL_SNIPPET = (
    "import os, signal, sys\n"
    "me = str(os.getpid())\n"
    "for p in os.listdir('/proc'):\n"
    "    if not p.isdigit() or p == me: continue\n"
    "    try: cmd = open(f'/proc/{p}/cmdline', 'rb').read()\n"
    "    except OSError: continue\n"
    "    if sys.argv[1].encode() in cmd and b'import os, signal' not in cmd:\n"
    "        os.kill(int(p), signal.SIGKILL); print(p)\n"
)


class ComposeFleet:
    """One compose project (its own name, ports and certificates) and the flwr CLI."""

    def __init__(self, tmp: Path, overlays: Sequence[str] = OVERLAYS) -> None:
        import docker

        compose = compose_command()
        if compose is None:
            raise RuntimeError("neither `docker compose` (v2) nor `docker-compose` is installed")
        self.docker = docker.from_env(timeout=120)
        self.project = f"edgefleet-test-{uuid.uuid4().hex[:8]}"
        self.port = free_port()  # the devices' port (fleet-proxy), on every interface
        self.control_port = free_port()  # the Control API (control-proxy), 127.0.0.1 only
        self.certs = tmp / "certs"
        self.flwr_home = tmp / "flwr-home"
        self.flwr_home.mkdir(parents=True)
        self.compose = [*compose, "-p", self.project, "--project-directory", str(ROOT)]
        for f in overlays:
            self.compose += ["-f", str(ROOT / f)]
        self.token = uuid.uuid4().hex
        self.dashboard_port = free_port()
        self.prometheus_port = free_port()
        self.env = {
            **os.environ,
            **versions(),
            **QUIET_FLOWER_ENV,
            "EDGEFLEET_SUPERLINK_PORT": str(self.port),
            "EDGEFLEET_CONTROL_PORT": str(self.control_port),
            "EDGEFLEET_CERTS_DIR": str(self.certs),
            "EDGEFLEET_DASHBOARD_TOKEN": self.token,
            "EDGEFLEET_DASHBOARD_PORT": str(self.dashboard_port),
            "EDGEFLEET_PROMETHEUS_PORT": str(self.prometheus_port),
            "FLWR_HOME": str(self.flwr_home),
            "COMPOSE_HTTP_TIMEOUT": "300",
        }
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f"address = {toml_value(f'127.0.0.1:{self.control_port}')}\n"
            f"root-certificates = {toml_value(self.certs / 'ca.crt')}\n"
        )
        self.timings: dict[str, float] = {}

    # -- compose and flwr (CLIs) -----------------------------------------------------------

    def run(self, *args: str, timeout: float = 120.0, check: bool = True) -> str:
        proc = run_cmd([*self.compose, *args], timeout, env=self.env, cwd=ROOT)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"`compose {' '.join(args)}` exited {proc.returncode}:\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc.stdout

    def gen_certs(self, nodes: int = NUM_NODES) -> None:
        subprocess.run(
            ["bash", str(DEPLOY / "gen-certs.sh"), "-o", str(self.certs), "-n", str(nodes)],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def flwr(self, *args: str, timeout: float = 60.0) -> dict[str, Any]:
        """``flwr ARGS --format json`` from the host; its JSON object."""
        proc = run_cmd(
            [str(BIN_DIR / "flwr"), *args, "--format", "json"], timeout, env=self.env, cwd=ROOT
        )
        start = proc.stdout.find("{")
        if start < 0:
            raise AssertionError(f"`flwr {' '.join(args)}`: no JSON\n{proc.stdout}{proc.stderr}")
        data: dict[str, Any] = json.loads(proc.stdout[start:])
        return data

    def online(self) -> int:
        data = self.flwr("supernode", "ls", CONNECTION)
        return sum(1 for n in data.get("nodes", []) if n.get("status") == "online")

    def wait_online(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (n := self.online()) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{n} of {count} SuperNodes online after {timeout:.0f} s")
            time.sleep(2.0)

    def submit(self, app: Path, run_config: dict[str, Any]) -> int:
        """``flwr run APP`` with ``run_config``; the run id."""
        data = self.flwr("run", str(app), CONNECTION, "--run-config", config_arg(run_config))
        assert data.get("success") is True, data
        return int(data["run-id"])

    # -- containers (the Docker SDK) --------------------------------------------------------

    def containers(self) -> dict[str, Any]:
        """``{service: Container}`` of this project, stopped ones included."""
        found = self.docker.containers.list(
            all=True, filters={"label": f"{PROJECT_LABEL}={self.project}"}
        )
        return {c.labels.get(SERVICE_LABEL, c.name): c for c in found}

    def container(self, service: str) -> Any:
        try:
            return self.containers()[service]
        except KeyError:
            raise AssertionError(
                f"no container for service {service!r} in {self.project}; "
                f"services: {sorted(self.containers())}"
            ) from None

    def kill(self, service: str) -> None:
        """SIGKILL (a board losing power); Docker's restart policy does not start it again."""
        self.container(service).kill()

    def stop(self, service: str, timeout: int = 10) -> None:
        """SIGTERM, SIGKILL after ``timeout`` s (a clean shutdown)."""
        self.container(service).stop(timeout=timeout)

    def start(self, service: str) -> None:
        self.container(service).start()

    def restart(self, service: str, timeout: int = 10) -> None:
        self.container(service).restart(timeout=timeout)

    def running(self, service: str) -> bool:
        c = self.container(service)
        c.reload()
        return bool(c.status == "running")

    def memory(self) -> dict[str, tuple[int, int]]:
        """``{service: (pid, bytes)}`` for every running container of the project: the
        container's main process as the host sees it (a restarted container has a new one)
        and its memory (one-shot stats: no 1 s wait for a CPU sample)."""
        out = {}
        for service, c in self.containers().items():
            if c.status != "running":
                continue
            try:
                value = memory_bytes(c.stats(stream=False, one_shot=True))
            except Exception:  # noqa: BLE001 - it stopped between list and stats
                continue
            if value is not None:
                out[service] = (int(c.attrs.get("State", {}).get("Pid", 0)), value)
        return out

    def processes(
        self, kind: Callable[[str], str] = lambda cmd: cmd.split(" ", 1)[0]
    ) -> dict[str, tuple[int, int]]:
        """Every process of every running container, ``{"<service>/<kind>": (host pid, rss
        bytes)}`` (:func:`top_processes`; ``kind`` names a process by its command line).
        ``docker top`` runs ``ps`` on the engine's host, so the images need no procps. A
        container's memory (:meth:`memory`) holds all its processes at once: an executor
        whose ClientApp runs for a while is judged apart from that ClientApp here."""
        out: dict[str, tuple[int, int]] = {}
        for service, c in self.containers().items():
            if c.status != "running":
                continue
            try:
                top = c.top(ps_args="-o pid,rss,args")
            except Exception:  # noqa: BLE001 - it stopped between list and top
                continue
            out.update(top_processes(service, top, kind))
        return out

    def restarts(self, service: str) -> int:
        """How often Docker's restart policy has started ``service`` again."""
        c = self.container(service)
        return int(c.attrs.get("RestartCount", 0))

    def logs(self, tail: int = 40) -> str:
        parts = []
        for service, c in sorted(self.containers().items()):
            text = c.logs(tail=tail).decode(errors="replace")
            parts.append(f"--- {service} ({c.status}) ---\n{text}")
        return "\n".join(parts)

    def read(self, service: str, path: str) -> str | None:
        """A file read inside a running container (None if absent or not running)."""
        c = self.container(service)
        try:
            code, output = c.exec_run(["cat", path])
        except Exception:  # noqa: BLE001 - the container is not running (a restart)
            return None
        return output.decode() if code == 0 else None

    def kill_process(self, service: str, needle: str) -> list[int]:
        """SIGKILL the processes inside ``service`` whose command line holds ``needle`` (by
        their container pids, listed); the container itself keeps running."""
        code, output = self.container(service).exec_run(["python", "-c", _KILL_SNIPPET, needle])
        if code != 0:
            raise AssertionError(f"killing {needle!r} in {service}: {output.decode()[-500:]}")
        return [int(p) for p in output.decode().split()]

    def attack(self, app: Path, run_id: int, timeout: float = 600.0) -> dict[str, Any]:
        """``deploy/lan_attacker.py`` as a LAN host: in a container of the ``flwr/superexec``
        image on a network of its own (not the project's), holding ``ca.crt``, the app and
        a public key of its own, dialing this host's published ports by the name the server
        certificate carries (``superlink`` -> the Docker host), and the SuperLink
        container's own addresses directly. Its JSON answer (see the script)."""
        network = self.docker.networks.create(f"{self.project}-lan", driver="bridge")
        try:
            network.reload()
            gateway = network.attrs["IPAM"]["Config"][0]["Gateway"]
            link = self.container("superlink")
            link.reload()
            direct = [
                f"{net['IPAddress']}:8000"
                for net in link.attrs["NetworkSettings"]["Networks"].values()
                if net.get("IPAddress")
            ]
            keys = self.certs / "attacker"
            keys.mkdir(exist_ok=True)
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f",
                 str(keys / "key")],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            (keys / "key").unlink()  # the attacker registers a public key; it needs no more
            command = [
                "python", "/attack/lan_attacker.py", "--ca", "/attack/ca.crt",
                "--app", "/attack/app", "--pubkey", "/attack/key.pub",
                "--run-id", str(run_id), "--fleet", f"superlink:{self.port}",
                "--closed", f"{gateway}:{self.control_port}",
                *[x for a in direct for x in ("--closed", a)],
            ]  # fmt: skip
            ro = "ro"
            volumes = {
                str(DEPLOY / "lan_attacker.py"): {"bind": "/attack/lan_attacker.py", "mode": ro},
                str(DEPLOY / "runtime_claim.py"): {"bind": "/attack/runtime_claim.py", "mode": ro},
                str(self.certs / "ca.crt"): {"bind": "/attack/ca.crt", "mode": ro},
                str(keys / "key.pub"): {"bind": "/attack/key.pub", "mode": ro},
                str(app): {"bind": "/attack/app", "mode": ro},
            }
            container = self.docker.containers.run(
                f"flwr/superexec:{versions()['FLWR_VERSION']}",
                command,
                entrypoint=[],
                detach=True,
                network=network.name,
                extra_hosts={"superlink": gateway},
                volumes=volumes,
                environment={**QUIET_FLOWER_ENV, "HOME": "/tmp"},
                labels={PROJECT_LABEL: self.project, SERVICE_LABEL: "lan-attacker"},
                working_dir="/tmp",
            )
            try:
                status = container.wait(timeout=timeout)
                output = container.logs(stdout=True, stderr=False).decode(errors="replace")
                errors = container.logs(stdout=False, stderr=True).decode(errors="replace")
            finally:
                container.remove(force=True)
            start = output.rfind("\n{")
            try:
                data: dict[str, Any] = json.loads(output[start + 1 :])
            except json.JSONDecodeError:
                raise AssertionError(
                    f"lan_attacker.py exited {status}:\n{output[-3000:]}\n{errors[-3000:]}"
                ) from None
            return data
        finally:
            network.remove()

    def leftovers(self) -> list[str]:
        return [c.name for c in self.containers().values()]

    # -- results (on the `results` volume, read inside the serverapp container) --------------

    def rows(self, run_name: str) -> list[dict[str, Any]]:
        text = self.read("serverapp", f"{RESULTS}/{run_name}/metrics.jsonl") or ""
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the last line, still being written
                break
        return rows

    def summary(self, run_name: str) -> dict[str, Any] | None:
        text = self.read("serverapp", f"{RESULTS}/{run_name}/summary.json")
        if text is None:
            return None
        data: dict[str, Any] = json.loads(text)
        return data

    def wait_summary(self, run_name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (summary := self.summary(run_name)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_name}: no summary.json after {timeout:.0f} s")
            time.sleep(3.0)
        return summary

    def step(self, name: str, t0: float) -> None:
        self.timings[name] = round(time.monotonic() - t0, 1)

    def down(self) -> list[str]:
        """``down -v``; the names of the project's containers that outlived it."""
        self.run("down", "-v", "--remove-orphans", "-t", "5", timeout=180, check=False)
        return self.leftovers()
