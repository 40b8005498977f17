"""The docs' claims table (docs/benchmarks/claims.md) is ``benchmarks/claims/table.py``'s output
from the committed results
files: every figure in it can be re-derived from a file under ``benchmarks/results/``, every
results file says how it was made, and a verdict follows from the numbers (reading JSON only,
no benchmark runs)."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.claims import table as claims

ROOT = Path(__file__).resolve().parents[1]


def _readme_table() -> str:
    readme = (ROOT / "docs" / "benchmarks" / "claims.md").read_text()
    start = readme.index(claims.BEGIN)
    end = readme.index(claims.END) + len(claims.END)
    return readme[start:end]


def test_readme_claims_table_is_the_generated_one() -> None:
    assert _readme_table() == claims.markdown(), (
        "run `python docs/gen.py` (it writes benchmarks/claims/table.py's table into the docs)"
    )


def test_every_results_file_follows_the_convention() -> None:
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert files
    problems = [
        p for f in files for p in claims.convention_problems(f.name, json.loads(f.read_text()))
    ]
    assert problems == []


def test_convention_asks_why_a_field_is_null() -> None:
    line = {"benchmark": "x", "command": None, "git_commit": "abc", "git_dirty": False}
    line |= {"wall_s": 1.0, "sizes": {}}
    assert claims.convention_problems("x.json", line) == [
        "x.json: command null with no 'provenance' saying why"
    ]
    line["provenance"] = {"command": "not recorded: ..."}
    assert claims.convention_problems("x.json", line) == []
    assert claims.convention_problems("y.json", {"benchmark": "y"})[0] == "y.json: no 'command'"


def test_every_row_names_committed_files_and_a_missing_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for row in claims.ROWS:
        assert row.files and row.rule.strip(), row.paper
        for name in row.files:
            assert (claims.RESULTS / name).is_file(), f"{row.paper}: {name} is not committed"
    monkeypatch.setattr(claims, "RESULTS", tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(claims.ROWS[0].files[0])):
        claims.markdown()


def test_an_unmeasured_claim_has_a_command_and_no_row() -> None:
    table = _readme_table()
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| paper")]
    assert len(rows) == len(claims.ROWS)
    measured = {row.paper for row in claims.ROWS}
    for u in claims.UNMEASURED:
        assert u.paper not in measured
        assert not any(r.startswith(f"| {u.paper} |") for r in rows)
        assert f"Run `{u.command}`" in table


def _row(paper_prefix: str) -> Any:
    (row,) = [r for r in claims.ROWS if r.paper.startswith(paper_prefix)]
    return row


def _lines(row: Any) -> list[dict[str, Any]]:
    return [claims.load(name) for name in row.files]


def test_fedsag_verdict_follows_the_figures() -> None:
    row = _row("EH-FedSAG, paper")
    assert row.measure(_lines(row)).verdict == "holds, larger than claimed"
    swapped = _lines(row)
    for line in swapped:
        for s in line["settings"]:
            s["fedavg"], s["fedsag"] = s["fedsag"], s["fedavg"]
    assert row.measure(swapped).verdict == "does not"


def test_fedsag_row_says_what_the_files_compare() -> None:
    row = _row("EH-FedSAG, paper")
    why = row.measure(_lines(row)).why
    # The committed files were written before the check became same_selection.
    assert "`same_participants`" in why and "7 of 8 runs" in why
    assert "seed 1 (first differs: fedsag at round 24; rejected replies: fedavg 3)" in why
    renamed = _lines(row)
    for line in renamed:
        for s in line["settings"]:
            for check in s["participants_check"].values():
                check["same_selection"] = True
                check["first_differing_round"] = {}
                del check["same_participants"]
    why = row.measure(renamed).why
    assert "the devices selected each round (`same_selection`): the same in all 8 runs" in why


def test_pruning_verdict_follows_the_figures() -> None:
    row = _row("CA-HFP on CIFAR-10 (")
    lines = _lines(row)
    assert row.measure(lines).verdict == "partly"
    better = copy.deepcopy(lines)
    (last,) = max(better, key=lambda line: line["sizes"]["rounds"])["settings"]
    for key in ("final_accuracy", "last3_accuracy"):
        last["curvature"][key] = last["full"][key]
    for seed in last["curvature"]["seeds"]:
        seed["final_accuracy"] = 1.0
    assert row.measure(better).verdict == "holds"


def test_longer_pruning_row_says_whether_the_full_model_passed_60_percent() -> None:
    row = _row("CA-HFP on CIFAR-10, longer")
    lines = _lines(row)
    why = row.measure(lines).why
    full = lines[0]["settings"][0]["full"]["seeds"]
    passed = sum(s["best_accuracy"] > 0.6 for s in full)
    assert f"it passed 60% in {passed} of {len(full)} seeds at its best round" in why
    lower = copy.deepcopy(lines)
    for s in lower[0]["settings"][0]["full"]["seeds"]:
        s["best_accuracy"] = 0.5
    assert "it passed 60% in 0 of 2 seeds" in row.measure(lower).why


def test_earlystop_verdict_follows_the_figures() -> None:
    row = _row("Data-free stopping (arXiv")
    lines = _lines(row)
    assert row.measure(lines).verdict == "holds"
    worse = copy.deepcopy(lines)
    worse[0]["settings"][0]["mean"]["data_free_bacc"] -= 0.05
    assert row.measure(worse).verdict == "partly"


def test_rows_of_one_claim_must_share_their_sizes() -> None:
    row = _row("EH-FedSAG, paper")
    lines = _lines(row)
    lines[1]["sizes"]["rounds"] = 50
    with pytest.raises(ValueError, match="differ in sizes"):
        row.measure(lines)


def test_a_benchmark_line_records_how_it_was_made(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location(
        "_provenance", ROOT / "benchmarks" / "lib" / "provenance.py"
    )
    assert spec is not None and spec.loader is not None
    prov = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prov)
    script = str(ROOT / "benchmarks" / "claims" / "x_claims.py")
    monkeypatch.setattr(sys, "argv", [script, "--seeds", "0,1", "--bad-lrs", ""])
    line = json.loads(prov.dumps({"benchmark": "x_claims", "sizes": {"seeds": "0,1"}}))
    assert list(line)[:4] == ["benchmark", "command", "git_commit", "git_dirty"]
    assert line["command"] == "python -m benchmarks.claims.x_claims --seeds 0,1 --bad-lrs ''"
    if (ROOT / ".git").exists():  # a checkout; an unpacked copy records None, None
        assert len(line["git_commit"]) == 40 and isinstance(line["git_dirty"], bool)
    assert isinstance(line["wall_s"], float)
    assert claims.convention_problems("x.json", line) == []
    # A line's own wall time is kept.
    assert prov.stamp({"benchmark": "y", "wall_s": 12.5})["wall_s"] == 12.5


def test_a_line_records_the_code_version_of_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit made while a long benchmark runs is not the code it ran."""
    monkeypatch.setenv("BENCHMARK_GIT_COMMIT", "a" * 40)
    spec = importlib.util.spec_from_file_location(
        "_provenance_start", ROOT / "benchmarks" / "lib" / "provenance.py"
    )
    assert spec is not None and spec.loader is not None
    prov = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prov)  # the benchmark starts
    monkeypatch.setenv("BENCHMARK_GIT_COMMIT", "b" * 40 + "+dirty")  # HEAD moves meanwhile
    line = prov.stamp({"benchmark": "x"})
    assert (line["git_commit"], line["git_dirty"]) == ("a" * 40, False)


