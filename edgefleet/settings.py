"""How a run-config key is declared: ``key(name, default, check, help)`` as a field of a frozen
section dataclass that lives beside the component it configures (``StoppingConfig`` in
:mod:`edgefleet.strategies.stopping`, ...), and everything derived from those declarations:
the checks, parsing a flat ``key = value`` mapping into sections, and the reference table.

A leaf module: it imports no component, so every component can declare its section here
and :mod:`edgefleet.config` composes them without an import cycle. Adding a key is adding a
field to its component's section (plus ``python docs/gen.py`` for the reference).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

from edgefleet.errors import SettingError

Value = bool | int | float | str
# A check returns None when the value is fine, else the text "must be ..." for the error.
Check = Callable[[Any], str | None]
S = TypeVar("S")


class ConfigError(SettingError):
    """A run-config value is invalid; the message names the key, value and valid choices."""


# -- bounds every value of a type meets (docs/reference/config-limits.md) --------------------

# Every integer goes to NumPy, torch and Flower's records (64-bit at most; numpy's legacy
# seeding 32-bit): 2^31 - 1 is far above any count a fleet has and below every such limit.
MAX_INT = 2**31 - 1
MAX_TEXT = 4096  # characters of a string value (a path: Linux's PATH_MAX)


@dataclass(frozen=True)
class KeySpec:
    """One run-config key: its name, default (whose type is the key's type), check, help
    text, an optional parser from the raw value to the field's value, and the largest
    integer it takes."""

    name: str
    default: Value
    check: Check
    help: str
    parse: Callable[[Any], Any] | None = None
    most: int = MAX_INT


def key(
    name: str,
    default: Value,
    check: Check,
    help: str,
    parse: Callable[[Any], Any] | None = None,
    most: int = MAX_INT,
) -> Any:
    """A section field read from run-config key ``name``; the field's own default is the
    parsed default, so ``Section()`` is the section at its defaults."""
    spec = KeySpec(name, default, check, help, parse, most)
    return field(default=parse(default) if parse else default, metadata={"spec": spec})


def section(cls: type[S]) -> Any:
    """A field of a composed config holding section ``cls`` (defaults: ``cls()``)."""
    return field(default_factory=cls, metadata={"section": cls})


def bounds(spec: KeySpec, value: Value) -> str | None:
    """What no key of ``value``'s type accepts: inf or NaN numbers, integers beyond
    :data:`MAX_INT` (or the key's own bound), strings longer than :data:`MAX_TEXT` or
    holding a NUL."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and not -MAX_INT <= value <= spec.most
    ):
        return f"must be at most {spec.most:,}" if value > 0 else f"must be at least {-MAX_INT:,}"
    if isinstance(value, str) and len(value) > MAX_TEXT:
        return f"must be at most {MAX_TEXT} characters (has {len(value):,})"
    if isinstance(value, str) and "\0" in value:  # no path, name or list holds one
        return "must not contain a NUL character"
    return None


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error names a bad value without
    repeating a megabyte of it."""
    if isinstance(value, int) and abs(value) >= 10**30:  # (repr fails past 4,300 digits)
        return f"{'-' if value < 0 else ''}<an integer of {value.bit_length():,} bits>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text):,} chars)"


# -- checks ---------------------------------------------------------------------------------


def choice(options: Iterable[str]) -> Check:
    options = tuple(options)
    return lambda v: None if v in options else f"must be one of {', '.join(options)}"


def at_least(low: float) -> Check:
    return lambda v: None if v >= low else f"must be >= {low}"


def positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def fraction(v: Any) -> str | None:
    return None if 0.0 < v <= 1.0 else "must be in (0, 1]"


def unit_interval(v: Any) -> str | None:
    return None if 0.0 <= v <= 1.0 else "must be in [0, 1]"


def half_open_fraction(v: Any) -> str | None:
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def open_fraction(v: Any) -> str | None:
    return None if 0.0 < v < 1.0 else "must be in (0, 1)"


def anything(_: Any) -> str | None:
    return None


def not_empty(v: str) -> str | None:
    return None if v else "must not be empty"


def finite(v: float) -> str | None:
    return None if v == v and abs(v) != float("inf") else "must be a finite number"


def names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def int_list(v: str) -> str | None:
    try:
        values = ints(v)
    except ValueError:
        return "must be comma-separated device ids, e.g. '100,101'"
    return None if all(x >= 0 for x in values) else "each id must be >= 0"


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def float_list(low: float, high: float, low_open: bool, example: str) -> Check:
    def check(v: str) -> str | None:
        try:
            values = floats(v)
        except ValueError:
            return f"must be comma-separated numbers, e.g. '{example}'"
        ok = all((low < x if low_open else low <= x) and x <= high for x in values)
        return None if ok else f"each value must be in {'(' if low_open else '['}{low}, {high}]"

    return check


# -- derived from the declarations ---------------------------------------------------------


def walk(cfg: Any) -> Iterator[tuple[KeySpec, Any, Field[Any]]]:
    """(spec, owner, field) for every key of ``cfg`` (a section or a composed config, class
    or instance), in declaration order; ``owner`` is the section instance (or class)."""
    for f in fields(cfg):
        if "spec" in f.metadata:
            yield f.metadata["spec"], cfg, f
        elif "section" in f.metadata:
            yield from walk(
                f.metadata["section"] if isinstance(cfg, type) else getattr(cfg, f.name)
            )


def keys_of(cls: type) -> dict[str, KeySpec]:
    """Every key of ``cls`` by name; a name declared twice is a programming error."""
    found: dict[str, KeySpec] = {}
    for spec, _, _ in walk(cls):
        if spec.name in found:
            raise TypeError(f"run-config key {spec.name!r} is declared twice in {cls.__name__}")
        if not callable(spec.check):  # a field named like its check shadows it in the body
            raise TypeError(f"run-config key {spec.name!r}: its check is not a function")
        found[spec.name] = spec
    return found


# What a value of each key type is called in an error (a float key takes any number).
TYPE_NAMES: dict[type, str] = {
    bool: "a boolean (true or false)",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def toml(value: Value) -> str:
    """A value as it is written in TOML and ``--set`` (``false``, not ``False``)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def coerce(spec: KeySpec, value: Any) -> Value:
    """Match the default's type; TOML and ``--run-config`` give ints where floats are meant."""
    want = type(spec.default)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # beyond any float: 10**400
            raise ConfigError(
                f"run config '{spec.name}' = {shown(value)}: must be a finite number"
            ) from None
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(
            f"run config '{spec.name}' = {shown(value)}: must be {TYPE_NAMES[want]} "
            f"(default {toml(spec.default)})"
        )
    return value


def close_names(name: str, known: Iterable[str]) -> list[str]:
    """The known names closest to a misspelt ``name`` (best first; ties kept), or none."""
    close = difflib.get_close_matches(name, list(known), n=3)
    ratio = [difflib.SequenceMatcher(None, name, c).ratio() for c in close]
    return [c for c, r in zip(close, ratio, strict=True) if r >= ratio[0] - 0.05]


def unknown_keys_message(what: str, unknown: Iterable[str], known: Iterable[str]) -> str:
    """``unknown WHAT key 'k'; did you mean 'x'?`` (several keys: each with its guess)."""
    known = list(known)
    listed_names = sorted(unknown)
    guesses = {n: " or ".join(repr(c) for c in close_names(n, known)) for n in listed_names}
    if len(listed_names) == 1:
        name, guess = listed_names[0], guesses[listed_names[0]]
        return f"unknown {what} key {name!r}" + (f"; did you mean {guess}?" if guess else "")
    listed = ", ".join(
        f"{n!r}" + (f" (did you mean {g}?)" if g else "") for n, g in guesses.items()
    )
    return f"unknown {what} keys {listed}"


def checked_values(specs: Mapping[str, KeySpec], raw: Mapping[str, Any]) -> dict[str, Value]:
    """Every key of ``specs`` from ``raw`` (its default where missing), type-matched and
    checked; the first bad one raises :class:`ConfigError` naming key, value and what is
    valid. Unknown keys are the caller's to refuse."""
    values: dict[str, Value] = {}
    for name, spec in specs.items():
        value = coerce(spec, raw.get(name, spec.default))
        problem = bounds(spec, value) or spec.check(value)
        if problem:
            raise ConfigError(f"run config '{name}' = {shown(value)}: {problem}")
        values[name] = value
    return values


def build(cls: type[S], values: Mapping[str, Value]) -> S:
    """``cls`` (a section or a composed config) from checked values by key name."""
    kwargs: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if "spec" in f.metadata:
            spec: KeySpec = f.metadata["spec"]
            value = values[spec.name]
            kwargs[f.name] = spec.parse(value) if spec.parse else value
        elif "section" in f.metadata:
            kwargs[f.name] = build(f.metadata["section"], values)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} is neither a key nor a section")
    return cls(**kwargs)


