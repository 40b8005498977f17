"""The claims table (docs/benchmarks/claims.md, written by docs/gen.py), generated from the
committed results files.

``python -m benchmarks.claims.table`` prints what goes between the docs page's ``claims-table``
markers; ``tests/test_claims.py`` keeps the two equal, so every figure in the table can be
re-derived from a file under ``benchmarks/results/``.

A results file (``benchmarks/results/<benchmark>-<what>-<date>.json``) is one benchmark's JSON
line, saved as printed (``python -m benchmarks.<group>.x ... > benchmarks/results/x-....json``).
It holds:

- ``benchmark``, ``sizes`` and the benchmark's figures, per seed where it runs seeds
  (``settings[*].<variant>.seeds``) or per repeat (``repeats``);
- ``command`` (the argv), ``git_commit`` and ``git_dirty`` (the code it ran), ``wall_s``:
  written by the benchmark itself (``benchmarks/lib/provenance.py``);
- ``provenance``, only in files written before the benchmarks recorded those fields: how each
  was recovered from git history, or why it is null (``recorded_by_run``: false).

Each row of :data:`ROWS` names its files and computes its "measured" text, its verdict and its
"why" from them; the verdict rule is written out in the row (a rule on the numbers, or a
judgement stated as one). A claim with no committed results file is in :data:`UNMEASURED`,
with the command that would write one: it is listed under the table, with no figures.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
BEGIN = (
    "<!-- claims-table: written by `python docs/gen.py` (`python -m benchmarks.claims.table` "
    "prints it) from benchmarks/results/; tests/test_claims.py keeps it equal -->\n"
)
END = "<!-- claims-table end -->\n"
REQUIRED = ("benchmark", "command", "git_commit", "git_dirty", "wall_s", "sizes")

Line = dict[str, Any]


def load(name: str) -> Line:
    """A results file by name; a missing one names what the table needs it for."""
    path = RESULTS / name
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmarks/results/{name} is named by a claims row but is not there: commit it, "
            "or move the row to UNMEASURED in benchmarks/claims/table.py with the command that "
            "writes it"
        )
    line: Line = json.loads(path.read_text())
    return line


def convention_problems(name: str, line: Mapping[str, Any]) -> list[str]:
    """What a results file lacks under the convention above (empty: none)."""
    problems = [f"{name}: no '{k}'" for k in REQUIRED if k not in line]
    nulls = [k for k in ("command", "git_commit", "git_dirty", "wall_s") if line.get(k) is None]
    prov = line.get("provenance")
    if nulls and not isinstance(prov, dict):
        problems.append(f"{name}: {', '.join(nulls)} null with no 'provenance' saying why")
    elif nulls and isinstance(prov, dict):
        problems += [
            f"{name}: {k} null, provenance does not say why"
            for k in nulls
            if k != "git_dirty" and not prov.get(k)
        ]
    return problems


# -- formatting ----------------------------------------------------------------------------


def f3(x: float) -> str:
    return f"{x:.3f}"


def pts(x: float) -> str:
    """A difference of accuracies, in points."""
    return f"{100 * x:+.1f}"


def mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs)


def seeds_of(line: Mapping[str, Any]) -> list[int]:
    return [int(s) for s in str(line["sizes"]["seeds"]).split(",") if s.strip()]


def same_sizes(lines: Sequence[Line], ignore: Sequence[str]) -> dict[str, Any]:
    """The sizes the files of one row share; files that differ in anything else are refused,
    since their figures would not be one setting's."""
    first = {k: v for k, v in lines[0]["sizes"].items() if k not in ignore}
    for line in lines[1:]:
        other = {k: v for k, v in line["sizes"].items() if k not in ignore}
        if other != first:
            raise ValueError(f"results files of one row differ in sizes: {first} vs {other}")
    return first


@dataclass(frozen=True)
class Measured:
    measured: str
    verdict: str
    why: str


@dataclass(frozen=True)
class Row:
    paper: str
    claim: str  # the paper's claim in words, with its figure
    files: tuple[str, ...]
    measure: Callable[[Sequence[Line]], Measured]
    rule: str  # how the verdict follows from the figures


@dataclass(frozen=True)
class Unmeasured:
    paper: str
    claim: str
    command: str
    note: str = ""
    pending: str = ""  # why a regime the claims table needs has not been run yet


# -- EH-FedSAG in the paper's CIFAR-10 regime ------------------------------------------------

CHANCE_PLUS = 0.15  # 10 classes: EH-FedAvg "learns" once its final accuracy is 1.5x chance
FEDSAG_PAPER_GAIN = 0.03
FEDSAG_PAPER_VAR_RATIO = 20.0


def _rounds(seeds: Sequence[Mapping[str, Any]]) -> str:
    reached = [s["rounds_to_target"] for s in seeds if s["rounds_to_target"] is not None]
    if not reached:
        return "never"
    text = f"{mean(reached):g}"
    return text if len(reached) == len(seeds) else f"{text} ({len(reached)} of {len(seeds)})"


def fedsag_cifar(lines: Sequence[Line]) -> Measured:
    sizes = same_sizes(lines, ("seeds", "alphas"))
    per: dict[tuple[float, float], dict[str, list[dict[str, Any]]]] = {}
    checks: list[tuple[float, float, str, Mapping[str, Any], dict[str, dict[str, Any]]]] = []
    for line in lines:
        seeds = seeds_of(line)
        for s in line["settings"]:
            key = (float(s["alpha"]), float(s["harvest_prob"]))
            into = per.setdefault(key, {"fedavg": [], "fedsag": []})
            by_seed: dict[str, dict[str, Any]] = {}
            for v in ("fedavg", "fedsag"):
                for seed, fig in zip(seeds, s[v]["seeds"], strict=True):
                    into[v].append({**fig, "seed": seed})
                    by_seed.setdefault(str(seed), {})[v] = fig
            for seed, check in s["participants_check"].items():
                checks.append((*key, seed, check, by_seed))
    parts, gains, ratios, chance = [], {}, {}, []
    for alpha in sorted({a for a, _ in per}):
        texts = []
        for (a, ph), v in sorted(per.items()):
            if a != alpha:
                continue
            fa, fs = v["fedavg"], v["fedsag"]
            acc_a, acc_s = (
                mean([x["final_accuracy"] for x in fa]),
                mean([x["final_accuracy"] for x in fs]),
            )
            var_a, var_s = (
                mean([x["late_variance_pp2"] for x in fa]),
                mean([x["late_variance_pp2"] for x in fs]),
            )
            gains[(a, ph)] = acc_s - acc_a
            if acc_a >= CHANCE_PLUS:
                ratios[(a, ph)] = var_a / var_s
            else:
                chance.append((a, ph, acc_a, var_a, var_s))
            part = mean([x["participants_per_round"] for x in fs])
            texts.append(
                f"P_h {ph:g} EH-FedAvg {f3(acc_a)} / {var_a:.2f} / {_rounds(fa)}, EH-FedSAG "
                f"{f3(acc_s)} / {var_s:.2f} / {_rounds(fs)} ({part:.1f} devices aggregated a "
                "round)"
            )
        n = len(next(v for (a, _), v in per.items() if a == alpha)["fedsag"])
        parts.append(f"alpha {alpha:.1f}, {n} seeds: " + "; ".join(texts))
    measured = (
        f"{sizes['dataset']}, SmallCNN, K {sizes['devices']}, M {sizes['max_devices']}, "
        f"{sizes['rounds']} rounds, capacity {sizes['capacity']:g}, eval on "
        f"{sizes['eval_samples']} test images; final accuracy / late variance (pp^2) / rounds "
        f"to {sizes['target']:.0%}, means over seeds. " + ". ".join(parts)
    )
    direction = all(g > 0 for g in gains.values()) and all(r > 1 for r in ratios.values())
    some = any(g > 0 for g in gains.values())
    best = max(gains, key=lambda k: gains[k])
    worst = min(gains, key=lambda k: gains[k])
    if direction:
        verdict = "holds"
        if gains[best] > 2 * FEDSAG_PAPER_GAIN:
            verdict += ", larger than claimed"
    else:
        verdict = "partly" if some else "does not"
    why = [
        f"EH-FedSAG ends above EH-FedAvg in every setting ({pts(gains[worst])} to "
        f"{pts(gains[best])} points)"
        if all(g > 0 for g in gains.values())
        else "EH-FedSAG does not end above EH-FedAvg in every setting",
        f"where EH-FedAvg leaves chance (final >= {CHANCE_PLUS}) its late variance is "
        f"{min(ratios.values()):.1f}-{max(ratios.values()):.0f}x EH-FedSAG's "
        f"(the paper: about {FEDSAG_PAPER_VAR_RATIO:g}x)",
    ]
    why += [
        f"at alpha {a:.1f}, P_h {ph:g} EH-FedAvg ends at {f3(acc)}, chance, with a flat "
        f"{va:.2f} pp^2 against EH-FedSAG's {vs:.2f}"
        for a, ph, acc, va, vs in chance
    ]
    why.append(
        f"the accuracy gain is far from the paper's {100 * FEDSAG_PAPER_GAIN:g} points: "
        f"{pts(gains[best])} at alpha {best[0]:.1f}, P_h {best[1]:g} (fewest devices a round) and "
        f"{pts(gains[worst])} at alpha {worst[0]:.1f}, P_h {worst[1]:g}"
    )
    why.append(_selection_note(checks))
    return Measured(measured, verdict, "; ".join(why))


