"""The claims benchmarks' learning-rate options (``benchmarks/lib/lrsweep.py``, used by
``fedsag_claims`` and ``pruning_claims``): ``--lrs`` (every variant at each lr),
``--variant-lr VARIANT=LR`` (each variant at its pick) and the rule that picks (no runs: the
parsing and the choice are pure functions); and ``fedsag_claims``' figures and early stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.lib import lrsweep as lw

ROOT = Path(__file__).resolve().parents[1]


def _fedsag_claims() -> Any:
    from benchmarks.claims import fedsag_claims

    return fedsag_claims


fc = _fedsag_claims()


def test_lrs_parse_and_bad_ones_are_named() -> None:
    assert lw.parse_lrs("0.01, 0.03,0.1") == [0.01, 0.03, 0.1]
    for text, why in (
        ("0.01,x", "'x' is not a number"),
        ("0.01,0", "'0' must be a finite number > 0"),
        ("-0.1", "'-0.1' must be"),
        ("nan", "'nan' must be"),
        ("0.1,0.10", "'0.10' given twice"),
        ("0.1,", "'' is not a number"),
    ):
        with pytest.raises(ValueError, match=f"--lrs: {why}"):
            lw.parse_lrs(text)


def test_variant_lrs_parse_against_the_variants_run() -> None:
    variants = ["fedavg", "mifa"]
    got = lw.parse_variant_lrs(["fedavg=0.03", " mifa = 0.1 "], variants)
    assert got == {"fedavg": 0.03, "mifa": 0.1}
    for items, why in (
        (["fedavg"], "expected VARIANT=LR"),
        (["scaffold=0.1"], r"'scaffold' is not among --variants \(fedavg, mifa\)"),
        (["fedavg=0.1", "fedavg=0.03"], "fedavg given twice"),
        (["fedavg=0"], "must be a finite number > 0"),
        (["fedavg=0.1,0.03"], "one lr per variant"),
    ):
        with pytest.raises(ValueError, match=why):
            lw.parse_variant_lrs(items, variants)


def test_arms_name_each_run_by_its_lr_when_lrs_are_given() -> None:
    # No lr option: the names and labels of the runs written before the options existed.
    assert lw.arms(["fedavg", "mifa"], [], {}, 0.05) == [
        ("fedavg", "fedavg", 0.05, False),
        ("mifa", "mifa", 0.05, False),
    ]
    assert lw.arms(["fedavg"], [0.01, 0.1], {}, 0.05) == [
        ("fedavg@lr0.01", "fedavg", 0.01, True),
        ("fedavg@lr0.1", "fedavg", 0.1, True),
    ]
    # Each variant at its pick: the label is the variant, the run name carries the lr, so a
    # sweep's run of the same seed and lr is reused.
    assert lw.arms(["fedavg", "mifa"], [], {"mifa": 0.1}, 0.05) == [
        ("fedavg", "fedavg", 0.05, True),
        ("mifa", "mifa", 0.1, True),
    ]
    with pytest.raises(ValueError, match="give one"):
        lw.arms(["fedavg"], [0.1], {"fedavg": 0.1}, 0.05)


def test_the_sweep_picks_the_best_last_rounds_mean_and_the_smaller_lr_on_a_tie() -> None:
    arm_list = lw.arms(["fedavg", "mifa"], [0.01, 0.03, 0.1], {}, 0.05)
    last = {
        "fedavg@lr0.01": 0.5,
        "fedavg@lr0.03": 0.7,
        "fedavg@lr0.1": 0.1,
        "mifa@lr0.01": 0.8,
        "mifa@lr0.03": 0.6,
        "mifa@lr0.1": 0.8,
    }
    row = {label: {"last_accuracy": x, "seeds_stopped": 0} for label, x in last.items()}
    assert lw.choose_lrs(row, arm_list) == {"fedavg": 0.03, "mifa": 0.01}
    # A run that stopped early (every reply rejected) is not picked, however its last rounds
    # before the stop read; when every lr stopped, the rule falls back to the accuracy.
    row["fedavg@lr0.03"]["seeds_stopped"] = 1
    assert lw.choose_lrs(row, arm_list)["fedavg"] == 0.01
    for lr in ("0.01", "0.1"):
        row[f"fedavg@lr{lr}"]["seeds_stopped"] = 1
    assert lw.choose_lrs(row, arm_list)["fedavg"] == 0.03


def test_figures_report_the_last_rounds_mean_the_rule_reads() -> None:
    rows = [
        {"round": r, "test_accuracy": a, "test_loss": 1.0, "rejected": [], "participants": [1]}
        for r, a in enumerate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], start=1)
    ]
    fig = fc.figures(rows, 0.5)
    assert fig["final_accuracy"] == 0.7
    assert fig["last_accuracy"] == pytest.approx(0.5)  # rounds 3-7


def test_a_run_stopped_by_a_silent_fleet_is_a_result_and_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgefleet.simulation.engine import RunFailed

    args = fc.argparse.Namespace(
        rounds=60, dataset="mnist-5k", data_dir="", local_steps=2, lr=0.05, max_devices=2,
        batch_size=3, capacity=8.0, train_slots=3, eval_samples=200, devices=3,
        engine="inprocess", out=str(tmp_path),
    )  # fmt: skip
    calls = []

    def diverges(out: Path, name: str, *a: Any, **k: Any) -> Any:
        calls.append(name)
        (out / name).mkdir(parents=True, exist_ok=True)
        rows = [{"round": r, "test_accuracy": 0.1} for r in (1, 2)]
        (out / name / "metrics.jsonl").write_text("".join(fc.json.dumps(r) + "\n" for r in rows))
        raise RunFailed(f"run {name} failed: ...FleetSilent: no device took part in 3 rounds")

    monkeypatch.setattr(fc, "run_once", diverges)
    rows, stopped = fc._run(args, "x-lr0.1", {}, lr=0.1)
    assert [r["round"] for r in rows] == [1, 2] and "FleetSilent" in stopped
    again = fc._run(args, "x-lr0.1", {}, lr=0.1)
    assert again == (rows, stopped) and calls == ["x-lr0.1"]  # reused, not run again
    fc._run(args, "x-lr0.1", {}, lr=0.2)  # other settings: run again
    assert calls == ["x-lr0.1", "x-lr0.1"]

    def crashes(out: Path, name: str, *a: Any, **k: Any) -> Any:
        raise RunFailed(f"run {name} failed: ValueError: a bug")

    monkeypatch.setattr(fc, "run_once", crashes)  # any other failure is not a result
    with pytest.raises(RunFailed, match="a bug"):
        fc._run(args, "y", {}, lr=0.1)
