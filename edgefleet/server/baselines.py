"""The field's baselines built from the run config (``strategy = "mifa" | "fedvarp" |
"scaffold"``), apart from :func:`edgefleet.server.app.build_strategy` so that adding one
touches one file. Each is a Flower message-API strategy of :mod:`edgefleet.strategies`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.serverapp.strategy import Strategy

from edgefleet.config import RunConfig
from edgefleet.strategies.fedvarp import FedVARP
from edgefleet.strategies.mifa import MIFA
from edgefleet.strategies.scaffold import Scaffold

BASELINES: tuple[str, ...] = ("mifa", "fedvarp", "scaffold")


def build_baseline(cfg: RunConfig, common: Mapping[str, Any]) -> Strategy:
    """The aggregator for ``cfg.server.strategy``, one of :data:`BASELINES`."""
    name, srv = cfg.server.strategy, cfg.server
    if name in ("mifa", "fedvarp"):
        cls = MIFA if name == "mifa" else FedVARP
        return cls(
            server_lr=cfg.saga.server_lr,
            robust=cfg.robust.rule,
            robust_params=cfg.robust.params(),
            max_age=cfg.saga.max_age,
            **common,
        )
    if name == "scaffold":
        t = cfg.train
        return Scaffold(
            local_steps=t.local_steps,
            lr=t.lr,
            momentum=t.momentum,
            server_lr=cfg.saga.server_lr,
            **common,
        )
    raise ValueError(f"strategy {name!r} is not a baseline; valid: {', '.join(BASELINES)}")
