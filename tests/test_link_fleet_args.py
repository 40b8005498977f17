"""``benchmarks/link_fleet.py`` refuses a bad setting before it starts a fleet (no root needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--set", "nokey=1"], "unknown run-config key 'nokey'"),
        (["--set", "saga.correction=nope"], "must be one of channels, participants"),
        (["--set", "saga.correction"], "expected KEY=VALUE"),
        (["--strategy", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_a_bad_setting_is_refused_before_any_fleet(args: list[str], says: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "link_fleet.py"), *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr
    assert "link_fleet:" not in proc.stdout + proc.stderr.replace("link_fleet.py:", "")
