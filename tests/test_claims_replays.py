"""Pure parts of the claims benchmarks added for issue 46 (no runs): the data-free rule's
seed form replayed on recorded norms, the width-slice baselines' run configs, and the async
run's versions in ``link_fleet`` when it may spend more device updates."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.claims import earlystop_claims as es
from benchmarks.claims import pruning_claims as pc
from benchmarks.perf import link_fleet as lf
from edgefleet.config import parse_run_config


def _rows(norms: list[float]) -> list[dict[str, Any]]:
    return [
        {"round": r, "task_vector_norm": n, "participants": [1]}
        for r, n in enumerate(norms, start=1)
    ]


def test_seed_form_counts_slow_rounds_it_never_resets_on_the_squared_norm() -> None:
    # Growth of the plain norm per round: +10 %, +0.3 %, +10 %, +0.3 %, +0.3 %.
    norms = [1.0, 1.1, 1.1033, 1.21363, 1.217271, 1.220923]
    rows = _rows(norms)
    # tau 0.005, patience 2. Reference: the +10 % round resets the counter, so the rule
    # fires at the second slow round in a row (round 6).
    assert es.data_free_stop(rows, 0.005, 2) == 6
    # Seed: squared-norm growth is (1 + g)^2 - 1, 0.6 % for g = 0.3 % (not under 0.005),
    # so at tau 0.005 no round counts...
    assert es.data_free_stop(rows, 0.005, 2, "seed") is None
    # ... and at tau 0.007 the slow rounds 3, 5 count without a reset: fires at round 5.
    assert es.data_free_stop(rows, 0.007, 2, "seed") == 5
    assert es.data_free_stop(rows, 0.007, 2) == 6


def test_a_nan_norm_stops_either_form_as_diverged() -> None:
    rows = _rows([1.0, float("nan"), 1.0])
    assert es.data_free_stop(rows, 0.005, 5) == es.data_free_stop(rows, 0.005, 5, "seed") == 2


@pytest.mark.parametrize("variant", ["heterofl", "fedrolex", "fjord", "curvature-seed"])
def test_the_field_variants_are_run_configs_edgefleet_accepts(variant: str) -> None:
    cfg = parse_run_config({"pruning.keep-ratios": "1.0,0.5", **pc.VARIANTS[variant]})
    assert cfg.pruning.criterion == {
        "heterofl": "prefix", "fedrolex": "rolling", "fjord": "ordered-dropout",
    }.get(variant, "curvature")  # fmt: skip
    if variant != "curvature-seed":
        assert cfg.pruning.reconstruction == "elementwise"


@pytest.mark.parametrize(("x", "versions"), [(1.0, 16), (2.0, 32), (1.5, 24), (0.1, 2), (0.01, 1)])
def test_async_versions_scale_with_the_update_budget(x: float, versions: int) -> None:
    assert lf.async_versions(8, 4, 2, x) == versions
