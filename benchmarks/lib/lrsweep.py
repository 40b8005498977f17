"""The learning-rate sweep that every method of a claims comparison gets (issue 46: no row
stands against an untuned baseline).

``--lrs 0.01,0.03,0.1`` runs every variant at each rate and picks each variant's rate by
:data:`LR_RULE` (``chosen_lr`` in the results line); ``--variant-lr VARIANT=LR`` then runs
each variant at its pick over more seeds. A benchmark adds the two flags with
:func:`add_lr_args`, turns them into runs with :func:`lr_arms` and names a run by its
``(label, variant, lr, tagged)`` arm.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

# How --lrs picks a variant's learning rate: the highest mean test accuracy over the last 5
# evaluated rounds (less noisy than the final round alone), mean over the seeds swept; on a
# tie, the smaller learning rate.
LAST = 5
LR_RULE = (
    f"the learning rate with the highest mean test accuracy over the last {LAST} rounds "
    "(mean over the seeds swept); on a tie the smaller; a learning rate whose run stopped "
    "early in some seed (every reply rejected, e.g. non-finite) only if every one did"
)

Arm = tuple[str, str, float, bool]


def parse_lrs(text: str) -> list[float]:
    """``--lrs``: comma-separated learning rates, each a finite number > 0, none twice."""
    lrs = []
    for item in (x.strip() for x in text.split(",")):
        try:
            lr = float(item)
        except ValueError:
            raise ValueError(f"--lrs: {item!r} is not a number") from None
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"--lrs: {item!r} must be a finite number > 0")
        if lr in lrs:
            raise ValueError(f"--lrs: {item!r} given twice")
        lrs.append(lr)
    return lrs


def parse_variant_lrs(items: list[str], variants: list[str]) -> dict[str, float]:
    """``--variant-lr VARIANT=LR`` (repeatable): each named variant runs at its own lr."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = (x.strip() for x in item.partition("="))
        if not sep:
            raise ValueError(f"--variant-lr {item!r}: expected VARIANT=LR")
        if name not in variants:
            raise ValueError(
                f"--variant-lr {item!r}: {name!r} is not among --variants ({', '.join(variants)})"
            )
        if name in out:
            raise ValueError(f"--variant-lr {item!r}: {name} given twice")
        lrs = parse_lrs(value)
        if len(lrs) != 1:
            raise ValueError(f"--variant-lr {item!r}: one lr per variant")
        out[name] = lrs[0]
    return out


def arms(
    variants: list[str], lrs: list[float], variant_lrs: dict[str, float], lr: float
) -> list[Arm]:
    """(label, variant, lr, tagged) for each run of a seed; ``tagged``: the run name and
    the label carry the lr (a sweep or a variant's own lr)."""
    if lrs and variant_lrs:
        raise ValueError("--lrs and --variant-lr: give one (the sweep, or each variant's pick)")
    if lrs:
        return [(f"{v}@lr{x:g}", v, x, True) for v in variants for x in lrs]
    return [(v, v, variant_lrs.get(v, lr), bool(variant_lrs)) for v in variants]


def choose_lrs(row: dict[str, Any], arm_list: list[Arm]) -> dict[str, float]:
    """Each variant's learning rate by :data:`LR_RULE` from a sweep's summaries in ``row``
    (per label: ``last_accuracy`` and, where runs can stop early, ``seeds_stopped``)."""
    best: dict[str, tuple[bool, float, float]] = {}
    for label, variant, lr, _ in arm_list:
        # (ran every round, accuracy, -lr): the largest wins
        key = (not row[label].get("seeds_stopped", 0), row[label]["last_accuracy"], -lr)
        if variant not in best or key > best[variant]:
            best[variant] = key
    return {v: -key[2] for v, key in best.items()}


def add_lr_args(p: argparse.ArgumentParser) -> None:
    """``--lr``'s siblings: ``--lrs`` (the sweep) and ``--variant-lr`` (each variant's pick)."""
    p.add_argument("--lrs", default="", help="sweep: every variant at each lr (e.g. 0.01,0.03,0.1)")
    p.add_argument(
        "--variant-lr",
        action="append",
        default=[],
        metavar="VARIANT=LR",
        help="a variant's own lr (a sweep's pick); the others run at --lr",
    )


def lr_arms(p: argparse.ArgumentParser, args: argparse.Namespace, variants: list[str]) -> list[Arm]:
    """The runs of one seed from ``--lr``, ``--lrs`` and ``--variant-lr``; a bad value is a
    usage error naming it."""
    try:
        return arms(
            variants,
            parse_lrs(args.lrs) if args.lrs.strip() else [],
            parse_variant_lrs(args.variant_lr, variants),
            args.lr,
        )
    except ValueError as e:
        p.error(str(e))
