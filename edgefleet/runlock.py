"""One writer per run folder: an exclusive lock, ``writer.lock``, in the run folder.

Two processes writing one run folder (a ``--resume`` started while the run still goes)
interleave their rows in ``metrics.jsonl`` and overwrite each other's checkpoints.
EdgeFleet's ServerApp therefore takes this lock when it prepares its run folder, fresh or
resumed (:func:`edgefleet.server.results.prepare_run_dir`), and holds it until the run
ends; a second writer is refused at once, told who holds the folder. ``edgefleet run``
checks it (:func:`check`) before it starts any Flower process, ``edgefleet sweep`` before
it removes a folder to start that run again.

The lock is ``fcntl.flock`` on the file, so the kernel drops it when its process ends,
however it ends (a crash, SIGKILL): a lock file that a dead process left behind is taken
over, with a warning naming that process. The file's JSON (PID, host, start time, kernel
boot id) names the holder; whether it still holds the lock is the flock's answer.

``flock`` works between the processes of one kernel (containers on one machine included);
on a network file system it may not reach other machines, so a lock file written under
another kernel on another host is never taken over: the run is refused, and the message
says how to clear it by hand. (The file names the kernel by its boot id: a container
recreated under another host name, ``docker compose down`` and ``up``, is on the same
kernel, and a host that has rebooted has the same name, so both take over.) Where
``flock`` fails outright (a mount without locks) the run goes on unlocked, with a warning.

The lock file is opened never through a link (:func:`edgefleet.fileio.open_regular`): one
planted in the folder in its place is refused, by :func:`check` too, before any Flower
process starts, and its target is left untouched.

Within one process the lock is re-entrant: a ServerApp run in-process twice (a run, then
its resume) takes it again. A forked child is another process: while its parent holds
the lock, the child's :func:`acquire` is refused.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from edgefleet.fileio import NotARegularFile, open_regular

LOCK_FILE = "writer.lock"
HOST = socket.gethostname()


def _boot_id() -> str:
    try:  # Linux: one per kernel boot, shared by the containers on it
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


BOOT_ID = _boot_id()

# Flower's logger (``flwr.common.log`` logs to it), without importing Flower here.
_log = logging.getLogger("flwr")


class RunLocked(RuntimeError):
    """Another process writes (or may write) this run folder; the message names it."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: str
    boot_id: str = ""

    @property
    def elsewhere(self) -> bool:
        """Under another kernel, whose processes and locks this one cannot see."""
        return self.host != HOST and not (BOOT_ID and self.boot_id == BOOT_ID)

    def __str__(self) -> str:
        return f"PID {self.pid} on host {self.host}, since {self.started}"


@dataclass(frozen=True)
class _Held:
    fd: int | None  # None: the file system has no locks (warned)
    pid: int  # who took it: a forked child inherits this table, but is not the holder


_held: dict[Path, _Held] = {}
_guard = threading.Lock()


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir).resolve() / LOCK_FILE


def acquire(run_dir: str | Path) -> None:
    """Take ``run_dir``'s writer lock for this process (a no-op when it holds it already);
    :class:`RunLocked` when another process holds it, or when the lock file names another
    host's kernel (whose processes and locks this one cannot see)."""
    path = lock_path(run_dir)
    with _guard:
        held = _held.get(path)
        if held is not None and held.pid == os.getpid():
            return
        _held[path] = _Held(_take(path), os.getpid())


def release(run_dir: str | Path) -> None:
    """Give up ``run_dir``'s lock, if this process holds it, and remove the lock file."""
    path = lock_path(run_dir)
    with _guard:
        held = _held.pop(path, None)
    if held is None or held.fd is None or held.pid != os.getpid():
        return
    try:
        # Removed while still locked: a process that opened the file meanwhile finds, once
        # it has the flock, that the file is gone, and starts over (see _take).
        if _same_file(held.fd, path):
            path.unlink()
    finally:
        os.close(held.fd)  # drops the flock


