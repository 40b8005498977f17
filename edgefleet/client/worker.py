"""A warm ClientApp executor for a SuperNode: one long-lived process runs every message.

Why. Flower 1.42's SuperNode, in its default ``--isolation subprocess``, has its SuperExec
start a fresh ``flwr-clientapp`` process for every message it receives. That process starts
Python, imports flwr, pulls the message, the Context and the app bundle (FAB) from the
SuperNode, unpacks the FAB into ``$FLWR_HOME/apps``, imports the ClientApp (torch with it),
rebuilds the device's data and model, trains, pushes the reply and the Context back, and
exits. ``benchmarks/perf/deploy_overhead.py`` measures every step; on this machine everything but
the training is several seconds a message, and a device on harvested energy pays for it.
A ClientApp process that only forwards to a warm worker still imports flwr and does Flower's
bookkeeping per message, which alone measured more than a second: too much.

How. With ``flower-supernode --isolation process`` the SuperNode starts no SuperExec: it
queues each message as a task on its Runtime API and waits for an executor to claim it. This
module is that executor. It claims ``flwr-clientapp`` tasks (``AcquireTask``) and runs each in
its own interpreter with the very functions ``flwr-clientapp`` uses (``pull_task_input``,
``install_from_fab``, Flower's ClientApp loader, ``push_message``, ``push_task_output``), so
a message gets exactly the handling it would get from Flower (only the message's objects are
pulled with shorter retry waits, ``PULL_FIRST_RETRY_S``, and given up as soon as the SuperNode
has given them up: ``_Successor``). What stays warm between
messages: the interpreter, the flwr and torch imports (torch is imported at start, before the
first message), the installed FAB and its loaded ClientApp module, and with it whatever that
module caches per process (EdgeFleet's :mod:`edgefleet.client.device`: the local data and the
model). What never stays: the ``Context``. It is pulled from the SuperNode with every message
and pushed back after it, as ``flwr-clientapp`` does, so ``Context.state`` (the battery of
:mod:`edgefleet.client.mods`) lives in one place, the SuperNode, and cannot fork.

A task of another FAB (a changed app) unloads the previous app's modules (the FAB's top-level
packages, found in its folder) and imports the new one's from its folder, first on
``sys.path``: every message runs the code of its own run's FAB, never an installed copy.

Start it as ``edgefleet supernode ARGS``: that runs ``flower-supernode --isolation process
ARGS`` as its child, serves the child's Runtime API, ends when the child ends and takes the
child down when it is stopped itself. A random secret in a private (0700) folder, given to
both as ``--superexec-auth-secret-file``, lets only holders of that file (the node's user and
root) claim the node's tasks on the loopback Runtime API. ``edgefleet worker
--runtime-api-address HOST:PORT`` is the executor alone, for a SuperNode started otherwise.

Limits. One message at a time (the SuperNode hands out one at a time too). A ClientApp that
crashes the interpreter (a segfault, the OOM killer) takes the worker down with it, which
under ``edgefleet supernode`` ends the SuperNode as well: run the node under a supervisor
(systemd ``Restart=``, a container restart policy) as for any SuperNode. State that a ClientApp
keeps in module globals survives between messages; EdgeFleet's is a cache keyed by the run
config and node config. Linux or macOS; the parent-death signal is Linux only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from logging import DEBUG, ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import httpx
from flwr.app import Context, Error, Message

# fp: every Flower internal the worker uses, through one module that checks the installed
# Flower against the version they were read from (edgefleet/client/flower_private.py).
if __package__:  # edgefleet supernode|worker, python -m edgefleet.client.worker
    from edgefleet.client import flower_private as fp
else:  # this file run as a script (deploy/pi/worker.py): the adapter is the file beside it
    import flower_private as fp  # type: ignore[no-redef]

# AcquireTask is the one Runtime API call that is not scoped by a task token.
ACQUIRE_TASK = "/flwr.proto.Runtime/AcquireTask"
# Claim polls: quick right after a task (a status query is often followed by a train message
# within a second), then backing off so that an idle node polls its loopback API 4 times a
# second at most. Flower's own SuperExec polls once a second (FLWR_SUPEREXEC_TASK_POLL_INTERVAL).
MIN_POLL_S = 0.02
MAX_POLL_S = 0.25
# Flower pulls a message's objects with its first retry after 1 s (PULL_INITIAL_BACKOFF), and
# a worker that claims within 20 ms often asks before the SuperNode holds all of them: it lost
# 0.74 s a round waiting out that backoff (benchmarks/perf/deploy_overhead.py, "task_input"). Same
# pull, first retry after 20 ms, doubling to at most 1 s (500 tries, Flower's limit: ~8 min).
PULL_FIRST_RETRY_S = 0.02
PULL_RETRY_CAP_S = 1.0
# A task whose message's objects are still missing asks the SuperNode at most this often
# whether it has taken its next message (``_Successor``): the delay, at worst, before the
# worker gives up a message that the SuperNode gave up.
SUCCESSOR_CHECK_S = 0.5
# flower-supernode's own exit is bounded by Flower's force-exit timer (5 s, then os._exit):
# more than enough to deactivate the node at the SuperLink. Killed only after this.
CHILD_STOP_S = 15.0
DEFAULT_PRELOAD = ("torch",)
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class WorkerError(RuntimeError):
    """The worker cannot start (bad arguments, no ``flower-supernode``)."""


@dataclass(frozen=True)
class RuntimeAddress:
    """Where the SuperNode's Runtime API listens, and how to reach it."""

    address: str
    root_certificates: str | None = None  # None: plain HTTP (loopback)
    auth_secret: bytes | None = None

    @property
    def insecure(self) -> bool:
        return self.root_certificates is None


