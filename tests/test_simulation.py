"""End to end on Flower's Simulation Engine, and the scenario runner's checks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from edgefleet.cli import main as cli_main
from edgefleet.config import ConfigError
from edgefleet.server.checkpoint import FILENAME, Checkpoint, run_identity, save_checkpoint
from edgefleet.simulation.runner import (
    check_federation,
    load_scenario,
    parse_value,
    resolve_run_config,
    resume_hint,
    run_scenario,
    serverapp_error,
)
from fleetharness.fleet import processes_with_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_two_rounds_on_simulation_engine(tmp_path: Path, monkeypatch) -> None:
    # The runner's FLWR_HOME is a temp dir; put it where we can recognise its processes.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    scenario = load_scenario(
        ROOT / "scenarios" / "fedavg.toml",
        {
            "federation.num-supernodes": 3,
            "num-server-rounds": 2,
            "local-steps": 15,
            "output-dir": str(tmp_path),
            "run-name": "e2e",
        },
    )
    run_dir = run_scenario(scenario, timeout=240, quiet=True)
    assert run_dir == tmp_path / "e2e"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(sorted(r["participants"]) == ["0", "1", "2"] for r in rows)
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_run"] == 2
    assert summary["final_accuracy"] > 0.3  # 10 classes: chance is 0.1
    fleet = json.loads((run_dir / "fleet.json").read_text())
    assert fleet["round"] == 2 and [d["device"] for d in fleet["devices"]] == ["0", "1", "2"]
    assert all(d["participations"] == 2 and d["online"] for d in fleet["devices"])
    assert summary["config"]["num-server-rounds"] == 2
    left = processes_with_env(f"FLWR_HOME={tmp_path / 'tmp'}")
    assert not left, f"the runner left Flower processes behind: {left}"


def test_bad_config_fails_before_any_process(tmp_path: Path, capsys) -> None:
    code = cli_main(["run", str(ROOT / "scenarios" / "fedavg.toml"), "--set", "alpha=0", "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "'alpha' = 0.0" in err and "must be > 0" in err


def test_scenario_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_scenario(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[federation]\nnum-supernodez = 3\n")
    with pytest.raises(ConfigError, match="unknown federation key.*num-supernodes"):
        load_scenario(bad)
    bad.write_text("[runconfig]\n")
    with pytest.raises(ConfigError, match="unknown table"):
        load_scenario(bad)
    bad.write_text("[federation]\nnum-supernodes = 0\n")
    with pytest.raises(ConfigError, match="num-supernodes"):
        load_scenario(bad)


@pytest.mark.parametrize(
    ("federation", "match"),
    [
        (
            {"client-resources-num-cpus": "lots"},
            r"'client-resources-num-cpus' = 'lots': must be an integer in \[1, 4,096\]",
        ),
        ({"client-resources-num-cpus": 1.0}, "must be an integer"),
        ({"num-supernodes": 0}, "'num-supernodes' = 0"),
        ({"client-resources-num-gpus": -1}, r"must be a number in \[0, 1,024\]"),
        ({"client-resources-num-gpus": float("inf")}, r"= inf: must be a number in \[0, 1,024\]"),
        ({"num-supernodes": 10**9}, r"= 1000000000: must be an integer in \[1, 100,000\]"),
        ({"verbose": "yes"}, "must be true or false"),
        ({"backend": "dask"}, "must be ray"),
        ({"init-args-num-cpus": 2, "client-resources-num-cpus": 4}, "no ClientApp could ever run"),
    ],
)
def test_bad_federation_values_are_named(federation: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_federation({"num-supernodes": 2, **federation})


def test_bad_federation_value_fails_before_any_process(capsys) -> None:
    code = cli_main(
        [
            "run",
            str(ROOT / "scenarios" / "fedavg.toml"),
            "--quiet",
            "--set",
            'federation.client-resources-num-cpus="lots"',
        ]  # fmt: skip
    )
    assert code == 2
    assert "'client-resources-num-cpus' = 'lots'" in capsys.readouterr().err


def test_missing_data_fails_before_flower_starts(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    marker = tmp_path / "tmp"
    marker.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(marker))
    code = cli_main(
        [
            "run",
            str(ROOT / "scenarios" / "fedavg.toml"),
            "--quiet",
            "--set",
            "dataset=pneumonia",
            "--set",
            f"data-dir={tmp_path / 'nothing-here'}",
            "--set",
            f"output-dir={tmp_path / 'runs'}",
        ]  # fmt: skip
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "data set 'pneumonia' not found" in err and "nothing-here" in err
    assert not processes_with_env(f"FLWR_HOME={marker}"), "a Flower process was started"


# What `flwr run --stream` shows when the ServerApp raises (Flower 1.42, trimmed): first a
# ClientApp's error, which the engine turned into an error reply (not the cause), then the
# ServerApp's exception as Flower logs it when the run ends.
FAILED_STREAM = """\
INFO :      Starting Flower Simulation
ERROR :     An exception was raised when processing a message by RayBackend
ERROR :     Traceback (most recent call last):
  File "/v/flwr/simulation/ray_transport/ray_actor.py", line 60, in run
    out_message = app(message=message, context=context)
