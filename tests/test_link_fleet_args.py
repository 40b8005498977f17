"""``benchmarks/perf/link_fleet.py`` refuses a bad setting before it starts a fleet, and its
variants and summary figures (no root needed, no processes but the refusals')."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--set", "nokey=1"], "unknown run-config key 'nokey'"),
        (["--set", "saga.correction=nope"], "must be one of channels, participants"),
        (["--set", "saga.correction"], "expected KEY=VALUE"),
        (["--strategy", "nope"], "--strategy: unknown ['nope']; valid: fedavg"),
    ],
)
def test_a_bad_setting_is_refused_before_any_fleet(args: list[str], says: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.link_fleet", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr
    assert "link_fleet:" not in proc.stdout + proc.stderr.replace("link_fleet.py:", "")


def _module() -> Any:
    from benchmarks.perf import link_fleet

    return link_fleet


lf = _module()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--aggregation", "sync,later"], "--aggregation: unknown ['later']; valid: sync, async"),
        (["--variants", "sync,fast"], "unknown word 'fast'; valid: none, deadline, sync, async"),
        (["--variants", "async,async"], "'async' is given twice"),
        (["--variants", "deadline+async"], "does not yet support selection.deadline = 20.0"),
        (["--set", "async.buffer-size=0"], "'async.buffer-size' = 0: must be >= 1"),
        (["--baseline", "/nonexistent.json"], "--baseline /nonexistent.json: not a link_fleet"),
    ],
)
def test_a_bad_async_setting_is_refused_in_process(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        lf.main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err
    assert "link_fleet:" not in err.replace("link_fleet.py:", "")


def test_variants_are_the_axes_product_unless_named() -> None:
    V = lf.Variant
    product = lf.parse_variants("", ["fedavg"], ["none", "deadline"], ["sync", "async"])
    assert product == [
        V("none", "fedavg", "sync"),
        V("none", "fedavg", "async"),
        V("deadline", "fedavg", "sync"),
        V("deadline", "fedavg", "async"),
    ]
    named = lf.parse_variants(
        "sync, deadline,fedsag+deadline,async", ["fedavg"], ["none"], ["sync"]
    )
    assert named == [
        V(),
        V(selection="deadline"),
        V("deadline", "fedsag", "sync"),
        V(aggregation="async"),
    ]
    # names: the first strategy is the baseline's and is not spelt out
    assert [v.suffix("fedavg") for v in named] == ["", "-deadline", "-deadline-fedsag", "-async"]
    assert V("none", "fedsag", "async").suffix("fedsag") == "-async"
    assert lf._parts("quarter-cellular-full-deadline-fedsag") == [
        "quarter-cellular", "full", "deadline", "fedsag",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("rounds", "nodes", "k", "versions"), [(8, 4, 2, 16), (8, 4, 3, 11), (3, 4, 5, 3), (1, 1, 1, 1)]
)
def test_async_versions_match_the_sync_runs_device_updates(
    rounds: int, nodes: int, k: int, versions: int
) -> None:
    assert lf.async_versions(rounds, nodes, k) == versions


def test_accuracy_at_budget_is_the_last_evaluated_row_within_it() -> None:
    walls = [5.0, 9.0, 12.0, 20.0]
    acc = [0.5, None, 0.7, 0.8]
    assert lf.accuracy_at(walls, acc, 12.0) == 0.7  # a row exactly at the budget counts
    assert lf.accuracy_at(walls, acc, 11.9) == 0.5  # the unevaluated row at 9 s is skipped
    assert lf.accuracy_at(walls, acc, 100.0) == 0.8
    assert lf.accuracy_at(walls, acc, 4.0) is None


def _run(walls: list[float], acc: list[float], to_target: float | None) -> dict[str, Any]:
    return {
        "row_wall_s": walls,
        "run_s": walls[-1],
        "accuracy": acc,
        "seconds_to_target": to_target,
    }


def test_ratios_compare_every_run_with_the_all_fast_sync_run_at_its_wall_time() -> None:
    results = {
        "all-fast-full": _run([10.0, 20.0, 30.0], [0.6, 0.75, 0.80], 20.0),
        "half-wifi-full": _run([20.0, 40.0, 60.0], [0.6, 0.75, 0.80], 40.0),
        "half-wifi-full-async": _run([5.0, 10.0, 25.0, 31.0], [0.5, 0.72, 0.795, 0.9], 10.0),
        "half-wifi-full-deadline": _run([8.0, 16.0, 24.0], [0.6, 0.71, 0.78], 16.0),
    }
    r = lf.ratios(results)
    assert r["all-fast-full"]["time_to_target_vs_all_fast"] == 1.0
    assert r["all-fast-full"]["accuracy_at_budget_minus_all_fast"] == 0.0
    sync = r["half-wifi-full"]
    assert (sync["budget_s"], sync["time_to_target_vs_all_fast"]) == (30.0, 2.0)
    assert sync["accuracy_at_budget"] == 0.6  # the row at 20 s; the one at 40 s is past 30 s
    assert sync["accuracy_at_budget_minus_all_fast"] == pytest.approx(-0.2)
    assert (sync["meets_time"], sync["meets_accuracy"]) == (False, False)
    a = r["half-wifi-full-async"]
    assert a["time_to_target_vs_all_fast"] == 0.5
    assert a["accuracy_at_budget"] == 0.795  # 31 s is past the budget: its 0.9 does not count
    assert a["accuracy_at_budget_minus_all_fast"] == pytest.approx(-0.005)
    assert (a["meets_time"], a["meets_accuracy"]) == (True, True)
    d = r["half-wifi-full-deadline"]
    assert d["accuracy_at_budget_minus_all_fast"] == pytest.approx(-0.02)
    assert (d["meets_time"], d["meets_accuracy"]) == (True, False)
    assert d["final_accuracy_minus_no_deadline"] == pytest.approx(-0.02)
    # without the all-fast sync run nothing is compared
    alone = lf.ratios({"half-wifi-full-async": results["half-wifi-full-async"]})
    assert alone["half-wifi-full-async"]["time_to_target_vs_all_fast"] is None
    assert alone["half-wifi-full-async"]["meets_accuracy"] is False
    # ... unless another file's all-fast sync run is given as the baseline
    swept = lf.ratios(
        {"half-wifi-full-async": results["half-wifi-full-async"]},
        {"all-fast-full": results["all-fast-full"]},
    )
    no_same_mix = {**a, "final_accuracy_minus_no_deadline": None}  # half-wifi-full not run
    assert swept["half-wifi-full-async"] == no_same_mix


def test_staleness_and_idle_summaries() -> None:
    rows = [
        {"staleness_min": 0, "staleness_median": 0.5, "staleness_max": 1, "in_flight": 3},
        {"staleness_min": 1, "staleness_median": 2.0, "staleness_max": 4, "in_flight": 2},
        {"staleness_min": 0, "staleness_median": 1.0, "staleness_max": 2, "in_flight": 4},
    ]
    st = lf.staleness(rows)
    assert st["per_version"] == [[0, 0.5, 1], [1, 2.0, 4], [0, 1.0, 2]]
    assert (st["min"], st["median"], st["max"]) == (0, 1.0, 4)
    assert st["in_flight"] == [3, 2, 4]
    assert lf.staleness([{"round": 1}]) is None  # a synchronous run's rows
    links = {
        "1": {"timed_rounds": 8, "round_s": 2.5},  # 20 s busy of 40
        "0": {"timed_rounds": 4, "round_s": 12.5},  # 50 s "busy": no negative idle
        "2": None,  # never timed: left out
    }
    idle = lf.device_idle(links, 40.0)
    assert idle["idle_s"] == {"0": 0.0, "1": 20.0}
    assert idle["idle_share"] == 0.25
    assert lf.device_idle({}, 40.0) == {"idle_s": {}, "idle_share": None}


@pytest.mark.parametrize(
    "module", ["benchmarks.claims.fedsag_claims", "benchmarks.claims.attack_grid"]
)
def test_the_shared_set_option_refuses_a_misspelt_key_before_any_run(module: str) -> None:
    """``--set`` is benchmarks/lib/overrides.py's in every benchmark that takes it."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--smoke", "--set", "saga.corection=channels"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown run-config key 'saga.corection'; did you mean 'saga.correction'" in (
        proc.stderr
    )
