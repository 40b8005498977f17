"""The in-process engine: a scenario's ServerApp and ClientApps without a SuperLink or Ray.

Flower's Simulation Engine runs a ServerApp against a SuperLink and hands each message to a
Ray actor; here the same ServerApp (EdgeFleet's, unchanged) gets an :class:`InProcessGrid`
that hands each message to the ClientApp of the node it is addressed to and returns the
replies. Same apps, mods, run config, node configs and seeds, so the same rows (the test
``tests/test_engines.py`` runs one seeded scenario on both engines and compares them); no
Ray start-up (tens of seconds on a loaded machine, sometimes past Ray's own deadline) and no
dispatch polling. For sweeps and benchmarks on one machine; Flower's engine stays the default
of ``edgefleet run`` and the way to a Ray cluster of several machines.

What a node sees is what Flower's engine gives it:

- its node config ``{"partition-id": i, "num-partitions": N}`` and a Context whose state
  persists between its messages; a ClientApp that raises leaves that state as it was and
  answers with Flower's error reply (code ``CLIENT_APP_RAISED_EXCEPTION``, Flower's reason);
- a copy of the message (the server's objects are never shared with a ClientApp) and the
  server a copy of the reply, as over Flower's wire;
- ``client-threads`` torch threads while its ClientApp runs.

``workers`` > 1 runs a round's messages on that many worker processes (forkserver, started
once per run and stopped at its end): node i starts in worker ``i mod workers``, where its
Context, data and model (the device caches of :mod:`edgefleet.client.device`) stay warm,
and the replies come back in the order of the messages. Each delivery is balanced: where the
round's nodes fall unevenly (20 of 100 devices a round land 12 to 8 on two workers as often
as not, and the round waits for the busier one), whole nodes move from the busiest worker to
the idlest until their shares differ by at most one, the Context handed over with the node,
which then stays where it moved. A node's messages run in their order, in one process at a
time, so its RNG use and state do not depend on the workers.

:class:`InProcessGrid` is also the grid of the unit tests (``tests/fakes.py``): nodes there
are plain functions from a message to a reply.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import itertools
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import ClientAppException
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from edgefleet.fileio import NotARegularFile, atomic_write_text
from edgefleet.processes import end_with_parent
from edgefleet.simulation.engine import Interrupted, RunFailed, serverapp_error

if TYPE_CHECKING:
    from edgefleet.simulation.runner import Scenario

Handler = Callable[[Message], Message | None]  # a node; None: it never answers
AppSpec = ClientApp | str | Callable[[], ClientApp]  # an app, "module:attribute", a factory
EDGEFLEET_APP = "edgefleet.client.app:app"
SERVER_NODE_ID = 0
RUN_ID = 1
STOP_GRACE = 10.0  # seconds a stopped run or worker gets to finish before it is killed


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# -- the grid ---------------------------------------------------------------------------------


def error_reply(msg: Message, err: Exception) -> Message:
    """The reply Flower's Simulation Engine makes for a ClientApp that raised ``err``
    (flwr/server/superlink/fleet/vce/vce_api.py: the actor wraps it in ClientAppException)."""
    wrapped = ClientAppException(str(err))
    reason = str(type(wrapped)) + ":<'" + str(wrapped) + "'>"
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


def answer(handler: Handler, msg: Message) -> Message | None:
    """``handler``'s reply to ``msg``; an exception becomes the error reply, logged as
    Flower's engine logs it."""
    try:
        return handler(msg)
    except Exception as err:  # noqa: BLE001 - a node's failure is its reply
        log(logging.ERROR, "ClientApp of node %d raised: %r", msg.metadata.dst_node_id, err)
        log(logging.ERROR, traceback.format_exc())
        return error_reply(msg, err)


