"""EH-FedAvg, EH-FedSAG's baseline: FedAvg with every participant weighted equally.

Its own module because robust aggregation (:mod:`edgefleet.strategies.robust`) and FedSAG
(:mod:`edgefleet.strategies.fedsag`) both need it, and FedSAG uses robust's rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from edgefleet.loop.base import start_on_loop


class EqualWeightFedAvg(FedAvg):
    """FedAvg with every participant weighted equally: EH-FedAvg, the paper's baseline, is
    the plain mean of the participants' models, as FedSAG's direction is a plain mean.
    Flower's FedAvg weights by ``num-examples`` (samples seen), which differs between
    devices whose data is shorter than ``local-steps`` x ``batch-size``."""

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """Flower's ``Strategy.start`` contract on EdgeFleet's round loop, which screens every
        reply, as every EdgeFleet strategy used alone does (FedSAG's ``start``)."""
        return start_on_loop(self, grid, initial_arrays, *args, **kwargs)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        key = self.weighted_by_key
        contents = [
            RecordDict(
                {
                    **dict(m.content.array_records),
                    **{
                        name: MetricRecord({**dict(rec), key: 1})
                        for name, rec in m.content.metric_records.items()
                    },
                }
            )
            for m in valid
        ]
        return aggregate_arrayrecords(contents, key), self.train_metrics_aggr_fn(contents, key)
