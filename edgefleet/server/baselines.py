"""The aggregator innermost in EdgeFleet's stack, one factory per ``strategy``: Flower's
``FedAvg`` and ``FedProx``, FedSAG and the field's baselines (MIFA, FedVARP, SCAFFOLD), each
built from its config sections by its own ``from_config``. Apart from
:func:`edgefleet.server.app.build_strategy` (which wraps it) so that adding an aggregator
touches this table and its name in :class:`edgefleet.config.StrategyName`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

from edgefleet.config import RunConfig, SelectionMode, StrategyName
from edgefleet.strategies.equalweight import EqualWeightFedAvg
from edgefleet.strategies.fedsag import FedSAG
from edgefleet.strategies.fedvarp import FedVARP
from edgefleet.strategies.mifa import MIFA
from edgefleet.strategies.scaffold import Scaffold

# (cfg, Flower's FedAvg keyword arguments) -> the aggregator.
Aggregator = Callable[[RunConfig, dict[str, Any]], Strategy]

BASELINES: tuple[str, ...] = (StrategyName.MIFA, StrategyName.FEDVARP, StrategyName.SCAFFOLD)


def _fedavg(cfg: RunConfig, common: dict[str, Any]) -> Strategy:
    # Under energy-aware selection the plain mean of the participants: EH-FedAvg, the
    # paper's baseline (FedSAG's direction is a plain mean too).
    if cfg.energy.selection == SelectionMode.ENERGY_AGE:
        return EqualWeightFedAvg(**common)
    return FedAvg(**common)


AGGREGATORS: dict[str, Aggregator] = {
    StrategyName.FEDAVG: _fedavg,
    StrategyName.FEDPROX: lambda cfg, common: FedProx(proximal_mu=cfg.train.proximal_mu, **common),
    # FedSAG weights corrections 1/max(|S|, M), M the participant cap an energy-age selection
    # around it declares (none without one: the seed's 1/|S|), as in any app.
    StrategyName.FEDSAG: lambda cfg, common: FedSAG.from_config(cfg.saga, cfg.robust, **common),
    StrategyName.MIFA: lambda cfg, common: MIFA.from_config(cfg.saga, cfg.robust, **common),
    StrategyName.FEDVARP: lambda cfg, common: FedVARP.from_config(cfg.saga, cfg.robust, **common),
    StrategyName.SCAFFOLD: lambda cfg, common: Scaffold.from_config(cfg.train, cfg.saga, **common),
}