ValueError: a ClientApp's own trouble
ERROR :     Simulation raised an exception
Traceback (most recent call last):
  File "/v/flwr/simulation/app.py", line 337, in run_simulation_process
    simulation_result = _run_simulation(
                        ^^^^^^^^^^^^^^^^
  File "/a/edgefleet/server/app.py", line 289, in main
    ckpt = resume_from(run_dir, strategy, list(central.initial))
  File "/a/edgefleet/server/checkpoint.py", line 65, in load_checkpoint
    raise CheckpointError(f"checkpoint {path} is unreadable ({err})") from None
edgefleet.server.checkpoint.CheckpointError: checkpoint /r/x/checkpoint.pkl is unreadable (bad)
ERROR :     Exit Code: 700

An unhandled exception occurred when running the simulation.
"""

# The same cause, re-raised by Flower with a wrapper of its own.
CHAINED = FAILED_STREAM.replace(
    "ERROR :     Exit Code: 700",
    """
The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/v/flwr/simulation/run_simulation.py", line 347, in _main_loop
    raise RuntimeError("An error was encountered. Ending simulation.") from ex
RuntimeError: An error was encountered. Ending simulation.""",
)


@pytest.mark.parametrize("log", [FAILED_STREAM, CHAINED])
def test_serverapp_error_is_the_exception_that_ended_the_run(log: str) -> None:
    cause = serverapp_error(log)
    assert cause is not None
    lines = cause.splitlines()
    assert lines[0].startswith("edgefleet.server.checkpoint.CheckpointError: checkpoint")
    assert "unreadable" in lines[0]
    assert lines[-1].strip().startswith('File "/a/edgefleet/server/checkpoint.py"')
    assert "Ending simulation" not in cause and "ClientApp's own" not in cause
    assert serverapp_error("INFO : all fine\n") is None


def test_resume_hint_names_the_run_and_keeps_the_overrides(tmp_path: Path) -> None:
    sets = ["lr=0.1", "run-name=old", f"output-dir={tmp_path}"]  # output-dir: named once
    hint = resume_hint("scenarios/default.toml", tmp_path / "r1", sets)
    assert hint == (
        f"edgefleet run scenarios/default.toml --set lr=0.1 --set run-name=r1 "
        f"--set output-dir={tmp_path} --resume"
    )


def test_nested_tables_flatten_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text("[run-config]\nlr = 0.1\n[run-config.energy]\ncapacity = 5\n")
    sc = load_scenario(path, {"lr": 0.2, "federation.num-supernodes": 4})
    assert sc.run_config == {"lr": 0.2, "energy.capacity": 5}
    assert sc.federation == {"num-supernodes": 4}


def test_parse_value() -> None:
    assert parse_value("0.5") == 0.5
    assert parse_value("3") == 3
    assert parse_value("true") is True
    assert parse_value("'x'") == "x"
    assert parse_value("mnist") == "mnist"


def test_cli_usage() -> None:
    assert subprocess.run([sys.executable, "-m", "edgefleet.cli"]).returncode == 2


@pytest.mark.timeout(300)
def test_data_free_stopping_ends_run_early(tmp_path: Path) -> None:
    # A loose threshold so that a short run plateaus: the rule, not the budget, ends it.
    scenario = load_scenario(
        ROOT / "scenarios" / "fedavg.toml",
        {
            "federation.num-supernodes": 2,
            "num-server-rounds": 12,
            "local-steps": 5,
            "lr": 0.01,
            "stopping.mode": "data-free",
            "stopping.tau": 0.3,
            "stopping.patience": 2,
            "output-dir": str(tmp_path),
            "run-name": "stop",
        },
    )
    run_dir = run_scenario(scenario, timeout=240, quiet=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "task-vector-plateau"
    assert 3 <= summary["stop_round"] < 12
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == summary["stop_round"] == summary["rounds_run"]
    assert rows[0]["task_vector_growth"] is None
    assert all(r["task_vector_growth"] < 0.3 for r in rows[-2:])


@pytest.mark.timeout(300)
def test_eh_fedsag_scenario_selects_within_energy(tmp_path: Path) -> None:
    scenario = load_scenario(
        ROOT / "scenarios" / "eh-fedsag.toml",
        {
            "federation.num-supernodes": 6,
            "num-server-rounds": 4,
            "local-steps": 3,
            "selection.max-devices": 2,
            "selection.batch-size": 3,
            "energy.capacity": 4.0,  # exactly one round: a device must recharge in between
            "output-dir": str(tmp_path),
            "run-name": "ehsag",
        },
    )
    run_dir = run_scenario(scenario, timeout=240, quiet=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert 1 <= len(row["participants"]) <= 2
        assert row["energy_spent"] == 4.0 * len(row["participants"])
        assert row["status_queries"] >= 2
    # with a one-round battery nobody trains twice in a row before recharging enough
    # (P_h <= 0.6 over 4 slots gives at most 4 units only rarely): most rounds change hands
    changes = sum(rows[i]["participants"] != rows[i + 1]["participants"] for i in range(3))
    assert changes >= 2


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not (ROOT.parent / "shared" / "data" / "bccd_cells_28.npz").exists(),
    reason="needs ../shared/data/bccd_cells_28.npz",
)
def test_runner_finds_shared_data_without_data_dir(tmp_path: Path, monkeypatch) -> None:
    """The apps run from a temporary folder; ../shared/data is taken from where the command
    was typed."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("EDGEFLEET_DATA_DIR", raising=False)
    overrides = {
        "federation.num-supernodes": 2,
        "num-server-rounds": 1,
        "dataset": "bccd",
        "local-steps": 2,
        "output-dir": str(tmp_path),
        "run-name": "bccd",
    }
    run_dir = run_scenario(load_scenario(ROOT / "scenarios" / "fedavg.toml", overrides), quiet=True)
    assert json.loads((run_dir / "summary.json").read_text())["final_accuracy"] > 0.3


@pytest.mark.timeout(300)
def test_a_serverapp_failure_reaches_the_user(tmp_path: Path, capsys) -> None:
    """The ServerApp's own error is what the command prints, never "exit code 0";
    flower.log keeps the ServerApp's log. Here: a checkpoint of this very config (so the
    command's own resume check passes) holding another model, which only the ServerApp,
    building the model, can tell."""
    run_dir = tmp_path / "broken"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n')
    overrides = {"output-dir": str(tmp_path), "run-name": "broken", "resume": True}
    scenario = load_scenario(ROOT / "scenarios" / "fedavg.toml", overrides)
    cfg, _ = resolve_run_config(scenario)
    save_checkpoint(
        run_dir / FILENAME,
        Checkpoint(1, {"w": np.zeros(3, np.float32)}, {}, random.getstate(), {}, run_identity(cfg)),
    )
    code = cli_main(
        [
            "run",
            str(ROOT / "scenarios" / "fedavg.toml"),
            "--quiet",
            "--resume",
            "--set",
            "federation.num-supernodes=2",
            "--set",
            f"output-dir={tmp_path}",
            "--set",
            "run-name=broken",
            "--timeout",
            "240",
        ]  # fmt: skip
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert "CheckpointError" in err and "another model" in err, err
    assert "exit code 0" not in err
    log = (run_dir / "flower.log").read_text()
    assert "===== ServerApp" in log and "CheckpointError" in log
    assert "===== SuperLink" in log


def _start_run(tmp_path: Path, name: str, rounds: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "edgefleet.cli", "run", str(ROOT / "scenarios" / "fedavg.toml"),
         "--quiet", "--set", "federation.num-supernodes=2", "--set", f"num-server-rounds={rounds}",
         "--set", "local-steps=2", "--set", f"output-dir={tmp_path}", "--set", f"run-name={name}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
        # A shell starts background commands with SIGINT ignored, and children inherit that:
        # under such a CI script the run would not see the test's Ctrl-C at all.
        preexec_fn=_default_sigint,
    )  # fmt: skip


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_rows(path: Path, n: int, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no {n} rows in {path} (exit {proc.poll()}): {proc.communicate()[1][-2000:]}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_stops_everything_and_says_how_to_resume(
    tmp_path: Path, sig: signal.Signals
) -> None:
    (tmp_path / "tmp").mkdir()
    proc = _start_run(tmp_path, "cut", rounds=40)
    _wait_for_rows(tmp_path / "cut" / "metrics.jsonl", 1, proc, timeout=400)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "resume with: edgefleet run" in lines[0] and "--set run-name=cut" in lines[0]
    left = processes_with_env(f"TMPDIR={tmp_path / 'tmp'}")
    assert not left, f"processes outlived the interrupted run: {left}"
    assert not (tmp_path / "cut" / "writer.lock").exists()  # a clean stop leaves no lock
    if sig == signal.SIGINT:  # the hinted command continues the run to its end
        metrics = tmp_path / "cut" / "metrics.jsonl"
        done = len(metrics.read_text().splitlines())
        hint = lines[0].split("resume with: ", 1)[1].split()
        assert hint[:2] == ["edgefleet", "run"]
        code = cli_main(
            [*hint[1:], "--quiet", "--set", f"num-server-rounds={done + 2}",
             "--set", "resume-changes=num-server-rounds"]
        )  # fmt: skip
        assert code == 0
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        assert [r["round"] for r in rows] == list(range(1, done + 3))
