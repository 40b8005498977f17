"""SCAFFOLD: control variates that correct each device's local drift.

"SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", Karimireddy, Kale, Mohri,
Reddi, Stich, Suresh, ICML 2020 (arXiv 1910.06378), Algorithm 1 with option II. A server
control variate c and one per device c_i; device i trains K local steps from the global
model x with the corrected gradient

    y <- y - eta (g_i(y) - c_i + c)

and (option II) c_i+ = c_i - c + (x - y) / (K eta). The server steps

    x <- x + server_lr * (1/|S|) sum_{i in S} (y_i - x)
    c <- c + (1/N) sum_{i in S} (c_i+ - c_i),      c_i <- c_i+ for i in S

How it is split here, so that a device needs no state of its own: the server keeps every c_i
(keyed by the stable device id, as FedSAG's memory is) and sends each device its correction
c - c_i as an extra ArrayRecord ``scaffold-correction`` (same keys and shapes as the model)
beside the model; the device adds it to every gradient and replies as usual, with the metric
``scaffold-applied`` = 1. Option II's c_i+ needs only the update y_i - x, which the server
has, so the server computes c_i+ itself. That is the paper's algorithm exactly (the paper's
device stores c_i; holding it on the server changes who stores it, not any value), at the
price of one model-sized download more per round.

**The ClientApp must cooperate.** No Flower mod can add a term to the gradients of a
training loop it does not run, so SCAFFOLD works only with a train handler that reads
``scaffold-correction`` and adds it to each gradient before the optimiser step
(``p.grad += correction[name]``; EdgeFleet's ClientApp does). A reply without
``scaffold-applied`` = 1 (Flower's quickstart app would send none) is dropped with a logged
reason: averaging it would mix uncorrected updates into the corrected ones and corrupt c.

Momentum: option II assumes plain SGD. With heavy-ball momentum beta (the buffer starting
from zero each round, as EdgeFleet's client does), K steps along a constant direction d move
the model by eta d K_eff with K_eff = sum_{m=1..K} (1 - beta^m) / (1 - beta), so c_i+ uses
K_eff in place of K (K_eff = K at beta = 0). A foreign ClientApp states its own K, eta, beta.
The learning rate of a round is the ``lr`` of the train config when the round sends one
(``lr-schedule``), else the constructor's. Updates are averaged unweighted, as in the paper.

Under pruning (CA-HFP submodels) the correction does not fit a submodel; EdgeFleet refuses
that combination before round 1, and its client declines a correction that does not fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from edgefleet.algorithms.saga import flatten, unflatten
from edgefleet.arrays import to_numpy, to_record
from edgefleet.errors import SettingError
from edgefleet.loop.base import start_on_loop
from edgefleet.loop.context import current_round
from edgefleet.loop.hooks import StrategyHooks
from edgefleet.loop.screening import reply_arrays, reply_device
from edgefleet.loop.status import Declaration
from edgefleet.settings import checked
from edgefleet.wire import CONFIG_LR, SCAFFOLD_APPLIED, SCAFFOLD_CORRECTION

if TYPE_CHECKING:
    from edgefleet.strategies.fedsag import SagaConfig
    from edgefleet.task.names import TrainConfig


def effective_steps(local_steps: int, momentum: float) -> float:
    """K_eff = sum_{m=1..K} (1 - beta^m) / (1 - beta): how many plain SGD steps' worth of
    movement K heavy-ball steps along a constant direction make (K at beta = 0)."""
    if momentum == 0:
        return float(local_steps)
    return sum((1 - momentum**m) / (1 - momentum) for m in range(1, local_steps + 1))


def scaffold_step(
    x: np.ndarray,
    c: np.ndarray,
    updates: dict[str, tuple[np.ndarray, np.ndarray]],
    *,
    num_devices: int,
    steps_lr: float,
    server_lr: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """One server step of SCAFFOLD (option II): ``updates`` maps device -> (y_i, c_i it
    trained with); returns (x+, c+, {device: c_i+}). ``steps_lr`` is K_eff x eta."""
    if not updates:
        return x, c, {}
    new_ci = {i: ci - c + (x - y) / steps_lr for i, (y, ci) in updates.items()}
    dy = np.mean([y - x for y, _ in updates.values()], axis=0)
    dc = np.sum([new_ci[i] - ci for i, (_, ci) in updates.items()], axis=0)
    return x + server_lr * dy, c + dc / num_devices, new_ci


class Scaffold(StrategyHooks, FedAvg):
    """SCAFFOLD (Karimireddy et al., ICML 2020), option II, with the devices' control
    variates held on the server (module docstring). ``local_steps``, ``lr`` and
    ``momentum`` are those the ClientApp trains with."""

    @classmethod
    def from_config(cls, train: TrainConfig, saga: SagaConfig, **fedavg_kwargs: Any) -> Scaffold:
        """SCAFFOLD with the devices' local SGD (``local-steps``, ``lr``, ``momentum``: its
        control variates' step) and ``server-lr``."""
        train, saga = checked(train), checked(saga)
        return cls(train.local_steps, train.lr, train.momentum, saga.server_lr, **fedavg_kwargs)

    def __init__(
        self,
        local_steps: int,
        lr: float,
        momentum: float = 0.0,
        server_lr: float = 1.0,
        **fedavg_kwargs: Any,
    ) -> None:
        super().__init__(**fedavg_kwargs)
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise SettingError(f"local_steps={local_steps!r} must be an integer >= 1")
        for name, value in (("lr", lr), ("server_lr", server_lr)):
            if not (np.isfinite(value) and value > 0):
                raise SettingError(f"{name}={value!r} must be a finite number > 0")
        if not 0 <= momentum < 1:
            raise SettingError(f"momentum={momentum!r} must be in [0, 1)")
        self.local_steps, self.lr, self.momentum = local_steps, float(lr), float(momentum)
        self.server_lr = float(server_lr)
        self.c: np.ndarray | None = None  # float64, sized on the first round
        self.ci: dict[str, np.ndarray] = {}  # device -> c_i (float32: one model per device)
        self._known: dict[str, None] = {}

    def summary(self) -> None:
        log(INFO, "\t├──> SCAFFOLD settings (option II, control variates on the server):")
        log(INFO, "\t│\t├── Local steps K: %s, lr: %s, momentum: %s", self.local_steps,
            self.lr, self.momentum)  # fmt: skip
        log(INFO, "\t│\t└── Server learning rate: %s", self.server_lr)
        super().summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """Flower's ``Strategy.start`` contract on EdgeFleet's round loop (as FedSAG)."""
        return start_on_loop(self, grid, initial_arrays, *args, **kwargs)

    def declarations(self) -> list[Declaration]:
        return [
            Declaration(
                "Scaffold",
                round_barrier=(
                    "Scaffold's correction c - c_i is per device and its control variates are "
                    "updated from one synchronous round's replies; the asynchronous loop sends "
                    "one template message to every device"
                ),
            )
        ]

    def register_devices(self, device_ids: Iterable[str]) -> None:
        """Count devices in N (c's step is (1/N) x the sum of the participants' changes)."""
        for device_id in device_ids:
            self._known.setdefault(str(device_id))

    def on_session(self, arrays: ArrayRecord | None) -> None:
        """A new session: the control variates described the last session's devices and
        models; start from zero, as the paper does."""
        self.c, self.ci, self._known = None, {}, {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        ctx = current_round()
        sent = ctx.own(self, _Sent)
        sent.arrays = arrays
        sent.lr = float(config.get(CONFIG_LR, self.lr))  # type: ignore[arg-type]
        like = to_numpy(arrays)
        x = flatten(like)
        if self.c is None or self.c.size != x.size:
            self.c = np.zeros(x.size, dtype=np.float64)
            self.ci = {}
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            device = ctx.registry.name(node)
            ci = self.ci.get(device)
            ci64 = np.zeros(x.size) if ci is None else ci.astype(np.float64)
            sent.ci[node] = ci64
            content = RecordDict(
                {
                    self.arrayrecord_key: arrays,  # first: the model replies are taken against
                    self.configrecord_key: config,
                    SCAFFOLD_CORRECTION: to_record(unflatten(self.c - ci64, like)),
                }
            )
            out.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        sent = current_round().own(self, _Sent)
        if sent.arrays is None or self.c is None:
            return None, None
        like = to_numpy(sent.arrays)
        x = flatten(like)
        updates: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        used = []
        for msg in replies:
            if msg.has_error():
                continue
            device = reply_device(msg)
            reason = self._refusal(msg)
            if reason is None and msg.metadata.src_node_id not in sent.ci:
                reason = "no correction was sent to its node this round"
            if reason is not None:
                log(WARNING, "SCAFFOLD round %d: reply of %s dropped: %s", server_round,
                    device, reason)  # fmt: skip
                continue
            y = flatten(to_numpy(reply_arrays(msg.content)))
            if y.shape != x.shape or not np.all(np.isfinite(y)):
                log(WARNING, "SCAFFOLD round %d: reply of %s dropped: arrays do not fit the "
                    "model or are not finite", server_round, device)  # fmt: skip
                continue
            updates[device] = (y, sent.ci[msg.metadata.src_node_id])
            used.append(msg)
        if not updates:
            return None, None
        steps_lr = effective_steps(self.local_steps, self.momentum) * sent.lr
        n = len(set(self._known) | set(self.ci) | set(updates))
        new_x, new_c, new_ci = scaffold_step(
            x, self.c, updates, num_devices=n, steps_lr=steps_lr, server_lr=self.server_lr
        )
        if not (np.all(np.isfinite(new_x)) and np.all(np.isfinite(new_c))):
            log(WARNING, "SCAFFOLD round %d: the step would make the model or c non-finite; "
                "model and control variates left unchanged", server_round)  # fmt: skip
            return None, None
        self.c = new_c
        for device, ci in new_ci.items():
            self.ci[device] = ci.astype(np.float32)
            self._known.setdefault(device)
        metrics = aggregate_metricrecords([m.content for m in used], self.weighted_by_key)
        return to_record(unflatten(new_x, like)), metrics

    @staticmethod
    def _refusal(msg: Message) -> str | None:
        for record in msg.content.metric_records.values():
            if SCAFFOLD_APPLIED in record:
                value = record[SCAFFOLD_APPLIED]
                return None if value == 1 else f"'{SCAFFOLD_APPLIED}' = {repr(value)[:40]}, not 1"
        return (
            f"no '{SCAFFOLD_APPLIED}' metric: SCAFFOLD needs a ClientApp that adds the "
            f"'{SCAFFOLD_CORRECTION}' record to every gradient (edgefleet.strategies.scaffold)"
        )

    def state_dict(self) -> dict[str, Any]:
        ids = list(self.ci)
        return {
            "c": self.c,
            "ci_ids": ids,
            "ci": np.stack([self.ci[i] for i in ids]) if ids else np.zeros((0, 0), np.float32),
            "known": list(self._known),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.c = None if state.get("c") is None else np.asarray(state["c"], dtype=np.float64)
        table = np.asarray(state["ci"], dtype=np.float32)
        self.ci = {str(i): table[r].copy() for r, i in enumerate(state["ci_ids"])}
        self._known = dict.fromkeys(str(i) for i in state.get("known", []))


@dataclass
class _Sent:
    arrays: ArrayRecord | None = None  # the model this round's train messages carried
    lr: float = 0.0
    ci: dict[int, np.ndarray] = field(default_factory=dict)  # node -> the c_i it was sent
