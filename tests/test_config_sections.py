"""Each setting beside its component: a section dataclass per component, composed by the run
config; every component built by ``from_config`` from its section; a new key is one
declaration, from which parsing, checks, defaults and the reference table all follow."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAvg

from edgefleet import settings
from edgefleet.config import KEYS, RunConfig, ServerConfig, markdown_table, parse_run_config
from edgefleet.loop.asyncloop import AsyncConfig
from edgefleet.loop.screening import Screening, ScreeningConfig
from edgefleet.loop.staleness import AsyncSettings
from edgefleet.loop.timing import RoundWait
from edgefleet.server.app import LAYERS, build_strategy
from edgefleet.settings import ConfigError, choice, positive, section, setting
from edgefleet.strategies.energy_selection import EnergyAgeSelection, EnergyConfig
from edgefleet.strategies.equalweight import EqualWeightFedAvg
from edgefleet.strategies.fedsag import FedSAG, SagaConfig
from edgefleet.strategies.fedvarp import FedVARP
from edgefleet.strategies.mifa import MIFA
from edgefleet.strategies.reconstruction import PruningConfig, SubmodelReconstruction
from edgefleet.strategies.robust import RobustAggregation, RobustConfig
from edgefleet.strategies.scaffold import Scaffold
from edgefleet.strategies.stopping import StoppingConfig, TaskVectorStopping, ValidationStopping
from edgefleet.strategies.warmstart_initializer import (
    SessionsConfig,
    WarmStartConfig,
    WarmStartInitializer,
)
from edgefleet.task.names import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "docs" / "gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_gen"] = module
    spec.loader.exec_module(module)
    return module


# -- a new key is one declaration ---------------------------------------------------------


@dataclass(frozen=True)
class ToyConfig:
    """A component's section as a new component would declare it, in its own module."""

    knob: str = setting("toy.knob", "low", choice(("low", "high")), "how far the toy turns")
    gain: float = setting("toy.gain", 2.0, positive, "the toy's gain")


@dataclass(frozen=True)
class ToyRun(RunConfig):
    toy: ToyConfig = section(ToyConfig)


def test_a_new_section_is_parsed_checked_defaulted_and_in_the_table_from_its_declaration() -> None:
    cfg = settings.parse_section(ToyRun, {"toy.knob": "high", "lr": 0.1})
    assert cfg.toy == ToyConfig(knob="high", gain=2.0)
    assert cfg.train.lr == 0.1  # the run's own keys as before
    assert ToyRun().toy == ToyConfig()  # defaults from the declaration
    with pytest.raises(ConfigError, match=r"'toy.knob' = 'sideways': must be one of low, high"):
        settings.parse_section(ToyRun, {"toy.knob": "sideways"})
    with pytest.raises(ConfigError, match=r"'toy.gain' = -1.0: must be > 0"):
        settings.parse_section(ToyRun, {"toy.gain": -1.0})
    with pytest.raises(ConfigError, match=r"'toy.gain' = 'x': must be a number"):
        settings.parse_section(ToyRun, {"toy.gain": "x"})
    with pytest.raises(ConfigError, match="did you mean 'toy.knob'"):
        settings.parse_section(ToyRun, {"toy.knbo": "high"})
    table = settings.markdown_table(ToyRun)
    assert table.startswith(markdown_table())  # the run's rows unchanged, the new ones after
    assert table.endswith(
        '| `toy.knob` | `"low"` | how far the toy turns |\n| `toy.gain` | 2.0 | the toy\'s gain |\n'
    )
    assert settings.flat(cfg)["toy.knob"] == "high"
    assert settings.parse_section(ToyRun, settings.flat(cfg)) == cfg
    # ... and in pyproject.toml's table, which Flower needs for --run-config overrides.
    defaults = {name: spec.default for name, spec in settings.keys_of(ToyRun).items()}
    assert _gen().pyproject_table(defaults).endswith('toy.knob = "low"\ntoy.gain = 2.0\n')


def test_pyproject_table_is_the_generated_one() -> None:
    assert (ROOT / "pyproject.toml").read_text() == _gen().pyproject_text(), (
        "run `python docs/gen.py`"
    )