def fedsag_seed_form(lines: Sequence[Line]) -> Measured:
    """The seed's form of FedSAG (corrections 1/participants, memory mean over the stored
    memories; ``--variants fedsag-seed``, the first file) against EH-FedAvg and EdgeFleet's
    form on the same settings and seeds (the other files): selection does not depend on the
    model, so each seed's runs select the same devices."""
    seed_line, others = lines[0], lines[1:]
    ref: dict[tuple[float, float, int], dict[str, Any]] = {}
    for line in others:
        for s in line["settings"]:
            for v in ("fedavg", "fedsag"):
                for seed, fig in zip(seeds_of(line), s[v]["seeds"], strict=True):
                    ref.setdefault((float(s["alpha"]), float(s["harvest_prob"]), seed), {})[v] = fig
    parts, below = [], []
    for s in seed_line["settings"]:
        key = (float(s["alpha"]), float(s["harvest_prob"]))
        rows = [
            (seed, fig, ref[(*key, seed)])
            for seed, fig in zip(seeds_of(seed_line), s["fedsag-seed"]["seeds"], strict=True)
        ]
        for seed, fig, r in rows:
            parts.append(
                f"alpha {key[0]:.1f}, P_h {key[1]:g}, seed {seed}: seed's form "
                f"{f3(fig['final_accuracy'])} / {fig['late_variance_pp2']:.2f} / "
                f"{fig['rounds_to_target'] or 'never'}, EH-FedAvg "
                f"{f3(r['fedavg']['final_accuracy'])} / {r['fedavg']['late_variance_pp2']:.2f}, "
                f"EdgeFleet's form {f3(r['fedsag']['final_accuracy'])} / "
                f"{r['fedsag']['late_variance_pp2']:.2f}"
            )
            below.append(fig["final_accuracy"] < r["fedavg"]["final_accuracy"])
    verdict = "does not" if all(below) else ("partly" if any(below) else "holds")
    why = (
        "the seed's form ends below EH-FedAvg in every run measured, with a higher late "
        "variance: stale corrections at weight 1/participants (2-3 devices a round) swing the "
        "model; EdgeFleet's cap at 1/max(participants, M) is what holds"
        if all(below)
        else "the seed's form ends below EH-FedAvg in some runs"
    )
    measured = (
        "final accuracy / late variance (pp^2) / rounds to 50 %, per seed; the P_h 0.06 and "
        "alpha 0.1 settings not run with the seed's form. " + "; ".join(parts)
    )
    return Measured(measured, verdict, why)


def _selection_note(
    checks: Sequence[tuple[float, float, str, Mapping[str, Any], dict[str, dict[str, Any]]]],
) -> str:
    """What the files say about the two variants seeing the same devices. Files written
    before commit 31af4be compare the devices aggregated (``same_participants``); later ones
    the devices selected: aggregated, declined or rejected (``same_selection``)."""
    keys = {
        "same_selection" if "same_selection" in c else "same_participants" for *_, c, _ in checks
    }
    differ = [
        (a, ph, seed, c, figs) for a, ph, seed, c, figs in checks if not c.get(next(iter(keys)))
    ]
    what = {
        "same_participants": "the devices aggregated each round (`same_participants`, written "
        "before the check became `same_selection`, which also counts declined and rejected "
        "devices)",
        "same_selection": "the devices selected each round (`same_selection`)",
    }
    text = "the results files compare " + " and ".join(what[k] for k in sorted(keys))
    runs = len(checks)
    if not differ:
        return text + f": the same in all {runs} runs"
    notes = []
    for a, ph, seed, c, figs in differ:
        first = ", ".join(f"{v} at round {r}" for v, r in c["first_differing_round"].items())
        rejected = ", ".join(
            f"{v} {f['rejected_replies']}" for v, f in figs[seed].items() if f["rejected_replies"]
        )
        notes.append(
            f"alpha {a:.1f}, P_h {ph:g}, seed {seed} (first differs: {first}; rejected replies: "
            f"{rejected or 'none'})"
        )
    text += f": the same in {runs - len(differ)} of {runs} runs, not in " + "; ".join(notes)
    if keys == {"same_participants"}:
        text += (
            ". A rejected reply changes who is aggregated, not who was selected; whether the "
            "selections were the same there is in no committed file (a re-run of "
            "`fedsag_claims.py` writes `same_selection`)"
        )
    return text


# -- EH-FedSAG against the field's baselines --------------------------------------------------

FIELD_NAMES = {
    "fedsag": "EdgeFleet's form",
    "fedsag-seed": "seed's form",
    "fedavg": "EH-FedAvg",
    "mifa": "MIFA",
    "fedvarp": "FedVARP",
    "scaffold": "SCAFFOLD",
}
FIELD_FORMS = ("fedsag", "fedsag-seed")  # FedSAG's two forms; the other variants are baselines
FIELD_BASELINES = ("fedavg", "mifa", "fedvarp", "scaffold")
NO_DEVICE = "no GPU machine was lent to this work"
DATASET_NAMES = {"fashion-mnist": "Fashion-MNIST", "cifar10": "CIFAR-10", "mnist": "MNIST"}
FIELD_PAPER = (
    "the paper (as the seed gives it): CIFAR-10, 1,000 rounds, EH-FedSAG about 3 points above "
    "EH-FedAvg at scarce energy, late-stage variance 0.94 -> 0.04, the 50% target about 26% "
    "sooner; it compares with EH-FedAvg only"
)


def _finals(seeds: Sequence[Mapping[str, Any]]) -> list[float]:
    return [s["final_accuracy"] for s in seeds]


def field_verdict(
    form: Sequence[Mapping[str, Any]],
    fedavg: Sequence[Mapping[str, Any]],
    best: Sequence[Mapping[str, Any]],
) -> str:
    """One form's verdict from its per-seed figures, EH-FedAvg's and the best baseline's (the
    same seeds, in order). The paper's direction: a higher mean final accuracy than EH-FedAvg
    and a lower mean late variance, the variance not compared where EH-FedAvg stays at chance
    (mean final below CHANCE_PLUS) ("holds": both, "partly": one, "does not": neither). Beats
    the best baseline: a higher mean final accuracy and a higher final in every seed."""
    acc = mean(_finals(form)) > mean(_finals(fedavg))
    # A model at chance barely moves: its low variance is no stability (as fedsag_cifar).
    var = mean(_finals(fedavg)) < CHANCE_PLUS or mean(
        [s["late_variance_pp2"] for s in form]
    ) < mean([s["late_variance_pp2"] for s in fedavg])
    direction = "holds" if acc and var else ("partly" if acc or var else "does not")
    beats = mean(_finals(form)) > mean(_finals(best)) and all(
        a > b for a, b in zip(_finals(form), _finals(best), strict=True)
    )
    return f"direction {direction}, {'beats' if beats else 'does not beat'} the best baseline"


