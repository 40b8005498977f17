"""Every claim benchmark runs as written: ``--smoke`` (the smallest sizes that still run its
whole path) as a subprocess, exactly one JSON line on stdout with the keys the docs and the
files under ``benchmarks/results/`` rely on, and verdicts that are computed from the figures
(a bool, or null/absent when nothing was run to judge them by, never a constant true).

Runs go to a tmp folder; a second call on the same ``--out`` reuses the finished runs, so the
"nothing to judge" cases cost a benchmark's start-up, not new runs. Also: the claims page's commands
that must configure what their rows say (FedSAG's harvest probability, CA-HFP's budget).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgefleet.client.device import DeviceProfile
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.simulation.runner import load_scenario, parse_value, resolve_run_config

ROOT = Path(__file__).resolve().parents[1]
# The claims page (docs/benchmarks/claims.md) renders each unmeasured claim's command.
README = (ROOT / "docs" / "benchmarks" / "claims.md").read_text()


def smoke(script: str, out: Path, *extra: str) -> dict[str, Any]:
    """Run ``python -m benchmarks.<group>.<script> --smoke --out out *extra``; its one JSON
    line."""
    (path,) = (ROOT / "benchmarks").glob(f"*/{script}.py")
    module = f"benchmarks.{path.parent.name}.{script}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", module, "--smoke", "--out", str(out)] + list(extra),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"{script} printed {len(lines)} lines on stdout:\n{proc.stdout}"
    line: dict[str, Any] = json.loads(lines[0])
    assert line["benchmark"] == script
    assert line["sizes"]["smoke"] is True
    assert isinstance(line["wall_s"], float)
    # benchmarks/lib/provenance.py: how the line was made, as benchmarks/results/ files need.
    assert line["command"].startswith(f"python -m {module} --smoke")
    if (ROOT / ".git").exists():
        assert isinstance(line["git_commit"], str) and isinstance(line["git_dirty"], bool)
    return line


def is_fraction(x: Any) -> bool:
    return isinstance(x, float | int) and not isinstance(x, bool) and 0.0 <= x <= 1.0


def test_warmstart_claims_smoke(tmp_path: Path) -> None:
    line = smoke("warmstart_claims", tmp_path)
    sizes = line["sizes"]
    assert (sizes["devices"], sizes["sessions"], sizes["rounds_per_session"]) == (2, 4, 2)
    assert sizes["engine"] == "inprocess" and sizes["modes"] == "pilot,previous,continuous"
    (setting,) = line["settings"]
    assert (setting["dataset"], setting["overlap"], setting["strategy"]) == (
        "mnist-5k",
        0,
        "fedavg",
    )
    for mode in ("pilot", "previous", "continuous"):
        m = setting["modes"][mode]
        assert m["post_pilot"]["sessions"] == [2, 3, 4]
        assert m["lookalike"]["sessions"] == [4]
        assert [e["session"] for e in m["sessions"]] == [1, 2, 3, 4]
        assert isinstance(m["post_pilot"]["rounds_to_target"], float)
    assert setting["modes"]["continuous"]["sessions"][-1]["teacher_downloads"] > 0
    for pair in ("previous/pilot", "continuous/pilot"):
        ratio = setting["ratios"][pair]["post_pilot"]["aux_counted"]
        assert isinstance(ratio, float)
    assert "0.1" in setting["at_other_targets"]
    assert Path(setting["plots"]).is_dir() and tmp_path in Path(setting["plots"]).parents
    # the verdict from the figures
    ratio = setting["ratios"]["previous/pilot"]["post_pilot"]["aux_counted"]
    assert line["target_10x_overlap0"] is (ratio >= 10)

    # No overlap-0 setting with pilot and previous: nothing to judge (the runs are reused).
    alone = smoke("warmstart_claims", tmp_path, "--modes", "pilot")
    assert alone["target_10x_overlap0"] is None


def test_fedsag_claims_smoke_runs_every_variant(tmp_path: Path) -> None:
    # Every variant: a variant's run-config keys are only checked when it runs (fedsag-seed
    # once named a key that does not exist).
    line = smoke("fedsag_claims", tmp_path)
    sizes = line["sizes"]
    assert sizes["variants"] == "fedavg,fedsag,fedsag-seed,fedsag-sag"
    assert (sizes["devices"], sizes["max_devices"], sizes["rounds"]) == (3, 2, 3)
    (setting,) = line["settings"]
    assert (setting["alpha"], setting["harvest_prob"]) == (1.0, 0.2)
    for variant in sizes["variants"].split(","):
        v = setting[variant]
        assert is_fraction(v["final_accuracy"])
        assert isinstance(v["late_variance_pp2"], float)
        assert v["seeds_finite"] in (0, 1)
        (seed,) = v["seeds"]
        assert isinstance(seed["finite"], bool) and seed["participants_per_round"] > 0
    check = setting["participants_check"]["0"]
    assert check["same_selection"] is (not check["first_differing_round"])
    assert setting["same_selection"] is check["same_selection"]

    # One variant has nothing to be compared with.
    alone = smoke("fedsag_claims", tmp_path, "--variants", "fedavg")
    assert alone["settings"][0]["same_selection"] is None
    assert alone["settings"][0]["participants_check"]["0"]["same_selection"] is None


def test_pruning_claims_smoke(tmp_path: Path) -> None:
    line = smoke("pruning_claims", tmp_path)
    sizes = line["sizes"]
    assert (sizes["devices"], sizes["rounds"], sizes["keep_ratios"]) == (2, 2, "1.0,0.5")
    assert sizes["budget"] == "parameters"
    (setting,) = line["settings"]
    for variant in ("full", "curvature"):
        v = setting[variant]
        for key in ("final_accuracy", "last3_accuracy", "kept_parameters"):
            assert is_fraction(v[key]), (variant, key, v[key])
        assert isinstance(v["bytes_up_per_round"], int) and v["bytes_up_per_round"] > 0
    assert setting["full"]["kept_parameters"] == 1.0
    # the device keeping 0.5 of the parameters: less than the full model kept and uploaded
    assert setting["curvature"]["kept_parameters"] < 1.0
    assert 0 < setting["curvature"]["upload_vs_full"] < 1.0


def test_earlystop_claims_smoke(tmp_path: Path) -> None:
    line = smoke("earlystop_claims", tmp_path)
    sizes = line["sizes"]
    assert (sizes["budget"], sizes["devices"], sizes["bad_lrs"]) == (4, 2, "5.0")
    (setting,) = line["settings"]
    (seed,) = setting["seeds"]
    for key in ("data_free_bacc", "reference_validation_bacc", "validation_bacc", "best_bacc"):
        assert is_fraction(seed[key])
    for key in ("gap_to_best_points", "gap_to_reference_points"):
        assert isinstance(seed[key], float | int)
    (bad,) = line["bad_configs"]
    assert bad["lr"] == 5.0
    targets = line["targets_met"]
    assert targets == {
        "stop_before_half_budget": (seed["data_free_stop"] or 4) < 2,
        "within_1.5_points_of_best": seed["gap_to_best_points"] <= 1.5,
        "within_1.5_points_of_reference_validation": seed["gap_to_reference_points"] <= 1.5,
        "bad_configs_stopped_within_30": bad["data_free_stop"] is not None
        and bad["data_free_stop"] <= 30,
    }
    assert all(isinstance(v, bool) for v in targets.values())
    assert all(Path(p).is_file() for p in line["plots"])

    # No bad configuration run (the claims page's command): that target is left out, not true.
    no_bad = smoke("earlystop_claims", tmp_path, "--bad-lrs", "")
    assert no_bad["bad_configs"] == []
    assert "bad_configs_stopped_within_30" not in no_bad["targets_met"]
    assert set(no_bad["targets_met"]) == set(targets) - {"bad_configs_stopped_within_30"}


def test_fault_campaign_smoke(tmp_path: Path) -> None:
    line = smoke("fault_campaign", tmp_path)
    sizes = line["sizes"]
    assert (sizes["devices"], sizes["rounds"], sizes["kinds"]) == (3, 3, "nan,noise")
    assert line["hostile_partitions"] == [2]
    assert line["set"] == {"local-steps": 2, "eval-samples": 200}
    for run in (line["clean"], *line["kinds"].values()):
        assert run["rounds_completed"] == 3
        assert isinstance(run["rejected"], int)
    nan = line["kinds"]["nan"]
    assert nan["rejected"] == 3 and "non-finite" in nan["first_reason"]
    assert isinstance(line["kinds"]["noise"]["accuracy_delta"], float)
    assert line["target_met"] is all(
        r["rounds_completed"] == 3 and r["accuracy_delta"] >= -0.02 for r in line["kinds"].values()
    )

    # No hostile kind run: nothing to judge.
    clean_only = smoke("fault_campaign", tmp_path, "--kinds", "")
    assert clean_only["kinds"] == {} and clean_only["target_met"] is None


def test_attack_grid_smoke(tmp_path: Path) -> None:
    line = smoke("attack_grid", tmp_path)
    sizes = line["sizes"]
    assert (sizes["devices"], sizes["rounds"], sizes["fleets"]) == (3, 2, "fedavg")
    assert (sizes["attacks"], sizes["defences"], sizes["fractions"]) == (
        "backdoor",
        "off,median",
        "0.2",
    )
    assert line["runs"] == {"new": 4, "reused": 0}
    assert line["recommend"] == {"fedavg": "median"}
    per = line["fleets"]["fedavg"]
    no_defence = per["off"]["clean_accuracy"]
    for defence in ("off", "median"):
        entry = per[defence]
        assert is_fraction(entry["clean_accuracy"])
        assert entry["clean_cost"] == pytest.approx(entry["clean_accuracy"] - no_defence, abs=1e-4)
        assert is_fraction(entry["clean_attack_success_rate"])
        cell = entry["attacks"]["backdoor"]["0.2"]
        assert cell["accuracy_delta"] == pytest.approx(
            cell["final_accuracy"] - entry["clean_accuracy"], abs=1e-4
        )
        assert is_fraction(cell["attack_success_rate"]) and cell["seeds"][0]["rounds_run"] == 2
        # the final model's success rate, kept beside the run for a reuse
        cached = json.loads(
            (tmp_path / f"fedavg-{defence}-backdoor-f0.2-s0" / "attack_success.json").read_text()
        )
        assert cached["attack_success_rate"] == cell["attack_success_rate"]
    median = per["median"]
    cell = median["attacks"]["backdoor"]["0.2"]
    # Per fleet (tests/test_attack_grid.py judges hand-made grids).
    verdict = line["verdicts"]["fedavg"]
    targets = {
        "attacks_within_5_points": cell["accuracy_delta"] >= -0.05,
        "backdoor_success_under_10pct": cell["attack_success_rate"] < 0.10,
        "clean_cost_within_1_point": median["clean_cost"] >= -0.01,
    }
    assert verdict["rule"] == "median"
    assert verdict["targets"] == verdict["targets_by_defence"]["median"] == targets
    assert verdict["met"] is all(targets.values())
    assert verdict["worst_attack"] == {
        "attack": "backdoor",
        "accuracy_delta": cell["accuracy_delta"],
    }
    # Median is the one rule offered: the backdoor beats it unless it holds both targets.
    holds = targets["attacks_within_5_points"] and targets["backdoor_success_under_10pct"]
    figures = {"median": {k: cell[k] for k in ("accuracy_delta", "attack_success_rate")}}
    assert verdict["beaten_at_0.2"] == ({} if holds else {"backdoor": figures})
    # No defence costs nothing by definition: nothing to judge.
    assert verdict["targets_by_defence"]["off"]["clean_cost_within_1_point"] is None


def test_straggler_fleet_smoke(tmp_path: Path) -> None:
    line = smoke("straggler_fleet", tmp_path)
    assert (line["sizes"]["devices"], line["sizes"]["cohort"]) == (6, 3)
    assert line["fleet"]["compute"]["dist"] == "lognormal"
    runs = {r["method"]: r for r in line["runs"]}
    assert set(runs) == {"sync", "deadline", "async"}
    # Virtual time: a synchronous round lasts as long as its slowest reply, so the fleet's
    # time is at least one round of its fastest device, and the deadline cuts nothing early.
    for run in runs.values():
        assert run["curve"] and all(t > 0 for t, _ in run["curve"])
    assert runs["deadline"]["deadline_s"] == line["deadline_s"]["0"] > 0
    assert runs["async"]["staleness"]["max"] >= 0
    ratio = line["ratio_async_over_sync"]["per_seed"].get("0")
    if runs["sync"]["reached"] and runs["async"]["reached"]:
        want = runs["async"]["time_to_target_s"] / runs["sync"]["time_to_target_s"]
        assert ratio == pytest.approx(want, abs=1e-3)
        assert line["async_at_most_half_sync"] is (ratio <= 0.5)
    else:
        assert ratio is None and line["async_at_most_half_sync"] is None


# -- claims-page commands that must configure what their rows measured --------------------


def _command(paper: str) -> str:
    """The claims page's command for a claim (benchmarks/claims/table.py renders it there)."""
    from benchmarks.claims import table as claims

    (command,) = [u.command for u in claims.UNMEASURED if u.paper == paper]
    assert f"`{command}`" in README, paper
    return str(command)


