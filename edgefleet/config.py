"""Run config: the flat ``key = value`` table Flower hands to both apps, parsed once.

Flower passes ``context.run_config`` as a flat mapping (``pyproject.toml``'s
``[tool.flwr.app.config]`` fused with ``--run-config`` overrides). :func:`parse_run_config`
turns it into a frozen :class:`RunConfig` and rejects every bad value before any work is
spent, naming the key, the value and what would have been valid.

Each key is declared once, as a field of the section dataclass beside the component that uses
it (``key(name, default, check, help)``, :mod:`edgefleet.settings`): ``StoppingConfig`` in
:mod:`edgefleet.strategies.stopping`, ``EnergyConfig`` beside ``EnergyAgeSelection``, and so
on. :class:`RunConfig` composes the sections; this module keeps the run's own keys
(:class:`ServerConfig`), the rules that involve more than one section, and what derives from
the declarations: ``KEYS``, ``DEFAULTS``, :func:`markdown_table` (the reference's key table,
kept equal by a test, as is ``pyproject.toml``'s table). To add a key, add a field to its
component's section.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from edgefleet import settings
from edgefleet.algorithms.warmstart import WarmStartMode
from edgefleet.attacks.mods import AttackConfig
from edgefleet.harvest import SourceKind
from edgefleet.loop.asyncloop import AsyncConfig
from edgefleet.loop.screening import ScreeningConfig
from edgefleet.loop.timing import WAIT_MODES
from edgefleet.pruning.names import Criterion, Reconstruction
from edgefleet.settings import (
    ConfigError,
    KeySpec,
    Value,
    anything,
    at_least,
    choice,
    fraction,
    key,
    names,
    not_empty,
    positive,
    section,
    shown,
    unit_interval,
    unknown_keys_message,
)
from edgefleet.strategies.energy_selection import EnergyConfig, SelectionMode
from edgefleet.strategies.fedsag import SagaConfig
from edgefleet.strategies.reconstruction import PruningConfig
from edgefleet.strategies.robust import RobustConfig, RobustRule
from edgefleet.strategies.stopping import (
    StoppingConfig,
    StoppingMode,
    ValidationSplit,
)
from edgefleet.strategies.warmstart_initializer import (
    SessionSchedule,
    SessionsConfig,
    WarmStartConfig,
)
from edgefleet.task.names import LrSchedule, TrainConfig
from edgefleet.task.partition import DataConfig

__all__ = [  # the sections and names other modules import from here
    "DEFAULTS",
    "KEYS",
    "SAGA_FAMILY",
    "STRATEGIES",
    "AsyncConfig",
    "AttackConfig",
    "ConfigError",
    "DataConfig",
    "EnergyConfig",
    "KeySpec",
    "LrSchedule",
    "PruningConfig",
    "RobustConfig",
    "RunConfig",
    "SagaConfig",
    "ScreeningConfig",
    "SelectionMode",
    "ServerConfig",
    "SessionSchedule",
    "SessionsConfig",
    "StoppingConfig",
    "StoppingMode",
    "StrategyName",
    "TrainConfig",
    "ValidationSplit",
    "Value",
    "WarmStartConfig",
    "attack_keys_set",
    "markdown_table",
    "parse_run_config",
    "shown",
    "unknown_keys_message",
]


class StrategyName(StrEnum):
    """The inner strategy (``strategy``)."""

    FEDAVG = "fedavg"
    FEDPROX = "fedprox"
    FEDSAG = "fedsag"
    MIFA = "mifa"
    FEDVARP = "fedvarp"
    SCAFFOLD = "scaffold"


# FedSAG and the baselines that are fixed configurations of it (robust rules go inside them).
SAGA_FAMILY: tuple[str, ...] = (StrategyName.FEDSAG, StrategyName.MIFA, StrategyName.FEDVARP)
STRATEGIES: tuple[str, ...] = tuple(m.value for m in StrategyName)

# A round budget no run reaches (a million rounds of a one-second round is 11 days); above it
# a value is a typo or an attempt to run forever.
MAX_ROUNDS = 1_000_000

# Keys a resumed run may change when `resume-changes` names them: they change how much is
# run or measured, not what the rounds already on record did.
RESUME_CHANGEABLE: tuple[str, ...] = (
    "num-server-rounds",
    "evaluate-every",
    "eval-samples",
    "fraction-evaluate",
)
# Keys that say where and how long to wait, never what the run is: never compared on resume.
RESUME_OPERATIONAL: tuple[str, ...] = (
    "output-dir",
    "run-name",
    "resume",
    "resume-changes",
    "data-dir",
    "round-timeout",
    "timeout-mode",
    "first-round-timeout",
    "timeout-slack",
    "timeout-margin",
    "node-wait-timeout",
    "min-nodes",
    "client-threads",
    "run.max-empty-rounds",
)


def _run_name(v: str) -> str | None:
    if "/" in v or "\\" in v:
        return "must not contain '/' or '\\'"
    return "must not be '.' or '..'" if v in (".", "..") else None


def _resume_changes(v: str) -> str | None:
    bad = [k for k in names(v) if k not in RESUME_CHANGEABLE]
    if bad:
        return f"names {', '.join(bad)}; only these may change on resume: " + ", ".join(
            RESUME_CHANGEABLE
        )
    return None


@dataclass(frozen=True)
class ServerConfig:
    num_rounds: int = key("num-server-rounds", 5, at_least(1), "round budget", most=MAX_ROUNDS)
    max_empty_rounds: int = key(
        "run.max-empty-rounds",
        3,
        at_least(0),
        "stop the run with an error (its checkpoint kept for `--resume`) after this many rounds "
        "in a row without a participant, naming the cause (0 = never)",
    )
    strategy: str = key(
        "strategy",
        "fedavg",
        choice(STRATEGIES),
        "`fedavg`, `fedprox`, `fedsag` (SAGA memory), and the field's baselines: `mifa`, "
        "`fedvarp`, `scaffold` (needs a ClientApp that applies its correction; "
        "docs/explanation/field-baselines.md)",
    )
    fraction_train: float = key(
        "fraction-train", 1.0, fraction, "fraction of online nodes asked to train each round"
    )
    fraction_evaluate: float = key(
        "fraction-evaluate",
        0.0,
        unit_interval,
        "fraction of online nodes asked to evaluate the global model on their own test data "
        "each round (federated evaluation; 0 = none)",
    )
    evaluate_every: int = key(
        "evaluate-every",
        1,
        at_least(1),
        "central evaluation every N rounds and on the last (rows between say `evaluated: false`)",
    )
    min_nodes: int = key(
        "min-nodes",
        2,
        at_least(1),
        "nodes to wait for before round 1 (at most `node-wait-timeout` s, then go on; a "
        "resumed run goes on once none has joined for 15 s)",
    )
    round_timeout: float = key(
        "round-timeout",
        600.0,
        positive,
        "seconds to wait for a round's replies (with `timeout-mode` `expected`: the most a "
        "timed device is waited for)",
    )
    timeout_mode: str = key(
        "timeout-mode",
        "fixed",
        choice(WAIT_MODES),
        "`fixed` (every reply waited for `round-timeout`) or `expected` (each device for "
        "`timeout-slack` x its observed round + `timeout-margin`, at most `round-timeout`; "
        "`first-round-timeout` before its first timed round)",
    )
    first_round_timeout: float = key(
        "first-round-timeout",
        600.0,
        positive,
        "`timeout-mode` `expected`: seconds to wait for a device never timed (its first round "
        "installs, imports and loads data); may exceed `round-timeout`",
    )
    timeout_slack: float = key(
        "timeout-slack", 3.0, at_least(1.0), "`timeout-mode` `expected`: x the observed round"
    )
    timeout_margin: float = key(
        "timeout-margin", 10.0, at_least(0.0), "`timeout-mode` `expected`: seconds added"
    )
    eval_samples: int = key(
        "eval-samples",
        0,
        at_least(0),
        "central evaluation on a seeded random subset of this many test images (0 = all)",
    )
    node_wait_timeout: float = key(
        "node-wait-timeout", 120.0, at_least(0.0), "seconds to wait for `min-nodes`"
    )
    output_dir: str = key("output-dir", "runs", not_empty, "results go to `output-dir/run-name`")
    run_name: str = key(
        "run-name", "", _run_name, "the run's folder name (made up from time and config if empty)"
    )
    resume: bool = key("resume", False, anything, "continue `run-name` from its last checkpoint")
    resume_changes: tuple[str, ...] = key(
        "resume-changes",
        "",
        _resume_changes,
        "keys a resumed run may change (comma-separated; of "
        + ", ".join(f"`{k}`" for k in RESUME_CHANGEABLE)
        + "); any other change is refused",
        names,
    )


@dataclass(frozen=True)
class RunConfig:
    """The whole run config: the run's own keys and every component's section, in the order
    of the reference table."""

    server: ServerConfig = section(ServerConfig)
    saga: SagaConfig = section(SagaConfig)
    data: DataConfig = section(DataConfig)
    train: TrainConfig = section(TrainConfig)
    energy: EnergyConfig = section(EnergyConfig)
    stopping: StoppingConfig = section(StoppingConfig)
    pruning: PruningConfig = section(PruningConfig)
    sessions: SessionsConfig = section(SessionsConfig)
    warmstart: WarmStartConfig = section(WarmStartConfig)
    screening: ScreeningConfig = section(ScreeningConfig)
    robust: RobustConfig = section(RobustConfig)
    attack: AttackConfig = section(AttackConfig)
    aggregation: AsyncConfig = section(AsyncConfig)
    seed: int = key("seed", 0, at_least(0), "seeds partitions, initial model, sampling, batches")

    @property
    def sessions_enabled(self) -> bool:
        s = self.sessions
        return (
            s.schedule != SessionSchedule.NONE
            or s.rounds > 0
            or self.warmstart.mode != WarmStartMode.PREVIOUS
        )

    def to_dict(self) -> dict[str, Any]:
        """The resolved config, in the run-config key names, for ``summary.json``."""
        return settings.flat(self)


KEYS: dict[str, KeySpec] = settings.keys_of(RunConfig)
DEFAULTS: dict[str, Value] = {name: spec.default for name, spec in KEYS.items()}


def parse_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """Validate ``raw`` (missing keys take their defaults) and build a :class:`RunConfig`.

    Keys this version does not know are an error too: a typo would otherwise be ignored.
    """
    unknown = set(raw) - set(KEYS)
    if unknown:
        # Suggestions, not the ~90 keys: those are one command away.
        raise ConfigError(
            f"{unknown_keys_message('run-config', unknown, KEYS)} "
            "(`python -m edgefleet.config` lists every key)"
        )
    values = settings.checked_values(KEYS, raw)
    cfg = settings.build(RunConfig, values)
    _check_together(cfg)
    _check_harvest(values)
    _check_async(cfg)
    return cfg


def markdown_table() -> str:
    """The reference's table of every key, its default and its meaning."""
    return settings.markdown_table(RunConfig)


