"""EdgeFleet's ServerApp: parse the config, build the strategy, run the round loop, write results.

The same ServerApp runs under Flower's Simulation Engine (``flwr run .``) and the Deployment
Engine (SuperLink + SuperNodes); nothing here knows which.
"""

from __future__ import annotations

import random
import time
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

from edgefleet.config import RunConfig, parse_run_config
from edgefleet.server.loop import EvaluateFn, RoundLoop
from edgefleet.server.results import MetricsWriter, prepare_run_dir, write_summary
from edgefleet.task.data import load_dataset
from edgefleet.task.models import build_model
from edgefleet.task.train import evaluate, get_arrays, set_arrays

app = ServerApp()


def make_strategy(cfg: RunConfig) -> Strategy:
    common = {
        "fraction_train": cfg.server.fraction_train,
        "fraction_evaluate": 0.0,  # central evaluation on the held-out set instead
        "min_train_nodes": 1,
        "min_available_nodes": 1,  # the wait for nodes is bounded in wait_for_nodes()
    }
    if cfg.server.strategy == "fedprox":
        return FedProx(proximal_mu=cfg.train.proximal_mu, **common)  # type: ignore[arg-type]
    return FedAvg(**common)  # type: ignore[arg-type]


def wait_for_nodes(grid: Grid, wanted: int, timeout: float) -> int:
    """Wait up to ``timeout`` s for ``wanted`` nodes; go on with whoever is there after that.

    FedAvg's own wait (``min_available_nodes``) has no timeout and hangs a server whose
    fleet is short of nodes.
    """
    deadline = time.monotonic() + timeout
    while (n := len(list(grid.get_node_ids()))) < wanted and time.monotonic() < deadline:
        log(INFO, "Waiting for nodes: %d of %d online", n, wanted)
        time.sleep(1.0)
    if n < wanted:
        log(WARNING, "Only %d of %d nodes online after %.0f s; going on", n, wanted, timeout)
    if n == 0:
        raise RuntimeError(f"no node came online within {timeout:.0f} s")
    return n


def central_evaluator(cfg: RunConfig) -> tuple[EvaluateFn, ArrayRecord]:
    """The held-out test evaluation and the seeded initial model."""
    _, test_set, info = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.train.model, info.input_shape, info.num_classes)
    initial = get_arrays(model)

    def evaluate_fn(_: int, arrays: ArrayRecord) -> dict[str, float]:
        set_arrays(model, arrays)
        loss, acc = evaluate(model, test_set)
        return {"test_loss": loss, "test_accuracy": acc}

    return evaluate_fn, initial


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = parse_run_config(context.run_config)
    random.seed(cfg.seed)  # Flower's node sampling draws from the global RNG
    run_dir = prepare_run_dir(cfg)
    log(INFO, "EdgeFleet run %s: writing results to %s", run_dir.name, run_dir.resolve())
    evaluate_fn, initial = central_evaluator(cfg)
    wait_for_nodes(grid, cfg.server.min_nodes, cfg.server.node_wait_timeout)
    writer = MetricsWriter(run_dir)
    loop = RoundLoop(
        make_strategy(cfg),
        grid,
        evaluate_fn=evaluate_fn,
        callbacks=[writer],
        round_timeout=cfg.server.round_timeout,
    )
    t0 = time.monotonic()
    outcome = loop.run(initial, cfg.server.num_rounds, ConfigRecord())
    summary = write_summary(run_dir, cfg, outcome, writer.rows, time.monotonic() - t0)
    log(
        INFO,
        "EdgeFleet run %s done: %d rounds, final accuracy %.4f, results in %s",
        run_dir.name,
        summary["rounds_run"],
        summary["final_accuracy"] or float("nan"),
        run_dir.resolve(),
    )