class InProcessGrid(Grid):
    """Flower's :class:`~flwr.serverapp.Grid` over nodes in this process: ``handlers`` maps
    each node id to a function from a message to its reply (None: no reply).

    Messages are stamped and checked as Flower's in-memory grid does (a message id, no
    ``reply_to``, a positive TTL; one to a node that is not here is logged and dropped) and
    delivered in the order given; every reply is returned at once (``timeout`` only bounds
    waiting, and nothing here waits). Ids count up from 1, so a seeded run gives the same
    ids each time.
    """

    # Every reply comes back from the pull that delivers its message, or never: the round
    # loop's exchange (edgefleet.loop.timing) pulls once instead of polling for more.
    synchronous = True

    def __init__(self, handlers: Mapping[int, Handler] | None = None) -> None:
        # Building a Message needs the ids of the task that sends it.
        TaskIdentity.task_id, TaskIdentity.run_id = 1, RUN_ID
        TaskIdentity.node_id = SERVER_NODE_ID
        self.handlers: dict[int, Handler] = dict(handlers or {})
        self._run = Run.create_empty(RUN_ID)
        self._ids = itertools.count(1)
        self._pushed: dict[str, Message] = {}

    # -- Flower's Grid interface --------------------------------------------------------------

    def set_run(self, run: Run) -> None:
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be an instance of Run, got {type(run).__name__}")
        self._run = run

    @property
    def run(self) -> Run:
        return Run(**vars(self._run))

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return sorted(self.handlers)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = mid = f"{self._run.run_id}-{next(self._ids)}"
            md = msg.metadata
            if md.reply_to_message_id != "" or not md.ttl > 0 or md.delivered_at != "":
                raise ValueError(f"Invalid message: {msg}")
            if md.dst_node_id not in self.handlers:  # as Flower's link state: no id, no reply
                log(logging.ERROR, "Invalid destination node ID for Message: %s", md.dst_node_id)
                continue
            self._pushed[mid] = msg
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        pending = [self._pushed.pop(i) for i in message_ids if i in self._pushed]
        return [r for r in self.deliver(pending) if r is not None]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))

    # -- delivery ---------------------------------------------------------------------------

    def deliver(self, messages: list[Message]) -> list[Message | None]:
        """Each message's reply (None: none), in the messages' order."""
        return [answer(self.handlers[m.metadata.dst_node_id], m) for m in messages]


# -- ClientApp nodes --------------------------------------------------------------------------


def load_app(spec: AppSpec | None) -> ClientApp:
    """The ClientApp ``spec`` names: itself, a ``module:attribute`` component string (as in
    ``pyproject.toml``), or a factory called once; None: EdgeFleet's."""
    spec = EDGEFLEET_APP if spec is None else spec
    if isinstance(spec, ClientApp):
        return spec
    if isinstance(spec, str):
        module, sep, attr = spec.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"ClientApp {spec!r}: expected a component 'module:attribute'")
        app = getattr(importlib.import_module(module), attr)
    else:
        app = spec()
    if not isinstance(app, ClientApp):
        raise TypeError(f"ClientApp {spec!r} is a {type(app).__name__}, not a flwr ClientApp")
    return app


def node_contexts(run_config: Mapping[str, Any], nodes: int) -> dict[int, Context]:
    """Node ``i + 1`` holds partition ``i`` of ``nodes``, as Flower's engine configures its
    nodes (whose ids are random numbers instead)."""
    return {
        i + 1: Context(
            run_id=RUN_ID,
            node_id=i + 1,
            node_config={"partition-id": i, "num-partitions": nodes},
            state=RecordDict(),
            run_config=dict(run_config),
        )
        for i in range(nodes)
    }


def _wire(msg: Message) -> Message:
    return pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


class ClientAppNode:
    """One node: ``app`` called with this node's Context, as a Flower engine calls it (see
    the module docstring); ``wire`` copies the message in and the reply out."""

    def __init__(self, app: ClientApp, context: Context, threads: int, wire: bool = True) -> None:
        self.app, self.context, self.threads, self.wire = app, context, threads, wire

    def __call__(self, msg: Message) -> Message:
        import torch

        ctx = self.context
        # The app works on a copy: one that raises leaves the node's state as it was.
        work = Context(ctx.run_id, ctx.node_id, ctx.node_config, copy.deepcopy(ctx.state),
                       ctx.run_config)  # fmt: skip
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            reply = self.app(_wire(msg) if self.wire else msg, work)
        finally:
            torch.set_num_threads(threads)
        self.context = work
        return _wire(reply) if self.wire else reply


