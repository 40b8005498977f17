"""Hypothesis fuzzes what a user types: ``--set`` values and scenario TOML files. Each input
ends in a scenario and run config that parse, or in a ConfigError (a usage error on the
command line) naming the problem; never another exception. Derandomized: the same examples
every run, a few seconds in all."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefleet.cli import parse_overrides
from edgefleet.config import KEYS, ConfigError
from edgefleet.simulation.runner import FEDERATION_KEYS, load_scenario, resolve_run_config

ROOT = Path(__file__).resolve().parents[1]
FEDAVG = ROOT / "scenarios" / "fedavg.toml"
FUZZ = settings(
    derandomize=True,
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

KEY_NAMES = sorted(KEYS) + [f"federation.{k}" for k in FEDERATION_KEYS]
# Values as typed after `--set KEY=`: TOML literals of every kind and size, and plain text.
_atoms = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.sampled_from(["inf", "-inf", "nan", "1e400", "2**70", "true", "0x7f", "1979-05-27"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=20).map(lambda t: '"' + t.replace("\\", "").replace('"', "") + '"'),
    st.text(max_size=20),
)
VALUES = st.one_of(
    _atoms,
    st.tuples(st.integers(1, 3000), st.sampled_from("[{")).map(
        lambda d: d[1] * d[0] + ("]" if d[1] == "[" else "}") * d[0]
    ),
    st.lists(_atoms, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
)


def _outcome(scenario: Path, overrides: dict[str, object]) -> None:
    with contextlib.suppress(ConfigError):  # a clear error is a right answer too
        resolve_run_config(load_scenario(scenario, overrides))


@FUZZ
@given(key=st.sampled_from(KEY_NAMES) | st.text(max_size=12), value=VALUES)
def test_a_set_value_parses_or_is_a_clear_error(key: str, value: str) -> None:
    parser = argparse.ArgumentParser(prog="edgefleet run")
    try:
        overrides = parse_overrides(parser, [f"{key}={value}"])
    except SystemExit as exc:  # argparse's usage error, its message on stderr
        assert exc.code == 2
        return
    _outcome(FEDAVG, overrides)


_lines = st.one_of(
    st.sampled_from(
        ["[federation]", "[run-config]", "[run-config.energy]", "[[x]]", "run-config = [1,2]"]
    ),
    st.tuples(st.sampled_from(KEY_NAMES) | st.text(max_size=8), VALUES).map(
        lambda kv: f"{kv[0]} = {kv[1]}"
    ),
    st.text(max_size=40),
)


@FUZZ
@given(
    lines=st.lists(_lines, max_size=8),
    raw=st.binary(max_size=40),
)
def test_a_scenario_file_parses_or_is_a_clear_error(lines: list[str], raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.toml"
        path.write_text("\n".join(lines) + "\n")
        _outcome(path, {})
        path.write_bytes(raw)  # any bytes, UTF-8 or not
        _outcome(path, {})


@pytest.mark.parametrize("deep", ["[" * 5000 + "]" * 5000, "{a=" * 3000 + "1" + "}" * 3000])
def test_a_value_nested_thousands_deep_is_a_usage_error(
    deep: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_overrides(argparse.ArgumentParser(prog="edgefleet run"), [f"seed={deep}"])
    assert exc.value.code == 2
    assert "--set seed: value" in capsys.readouterr().err