def _retry_invoker(max_time: float = 60.0) -> fp.RetryInvoker:
    """Retries on transport errors only. Flower's own HTTP invoker signals SIGINT to its
    process on a 401 (the token of a finished task): right for a one-message process, fatal
    for a worker that must go on with the next task."""
    return fp.RetryInvoker(
        lambda: fp.exponential(max_delay=5),
        recoverable_exceptions=(httpx.TransportError,),
        max_tries=None,
        max_time=max_time,
        jitter=None,
    )


class TaskAbandoned(Exception):
    """The SuperNode gave up this task's message: its objects will never come."""


class _Successor:
    """The SuperNode's next ClientApp task, claimed while the current task still waits for
    the objects of its message: proof that they will never come.

    Flower 1.42's SuperNode takes one message at a time: it creates the message's task, pulls
    the message's objects from the SuperLink, stores them all at once, and then waits for a
    reply before it takes the next message. When the run stops while those objects are on
    their way (a ServerApp killed mid-round; the SuperLink answers ``RunNotRunningException``)
    it drops the message but leaves its task pending and the objects missing
    (``start_client_internal._pull_and_store_message`` catches that exception without
    finishing the task), and takes the next message. A ``flwr-clientapp`` process started for
    the left task polls for those objects (500 tries) while the SuperExec starts processes for
    the next tasks beside it; the warm worker runs one task at a time and waited out all 500
    tries, ~8 minutes, answering nothing meanwhile (a resumed run got no reply). So a task
    that appears while objects are missing means the SuperNode left this message: had it
    stored the objects, it would still be waiting for this task's reply."""

    def __init__(self, claim: Callable[[], str | None]) -> None:
        self._claim = claim
        self._lock = threading.Lock()
        self._checked_at = -SUCCESSOR_CHECK_S
        self.token: str | None = None

    def arrived(self) -> bool:
        with self._lock:  # the object pulls run in several threads
            now = time.monotonic()
            if self.token is None and now - self._checked_at >= SUCCESSOR_CHECK_S:
                self._checked_at = now
                self.token = self._claim()
            return self.token is not None


class _TaskClient(fp.RuntimeHttpClient):
    """The Runtime API as one task sees it; given ``successor``, an object of the message
    that is still missing once the SuperNode has taken its next message raises
    :class:`TaskAbandoned` instead of being retried (Flower would retry it 500 times)."""

    successor: _Successor | None = None

    def PullObject(self, request: Any) -> Any:  # Flower's name
        response = super().PullObject(request)
        if not response.object_found or response.object_available or self.successor is None:
            return response
        if not self.successor.arrived():
            return response  # Flower retries it
        response = super().PullObject(request)  # once more: stored just before it moved on
        if response.object_found and not response.object_available:
            raise TaskAbandoned(
                f"run {request.run_id}: object {request.object_id[:12]} of the message is "
                "still missing and the SuperNode has taken its next message, so it gave this "
                "one up (the run stopped while the message was on its way)"
            )
        return response


def _client(runtime: RuntimeAddress, extra: Sequence[Any] = ()) -> _TaskClient:
    return _TaskClient.from_server_address(
        server_address=runtime.address,
        insecure=runtime.insecure,
        root_certificates=runtime.root_certificates,
        interceptors=[fp.RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), *extra],
        retry_invoker=_retry_invoker(),
    )


