"""The ``edgefleet`` command line as a new user meets it: --version, the top-level help, the
errors for a misspelt key or a taken run folder, and the docs' command reference
(docs/reference/cli.md) kept equal to the parsers. Nothing here starts Flower or Ray."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from edgefleet import cli
from edgefleet.cli import command_parsers, main, top_parser
from edgefleet.config import ConfigError
from edgefleet.simulation.runner import load_scenario

ROOT = Path(__file__).resolve().parents[1]
FEDAVG = str(ROOT / "scenarios" / "fedavg.toml")


def test_version_prints_edgefleet_flower_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"edgefleet {version('edgefleet')} ")
    assert f"Flower {version('flwr')}" in out and f"torch {version('torch')}" in out


def test_version_does_not_import_torch() -> None:
    code = (
        "import sys; from edgefleet.cli import main; main(['--version']); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[-1] == "False"


@pytest.mark.parametrize("argv", [[], ["--help"], ["nope"]])
def test_top_level_usage_names_commands_and_per_command_help(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(argv)
    assert code == (0 if argv == ["--help"] else 2)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    for command in cli.COMMANDS:
        assert command in text
    if argv != ["nope"]:
        assert "edgefleet COMMAND --help" in text
    else:
        assert "invalid choice: 'nope'" in text


def test_unknown_key_on_the_command_line_suggests_a_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "_early_engine", lambda *a: None)  # no Ray cluster for this
    assert main(["run", FEDAVG, "--set", "num-server-round=3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown run-config key 'num-server-round'; did you mean 'num-server-rounds'?" in err
    assert "python -m edgefleet.config" in err
    assert "local-steps" not in err


def test_unknown_federation_key_suggests_a_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'num-supernode'; did you mean 'num-supernodes'"):
        load_scenario(FEDAVG, {"federation.num-supernode": 3})


def test_a_key_of_the_other_table_says_where_it_belongs() -> None:
    with pytest.raises(ConfigError, match=r"federation key.*--set federation\.num-supernodes="):
        load_scenario(FEDAVG, {"num-supernodes": 3})
    with pytest.raises(ConfigError, match=r"run-config key, not a federation key.*--set seed="):
        load_scenario(FEDAVG, {"federation.seed": 3})


def test_a_taken_run_folder_is_refused_in_the_cli_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "_early_engine", lambda *a: None)
    run_dir = tmp_path / "runs" / "taken"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n')
    sets = ["--set", "run-name=taken", "--set", f"output-dir={tmp_path / 'runs'}"]
    assert main(["run", FEDAVG, *sets, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"run folder {run_dir} already holds results" in err
    resume = (
        f"edgefleet run {FEDAVG} --set run-name=taken --set output-dir={run_dir.parent} --resume"
    )
    assert resume in err
    assert "resume = true" not in err
    # and nothing was started or written: the folder is as it was
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("engine", ["inprocess", "simulation"])
def test_a_failed_data_check_leaves_no_run_folder(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    engine: str,
) -> None:
    """An empty folder left by a refused start would show among the runs to resume."""
    from edgefleet.simulation import engine as simulation_engine
    from edgefleet.task import datasets

    def missing(name: str, data_dir: str) -> None:
        raise FileNotFoundError(f"data set {name!r} not found")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    monkeypatch.setattr(cli, "_early_engine", lambda *a: None)
    # The Simulation Engine checks the data while it starts: no Flower process for this.
    monkeypatch.setattr(simulation_engine.Engine, "start", lambda self, check: check())
    sets = ["--set", "run-name=refused", "--set", f"output-dir={tmp_path}"]
    assert main(["run", FEDAVG, "--engine", engine, *sets, "--quiet"]) == 2
    assert "data set 'mnist-5k' not found" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- the docs' command reference (generated by docs/gen.py) --------------------------------


def _reference() -> str:
    return (ROOT / "docs" / "reference" / "cli.md").read_text()


def _blocks(section: str) -> dict[str, str]:
    """The text of each ``edgefleet COMMAND ...`` entry and the option lines under it."""
    blocks: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        m = re.match(r"## edgefleet ([a-z]+)\b", line)
        if m:
            current = m.group(1)
            blocks[current] = ""
        if current is not None:
            blocks[current] += line + "\n"
    return blocks


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [
        max(a.option_strings, key=len)  # the long form
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def _positionals(parser: argparse.ArgumentParser) -> list[str]:
    return [(a.metavar or a.dest).upper() for a in parser._actions if not a.option_strings]


def test_readme_command_reference_lists_every_command_and_option() -> None:
    section = _reference()
    blocks = _blocks(section)
    for option in _options(top_parser()):
        assert f"edgefleet {option}" in section, option
    assert "edgefleet COMMAND --help" in section
    parsers = command_parsers()
    assert set(parsers) == set(cli.COMMANDS)
    for command, parser in parsers.items():
        assert command in blocks, f"docs/reference/cli.md lacks `edgefleet {command}`"
        for option in _options(parser):
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", blocks[command]), (
                f"docs/reference/cli.md lacks `edgefleet {command} {option}`"
            )
        for positional in _positionals(parser):
            assert positional in blocks[command].splitlines()[0], (command, positional)


@pytest.mark.parametrize(
    ("content", "overrides", "expected"),
    [
        (b'[run-config]\nrun-name = "\xff\xfe"\n', [], "is not UTF-8 text"),
        (b"run-config = [1,2]\n", [], "'run-config' = \\[1, 2\\] must be a table"),
        (b"federation = 3\n", [], "'federation' = 3 must be a table"),
        (b"[run-config]\nx = " + b"[" * 5000 + b"]" * 5000, [], "nests arrays or tables too deep"),
        (
            b"[run-config]\n" + b".".join([b"a"] * 5000) + b" = 1\n",
            [],
            "run-config tables nest deeper than 16",
        ),
        (b"", ["seed=2**70"], "must be an integer"),  # not TOML: taken as the text '2**70'
        (b"", [f"seed={2**70}"], "'seed' = 1180591620717411303424: must be at most 2,147,483,647"),
        (b"", ["screening.norm-factor=inf"], "'screening.norm-factor' = inf: must be a finite"),
        (
            b"",
            ["federation.num-supernodes=1000000000"],
            "federation 'num-supernodes' = 1000000000: must be an integer in \\[1, 100,000\\]",
        ),
        (b"", [f"num-server-rounds={2**80}"], "must be at most 1,000,000"),
    ],
)
def test_bad_scenario_files_and_values_are_refused_before_work_starts(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    content: bytes,
    overrides: list[str],
    expected: str,
) -> None:
    started: list[object] = []  # the data check: the first work a run does, after the checks

    def work_starts(cfg: object) -> None:  # and stops there: 10^9 nodes must never be built
        started.append(cfg)
        raise RuntimeError("the run started its work")

    monkeypatch.setattr("edgefleet.simulation.runner.check_data", work_starts)
    monkeypatch.chdir(tmp_path)
    scenario = tmp_path / "s.toml"
    scenario.write_bytes(content)
    argv = ["run", str(scenario), "--quiet", "--engine", "inprocess"]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err), err
    assert "Traceback" not in err and not started


def test_a_directory_as_scenario_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", str(tmp_path), "--quiet", "--engine", "inprocess"]) == 2
    assert f"scenario {tmp_path} is a directory" in capsys.readouterr().err