def test_a_key_declared_twice_is_refused() -> None:
    @dataclass(frozen=True)
    class Clash:
        a: int = setting("seed", 1, positive, "again")

    @dataclass(frozen=True)
    class Twice(RunConfig):
        clash: Clash = section(Clash)

    with pytest.raises(TypeError, match="'seed' is declared twice"):
        settings.keys_of(Twice)


def test_the_run_config_is_the_composition_of_the_component_sections() -> None:
    owners = {
        "saga": "edgefleet.strategies.fedsag",
        "data": "edgefleet.task.partition",
        "train": "edgefleet.task.names",
        "energy": "edgefleet.strategies.energy_selection",
        "stopping": "edgefleet.strategies.stopping",
        "pruning": "edgefleet.strategies.reconstruction",
        "sessions": "edgefleet.strategies.warmstart_initializer",
        "warmstart": "edgefleet.strategies.warmstart_initializer",
        "screening": "edgefleet.loop.screening",
        "robust": "edgefleet.strategies.robust",
        "attack": "edgefleet.attacks.mods",
        "aggregation": "edgefleet.loop.asyncloop",
        "server": "edgefleet.config",  # the run's own keys: rounds, waits, output
    }
    sections = {f.name: f.metadata["section"] for f in fields(RunConfig) if "section" in f.metadata}
    assert {name: cls.__module__ for name, cls in sections.items()} == owners
    assert RunConfig() == parse_run_config({})  # every default from the declarations
    assert markdown_table() == settings.markdown_table(RunConfig)
    assert list(KEYS) == list(settings.keys_of(RunConfig))


# -- from_config: round trips and named errors --------------------------------------------


def _arrays() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})


def _check(obj: Any, expected: dict[str, Any]) -> None:
    for path, value in expected.items():
        got = obj
        for part in path.split("."):
            got = getattr(got, part)
        assert got == value, path