def lr_picks(
    sweep: Mapping[str, Any], runs: Mapping[str, Any], variants: Sequence[str]
) -> tuple[list[float], dict[str, float]]:
    """A comparison's sweep file (``--lrs``) and its seeds file (``--variant-lr``): the swept
    rates and each variant's pick, checked to follow the sweep's stated rule (its
    ``lr_rule``) from its own figures, and to be the rates the seeds file ran."""
    (sw,) = sweep["settings"]
    lrs = [float(x) for x in sweep["sizes"]["lrs"].split(",")]
    chosen = {v: float(x) for v, x in sw["chosen_lr"].items()}
    picked = {v: float(x) for v, x in runs["sizes"]["variant_lr"].items()}
    if picked != {v: chosen[v] for v in variants}:
        raise ValueError(f"the seeds file ran the lrs {picked}, the sweep picked {chosen}")
    for v in variants:
        arm = {lr: sw[f"{v}@lr{lr:g}"] for lr in lrs}
        by = {lr: (not a.get("seeds_stopped", 0), a["last_accuracy"]) for lr, a in arm.items()}
        if max(lrs, key=lambda lr: (*by[lr], -lr)) != chosen[v]:
            raise ValueError(f"{v}: the sweep's pick {chosen[v]} does not follow its rule {by}")
    return lrs, chosen


def sweep_summary(
    sw: Mapping[str, Any],
    lrs: Sequence[float],
    chosen: Mapping[str, float],
    names: Mapping[str, str],
) -> str:
    """Per variant (in ``names``' order): its sweep's last-5-round means, rate by rate, and
    its pick."""
    return "; ".join(
        f"{names[v]} "
        + " / ".join(
            f3(sw[f"{v}@lr{lr:g}"]["last_accuracy"])
            + (" (stopped)" if sw[f"{v}@lr{lr:g}"].get("seeds_stopped") else "")
            for lr in lrs
        )
        + f" (picked {chosen[v]:g})"
        for v in names
        if v in chosen
    )


@dataclass(frozen=True)
class FieldRuns:
    """A comparison's two files read together: the sweep (``--lrs``) and the seeds at each
    variant's pick (``--variant-lr``), the picks checked by :func:`lr_picks`."""

    sizes: dict[str, Any]
    sweep: Line
    sw: Mapping[str, Any]  # the sweep's one setting
    st: Mapping[str, Any]  # the seeds file's one setting
    lrs: list[float]
    chosen: dict[str, float]
    seeds: list[int]
    per: dict[str, list[Mapping[str, Any]]]  # variant -> its per-seed figures

    @classmethod
    def read(
        cls, lines: Sequence[Line], names: Mapping[str, str], ignore: Sequence[str]
    ) -> FieldRuns:
        sweep, runs = lines
        sizes = same_sizes(lines, ignore)
        (sw,) = sweep["settings"]
        (st,) = runs["settings"]
        variants = [v for v in names if v in st]
        lrs, chosen = lr_picks(sweep, runs, variants)
        per = {v: st[v]["seeds"] for v in variants}
        return cls(sizes, sweep, sw, st, lrs, chosen, seeds_of(runs), per)


def _unseeded_note(
    names: Mapping[str, str],
    unseeded: Sequence[str],
    at_pick: Mapping[str, float],
    best: str,
    above: bool,
) -> str:
    """Why a row's baselines run on the sweep's seed only do or do not leave its verdict
    against the best baseline standing (``above``: one of them was at or above the best
    one's pick on that seed)."""
    return (
        f"{', '.join(names[v] for v in unseeded)} run on the sweep's seed only: at their picks "
        "their last-5 means "
        + ", ".join(f3(at_pick[v]) for v in unseeded)
        + f" against {names[best]}'s {f3(at_pick[best])}"
        + (" (above it: the best baseline is not judged)" if above else "")
    )


def fedsag_field(lines: Sequence[Line]) -> Measured:
    """FedSAG's two forms against EH-FedAvg, MIFA, FedVARP and SCAFFOLD, each at the client
    learning rate its own seed-0 sweep picked: the sweep's file (``--lrs``) first, then the
    file of every seed at the picks (``--variant-lr``), whose picks must be the sweep's."""
    runs = FieldRuns.read(lines, FIELD_NAMES, ("seeds", "lrs", "variant_lr", "set", "variants"))
    sizes, sweep, sw, lrs, chosen, seeds, per = (
        runs.sizes, runs.sweep, runs.sw, runs.lrs, runs.chosen, runs.seeds, runs.per
    )  # fmt: skip
    variants = list(per)
    baselines = [v for v in FIELD_BASELINES if v in per]
    best = max(baselines, key=lambda v: mean(_finals(per[v])))
    # A baseline run on the sweep's seed only: the verdict against the best baseline stands
    # only if, on that seed, it ended below the best one at their picks.
    at_pick = {v: sw[f"{v}@lr{chosen[v]:g}"]["last_accuracy"] for v in chosen}
    unseeded = [v for v in FIELD_BASELINES if v not in per]
    open_question = [v for v in unseeded if at_pick[v] >= at_pick[best]]
    sweep_text = sweep_summary(sw, lrs, chosen, FIELD_NAMES)
    seed_text = "; ".join(
        f"{FIELD_NAMES[v]} "
        + ", ".join(f3(x) for x in _finals(per[v]))
        + f" (mean {f3(mean(_finals(per[v])))}) / "
        + f"{mean([s['late_variance_pp2'] for s in per[v]]):.2f}"
        for v in variants
    )
    part = mean([s["participants_per_round"] for s in per["fedsag"]])
    measured = (
        f"{FIELD_PAPER}. Here: {sizes['dataset']}, SmallCNN, K {sizes['devices']}, M "
        f"{sizes['max_devices']}, {sizes['rounds']} rounds, alpha {sizes['alphas']}, P_h "
        f"{sizes['harvest_probs']}, capacity {sizes['capacity']:g}, {sizes['local_steps']} local "
        f"steps, eval on {sizes['eval_samples']} test images, {part:.1f} devices aggregated a "
        f"round, the same batteries and energy-age selection for all. Learning-rate sweep on "
        f"seed {sweep['sizes']['seeds']}, client lr {' / '.join(f'{x:g}' for x in lrs)}, mean "
        f"accuracy of the last 5 rounds: {sweep_text}. At each pick, seeds "
        f"{', '.join(map(str, seeds))}: final accuracy per seed (mean) / late variance (pp^2, "
        f"mean): {seed_text}; best baseline"
        + (" of those run at every seed" if unseeded else "")
        + f": {FIELD_NAMES[best]}"
    )
    forms = [f for f in FIELD_FORMS if f in per]
    verdicts = {f: field_verdict(per[f], per["fedavg"], per[best]) for f in forms}
    if open_question:
        verdicts = {
            f: v.split(",")[0] + ", the best baseline not judged" for f, v in verdicts.items()
        }
    verdicts |= {
        f: f"run on the sweep's seed only (last-5 mean {f3(at_pick[f])} at its pick)"
        for f in FIELD_FORMS
        if f not in per
    }
    verdict = "; ".join(f"{FIELD_NAMES[f]}: {verdicts[f]}" for f in FIELD_FORMS)
    why = (
        [_unseeded_note(FIELD_NAMES, unseeded, at_pick, best, bool(open_question))]
        if unseeded
        else []
    )
    for f in forms:
        ahead = sum(a > b for a, b in zip(_finals(per[f]), _finals(per[best]), strict=True))
        why.append(
            f"{FIELD_NAMES[f]} {pts(mean(_finals(per[f])) - mean(_finals(per['fedavg'])))} "
            f"points against EH-FedAvg, "
            f"{pts(mean(_finals(per[f])) - mean(_finals(per[best])))} against "
            f"{FIELD_NAMES[best]} (above it in {ahead} of {len(seeds)} seeds)"
        )
    rejected = {
        v: sum(s["rejected_replies"] for s in per[v])
        for v in variants
        if any(s["rejected_replies"] for s in per[v])
    }
    if rejected:
        why.append(
            "replies rejected by the norm screen over the seeds: "
            + ", ".join(f"{FIELD_NAMES[v]} {n}" for v, n in rejected.items())
        )
    same = runs.st["same_selection"]
    why.append(
        "every method selected the same devices round by round in every seed (`same_selection`)"
        if same
        else "the methods' selections differ in some seed (`participants_check`)"
    )
    why.append(
        f"{sizes['rounds']} rounds of {sizes['devices']} devices on "
        f"{DATASET_NAMES[sizes['dataset']]}, not the paper's regime (1,000 CIFAR-10 rounds of "
        f"100 devices; pending: {NO_DEVICE})"
    )
    return Measured(measured, verdict, "; ".join(why))