def test_fedsag_seed_form_verdict_follows_the_figures() -> None:
    row = _row("EH-FedSAG, the seed's form")
    got = row.measure(_lines(row))
    assert got.verdict == "does not" and "1/max(participants, M)" in got.why
    lines = _lines(row)
    for s in lines[0]["settings"]:  # the seed's form far above EH-FedAvg in every run
        for fig in s["fedsag-seed"]["seeds"]:
            fig["final_accuracy"] = 0.99
    assert row.measure(lines).verdict == "holds"


def test_warmstart_verdict_follows_the_figures() -> None:
    row = _row("Warm start when devices arrive")
    lines = _lines(row)
    got = row.measure(lines)
    ratios = [
        s["ratios"]["continuous/pilot"]["lookalike"]["aux_counted"]
        for line in lines
        for s in line["settings"]
    ]
    factor = claims.WARM_PAPER_FACTOR
    want = "holds" if min(ratios) >= factor else "partly" if max(ratios) > 1 else "does not"
    assert got.verdict == want
    for target, scale in (("holds", factor), ("partly", 2.0), ("does not", 0.5)):
        changed = copy.deepcopy(lines)
        for line in changed:
            for s in line["settings"]:
                s["ratios"]["continuous/pilot"]["lookalike"]["aux_counted"] = scale
        assert row.measure(changed).verdict == target


