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
"""

from __future__ import annotations

import glob
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")


def atomic_write(path: Path | str, write: Callable[[BinaryIO], object]) -> None:
    """Create or replace ``path`` with what ``write(fileobj)`` writes, atomically.

    If ``write`` raises, the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
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