# -- CA-HFP on CIFAR-10 ---------------------------------------------------------------------

PRUNING_ORDER = ("full", "curvature", "magnitude", "random", "no-reconstruction")
PRUNING_NAMES = {
    "full": "full",
    "curvature": "curvature (Taylor form)",
    "magnitude": "magnitude",
    "random": "random",
    "no-reconstruction": "no reconstruction",
    "curvature-signed": "curvature (seed's signed score)",
}
NEAR_FULL = 0.02  # judgement: "stays near the full model" = within 2 points of its final mean
FULL_TARGET = 0.60  # issue 27: the full model past 60 %, the paper's regime in reach
PAPER_CIFAR_ACCURACY = 0.73


def _beats(s: Mapping[str, Any], a: str, b: str) -> bool:
    """``a`` above ``b`` in the final and last-3-round means and in every seed's final."""
    return (
        s[a]["final_accuracy"] > s[b]["final_accuracy"]
        and s[a]["last3_accuracy"] > s[b]["last3_accuracy"]
        and all(
            x["final_accuracy"] > y["final_accuracy"]
            for x, y in zip(s[a]["seeds"], s[b]["seeds"], strict=True)
        )
    )


def pruning_cifar(lines: Sequence[Line]) -> Measured:
    sizes = same_sizes(lines, ("rounds",))
    lines = sorted(lines, key=lambda line: line["sizes"]["rounds"])
    variants = [v for v in PRUNING_NAMES if v in lines[0]["settings"][0]]
    parts = []
    for line in lines:
        (s,) = line["settings"]
        finals = ", ".join(f"{PRUNING_NAMES[v]} {f3(s[v]['final_accuracy'])}" for v in variants)
        last3 = ", ".join(f3(s[v]["last3_accuracy"]) for v in variants)
        parts.append(
            f"{line['sizes']['rounds']} rounds: final {finals}; mean of the last 3 rounds {last3}"
        )
    (s0,) = lines[0]["settings"]
    measured = (
        f"{sizes['model']}, {sizes['dataset']}, {sizes['devices']} devices keeping "
        f"{sizes['keep_ratios'].replace(',', '/')} of the {sizes['budget']} "
        f"({s0['curvature']['kept_parameters']:.2f} of the model's parameters uploaded on "
        f"average), alpha {s0['alpha']:g}, seeds {sizes['seeds']}, all {len(variants)} variants "
        "side by side. " + ". ".join(parts)
    )
    (last,) = lines[-1]["settings"]
    rounds = lines[-1]["sizes"]["rounds"]
    others = ("magnitude", "random", "no-reconstruction")
    beaten = [v for v in others if _beats(last, "curvature", v)]
    near = last["full"]["final_accuracy"] - last["curvature"]["final_accuracy"] <= NEAR_FULL
    if near and len(beaten) == len(others):
        verdict = "holds"
    elif beaten:
        verdict = "partly"
    else:
        verdict = "does not"
    why = []
    for line in lines:
        (s,) = line["settings"]
        rank = sorted(PRUNING_ORDER, key=lambda v: -s[v]["final_accuracy"])
        paper = list(rank) == list(PRUNING_ORDER)
        spread = max(
            max(x["final_accuracy"] for x in s[v]["seeds"])
            - min(x["final_accuracy"] for x in s[v]["seeds"])
            for v in PRUNING_ORDER
        )

        def ahead(key: str, s: Mapping[str, Any] = s) -> float:
            return float(s["curvature"][key] - s["magnitude"][key])

        why.append(
            f"at {line['sizes']['rounds']} rounds the final means rank "
            + " > ".join(PRUNING_NAMES[v] for v in rank)
            + (" (the paper's order)" if paper else "")
            + f"; curvature minus magnitude {pts(ahead('final_accuracy'))} points at the end, "
            f"{pts(ahead('last3_accuracy'))} over the last 3 rounds, while one variant's seeds "
            f"lie up to {100 * spread:.1f} points apart"
        )
    missing = [PRUNING_NAMES[v] for v in others if v not in beaten]
    below = last["full"]["final_accuracy"] - last["curvature"]["final_accuracy"]
    why.append(
        f"at {rounds} rounds curvature beats "
        + (" and ".join(PRUNING_NAMES[v] for v in beaten) or "none of them")
        + " (final and last-3 means above, and the final above in every seed)"
        + (f", not {' or '.join(missing)}" if missing else "")
        + f"; it ends {100 * below:.1f} points below the full model (near: within "
        f"{100 * NEAR_FULL:g})"
    )
    why.append(
        f"{rounds} rounds of {sizes['devices']} devices reach {f3(last['full']['final_accuracy'])} "
        f"where the paper reports {PAPER_CIFAR_ACCURACY:.0%}"
        + ("" if "best_accuracy" in last["full"]["seeds"][0] else ": an early-training comparison")
    )
    if "best_accuracy" in last["full"]["seeds"][0]:
        best = [(x["best_accuracy"], x["best_round"]) for x in last["full"]["seeds"]]
        passed = sum(a > FULL_TARGET for a, _ in best)
        why.append(
            "the full model's best round per seed: "
            + ", ".join(f"{f3(a)} (round {r})" for a, r in best)
            + f", so it passed {FULL_TARGET:.0%} in {passed} of {len(best)} seeds at its best "
            "round; curvature's best rounds: "
            + ", ".join(f"{f3(x['best_accuracy'])}" for x in last["curvature"]["seeds"])
        )
    if "curvature-signed" in variants:
        signed_behind = all(
            _beats(line["settings"][0], "curvature", "curvature-signed") for line in lines
        )
        why.append(
            "the Taylor form beat the seed's signed score in every seed at every length, so it "
            "stays the default"
            if signed_behind
            else "the Taylor form did not beat the signed score in every seed"
        )
    return Measured(measured, verdict, "; ".join(why))


PRUNING_FIELD_NAMES = {
    "curvature": "CA-HFP (EdgeFleet's Taylor score)",
    "curvature-seed": "CA-HFP (the seed's signed Hutchinson score)",
    "full": "full model",
    "heterofl": "HeteroFL",
    "fedrolex": "FedRolex",
    "fjord": "FjORD",
}
PRUNING_FIELD_FORMS = ("curvature", "curvature-seed")
# Why a form is missing from a regime's files (said in its row).
PRUNING_UNRUN_WHY = {
    "curvature-seed": "its Hutchinson Hessian diagonal made a CIFAR-10 run take 17 min on this "
    "2-core machine against 2-6 min for the others, and the four rates of its sweep and its "
    "seeds did not fit the session; its Fashion-MNIST figures are in the row above",
}
PRUNING_FIELD_BASELINES = ("heterofl", "fedrolex", "fjord")
PRUNING_FIELD_PAPER = (
    "the paper (as the seed gives it): CIFAR-10 at alpha 0.1, CA-HFP 73.12 % and 62.84 % "
    "without reconstruction; it compares with FedMP and PruneFL, not with width slices"
)


