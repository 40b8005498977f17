"""``benchmarks/claims/attack_grid.py``'s judging, on hand-made grids (no runs): the verdicts
are per
fleet (one fleet's figures never judge another's rule), a target with nothing measured to
judge it is null, ``--recommend`` is checked before any run, and the committed results file
is judged the same way (its ``fleets`` reads as a new line's does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "attack_grid-mlp-f0.2-2026-12-03.json"
ATTACKS, BACKDOOR, COST = (
    "attacks_within_5_points",
    "backdoor_success_under_10pct",
    "clean_cost_within_1_point",
)


def _attack_grid() -> Any:
    from benchmarks.claims import attack_grid

    return attack_grid


ag = _attack_grid()


def entry(cost: float, **cells: dict[str, Any]) -> dict[str, Any]:
    return {"clean_cost": cost, "attacks": cells}


def grid() -> dict[str, Any]:
    """Three fleets: fedavg meets every target with median; cahfp's median fails two, which a
    pooled verdict would have charged to fedavg too; fedsag-energy ran only 0.1 attackers
    and no backdoor, so it has nothing at 0.2 to judge by."""
    return {
        "fedavg": {
            "off": entry(
                0.0,
                alie={"0.2": {"accuracy_delta": -0.3}},
                backdoor={"0.2": {"accuracy_delta": -0.002, "attack_success_rate": 1.0}},
            ),
            "median": entry(
                -0.004,
                alie={"0.2": {"accuracy_delta": -0.03}, "0.1": {"accuracy_delta": -0.2}},
                backdoor={"0.2": {"accuracy_delta": -0.01, "attack_success_rate": 0.04}},
            ),
            "trimmed-mean": entry(
                -0.02,
                alie={"0.2": {"accuracy_delta": -0.06}},
                backdoor={"0.2": {"accuracy_delta": -0.001, "attack_success_rate": 0.5}},
            ),
        },
        "cahfp": {
            "off": entry(0.0, alie={"0.2": {"accuracy_delta": -0.02}}),
            "median": entry(
                -0.013,
                alie={"0.2": {"accuracy_delta": -0.08}},
                ipm={"0.2": {"accuracy_delta": -0.01}},
                backdoor={"0.2": {"accuracy_delta": 0.0, "attack_success_rate": 0.07}},
            ),
            "multikrum": entry(
                0.002,
                alie={"0.2": {"accuracy_delta": -0.06}},
                ipm={"0.2": {"accuracy_delta": -0.09}},
                backdoor={"0.2": {"accuracy_delta": 0.0, "attack_success_rate": 1.0}},
            ),
        },
        "fedsag-energy": {
            "off": entry(0.0, alie={"0.1": {"accuracy_delta": -0.2}}),
            "median": entry(-0.19, alie={"0.1": {"accuracy_delta": 0.1}}),
        },
    }


def test_verdicts_are_per_fleet() -> None:
    v = ag.verdicts(grid(), {"fedavg": "median", "cahfp": "median", "fedsag-energy": "median"})
    assert set(v) == {"fedavg", "cahfp", "fedsag-energy"}

    fedavg = v["fedavg"]
    assert fedavg["rule"] == "median"
    # cahfp's -8 points and -1.3 points of clean cost do not reach fedavg's verdict.
    assert fedavg["targets"] == {ATTACKS: True, BACKDOOR: True, COST: True}
    assert fedavg["met"] is True
    # 0.1 attackers (-20 points) is not the target fraction.
    assert fedavg["worst_attack"] == {"attack": "alie", "accuracy_delta": -0.03}
    assert fedavg["targets_by_defence"] == {
        "off": {ATTACKS: False, BACKDOOR: False, COST: None},  # no defence: no clean cost
        "median": {ATTACKS: True, BACKDOOR: True, COST: True},
        "trimmed-mean": {ATTACKS: False, BACKDOOR: False, COST: False},
    }
    # alie is held by median; the backdoor by median (4 %): nothing beats every rule.
    assert fedavg["beaten_at_0.2"] == {}

    cahfp = v["cahfp"]
    assert cahfp["targets"] == {ATTACKS: False, BACKDOOR: True, COST: False}
    assert cahfp["met"] is False
    assert cahfp["worst_attack"] == {"attack": "alie", "accuracy_delta": -0.08}
    # alie costs more than 5 points under median and multikrum, with both figures; ipm is
    # held by median, the backdoor by median (7 %).
    assert cahfp["beaten_at_0.2"] == {
        "alie": {"median": {"accuracy_delta": -0.08}, "multikrum": {"accuracy_delta": -0.06}}
    }

    # Nothing at 0.2 on fedsag-energy: the attack and backdoor targets are null, not true;
    # only the clean cost (-19 points) is judged; so nothing is met, and no attack beats.
    sag = v["fedsag-energy"]
    assert sag["targets"] == {ATTACKS: None, BACKDOOR: None, COST: False}
    assert sag["met"] is False
    assert sag["worst_attack"] is None
    assert sag["beaten_at_0.2"] is None


def test_a_fleet_without_a_rule_or_a_figure_is_null_never_true() -> None:
    result = grid()
    # No rule recommended for cahfp: every target null, and so is met.
    v = ag.verdicts(result, {"fedavg": "median"})
    assert v["cahfp"]["rule"] is None
    assert v["cahfp"]["targets"] == {ATTACKS: None, BACKDOOR: None, COST: None}
    assert v["cahfp"]["met"] is None and v["cahfp"]["worst_attack"] is None
    # The attacks that beat every rule do not depend on the recommendation.
    assert list(v["cahfp"]["beaten_at_0.2"]) == ["alie"]
    # A fleet whose judged targets all hold but one is unjudged: met is null, not true.
    del result["fedavg"]["median"]["attacks"]["backdoor"]
    v = ag.verdicts(result, {"fedavg": "median"})
    assert v["fedavg"]["targets"] == {ATTACKS: True, BACKDOOR: None, COST: True}
    assert v["fedavg"]["met"] is None
    # A rule that was not run on the fleet: nothing to judge.
    assert set(ag.judge(result["fedavg"], "multikrum").values()) == {None}
    # With no rule but off run, nothing can beat "every rule".
    assert ag.beaten_by_every_rule({"off": result["fedavg"]["off"]}) is None


def test_the_backdoor_beats_a_rule_by_its_success() -> None:
    per = grid()["fedavg"]
    per["median"]["attacks"]["backdoor"]["0.2"]["attack_success_rate"] = 0.1
    beaten = ag.beaten_by_every_rule(per)
    assert beaten == {
        "backdoor": {
            "median": {"accuracy_delta": -0.01, "attack_success_rate": 0.1},
            "trimmed-mean": {"accuracy_delta": -0.001, "attack_success_rate": 0.5},
        }
    }
    assert ag.judge(per, "median")[BACKDOOR] is False


def test_parse_recommend() -> None:
    fleets, defences = ["fedavg", "cahfp", "fedsag-energy"], ["off", "median", "trimmed-mean"]
    assert ag.parse_recommend("", fleets, defences) == {}
    assert ag.parse_recommend("median", fleets, defences) == dict.fromkeys(fleets, "median")
    assert ag.parse_recommend(
        "fedavg=median, cahfp=median,fedsag-energy=trimmed-mean", fleets, defences
    ) == {"fedavg": "median", "cahfp": "median", "fedsag-energy": "trimmed-mean"}
    assert ag.parse_recommend("cahfp=median", fleets, defences) == {"cahfp": "median"}
    bad = {
        "krum": "unknown rule 'krum'",
        "fedavg=krum": "unknown rule 'krum' for fedavg",
        "multikrum": "'multikrum' for fedavg is not among --defences",
        "fleet=median": "unknown fleet 'fleet'",
        "fedavg=median,median": "expected FLEET=RULE",
        "fedavg=median,fedavg=off": "fleet 'fedavg' named twice",
    }
    for text, why in bad.items():
        with pytest.raises(ValueError, match=why) as err:
            ag.parse_recommend(text, fleets, defences)
        # Every refusal names the valid fleets and rules.
        assert "fleets run: fedavg, cahfp, fedsag-energy" in str(err.value)
        assert "median, trimmed-mean" in str(err.value)
    with pytest.raises(ValueError, match="fleet 'cahfp' is not run"):
        ag.parse_recommend("cahfp=median", ["fedavg"], defences)


def test_a_bad_recommend_stops_before_any_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.claims.attack_grid", "--smoke"]
        + ["--out", str(tmp_path / "out"), "--recommend", "cahfp=median"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "fleet 'cahfp' is not run; " in proc.stderr
    assert "fleets run: fedavg; rules run (--defences): off, median" in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out").exists()


def test_the_committed_grid_judged_per_fleet() -> None:
    """The docs' recommendation (docs/how-to/robust-aggregation.md: median on FedAvg and
    CA-HFP fleets, none for FedSAG under energy-age selection) against the committed grid: its
    ``fleets`` is what a new line's is."""
    line = json.loads(RESULTS.read_text())
    v = ag.verdicts(line["fleets"], {"fedavg": "median", "cahfp": "median"})
    assert v["fedavg"]["targets"] == {ATTACKS: True, BACKDOOR: True, COST: True}
    assert v["fedavg"]["worst_attack"] == {"attack": "ipm", "accuracy_delta": -0.047}
    # CA-HFP's median holds the attacks and the backdoor (7 %) and costs 1.3 points clean.
    assert v["cahfp"]["targets"] == {ATTACKS: True, BACKDOOR: True, COST: False}
    assert v["cahfp"]["worst_attack"] == {"attack": "sign-flip", "accuracy_delta": -0.036}
    assert v["fedsag-energy"]["rule"] is None and v["fedsag-energy"]["met"] is None
    # No attack beat every rule offered on any fleet at 0.2.
    assert {f: x["beaten_at_0.2"] for f, x in v.items()} == dict.fromkeys(v, {})
