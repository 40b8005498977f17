"""Energy-aware age-based selection (EH-FedSAG, arXiv 2606.18758) around any strategy.

Each round the server broadcasts the global slot clock in a light ``query`` message; a
device advances its battery to that slot and answers with its level and whether it can
afford a round (Omega training slots + 1 transmission slot). No answer (offline, error)
means unavailable. Among the feasible devices the server takes up to M (orthogonal uplink
channels) with the largest age (rounds since their last upload), ties broken by a seeded
RNG, and only those get the train message. Ages reset on upload.

Devices are asked in descending age, ``batch_size`` at a time, until M feasible ones have
answered: the rule picks the oldest feasible devices, so asking the rest could not change
the selection, and a round's cost stays proportional to M rather than to the fleet
(``batch_size = 0`` asks everyone at once). Wrapped around FedAvg this is EH-FedAvg, around
:class:`~edgefleet.strategies.fedsag.FedSAG` it is EH-FedSAG.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefleet.server.loop import RoundCallback, RoundResult
from edgefleet.strategies.base import LoopStrategy, SubsetGrid, query_status
from edgefleet.strategies.selection import AgeTracker, query_order, select_in_batches


class EnergyAgeSelection(LoopStrategy, RoundCallback):
    def __init__(
        self,
        inner: Strategy,
        max_devices: int,
        slots_per_round: int,
        batch_size: int = 0,
        seed: int = 0,
        query_timeout: float = 60.0,
    ) -> None:
        super().__init__(inner)
        self.max_devices = max_devices
        self.slots_per_round = slots_per_round
        self.batch_size = batch_size
        self.query_timeout = query_timeout
        self.rng = np.random.default_rng(seed)
        self.ages = AgeTracker()
        self.device_of_node: dict[int, str] = {}
        self._queried = 0
        self._selected: list[str] = []

    def own_callbacks(self) -> list[RoundCallback]:
        return [self]

    def slot(self, server_round: int) -> int:
        return (server_round - 1) * self.slots_per_round

    def _status(self, grid: Grid, nodes: list[int], server_round: int) -> dict[int, bool]:
        """Ask ``nodes`` for their battery at this round's slot; feasibility per node."""
        answers = query_status(grid, nodes, server_round, self.slots_per_round, self.query_timeout)
        for node, status in answers.items():
            self.device_of_node[node] = status.device
        devices = [a.device for a in answers.values()]
        self.ages.register(devices)
        self.register_devices(devices)
        return {node: status.feasible for node, status in answers.items()}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        nodes = list(grid.get_node_ids())
        # Order by the age of the device behind each node; a node not seen yet is a
        # newcomer (its age: every round so far, as AgeTracker gives newcomers).
        ages = {
            str(n): self.ages.ages.get(self.device_of_node.get(n, ""), self.ages.rounds)
            for n in nodes
        }
        order = query_order(ages, ages, self.rng)
        batch = self.batch_size or max(1, len(order))

        def feasible(batch_ids: list[str]) -> dict[str, bool]:
            answers = self._status(grid, [int(i) for i in batch_ids], server_round)
            return {str(n): ok for n, ok in answers.items()}

        chosen, self._queried = select_in_batches(order, feasible, self.max_devices, batch)
        self._selected = [self.device_of_node[int(n)] for n in chosen]
        log(
            INFO,
            "energy-age selection: %d of %d nodes selected (%d asked)",
            len(chosen),
            len(nodes),
            self._queried,
        )
        if not chosen:
            return []
        config = ConfigRecord({**dict(config), "slot": self.slot(server_round)})
        subset = SubsetGrid(grid, [int(n) for n in chosen])
        return self.inner.configure_train(server_round, arrays, config, subset)  # type: ignore[arg-type]

    def after_round(self, result: RoundResult) -> str | None:
        self.ages.on_round(result.participants)
        result.extra["status_queries"] = self._queried
        result.extra["selected"] = self._selected
        return None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            ages=self.ages.state_dict(),
            device_of_node={str(k): v for k, v in self.device_of_node.items()},
            rng=self.rng.bit_generator.state,
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ages.load_state_dict(state["ages"])
        self.device_of_node = {int(k): v for k, v in state["device_of_node"].items()}
        self.rng.bit_generator.state = state["rng"]
