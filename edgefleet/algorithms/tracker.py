"""Session detection from the set of present devices.

Warm start ("Communication-Efficient Federated Learning under Dynamic Device Arrival and
Departure", arXiv 2410.05662) trains in sessions: a session is a stretch of rounds over a
roughly fixed device set, and a new session (with a new initial model, see
:mod:`edgefleet.algorithms.warmstart`) begins when that set changes. In the paper's
experiments the schedule is known and every session has the same length; a real fleet only
shows who is present each round, so :class:`SessionTracker` decides when the set has changed
enough.

Change rule: the present set P is compared with the session's *founding* set F (the devices
present when it opened), not with the previous round's set, so slow churn of one device per
round adds up and eventually opens a session instead of drifting unnoticed. The measure is the
Jaccard distance |P xor F| / |P union F|: it lies in [0, 1], 0 for the same set and 1 for
disjoint sets, and it is relative, so one device coming or going matters less in a fleet of
100 than in a fleet of 5. A new session opens when it exceeds ``change_threshold``
(0 = any change). ``max_rounds`` > 0 also closes a session that has lasted that many rounds,
counted by round number (``round - start_round >= max_rounds``), so a skipped round uses up the
budget too; when both rules fire, the reason is ``"membership"``.

A round with nobody present changes nothing: there is no data and no device set to found a
session on, and an outage of the whole fleet is not evidence that the set changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from edgefleet.errors import SettingError

REASON_START = "start"
REASON_MEMBERSHIP = "membership"
REASON_LENGTH = "length"


class SessionError(SettingError):
    """Bad arguments or state for the session tracker; the message says why."""


@dataclass(frozen=True)
class SessionChange:
    """A new session opened at ``round``; ``arrived``/``left`` are relative to the previous
    session's founding set (for ``reason="start"``: everyone present arrived)."""

    session: int
    round: int
    arrived: frozenset[str]
    left: frozenset[str]
    reason: str


def membership_change(present: frozenset[str], founding: frozenset[str]) -> float:
    """Jaccard distance |present xor founding| / |present union founding|; 0 if both empty."""
    union = present | founding
    return len(present ^ founding) / len(union) if union else 0.0


class SessionTracker:
    """Opens sessions from the per-round set of present devices (see the module docstring)."""

    def __init__(self, change_threshold: float, max_rounds: int) -> None:
        try:
            threshold = float(change_threshold)
        except (TypeError, ValueError):
            threshold = float("nan")
        if not 0.0 <= threshold < 1.0:  # also rejects NaN
            raise SessionError(f"change_threshold={change_threshold!r} must lie in [0, 1)")
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0:
            raise SessionError(f"max_rounds={max_rounds!r} must be an integer >= 0 (0 = no limit)")
        self.change_threshold = threshold
        self.max_rounds = max_rounds
        self.session = 0  # 0 until the first non-empty round opens session 1
        self.founding: frozenset[str] = frozenset()
        self.start_round: int | None = None

    def update(self, round: int, present: Iterable[str]) -> SessionChange | None:
        """Feed one round's present devices; the new session if one opens now, else None."""
        if isinstance(round, bool) or not isinstance(round, int):
            raise SessionError(f"round={round!r} must be an int")
        if self.start_round is not None and round < self.start_round:
            raise SessionError(
                f"round {round} is before the current session's start round {self.start_round}"
            )
        now = frozenset(str(d) for d in present)
        if not now:
            return None
        if self.start_round is None:
            return self._open(round, now, REASON_START)
        if membership_change(now, self.founding) > self.change_threshold:
            return self._open(round, now, REASON_MEMBERSHIP)
        if self.max_rounds and round - self.start_round >= self.max_rounds:
            return self._open(round, now, REASON_LENGTH)
        return None

    def _open(self, round: int, present: frozenset[str], reason: str) -> SessionChange:
        change = SessionChange(
            session=self.session + 1,
            round=round,
            arrived=present - self.founding,
            left=self.founding - present,
            reason=reason,
        )
        self.session, self.founding, self.start_round = change.session, present, round
        return change

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: session number, founding set (sorted), session start round."""
        return {
            "session": self.session,
            "founding": sorted(self.founding),
            "start_round": self.start_round,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            session = state["session"]
            founding = frozenset(str(d) for d in state["founding"])
            start_round = state["start_round"]
        except (KeyError, TypeError) as err:
            raise SessionError(f"session tracker state is malformed: {err!r}") from None
        if isinstance(session, bool) or not isinstance(session, int) or session < 0:
            raise SessionError(f"session tracker state: session={session!r} must be an int >= 0")
        if start_round is not None and (
            isinstance(start_round, bool) or not isinstance(start_round, int)
        ):
            raise SessionError(f"session tracker state: start_round={start_round!r} not an int")
        if (session == 0) != (start_round is None):
            raise SessionError(
                f"session tracker state: session {session} with start_round {start_round!r}"
            )
        self.session, self.founding, self.start_round = session, founding, start_round
