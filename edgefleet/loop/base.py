"""Wrapper strategies that plug into EdgeFleet's round loop.

Each EdgeFleet technique is a ``flwr.serverapp.strategy.Strategy`` that wraps another one,
the way Flower's ``DifferentialPrivacyServerSideFixedClipping`` wraps ``FedAvg``: the
message-building and aggregation calls go to the inner strategy unless the wrapper changes
them, and what happens *between* rounds (stopping, sessions) is a round callback. Since
Flower's own ``Strategy.start`` has no hook between rounds, :meth:`LoopStrategy.start` runs
EdgeFleet's :class:`~edgefleet.loop.roundloop.RoundLoop` instead, with the same arguments
and the same :class:`~flwr.serverapp.strategy.Result`, so a Flower user can write::

    result = TaskVectorStopping(FedAvg()).start(grid, arrays, num_rounds=500)

and EdgeFleet's own ServerApp is only the first user of that public API.

A wrapper sends nothing itself: it builds messages (Flower's ``configure_*`` contract) and
reads or writes the round context. What it needs of the fleet (the status answers, the slot
clock, the participant cap) it declares (:meth:`~edgefleet.loop.hooks.StrategyHooks.
declarations`), and the loop's status phase (:mod:`edgefleet.loop.status`) asks once
a round for all of them.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Sequence
from logging import INFO
from typing import Any, TypeVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Bulyan, Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from edgefleet.loop.hooks import StrategyHooks, hooks_of
from edgefleet.loop.roundloop import RoundCallback, RoundLoop, RoundResult, numbers
from edgefleet.loop.screening import RecordKeys, Screening
from edgefleet.loop.status import Ask, Declaration, StatusQuery, fleet_facts

__all__ = ["LoopStrategy", "StatusQuery", "SubsetGrid", "build_loop", "start_on_loop"]


class SubsetGrid:
    """The grid as an inner strategy should see it: only ``node_ids`` (those still online).

    Each call asks the grid below, so the round loop's bound on waiting for nodes holds
    here too: a FedAvg asked to sample 2 of an empty subset used to wait for good."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid, self._nodes = grid, node_ids

    def get_node_ids(self) -> list[int]:
        online = set(self._grid.get_node_ids())
        return [n for n in self._nodes if n in online]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class LoopStrategy(StrategyHooks, Strategy):
    """Delegates every Strategy call and every hook to ``inner``; a subclass that is also a
    :class:`~edgefleet.loop.roundloop.RoundCallback` is called after every round."""

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner

    # -- hooks: passed down to the inner strategy -----------------------------------------

    def round_callbacks(self) -> list[RoundCallback]:
        """Callbacks of this wrapper and of every wrapper inside it, innermost first."""
        return hooks_of(self.inner).round_callbacks() + self.own_callbacks()

    def own_callbacks(self) -> list[RoundCallback]:
        return [self] if isinstance(self, RoundCallback) else []

    def on_session(self, arrays: ArrayRecord | None) -> None:
        hooks_of(self.inner).on_session(arrays)

    def declarations(self) -> list[Declaration]:
        """This wrapper's declarations, then those of every wrapper inside it."""
        return self.own_declarations() + hooks_of(self.inner).declarations()

    def own_declarations(self) -> list[Declaration]:
        return []

    def plan_status(
        self, server_round: int, arrays: ArrayRecord, nodes: Sequence[int], ask: Ask
    ) -> None:
        """Passed down: a wrapper that narrows the nodes (sessions: the present ones) or
        stops the round (stopping: resting) overrides it."""
        hooks_of(self.inner).plan_status(server_round, arrays, nodes, ask)

    def choose_to_start(
        self, clock_round: int, arrays: ArrayRecord, idle: Sequence[int], count: int, ask: Ask
    ) -> list[int] | None:
        return hooks_of(self.inner).choose_to_start(clock_round, arrays, idle, count, ask)

    def register_devices(self, device_ids: Iterable[str]) -> None:
        hooks_of(self.inner).register_devices(device_ids)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (nested per wrapper)."""
        return {"inner": hooks_of(self.inner).state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hooks_of(self.inner).load_state_dict(state.get("inner", {}))

    def check_reply(self, msg: Message, reference: ArrayRecord, keys: RecordKeys) -> str | None:
        """The innermost wrapper that knows the reply format decides (full-size arrays
        unless a wrapper such as CA-HFP's accepts submodels)."""
        return hooks_of(self.inner).check_reply(msg, reference, keys)

    def update_norm(self, msg: Message, sent: RecordDict | None, reference: ArrayRecord) -> float:
        return hooks_of(self.inner).update_norm(msg, sent, reference)

    def full_size_reply(self, msg: Message, base: ArrayRecord) -> Message:
        return hooks_of(self.inner).full_size_reply(msg, base)

    # -- Strategy -------------------------------------------------------------------------

    def settings(self) -> dict[str, object]:
        """This wrapper's own settings, for :meth:`summary`."""
        return {}

    def summary(self) -> None:
        """This wrapper's settings, then the inner strategy's (as Flower's DP wrappers do)."""
        log(INFO, "\t├──> %s settings:", type(self).__name__)
        items = list(self.settings().items()) or [("(none)", "")]
        for i, (key, value) in enumerate(items):
            log(INFO, "\t│\t%s── %s: %s", "└" if i == len(items) - 1 else "├", key, value)
        self.inner.summary()

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

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """Flower's ``Strategy.start`` contract, run by EdgeFleet's round loop: the arguments
        and the ``Result`` of :func:`start_on_loop`."""
        return start_on_loop(self, grid, initial_arrays, *args, **kwargs)


W = TypeVar("W")


def find_wrapper(strategy: object, kind: type[W]) -> W | None:
    """The outermost wrapper of type ``kind`` in ``strategy``'s chain (``.inner`` links)."""
    while strategy is not None:
        if isinstance(strategy, kind):
            return strategy
        strategy = getattr(strategy, "inner", None)
    return None


def participant_cap_error(strategy: object, cap: int | None) -> str | None:
    """Why Flower's Bulyan in ``strategy``'s chain can never aggregate when at most ``cap``
    devices take part in a round (a selection's M), or None. Bulyan skips every round with
    fewer than 4f + 3 replies (f its ``num_malicious_nodes``) and keeps the model as it was,
    so a cap below that would run to the end without learning."""
    while strategy is not None and not isinstance(strategy, Bulyan):
        strategy = getattr(strategy, "inner", None)
    if strategy is None or cap is None:
        return None
    need = 4 * strategy.num_malicious_nodes + 3
    if cap >= need:
        return None
    most = (cap - 3) // 4
    return (
        f"Bulyan(num_malicious_nodes={strategy.num_malicious_nodes}) needs at least {need} "
        f"replies a round (4f + 3), but at most {cap} devices are selected a round: raise the "
        f"selection's max_devices to {need} or more"
        + (f", or set num_malicious_nodes to {most} or less" if most >= 0 else "")
        + ", or use MultiKrum"
    )


def build_loop(
    strategy: Strategy,
    grid: Grid,
    *,
    before: Sequence[RoundCallback] = (),
    after: Sequence[RoundCallback] = (),
    **loop_kwargs: Any,
) -> RoundLoop:
    """The round loop for ``strategy``: its wrappers' callbacks (innermost first), between
    ``before`` and ``after`` (EdgeFleet's ServerApp puts its metrics writer and checkpoint
    after them, so that they record what the wrappers wrote). ``loop_kwargs`` go to
    :class:`~edgefleet.loop.roundloop.RoundLoop`. The one way both
    :func:`start_on_loop` and EdgeFleet's ServerApp build it."""
    # The fleet's cap as the components declare it (RoundLoop merges them the same way).
    cap = fleet_facts(hooks_of(strategy).declarations()).participant_cap
    why = participant_cap_error(strategy, cap)
    if why:  # before round 1, not a run that never aggregates
        raise ValueError(why)
    callbacks = [*before, *hooks_of(strategy).round_callbacks(), *after]
    return RoundLoop(strategy, grid, callbacks=callbacks, **loop_kwargs)


def start_on_loop(
    strategy: Strategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int = 3,
    timeout: float = 3600,
    train_config: ConfigRecord | None = None,
    evaluate_config: ConfigRecord | None = None,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    *,
    screening: Screening | None = None,
) -> Result:
    """Flower's ``Strategy.start`` contract, run by EdgeFleet's round loop.

    As in Flower: the summary is logged first; ``evaluate_fn`` is called on the initial
    model (round 0) and after every round; federated evaluation runs when the inner
    strategy's ``fraction_evaluate`` > 0; the returned ``Result`` holds the final arrays
    and every round's aggregated train, federated-evaluation and central metrics (a round
    that kept the model as it was holds the last evaluation's figures, without a second
    pass). The one difference: a round callback may end the run before ``num_rounds`` (a
    stopping rule). ``screening`` (EdgeFleet's addition) sets the bounds replies are
    screened against (:class:`~edgefleet.loop.screening.Screening`; e.g.
    ``max_examples`` when your ClientApp's sample count per round is known).
    """
    log(INFO, "Starting %s strategy:", type(strategy).__name__)
    log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
    strategy.summary()
    log(INFO, "")
    result = Result(arrays=initial_arrays)
    central: dict[int, MetricRecord] = result.evaluate_metrics_serverapp
    last: list[MetricRecord] = []  # the last record evaluate_fn returned

    def evaluate(rnd: int, arrays: ArrayRecord) -> dict[str, float]:
        res = evaluate_fn(rnd, arrays) if evaluate_fn else None
        if res is None:
            return {}
        central[rnd] = res
        last[:] = [res]
        return numbers(res)

    if evaluate_fn is not None:
        log(INFO, "Initial global evaluation results: %s", evaluate(0, initial_arrays))

    class Collect(RoundCallback):
        def after_round(self, res: RoundResult) -> str | None:
            if res.train_metrics:
                result.train_metrics_clientapp[res.round] = MetricRecord(dict(res.train_metrics))
            if res.federated_metrics:
                result.evaluate_metrics_clientapp[res.round] = MetricRecord(
                    dict(res.federated_metrics)
                )
            if res.evaluated and res.round not in central and last:
                central[res.round] = last[0]  # the loop reused the last figures
            return None

    loop = build_loop(
        strategy,
        grid,
        before=[Collect()],
        evaluate_fn=evaluate if evaluate_fn is not None else None,
        evaluate_config=evaluate_config,
        round_timeout=timeout,
        screening=screening,
    )
    outcome = loop.run(initial_arrays, num_rounds, train_config)
    result.arrays = outcome.arrays
    log(INFO, "")
    log(INFO, "Run ended after round %d (%s). Final results:", outcome.rounds_run,
        outcome.stop_reason)  # fmt: skip
    for line in io.StringIO(str(result)):
        log(INFO, "\t%s", line.strip("\n"))
    return result