def _client_threads(run_config: Mapping[str, Any]) -> int:
    # lazy: config pulls in ~55 EdgeFleet modules; InProcessGrid users need flwr only
    from edgefleet.config import DEFAULTS

    value = run_config.get("client-threads", DEFAULTS["client-threads"])
    return value if isinstance(value, int) and value >= 1 else 1


class ClientAppGrid(InProcessGrid):
    """``nodes`` nodes running ``app`` (None: EdgeFleet's ClientApp) under ``run_config`` (the
    ClientApps' run config, as Flower gives it: the app's defaults under the run's values).

    ``workers`` = 1 runs every message here, one after the other; more runs them on that many
    worker processes (module docstring), which needs an ``app`` they can load: a component
    string or a picklable factory (a function of an importable module, not of the script
    itself, or a ``functools.partial`` of one). ``pool``: workers already started for these
    nodes (the engine starts them before it forks the run's process). Use it as a context
    manager, or call :meth:`close`, to stop the workers.
    """

    def __init__(
        self,
        run_config: Mapping[str, Any],
        nodes: int,
        app: AppSpec | None = None,
        workers: int = 1,
        *,
        pool: WorkerPool | None = None,
    ) -> None:
        super().__init__()
        if nodes < 1:
            raise ValueError(f"nodes = {nodes}: a grid needs at least one node")
        if workers < 1:
            raise ValueError(f"workers = {workers}: must be at least 1")
        contexts = node_contexts(run_config, nodes)
        threads = _client_threads(run_config)
        if pool is None and min(workers, nodes) > 1:
            pool = WorkerPool(contexts, app, min(workers, nodes), threads)
        self._pool = pool
        self.workers = 1 if pool is None else len(pool.conns)
        if pool is None:
            client_app = load_app(app)
            self.handlers = {n: ClientAppNode(client_app, c, threads) for n, c in contexts.items()}
        else:
            if set(pool.pin) != set(contexts):
                raise ValueError(f"the pool serves nodes {sorted(pool.pin)}, not 1..{nodes}")
            self.handlers = {n: pool.unreachable for n in contexts}

    def deliver(self, messages: list[Message]) -> list[Message | None]:
        if self._pool is None:
            return super().deliver(messages)
        return self._pool.deliver(messages)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool = None

    def __enter__(self) -> ClientAppGrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the worker pool --------------------------------------------------------------------------

# What the worker processes import once, in the forkserver they are forked from: the ClientApp,
# and what its first train call would import (torch._dynamo with the first optimizer: seconds,
# 20 s on a loaded machine; torch.func for CA-HFP's scores).
WORKER_PRELOAD = ["torch._dynamo", "torch.func", "edgefleet.client.app", __name__]


class WorkerDied(RuntimeError):
    """A worker process ended in the middle of a run."""


@dataclass(frozen=True)
class Job:
    """What a worker is sent: nodes to hand back (``give``, answered with their Contexts),
    or nodes to take over (``take``) and the messages to run (``run``: (index, message))."""

    give: list[int] = field(default_factory=list)
    take: dict[int, Context] = field(default_factory=dict)
    run: list[tuple[int, Message]] = field(default_factory=list)


