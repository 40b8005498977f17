"""Reading a run folder as the dashboard sees it: ``fleet.json`` and ``metrics.jsonl``.

Both are read afresh on every request, so the dashboard shows a live run (the server
rewrites ``fleet.json`` atomically after every round and appends a row to ``metrics.jsonl``)
or a finished one the same way. A file that is absent or not yet whole (the last line of
``metrics.jsonl`` while the server appends it) reads as nothing rather than as an error: the
next refresh has it. What is made of the files (:class:`ContentCache`) is made again only when
their bytes change: at 1,000 devices parsing and rendering cost far more than reading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from edgefleet.fileio import read_regular

FLEET = "fleet.json"
ROUNDS = "metrics.jsonl"
BATTERIES = "batteries.jsonl"  # edgefleet.server.fleet.BATTERIES; not imported: no torch here
T = TypeVar("T")


def _finite_or_none(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _loads(raw: bytes) -> Any:
    """JSON with every non-finite number (``NaN``, ``Infinity``, ``1e999``) read as None: the
    server's rows may hold one (a diverged model's loss is ``Infinity``), and the page's JSON
    must not (a strict encoder refuses it, and the whole endpoint with it)."""
    return json.loads(raw, parse_constant=lambda _: None, parse_float=_finite_or_none)


def read_bytes(run_dir: Path, name: str) -> bytes | None:
    """A run file's bytes, or None while it does not exist (or cannot be read). A link, a FIFO
    or a device there reads as nothing (:func:`~edgefleet.fileio.read_regular`): a link would
    serve another file to the page, a FIFO hold a worker thread forever."""
    try:
        return read_regular(Path(run_dir) / name)
    except OSError:
        return None


def read_fleet(run_dir: Path) -> dict[str, Any]:
    """``fleet.json`` as a dict (``{}`` while there is none, or it is not a JSON object)."""
    return parse_fleet(read_bytes(run_dir, FLEET))


def parse_fleet(raw: bytes | None) -> dict[str, Any]:
    """:func:`read_fleet` of a file's bytes."""
    if raw is None:
        return {}
    try:
        data = _loads(raw)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    if not isinstance(data.get("devices"), list):
        data["devices"] = []
    data["devices"] = [d for d in data["devices"] if isinstance(d, dict)]
    return data


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    """Every whole row of ``metrics.jsonl``, in file order: a line that does not parse (the
    last one, while the server is writing it) is left out."""
    return parse_rounds(read_bytes(run_dir, ROUNDS))


def parse_rounds(raw: bytes | None) -> list[dict[str, Any]]:
    """:func:`read_rounds` of a file's bytes."""
    if raw is None:
        return []
    rows = []
    for line in raw.splitlines():
        try:
            row = _loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def parse_batteries(raw: bytes | None) -> dict[int, dict[str, float]]:
    """``batteries.jsonl``'s bytes as ``{round: {device: level}}``, rounds in order; of a
    round run twice (a resume), the last line; lines that do not parse, and values that are
    not finite numbers, left out."""
    by_round: dict[int, dict[str, float]] = {}
    for row in parse_rounds(raw):
        rnd, levels = row.get("round"), row.get("batteries")
        if isinstance(rnd, bool) or not isinstance(rnd, int) or not isinstance(levels, dict):
            continue
        by_round[rnd] = {str(k): v for k, x in levels.items() if (v := number(x)) is not None}
    return dict(sorted(by_round.items()))


def battery_stats(by_round: dict[int, dict[str, float]]) -> dict[str, list[Any]]:
    """Per round: the fleet's mean, lowest and highest battery."""
    stats: dict[str, list[Any]] = {"rounds": [], "mean": [], "min": [], "max": []}
    for rnd, levels in by_round.items():
        values = list(levels.values())
        stats["rounds"].append(rnd)
        stats["mean"].append(sum(values) / len(values) if values else None)
        stats["min"].append(min(values, default=None))
        stats["max"].append(max(values, default=None))
    return stats


class ContentCache:
    """For each use (a name), the last value made of a run folder's files, kept while those
    files hold the same bytes. Keyed by a digest of the exact contents, not by modification
    time: a file rewritten within one clock tick at the same size is still seen to change.
    One value per use, so what is kept is bounded by the number of endpoints."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, tuple[tuple[str, ...], Any]] = {}

    def get(self, use: str, run_dir: Path, names: tuple[str, ...], make: Callable[..., T]) -> T:
        """``make(*bytes_of_names)``, or the value it gave for these exact bytes before."""
        raws = [read_bytes(run_dir, name) for name in names]
        key = (str(run_dir),) + tuple(
            "-" if raw is None else hashlib.blake2b(raw, digest_size=20).hexdigest() for raw in raws
        )
        with self._lock:
            hit = self._values.get(use)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = make(*raws)
        with self._lock:
            self._values[use] = (key, value)
        return value


def signature(run_dir: Path) -> str:
    """Changes whenever a run file does (what the page's event stream watches)."""
    parts = []
    for name in (FLEET, ROUNDS, BATTERIES):
        try:
            st = (Path(run_dir) / name).stat()
            parts.append(f"{st.st_mtime_ns}:{st.st_size}")
        except OSError:
            parts.append("-")
    return "/".join(parts)


def latest_run(parent: Path) -> Path | None:
    """The run folder under ``parent`` written to last (None while there is none): of the
    subfolders holding ``fleet.json`` or ``metrics.jsonl``, the one whose folder or files
    changed most recently. A run in progress is the newest, since the server renames a fresh
    ``fleet.json`` into its folder after every round; so a dashboard of an output-dir follows
    each new run as it starts, without knowing its (dated) name in advance."""
    best: tuple[int, str] | None = None
    found = None
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return None
    for entry in entries:
        if entry.is_symlink():  # a run's folder is made by its run, never a link to elsewhere
            continue
        times = []
        for path in (entry, entry / FLEET, entry / ROUNDS):
            with contextlib.suppress(OSError):
                times.append(path.stat().st_mtime_ns)
        # A folder (or file) without either run file has one time at most: not a run.
        if len(times) < 2:
            continue
        key = (max(times), entry.name)  # the name breaks a tie, so the choice is stable
        if best is None or key > best:
            best, found = key, entry
    return found


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None (absent, a string, a bool, NaN or infinite)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        f = float(value)  # JSON's integers are unbounded: 1e400 as an int overflows here
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def device_id(device: dict[str, Any]) -> str:
    return str(device.get("device", ""))