def _app_packages(app_dir: Path) -> set[str]:
    """The top-level module names a FAB's folder provides (packages and single modules)."""
    names = set()
    for entry in app_dir.iterdir():
        if entry.is_dir() and (entry / "__init__.py").exists():
            names.add(entry.name)
        elif entry.suffix == ".py":
            names.add(entry.stem)
    return names


def _unload(names: set[str]) -> None:
    """Forget the modules named ``names`` and their submodules, so that the next import reads
    them from the folder first on ``sys.path``."""
    for module in list(sys.modules):
        if module.partition(".")[0] in names:
            del sys.modules[module]
    importlib.invalidate_caches()


class WarmApp:
    """The ClientApp of the FAB last seen, loaded once and reused while the FAB stays."""

    def __init__(self) -> None:
        self.fab_hash: str | None = None
        self.app_dir: Path | None = None
        self.app: fp.ClientApp | None = None
        self._packages: set[str] = set()

    def load(self, fab_id: str, fab_version: str, fab_hash: str, content: bytes) -> fp.ClientApp:
        if self.app is not None and fab_hash == self.fab_hash:
            return self.app
        fp.install_from_fab(content, skip_prompt=True)
        app_dir = fp.get_project_dir(fab_id, fab_version, fab_hash).absolute()
        packages = _app_packages(app_dir)
        # Whatever an earlier FAB (or the worker's own import of this package) loaded must not
        # answer for this FAB's modules; and this FAB's folder goes first on sys.path.
        _unload(self._packages | packages)
        for stale in {str(self.app_dir), str(app_dir)}:
            while stale in sys.path:
                sys.path.remove(stale)
        sys.path.insert(0, str(app_dir))
        self.fab_hash, self.app_dir, self.app, self._packages = None, app_dir, None, packages
        loader = fp.get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        self.app = loader(fab_id, fab_version, fab_hash)
        self.fab_hash = fab_hash
        fp.log(INFO, "Worker: loaded the ClientApp of FAB %s from %s", fab_hash[:12], app_dir)
        return self.app


def _heartbeat(client: fp.RuntimeHttpClient, lost: threading.Event) -> Callable[[], bool]:
    """Flower's task heartbeat, except that a task the SuperNode no longer knows sets
    ``lost`` instead of sending SIGINT to this process."""
    request = fp.SendTaskHeartbeatRequest()

    def beat() -> bool:
        try:
            response = client.SendTaskHeartbeat(request)
        except (httpx.TransportError, fp.RunNotRunningException):
            return False
        except httpx.HTTPStatusError:
            lost.set()
            return True
        if not response.success:
            lost.set()
        return True

    return beat


@contextlib.contextmanager
def _quick_object_pulls() -> Iterator[None]:
    """Flower's ``pull_task_input`` as it is, with shorter retry waits for the objects."""
    flower_pull = fp.run_clientapp.pull_and_inflate_object_from_tree
    fp.run_clientapp.pull_and_inflate_object_from_tree = functools.partial(
        flower_pull, initial_backoff=PULL_FIRST_RETRY_S, backoff_cap=PULL_RETRY_CAP_S
    )
    try:
        yield
    finally:
        fp.run_clientapp.pull_and_inflate_object_from_tree = flower_pull


