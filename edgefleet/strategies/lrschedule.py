"""The per-session client learning rate (arXiv 2410.05662's experiments), as a config
injector that composes with any wrapper.

:class:`SessionLearningRate` writes the round's rate as ``lr`` into every train message's
config, which EdgeFleet's ClientApp trains at (a ClientApp that ignores it keeps its own).
Within each session the rate decays polynomially, lr_t = (lr - lr_min) (1 - t/T)^0.9 + lr_min
over the session's T training rounds (:func:`~edgefleet.algorithms.warmstart.session_lr`),
restarting when the round context names a new session (without a sessions wrapper the whole
run is one session); auxiliary rounds (the context's :class:`SessionRow` phase ``aux``) train
at lr x ``aux_scale``, constant, and do not advance t, as the reference does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefleet.algorithms.warmstart import WarmStartError, session_lr
from edgefleet.loop.base import LoopStrategy
from edgefleet.loop.context import SessionRow, current_round
from edgefleet.wire import CONFIG_LR


class SessionLearningRate(LoopStrategy):
    """Every train message's config carries the round's client learning rate."""

    def __init__(
        self,
        inner: Strategy,
        lr: float,
        *,
        min_ratio: float = 1.0,
        session_rounds: int = 0,
        aux_scale: float = 0.5,
    ) -> None:
        """``lr``: the base rate; ``min_ratio`` < 1: decaying to lr x ``min_ratio`` over
        ``session_rounds`` training rounds of each session (needed then); ``aux_scale``: the
        auxiliary rounds' rate as a share of ``lr``."""
        super().__init__(inner)
        session_lr(lr, min_ratio, 0, 1)  # raises on a bad rate or ratio
        if min_ratio < 1 and session_rounds < 1:
            raise WarmStartError(
                "a learning rate that decays within each session needs sessions of a "
                "known length (SessionTracker max_rounds >= 1)"
            )
        if not 0 < aux_scale <= 1:
            raise WarmStartError(f"aux_lr_scale={aux_scale!r} must be in (0, 1]")
        self.lr, self.min_ratio, self.aux_scale = lr, min_ratio, aux_scale
        self.session_rounds = session_rounds
        self.session = 0  # the session t counts in
        self.t = 0  # training rounds configured in that session

    def settings(self) -> dict[str, object]:
        low = self.lr * self.min_ratio
        rate = (
            f"{self.lr:g}" if self.min_ratio == 1 else f"{self.lr:g} -> {low:g} within each session"
        )
        return {"Client learning rate": rate, "Auxiliary learning rate": self.lr * self.aux_scale}

    def rate(self, aux: bool) -> float:
        """This round's rate (``aux``: an auxiliary round)."""
        if aux:
            return self.lr * self.aux_scale
        if self.min_ratio < 1:
            return session_lr(self.lr, self.min_ratio, self.t, self.session_rounds)
        return self.lr

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        ctx = current_round()
        if ctx.session != self.session:
            self.session, self.t = ctx.session, 0
        row = ctx.section(SessionRow)
        aux = row.phase == "aux"
        config = ConfigRecord(dict(config))
        config[CONFIG_LR] = row.lr = self.rate(aux)
        messages = super().configure_train(server_round, arrays, config, grid)
        if not aux:
            self.t += 1
        return messages

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(lr_session=self.session, lr_t=self.t)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.session, self.t = state.get("lr_session", 0), state.get("lr_t", 0)
