"""The run stops, with an error naming the cause, when no device has taken part for
``run.max-empty-rounds`` rounds in a row.

Without it a fleet that is gone runs to its round budget: with every ClientApp actor killed
(the machine out of memory), the default scenario ran all 30 rounds with nobody selected,
printed "done ... final accuracy 0.1100" and exited 0. Now the ServerApp raises
:class:`FleetSilent` after the round's checkpoint is written: the run ends non-zero with the
cause in its message, without a summary (it has not finished), and ``--resume`` continues it
from its last round once the cause is fixed.

The cause is what the round knows: every device asked declined (energy, a client rule),
every reply was rejected by screening, the devices asked never answered (unreachable: on the
Simulation Engine that is also what killed workers look like), or nobody could be selected
(the selection's or the session's own reason, e.g. "no device present").

A round in which data-free stopping rests the fleet (a session that stopped learning) is
not silent either: the story counts it apart, and it ends a streak.

A round in which energy-aware selection heard from the devices but none could afford a round
is not silent: the devices are there and their batteries recharge (under scarce energy many
rounds have nobody, by design). It ends a streak instead of adding to it.

A round in which ``selection.deadline`` skipped every device while ``selection.deadline-retry``
will let them back is the server's own choice, not the fleet's silence: it neither adds to a
streak nor ends one, so a fleet that is really gone still stops once its retried devices
fail to answer. Counting it made a deadline run stop with ``FleetSilent`` under load (every
board's round over the deadline, ``deadline-retry`` >= ``max-empty-rounds``) before the retry
let any board back in (``benchmarks/perf/link_fleet.py``, docs/benchmarks/links.md).
"""

from __future__ import annotations

from edgefleet.loop.context import ScreeningRow, SelectionRow, StoppingRow
from edgefleet.loop.roundloop import RoundCallback, RoundResult

# What EnergyAgeSelection._why_nobody says when devices answered but none can afford a round
# (tests/test_empty_rounds.py checks that it still says so).
WAITING_FOR_ENERGY = "can afford a round"


def waiting_for_energy(result: RoundResult) -> bool:
    """Whether ``result``'s round was empty only because the devices that answered are
    recharging."""
    said = result.context.section(ScreeningRow).no_participants or ""
    return WAITING_FOR_ENERGY in said and not result.declined and not result.rejected


def skipped_by_deadline(result: RoundResult) -> bool:
    """Whether ``result``'s round was empty only because ``selection.deadline`` skipped every
    device it would have asked."""
    row = result.context.section(SelectionRow)
    return bool(row.deadline_skipped) and not row.selected and not result.declined


class FleetSilent(RuntimeError):
    """``run.max-empty-rounds`` rounds in a row aggregated no device; the message says why
    and how to go on."""


def _listed(devices: list[str]) -> str:
    """The first five of ``devices`` in a stable order (a streak's causes are deduplicated)."""
    return ", ".join(sorted(devices)[:5]) + (", ..." if len(devices) > 5 else "")


def empty_round_cause(result: RoundResult) -> str:
    """Why ``result``'s round aggregated nobody, as one line."""
    row = result.context.section(ScreeningRow)
    said = row.no_participants or "nobody was selected"
    if result.unreachable and not result.declined and not result.rejected:
        names = ", ".join(sorted(result.unreachable)[:5]) + (
            ", ..." if len(result.unreachable) > 5 else ""
        )
        return (
            f"the devices asked are unreachable ({len(result.unreachable)}: {names}); on the "
            "Simulation Engine the engine's workers may have been killed (e.g. out of memory): "
            "see flower.log"
        )
    if result.declined and not result.rejected:
        names = ", ".join(sorted(result.declined)[:5]) + (
            ", ..." if len(result.declined) > 5 else ""
        )
        return f"every device asked declined ({len(result.declined)}: {names})"
    if result.rejected:
        first = result.rejected[0]
        return (
            f"every reply was rejected by screening ({len(result.rejected)}; e.g. device "
            f"{str(first.get('device'))[:40]}: {str(first.get('reason'))[:120]})"
        )
    errors = result.context.status_errors
    if errors and not result.context.status:
        # They are there but cannot say their status: their ClientApp fails (a setting the
        # fleet cannot meet, say). Their own reason, not "unreachable".
        why = next(iter(errors.values()))
        return (
            f"every device that was asked answered the status query with an error "
            f"({len(errors)}; e.g. {why[:160]}); see flower.log"
        )
    if row.missing or "answered" in said or "no reply" in said or "no node" in said:
        return (
            f"the devices are unreachable ({said}); on the Simulation Engine the engine's "
            "workers may have been killed (e.g. out of memory): see flower.log"
        )
    return f"no device could be selected ({said})"


class EmptyRoundsStop(RoundCallback):
    """Round callback (put it after the checkpoint): raise :class:`FleetSilent` once
    ``limit`` rounds in a row had no participant (0: never). ``deadline_retry`` is
    ``selection.deadline-retry``: when it is 0 a device the deadline skips is never tried
    again, so a round it emptied counts like any other."""

    def __init__(self, limit: int, deadline_retry: int = 0) -> None:
        self.limit = limit
        self.deadline_retry = deadline_retry
        self.streak: list[tuple[int, str]] = []  # (round, cause) of the empty rounds in a row

    def after_round(self, result: RoundResult) -> str | None:
        # A rest is data-free stopping's decision (the session has stopped learning), not a
        # silent fleet: the story counts it apart too.
        resting = bool(result.context.section(StoppingRow).stopping_resting)
        if result.participants or not self.limit or resting or waiting_for_energy(result):
            self.streak = []
            return None
        if self.deadline_retry and skipped_by_deadline(result):
            return None  # the retry brings the skipped devices back: neither silent nor heard
        self.streak.append((result.round, empty_round_cause(result)))
        if len(self.streak) < self.limit:
            return None
        first, last = self.streak[0][0], self.streak[-1][0]
        causes = list(dict.fromkeys(cause for _, cause in self.streak))
        raise FleetSilent(
            f"no device took part in {len(self.streak)} rounds in a row (rounds {first}-{last}; "
            f"run.max-empty-rounds = {self.limit}): {'; '.join(causes[-2:])}. The checkpoint "
            f"of round {last} is kept: fix the cause and continue with --resume (resume = "
            "true), or set run.max-empty-rounds = 0 to run on regardless."
        )