def _check_harvest(values: Mapping[str, Value]) -> None:
    """A per-partition list would silently win over a single P_h, so a run that sets both is
    refused. Flower hands every key, its default included, so "sets" means "differs from the
    default": an explicit 0.5 beside a list cannot be told apart and the list applies."""
    prob, probs = values["energy.harvest-prob"], values["energy.harvest-probs"]
    if probs and prob != KEYS["energy.harvest-prob"].default:
        raise ConfigError(
            f"run config 'energy.harvest-prob' = {prob!r} with 'energy.harvest-probs' = "
            f"{probs!r}: the per-partition list wins, so {prob!r} would not be used; set "
            f'energy.harvest-probs = "" to give every device {prob!r}, or put the rates in '
            "energy.harvest-probs alone"
        )


def attack_keys_set(raw: Mapping[str, Any]) -> list[str]:
    """The ``attack.*`` keys of ``raw`` whose value differs from the default (Flower hands
    every key, defaults included, so a key at its default cannot be told from an absent one)."""
    return sorted(
        k for k, v in raw.items() if k.startswith("attack.") and k in KEYS and v != KEYS[k].default
    )


def _check_together(cfg: RunConfig) -> None:
    """Rules that involve more than one key."""
    s = cfg.sessions
    if s.schedule == SessionSchedule.ALTERNATE:
        if s.rounds < 1:
            raise ConfigError(
                "run config 'sessions.rounds' = 0: must be >= 1 with sessions.schedule = "
                "'alternate' (the length of each session)"
            )
        if cfg.server.num_rounds != s.count * s.rounds:
            raise ConfigError(
                f"run config 'num-server-rounds' = {cfg.server.num_rounds}: must equal "
                f"sessions.count x sessions.rounds = {s.count} x {s.rounds} = "
                f"{s.count * s.rounds} with sessions.schedule = 'alternate'"
            )
    if cfg.sessions_enabled and cfg.stopping.mode in (
        StoppingMode.VALIDATION,
        StoppingMode.OBSERVE,
    ):
        raise ConfigError(
            f"run config 'stopping.mode' = {cfg.stopping.mode!r}: the validation baseline "
            "cannot run within sessions; use 'data-free' or 'off'"
        )
    e = cfg.energy
    if e.status_max_age and e.selection != SelectionMode.ENERGY_AGE:
        raise ConfigError(
            f"run config 'selection.status-max-age' = {e.status_max_age!r} with selection.mode "
            f"= {e.selection!r}: it is energy-age selection's; set selection.mode = "
            "'energy-age' or selection.status-max-age = 0"
        )
    if e.deadline and e.selection != SelectionMode.ENERGY_AGE:
        raise ConfigError(
            f"run config 'selection.deadline' = {e.deadline!r} with selection.mode = "
            f"{e.selection!r}: the deadline is energy-age selection's; set selection.mode = "
            "'energy-age' or selection.deadline = 0"
        )
    if (
        e.selection == SelectionMode.ENERGY_AGE
        and e.source != SourceKind.ALWAYS_ON
        and e.capacity < e.round_cost
    ):
        raise ConfigError(
            f"run config 'energy.capacity' = {e.capacity}: below one round's cost "
            f"{e.round_cost:g} (energy.train-slots + 1), so no device could ever train"
        )
    _check_baselines(cfg)
    p = cfg.pruning
    if p.reconstruction == Reconstruction.ELEMENTWISE and cfg.server.strategy not in (
        StrategyName.FEDAVG,
        StrategyName.FEDPROX,
    ):
        raise ConfigError(
            f"run config 'pruning.reconstruction' = 'elementwise' with strategy = "
            f"{cfg.server.strategy!r}: the per-entry average replaces a plain weighted mean; "
            "use strategy 'fedavg' or 'fedprox', or reconstruction 'global' or 'zeros'"
        )
    if cfg.robust.rule != RobustRule.OFF and p.reconstruction == Reconstruction.ELEMENTWISE:
        raise ConfigError(
            f"run config 'robust.rule' = {cfg.robust.rule!r} with 'pruning.reconstruction' = "
            "'elementwise': the per-entry mean would replace the rule; use reconstruction "
            "'global' (the rule then works over the devices that kept each entry)"
        )
    a = cfg.attack
    if a.kind == "sybil" and not a.sybil_ids:
        raise ConfigError(
            "run config 'attack.kind' = 'sybil': needs 'attack.sybil-ids', the device ids the "
            "attacker claims (e.g. '100,101')"
        )
    w = cfg.warmstart
    if cfg.train.lr_schedule == LrSchedule.SESSION_POLY and not (cfg.sessions_enabled and s.rounds):
        raise ConfigError(
            "run config 'lr-schedule' = 'session-poly': needs sessions of a known length "
            "(sessions.rounds >= 1); use 'constant' or set sessions.rounds"
        )
    if w.mode == WarmStartMode.PILOT and s.rounds and w.aux_rounds >= s.rounds:
        raise ConfigError(
            f"run config 'warmstart.aux-rounds' = {w.aux_rounds}: must be below "
            f"sessions.rounds = {s.rounds}, or no round of a session is left to train"
        )


