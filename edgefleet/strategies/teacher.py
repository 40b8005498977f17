"""The Continuous baseline's teacher (arXiv 2410.05662), as a wrapper of its own.

:class:`ContinuousTeacher` makes every device add lambda x KL(p_last || p_local) to its
cross-entropy, with p_last the output of the last session's final model (the *teacher*) on
the same mini-batch: a continual-learning baseline that keeps what the last session learnt
while the new one trains. The sessions wrapper (:class:`~edgefleet.strategies.warmstart_initializer.
WarmStartInitializer`, mode ``continuous``) puts one inside itself and names the last
session's final model in every round's context (``RoundContext.last_session_model``, which
also keeps it in the checkpoint); nothing else about sessions is known here, and without a
wrapper that names that model this one sends nothing.

On the wire, for EdgeFleet's ClientApp (a ClientApp that ignores it trains without the term):
``kl-lambda`` and ``teacher-session`` (the session number) in the train config, and the
teacher as a second ArrayRecord ``teacher``, sent to a node only until it has trained with
it once in this session: the device keeps it in its ``Context.state`` (kept between
messages on both engines) and later messages name the session only. A node that has lost it
(its SuperNode restarted) declines the round, and a node asked to train that sent no
accepted reply gets the teacher again next time. The extra download is one model per device
per session (in the round's ``bytes_down``; the row's ``teacher_downloads`` counts them), not
one per round: about 1/T of the downloads of a T-round session, against a doubling for
sending it in every message. The device holds one more model in memory and runs one more
forward pass a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefleet.algorithms.warmstart import WarmStartError
from edgefleet.loop.base import LoopStrategy
from edgefleet.loop.context import SessionRow, current_round
from edgefleet.wire import CONFIG_KL_LAMBDA, CONFIG_TEACHER_SESSION, TEACHER_RECORD


@dataclass
class _Round:
    teacher: ArrayRecord | None = None  # this round's teacher (None: no KL term)
    asked: set[int] = field(default_factory=set)  # nodes sent a train message this round


class ContinuousTeacher(LoopStrategy):
    """Train messages carry the last session's final model as a KL teacher."""

    def __init__(self, inner: Strategy, kl_lambda: float = 0.5) -> None:
        """``kl_lambda``: the KL term's weight (0: no teacher is sent)."""
        super().__init__(inner)
        if not kl_lambda >= 0:
            raise WarmStartError(f"kl_lambda={kl_lambda!r} must be >= 0")
        self.kl_lambda = kl_lambda
        self.session = 0  # the session the holders belong to
        # Nodes that trained with this session's teacher. By node, not by device (so not in
        # the device registry): the teacher lives in the node's Context.state, and a device
        # back on a new node has lost it.
        self.holders: set[int] = set()

    def settings(self) -> dict[str, object]:
        return {"KL weight (lambda)": self.kl_lambda}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        ctx = current_round()
        if ctx.session != self.session:  # a new session: nobody holds its teacher yet
            self.session, self.holders = ctx.session, set()
        mine = ctx.own(self, _Round)
        # The teacher is the last session's final model (none in the first session).
        if ctx.session >= 2 and self.kl_lambda > 0:
            mine.teacher = ctx.last_session_model
        if mine.teacher is not None:
            config = ConfigRecord(dict(config))
            config[CONFIG_KL_LAMBDA] = self.kl_lambda
            config[CONFIG_TEACHER_SESSION] = self.session
        messages = list(super().configure_train(server_round, arrays, config, grid))
        mine.asked = {m.metadata.dst_node_id for m in messages}
        if mine.teacher is None:
            return messages
        out, sent = [], 0
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node in self.holders:
                out.append(msg)
                continue
            # The inner strategy shares one RecordDict between its messages: a new one each.
            content = RecordDict({**dict(msg.content.items()), TEACHER_RECORD: mine.teacher})
            out.append(Message(content, dst_node_id=node, message_type=msg.metadata.message_type))
            sent += 1
        ctx.section(SessionRow).teacher_downloads = sent
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        mine = current_round().own(self, _Round)
        if mine.teacher is not None:
            # A node asked to train without an accepted reply may have lost the teacher (a
            # restarted SuperNode declines for that): it is sent again next time.
            replied = {m.metadata.src_node_id for m in replies if not m.has_error()}
            self.holders = (self.holders - mine.asked) | (replied & mine.asked)
        return super().aggregate_train(server_round, replies)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["teacher_session"] = self.session
        return state  # not the holders: after a restart every node is sent the teacher again

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.session, self.holders = state["teacher_session"], set()