def pruning_field(lines: Sequence[Line]) -> Measured:
    """CA-HFP's two scores against HeteroFL, FedRolex and FjORD at the same keep ratios, with
    the full model as the ceiling, each at the client learning rate its own seed-0 sweep
    picked (the sweep's file, then the seeds at the picks, as :func:`fedsag_field`)."""
    runs = FieldRuns.read(lines, PRUNING_FIELD_NAMES, ("seeds", "lrs", "variant_lr"))
    sizes, sweep, sw, st, lrs, chosen, seeds, per = (
        runs.sizes, runs.sweep, runs.sw, runs.st, runs.lrs, runs.chosen, runs.seeds, runs.per
    )  # fmt: skip
    variants = list(per)
    best = max(
        (v for v in PRUNING_FIELD_BASELINES if v in per), key=lambda v: mean(_finals(per[v]))
    )
    # As in fedsag_field: a baseline run on the sweep's seed only leaves the verdict against
    # the best baseline standing only if, on that seed, it ended below the best one's pick.
    at_pick = {v: sw[f"{v}@lr{chosen[v]:g}"]["last_accuracy"] for v in chosen}
    unseeded = [v for v in PRUNING_FIELD_BASELINES if v not in per]
    open_question = [v for v in unseeded if at_pick[v] >= at_pick[best]]
    seed_text = "; ".join(
        f"{PRUNING_FIELD_NAMES[v]} "
        + ", ".join(f3(x) for x in _finals(per[v]))
        + f" (mean {f3(mean(_finals(per[v])))}, uploads {st[v]['upload_vs_full']:.2f} of full)"
        for v in variants
    )
    measured = (
        f"{PRUNING_FIELD_PAPER}. Here: {sizes['dataset']}, {sizes['model']}, "
        f"{sizes['devices']} devices keeping {sizes['keep_ratios'].replace(',', '/')} of the "
        f"{sizes['budget']}, alpha {st['alpha']:g}, {sizes['rounds']} rounds of "
        f"{sizes['local_steps']} local steps, eval on {sizes['eval_samples']} test images; the "
        "width-slice baselines average each entry over the devices that hold it (their "
        f"papers' aggregation). Learning-rate sweep on seed {sweep['sizes']['seeds']}, client lr "
        f"{' / '.join(f'{x:g}' for x in lrs)}, mean accuracy of the last 5 rounds: "
        f"{sweep_summary(sw, lrs, chosen, PRUNING_FIELD_NAMES)}. At each pick, seeds "
        f"{', '.join(map(str, seeds))}, final accuracy per seed: {seed_text}; best baseline"
        + (" of those run at every seed" if unseeded else "")
        + f": {PRUNING_FIELD_NAMES[best]}"
    )
    verdicts, why = [], []
    full = mean(_finals(per["full"]))
    for f in (f for f in PRUNING_FIELD_FORMS if f in per):
        gap = full - mean(_finals(per[f]))
        beats = mean(_finals(per[f])) > mean(_finals(per[best])) and all(
            a > b for a, b in zip(_finals(per[f]), _finals(per[best]), strict=True)
        )
        ahead = sum(a > b for a, b in zip(_finals(per[f]), _finals(per[best]), strict=True))
        against = (
            "the best baseline not judged"
            if open_question
            else f"{'beats' if beats else 'does not beat'} the best baseline"
        )
        verdicts.append(
            f"{PRUNING_FIELD_NAMES[f]}: {'near' if gap <= NEAR_FULL else 'not near'} the full "
            f"model, {against}"
        )
        why.append(
            f"{PRUNING_FIELD_NAMES[f]} {pts(-gap)} points against the full model, "
            f"{pts(mean(_finals(per[f])) - mean(_finals(per[best])))} against "
            f"{PRUNING_FIELD_NAMES[best]} (above it in {ahead} of {len(seeds)} seeds)"
        )
    if unseeded:
        why.insert(
            0, _unseeded_note(PRUNING_FIELD_NAMES, unseeded, at_pick, best, bool(open_question))
        )
    unrun = [f for f in PRUNING_FIELD_FORMS if f not in per]
    verdicts += [f"{PRUNING_FIELD_NAMES[f]}: not run in this regime" for f in unrun]
    why += [
        f"{PRUNING_FIELD_NAMES[f]} not run in this regime "
        f"({PRUNING_UNRUN_WHY.get(f, 'not in the files')})"
        for f in unrun
    ]
    why.append(
        f"{sizes['rounds']} rounds of {sizes['model']} on {DATASET_NAMES[sizes['dataset']]}, "
        f"not the paper's regime (CIFAR-10 with the full model past 60 %; pending: {NO_DEVICE})"
    )
    return Measured(measured, "; ".join(verdicts), "; ".join(why))


# -- data-free early stopping -----------------------------------------------------------------

STOP_TOLERANCE = 0.015  # the benchmark's own 1.5-point target, applied to the means


def earlystop(lines: Sequence[Line]) -> Measured:
    sizes = same_sizes(lines, ("datasets",))
    parts, means, summary, why = [], {}, [], []
    for line in lines:
        (s,) = line["settings"]
        seeds, m, ds = s["seeds"], s["mean"], s["dataset"]
        budget = line["sizes"]["budget"]

        def listed(key: str, fmt: Callable[[Any], str], seeds: Any = seeds) -> str:
            return ", ".join(fmt(x[key]) for x in seeds)

        gaps = [x["data_free_bacc"] - x["reference_validation_bacc"] for x in seeds]
        later = [x["data_free_stop"] - x["reference_validation_stop"] for x in seeds]
        used = [x["data_free_stop"] / budget for x in seeds]
        parts.append(
            f"{ds}: data-free stopped at rounds {listed('data_free_stop', str)} with "
            f"{listed('data_free_bacc', f3)} (mean {f3(m['data_free_bacc'])}); the reference "
            f"rule at {listed('reference_validation_stop', str)} with "
            f"{listed('reference_validation_bacc', f3)} (mean "
            f"{f3(m['reference_validation_bacc'])}): data-free {', '.join(pts(g) for g in gaps)}"
            f" points against it, {min(later)}-{max(later)} rounds later, using "
            f"{min(used):.0%}-{max(used):.0%} of the budget; {m['gap_to_best_points']:.1f} "
            "points below the budget's best round on average"
        )
        means[ds] = m["data_free_bacc"] - m["reference_validation_bacc"]
        per_seed = line["targets_met"].get("within_1.5_points_of_reference_validation")
        if per_seed is False:
            worst = min(range(len(gaps)), key=lambda i: gaps[i])
            why.append(
                f"on {ds} the benchmark's per-seed target "
                "(`within_1.5_points_of_reference_validation`) is false: seed "
                f"{seeds_of(line)[worst]} is {pts(gaps[worst])} points from the reference"
            )
        stop_later = m["data_free_stop"] - m["reference_validation_stop"]
        summary.append(
            f"{ds}: mean {pts(means[ds])} points against the reference rule, "
            f"{stop_later:.1f} rounds later"
        )
    ok = [ds for ds, g in means.items() if g >= -STOP_TOLERANCE]
    verdict = "holds" if len(ok) == len(means) else ("partly" if ok else "does not")
    measured = (
        f"{sizes['model']}, {sizes['devices']} devices, Dirichlet {sizes['alpha']:g}, "
        f"{lines[0]['settings'][0]['strategy']}, {sizes['budget']}-round budget, seeds "
        f"{sizes['seeds']}, balanced accuracy at the stop round; the reference rule: "
        f"validation loss and accuracy, min-delta {sizes['val_min_delta']:g}, patience "
        f"{sizes['val_patience']}, its stop round's model. " + ". ".join(parts)
    )
    strategies = {line["settings"][0]["strategy"] for line in lines}
    if "fedprox" not in strategies:
        why.append("FedProx not run")
    return Measured(measured, verdict, "; ".join(summary + why))


