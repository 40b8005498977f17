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
(``batch_size = 0`` asks everyone at once). A node is asked when it first appears, to learn
its stable device id, which orders it from then on; when a device reconnects under a new
node id, the old id is retired and never asked again. When an outer wrapper has already
asked every node this round (the sessions wrapper's presence query carries the same slot
clock), those answers are reused and no second query is sent. Wrapped around FedAvg this is
EH-FedAvg, around :class:`~edgefleet.strategies.fedsag.FedSAG` it is EH-FedSAG.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefleet.strategies.base import DeviceStatus, LoopStrategy, StatusQuery, SubsetGrid
from edgefleet.strategies.loop import RoundCallback, RoundResult
from edgefleet.strategies.selection import (
    SELECTION_ORDERS,
    AgeTracker,
    SelectionError,
    query_order,
    select_in_batches,
)


class EnergyAgeSelection(LoopStrategy, RoundCallback):
    def __init__(
        self,
        inner: Strategy,
        max_devices: int,
        slots_per_round: int,
        batch_size: int = 0,
        seed: int = 0,
        query_timeout: float = 60.0,
        first_answer_timeout: float | None = None,
        order: str = "age",
    ) -> None:
        super().__init__(inner)
        if order not in SELECTION_ORDERS:
            raise SelectionError(f"order={order!r}; valid: {', '.join(SELECTION_ORDERS)}")
        self.order = order
        self.max_devices = max_devices
        self.slots_per_round = slots_per_round
        self.batch_size = batch_size
        self.query = StatusQuery(slots_per_round, query_timeout, first_answer_timeout)
        self.rng = np.random.default_rng(seed)
        self.ages = AgeTracker()
        self.device_of_node: dict[int, str] = {}
        self._node_of_device: dict[str, int] = {}
        # Node ids superseded by a newer node of the same device (a reconnect): a dead
        # incarnation stays listed until its heartbeat expires and must not be asked.
        self._retired: set[int] = set()
        self._configured = 0  # the round configure_train last ran for
        self._queried = 0  # status messages sent this round
        self._selected: list[str] = []
        self._heard: dict[int, DeviceStatus] = {}  # this round's answers, by node
        self._heard_round = 0
        self._nobody = ""  # why the last configured round selected nobody

    def settings(self) -> dict[str, object]:
        return {
            "Max devices a round (M)": self.max_devices,
            "Slots a round": self.slots_per_round,
            "Status queries per batch": self.batch_size or "all at once",
            "Query order": self.order,
        }

    def slot(self, server_round: int) -> int:
        return (server_round - 1) * self.slots_per_round

    def on_status(self, server_round: int, answers: Mapping[int, DeviceStatus]) -> None:
        self._remember(server_round, answers)
        super().on_status(server_round, answers)

    def _remember(self, server_round: int, answers: Mapping[int, DeviceStatus]) -> None:
        """Keep this round's status answers (feasibility at this round's slot)."""
        if self._heard_round != server_round:
            self._heard, self._heard_round = {}, server_round
        self._heard.update(answers)
        for node, status in answers.items():
            self._map(node, status.device)
        devices = [a.device for a in answers.values()]
        self.ages.register(devices)
        self.register_devices(devices)

    def _map(self, node: int, device: str) -> None:
        before = self._node_of_device.get(device)
        if before is not None and before != node:
            self.device_of_node.pop(before, None)
            self._retired.add(before)
        self.device_of_node[node] = device
        self._node_of_device[device] = node

    def on_start(self, arrays: ArrayRecord, first_round: int) -> None:
        self._heard, self._heard_round = {}, 0  # answers of an earlier start() are stale

    def _ask(self, grid: Grid, nodes: list[int], server_round: int) -> None:
        """Send the status query (battery at this round's slot) to ``nodes``."""
        answers = self.query.ask(grid, nodes, server_round)
        self._queried += len(nodes)
        self._remember(server_round, answers)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        nodes = sorted(n for n in grid.get_node_ids() if n not in self._retired)
        self._configured, self._queried = server_round, 0
        self._remember(server_round, {})
        # A node's first answer names its device. Asking newcomers before ordering keeps the
        # order, seeded ties included, on stable device ids: Flower's node ids change when a
        # node reconnects, and the Simulation Engine draws them afresh every run, so an order
        # keyed on them made two runs with one seed select different devices. A node that
        # answers is not asked this again; one that does not stays unknown (unavailable this
        # round) and is asked again next round.
        new = [n for n in nodes if n not in self.device_of_node and n not in self._heard]
        if new:
            self._ask(grid, new, server_round)
        node_of = {self.device_of_node[n]: n for n in nodes if n in self.device_of_node}
        order = query_order(self.ages.ages, node_of, self.rng, self.order)
        batch = self.batch_size or max(1, len(order))

        def feasible(devices: list[str]) -> dict[str, bool]:
            ask = [node_of[d] for d in devices if node_of[d] not in self._heard]
            if ask:
                self._ask(grid, ask, server_round)
            heard = self._heard
            return {d: heard[node_of[d]].feasible for d in devices if node_of[d] in heard}

        self._selected, _ = select_in_batches(order, feasible, self.max_devices, batch)
        log(
            INFO,
            "energy-age selection: %d of %d nodes selected (%d asked)",
            len(self._selected),
            len(nodes),
            self._queried,
        )
        if not self._selected:
            self._nobody = self._why_nobody(nodes)
            log(WARNING, "Round %d: nobody selected: %s", server_round, self._nobody)
            return []
        config = ConfigRecord({**dict(config), "slot": self.slot(server_round)})
        subset = SubsetGrid(grid, [node_of[d] for d in self._selected])
        return self.inner.configure_train(server_round, arrays, config, subset)  # type: ignore[arg-type]

    def _why_nobody(self, nodes: list[int]) -> str:
        """Why this round's selection is empty, for the row and the log."""
        answered = [n for n in nodes if n in self._heard]
        if not nodes:
            return "energy-age selection: no node online"
        if not answered:
            return (
                f"energy-age selection: none of the {len(nodes)} nodes answered the status "
                "query in time"
            )
        return (
            f"energy-age selection: none of the {len(answered)} devices that answered can "
            "afford a round (battery below its cost)"
        )

    def after_round(self, result: RoundResult) -> str | None:
        # A node's train reply may name another device id than its status answer did (a
        # ClientApp that reports its id when training but cannot answer status queries):
        # the id it trains under is the one its age must follow.
        for node, device in zip(result.participant_nodes, result.participants, strict=True):
            if self.device_of_node.get(node) != device:
                self._map(node, device)
        self.ages.on_round(result.participants)
        configured = self._configured == result.round  # not when an outer wrapper skipped it
        result.extra["status_queries"] = self._queried if configured else 0
        result.extra["selected"] = self._selected if configured else []
        if configured and not self._selected:
            result.extra["no_participants"] = self._nobody
        return None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            ages=self.ages.state_dict(),
            device_of_node={str(k): v for k, v in self.device_of_node.items()},
            retired=sorted(self._retired),
            no_status=sorted(self.query.unsupported),
            rng=self.rng.bit_generator.state,
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ages.load_state_dict(state["ages"])
        self.device_of_node = {int(k): v for k, v in state["device_of_node"].items()}
        self._node_of_device = {v: k for k, v in self.device_of_node.items()}
        self._retired = {int(n) for n in state.get("retired", [])}
        self.query.unsupported = {int(n) for n in state.get("no_status", [])}
        self.rng.bit_generator.state = state["rng"]
