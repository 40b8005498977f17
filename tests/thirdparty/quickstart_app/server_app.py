"""The ServerApp, as Flower's quickstart writes it; the strategy line is EdgeFleet's. It runs
each strategy named in ``strategies`` from the same initial model and writes what each
``start()`` returned to ``out`` (JSON), for tests/test_thirdparty.py to read."""

from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, FedTrimmedAvg, Result, Strategy

from edgefleet.strategies import (
    EnergyAgeSelection,
    FedSAG,
    RobustAggregation,
    SessionTracker,
    SubmodelReconstruction,
    TaskVectorStopping,
    ValidationStopping,
    WarmStartInitializer,
)
from quickstart_app.task import Net, load_test, test

app = ServerApp()


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    net = Net()
    net.load_state_dict(arrays.to_torch_state_dict())
    loss, acc = test(net, *load_test())
    return MetricRecord({"accuracy": acc, "loss": loss})


def _no_submodels():  # full-size replies never need the pruning plan
    raise AssertionError("a standard reply was taken for a pruned submodel")


def make(name: str, fraction_evaluate: float, store: str, initial: ArrayRecord) -> Strategy:
    fedavg = FedAvg(fraction_train=1.0, fraction_evaluate=fraction_evaluate)
    if name == "fedavg":
        return fedavg
    if name == "stopping":
        return TaskVectorStopping(fedavg, patience=50)
    if name == "trimmed-stopping":  # Flower's own robust strategy under EdgeFleet's wrapper
        trimmed = FedTrimmedAvg(fraction_train=1.0, fraction_evaluate=fraction_evaluate, beta=0.2)
        return TaskVectorStopping(trimmed, patience=50)
    if name == "median-stopping":
        return TaskVectorStopping(RobustAggregation(fedavg, rule="median"), patience=50)
    if name == "validation":
        validate = lambda arrays: global_evaluate(0, arrays)["accuracy"]  # noqa: E731
        return ValidationStopping(fedavg, validate, patience=50)
    if name == "fedsag":
        return FedSAG(fraction_train=1.0, fraction_evaluate=fraction_evaluate)
    if name == "pruning":
        return SubmodelReconstruction(fedavg, _no_submodels)
    if name == "energy":
        # A long query timeout: on a loaded machine the first round's status query can
        # outwait the Ray actors' start (the test is about the answers, not about load).
        return EnergyAgeSelection(fedavg, max_devices=3, slots_per_round=4, query_timeout=300)
    if name in ("warmstart", "warmstart-again"):
        # Sessions of two rounds, so that the first run leaves a stored session behind; the
        # second ServerApp start opens the same folder.
        tracker = SessionTracker(change_threshold=0.2, max_rounds=2)
        return WarmStartInitializer(
            fedavg,
            store=store,
            initial=initial,
            tracker=tracker,
            pilot_sessions=1,
            first_answer_timeout=300,  # the Ray actors' start on a loaded machine
        )
    raise ValueError(f"unknown strategy {name!r}")


def _records(metrics: dict[int, MetricRecord]) -> dict[str, dict[str, float]]:
    return {str(r): {k: float(v) for k, v in rec.items()} for r, rec in metrics.items()}


def _summary(result: Result) -> dict[str, object]:
    return {
        "train": _records(result.train_metrics_clientapp),
        "federated": _records(result.evaluate_metrics_clientapp),
        "central": _records(result.evaluate_metrics_serverapp),
        "arrays": [a.tolist() for a in result.arrays.to_numpy_ndarrays()],
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    out: dict[str, object] = {}
    store = str(cfg["out"]) + ".sessions"
    for name in str(cfg["strategies"]).split(","):
        torch.manual_seed(0)
        initial = ArrayRecord(Net().state_dict())
        result = make(name, float(cfg["fraction-evaluate"]), store, initial).start(
            grid=grid,
            initial_arrays=initial,
            train_config=ConfigRecord({"lr": float(cfg["lr"])}),
            num_rounds=int(cfg["num-server-rounds"]),
            evaluate_fn=global_evaluate,
        )
        out[name] = _summary(result)
    with open(str(cfg["out"]), "w") as f:
        json.dump(out, f)
