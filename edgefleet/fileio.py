"""Atomic file writes: the one way EdgeFleet writes a file that someone may read later.

:func:`atomic_write` writes to a temporary file beside the target, fsyncs it, moves it over
the target with ``os.replace`` and fsyncs the folder. A reader (another process, or the same
program after a crash or a power cut, which a device on harvested energy must expect) sees
either the old file whole or the new one whole, never half of one. Use it for checkpoints,
results, session stores and the data cache; :func:`atomic_write_bytes` and
:func:`atomic_write_text` cover the common cases.

A crash between creating the temporary file and the move leaves a hidden
``.<name>.<pid>.<random>.tmp`` beside the target; :func:`remove_stale_temps` deletes them
where the caller knows nobody else is writing that target (the data cache, under its lock).

Files written in place (an appended log or rows, a lock file) are opened with
:func:`open_regular`: never through a symbolic link (``O_NOFOLLOW``) and only when what is
there is a regular file, so a link planted in a run folder (``flower.log`` ->
``~/.bashrc``) is refused with :class:`NotARegularFile` and its target left untouched; an
atomic write refuses such a target too, rather than silently replace the link.
:func:`read_regular` reads the same way (a FIFO would block a reader forever, a link to
``/dev/zero`` never end). Links in the folders above the file are followed: an output-dir
on another disk through a link is the operator's choice, a file in it is not.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, BinaryIO


class NotARegularFile(OSError):
    """A file EdgeFleet writes or reads in place is a symbolic link, a FIFO, a device or a
    folder: refused, its target untouched (the message names it and what to do)."""


def _refusal(path: Path, what: str) -> NotARegularFile:
    return NotARegularFile(
        errno.ELOOP if what.startswith("a symbolic link") else errno.EINVAL,
        f"{path} is {what}, not a regular file: EdgeFleet reads and writes its files only "
        "as regular files, never through a link (one planted there would have it overwrite "
        "the link's target). Remove it, or choose another folder.",
    )


def _kind(path: Path) -> str:
    try:
        st = path.lstat()
    except OSError:
        return "not a regular file"
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):  # fmt: skip
        if test(st.st_mode):
            return name
    return "not a regular file"


def open_regular(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags, mode)`` of a regular file only: a symbolic link as the last
    component (``O_NOFOLLOW``), a FIFO, a device or a folder is :class:`NotARegularFile`,
    found before a byte is read or written (``O_TRUNC`` is applied only after the check).
    Opened non-blocking, so a FIFO cannot hold the open, then switched back to blocking."""
    path = Path(path)
    truncate = bool(flags & os.O_TRUNC)
    flags = (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as err:
        # ELOOP: the link itself; ENXIO: a FIFO without a reader, opened to write; EISDIR.
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise _refusal(path, _kind(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refusal(path, _kind(path))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: Path | str) -> IO[str]:
    """``path`` opened to append text (created if absent): :func:`open_regular`."""
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding="utf-8")


def read_regular(path: Path | str) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`; absent: FileNotFoundError)."""
    with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as f:
        return f.read()


def check_regular_or_absent(path: Path | str) -> None:
    """:class:`NotARegularFile` unless ``path`` is a regular file or does not exist."""
    path = Path(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(path, _kind(path))


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")


def atomic_write(path: Path | str, write: Callable[[BinaryIO], object]) -> None:
    """Create or replace ``path`` with what ``write(fileobj)`` writes, atomically.

    If ``write`` raises, the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # os.replace would replace a planted link (or FIFO) without touching its target; refused
    # all the same, so that what is there is found, not silently undone.
    check_regular_or_absent(path)
    # Not tempfile.mkstemp: its 0600 mode would make a shared cache unreadable to others;
    # "x" opens with the usual umask and fails rather than reuse a name.
    tmp = _temp_name(path)
    try:
        with tmp.open("xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def remove_stale_temps(path: Path) -> None:
    """Delete temporary files that interrupted :func:`atomic_write` calls left for ``path``.

    Only safe while no other process can be writing ``path`` (e.g. under a lock that every
    writer of ``path`` takes).
    """
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        stale.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform lets a folder be opened for it.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