def earlystop_seed_form(lines: Sequence[Line]) -> Measured:
    """The data-free rule as the seed writes it (squared norm, counter never reset) beside
    EdgeFleet's reference form and the validation rule, replayed on the same observed runs;
    and each form under the swept thresholds (``tau_sweep``)."""
    sizes = same_sizes(lines, ("datasets",))
    parts, ok, why = [], [], []
    settings = [(s, line["sizes"]["budget"]) for line in lines for s in line["settings"]]
    for s, budget in settings:
        seeds, m, ds = s["seeds"], s["mean"], s["dataset"]
        stops = ", ".join(str(x["seed_form_stop"] or budget) for x in seeds)
        sweep = "; ".join(
            f"tau {tau}: "
            + ", ".join(
                f"{form} {mean([x['tau_sweep'][tau][form]['stop'] or budget for x in seeds]):.0f}"
                f" rounds / {f3(mean([x['tau_sweep'][tau][form]['bacc'] for x in seeds]))}"
                for form in ("reference", "seed")
            )
            for tau in seeds[0]["tau_sweep"]
        )
        parts.append(
            f"{ds}: the seed's form stopped at rounds {stops} with "
            + ", ".join(f3(x["seed_form_bacc"]) for x in seeds)
            + f" (mean {f3(m['seed_form_bacc'])}); EdgeFleet's form at "
            + ", ".join(str(x["data_free_stop"] or budget) for x in seeds)
            + f" (mean {f3(m['data_free_bacc'])}); the validation rule mean "
            f"{f3(m['reference_validation_bacc'])}. Mean stop round / balanced accuracy by "
            f"threshold: {sweep}"
        )
        gap = m["seed_form_bacc"] - m["reference_validation_bacc"]
        if gap >= -STOP_TOLERANCE:
            ok.append(ds)
        why.append(
            f"{ds}: seed's form {pts(gap)} points against the validation rule, "
            f"{pts(m['seed_form_bacc'] - m['data_free_bacc'])} against EdgeFleet's form, "
            f"{m['seed_form_stop'] - m['data_free_stop']:+.1f} rounds"
        )
    verdict = "holds" if len(ok) == len(settings) else ("partly" if ok else "does not")
    measured = (
        f"{sizes['model']}, {sizes['devices']} devices, Dirichlet {sizes['alpha']:g}, "
        f"{sizes['budget']}-round budget, seeds {sizes['seeds']}, tau {sizes['tau']:g}, "
        f"patience {sizes['patience']}, both data-free forms replayed on the same observed "
        "runs, balanced accuracy at the stop round. " + ". ".join(parts)
    )
    return Measured(measured, verdict, "; ".join(why))


# -- warm start when devices arrive and depart ----------------------------------------------

WARM_PAPER_FACTOR = 10.0  # "an order of magnitude or more fewer rounds" (150 -> 1 in the paper)


def _per_seed_mean(fig: Mapping[str, Any], sessions: Sequence[int], cap: int) -> list[float]:
    """Each seed's mean rounds to target over ``sessions`` (1-based), unreached = ``cap``."""
    return [
        mean([cap if r[k - 1] is None else r[k - 1] for k in sessions])
        for r in fig["rounds_to_target_per_seed"]
    ]


def warmstart(lines: Sequence[Line]) -> Measured:
    parts, ratios, why = [], {}, []
    for line in lines:
        z = line["sizes"]
        cap = z["rounds_per_session"] + 1
        seen: dict[str, str] = {}  # a setting's figures -> the first strategy that gave them
        for s in line["settings"]:
            tag = f"{s['dataset']} {s['strategy']}"
            modes = s["modes"]
            figures = json.dumps(
                {m: f["rounds_to_target_per_seed"] for m, f in modes.items()}, sort_keys=True
            )
            if figures in seen:  # FedProx's small proximal term can leave every count equal
                why.append(f"{tag}: every seed's rounds to target equal to {seen[figures]}'s")
                continue
            seen[figures] = tag
            post, look = modes["pilot"]["post_pilot"], modes["pilot"]["lookalike"]

            def both(mode: str, modes: Any = modes) -> str:
                m = modes[mode]
                return (
                    f"{mode} {m['post_pilot']['rounds_to_target']:.1f} / "
                    f"{m['lookalike']['rounds_to_target']:.1f}"
                )

            seeds = {
                m: _per_seed_mean(modes[m], look["sessions"], cap) for m in ("pilot", "continuous")
            }
            n_seeds = len(seeds["pilot"])
            reached = {
                m: [modes[m]["sessions"][k - 1]["seeds_reached"] for k in look["sessions"]]
                for m in ("pilot", "continuous")
            }
            parts.append(
                f"{tag} ({z['model']}, {z['devices']} devices, {z['sessions']} sessions of "
                f"{z['rounds_per_session']} rounds, target {z['target']:g}, seeds {z['seeds']}): "
                + ", ".join(both(m) for m in ("pilot", "previous", "continuous"))
                + "; look-alike sessions per seed: pilot "
                + ", ".join(f"{x:.1f}" for x in seeds["pilot"])
                + ", continuous "
                + ", ".join(f"{x:.1f}" for x in seeds["continuous"])
            )
            r = s["ratios"]["continuous/pilot"]
            ratios[tag] = r["lookalike"]["aux_counted"]
            ahead = sum(p < c for p, c in zip(seeds["pilot"], seeds["continuous"], strict=True))
            why.append(
                f"{tag}: Continuous / pilot {ratios[tag]:.1f}x in look-alike sessions "
                f"(sessions {look['sessions'][0]}-{look['sessions'][-1]}; pilot ahead in "
                f"{ahead} of {n_seeds} seeds), {r['post_pilot']['aux_counted']:.1f}x "
                f"over all post-pilot sessions ({post['sessions'][0]}-{post['sessions'][-1]}; "
                f"{', '.join(str(k) for k in post['sessions'] if k not in look['sessions'])} "
                "have nothing of their own group stored); previous / pilot "
                f"{s['ratios']['previous/pilot']['lookalike']['aux_counted']:.1f}x look-alike; "
                f"look-alike sessions that reached the target: pilot {sum(reached['pilot'])}, "
                f"continuous {sum(reached['continuous'])} of {n_seeds * len(look['sessions'])}; "
                f"a ratio here is at most {cap} (a session of "
                f"{cap - 1} rounds, unreached counted as {cap}), so the paper's 150x cannot show"
            )
            never = [
                k
                for k in post["sessions"]
                if all(r[k - 1] is None for r in modes["pilot"]["rounds_to_target_per_seed"])
            ]
            if never:
                why.append(
                    f"{tag}: pilot's session(s) {', '.join(map(str, never))} reached the target "
                    "in no seed (weighing only post-pilot sessions, session "
                    f"{z['pilot_sessions'] + 2} has only the other group's model to start from)"
                )
            if ratios[tag] < 1:
                look_rounds = {m: modes[m]["lookalike"]["rounds_to_target"] for m in modes}
                why.append(
                    f"{tag}: Continuous is ahead: it starts each look-alike session from the "
                    "last session's model, trained on the other group, and reached the target in "
                    f"{look_rounds['continuous']:.1f} rounds where previous, the same start "
                    f"without the KL term, took {look_rounds['previous']:.1f}: the KL term to the "
                    "last session's model keeps the earlier group's classes"
                )
    first = lines[0]["sizes"]
    measured = (
        "two device groups with disjoint labels alternating session by session (Dirichlet "
        f"{first['alpha']:g} within a group), {first['pilot_sessions']} pilot session, "
        "the reference's per-session lr decay and reset after the pilot; the warm start "
        "weighs only post-pilot sessions (the reference's rule); rounds to target on the "
        "session's classes, auxiliary rounds counted, mean over seeds, post-pilot sessions / "
        "look-alike sessions (a session of the same group stored). " + ". ".join(parts)
    )
    if all(r >= WARM_PAPER_FACTOR for r in ratios.values()):
        verdict = "holds"
    elif any(r > 1 for r in ratios.values()):
        verdict = "partly"
    else:
        verdict = "does not"
    return Measured(measured, verdict, "; ".join(why))


WARM_MODES = ("pilot", "average", "fresh", "previous", "continuous")
WARM_MODE_NAMES = {
    "pilot": "pilot (similarity-weighted)",
    "average": "average (uniform over stored models)",
    "fresh": "fresh (the initial model)",
    "previous": "previous (last session's model)",
    "continuous": "Continuous",
}


