"""How long each device takes a round, and how long a round waits for it (issue 26).

An edge fleet's links differ by orders of magnitude (a board on 50 Mbit/s Ethernet next to
one on a 512 kbit/s modem), so one global ``round-timeout`` is either too short for a slow
but healthy device (its round is lost, as the compose fleet's first round once was) or far
too long for a dead one (every round waits for it). The round loop therefore times every
train reply on the server's own clock, from the push of its message to its arrival, and
keeps per device (in the device registry, :class:`LinkEstimate`):

- ``round_s``: the time a round took it (an exponential average, newest half-weighted);
- ``compute_s``: the part it says it spent training (its ``train-time-s`` metric, bounded
  by the time observed, so a device cannot claim more than it took), when it reports one;
- ``bytes``: the bytes its last round moved (model down, update up), from which the link's
  rate is ``bytes / (round_s - compute_s)``: a CA-HFP submodel that halves the bytes halves
  the link part of the next estimate.

The rate's link part includes every fixed delay of the path (the SuperNode's polling, TLS),
so it underestimates a fast link's bandwidth; it is meant to predict a round, not to
measure a link. A device that did not answer within its wait has its estimate raised to
that wait (and its ``timeouts`` counted): a device that never answers in time is predicted
never to.

:class:`RoundWait` turns the estimates into the round's wait. ``mode="fixed"`` waits
``round_timeout`` for everyone (Flower's behaviour, the default). ``mode="expected"`` waits,
for each device, ``slack`` x its expected round plus ``margin`` seconds, at most
``round_timeout``; a device never timed (its first round: app install, imports, data load)
gets ``first_round_timeout``, which may exceed ``round_timeout``. The round ends when every
message is answered or the longest wait of those still outstanding has passed.

Energy-age selection can take a deadline (``selection.deadline``): a device whose expected
round does not fit is skipped this round, the way FedCS (Nishio and Yonetani, 2019) selects;
a device never timed is assumed to fit, and one skipped ``selection.deadline-retry`` rounds
in a row is let through once, to be timed afresh.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from flwr.app import Message
from flwr.serverapp import Grid

from edgefleet.errors import SettingError
from edgefleet.loop.pulling import ReplyPuller, pulls_wait_on_uploads

if TYPE_CHECKING:  # (the run config imports this module's wait modes)
    from edgefleet.config import ServerConfig

# Weight of the newest observation in the averages: a link that changes (a board moved, a
# modem on another cell) shows within two or three rounds.
NEWEST_WEIGHT = 0.5
# How often the loop asks for replies where the grid does not say (Flower's deployment grid
# polls every 3 s inside its send_and_receive; a round on a fast link takes less).
DEFAULT_POLL_S = 0.5


class WaitMode(StrEnum):
    """How long a round waits for its replies (``server.timeout-mode``)."""

    FIXED = "fixed"
    EXPECTED = "expected"


WAIT_MODES: tuple[str, ...] = tuple(m.value for m in WaitMode)


class TimingError(SettingError):
    """A bad round-wait setting; the message names it and the valid values."""


@dataclass
class LinkEstimate:
    """What the server has seen of one device's rounds (see the module docstring)."""

    rounds: int = 0  # rounds timed
    round_s: float = 0.0
    compute_s: float | None = None
    bytes: int = 0
    timeouts: int = 0

    def observe(self, elapsed: float, nbytes: int, compute: float | None) -> None:
        elapsed = max(0.0, float(elapsed))
        if compute is not None:
            compute = min(max(0.0, compute), elapsed)
        w = 1.0 if self.rounds == 0 else NEWEST_WEIGHT
        self.round_s = w * elapsed + (1 - w) * self.round_s
        if compute is not None:
            old = compute if self.compute_s is None else self.compute_s
            self.compute_s = w * compute + (1 - w) * old
        self.bytes = int(nbytes)
        self.rounds += 1

    def timed_out(self, waited: float) -> None:
        """No reply within ``waited`` seconds: the device takes at least that long."""
        self.timeouts += 1
        self.round_s = max(self.round_s, float(waited))
        self.rounds = max(self.rounds, 1)

    @property
    def link_s(self) -> float:
        return max(0.0, self.round_s - (self.compute_s or 0.0))

    @property
    def rate_bps(self) -> float | None:
        """Bytes per second of the link part of a round (None: not measurable)."""
        link = self.link_s
        return self.bytes / link if self.bytes and link > 1e-3 else None

    def expected_s(self) -> float | None:
        """The expected round (None: never timed). The next round moves about the bytes the
        last one did (a CA-HFP device keeps its keep ratio), so this is the average round;
        ``rate_bps`` and ``compute_s`` say where its time goes."""
        return self.round_s if self.rounds else None

    def view(self) -> dict[str, Any]:
        """As ``fleet.json`` shows it."""
        rate = self.rate_bps
        return {
            "timed_rounds": self.rounds,
            "round_s": round(self.round_s, 3),
            "compute_s": None if self.compute_s is None else round(self.compute_s, 3),
            "link_kbps": None if rate is None else round(rate * 8 / 1000, 1),
            "timeouts": self.timeouts,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "round_s": self.round_s,
            "compute_s": self.compute_s,
            "bytes": self.bytes,
            "timeouts": self.timeouts,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> LinkEstimate:
        compute = state.get("compute_s")
        return cls(
            rounds=int(state["rounds"]),
            round_s=float(state["round_s"]),
            compute_s=None if compute is None else float(compute),
            bytes=int(state.get("bytes", 0)),
            timeouts=int(state.get("timeouts", 0)),
        )


@dataclass(frozen=True)
class RoundWait:
    """How long a round waits for each device's reply (see the module docstring)."""

    round_timeout: float = 600.0
    mode: str = WaitMode.FIXED
    first_round_timeout: float = 600.0
    slack: float = 3.0
    margin: float = 10.0

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> RoundWait:
        """The waits ``round-timeout``, ``timeout-mode`` and its keys set."""
        return cls(
            round_timeout=cfg.round_timeout,
            mode=cfg.timeout_mode,
            first_round_timeout=cfg.first_round_timeout,
            slack=cfg.timeout_slack,
            margin=cfg.timeout_margin,
        )

    def __post_init__(self) -> None:
        try:
            WaitMode(self.mode)
        except ValueError:
            valid = ", ".join(m.value for m in WaitMode)
            raise TimingError(f"timeout mode {self.mode!r}; valid: {valid}") from None
        for name in ("round_timeout", "first_round_timeout"):
            if not getattr(self, name) > 0:
                raise TimingError(f"{name}={getattr(self, name)!r} must be > 0")
        if not self.slack >= 1:
            raise TimingError(f"slack={self.slack!r} must be >= 1")
        if not self.margin >= 0:
            raise TimingError(f"margin={self.margin!r} must be >= 0")

    def budget(self, estimate: LinkEstimate | None) -> float:
        """Seconds to wait for one device's reply. A device that let its first-round wait
        pass unanswered has an estimate of that wait, so it gets ``round_timeout`` after."""
        if self.mode == WaitMode.FIXED:
            return self.round_timeout
        expected = None if estimate is None else estimate.expected_s()
        if expected is None:
            return self.first_round_timeout
        return min(self.round_timeout, self.slack * expected + self.margin)


@dataclass
class Exchange:
    """One batch of messages sent and what came back: the replies in arrival order and,
    by message id, the seconds from the push to the reply's arrival."""

    replies: list[Message]
    arrived_s: dict[str, float]
    waits: dict[str, float]  # message id -> the wait it was given
    pushed: dict[str, Message]  # message id -> the message


def exchange(
    grid: Grid,
    messages: Iterable[Message],
    waits: Iterable[float],
    poll_s: float | None = None,
) -> Exchange:
    """Push ``messages`` (``waits[i]`` seconds allowed for the reply to message i) and pull
    their replies until all have come or every outstanding message's wait has passed.

    The same calls as Flower's ``Grid.send_and_receive`` (push, then pull until done or
    timed out), with a wait per message and each reply's arrival time on this clock. A
    grid that says it is ``synchronous`` (the in-process engine's: every reply comes back from
    the pull that delivers its message, or never) is asked once, through its own
    ``send_and_receive`` with the longest wait, and every reply arrives at the call's end."""
    messages = list(messages)
    allowed = list(waits)
    if len(allowed) != len(messages):
        raise ValueError(f"{len(messages)} messages and {len(allowed)} waits")
    longest = max(allowed, default=0.0)
    start = time.monotonic()
    if getattr(grid, "synchronous", False) is True:
        answered = list(grid.send_and_receive(messages, timeout=longest))
        now = time.monotonic() - start
        sent = {m.metadata.message_id: (m, w) for m, w in zip(messages, allowed, strict=True)}
        sent.pop("", None)  # not pushed (a grid that refused it gives it no id)
        return Exchange(
            answered,
            {r.metadata.reply_to_message_id: now for r in answered},
            {i: w for i, (_, w) in sent.items()},
            {i: m for i, (m, _) in sent.items()},
        )
    if poll_s is None:
        interval = getattr(grid, "pull_interval", None)
        poll_s = interval if isinstance(interval, float) and interval > 0 else DEFAULT_POLL_S
    ids = [i for i in grid.push_messages(messages) if i]
    # Pushing stamps each message with its id (as Flower's grids do); a message the grid
    # refused (to a node it does not know) has no id among those returned.
    sent = {m.metadata.message_id: (m, w) for m, w in zip(messages, allowed, strict=True)}
    waits_by_id = {i: sent[i][1] if i in sent else longest for i in ids}
    pending = set(ids)
    replies: list[Message] = []
    arrived: dict[str, float] = {}
    # On the Deployment Engine a reply still uploading at the deadline is not waited for,
    # and a fast reply's arrival is not stamped after a slow one's download
    # (edgefleet.loop.pulling).
    background = pulls_wait_on_uploads(grid)
    puller = ReplyPuller(grid, background, poll_s)
    try:
        left = max(waits_by_id.values(), default=0.0)
        while pending:
            # (In the background the pull itself waits for a reply, up to a poll.)
            got = puller.pull(sorted(pending), min(poll_s, left) if background else 0)
            now = time.monotonic() - start
            for reply in got:
                rid = reply.metadata.reply_to_message_id
                if rid in pending:
                    pending.discard(rid)
                    arrived[rid] = now
                    replies.append(reply)
            if not pending:
                break
            left = max(waits_by_id[i] for i in pending) - now
            if left <= 0:
                break
            if not background:
                time.sleep(min(poll_s, left))
    finally:
        puller.close()
    return Exchange(replies, arrived, waits_by_id, {i: sent[i][0] for i in ids if i in sent})


def reported_compute(value: object) -> float | None:
    """A reply's ``train-time-s`` as a number of seconds, or None (absent, not finite)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None
