"""The warm worker across a stopped run and a stopped node (edgefleet/client/worker.py).

1. A run stopped while the SuperNode pulls one of its messages (a ServerApp killed
   mid-round): Flower 1.42's SuperNode drops the message but leaves its task pending with the
   objects missing, and takes its next message. The worker must give that task up once the
   next one is there, not poll 500 times (~8 minutes) for objects that never come. Against a
   stand-in SuperNode (its Runtime API on an in-memory HTTP transport), seconds.
2. ``edgefleet supernode`` stopped by a SIGTERM to its process group (systemd, a fleet's
   stop): flower-supernode already has one and must get no second, which would kill it before
   it deactivates. A stand-in ``flower-supernode`` (a Python script that handles SIGTERM as
   Flower does) tells whether its shutdown ran to the end.

The restart against real processes is tests/test_restarts.py (opt-in).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.serde import context_to_proto, fab_to_proto, run_to_proto
from flwr.proto import message_pb2, runtime_pb2, task_pb2
from flwr.supercore.constant import TASK_TOKEN_HEADER
from flwr.supercore.fab import Fab
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from edgefleet.client import worker

NODE_ID = 7
DEADLINE_S = 10.0  # far below Flower's 500 tries (~8 min at the worker's 1 s cap)


class StandInSupernode:
    """The Runtime API of a SuperNode that gave up the message of run 1 (its objects never
    come) and then took a message of run 2, whose objects it holds. Run 2's task appears
    once run 1's task asks for an object, as in Flower, where the SuperNode creates the next
    message's task only after it gave up the last message. With ``late_s``, it did not give
    up: run 1's objects arrive after ``late_s`` seconds, and no other task appears."""

    GAVE_UP, NEXT = 1, 2

    def __init__(self, late_s: float | None = None) -> None:
        self.late_at = None if late_s is None else time.monotonic() + late_s
        self.lock = threading.Lock()
        self.pending: list[int] = [self.GAVE_UP]
        self.token_run: dict[str, int] = {}
        self.objects: dict[int, dict[str, bytes]] = {}
        self.trees: dict[int, message_pb2.ObjectTree] = {}
        for run_id in (self.GAVE_UP, self.NEXT):
            TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 0
            msg = Message(RecordDict({"config": ConfigRecord({"run": run_id})}), NODE_ID, "train")
            self.trees[run_id] = get_object_tree(msg)
            self.objects[run_id] = {k: v.deflate() for k, v in get_all_nested_objects(msg).items()}
        self.closed = False  # the test is over: every pull fails, whatever still runs ends
        self.replies: dict[int, float] = {}  # run -> when its reply came
        self.outputs: dict[int, tuple[str, str, bool]] = {}  # run -> sub-status, details, ctx

    def handle(self, request: httpx.Request) -> httpx.Response:
        rpc = request.url.path.rsplit("/", 1)[-1]
        token = request.headers.get(TASK_TOKEN_HEADER, "")
        with self.lock:
            body = self._answer(rpc, self.token_run.get(token, 0), token, request.content)
        return httpx.Response(200, content=body.SerializeToString())

    def _answer(self, rpc: str, run_id: int, token: str, content: bytes) -> Any:
        if rpc == "acquire-task":
            if not self.pending:
                return runtime_pb2.AcquireTaskResponse()
            run = self.pending.pop(0)
            token = f"token-{run}"
            self.token_run[token] = run
            task = task_pb2.Task(task_id=run, run_id=run)
            return runtime_pb2.AcquireTaskResponse(task=task, token=token)
        if rpc == "send-task-heartbeat":
            return runtime_pb2.SendTaskHeartbeatResponse(success=True)
        if rpc == "pull-task-input":
            context = Context(run_id, NODE_ID, {}, RecordDict(), {})
            run = Run.create_empty(run_id)
            return runtime_pb2.PullTaskInputResponse(
                context=context_to_proto(context),
                run=run_to_proto(run),
                fab=fab_to_proto(Fab("f" * 64, b"", {})),
                task_id=run_id,
            )
        if rpc == "pull-messages":
            return runtime_pb2.PullAppMessagesResponse(
                messages_list=[message_pb2.Message()], message_object_trees=[self.trees[run_id]]
            )
        if rpc == "pull-object":
            req = message_pb2.PullObjectRequest.FromString(content)
            taken = self.NEXT in self.pending or self.NEXT in self.token_run.values()
            if run_id == self.GAVE_UP and not taken and self.late_at is None:
                self.pending.append(self.NEXT)  # the SuperNode took its next message
            if self.closed:
                return message_pb2.PullObjectResponse(object_found=False)
            if run_id == self.GAVE_UP and (self.late_at is None or time.monotonic() < self.late_at):
                return message_pb2.PullObjectResponse(object_found=True, object_available=False)
            return message_pb2.PullObjectResponse(
                object_found=True,
                object_available=True,
                object_content=self.objects[run_id][req.object_id],
            )
        if rpc == "confirm-message-received":
            return message_pb2.ConfirmMessageReceivedResponse()
        if rpc == "push-messages":
            self.replies[run_id] = time.monotonic()
            return runtime_pb2.PushAppMessagesResponse(message_ids=["m"], session_id="s")
        if rpc == "push-object":
            return message_pb2.PushObjectResponse(stored=True)
        if rpc == "push-task-output":
            req = runtime_pb2.PushTaskOutputRequest.FromString(content)
            self.outputs[run_id] = (req.sub_status, req.details, req.HasField("context"))
            return runtime_pb2.PushTaskOutputResponse()
        raise AssertionError(f"unexpected Runtime API call {rpc}")