def run_task(
    runtime: RuntimeAddress, token: str, warm: WarmApp, successor: _Successor | None = None
) -> str:
    """Run one claimed ClientApp task as ``flwr-clientapp`` would; its final sub-status.
    With ``successor``, a task whose message the SuperNode gave up ends as soon as the
    SuperNode's next task is claimed (``successor.token``)."""
    client = _client(runtime, [fp.RuntimeTokenHttpInterceptor(token)])
    client.successor = successor
    lost = threading.Event()
    heartbeat = fp.HeartbeatSender(_heartbeat(client, lost))
    message: Message | None = None
    reply: Message | None = None
    context: Context | None = None
    sub_status, details = fp.SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        heartbeat.start()
        with _quick_object_pulls():
            message, context, run, fab = fp.run_clientapp.pull_task_input(client)
        app = warm.load(run.fab_id, run.fab_version, fab.hash_str, fab.content)
        reply = app(message=message, context=context)
        sub_status, details = fp.SubStatus.COMPLETED, ""
    except fp.RunNotRunningException:
        fp.log(INFO, "Worker: the run of this task is no longer running; task dropped")
        details = "run not running"
    except TaskAbandoned as gone:  # no reply, and the SuperNode's Context stays as it is
        fp.log(WARNING, "Worker: task abandoned, going on with the next one: %s", gone)
        details = f"abandoned: {gone}"
    except Exception as ex:  # as flwr-clientapp: any error becomes an Error reply
        code = fp.ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        reason = f"{type(ex)}:<'{ex}'>"
        if isinstance(ex, fp.LoadClientAppError):
            code = fp.ErrorCode.LOAD_CLIENT_APP_EXCEPTION
            reason = "An exception was raised when attempting to load `ClientApp`"
        fp.log(ERROR, "ClientApp raised an exception", exc_info=ex)
        details = reason
        if message is not None:
            reply = Message(Error(code=code, reason=reason), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None and not lost.is_set():
                fp.run_clientapp.push_message(client, reply, context)
        except Exception as ex:  # a run stopped meanwhile, the SuperNode went away
            fp.log(ERROR, "Worker: failed to push the reply: %s", ex)
        # The Context goes back whatever happened, as flwr-clientapp's exit handler does.
        with contextlib.suppress(Exception):
            fp.run_clientapp.push_task_output(client, context, sub_status, details)
        heartbeat.stop()
        client.close()
    return str(sub_status)


def serve(
    runtime: RuntimeAddress,
    *,
    alive: Callable[[], bool] = lambda: True,
    stop: threading.Event | None = None,
    max_tasks: int | None = None,
) -> int:
    """Claim and run ClientApp tasks until ``alive()`` turns false, ``stop`` is set or
    ``max_tasks`` ran; the number of tasks run."""
    stop = stop or threading.Event()
    extra = []
    if runtime.auth_secret is not None:
        extra.append(
            fp.SuperExecAuthHttpInterceptor(
                master_secret=runtime.auth_secret, protected_methods={ACQUIRE_TASK}
            )
        )
    control = fp.RuntimeHttpClient.from_server_address(
        server_address=runtime.address,
        insecure=runtime.insecure,
        root_certificates=runtime.root_certificates,
        interceptors=[fp.RuntimeVersionHttpInterceptor(component_name="SuperExec"), *extra],
        retry_invoker=None,
    )
    request = fp.AcquireTaskRequest(supported_task_types=[fp.TaskType.CLIENT_APP])

    def claim() -> str | None:
        try:
            response = control.AcquireTask(request)
        except httpx.HTTPError:
            return None
        return response.token if response.HasField("task") and response.token else None

    warm = WarmApp()
    done, delay, reported = 0, MIN_POLL_S, False
    claimed: str | None = None  # the next task, claimed while the last one ran
    try:
        while alive() and not stop.is_set() and (max_tasks is None or done < max_tasks):
            if claimed is not None:
                successor = _Successor(claim)
                run_task(runtime, claimed, warm, successor)
                claimed = successor.token
                done += 1
                delay = MIN_POLL_S
                continue
            try:
                response = control.AcquireTask(request)
            except httpx.HTTPStatusError as err:
                if err.response.status_code in (401, 403):
                    raise WorkerError(
                        "the SuperNode refused to hand out tasks "
                        f"({err.response.status_code}): is the worker's "
                        "--superexec-auth-secret-file the SuperNode's?"
                    ) from None
                response = None
            except httpx.TransportError:  # not up yet, or going away
                if not reported:
                    fp.log(DEBUG, "Worker: Runtime API at %s not reachable yet", runtime.address)
                    reported = True
                stop.wait(MAX_POLL_S)
                continue
            if response is not None and response.HasField("task") and response.token:
                claimed = response.token
                continue
            stop.wait(delay)
            delay = min(MAX_POLL_S, delay * 2)
    finally:
        control.close()
    return done


def preload(modules: Sequence[str]) -> None:
    """Import the ClientApp's heavy dependencies before the first message arrives."""
    for name in modules:
        t0 = time.monotonic()
        try:
            importlib.import_module(name)
        except ImportError as err:
            fp.log(WARNING, "Worker: cannot preload %s: %s", name, err)
            continue
        fp.log(INFO, "Worker: imported %s in %.1f s", name, time.monotonic() - t0)


# -- command line ---------------------------------------------------------------------------


def _preload_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preload",
        default=",".join(DEFAULT_PRELOAD),
        metavar="MODULES",
        help="comma-separated modules to import at start (default: torch; '' for none)",
    )


