"""The round-loop machinery every EdgeFleet strategy runs in.

:mod:`~edgefleet.loop.roundloop` (:class:`RoundLoop`, the one sender of messages, reply
outcomes, round callbacks), :mod:`~edgefleet.loop.status` (the status phase: declarations,
the fleet's slot clock and participant cap), :mod:`~edgefleet.loop.context` (the round
context and its typed row sections), :mod:`~edgefleet.loop.registry` (the device registry),
:mod:`~edgefleet.loop.hooks` (what a wrapper may implement), :mod:`~edgefleet.loop.base`
(``LoopStrategy``, the base of every wrapper, and ``SubsetGrid``),
:mod:`~edgefleet.loop.screening` (reply screening), :mod:`~edgefleet.loop.timing` (round
timing and deadlines), and the asynchronous loop (:mod:`~edgefleet.loop.asyncloop`,
:mod:`~edgefleet.loop.staleness`). Users import the public names from
:mod:`edgefleet.strategies`.
"""
