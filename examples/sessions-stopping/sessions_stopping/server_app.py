"""The ServerApp: Flower's quickstart with EdgeFleet's strategy lines.

- ``WarmStartInitializer`` (arXiv 2410.05662), outermost: every round it asks the online
  nodes whether their device is present; when the present set changes by more than
  ``change-threshold`` (or a session has run ``session-rounds``), the session ends, its
  final model is stored, and the next session starts warm: from the pilot sessions'
  average it runs an auxiliary round, and weighs the stored sessions' models by how close
  their updates were to that round's (softmin).
- ``TaskVectorStopping`` (arXiv 2601.22669), inside it: once the global model's task vector
  (its distance from the session's initial model) grows by less than ``tau`` (relative) for
  ``patience`` rounds, the session's training has converged and the devices rest until the
  next session opens. No validation data is needed.
"""

from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result

from edgefleet.strategies import SessionTracker, TaskVectorStopping, WarmStartInitializer
from sessions_stopping.task import Net, load_test, test

app = ServerApp()


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Accuracy of the global model on the server's held-out images."""
    net = Net()
    net.load_state_dict(arrays.to_torch_state_dict())
    loss, acc = test(net, *load_test())
    return MetricRecord({"accuracy": acc, "loss": loss})


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    torch.manual_seed(0)
    initial = ArrayRecord(Net().state_dict())

    # A session may hold a single device: Flower's defaults would wait for two.
    fedavg = FedAvg(
        fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1
    )
    stopping = TaskVectorStopping(fedavg, tau=float(cfg["tau"]), patience=int(cfg["patience"]))
    strategy = WarmStartInitializer(
        stopping,
        store=str(cfg["session-store"]),  # a folder: a later run continues its sessions
        initial=initial,
        tracker=SessionTracker(
            change_threshold=float(cfg["change-threshold"]),
            max_rounds=int(cfg["session-rounds"]),
        ),
        mode="pilot",
        pilot_sessions=1,
        aux_rounds=1,
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        num_rounds=int(cfg["num-server-rounds"]),
        evaluate_fn=global_evaluate,
    )

    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
    if cfg["results"]:
        write_results(str(cfg["results"]), result)


def write_results(path: str, result: Result) -> None:
    """Per round: the central accuracy and the averaged train metrics, as JSON."""
    rounds = {
        str(r): {"central": dict(m), "train": dict(result.train_metrics_clientapp.get(r, {}))}
        for r, m in result.evaluate_metrics_serverapp.items()
    }
    with open(path, "w") as f:
        json.dump(rounds, f, indent=1)
