import tomllib
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict

from edgefleet.config import DEFAULTS, KEYS, ConfigError, markdown_table, parse_run_config

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_table_matches_defaults() -> None:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert flatten_dict(table) == DEFAULTS


def test_defaults_parse() -> None:
    cfg = parse_run_config({})
    assert cfg.data.dataset == "mnist-5k"
    assert cfg.server.strategy == "fedavg"
    assert cfg.train.model == "smallcnn"
    assert cfg.to_dict() == dict(sorted(DEFAULTS.items()))


def test_int_accepted_for_float_key() -> None:
    assert parse_run_config({"lr": 1}).train.lr == 1.0


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("dataset", "imagenet", "mnist-5k"),
        ("model", "vgg", "smallcnn"),
        ("strategy", "feddyn", "fedprox"),
        ("partition", "zipf", "dirichlet"),
        ("lr", -0.1, "> 0"),
        ("lr", 0.0, "> 0"),
        ("alpha", 0.0, "> 0"),
        ("alpha", -1.0, "> 0"),
        ("momentum", 1.0, "[0, 1)"),
        ("fraction-train", 0.0, "(0, 1]"),
        ("fraction-train", 1.5, "(0, 1]"),
        ("local-steps", 0, ">= 1"),
        ("batch-size", 0, ">= 1"),
        ("num-server-rounds", 0, ">= 1"),
        ("proximal-mu", -0.5, ">= 0"),
        ("local-test-fraction", 1.0, "[0, 1)"),
        ("seed", -1, ">= 0"),
        ("round-timeout", 0.0, "> 0"),
        ("output-dir", "", "empty"),
        ("run-name", "a/b", "'/'"),
        ("stopping.mode", "early", "data-free"),
        ("stopping.tau", -0.1, ">= 0"),
        ("stopping.patience", 0, ">= 1"),
        ("stopping.norm", "l1", "squared"),
        ("stopping.validation-fraction", 1.0, "(0, 1)"),
        ("saga.memory-mean", "all", "stored, fleet"),
        ("saga.correction", "none", "channels, participants"),
        ("selection.order", "oldest", "age, random"),
    ],
)
def test_bad_value_names_key_value_and_choices(key: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_run_config({key: value})
    text = str(err.value)
    assert f"'{key}'" in text
    assert repr(value) in text
    assert expected in text


def test_wrong_type_rejected() -> None:
    with pytest.raises(ConfigError, match="'local-steps' = 'ten': must be an integer"):
        parse_run_config({"local-steps": "ten"})
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_run_config({"batch-size": True})
    with pytest.raises(ConfigError, match="must be a number"):
        parse_run_config({"lr": "fast"})
    with pytest.raises(ConfigError, match=r"must be a boolean \(true or false\) \(default false\)"):
        parse_run_config({"resume": 1})
    with pytest.raises(ConfigError, match="must be a string"):
        parse_run_config({"run-name": 3})


def test_unknown_key_suggests_the_close_ones_not_every_key() -> None:
    with pytest.raises(ConfigError) as err:
        parse_run_config({"num-server-round": 3})
    text = str(err.value)
    assert text.startswith(
        "unknown run-config key 'num-server-round'; did you mean 'num-server-rounds'?"
    )
    assert "python -m edgefleet.config" in text
    assert "local-steps" not in text  # the ~90 keys are not dumped
    with pytest.raises(ConfigError) as err:
        parse_run_config({"energy.capacty": 1, "zzz": 2})
    text = str(err.value)
    assert "'energy.capacty' (did you mean 'energy.capacity'?), 'zzz' (" in text


def test_docs_key_table_is_the_generated_one() -> None:
    readme = (ROOT / "docs" / "reference" / "run-config.md").read_text()
    start = readme.index("| key | default | meaning |")
    end = readme.index("<!-- config-table end -->")
    assert readme[start:end] == markdown_table(), "run `python docs/gen.py`"


def test_every_key_has_help_and_a_check_that_accepts_its_default() -> None:
    for name, spec in KEYS.items():
        assert spec.help.strip(), name
        assert spec.check(spec.default) is None, name


@pytest.mark.parametrize("name", ["..", ".", "a\\\\b"])
def test_run_name_cannot_leave_the_output_dir(name: str) -> None:
    with pytest.raises(ConfigError, match="run-name"):
        parse_run_config({"run-name": name})


def test_every_bad_setting_is_one_family_that_names_the_choices() -> None:
    # One `except SettingError` catches a bad run-config key and a bad constructor argument
    # of any component; each message names the valid choices.
    import numpy as np
    from flwr.serverapp.strategy import FedAvg

    from edgefleet.client.device import DeviceProfile
    from edgefleet.errors import SettingError
    from edgefleet.strategies import SessionStore, TaskVectorStopping, WarmStartInitializer
    from tests.fakes import rec

    bad = [
        lambda: parse_run_config({"warmstart.mode": "pilott"}),
        lambda: WarmStartInitializer(
            FedAvg(), store=SessionStore(None, 1), initial=rec(w=np.zeros(1)), mode="pilott"
        ),
        lambda: TaskVectorStopping(FedAvg(), norm="l3"),
        lambda: DeviceProfile.from_configs(
            {"partition-id": 0, "num-partitions": 2, "keep-ratio": 7}, parse_run_config({})
        ),
    ]
    for make in bad:
        with pytest.raises(SettingError) as err:
            make()
        assert isinstance(err.value, ValueError)
        text = str(err.value)
        assert "pilot" in text or "l2" in text or "keep-ratio" in text, text


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("seed", 2**70, "'seed' = 1180591620717411303424: must be at most 2,147,483,647"),
        ("num-server-rounds", 2**80, "'num-server-rounds' = .*must be at most 1,000,000"),
        ("screening.norm-factor", float("inf"), "'screening.norm-factor' = inf: must be a finite"),
        ("round-timeout", float("inf"), "'round-timeout' = inf: must be a finite number"),
        ("lr", 10**400, r"'lr' = <an integer of 1,329 bits>: must be a finite number"),
        ("run-name", "x" * 5000, r"'run-name' = 'xxx.*\(5,002 chars\): must be at most 4096"),
        ("output-dir", "runs\0x", "'output-dir' = 'runs\\\\x00x': must not contain a NUL"),
    ],
)
def test_values_past_every_bound_are_refused_naming_key_and_range(
    key: str, value: object, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_run_config({key: value})


def test_the_largest_values_in_range_are_accepted() -> None:
    cfg = parse_run_config({"seed": 2**31 - 1, "num-server-rounds": 1_000_000})
    assert cfg.seed == 2**31 - 1 and cfg.server.num_rounds == 1_000_000


def test_max_empty_rounds_is_a_run_key_that_a_resume_may_change() -> None:
    from edgefleet.config import RESUME_OPERATIONAL

    assert parse_run_config({}).server.max_empty_rounds == 3
    assert parse_run_config({"run.max-empty-rounds": 0}).server.max_empty_rounds == 0
    with pytest.raises(ConfigError, match="'run.max-empty-rounds' = -1: must be >= 0"):
        parse_run_config({"run.max-empty-rounds": -1})
    assert "run.max-empty-rounds" in RESUME_OPERATIONAL