def _modules(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def _read_secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        secret = Path(path).expanduser().read_bytes()
    except OSError as err:
        raise WorkerError(f"cannot read --superexec-auth-secret-file {path}: {err}") from None
    if not secret:
        raise WorkerError(f"--superexec-auth-secret-file {path} is empty")
    return secret


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgefleet worker",
        description="Run a SuperNode's ClientApp tasks in one warm process "
        "(the SuperNode runs with --isolation process).",
    )
    parser.add_argument(
        "--runtime-api-address",
        default=f"{fp.UVICORN_DEFAULT_HOST}:{fp.SUPERNODE_UVICORN_DEFAULT_PORT}",
        help="the SuperNode's Runtime API, HOST:PORT (its --host and --port)",
    )
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--insecure", action="store_true", help="plain HTTP (the default)")
    tls.add_argument("--root-certificates", help="CA file of the Runtime API's TLS certificate")
    parser.add_argument("--superexec-auth-secret-file", help="the SuperNode's shared secret")
    parser.add_argument("--parent-pid", type=int, help="exit when this process has exited")
    _preload_arg(parser)
    return parser


def worker_main(argv: Sequence[str]) -> int:
    """``edgefleet worker``: the executor alone, for a ``flower-supernode --isolation
    process`` started otherwise."""
    parser = worker_parser()
    args = parser.parse_args(argv)
    try:
        runtime = RuntimeAddress(
            args.runtime_api_address,
            args.root_certificates,
            _read_secret(args.superexec_auth_secret_file),
        )
    except WorkerError as err:
        parser.error(str(err))
    preload(_modules(args.preload))
    parent = args.parent_pid

    def alive() -> bool:
        return parent is None or _pid_alive(parent)

    stop = _stop_on_signals()
    try:
        serve(runtime, alive=alive, stop=stop)
    except WorkerError as err:
        print(f"edgefleet worker: {err}", file=sys.stderr)
        return 1
    return 0


# edgefleet.processes.pid_alive, copied: this module runs on boards that have flwr and the
# standard library only (deploy/pi/worker.py links here).
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_on_signals() -> threading.Event:
    """SIGTERM/SIGINT: stop after the message in hand; a second one: stop now."""
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set():
            raise SystemExit(128 + signum)
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    return stop


@dataclass(frozen=True)
class SupernodeArgs:
    """What the worker needs to know of ``flower-supernode``'s arguments."""

    passthrough: list[str]  # the user's arguments, minus ours
    address: str
    root_certificates: str | None
    secret_file: str | None
    preload: list[str]


def parse_supernode_args(argv: Sequence[str]) -> SupernodeArgs:
    """Split ``edgefleet supernode`` arguments: ``--preload`` is ours, the rest goes to
    ``flower-supernode``, of which ``--host``, ``--port``, ``--ssl-ca-certfile`` and
    ``--superexec-auth-secret-file`` tell the worker where and how to connect."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--isolation")
    parser.add_argument("--host", default=fp.UVICORN_DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=fp.SUPERNODE_UVICORN_DEFAULT_PORT)
    parser.add_argument("--ssl-ca-certfile")
    parser.add_argument("--superexec-auth-secret-file")
    _preload_arg(parser)
    known, _ = parser.parse_known_args(argv)
    if known.isolation not in (None, "process"):
        raise WorkerError(
            f"--isolation {known.isolation}: edgefleet supernode runs the SuperNode with "
            "--isolation process (its worker is the executor); drop the option, or run "
            "flower-supernode yourself for subprocess isolation"
        )
    passthrough, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--preload", "--isolation"):
            skip = "=" not in arg and i + 1 < len(argv)
            continue
        passthrough.append(arg)
    host = known.host
    if host in ("0.0.0.0", "", "::"):  # listening everywhere: reach it on loopback
        host = "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return SupernodeArgs(
        passthrough,
        f"{host}:{known.port}",
        known.ssl_ca_certfile,
        known.superexec_auth_secret_file,
        _modules(known.preload),
    )


def _flower_supernode() -> str:
    local = Path(sys.executable).parent / "flower-supernode"
    found = str(local) if local.exists() else shutil.which("flower-supernode")
    if found is None:
        raise WorkerError("flower-supernode not found next to this Python or on PATH")
    return found


def _catches_sigterm(pid: int) -> bool | None:
    """Whether process ``pid`` has a SIGTERM handler now (Linux ``/proc``; None: unknown)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return None