RUN_COUNT = re.compile(r"\((\d+) runs\b")
RESULTS_NAME = re.compile(r"benchmarks/results/([\w.-]+\.json)")


def run_count_problems(text: str, where: str) -> list[str]:
    """Each "(N runs" in ``text`` against the ``runs`` (new + reused) of the first results
    file named in the 400 characters after it: the count the file recorded, not a recount."""
    problems = []
    for m in RUN_COUNT.finditer(text):
        named = RESULTS_NAME.search(text, m.end(), m.end() + 400)
        if named is None:
            problems.append(f"{where}: '{m.group(0)}' names no results file after it")
            continue
        runs = claims.load(named.group(1)).get("runs")
        if not isinstance(runs, dict):
            problems.append(f"{where}: {named.group(1)} records no run count")
            continue
        total = sum(runs.values())
        if int(m.group(1)) != total:
            problems.append(f"{where}: '{m.group(0)}' but {named.group(1)} ran {total} ({runs})")
    return problems


def test_run_counts_in_the_docs_are_their_files() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    problems = [p for f in pages for p in run_count_problems(f.read_text(), f.name)]
    assert problems == []
    # A count that disagrees with its file is named (issue 46: "108 runs" for a file of 102).
    wrong = "(108 runs, 31 min; `benchmarks/results/attack_grid-mlp-f0.2-3seeds-2026-12-04.json`"
    assert run_count_problems(wrong, "x.md") == [
        "x.md: '(108 runs' but attack_grid-mlp-f0.2-3seeds-2026-12-04.json ran 102 "
        "({'new': 102, 'reused': 0})"
    ]


def _seeds(*finals: float, var: float = 1.0) -> list[dict[str, Any]]:
    return [
        {"final_accuracy": f, "late_variance_pp2": var, "rejected_replies": 0}
        | {"participants_per_round": 1.5}
        for f in finals
    ]


def test_field_verdict_has_the_papers_direction_and_the_best_baseline() -> None:
    fedavg = _seeds(0.60, 0.62, 0.64, var=20.0)
    best = _seeds(0.80, 0.81, 0.82, var=2.0)
    verdict = claims.field_verdict
    assert verdict(_seeds(0.85, 0.86, 0.87), fedavg, best) == (
        "direction holds, beats the best baseline"
    )
    # Above the best baseline on the mean but not in every seed: does not beat it.
    assert verdict(_seeds(0.95, 0.80, 0.87), fedavg, best) == (
        "direction holds, does not beat the best baseline"
    )
    # Above EH-FedAvg but with a higher late variance: half the paper's direction.
    assert verdict(_seeds(0.70, 0.70, 0.70, var=30.0), fedavg, best) == (
        "direction partly, does not beat the best baseline"
    )
    assert verdict(_seeds(0.1, 0.1, 0.1, var=30.0), fedavg, best) == (
        "direction does not, does not beat the best baseline"
    )
    # EH-FedAvg at chance is flat, not stable: its variance is not compared.
    chance = _seeds(0.10, 0.10, 0.11, var=0.01)
    assert verdict(_seeds(0.5, 0.5, 0.5), chance, best).startswith("direction holds")


