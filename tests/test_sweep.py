"""Sweeps: grid parsing, run names, skipping finished runs, resuming a killed one, and the
report's mean and spread over seeds. The engine is a stand-in that writes run folders the
way the ServerApp does (the real one is exercised by tests/test_simulation.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edgefleet.cli import main as cli_main
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.simulation import sweep as sweep_mod
from edgefleet.simulation.report import group_figures, group_runs, load_run
from edgefleet.simulation.runner import Interrupted, Scenario, resolve_run_config
from edgefleet.simulation.sweep import (
    Point,
    Sweep,
    grid_points,
    parse_grid,
    parse_seeds,
    run_name,
)

ROOT = Path(__file__).resolve().parents[1]


def test_parse_grid_and_points() -> None:
    grid = parse_grid(
        ["alpha=0.1,1.0", "strategy=fedavg,fedsag", 'pruning.keep-ratios=["1,0.5","1"]']
    )
    assert grid == {
        "alpha": [0.1, 1.0],
        "strategy": ["fedavg", "fedsag"],
        "pruning.keep-ratios": ["1,0.5", "1"],
    }
    points = grid_points({"alpha": [0.1, 1.0], "federation.num-supernodes": [4]})
    assert [p.name for p in points] == [
        "alpha=0.1,federation.num-supernodes=4",
        "alpha=1,federation.num-supernodes=4",
    ]
    assert points[1].overrides == {"alpha": 1.0, "federation.num-supernodes": 4}
    assert grid_points({}) == [Point("base", {})]
    assert run_name(Point("keep=1/2"), 3) == "keep=1_2,seed=3"
    assert parse_seeds("0,1,2") == [0, 1, 2]


@pytest.mark.parametrize(
    ("items", "match"),
    [(["alpha"], "expected KEY=V1"), (["seed=1,2"], "--seeds"), (["alpha=1,1"], "twice")],
)
def test_parse_grid_errors(items: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_grid(items)


@pytest.mark.parametrize("text", ["", "a,b", "1,1"])
def test_parse_seeds_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="--seeds"):
        parse_seeds(text)


class FakeEngine:
    """Writes what the ServerApp would: a row per round, a checkpoint, the summary. A run
    named in ``kill`` is interrupted after its second round (as Ctrl-C would)."""

    kill: set[str] = set()
    runs: list[tuple[str, bool]] = []  # (run name, resumed)
    started = 0

    def __init__(self, **kwargs: Any) -> None:
        FakeEngine.started += 1

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def alive(self) -> bool:
        return True

    def run(self, scenario: Scenario, **kwargs: Any) -> Path:
        cfg, raw = resolve_run_config(scenario)
        run_dir = Path(cfg.server.output_dir) / cfg.server.run_name
        run_dir.mkdir(parents=True, exist_ok=True)
        FakeEngine.runs.append((run_dir.name, cfg.server.resume))
        metrics = run_dir / "metrics.jsonl"
        done = len(metrics.read_text().splitlines()) if cfg.server.resume else 0
        # The accuracy depends on alpha and the seed, like a real run's would.
        base = 0.5 + 0.3 * cfg.data.alpha + 0.01 * cfg.seed
        with metrics.open("a" if cfg.server.resume else "w") as f:
            for rnd in range(done + 1, cfg.server.num_rounds + 1):
                row = {"round": rnd, "test_accuracy": base * rnd / cfg.server.num_rounds,
                       "bytes_up": 10, "bytes_down": 20, "energy_spent": 0.0,
                       "participants": ["0"], "wall_s": float(rnd)}  # fmt: skip
                f.write(json.dumps(row) + "\n")
                (run_dir / "checkpoint.pkl").write_text(str(rnd))
                if rnd == 2 and run_dir.name in FakeEngine.kill:
                    FakeEngine.kill.discard(run_dir.name)
                    raise Interrupted(run_dir, "SIGINT")
        summary = {"run_name": run_dir.name, "final_accuracy": base, "best_accuracy": base,
                   "rounds_run": cfg.server.num_rounds, "stop_reason": "budget",
                   "total_bytes_up": 10, "total_bytes_down": 20, "wall_s": 3.0,
                   "config": cfg.to_dict()}  # fmt: skip
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return run_dir


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> type[FakeEngine]:
    monkeypatch.setattr(sweep_mod, "Engine", FakeEngine)
    FakeEngine.kill, FakeEngine.runs, FakeEngine.started = set(), [], 0
    return FakeEngine


def _base(tmp_path: Path) -> Scenario:
    return Scenario(
        "fedavg",
        {"num-supernodes": 3},
        {"num-server-rounds": 4, "output-dir": str(tmp_path)},
    )


def test_sweep_runs_the_grid_skips_finished_runs_and_resumes_a_killed_one(
    tmp_path: Path, fake_engine: type[FakeEngine]
) -> None:
    points = grid_points({"alpha": [0.1, 1.0]})
    out = tmp_path / "sw"
    fake_engine.kill = {"alpha=1,seed=1"}
    sweep = Sweep(_base(tmp_path), points, [0, 1, 2], out)
    with pytest.raises(Interrupted):
        sweep.run()
    assert [name for name, _ in fake_engine.runs] == [
        "alpha=0.1,seed=0", "alpha=0.1,seed=1", "alpha=0.1,seed=2", "alpha=1,seed=0",
        "alpha=1,seed=1",
    ]  # fmt: skip
    # The same sweep again: the finished runs are skipped, the killed one continues from
    # its checkpoint, the rest runs.
    fake_engine.runs = []
    runs = Sweep(_base(tmp_path), points, [0, 1, 2], out).run()
    assert fake_engine.runs == [("alpha=1,seed=1", True), ("alpha=1,seed=2", False)]
    assert [r.status for r in runs] == ["done"] * 4 + ["resumed", "ran"]
    killed = load_run(out / "alpha=1,seed=1")
    assert [r["round"] for r in killed.rows] == [1, 2, 3, 4] and not killed.warnings
    assert fake_engine.started == 2  # one engine per sweep command, not per run
    # The report groups the seeds of each point: mean and spread.
    manifest = json.loads((out / sweep_mod.MANIFEST).read_text())
    dirs = [out / r["run"] for r in manifest["runs"]]
    assert [d.name for d in dirs][:2] == ["alpha=0.1,seed=0", "alpha=0.1,seed=1"]
    labels = {d.resolve(): d.name.rsplit(",seed=", 1)[0] for d in dirs}
    groups = group_runs([load_run(d) for d in dirs], labels)
    assert [g.label for g in groups] == ["alpha=0.1", "alpha=1"]
    fig = group_figures(groups[1])["final_accuracy"]
    assert fig["n"] == 3
    assert fig["mean"] == pytest.approx(0.8 + 0.01)
    assert fig["sd"] == pytest.approx(0.01)
    assert (fig["min"], fig["max"]) == (pytest.approx(0.8), pytest.approx(0.82))


def test_sweep_refuses_a_folder_of_another_sweep(
    tmp_path: Path, fake_engine: type[FakeEngine]
) -> None:
    out = tmp_path / "sw"
    Sweep(_base(tmp_path), grid_points({"alpha": [0.1]}), [0], out).run()
    other = _base(tmp_path)
    other.run_config["local-steps"] = 3
    with pytest.raises(ConfigError, match="another scenario or base config"):
        Sweep(other, grid_points({"alpha": [0.1]}), [0], out).run()
    # More seeds for the same sweep are fine: only the new run runs.
    fake_engine.runs = []
    Sweep(_base(tmp_path), grid_points({"alpha": [0.1]}), [0, 1], out).run()
    assert fake_engine.runs == [("alpha=0.1,seed=1", False)]


def test_a_bad_grid_value_fails_before_any_run(
    tmp_path: Path, fake_engine: type[FakeEngine]
) -> None:
    with pytest.raises(ConfigError, match="'alpha' = 0"):
        Sweep(_base(tmp_path), grid_points({"alpha": [1.0, 0.0]}), [0], tmp_path / "sw").run()
    assert fake_engine.runs == []


def test_sweep_command_prints_mean_and_spread(
    tmp_path: Path, fake_engine: type[FakeEngine], capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text("[federation]\nnum-supernodes = 3\n[run-config]\nnum-server-rounds = 3\n")
    code = cli_main(
        [
            "sweep",
            str(scenario),
            "--grid",
            "alpha=0.1,1.0",
            "--seeds",
            "0,1,2",
            "--quiet",
            "--set",
            f"output-dir={tmp_path / 'runs'}",
        ]  # fmt: skip
    )
    assert code == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("alpha=1 "))
    assert "0.8100 ± 0.0100" in line  # final accuracy over the three seeds
    report = tmp_path / "runs" / "s-sweep" / "report"
    assert (report / "accuracy.png").stat().st_size > 0


def test_finished_run_with_other_settings_is_an_error(
    tmp_path: Path, fake_engine: type[FakeEngine]
) -> None:
    out = tmp_path / "sw"
    Sweep(_base(tmp_path), grid_points({"alpha": [0.1]}), [0], out).run()
    summary = out / "alpha=0.1,seed=0" / "summary.json"
    data = json.loads(summary.read_text())
    data["config"]["lr"] = 0.5
    summary.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"other settings \(lr\)"):
        Sweep(_base(tmp_path), grid_points({"alpha": [0.1]}), [0], out).run()
    assert parse_run_config(data["config"]).train.lr == 0.5


def test_an_interrupted_sweep_command_says_the_same_command_resumes(
    tmp_path: Path, fake_engine: type[FakeEngine], capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text("[federation]\nnum-supernodes = 3\n[run-config]\nnum-server-rounds = 3\n")
    argv = ["sweep", str(scenario), "--grid", "alpha=0.1,1.0", "--seeds", "0", "--quiet",
            "--set", f"output-dir={tmp_path / 'runs'}"]  # fmt: skip
    fake_engine.kill = {"alpha=1,seed=0"}
    assert cli_main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the same command resumes the sweep" in err[0]
    assert "during alpha=1,seed=0" in err[0]
    assert cli_main(argv) == 0
    assert fake_engine.runs[-1] == ("alpha=1,seed=0", True)