def _check_baselines(cfg: RunConfig) -> None:
    """MIFA and FedVARP fix FedSAG's form; FedRolex's window moves every round; SCAFFOLD's
    correction fits only the full model and replaces the aggregation a robust rule would."""
    saga, strategy = cfg.saga, cfg.server.strategy
    if strategy in (StrategyName.MIFA, StrategyName.FEDVARP):
        form = ("saga.init", "saga.estimator", "saga.memory-mean", "saga.correction")
        values = (saga.init, saga.estimator, saga.memory_mean, saga.correction)
        changed = [k for k, v in zip(form, values, strict=True) if v != KEYS[k].default]
        if changed:
            raise ConfigError(
                f"run config {', '.join(repr(k) for k in changed)} with strategy = "
                f"{strategy!r}: {strategy} fixes FedSAG's form; use strategy 'fedsag' to "
                "choose it, or leave these keys at their defaults"
            )
    p = cfg.pruning
    if p.criterion == Criterion.ROLLING and p.compact_download:
        raise ConfigError(
            "run config 'pruning.criterion' = 'rolling' with pruning.compact-download = true: "
            "FedRolex's window moves every round, the compact download sends last round's "
            "slice; set pruning.compact-download = false"
        )
    if p.criterion == Criterion.ORDERED_DROPOUT:
        clash = []
        if p.compact_download:
            clash.append("pruning.compact-download = true (the device needs the full model)")
        if strategy in (StrategyName.FEDPROX, StrategyName.SCAFFOLD):
            clash.append(f"strategy = {strategy!r} (its local term)")
        if cfg.sessions_enabled and cfg.warmstart.mode == WarmStartMode.CONTINUOUS:
            clash.append("warmstart.mode = 'continuous' (its distillation term)")
        if clash:
            raise ConfigError(
                "run config 'pruning.criterion' = 'ordered-dropout' with "
                + "; ".join(clash)
                + ": FjORD's local steps are plain SGD steps on nested widths"
            )
    if strategy == StrategyName.SCAFFOLD:
        if p.keep_ratio < 1 or any(r < 1 for r in p.keep_ratios):
            raise ConfigError(
                "run config strategy = 'scaffold' with pruning.keep-ratio(s) below 1: "
                "SCAFFOLD's correction is a full-size model and fits no pruned submodel; "
                "use keep ratio 1 or another strategy"
            )
        if cfg.robust.rule != RobustRule.OFF:
            raise ConfigError(
                f"run config 'robust.rule' = {cfg.robust.rule!r} with strategy = 'scaffold': "
                "SCAFFOLD's step updates its control variates from the same mean the rule "
                "would replace; use robust.rule = 'off' or another strategy"
            )


