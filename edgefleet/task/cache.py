"""The data cache: files derived from a data set's source (decoded, unpacked, partitioned) that
the next process reads instead of redoing the work, and the checks that make them safe to
trust.

Use :func:`load_or_build` for anything written into the cache. A cached file is read only
after its *stamp* (``.<file>.stamp.json`` beside it, written after the file was built and decoded
successfully) matches: the stamp records the file's size and sha256 and a *key*, what the file
was built from (the source's size and sha256, the parameters, a format version). A file that
is truncated, corrupted, left by an older EdgeFleet or built from another source fails the
check and is rebuilt from its source; with no source at hand it is refused with a
:class:`DataCorruptError` naming it. Builders hold an inter-process lock
(:func:`cache_lock`), so simulated devices starting together build a file once and the others
wait for it; readers need no lock, since files are replaced atomically and checked against the
stamp through the same open file that is then decoded.

Use :func:`verify_source` for a source file (a data set as downloaded or copied): it gives the
file's size and sha256 for keys, and checks it against a ``SHA256SUMS`` file beside it (as in
the shared data folder), so a corrupted copy is named before any work is spent on it.

Where: ``$EDGEFLEET_CACHE_DIR``, default ``~/.cache/edgefleet`` (:func:`cache_dir`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from edgefleet.fileio import atomic_write, atomic_write_text, remove_stale_temps

log = logging.getLogger(__name__)

T = TypeVar("T")

STAMP_SUFFIX = ".stamp.json"  # the stamp of <folder>/<name> is <folder>/.<name>.stamp.json
STAMP_FORMAT = 1
SUMS_FILE = "SHA256SUMS"

# What decoding a truncated or corrupted file raises (np.load, gzip, tarfile, PIL, our checks).
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    EOFError,
    ValueError,
    KeyError,
    zipfile.BadZipFile,
    zlib.error,
)


class DataCorruptError(ValueError):
    """A data file (a source, or a cached copy that cannot be rebuilt) is truncated or
    corrupt. The message names the file and says how to get a good copy."""


class CacheUnwritableError(OSError):
    """The cache folder cannot be created or locked (read-only, not a folder, no space)."""


def cache_dir() -> Path:
    """Where derived data is written: $EDGEFLEET_CACHE_DIR or ~/.cache/edgefleet."""
    env = os.environ.get("EDGEFLEET_CACHE_DIR", "")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgefleet"


@contextmanager
def cache_lock(name: str, folder: Path | None = None) -> Iterator[Path]:
    """Hold the inter-process lock ``name`` (a file in ``folder``, default the cache) while
    building cached files; yields the folder.

    Simulated devices run in parallel processes and would otherwise all build the same file
    at once. The lock is an OS file lock (flock), released by the kernel if its holder dies.
    """
    from filelock import FileLock  # a dependency of its own; cheap, but only needed here

    folder = cache_dir() if folder is None else folder
    lock = FileLock(str(folder / f".{name}.lock"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as err:
        raise CacheUnwritableError(
            f"cannot use the data cache folder {folder} ({err}); set EDGEFLEET_CACHE_DIR to "
            "a folder this process can write"
        ) from err
    try:
        yield folder
    finally:
        lock.release()


# --- file identity ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FileId:
    """Size and sha256 of a file's content."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


_IDS: dict[tuple[Any, ...], FileId] = {}