class EchoApp:
    """Stands in for the warm ClientApp: answers every message with an empty reply."""

    def load(self, *_: object) -> Any:
        return lambda message, context: Message(RecordDict(), reply_to=message)


@pytest.fixture
def supernode(monkeypatch: pytest.MonkeyPatch, request: Any) -> Iterator[StandInSupernode]:
    for name in ("_task_id", "_run_id", "_node_id"):  # pull_task_input sets them
        monkeypatch.setattr(TaskIdentity, name, getattr(TaskIdentity, name))
    node = StandInSupernode(getattr(request, "param", None))
    transport = httpx.MockTransport(node.handle)
    real_client = httpx.Client

    class OnStandIn(real_client):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            kwargs.pop("verify", None)
            super().__init__(transport=transport, **kwargs)

    monkeypatch.setattr(httpx, "Client", OnStandIn)
    monkeypatch.setattr(worker, "WarmApp", EchoApp)
    yield node
    node.closed = True


def test_a_task_whose_message_the_supernode_gave_up_yields_to_the_next(supernode) -> None:
    runtime = worker.RuntimeAddress("supernode.invalid:9094")
    done: list[int] = []
    t0 = time.monotonic()
    thread = threading.Thread(target=lambda: done.append(worker.serve(runtime, max_tasks=2)))
    thread.start()
    thread.join(DEADLINE_S)
    supernode.closed = True  # ends a worker still polling for the objects
    thread.join(30)
    gave_up, next_run = StandInSupernode.GAVE_UP, StandInSupernode.NEXT
    assert next_run in supernode.replies, "the next run's message got no reply"
    assert supernode.replies[next_run] - t0 < DEADLINE_S, "answered only once the test gave up"
    assert done == [2]
    # The given-up task ends failed, with no reply and no Context of its own pushed back.
    sub_status, details, with_context = supernode.outputs[gave_up]
    assert sub_status == "failed" and details.startswith("abandoned: run 1: object")
    assert gave_up not in supernode.replies and not with_context
    assert supernode.outputs[next_run] == ("completed", "", True)


