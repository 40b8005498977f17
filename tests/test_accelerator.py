"""The ``accelerator`` setting (issue 16): resolution, clear errors, and a CPU path that is
the one of before, bit for bit (on a CPU-only machine ``auto`` is the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, RecordDict

from edgefleet.client import device as device_module
from edgefleet.client.app import train
from edgefleet.client.device import DeviceProfile, NodeConfigError, get_device
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.pruning.importance import weight_scores
from edgefleet.server.app import central_evaluation
from edgefleet.simulation.runner import with_gpu_share
from edgefleet.task import accelerator as acc
from edgefleet.task.accelerator import (
    AcceleratorError,
    available_accelerators,
    resolve_accelerator,
    simulation_gpu_share,
)
from edgefleet.task.datasets import ArrayDataset
from edgefleet.task.models import build_model
from edgefleet.task.train import evaluate, get_arrays, train_local
from tests.fakes import FakeGrid
from tests.test_pruning_fl import _model, _run

CPU_ONLY = available_accelerators() == ["cpu"]
cpu_only = pytest.mark.skipif(not CPU_ONLY, reason="this machine has an accelerator")


def _data(n: int = 64) -> ArrayDataset:
    rng = np.random.default_rng(0)
    return ArrayDataset(
        rng.normal(size=(n, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64)
    )


def _trained(accelerator: str | None) -> tuple[dict[str, torch.Tensor], float, float]:
    torch.manual_seed(0)
    model = build_model("resnet8", (1, 8, 8), 3)  # BatchNorm buffers too
    if accelerator is not None:
        model = model.to(resolve_accelerator(accelerator))
    res = train_local(
        model, _data(), steps=6, batch_size=16, lr=0.1, momentum=0.9, seed=3, proximal_mu=0.1
    )
    ev = evaluate(model, _data(40))
    return {k: v.cpu() for k, v in model.state_dict().items()}, res.loss, ev.loss


def test_cpu_and_auto_train_bit_for_bit_as_an_unplaced_model() -> None:
    base, loss, eval_loss = _trained(None)
    for name in ("cpu", "auto") if CPU_ONLY else ("cpu",):
        state, loss_b, eval_b = _trained(name)
        assert loss_b == loss and eval_b == eval_loss, name
        assert all(torch.equal(base[k], state[k]) for k in base), name


@pytest.mark.parametrize(("criterion", "hessian"), [("curvature", "fisher"),
                                                    ("curvature", "hutchinson"),
                                                    ("random", "fisher")])  # fmt: skip
def test_pruning_scores_on_cpu_equal_the_unplaced_model(criterion: str, hessian: str) -> None:
    torch.manual_seed(0)
    model = build_model("smallcnn", (1, 8, 8), 3)
    data = _data(32)
    batches = [(torch.from_numpy(data.x[:16]), torch.from_numpy(data.y[:16]))]
    a = weight_scores(model, batches, criterion, hessian, seed=5, hutchinson_samples=4)
    b = weight_scores(
        model.to(resolve_accelerator("cpu")), batches, criterion, hessian, 5, hutchinson_samples=4
    )
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_arrays_leave_as_cpu_tensors_equal_to_the_state_dict() -> None:
    model = build_model("resnet8", (1, 8, 8), 3)
    arrays = get_arrays(model)
    for k, v in model.state_dict().items():
        assert np.array_equal(arrays[k].numpy(), v.numpy())


def test_resolution_and_bad_names() -> None:
    assert resolve_accelerator("cpu") == torch.device("cpu")
    assert resolve_accelerator("auto").type == available_accelerators()[-1]
    with pytest.raises(AcceleratorError, match="valid choices are auto, cpu, cuda, mps"):
        resolve_accelerator("tpu")


@cpu_only
def test_a_missing_accelerator_is_a_clear_error_naming_what_is_there() -> None:
    for name in ("cuda", "mps"):
        with pytest.raises(AcceleratorError, match=f"'{name}' requested .* available here: cpu"):
            resolve_accelerator(name)


def test_run_config_and_node_config_keys() -> None:
    assert parse_run_config({}).train.accelerator == "auto"
    with pytest.raises(ConfigError, match="'accelerator' = 'gpu': must be one of auto, cpu"):
        parse_run_config({"accelerator": "gpu"})
    cfg = parse_run_config({"accelerator": "cpu"})
    node = {"partition-id": 0, "num-partitions": 2}
    assert DeviceProfile.from_configs(node, cfg).accelerator == "cpu"
    assert DeviceProfile.from_configs({**node, "accelerator": "cuda"}, cfg).accelerator == "cuda"
    with pytest.raises(NodeConfigError, match="accelerator='tpu'; valid choices: auto, cpu"):
        DeviceProfile.from_configs({**node, "accelerator": "tpu"}, cfg)


@cpu_only
def test_a_device_asking_for_cuda_here_declines_before_loading_data(monkeypatch) -> None:
    loaded = []
    monkeypatch.setattr(device_module, "load_dataset", lambda *a: loaded.append(a))
    with pytest.raises(AcceleratorError):
        get_device({}, {"partition-id": 0, "num-partitions": 2, "accelerator": "cuda"})
    assert loaded == []
    FakeGrid({})
    ctx = Context(
        run_id=1, node_id=1, state=RecordDict(), run_config={"local-steps": 1},
        node_config={"partition-id": 0, "num-partitions": 2, "accelerator": "cuda"},
    )  # fmt: skip
    replies: list[Message] = []

    def node(msg: Message) -> Message:
        replies.append(train(msg, ctx))
        return replies[-1]

    from flwr.serverapp.strategy import FedAvg

    one = {"min_available_nodes": 1, "min_train_nodes": 1, "fraction_evaluate": 0.0}
    _, results = _run(FedAvg(**one), FakeGrid({1: node}), get_arrays(_model()))
    assert results[0].declined == ["node-1"]
    assert "available here: cpu" in replies[0].error.reason


@cpu_only
def test_the_server_refuses_a_missing_accelerator_before_loading_data(monkeypatch) -> None:
    from edgefleet.task import datasets  # central_evaluation imports it when called

    monkeypatch.setattr(datasets, "load_dataset", lambda *a: pytest.fail("data loaded"))
    with pytest.raises(AcceleratorError, match="available here: cpu"):
        central_evaluation(parse_run_config({"accelerator": "cuda"}))


def test_simulation_gpu_share(monkeypatch) -> None:
    assert simulation_gpu_share("cpu", 1) is None
    monkeypatch.setattr(acc, "_nvidia_gpus_present", lambda: False)
    assert simulation_gpu_share("auto", 1) is None  # CPU-only: the federation as before
    assert with_gpu_share({"num-supernodes": 4}, "auto") == {"num-supernodes": 4}
    monkeypatch.setattr(acc, "_nvidia_gpus_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(acc.os, "cpu_count", lambda: 16)
    assert simulation_gpu_share("auto", 1) == 0.0625  # 16 one-CPU actors share one GPU
    assert simulation_gpu_share("cuda", 4) == 0.25
    fed = {"client-resources-num-cpus": 2}
    assert with_gpu_share(fed, "cuda") == {**fed, "client-resources-num-gpus": 0.125}
    assert (
        with_gpu_share({**fed, "client-resources-num-gpus": 0.5}, "cuda")[
            "client-resources-num-gpus"
        ]
        == 0.5
    )  # the scenario's own share wins
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'accelerator' = 'cuda'.*available here: cpu"):
        with_gpu_share({}, "cuda")