def warmstart_modes(lines: Sequence[Line]) -> Measured:
    """The pilot warm start against its own simpler starts (``average``, ``fresh``) and the
    two last-model baselines, look-alike sessions, auxiliary rounds counted."""
    (line,) = lines
    z = line["sizes"]
    cap = z["rounds_per_session"] + 1
    (s,) = line["settings"]
    modes = s["modes"]
    look = modes["pilot"]["lookalike"]["sessions"]
    per = {m: _per_seed_mean(modes[m], look, cap) for m in WARM_MODES if m in modes}
    text = "; ".join(
        f"{WARM_MODE_NAMES[m]} {modes[m]['lookalike']['rounds_to_target']:.1f} (per seed "
        + ", ".join(f"{x:.1f}" for x in per[m])
        + ")"
        for m in per
    )
    measured = (
        f"{s['dataset']}, {z['model']}, {s['strategy']}, {z['devices']} devices in two groups "
        f"with disjoint labels alternating (Dirichlet {z['alpha']:g} within a group), "
        f"{z['sessions']} sessions of {z['rounds_per_session']} rounds, {z['pilot_sessions']} "
        f"pilot session, target {z['target']:g}, seeds {z['seeds']}; mean rounds to target in "
        f"the look-alike sessions ({look[0]}-{look[-1]}), auxiliary rounds counted: {text}"
    )
    simple = [m for m in ("average", "fresh") if m in per]
    beaten = [m for m in simple if all(p < b for p, b in zip(per["pilot"], per[m], strict=True))]
    verdict = (
        "holds" if beaten == simple else ("partly" if beaten else "does not")
    ) + f" against {' and '.join(simple)}"
    why = [
        f"{m}/pilot {s['ratios'][f'{m}/pilot']['lookalike']['aux_counted']:.1f}x, pilot fewer "
        f"rounds in {sum(p < b for p, b in zip(per['pilot'], per[m], strict=True))} of "
        f"{len(per['pilot'])} seeds"
        for m in per
        if m != "pilot"
    ]
    why.append(
        f"a ratio here is at most {cap} (sessions of {cap - 1} rounds, unreached counted as "
        f"{cap}); {s['strategy']} only, not the paper's other inner algorithms"
    )
    return Measured(measured, verdict, "; ".join(why))


# -- the table -------------------------------------------------------------------------------

ROWS: tuple[Row, ...] = (
    Row(
        "Warm start when devices arrive and depart (arXiv 2410.05662)",
        "a session whose device group was seen before starts from the similarity-weighted "
        "stored models and reaches the target in an order of magnitude fewer rounds than the "
        "Continuous baseline (cross-entropy + KL to the last session's model): 150 -> 1 on "
        "TinyImageNet; the reference's MNIST regime (linear model) and CIFAR-10 (SmallCNN)",
        (
            "warmstart_claims-mnist-continuous-2026-12-03.json",
            "warmstart_claims-cifar10-continuous-2026-12-03.json",
        ),
        warmstart,
        "on the look-alike sessions (the claim's case) with auxiliary rounds counted; holds: "
        f"Continuous / pilot at least {WARM_PAPER_FACTOR:g}x in every setting; partly: pilot "
        "ahead (above 1x) in some setting; does not: in none",
    ),
    Row(
        "Warm start against its own baselines, MNIST (arXiv 2410.05662)",
        "the similarity-weighted start (pilot) is what makes the gain, not any start from "
        "stored models: beside the uniform average of the stored models (`average`), the "
        "initial model (`fresh`) and the last session's model with and without the KL term "
        "(Continuous, `previous`); the reference's MNIST regime",
        ("warmstart_claims-mnist-modes-2026-12-06.json",),
        warmstart_modes,
        "on the look-alike sessions with auxiliary rounds counted; holds: the pilot start takes "
        "fewer rounds to the target than `average` and than `fresh` in every seed (mean over the "
        "look-alike sessions, an unreached session counted as the session length + 1); partly: "
        "than one of them",
    ),
    Row(
        "Warm start against its own baselines, CIFAR-10 (arXiv 2410.05662)",
        "the MNIST row's question on CIFAR-10 SmallCNN: pilot against `average` and `fresh` "
        "(Continuous and `previous`, made with the same command and seeds, are in the first "
        "warm-start row's CIFAR-10 file)",
        ("warmstart_claims-cifar10-modes-2026-12-06.json",),
        warmstart_modes,
        "as the MNIST row",
    ),
    Row(
        "EH-FedSAG, paper's regime (arXiv 2606.18758)",
        "SAGA memory makes EH-FedAvg stable when energy is scarce and data non-IID: late-stage "
        "variance 0.94 -> 0.04, about +3 points; CIFAR-10, SmallCNN, K 100, M 25, P_h 0.02 "
        "and 0.06, alpha 0.1 and 1.0, 1,000 rounds (the seed's figure; run here for 300)",
        (
            "fedsag_claims-cifar10-a0.1-2026-12-01.json",
            "fedsag_claims-cifar10-a1.0-s0-2026-12-01.json",
            "fedsag_claims-cifar10-a1.0-s1-2026-12-01.json",
        ),
        fedsag_cifar,
        "EdgeFleet's form of FedSAG (corrections 1/max(participants, M), memory mean over "
        "the fleet); holds: EH-FedSAG's mean final accuracy above EH-FedAvg's in every "
        "setting and its late "
        f"variance lower wherever EH-FedAvg leaves chance (final >= {CHANCE_PLUS}); "
        f'"larger than claimed" when the largest gain is over twice the paper\'s '
        f"{100 * FEDSAG_PAPER_GAIN:g} points; partly: above in some settings",
    ),
    Row(
        "EH-FedSAG, the seed's form, paper's regime (arXiv 2606.18758)",
        "the same claim, for the estimator as the seed writes it: corrections weighted "
        "1/participants, memory mean over the stored memories",
        (
            "fedsag_claims-cifar10-a1.0-seedform-ph0.02-2026-12-01.json",
            "fedsag_claims-cifar10-a1.0-s0-2026-12-01.json",
            "fedsag_claims-cifar10-a1.0-s1-2026-12-01.json",
        ),
        fedsag_seed_form,
        "holds: the seed's form ends above EH-FedAvg in every run; does not: below in every run",
    ),
    Row(
        "EH-FedSAG against the field, Fashion-MNIST on CPU (arXiv 2606.18758)",
        "the same claim, asked as a user asks it: do FedSAG's two forms beat what one would "
        "otherwise use (EH-FedAvg, MIFA, FedVARP, SCAFFOLD) under the same batteries and "
        "energy-age selection, each method at its own learning rate from the same sweep?",
        (
            "fedsag_claims-field-fmnist-a0.1-ph0.05-sweep-2026-12-06.json",
            "fedsag_claims-field-fmnist-a0.1-ph0.05-seeds-2026-12-06.json",
        ),
        fedsag_field,
        "each method at the client lr its seed-0 sweep picks (the highest mean accuracy over the "
        "last 5 rounds; a tie to the smaller), then seeds 0-2 at that lr. For each form of "
        "FedSAG: the paper's direction holds when its mean final accuracy is above EH-FedAvg's "
        "and its mean late variance below (the variance not compared where EH-FedAvg's mean "
        f"final stays under {CHANCE_PLUS}), partly when one of the two, does not when neither; it "
        "beats the best baseline (of EH-FedAvg, MIFA, FedVARP and SCAFFOLD, the highest mean "
        "final accuracy) when its mean final accuracy is above that baseline's and its final is "
        "above in every seed",
    ),
    Row(
        "EH-FedSAG against the field, CIFAR-10 on CPU (arXiv 2606.18758)",
        "the Fashion-MNIST row's question on the paper's data set, CIFAR-10 SmallCNN, sized to "
        "about an hour on 2 cores",
        (
            "fedsag_claims-field-cifar10-a0.1-ph0.05-sweep-2026-12-06.json",
            "fedsag_claims-field-cifar10-a0.1-ph0.05-seeds-2026-12-06.json",
        ),
        fedsag_field,
        "as the Fashion-MNIST row",
    ),
    Row(
        "CA-HFP on CIFAR-10 (arXiv 2603.12591)",
        "curvature-aware structured pruning stays near the full model and beats magnitude and "
        "random pruning; without server reconstruction accuracy drops; resnet8, the paper's "
        "data set, beside the seed's signed score",
        ("pruning_claims-cifar10-2026-12-01.json", "pruning_claims-cifar10-50r-2026-12-01.json"),
        pruning_cifar,
        "at the longest run, curvature beats a variant when its final and last-3-round means are "
        "both above and its final is above in every seed; holds: it beats magnitude, random and "
        f"no reconstruction and ends within {100 * NEAR_FULL:g} points of full; partly: it "
        "beats some",
    ),
    Row(
        "CA-HFP on CIFAR-10, longer (arXiv 2603.12591)",
        "the same claim, run long enough for the full model to approach the paper's regime "
        "(25 local steps of 64 a round; the paper reports 73% for the full model)",
        ("pruning_claims-cifar10-124r-h200-2026-12-04.json",),
        pruning_cifar,
        "as the row above, on this run",
    ),
    Row(
        "CA-HFP against the field, Fashion-MNIST on CPU (arXiv 2603.12591)",
        "the same claim, asked as a user asks it: does CA-HFP beat the width-slice methods one "
        "would otherwise use for devices of different compute (HeteroFL, FedRolex, FjORD) at "
        "the same keep ratios, each method at its own learning rate from the same sweep?",
        (
            "pruning_claims-field-fmnist-a0.1-sweep-2026-12-06.json",
            "pruning_claims-field-fmnist-a0.1-seeds-2026-12-06.json",
        ),
        pruning_field,
        "each method at the client lr its seed-0 sweep picks (the highest mean accuracy over the "
        "last 5 rounds; a tie to the smaller), then seeds 0-2 at that lr. For each CA-HFP score: "
        f"near the full model when its mean final accuracy is within {100 * NEAR_FULL:g} points "
        "of the full model's; it beats the best baseline (of HeteroFL, FedRolex and FjORD, the "
        "highest mean final accuracy) when its mean final accuracy is above that baseline's and "
        "its final is above in every seed",
    ),
    Row(
        "CA-HFP against the field, CIFAR-10 on CPU (arXiv 2603.12591)",
        "the Fashion-MNIST row's question on the paper's data set, CIFAR-10 SmallCNN, sized to "
        "about an hour on 2 cores",
        (
            "pruning_claims-field-cifar10-a0.1-sweep-2026-12-06.json",
            "pruning_claims-field-cifar10-a0.1-seeds-2026-12-06.json",
        ),
        pruning_field,
        "as the Fashion-MNIST row",
    ),
    Row(
        "Data-free stopping (arXiv 2601.22669)",
        "stopping when the global task vector stops growing lands close to the reference "
        "validation rule, with no data",
        ("earlystop_claims-pneumonia-2026-12-01.json", "earlystop_claims-bccd-2026-12-01.json"),
        earlystop,
        "holds: on every data set the mean balanced accuracy at the data-free stop is at most "
        f"{100 * STOP_TOLERANCE:g} points below the reference rule's (the benchmark's own "
        "threshold, on the means); partly: on some",
    ),
    Row(
        "Data-free stopping, the seed's form (arXiv 2601.22669)",
        "the same claim for the rule as the seed writes it: the squared norm "
        "||theta_r - theta_0||^2 and a counter of slow rounds never reset "
        '(`stopping.form = "seed"`)',
        ("earlystop_claims-seedform-pneumonia-bccd-2026-12-06.json",),
        earlystop_seed_form,
        "as the row above, for the seed's form replayed on the same observed runs: holds when on "
        "every data set its mean balanced accuracy at its stop is at most "
        f"{100 * STOP_TOLERANCE:g} points below the validation rule's",
    ),
)