def release_stopped(run_dir: str | Path, wait: float = 5.0) -> None:
    """Remove the lock file of a writer that this process has just stopped (Ctrl-C,
    SIGTERM) and so could not release it: a clean stop leaves no lock for the resume to
    warn about. A lock still held after ``wait`` seconds (the writer outlived its stop) or
    written under another kernel is left alone."""
    path = lock_path(run_dir)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return  # no lock file: the writer released it, or never took it
    try:
        # Waited for, not tried once: a stopped process may still be closing its files
        # (its last threads ending) when the stopper sees it gone.
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        previous = _read(fd)
        if _same_file(fd, path) and not (previous is not None and previous.elsewhere):
            path.unlink()
    except OSError:
        pass  # held (BlockingIOError), or no locks here: leave it to the next writer
    finally:
        os.close(fd)


def check(run_dir: str | Path) -> None:
    """:class:`RunLocked` when another process holds ``run_dir``'s lock, without keeping
    it (a stale lock is taken over and removed on the way). Nothing to check when the
    folder does not exist or this process holds the lock."""
    path = lock_path(run_dir)
    with _guard:
        held = _held.get(path)
        if (held is not None and held.pid == os.getpid()) or not path.parent.is_dir():
            return
    try:
        acquire(run_dir)
    except NotARegularFile:
        raise  # a planted link: refused now, before any Flower process starts
    except OSError:
        return  # no lock file can be made there (read-only): the writer's checks say why
    release(run_dir)


def _take(path: Path) -> int | None:
    while True:
        # Never through a link planted in the folder: O_CREAT would create (or truncate
        # below) its target.
        fd = open_regular(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunLocked(_held_message(path, _read(fd))) from None
            except OSError as err:  # a file system without locks (some network mounts)
                _log.warning(
                    "Run folder %s: cannot lock %s (%s), so a second writer would not be "
                    "refused: start one run per folder",
                    path.parent,
                    path,
                    err.strerror,
                )
                path.unlink(missing_ok=True)
                os.close(fd)
                return None
            if not _same_file(fd, path):
                os.close(fd)  # released and removed since we opened it: try the new one
                continue
            previous = _read(fd)
            if previous is not None and previous.elsewhere:
                raise RunLocked(_other_host_message(path, previous))
            if previous is not None:
                _log.warning(
                    "Run folder %s: taking over the lock of %s; that process ended without "
                    "releasing it",
                    path.parent,
                    previous,
                )
            started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            me = json.dumps(
                {"pid": os.getpid(), "host": HOST, "started": started, "boot_id": BOOT_ID}
            )
            os.ftruncate(fd, 0)
            os.pwrite(fd, (me + "\n").encode(), 0)
            os.fsync(fd)
            return fd
        except BaseException:
            os.close(fd)
            raise


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.lstat()  # a link put there since is not our file
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def _read(fd: int) -> Holder | None:
    return _parse(os.pread(fd, 4096, 0))


def _parse(data: bytes) -> Holder | None:
    try:
        d = json.loads(data)
        return Holder(int(d["pid"]), str(d["host"]), str(d["started"]), str(d.get("boot_id", "")))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None  # empty (its holder is just writing it) or not ours


def _held_message(path: Path, who: Holder | None) -> str:
    run_dir = path.parent
    if who is None:
        return (
            f"run folder {run_dir} is being written by another process (it is just starting; "
            f"its details are not in {path} yet). Two writers would interleave its rows: wait "
            "for that run to end, or choose another run-name."
        )
    stop = f"`kill {who.pid}`" if who.host == HOST else f"`kill {who.pid}` on {who.host}"
    return (
        f"run folder {run_dir} is being written by another process: {who} (lock {path}). "
        "Two writers would interleave its rows. Wait for that run to end, or stop it "
        f"({stop}) and resume then; to run beside it, choose another run-name."
    )


def _other_host_message(path: Path, who: Holder) -> str:
    return (
        f"run folder {path.parent} is locked by {who}, and this host ({HOST}) cannot check "
        f"whether that process still runs. If it does not (on {who.host}: `ps -p {who.pid}`), "
        f"remove {path} by hand and try again."
    )
