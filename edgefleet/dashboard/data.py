"""Reading a run folder as the dashboard sees it: ``fleet.json`` and ``metrics.jsonl``.

Both are read afresh on every request, so the dashboard keeps no state: it shows a live run
(the server rewrites ``fleet.json`` atomically after every round and appends a row to
``metrics.jsonl``) or a finished one the same way. A file that is absent or not yet whole (the
last line of ``metrics.jsonl`` while the server appends it) reads as nothing rather than as an
error: the next refresh has it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FLEET = "fleet.json"
ROUNDS = "metrics.jsonl"


def read_fleet(run_dir: Path) -> dict[str, Any]:
    """``fleet.json`` as a dict (``{}`` while there is none, or it is not a JSON object)."""
    try:
        data = json.loads((Path(run_dir) / FLEET).read_text())
    except (OSError, ValueError):
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
    try:
        text = (Path(run_dir) / ROUNDS).read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def signature(run_dir: Path) -> str:
    """Changes whenever either file does (what the page's event stream watches)."""
    parts = []
    for name in (FLEET, ROUNDS):
        try:
            st = (Path(run_dir) / name).stat()
            parts.append(f"{st.st_mtime_ns}:{st.st_size}")
        except OSError:
            parts.append("-")
    return "/".join(parts)


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None (absent, a string, a bool, NaN or infinite)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def device_id(device: dict[str, Any]) -> str:
    return str(device.get("device", ""))