@pytest.mark.parametrize("supernode", [1.0], indirect=True)
def test_objects_that_come_late_are_waited_for(supernode) -> None:
    # The SuperNode still pulls them from the SuperLink (a slow link): no task of its next
    # message exists, so the worker keeps polling, as Flower does.
    assert worker.serve(worker.RuntimeAddress("supernode.invalid:9094"), max_tasks=1) == 1
    assert supernode.outputs[StandInSupernode.GAVE_UP] == ("completed", "", True)
    assert StandInSupernode.GAVE_UP in supernode.replies


# -- stopping flower-supernode --------------------------------------------------------------

# Handles SIGTERM as Flower's register_signal_handlers does: the default action back first,
# then the shutdown (deactivating the node at the SuperLink), which a second SIGTERM cuts.
STAND_IN_SUPERNODE = """\
#!{python}
import os, signal, sys, time
log = os.environ["STAND_IN_LOG"]
def note(line):
    with open(log, "a") as f:
        f.write(line + "\\n")
def graceful(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    note("stopping")
    time.sleep(1.0)
    note("deactivated")
    sys.exit(0)
signal.signal(signal.SIGTERM, graceful)
signal.signal(signal.SIGINT, graceful)
note("ready")
while True:
    time.sleep(0.05)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_node(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """``edgefleet supernode`` with the stand-in as its flower-supernode, in a process
    group of its own (as under systemd or a fleet); its worker polls a port nobody serves."""
    script = tmp_path / "flower-supernode"
    script.write_text(STAND_IN_SUPERNODE.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "stand-in.log"
    code = (
        "import sys; from edgefleet.client import worker; "
        f"worker._flower_supernode = lambda: {str(script)!r}; "
        "sys.exit(worker.main(sys.argv[1:]))"
    )
    env = {**os.environ, "STAND_IN_LOG": str(log), "PYTHONPATH": str(Path.cwd())}
    with (tmp_path / "node.log").open("wb") as out:
        node = subprocess.Popen(
            [sys.executable, "-c", code, "supernode", "--preload=", "--port", str(_free_port())],
            env=env,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while "ready" not in (log.read_text() if log.exists() else ""):
        assert node.poll() is None and time.monotonic() < deadline, "the node did not start"
        time.sleep(0.05)
    time.sleep(1.0)  # the worker's serve loop sees the child's handler (every <= 0.25 s)
    return node, log


def _stop(node: subprocess.Popen[bytes], log: Path, send: Any) -> tuple[int, list[str]]:
    send()
    try:
        node.wait(timeout=30)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    return node.returncode, log.read_text().split()


@pytest.mark.parametrize("worker_again", [False, True], ids=["group", "group-then-worker"])
def test_a_sigterm_to_the_group_reaches_flower_supernode_once(
    tmp_path: Path, worker_again: bool
) -> None:
    # systemd's default KillMode: the group; a fleet's stop: the group, then each process.
    node, log = _start_node(tmp_path)

    def signal_group() -> None:
        os.killpg(node.pid, signal.SIGTERM)
        if worker_again:
            time.sleep(0.05)
            os.kill(node.pid, signal.SIGTERM)

    rc, lines = _stop(node, log, signal_group)
    assert lines == ["ready", "stopping", "deactivated"], (rc, lines)
    assert rc == 0


def test_a_sigterm_to_the_worker_alone_is_passed_on_once(tmp_path: Path) -> None:
    node, log = _start_node(tmp_path)
    rc, lines = _stop(node, log, lambda: os.kill(node.pid, signal.SIGTERM))
    assert lines == ["ready", "stopping", "deactivated"], (rc, lines)
    assert rc == 0


def test_a_child_that_does_not_stop_is_killed_after_the_wait(tmp_path: Path) -> None:
    script = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    popen = subprocess.Popen([sys.executable, "-c", script])
    child = worker._SupernodeChild(popen)
    time.sleep(0.3)
    t0 = time.monotonic()
    child.stop(timeout=0.5)
    assert popen.returncode == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - t0 < 5.0
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # the worker's are back