class _SupernodeChild:
    """``flower-supernode`` as the worker's child, stopped with one SIGTERM at most.

    Flower's handler takes the first SIGTERM, puts back the default action and then
    deactivates the node at the SuperLink (so that its key may rejoin at once); a second
    SIGTERM meanwhile kills it half-way. The child shares the worker's process group, so a
    signal sent to the group (systemd stopping the service, a fleet's stop, Ctrl-C) reaches
    it as well as the worker: then it is stopping already and gets nothing more. Told apart
    by its SIGTERM handler: seen while it ran (``alive``), gone when it is stopping. A
    SIGTERM while the handler is still there is safe (one not yet handled is merged with
    it); only a handler that goes between the look and the signal, microseconds, is missed."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self._handled_sigterm = False  # seen with Flower's handler in place

    def alive(self) -> bool:
        if self.popen.poll() is not None:
            return False
        if not self._handled_sigterm:
            self._handled_sigterm = bool(_catches_sigterm(self.popen.pid))
        return True

    def stop(self, timeout: float = CHILD_STOP_S) -> None:
        """One SIGTERM unless it is stopping already, a wait of ``timeout`` seconds, then
        SIGKILL. Further signals to the worker are ignored meanwhile: the worker dying first
        would send the child its parent-death SIGTERM, a second one."""
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
        try:
            if self.popen.poll() is not None:
                return
            if self._handled_sigterm and _catches_sigterm(self.popen.pid) is False:
                fp.log(INFO, "Worker: flower-supernode got the signal too; waiting for it")
            else:
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                fp.log(WARNING, "Worker: flower-supernode still runs after %.0f s; killed", timeout)
                self.popen.kill()
                self.popen.wait()
        finally:
            for sig, handler in previous.items():  # None: not set from Python
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the worker dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def supernode_parser() -> argparse.ArgumentParser:
    """``edgefleet supernode``'s own options, for its --help (the other arguments go to
    ``flower-supernode`` as they are: :func:`parse_supernode_args` splits them)."""
    parser = argparse.ArgumentParser(
        prog="edgefleet supernode",
        usage="edgefleet supernode [--preload MODULES] FLOWER_SUPERNODE_ARGS...",
        description="Runs `flower-supernode --isolation process FLOWER_SUPERNODE_ARGS` and "
        "executes its ClientApp messages in this one warm process (see "
        "edgefleet/client/worker.py); `flower-supernode --help` lists its arguments.",
    )
    _preload_arg(parser)
    return parser


def supernode_main(argv: Sequence[str]) -> int:
    """``edgefleet supernode ARGS``: ``flower-supernode --isolation process ARGS`` plus the
    warm worker as its executor; ends with the SuperNode, and stops it when stopped."""
    if any(a in ("-h", "--help") for a in argv):
        supernode_parser().print_help()
        return 0
    try:
        args = parse_supernode_args(argv)
        command = [_flower_supernode(), "--isolation", "process", *args.passthrough]
    except WorkerError as err:
        print(f"edgefleet supernode: {err}", file=sys.stderr)
        return 2
    private = Path(tempfile.mkdtemp(prefix="edgefleet-worker-"))  # mode 0700
    try:
        secret_file = args.secret_file
        if secret_file is None:
            path = private / "superexec-secret"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            secret_file = str(path)
            command += ["--superexec-auth-secret-file", secret_file]
        try:
            runtime = RuntimeAddress(
                args.address, args.root_certificates, _read_secret(secret_file)
            )
        except WorkerError as err:
            print(f"edgefleet supernode: {err}", file=sys.stderr)
            return 2
        stop = _stop_on_signals()
        child = _SupernodeChild(
            subprocess.Popen(
                command, preexec_fn=_die_with_parent if sys.platform == "linux" else None
            )
        )
        try:
            preload(args.preload)
            serve(runtime, alive=child.alive, stop=stop)
        except WorkerError as err:
            print(f"edgefleet supernode: {err}", file=sys.stderr)
        finally:
            child.stop()
        if stop.is_set():
            return 0  # we were stopped, and stopped the SuperNode
        rc = child.popen.returncode
        return rc if rc is not None and rc >= 0 else 1  # the SuperNode's exit code
    finally:
        shutil.rmtree(private, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgefleet.client.worker supernode|worker ARGS`` (what ``edgefleet
    supernode|worker`` runs; of EdgeFleet this module imports only its Flower adapter,
    :mod:`edgefleet.client.flower_private`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("supernode", "worker"):
        print("usage: python -m edgefleet.client.worker supernode|worker ARGS", file=sys.stderr)
        return 2
    return (supernode_main if argv[0] == "supernode" else worker_main)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
