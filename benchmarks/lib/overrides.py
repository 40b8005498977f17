"""``--set KEY=VALUE``: run-config keys for every run of a benchmark, as ``edgefleet run --set``
takes them. The keys are the run config's own (``edgefleet.config.KEYS``), so a benchmark need
not re-declare a flag for each key it passes through, and a misspelt key is refused, with the
nearest valid names, before any run starts."""

from __future__ import annotations

import argparse
from typing import Any

from edgefleet.cli import parse_overrides
from edgefleet.config import KEYS, ConfigError
from edgefleet.settings import checked_values, unknown_keys_message


def add_set_arg(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """The repeatable ``--set KEY=VALUE`` option (``args.set``: the raw items)."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=help
        or "a run-config key for every run (as `edgefleet run --set`; `python -m "
        "edgefleet.config` lists them); repeatable",
    )


def parse_sets(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """``items`` as a run-config mapping; a malformed item, an unknown key or a value its key
    refuses is ``parser``'s usage error (exit 2) naming it. Each key is checked alone: whether
    the keys go together is the run's own check, with the benchmark's other settings."""
    sets = parse_overrides(parser, items)
    unknown = set(sets) - set(KEYS)
    if unknown:
        parser.error(
            f"--set: {unknown_keys_message('run-config', unknown, KEYS)} "
            "(`python -m edgefleet.config` lists every key)"
        )
    try:
        checked_values({k: KEYS[k] for k in sets}, sets)
    except ConfigError as err:
        parser.error(f"--set: {err}")
    return sets


def add_key_args(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """``--KEY`` for each run-config key in ``defaults`` (the benchmark's default for it), its
    type and help taken from the key's declaration rather than written again here; parsed
    values are checked as the run config checks them (:func:`key_values`)."""
    for name, default in defaults.items():
        spec = KEYS[name]
        kind = type(spec.default)
        if kind not in (int, float, str):
            raise TypeError(f"run-config key {name!r} ({kind.__name__}) has no flag form")
        parser.add_argument(
            f"--{name}", type=kind, default=default, help=f"{spec.help} (run-config key)"
        )


def key_values(
    parser: argparse.ArgumentParser, args: argparse.Namespace, keys: list[str]
) -> dict[str, Any]:
    """The run-config mapping of the ``--KEY`` flags ``keys`` that :func:`add_key_args`
    declared; a value its key refuses is ``parser``'s usage error naming it."""
    values = {name: getattr(args, name.replace("-", "_")) for name in keys}
    try:
        checked_values({k: KEYS[k] for k in values}, values)
    except ConfigError as err:
        parser.error(str(err))
    return values