class WorkerPool:
    """``workers`` worker processes, each holding the nodes pinned to it (node i of the sorted
    ids starts in worker i mod ``workers``; :meth:`balance` moves nodes, :attr:`pin` says
    where each is now), forked from a forkserver that has imported
    :data:`WORKER_PRELOAD`. They start at once; the first :meth:`deliver` waits until they
    are ready. ``log_path``: where their output goes (default: this process's).

    The process that starts the pool owns it (:meth:`stop` ends the workers, killing those
    that do not stop in time); a process forked from it can deliver messages and
    :meth:`stop` it too, which then only tells the workers to stop. A worker whose pipe
    closes in every process (its owner died) stops by itself."""

    def __init__(
        self,
        contexts: Mapping[int, Context],
        app: AppSpec | None,
        workers: int,
        threads: int,
        log_path: str | None = None,
    ) -> None:
        if isinstance(app, ClientApp):
            raise ValueError(
                "workers > 1 needs a ClientApp the worker processes can load: a component "
                "string 'module:attribute' or a picklable factory, not a ClientApp object"
            )
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(WORKER_PRELOAD)
        spec = EDGEFLEET_APP if app is None else app
        nodes = sorted(contexts)
        self.pin = {node: i % workers for i, node in enumerate(nodes)}
        self.owner = os.getpid()
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self._ready = False
        try:
            with _without_main():
                for w in range(workers):
                    mine = {n: contexts[n] for n in nodes if self.pin[n] == w}
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(
                        target=_worker_main,
                        args=(child, spec, mine, threads, log_path),
                        name=f"edgefleet-worker-{w}",
                        daemon=True,
                    )
                    proc.start()
                    child.close()  # the worker's end: its EOF then means the worker is gone
                    self.procs.append(proc)
                    self.conns.append(parent)
        except BaseException:
            self.stop()
            raise

    def unreachable(self, msg: Message) -> Message | None:
        raise AssertionError("messages of a worker pool go through ClientAppGrid.deliver")

    def nodes_of(self, w: int) -> list[int]:
        return sorted(n for n, i in self.pin.items() if i == w)

    def _recv(self, w: int) -> Any:
        try:
            return self.conns[w].recv()
        except (EOFError, OSError):
            raise WorkerDied(
                f"in-process worker {w} (nodes {self.nodes_of(w)}) ended; its error, if it "
                "printed one, is in the run's log"
            ) from None

    def wait_ready(self) -> None:
        if self._ready:
            return
        for w in range(len(self.conns)):
            ready = self._recv(w)
            if ready != "ready":
                raise WorkerDied(f"in-process worker {w} could not start:\n{ready}")
        self._ready = True

    def deliver(self, messages: list[Message]) -> list[Message | None]:
        """Each message's reply, in the messages' order; each worker runs its share in order."""
        self.wait_ready()
        by_node: dict[int, list[tuple[int, Message]]] = {}
        for i, msg in enumerate(messages):
            by_node.setdefault(msg.metadata.dst_node_id, []).append((i, msg))
        moves = self.balance(by_node)
        taken = self._hand_over(moves)
        batches: dict[int, list[tuple[int, Message]]] = {}
        for node, items in by_node.items():
            batches.setdefault(self.pin[node], []).extend(items)
        for w, batch in batches.items():
            job = Job(take=taken.get(w, {}), run=sorted(batch, key=lambda item: item[0]))
            self._send(w, job)
        replies: list[Message | None] = [None] * len(messages)
        waiting = {self.conns[w]: w for w in batches}
        while waiting:
            for conn in wait(list(waiting)):
                w = waiting.pop(conn)  # type: ignore[call-overload]
                for i, reply in self._recv(w):
                    replies[i] = reply
        return replies

    def balance(self, by_node: Mapping[int, list[tuple[int, Message]]]) -> dict[int, int]:
        """Move nodes (in :attr:`pin`) from the busiest worker to the idlest until their
        message counts differ by at most one (or one more move would not narrow the gap);
        node -> the worker it left. Deterministic: the busiest worker's highest node id
        moves first, ties go to the lowest worker."""
        load = [0] * len(self.conns)
        mine: list[list[int]] = [[] for _ in self.conns]
        for node in sorted(by_node):
            load[self.pin[node]] += len(by_node[node])
            mine[self.pin[node]].append(node)
        moves: dict[int, int] = {}
        while True:
            busy = max(range(len(load)), key=lambda w: (load[w], -w))
            idle = min(range(len(load)), key=lambda w: (load[w], w))
            last = mine[busy][-1] if mine[busy] else None
            if last is None or load[busy] - load[idle] <= len(by_node[last]):
                return moves
            mine[idle].append(mine[busy].pop())
            n = len(by_node[last])
            load[busy], load[idle] = load[busy] - n, load[idle] + n
            moves.setdefault(last, busy)
            self.pin[last] = idle

    def _hand_over(self, moves: Mapping[int, int]) -> dict[int, dict[int, Context]]:
        """The moved nodes' Contexts, fetched from the workers they left (which forget
        them): new worker -> {node: Context}."""
        gives: dict[int, list[int]] = {}
        for node, old in moves.items():
            if self.pin[node] != old:  # moved there and back again: nothing to hand over
                gives.setdefault(old, []).append(node)
        for w, nodes in gives.items():
            self._send(w, Job(give=nodes))
        taken: dict[int, dict[int, Context]] = {}
        for w in gives:
            for node, context in self._recv(w).items():
                taken.setdefault(self.pin[node], {})[node] = context
        return taken

    def _send(self, w: int, job: Job) -> None:
        try:
            self.conns[w].send(job)
        except OSError:  # a broken pipe: the worker is gone
            self._recv(w)  # raises WorkerDied, naming it

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a worker that is gone needs no stop
                conn.send(None)
        if os.getpid() == self.owner:
            deadline = time.monotonic() + STOP_GRACE
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """Start processes without this process's ``__main__``: multiprocessing's forkserver
    children import the main script again (as ``__mp_main__``) when it has a file, which
    costs a worker the script's imports (matplotlib for a benchmark: seconds) and, in a
    script without the ``if __name__ == "__main__":`` guard, runs it all again. A worker
    needs only importable modules (its target here, the ClientApp's module)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _worker_main(
    conn: Connection,
    app: AppSpec,
    contexts: dict[int, Context],
    threads: int,
    log_path: str | None,
) -> None:
    """A worker: its nodes' messages, one batch at a time, until told to stop (None) or its
    pipe is closed everywhere (EOF)."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end_with_parent(os.getppid())  # the forkserver: it ends with the run, and so do we
    try:
        if log_path is not None:
            with open(log_path, "a") as out:  # appends beside the run's other writers
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
        import torch
        from flwr.common.logger import update_console_handler

        update_console_handler(level=logging.INFO, timestamps=True, colored=False)
        torch.set_num_threads(threads)
        TaskIdentity.task_id, TaskIdentity.run_id = 1, RUN_ID
        TaskIdentity.node_id = SERVER_NODE_ID
        client_app = load_app(app)
        # Messages and replies cross the pipe: that is the copy, no second one is needed.
        nodes = {n: ClientAppNode(client_app, c, threads, wire=False) for n, c in contexts.items()}
    except BaseException:  # noqa: BLE001 - the parent says which worker failed, with this
        conn.send(traceback.format_exc())
        return
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        if job.give:  # nodes moving to another worker: their Contexts go with them
            conn.send({n: nodes.pop(n).context for n in job.give})
            continue
        for n, context in job.take.items():
            nodes[n] = ClientAppNode(client_app, context, threads, wire=False)
        conn.send([(i, answer(nodes[m.metadata.dst_node_id], m)) for i, m in job.run])
        sys.stdout.flush()
        sys.stderr.flush()


