"""``python -m benchmarks``: one runner that lists every benchmark by group and runs one as
``python -m benchmarks.<group>.<name>`` would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as runner
from benchmarks.claims import table

ROOT = Path(__file__).resolve().parents[1]


def test_the_listing_names_every_benchmark_module_in_its_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert runner.main([]) == 0
    out = capsys.readouterr().out
    for group in runner.GROUPS:
        for path in (ROOT / "benchmarks" / group).glob("[!_]*.py"):
            assert f"  {path.stem} " in out, path
            assert runner.benchmarks()[path.stem][0] == group


def test_an_unknown_benchmark_is_refused_with_the_valid_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert runner.main(["link-fleet"]) == 2
    assert runner.main(["claims.link_fleet"]) == 2  # in perf, not claims
    err = capsys.readouterr().err
    assert "unknown benchmark 'link-fleet'" in err and "link_fleet, " in err


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_benchmark_runs_through_the_runner_with_its_own_arguments() -> None:
    assert _run("table").stdout == table.markdown()
    proc = _run("perf.link_fleet", "--set", "nokey=1")
    assert proc.returncode == 2
    assert "unknown run-config key 'nokey'" in proc.stderr


def test_key_flags_take_type_and_help_from_the_run_config_and_refuse_a_bad_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from benchmarks.lib.overrides import add_key_args, key_values
    from edgefleet.config import KEYS

    p = argparse.ArgumentParser()
    add_key_args(p, {"local-steps": 5, "model": "linear"})
    assert key_values(p, p.parse_args([]), ["local-steps", "model"]) == {
        "local-steps": 5,
        "model": "linear",
    }
    assert KEYS["local-steps"].help in p.format_help()
    with pytest.raises(SystemExit) as stop:
        key_values(p, p.parse_args(["--model", "nope"]), ["local-steps", "model"])
    assert stop.value.code == 2
    assert "'model' = 'nope': must be one of linear" in capsys.readouterr().err