def test_readme_fedsag_mnist_command_harvests_at_the_rows_probability(tmp_path: Path) -> None:
    args = shlex.split(_command("EH-FedSAG (arXiv 2606.18758)"))
    assert args[:3] == ["edgefleet", "run", "scenarios/eh-fedsag.toml"]
    # Each `KEY=VALUE` of the command as the shell hands it to `--set`.
    items = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        overrides[key] = parse_value(value)
    assert overrides["energy.harvest-prob"] == 0.05
    overrides["output-dir"] = str(tmp_path)
    scenario = load_scenario(ROOT / "scenarios" / "eh-fedsag.toml", overrides)
    cfg, _ = resolve_run_config(scenario)
    devices = scenario.federation["num-supernodes"]
    assert devices == 50
    probs = {
        DeviceProfile.from_configs({"partition-id": i, "num-partitions": devices}, cfg).harvest_prob
        for i in range(devices)
    }
    assert probs == {0.05}


def test_harvest_prob_beside_a_per_device_list_is_refused() -> None:
    # The scenario's list would silently win over the single probability.
    with pytest.raises(ConfigError, match=r"energy\.harvest-probs = \"\""):
        parse_run_config({"energy.harvest-prob": 0.05, "energy.harvest-probs": "0.1,0.3,0.6"})
    assert parse_run_config({"energy.harvest-prob": 0.05}).energy.harvest_prob == 0.05
    listed = parse_run_config({"energy.harvest-probs": "0.1,0.3,0.6"}).energy
    assert listed.harvest_probs == (0.1, 0.3, 0.6)
    # The claims page's command without clearing the list: refused before any work.
    scenario = load_scenario(ROOT / "scenarios" / "eh-fedsag.toml", {"energy.harvest-prob": 0.05})
    with pytest.raises(ConfigError, match="harvest-prob"):
        resolve_run_config(scenario)


def test_readme_ca_hfp_mnist_command_uses_the_budget_it_was_measured_with() -> None:
    # The MNIST figures were measured before pruning.budget existed, when a keep ratio meant
    # a share of channels, with five variants (commit 594822c made parameters the default).
    args = shlex.split(_command("CA-HFP (arXiv 2603.12591)"))
    assert args[:3] == ["python", "-m", "benchmarks.claims.pruning_claims"]
    assert args[args.index("--budget") + 1] == "channels"
    variants = args[args.index("--variants") + 1].split(",")
    assert variants == ["full", "curvature", "magnitude", "random", "no-reconstruction"]