def _field_lines() -> list[dict[str, Any]]:
    """A sweep line and a seeds line as fedsag_claims.py writes them (--lrs, --variant-lr)."""
    sizes = {
        "devices": 20, "max_devices": 5, "rounds": 60, "local_steps": 10, "lr": 0.05,
        "capacity": 8.0, "train_slots": 3, "dataset": "fashion-mnist", "target": 0.5,
        "batch_size": 40, "alphas": "0.1", "harvest_probs": "0.05", "eval_samples": 1000,
        "engine": "inprocess", "smoke": False, "set": {},
    }  # fmt: skip
    lrs = (0.01, 0.03, 0.1)
    last = {"fedsag": (0.7, 0.8, 0.6), "fedsag-seed": (0.3, 0.2, 0.1), "fedavg": (0.5, 0.6, 0.6)}
    last |= {"mifa": (0.7, 0.75, 0.5), "fedvarp": (0.2, 0.3, 0.1), "scaffold": (0.5, 0.5, 0.4)}
    sweep: dict[str, Any] = {"alpha": 0.1, "harvest_prob": 0.05, "same_selection": True}
    for v, xs in last.items():
        for lr, x in zip(lrs, xs, strict=True):
            sweep[f"{v}@lr{lr:g}"] = {"lr": lr, "last_accuracy": x, "seeds": _seeds(x)}
    chosen = {"fedsag": 0.03, "fedsag-seed": 0.01, "fedavg": 0.03}
    chosen |= {"mifa": 0.03, "fedvarp": 0.03, "scaffold": 0.01}
    sweep["chosen_lr"] = chosen
    finals = {"fedsag": (0.8, 0.82, 0.84), "fedsag-seed": (0.2, 0.25, 0.3)}
    finals |= {"fedavg": (0.6, 0.6, 0.6), "mifa": (0.75, 0.83, 0.8)}
    finals |= {"fedvarp": (0.3, 0.3, 0.3), "scaffold": (0.5, 0.5, 0.5)}
    runs: dict[str, Any] = {"alpha": 0.1, "harvest_prob": 0.05, "same_selection": True}
    runs |= {v: {"seeds": _seeds(*f, var=1.0 if v == "fedsag" else 5.0)} for v, f in finals.items()}
    variants = ",".join(last)
    return [
        {"sizes": sizes | {"seeds": "0", "lrs": "0.01,0.03,0.1", "variants": variants},
         "settings": [sweep]},
        {"sizes": sizes | {"seeds": "0,1,2", "lrs": "", "variants": variants,
                           "variant_lr": dict(chosen)}, "settings": [runs]},
    ]  # fmt: skip


def test_field_row_reads_the_sweep_and_the_seeds_at_each_pick() -> None:
    got = claims.fedsag_field(_field_lines())
    # MIFA (mean 0.793) is the best baseline; EdgeFleet's form is above it in 2 of 3 seeds.
    assert got.verdict == (
        "EdgeFleet's form: direction holds, does not beat the best baseline; "
        "seed's form: direction does not, does not beat the best baseline"
    )
    assert "best baseline: MIFA" in got.measured
    assert "MIFA 0.700 / 0.750 / 0.500 (picked 0.03)" in got.measured
    assert "EdgeFleet's form 0.800, 0.820, 0.840 (mean 0.820) / 1.00" in got.measured
    assert "above it in 2 of 3 seeds" in got.why
    lines = _field_lines()
    lines[1]["settings"][0]["fedsag"]["seeds"][1]["final_accuracy"] = 0.9
    assert claims.fedsag_field(lines).verdict.startswith(
        "EdgeFleet's form: direction holds, beats the best baseline"
    )


def test_field_row_refuses_picks_that_are_not_the_sweeps() -> None:
    lines = _field_lines()
    lines[1]["sizes"]["variant_lr"]["fedavg"] = 0.1  # the seeds ran another lr than the pick
    with pytest.raises(ValueError, match="the sweep picked"):
        claims.fedsag_field(lines)
    lines = _field_lines()
    # EH-FedAvg ties at 0.03 and 0.1 (0.6): the rule takes the smaller, so 0.1 is refused.
    lines[0]["settings"][0]["chosen_lr"]["fedavg"] = 0.1
    lines[1]["sizes"]["variant_lr"]["fedavg"] = 0.1
    with pytest.raises(ValueError, match="does not follow its rule"):
        claims.fedsag_field(lines)


def test_field_row_with_a_baseline_run_on_the_sweeps_seed_only() -> None:
    lines = _field_lines()
    del lines[1]["settings"][0]["scaffold"], lines[1]["sizes"]["variant_lr"]["scaffold"]
    got = claims.fedsag_field(lines)
    assert got.verdict.startswith("EdgeFleet's form: direction holds, does not beat")
    assert "SCAFFOLD run on the sweep's seed only" in got.why
    # Above the best seeded baseline on the sweep's seed: no verdict against the field.
    lines[0]["settings"][0]["scaffold@lr0.01"]["last_accuracy"] = 0.9
    got = claims.fedsag_field(lines)
    assert got.verdict == (
        "EdgeFleet's form: direction holds, the best baseline not judged; "
        "seed's form: direction does not, the best baseline not judged"
    )