# -- the engine: one run in a child process ----------------------------------------------------


def serve(
    run_config: Mapping[str, Any],
    nodes: int,
    *,
    workers: int = 1,
    app: AppSpec | None = None,
    pool: WorkerPool | None = None,
) -> None:
    """EdgeFleet's ServerApp on a :class:`ClientAppGrid` of ``nodes`` nodes, here and now.
    ``run_config`` is the run's own (as ``flwr run --run-config`` takes it); the apps get the
    app's defaults under it, as Flower builds their run config (:func:`client_run_config`)."""
    # lazy: the ServerApp's ~65 modules only for a run (preload() imports it up front)
    from edgefleet.server.app import app as server_app

    full = client_run_config(run_config)
    with ClientAppGrid(full, nodes, app, workers, pool=pool) as grid:
        context = Context(
            run_id=RUN_ID, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(),
            run_config=dict(full),
        )  # fmt: skip
        server_app(grid, context)


def client_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    # lazy: config pulls in ~55 EdgeFleet modules; InProcessGrid users need flwr only
    from edgefleet.config import DEFAULTS

    return {**DEFAULTS, **run_config}


def preload() -> None:
    """Import what every run needs, once, before the first run's child is forked from this
    process (seconds a run otherwise, most of a short run on a loaded machine)."""
    import torch._dynamo  # noqa: F401  (torch's first optimizer imports it: seconds)
    import torch.func  # noqa: F401  (CA-HFP's curvature scores)

    import edgefleet.client.app  # noqa: F401
    import edgefleet.server.app  # noqa: F401