CASES: list[tuple[str, type, dict[str, Any], Any, dict[str, Any]]] = [
    (
        "data-free stopping",
        StoppingConfig,
        {"stopping.mode": "data-free", "stopping.tau": 0.02, "stopping.patience": 3},
        lambda c: TaskVectorStopping.from_config(FedAvg(), c, keys=["w"]),
        {"rule.tau": 0.02, "rule.patience": 3, "enforce": True, "squared": False},
    ),
    (
        "observing stopping, the seed's form",
        StoppingConfig,
        {"stopping.mode": "observe", "stopping.form": "seed"},
        lambda c: TaskVectorStopping.from_config(FedAvg(), c),
        {"enforce": False, "form": "seed", "squared": True},
    ),
    (
        "validation stopping",
        StoppingConfig,
        {"stopping.mode": "validation", "stopping.validation-rule": "best"},
        lambda c: ValidationStopping.from_config(FedAvg(), c, validate=lambda a: {}),
        {"enforce": True, "keeps_best": True, "counter.patience": 10},
    ),
    (
        "energy-age selection",
        EnergyConfig,
        {
            "selection.mode": "energy-age",
            "selection.max-devices": 3,
            "energy.train-slots": 2,
            "selection.order": "random",
            "selection.deadline": 5.0,
        },
        lambda c: EnergyAgeSelection.from_config(FedAvg(), c, seed=1, query_timeout=7.0),
        {"max_devices": 3, "slots_per_round": 3, "order": "random", "deadline": 5.0},
    ),
    (
        "reconstruction",
        PruningConfig,
        {"pruning.reconstruction": "zeros", "pruning.refresh-rounds": 2},
        lambda c: SubmodelReconstruction.from_config(FedAvg(), c, plan_factory=lambda: None),
        {"reconstruction": "zeros", "refresh_rounds": 2, "compact_download": False},
    ),
    (
        "robust rule",
        RobustConfig,
        {"robust.rule": "trimmed-mean", "robust.beta": 0.1},
        lambda c: RobustAggregation.from_config(FedAvg(), c),
        {"rule": "trimmed-mean", "spec.beta": 0.1},
    ),
    (
        "FedSAG",
        SagaConfig,
        {"server-lr": 0.5, "saga.estimator": "sag", "saga.max-age": 4},
        lambda c: FedSAG.from_config(c, RobustConfig(rule="median")),
        {"server_lr": 0.5, "estimator": "sag", "max_age": 4, "robust.rule": "median"},
    ),
    (
        "MIFA takes the server step, its form is its own",
        SagaConfig,
        {"server-lr": 0.5},
        lambda c: MIFA.from_config(c, RobustConfig()),
        {"server_lr": 0.5, "estimator": "sag", "mean_over": "fleet"},
    ),
    (
        "FedVARP",
        SagaConfig,
        {"saga.max-age": 2},
        lambda c: FedVARP.from_config(c, RobustConfig()),
        {"max_age": 2, "estimator": "saga"},
    ),
    (
        "SCAFFOLD",
        TrainConfig,
        {"local-steps": 7, "lr": 0.2, "momentum": 0.0},
        lambda c: Scaffold.from_config(c, SagaConfig(server_lr=0.5)),
        {"local_steps": 7, "lr": 0.2, "momentum": 0.0, "server_lr": 0.5},
    ),
    (
        "reply screening, max-examples 0: the app's own bound",
        ScreeningConfig,
        {"screening.norm-factor": 5.0, "screening.device-binding": "strict"},
        lambda c: Screening.from_config(c, 640, max_energy=4.0),
        {"max_examples": 640.0, "max_energy": 4.0, "norm_factor": 5.0, "device_binding": "strict"},
    ),
    (
        "reply screening, max-examples set",
        ScreeningConfig,
        {"screening.max-examples": 10},
        lambda c: Screening.from_config(c, 640),
        {"max_examples": 10.0, "max_energy": None},
    ),
    (
        "round waits",
        ServerConfig,
        {"timeout-mode": "expected", "timeout-slack": 2.0, "round-timeout": 30.0},
        RoundWait.from_config,
        {"mode": "expected", "slack": 2.0, "round_timeout": 30.0, "margin": 10.0},
    ),
    (
        "asynchronous loop",
        AsyncConfig,
        {"async.buffer-size": 3, "async.staleness": "hinge", "async.staleness-b": 2},
        AsyncSettings.from_config,
        {"buffer_size": 3, "staleness": "hinge", "b": 2},
    ),
]