FEDSAG_MNIST_SETS = (
    "federation.num-supernodes=50",
    "selection.max-devices=10",
    "alpha=0.1",
    "energy.harvest-prob=0.05",
    'energy.harvest-probs=""',
    "energy.capacity=8",
    "local-steps=10",
    "eval-samples=1000",
    "num-server-rounds=120",
    "seed=11",
)

FIELD_VARIANTS = "fedavg,fedsag,fedsag-seed,mifa,fedvarp,scaffold"

UNMEASURED: tuple[Unmeasured, ...] = (
    Unmeasured(
        "EH-FedSAG against the field, the paper's regime (arXiv 2606.18758)",
        "the seed's 1,000 CIFAR-10 rounds (K 100, M 25, P_h 0.02 and 0.06, alpha 0.1 and 1.0): "
        "FedSAG's two forms against EH-FedAvg, MIFA, FedVARP and SCAFFOLD, each at its own "
        "learning rate from the same sweep",
        "python -m benchmarks.claims.fedsag_claims --dataset cifar10 --data-dir ../shared/data "
        "--devices 100 --max-devices 25 --rounds 1000 --alphas 0.1,1.0 --harvest-probs 0.02,0.06 "
        f"--seeds 0 --lrs 0.01,0.03,0.1 --variants {FIELD_VARIANTS} --eval-samples 1000 "
        "--engine inprocess",
        "then `--seeds 0,1,2` with one `--variant-lr VARIANT=LR` per variant, the sweep's "
        "`chosen_lr`, on the same `--out`",
        NO_DEVICE,
    ),
    Unmeasured(
        "CA-HFP against the field, the paper's regime (arXiv 2603.12591)",
        "CIFAR-10 with the full model past 60 %: CA-HFP and the seed's signed Hutchinson score "
        "against HeteroFL, FedRolex and FjORD at the same keep ratios",
        "python -m benchmarks.claims.pruning_claims --dataset cifar10 --model resnet8 --alphas 0.1 "
        "--seeds 0,1,2 --devices 4 --local-steps 25 --batch-size 64 --rounds 124 "
        "--variants full,curvature,curvature-signed,curvature-hutchinson,magnitude,random,"
        "no-reconstruction --engine inprocess --data-dir ../shared/data",
        "the Fashion-MNIST row's variants and sweep on CIFAR-10: add "
        "`curvature-seed,heterofl,fedrolex,fjord` to `--variants` and `--lrs 0.01,0.03,0.1,0.3` "
        "on seed 0, then `--variant-lr` per variant",
        NO_DEVICE,
    ),
    Unmeasured(
        "EH-FedSAG (arXiv 2606.18758)",
        "SAGA memory makes EH-FedAvg stable when energy is scarce and data non-IID (late-stage "
        "variance about 20x lower, about +3 points); the issue's mnist-5k reproducer",
        "edgefleet run scenarios/eh-fedsag.toml "
        + " ".join(f"--set {s}" for s in FEDSAG_MNIST_SETS),
        "with `seed=12` and `seed=13`, and each with `--set strategy=fedavg`; it writes run "
        "folders, not a results line: no benchmark runs this setting yet",
    ),
    Unmeasured(
        "CA-HFP (arXiv 2603.12591)",
        "curvature-aware structured pruning stays near the full model and beats magnitude and "
        "random pruning; without server reconstruction accuracy drops (full MNIST)",
        "python -m benchmarks.claims.pruning_claims --data-dir ../shared/data --budget channels "
        "--variants full,curvature,magnitude,random,no-reconstruction "
        "> benchmarks/results/pruning_claims-mnist-channels-DATE.json",
        "`--budget channels`: a keep ratio meant a share of channels when this row was last "
        "measured",
    ),
)


def _minutes(line: Mapping[str, Any]) -> str:
    wall = line.get("wall_s")
    if wall is None:
        return "wall time not recorded"
    if wall < 60:  # a line made from runs its --out already held: the runs' time is elsewhere
        return f"{wall:.0f} s, its runs reused from an earlier invocation"
    return f"{wall / 60:.0f} min"


def _command_cell(row: Row, lines: Sequence[Line]) -> str:
    cells = []
    for name, line in zip(row.files, lines, strict=True):
        recovered = (line.get("provenance") or {}).get("recorded_by_run") is False
        cells.append(
            f"`{line['command']}` ({_minutes(line)}; `benchmarks/results/{name}`"
            + ("; command recovered from git history" if recovered else "")
            + ")"
        )
    return "<br>".join(cells)


def markdown() -> str:
    """What goes between the claims page's claims-table markers (the markers included)."""
    out = [
        BEGIN,
        "| paper | claim | measured here | command (wall time; results file) | verdict "
        "| why, where it falls short | verdict rule |\n",
        "|---|---|---|---|---|---|---|\n",
    ]
    for row in ROWS:
        lines = [load(name) for name in row.files]
        m = row.measure(lines)
        cells = (row.paper, row.claim, m.measured, _command_cell(row, lines), m.verdict, m.why)
        out.append("| " + " | ".join((*cells, row.rule)) + " |\n")
    out.append(
        "\nNot measured with a committed results file, so no figures are quoted (the command "
        "writes one):\n\n"
    )
    for u in UNMEASURED:
        note = f" ({u.note})" if u.note else ""
        pending = f" (pending: {u.pending})" if u.pending else ""
        out.append(f"- **{u.paper}**{pending}: {u.claim}. Run `{u.command}`{note}.\n")
    out.append(END)
    return "".join(out)


if __name__ == "__main__":  # python -m benchmarks.claims.table: print the claims table
    sys.stdout.write(markdown())