def test_field_row_with_a_form_run_on_the_sweeps_seed_only() -> None:
    lines = _field_lines()
    del lines[1]["settings"][0]["fedsag-seed"], lines[1]["sizes"]["variant_lr"]["fedsag-seed"]
    got = claims.fedsag_field(lines)
    assert got.verdict.endswith(
        "seed's form: run on the sweep's seed only (last-5 mean 0.300 at its pick)"
    )
    assert "seed's form" not in got.why.split("against EH-FedAvg")[-1]


def test_pruning_field_verdict_follows_the_figures() -> None:
    row = _row("CA-HFP against the field, Fashion")
    got = row.measure(_lines(row))
    assert got.verdict == (
        "CA-HFP (EdgeFleet's Taylor score): near the full model, beats the best baseline; "
        "CA-HFP (the seed's signed Hutchinson score): not near the full model, does not beat "
        "the best baseline"
    )
    assert "best baseline: FjORD" in got.measured
    # One seed below the best baseline is enough to lose "beats"; a mean 2+ points under
    # the full model loses "near".
    lines = _lines(row)
    st = lines[1]["settings"][0]
    seeds = st["curvature"]["seeds"]
    seeds[0]["final_accuracy"], seeds[2]["final_accuracy"] = 0.72, 0.88  # FjORD's seed 0: 0.722
    assert "Taylor score): near the full model, does not beat" in row.measure(lines).verdict
    seeds[1]["final_accuracy"] = 0.70
    assert "Taylor score): not near the full model" in row.measure(lines).verdict
    # A form left out of a regime's files is said to be, with the reason, not dropped.
    lines = _lines(row)
    del lines[1]["settings"][0]["curvature-seed"], lines[1]["sizes"]["variant_lr"]["curvature-seed"]
    del lines[0]["settings"][0]["chosen_lr"]["curvature-seed"]
    got = row.measure(lines)
    assert got.verdict.endswith(
        "CA-HFP (the seed's signed Hutchinson score): not run in this regime"
    )
    assert "Hutchinson score) not run in this regime (its Hutchinson Hessian" in got.why


def test_pruning_field_row_with_baselines_run_on_the_sweeps_seed_only() -> None:
    row = _row("CA-HFP against the field, Fashion")
    lines = _lines(row)
    del lines[1]["settings"][0]["heterofl"], lines[1]["sizes"]["variant_lr"]["heterofl"]
    got = row.measure(lines)
    assert "best baseline of those run at every seed: FjORD" in got.measured
    assert got.verdict.startswith("CA-HFP (EdgeFleet's Taylor score): near the full model, beats")
    assert "HeteroFL run on the sweep's seed only: at their picks their last-5 means 0.678" in (
        got.why
    )
    # An unseeded baseline above the best seeded one on the sweep's seed: not judged.
    lines[0]["settings"][0]["heterofl@lr0.1"]["last_accuracy"] = 0.99
    got = row.measure(lines)
    assert "Taylor score): near the full model, the best baseline not judged" in got.verdict
    assert "(above it: the best baseline is not judged)" in got.why


def test_warmstart_modes_verdict_follows_the_figures() -> None:
    row = _row("Warm start against its own baselines, MNIST")
    got = row.measure(_lines(row))
    assert got.verdict == "holds against average and fresh"
    assert "average/pilot 6.3x, pilot fewer rounds in 3 of 3 seeds" in got.why
    lines = _lines(row)
    # The average start 1 round per look-alike session in seed 0: pilot no longer ahead there.
    per_seed = lines[0]["settings"][0]["modes"]["average"]["rounds_to_target_per_seed"]
    per_seed[0][3:] = [1, 1, 1]
    assert row.measure(lines).verdict == "partly against average and fresh"


def test_earlystop_seed_form_verdict_follows_the_figures() -> None:
    row = _row("Data-free stopping, the seed's form")
    got = row.measure(_lines(row))
    assert got.verdict == "holds"
    assert "pneumonia: seed's form +2.2 points against the validation rule" in got.why
    lines = _lines(row)
    lines[0]["settings"][1]["mean"]["seed_form_bacc"] = 0.96  # bccd: 2.2 points under 0.982
    assert row.measure(lines).verdict == "partly"