def parse_section(cls: type[S], raw: Mapping[str, Any]) -> S:
    """One section (or any composed config) from its own keys in ``raw`` (missing keys take
    their defaults; unknown ones are refused, with the close names)."""
    specs = keys_of(cls)
    unknown = set(raw) - set(specs)
    if unknown:
        raise ConfigError(unknown_keys_message(f"{cls.__name__}", unknown, specs))
    return build(cls, checked_values(specs, raw))


def checked(
    cfg: S,
    name: str | None = None,
    value: Any = None,
    allowed: Iterable[str] = (),
    who: str = "",
) -> S:
    """``cfg`` (a section, perhaps made by hand rather than parsed) when every key's value
    passes its check, else :class:`ConfigError` naming key, value and what is valid. With
    ``name``: also that key's ``value`` is one of ``allowed``, the values under which
    component ``who`` is built (a component's ``from_config`` calls this)."""
    checked_values(keys_of(type(cfg)), flat(cfg))
    allowed = tuple(allowed)
    if name is not None and value not in allowed:
        raise ConfigError(
            f"run config '{name}' = {shown(value)}: {who or 'this component'} is built with "
            f"{name} one of {', '.join(allowed)}"
        )
    return cfg


def flat(cfg: Any) -> dict[str, Any]:
    """A section or composed config back in run-config key names (lists comma-joined, as
    they are written), sorted: parsing it again gives an equal config."""
    out: dict[str, Any] = {}
    for spec, owner, f in walk(cfg):
        value = getattr(owner, f.name)
        out[spec.name] = ",".join(str(x) for x in value) if isinstance(value, tuple) else value
    return dict(sorted(out.items()))


def markdown_table(cls: type) -> str:
    """The reference table of every key of ``cls``: name, default and meaning."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for spec in keys_of(cls).values():
        default = spec.default
        text = str(default).lower() if isinstance(default, bool) else default
        text = f'`"{text}"`' if isinstance(default, str) else f"{text}"
        lines.append(f"| `{spec.name}` | {text} | {spec.help} |")
    return "\n".join(lines) + "\n"


setting = key  # the name a component's section uses (``key`` is a common loop variable)