def _check_async(cfg: RunConfig) -> None:
    """What asynchronous aggregation does not support yet is refused before the run starts,
    naming the key (docs/how-to/async-aggregation.md says why each is not there yet)."""
    a = cfg.aggregation
    if a.server_lr_min > a.server_lr:
        raise ConfigError(
            f"run config: async.server-lr-min = {a.server_lr_min!r} is above async.server-lr "
            f"= {a.server_lr!r}; the cosine server step decays from the second to the first"
        )
    if not a.enabled:
        return
    p = cfg.pruning
    pruned = p.keep_ratio < 1 or any(r < 1 for r in p.keep_ratios)
    refused = {
        f"selection.deadline = {cfg.energy.deadline!r}": (
            cfg.energy.selection == SelectionMode.ENERGY_AGE and cfg.energy.deadline > 0,
            "the deadline skips devices whose round is slower than a round's wait; there is "
            "no round to wait for (a slow device's update arrives stale and is discounted)",
        ),
        f"pruning.reconstruction = {p.reconstruction!r} with CA-HFP": (
            pruned and p.reconstruction != Reconstruction.GLOBAL,
            "a submodel is rebuilt against the version it was cut from and only its own "
            "entries move ('global'); 'zeros' and 'elementwise' mix entries of several "
            "versions",
        ),
        "pruning.compact-download = true": (
            pruned and p.compact_download,
            "a compact download is the slice of one version, and a device's channels are "
            "refreshed on a round schedule the versions do not keep",
        ),
        "sessions (sessions.schedule, sessions.rounds or warmstart.mode)": (
            cfg.sessions_enabled,
            "session boundaries and warm start are defined between synchronous rounds",
        ),
        f"stopping.mode = {cfg.stopping.mode!r}": (
            cfg.stopping.mode in (StoppingMode.VALIDATION, StoppingMode.OBSERVE),
            "the validation baseline's best-round model is not kept across versions; "
            "'data-free' and 'off' work",
        ),
        "strategy = 'scaffold'": (
            cfg.server.strategy == StrategyName.SCAFFOLD,
            "SCAFFOLD's control variates are updated from one synchronous round's replies, "
            "all made from the same model; a stale reply's correction does not hold",
        ),
        f"async.participation = {a.participation!r} with strategy = {cfg.server.strategy!r}": (
            a.participation != "none" and cfg.server.strategy in SAGA_FAMILY,
            "the server memory already counts every device's last update in each model; "
            "the weight would count a rare device's stored update up to the cap times",
        ),
        f"fraction-evaluate = {cfg.server.fraction_evaluate!r}": (
            cfg.server.fraction_evaluate > 0,
            "federated evaluation needs a round barrier; use central evaluation",
        ),
    }
    for what, (hit, why) in refused.items():
        if hit:
            raise ConfigError(
                f"run config: aggregation.mode = 'async' does not yet support {what}: {why}. "
                "Use aggregation.mode = 'sync' for it, or turn it off"
            )


if __name__ == "__main__":  # python -m edgefleet.config: print the README's key table
    print(markdown_table(), end="")