@pytest.mark.parametrize(
    ("name", "cls", "raw", "build", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_from_config_builds_the_component_as_its_keys_say(
    name: str, cls: type, raw: dict[str, Any], build: Any, expected: dict[str, Any]
) -> None:
    cfg = settings.parse_section(cls, raw)
    flat = settings.flat(cfg)
    assert {k: flat[k] for k in raw} == raw  # back in key names, as written
    assert settings.parse_section(cls, flat) == cfg
    _check(build(cfg), expected)


def test_sessions_from_config(tmp_path: Any) -> None:
    w = settings.parse_section(
        WarmStartConfig, {"warmstart.mode": "average", "warmstart.max-stored": 3}
    )
    s = settings.parse_section(
        SessionsConfig, {"sessions.rounds": 4, "sessions.change-threshold": 0.5}
    )
    init = WarmStartInitializer.from_config(
        FedAvg(), w, s, store=tmp_path / "store", initial=_arrays(), slots_per_round=4
    )
    _check(
        init,
        {"mode": "average", "tracker.max_rounds": 4, "tracker.change_threshold": 0.5},
    )
    assert init.store.max_stored == 3 and init.slots_per_round == 4


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: TaskVectorStopping.from_config(FedAvg(), StoppingConfig(mode="early")),
            "'stopping.mode' = 'early': must be one of off, data-free, validation, observe",
        ),
        (
            lambda: TaskVectorStopping.from_config(FedAvg(), StoppingConfig()),
            "'stopping.mode' = 'off': TaskVectorStopping is built with stopping.mode one of "
            "data-free, observe",
        ),
        (
            lambda: ValidationStopping.from_config(
                FedAvg(), StoppingConfig(mode="data-free"), validate=None
            ),
            "ValidationStopping is built with stopping.mode one of validation, observe",
        ),
        (
            lambda: EnergyAgeSelection.from_config(FedAvg(), EnergyConfig()),
            "'selection.mode' = 'all': EnergyAgeSelection is built with selection.mode one of "
            "energy-age",
        ),
        (
            lambda: EnergyAgeSelection.from_config(
                FedAvg(), EnergyConfig(selection="energy-age", order="oldest")
            ),
            "'selection.order' = 'oldest': must be one of age, random",
        ),
        (
            lambda: RobustAggregation.from_config(FedAvg(), RobustConfig()),
            "'robust.rule' = 'off': RobustAggregation is built with robust.rule one of median, ",
        ),
        (
            lambda: RobustAggregation.from_config(FedAvg(), RobustConfig(rule="mean")),
            "'robust.rule' = 'mean': must be one of off, median, trimmed-mean",
        ),
        (
            lambda: SubmodelReconstruction.from_config(
                FedAvg(), PruningConfig(reconstruction="none"), lambda: None
            ),
            "'pruning.reconstruction' = 'none': must be one of global, elementwise, zeros",
        ),
        (
            lambda: FedSAG.from_config(SagaConfig(memory_mean="all"), RobustConfig()),
            "'saga.memory-mean' = 'all': must be one of",
        ),
        (
            lambda: Scaffold.from_config(TrainConfig(local_steps=0), SagaConfig()),
            "'local-steps' = 0: must be >= 1",
        ),
        (
            lambda: WarmStartInitializer.from_config(
                FedAvg(),
                WarmStartConfig(mode="best"),
                SessionsConfig(),
                store="unused",
                initial=_arrays(),
            ),
            "'warmstart.mode' = 'best': must be one of pilot, previous, average, fresh, continuous",
        ),
    ],
)
def test_a_section_made_by_hand_with_a_bad_value_is_a_named_error(build: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build()
    assert message in str(err.value)


def test_every_choice_key_refuses_a_made_up_value_naming_the_key_and_the_choices() -> None:
    choice_keys = [
        k
        for k, s in KEYS.items()
        if isinstance(s.default, str) and s.check("<bogus>") is not None and s.parse is None
    ]
    assert len(choice_keys) >= 30
    for k in choice_keys:
        with pytest.raises(ConfigError) as err:
            parse_run_config({k: "<bogus>"})
        text = str(err.value)
        assert f"'{k}' = '<bogus>'" in text, text


# -- build_strategy: an ordered list of factories -----------------------------------------


def test_build_strategy_applies_the_layers_innermost_first() -> None:
    assert [layer.name for layer in LAYERS] == [
        "robust rule",
        "CA-HFP reconstruction",
        "energy-age selection",
        "data-free stopping",
        "validation stopping",
        "sessions",
    ]
    cfg = parse_run_config(
        {
            "selection.mode": "energy-age",
            "stopping.mode": "data-free",
            "robust.rule": "median",
            "selection.max-devices": 4,
        }
    )
    central = SimpleNamespace(keys=["w"])
    chain = []
    strategy: Any = build_strategy(cfg, central)  # type: ignore[arg-type]
    while strategy is not None:
        chain.append(type(strategy))
        strategy = getattr(strategy, "inner", None)
    assert chain == [
        TaskVectorStopping,
        EnergyAgeSelection,
        SubmodelReconstruction,
        RobustAggregation,
        EqualWeightFedAvg,
    ]
    async_cfg = parse_run_config({"aggregation.mode": "async", "robust.rule": "median"})
    outer = build_strategy(async_cfg)  # in async only the layers marked in_async
    assert type(outer) is SubmodelReconstruction and type(outer.inner) is RobustAggregation


def test_build_strategy_names_what_a_layer_needs() -> None:
    with pytest.raises(ValueError, match="stopping needs the central evaluation"):
        build_strategy(parse_run_config({"stopping.mode": "data-free"}))
    with pytest.raises(ValueError, match="sessions need the run folder"):
        build_strategy(
            parse_run_config({"sessions.rounds": 2}),
            SimpleNamespace(initial=_arrays(), keys=["w"]),  # type: ignore[arg-type]
        )