def _child(spec: dict[str, Any], log_path: str) -> None:
    """A forked run: stdout and stderr (file descriptors included) into ``log_path``, then
    the server; exit status 0 only if it returned."""
    from flwr.common.logger import update_console_handler

    code = 1
    with open(log_path, "a") as out:  # appends beside the workers
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            # A stopped run unwinds: its workers are stopped on the way out. So does a run
            # whose `edgefleet run` was killed (kill -9): it must not run on as an orphan.
            signal.signal(signal.SIGTERM, _sigterm)
            end_with_parent(spec["parent"])
            signal.signal(signal.SIGINT, signal.default_int_handler)
            update_console_handler(level=logging.INFO, timestamps=True, colored=False)
            # One torch thread, before any torch op: a parent that ran torch's OpenMP pool
            # before forking us (a test, a user's notebook) leaves a pool whose threads this
            # process does not have, and the first parallel op here would wait for them for
            # ever (seen: central evaluation hung in load_state_dict). With one thread torch
            # never enters that pool; every EdgeFleet process runs one thread anyway.
            import torch

            torch.set_num_threads(1)
            serve(spec["run_config"], spec["nodes"], app=spec["app"], pool=spec["pool"])
            code = 0
        except BaseException:  # noqa: BLE001 - the log says why; the parent sees the status
            # Into the log file itself, not sys.stderr: a parent that had replaced sys.stderr
            # (pytest's capture, a notebook) leaves the child's sys.stderr off fd 2, and the
            # parent's error then said only "exited with code 1" without the cause.
            sys.stdout.flush()
            sys.stderr.flush()
            traceback.print_exc(file=out)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            out.flush()
    # The parent's exit handlers (and its buffers, flushed before the fork) are not the
    # child's to run.
    os._exit(code)


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class InProcessEngine:
    """Runs scenarios with the in-process engine, one after the other, each in a child
    process of its own forked from this one (fresh module state, as Flower gives each run a
    fresh ServerApp process; the imports are paid once, here). The same interface as
    :class:`~edgefleet.simulation.engine.Engine` for :func:`~edgefleet.simulation.runner.
    run_scenario` and sweeps: the run folder, its rows, checkpoints and ``flower.log``
    (here the ServerApp's and ClientApps' log) are written as there.

    ``workers``: worker processes per run (None: one per core, at most one per node);
    ``app``: another ClientApp than EdgeFleet's (see :func:`load_app`).
    """

    def __init__(self, *, workers: int | None = None, app: AppSpec | None = None) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"workers = {workers}: must be at least 1")
        self.workers = workers
        self.app = app
        self.started = False
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> None:
        if not self.started:
            if self.workers != 1:
                # The workers' forkserver imports its modules while this process does.
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(WORKER_PRELOAD)
                multiprocessing.forkserver.ensure_running()
            preload()
            self._tmp = tempfile.TemporaryDirectory(prefix="edgefleet-inprocess-")
            self.started = True

    def stop(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self.started = False

    def alive(self) -> bool:
        return True

    def __enter__(self) -> InProcessEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def run(
        self,
        scenario: Scenario,
        *,
        timeout: float = 3600.0,
        echo: TextIO | None = None,
        progress: str | None = None,
    ) -> Path:
        """Run ``scenario`` to completion; its run folder. ``echo`` gets the run's log as it
        is written (None: only ``flower.log`` does); ``progress`` (``live`` or ``plain``) shows
        the progress line on stdout, as :meth:`Engine.run` does."""
        # lazy: a run's machinery (~60 modules); InProcessGrid users need flwr only
        from edgefleet.config import ConfigError
        from edgefleet.runlock import RunLocked, release_stopped
        from edgefleet.server.results import prepare_run_dir
        from edgefleet.simulation.runner import (
            check_data,
            check_run_folder,
            resolve_run_config,
            with_gpu_share,
        )

        cfg, raw = resolve_run_config(scenario)
        check_run_folder(cfg)
        with_gpu_share(scenario.federation, cfg.train.accelerator)  # the accelerator's check
        try:
            run_dir = prepare_run_dir(cfg, lock=False)  # the ServerApp takes the lock
        except (ValueError, FileExistsError, RunLocked, NotARegularFile) as err:
            raise ConfigError(str(err)) from None
        check_data(cfg, run_dir)
        self.start()
        assert self._tmp is not None
        nodes = int(scenario.federation["num-supernodes"])
        workers = min(self.workers or default_workers(), nodes)
        log_path = Path(self._tmp.name) / f"{run_dir.name}.log"
        log_path.write_text("")
        title = f"in-process engine, {nodes} nodes, {workers} worker process(es)"
        pool: WorkerPool | None = None
        # lazy: tqdm only for a run (as for the imports above)
        from edgefleet.simulation.progress import start_progress

        reporter, echo = start_progress(run_dir, cfg.server.num_rounds, progress, sys.stdout, echo)
        try:
            if workers > 1:
                # Started here, where the forkserver that forks them lives for the whole
                # sweep (its imports paid once); the run's process gets the pipes.
                full = client_run_config(raw)
                pool = WorkerPool(node_contexts(full, nodes), self.app, workers,
                                  _client_threads(full), str(log_path))  # fmt: skip
            spec = {"run_config": raw, "nodes": nodes, "app": self.app, "pool": pool,
                    "parent": os.getpid()}  # fmt: skip
            sys.stdout.flush()
            sys.stderr.flush()
            # fork: the child starts with this process's imports (spawn would import them
            # again), and with nothing else: this process never runs a round itself.
            proc = multiprocessing.get_context("fork").Process(
                target=_child, args=(spec, str(log_path)), name=f"edgefleet-run-{run_dir.name}"
            )
            proc.start()
            try:
                self._wait(proc, log_path, timeout, echo, run_dir, reporter)
            except (KeyboardInterrupt, SystemExit) as err:
                sig = "SIGINT" if isinstance(err, KeyboardInterrupt) else "SIGTERM"
                _end(proc)
                release_stopped(run_dir)  # its writer is stopped: no stale lock left
                raise Interrupted(run_dir, sig) from None
            except BaseException:
                _end(proc)
                raise
        finally:
            if reporter is not None:
                reporter.close()
            if pool is not None:
                pool.stop()
            _write_log(run_dir, log_path, title)
        if proc.exitcode == 0 and (run_dir / "summary.json").exists():
            return run_dir
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        cause = serverapp_error(text) or f"the run's process exited with code {proc.exitcode}"
        raise RunFailed(f"run {run_dir.name} failed: {cause}", run_dir)

    def _wait(
        self,
        proc: Any,
        log_path: Path,
        timeout: float,
        echo: TextIO | None,
        run_dir: Path,
        reporter: Any = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        offset = 0
        while True:
            proc.join(0.2)
            if reporter is not None:
                reporter.poll()
            if echo is not None and log_path.exists():
                with log_path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                if chunk:
                    echo.write(chunk.decode(errors="replace"))
                    echo.flush()
            if proc.exitcode is not None:
                return
            if time.monotonic() > deadline:
                _end(proc)
                raise RunFailed(
                    f"run {run_dir.name} ran past the {timeout:.0f} s timeout (--timeout); its "
                    f"rows so far are in {run_dir}",
                    run_dir,
                )


def _end(proc: Any) -> None:
    """Stop a run's process: SIGTERM (it stops its workers on the way out), then SIGKILL."""
    if proc.exitcode is None:
        proc.terminate()
        proc.join(STOP_GRACE)
    if proc.exitcode is None:
        proc.kill()
        proc.join()


def _write_log(run_dir: Path, log_path: Path, title: str) -> None:
    if run_dir.exists() and log_path.exists():
        body = log_path.read_text(errors="replace").rstrip()
        # never through a planted link
        atomic_write_text(run_dir / "flower.log", f"===== ServerApp ({title}) =====\n{body}\n")


__all__ = [
    "AppSpec",
    "ClientAppGrid",
    "ClientAppNode",
    "InProcessEngine",
    "InProcessGrid",
    "WorkerDied",
    "answer",
    "default_workers",
    "error_reply",
    "load_app",
    "serve",
]
