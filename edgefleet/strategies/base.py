"""Wrapper strategies that plug into EdgeFleet's round loop.

Each EdgeFleet technique is a ``flwr.serverapp.strategy.Strategy`` that wraps another one,
the way Flower's ``DifferentialPrivacyServerSideFixedClipping`` wraps ``FedAvg``: the
message-building and aggregation calls go to the inner strategy unless the wrapper changes
them, and what happens *between* rounds (stopping, sessions) is a round callback. Since
Flower's own ``Strategy.start`` has no hook between rounds, :meth:`LoopStrategy.start` runs
EdgeFleet's :class:`~edgefleet.server.loop.RoundLoop` instead, so a Flower user can write::

    result = TaskVectorStopping(FedAvg()).start(grid, arrays, num_rounds=500)

and EdgeFleet's own ServerApp is only the first user of that public API.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from edgefleet.server.loop import RoundCallback, RoundLoop, RoundResult, check_train_reply


@dataclass(frozen=True)
class DeviceStatus:
    """A device's answer to the light status query."""

    device: str  # the stable device id
    feasible: bool  # its battery covers a round
    present: bool  # it takes part in the current session
    labels: tuple[int, ...]  # classes of its data (only when asked for)


def query_status(
    grid: Grid,
    nodes: Iterable[int],
    server_round: int,
    slots_per_round: int,
    timeout: float,
    labels: bool = False,
) -> dict[int, DeviceStatus]:
    """Send the status query (carrying the global slot clock) to ``nodes``; the answers by
    node. A node that does not answer, answers with an error or with a malformed status is
    left out: unavailable this round, never an end of the run."""
    config = ConfigRecord(
        {
            "slot": (server_round - 1) * slots_per_round,
            "server-round": server_round,
            "labels": int(labels),
        }
    )
    messages = [
        Message(RecordDict({"config": config}), dst_node_id=n, message_type=MessageType.QUERY)
        for n in nodes
    ]
    answers: dict[int, DeviceStatus] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = reply.metadata.src_node_id
        if reply.has_error() or "status" not in reply.content.metric_records:
            continue
        status = reply.content.metric_records["status"]
        try:
            answers[node] = DeviceStatus(
                device=str(int(status["device-id"])),  # type: ignore[arg-type]
                feasible=bool(status.get("feasible", 0)),
                present=bool(status.get("present", 1)),
                labels=tuple(int(c) for c in status.get("labels", [])),  # type: ignore[union-attr]
            )
        except (KeyError, TypeError, ValueError) as err:
            log(WARNING, "Ignoring a malformed status from node %d: %r", node, err)
    return answers


class SubsetGrid:
    """The grid as an inner strategy should see it: only ``node_ids`` are online."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid, self._nodes = grid, node_ids

    def get_node_ids(self) -> list[int]:
        return list(self._nodes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class LoopStrategy(Strategy):
    """Delegates every Strategy call to ``inner``; contributes round callbacks."""

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner

    def round_callbacks(self) -> list[RoundCallback]:
        """Callbacks of this wrapper and of every wrapper inside it, innermost first."""
        inner = self.inner.round_callbacks() if isinstance(self.inner, LoopStrategy) else []
        return inner + self.own_callbacks()

    def own_callbacks(self) -> list[RoundCallback]:
        return []

    def on_session(self, arrays: ArrayRecord | None) -> None:
        """A session boundary, announced by the sessions wrapper to every wrapper inside it:
        ``arrays`` is the model the session's training starts from, or None while the
        session's auxiliary rounds run (rounds that are not the session's training)."""
        if hasattr(self.inner, "on_session"):  # a wrapper, or a stateful strategy (FedSAG)
            self.inner.on_session(arrays)

    def register_devices(self, device_ids: Iterable[str]) -> None:
        """Devices the selection has heard from, passed down to a strategy that keeps
        per-device state (FedSAG counts them in its memory mean before their first upload)."""
        if hasattr(self.inner, "register_devices"):
            self.inner.register_devices(device_ids)

    def on_status(self, server_round: int, answers: Mapping[int, DeviceStatus]) -> None:
        """Status answers an outer wrapper already collected this round (same slot clock),
        passed down so that an inner selection does not ask those nodes again."""
        if hasattr(self.inner, "on_status"):
            self.inner.on_status(server_round, answers)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, for the server checkpoint (nested per wrapper).
        An inner strategy with state of its own (e.g. FedSAG's memory) has ``state_dict``
        too; Flower's stateless ones have not."""
        inner = self.inner.state_dict() if hasattr(self.inner, "state_dict") else {}
        return {"inner": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.inner, "load_state_dict"):
            self.inner.load_state_dict(state.get("inner", {}))

    def summary(self) -> None:
        self.inner.summary()

    def check_reply(self, msg: Message, reference: ArrayRecord) -> str | None:
        """Why the round loop must drop the train reply ``msg``, or None: the innermost
        wrapper that knows the reply format decides (full-size arrays unless a wrapper
        such as CA-HFP's accepts submodels)."""
        if isinstance(self.inner, LoopStrategy):
            return self.inner.check_reply(msg, reference)
        return check_train_reply(msg, reference)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.inner.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``Strategy.start`` contract, run by EdgeFleet's round loop.

        Differences: rounds may end early (a callback stops the run), and federated
        evaluation on the ClientApps is not run (``evaluate_config`` is unused);
        ``evaluate_fn`` is called after every round, as in Flower.
        """

        def central(rnd: int, arrays: ArrayRecord) -> dict[str, float]:
            res = evaluate_fn(rnd, arrays) if evaluate_fn else None
            return {k: float(v) for k, v in (res or {}).items()}  # type: ignore[arg-type]

        result = Result()

        class Collect(RoundCallback):
            def after_round(self, res: RoundResult) -> str | None:
                for metrics, into in (
                    (res.train_metrics, result.train_metrics_clientapp),
                    (res.eval_metrics, result.evaluate_metrics_serverapp),
                ):
                    if metrics:
                        into[res.round] = MetricRecord(dict(metrics))
                return None

        loop = RoundLoop(
            self,
            grid,
            evaluate_fn=central,
            callbacks=[Collect(), *self.round_callbacks()],
            round_timeout=timeout,
        )
        outcome = loop.run(initial_arrays, num_rounds, train_config)
        result.arrays = outcome.arrays
        return result