def file_id(path: Path) -> FileId:
    """Size and sha256 of ``path``; hashed once per process while the file is unchanged."""
    st = path.stat()
    memo = (str(path.absolute()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if memo not in _IDS:
        with path.open("rb") as f:
            _IDS[memo] = FileId(st.st_size, hashlib.file_digest(f, "sha256").hexdigest())
    return _IDS[memo]


def verify_source(path: Path) -> FileId:
    """The identity of source file ``path``, checked against a ``SHA256SUMS`` listing it in
    its folder or the folder above (``mnist/train-images-idx3-ubyte.gz``); DataCorruptError
    when the content differs."""
    fid = file_id(path)
    for sums, name in (
        (path.parent / SUMS_FILE, path.name),
        (path.parent.parent / SUMS_FILE, f"{path.parent.name}/{path.name}"),
    ):
        expected = _listed_sha256(sums, name)
        if expected is not None and expected != fid.sha256:
            raise DataCorruptError(
                f"{path} is truncated or corrupt: its sha256 is {fid.sha256} ({fid.size} "
                f"bytes) but {sums} lists {expected}. Copy it again from where that folder "
                f"came from and check the copy with `cd {sums.parent} && sha256sum -c "
                f"{SUMS_FILE}`."
            )
    return fid


def _listed_sha256(sums: Path, name: str) -> str | None:
    try:
        lines = sums.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        digest, _, listed = line.strip().partition(" ")
        if listed.strip().lstrip("*") == name:  # "HEX  name" or, binary mode, "HEX *name"
            return digest.lower()
    return None


# --- verified entries -------------------------------------------------------------------------


def _canonical(key: Mapping[str, Any]) -> dict[str, Any]:
    """The key as it reads back from JSON (tuples become lists), so stamps compare equal."""
    out: dict[str, Any] = json.loads(json.dumps(key, sort_keys=True))
    return out


def key_digest(key: Mapping[str, Any]) -> str:
    """A short, stable name for ``key`` (file names of keyed entries)."""
    text = json.dumps(_canonical(key), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class CachedFile:
    """One file in the cache and its stamp.

    ``key`` says what the file must have been built from; ``None`` accepts whatever the
    stamp records (for a file whose source is not at hand: it is still checked against its
    own size and hash).
    """

    def __init__(self, path: Path, key: Mapping[str, Any] | None) -> None:
        self.path = path
        self.key = None if key is None else _canonical(key)

    @property
    def stamp_path(self) -> Path:
        # Hidden, so that a listing of the cache shows the data files.
        return self.path.with_name(f".{self.path.name}{STAMP_SUFFIX}")

    def open_verified(self) -> tuple[BinaryIO | None, str]:
        """The file opened for reading and checked against its stamp, or (None, why not).

        The check and the caller's decoding use the same open file, so a file replaced in
        between (another process rebuilding it) cannot slip through unchecked.
        """
        if not self.path.exists():
            return None, "missing"
        try:
            stamp = json.loads(self.stamp_path.read_text())
            size, sha = int(stamp["size"]), str(stamp["sha256"])
            stamped_key = stamp["key"]
            if stamp.get("format") != STAMP_FORMAT:
                return None, f"stamp format {stamp.get('format')!r} is not {STAMP_FORMAT}"
        except FileNotFoundError:
            return None, "no stamp (an interrupted build or an older EdgeFleet wrote it)"
        except (OSError, ValueError, KeyError, TypeError) as err:
            return None, f"unreadable stamp {self.stamp_path.name} ({err})"
        if self.key is not None and stamped_key != self.key:
            return None, "built from another source or with other parameters"
        try:
            f = self.path.open("rb")
        except OSError as err:
            return None, f"cannot open it ({err})"
        try:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                f.close()
                return None, f"{actual} bytes where its stamp says {size} (truncated?)"
            if hashlib.file_digest(f, "sha256").hexdigest() != sha:
                f.close()
                return None, "its sha256 differs from its stamp (corrupted)"
            f.seek(0)
        except BaseException:
            f.close()
            raise
        return f, ""

    def write_stamp(self) -> None:
        """Record the file as it is now; call only after it was decoded successfully."""
        with self.path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            sha = hashlib.file_digest(f, "sha256").hexdigest()
        stamp = {"format": STAMP_FORMAT, "size": size, "sha256": sha, "key": self.key or {}}
        atomic_write_text(self.stamp_path, json.dumps(stamp, indent=1, sort_keys=True) + "\n")

    def discard(self) -> None:
        # The stamp goes first: a reader never pairs an old stamp with a new file by mistake
        # (it would fail the hash check anyway, then wait for the lock).
        self.stamp_path.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)


_MISSING: Any = object()


def _read_verified(entry: CachedFile, read: Callable[[BinaryIO], T]) -> tuple[T, str]:
    f, why = entry.open_verified()
    if f is None:
        return _MISSING, why
    with f:
        try:
            return read(f), ""
        except DECODE_ERRORS as err:  # matches its stamp but not what this code expects
            return _MISSING, f"does not decode ({err})"


def load_or_build(
    entry: CachedFile,
    read: Callable[[BinaryIO], T],
    build: Callable[[BinaryIO], object] | None,
    *,
    lock: str,
    lock_dir: Path | None = None,
    source: str = "",
    how: str = "",
) -> T:
    """``read(file)`` of the verified cache file ``entry``, building it first if needed.

    ``build(file)`` writes the file from its source (it raises DataCorruptError, naming the
    source, when the source is bad); ``read`` decodes and checks it, raising one of
    ``DECODE_ERRORS`` for a bad file. A file that fails the check is logged and rebuilt. With
    ``build=None`` (no source at hand) a file with no stamp (from an older EdgeFleet) is kept
    if it decodes; any other bad file is removed and DataCorruptError raised, with ``how``
    saying how to get the source. ``source`` names the source in messages. The lock is
    ``lock`` in ``lock_dir`` (default: the file's folder); everything that writes the same
    files must use the same one.
    """
    value, why = _read_verified(entry, read)
    if value is not _MISSING:
        return value
    with cache_lock(lock, entry.path.parent if lock_dir is None else lock_dir):
        value, why = _read_verified(entry, read)  # another process may have built it meanwhile
        if value is not _MISSING:
            return value
        if why != "missing":
            log.warning(
                "cache file %s is not usable: %s; %s",
                entry.path,
                why,
                "rebuilding it" if build else "no source to rebuild it from",
            )
        if build is None:
            return _adopt_or_refuse(entry, read, why, how)
        entry.discard()
        remove_stale_temps(entry.path)
        atomic_write(entry.path, build)
        try:
            with entry.path.open("rb") as f:
                value = read(f)
        except DECODE_ERRORS as err:
            entry.discard()
            raise DataCorruptError(
                f"{source or 'the source'} is corrupt: {entry.path.name} built from it does "
                f"not decode ({err}). {how}".rstrip()
            ) from err
        entry.write_stamp()
        return value


def _adopt_or_refuse(entry: CachedFile, read: Callable[[BinaryIO], T], why: str, how: str) -> T:
    if why == "missing":
        raise FileNotFoundError(f"cache file {entry.path} does not exist. {how}".rstrip())
    if why.startswith("no stamp"):
        try:
            with entry.path.open("rb") as f:
                value = read(f)
        except DECODE_ERRORS as err:
            why = f"it does not decode ({err})"
        else:
            entry.write_stamp()
            log.info("cache file %s decodes; stamped it", entry.path)
            return value
    entry.discard()
    raise DataCorruptError(
        f"cache file {entry.path} is corrupt ({why}) and its source is not at hand to rebuild "
        f"it; removed it. {how}".rstrip()
    )
