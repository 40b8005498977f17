"""EdgeFleet's ServerApp: parse the config, build the strategy, run the round loop, write results.

The same ServerApp runs under Flower's Simulation Engine (``flwr run .``) and the Deployment
Engine (SuperLink + SuperNodes); nothing here knows which.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

from edgefleet.config import RunConfig, parse_run_config
from edgefleet.server.checkpoint import Checkpointer, resume_from
from edgefleet.server.loop import EvaluateFn, RoundLoop
from edgefleet.server.results import MetricsWriter, prepare_run_dir, write_summary
from edgefleet.server.sessions import SessionTracker
from edgefleet.strategies.base import LoopStrategy
from edgefleet.strategies.energy import EnergyAgeSelection
from edgefleet.strategies.fedsag import EqualWeightFedAvg, FedSAG
from edgefleet.strategies.pruning import SubmodelReconstruction
from edgefleet.strategies.sessions import WarmStartInitializer
from edgefleet.strategies.stopping import TaskVectorStopping, ValidationStopping
from edgefleet.strategies.warmstart import SessionStore
from edgefleet.task.data import dataset_info, load_dataset, split_local
from edgefleet.task.models import build_model
from edgefleet.task.train import evaluate, get_arrays, set_arrays

if TYPE_CHECKING:
    from edgefleet.pruning.submodel import PruningPlan

app = ServerApp()


def make_strategy(cfg: RunConfig) -> Strategy:
    """The aggregation strategy named by ``strategy``, behind CA-HFP's reconstruction of
    submodel replies, inside energy-aware selection when ``selection.mode = "energy-age"``
    (EH-FedAvg / EH-FedSAG)."""
    common = {
        "fraction_train": cfg.server.fraction_train,
        "fraction_evaluate": 0.0,  # central evaluation on the held-out set instead
        "min_train_nodes": 1,
        "min_available_nodes": 1,  # the wait for nodes is bounded in wait_for_nodes()
    }
    energy_age = cfg.energy.selection == "energy-age"
    if energy_age:
        common["fraction_train"] = 1.0  # the selection wrapper has already chosen
    inner: Strategy
    if cfg.server.strategy == "fedprox":
        inner = FedProx(proximal_mu=cfg.train.proximal_mu, **common)  # type: ignore[arg-type]
    elif cfg.server.strategy == "fedsag":
        sc = cfg.server
        # Corrections weighted 1/max(|S|, M): M (the channels) exists only when energy-age
        # selection caps the round; otherwise the seed's 1/|S|.
        floor = cfg.energy.max_devices if energy_age and sc.saga_correction == "channels" else 0
        inner = FedSAG(
            sc.server_lr, sc.saga_init, sc.saga_estimator, sc.saga_memory_mean, floor, **common
        )
    elif energy_age:  # EH-FedAvg: the plain mean of the participants
        inner = EqualWeightFedAvg(**common)  # type: ignore[arg-type]
    else:
        inner = FedAvg(**common)  # type: ignore[arg-type]
    # Always on: it passes full-size replies through, and a deployment may give a SuperNode
    # a keep ratio (--node-config keep-ratio=...) that the server's config does not know.
    p = cfg.pruning
    inner = SubmodelReconstruction(
        inner, partial(pruning_plan, cfg), p.reconstruction, p.compact_download, p.refresh_rounds
    )
    if not energy_age:
        return inner
    e = cfg.energy
    return EnergyAgeSelection(
        inner,
        e.max_devices,
        e.slots_per_round,
        e.batch_size,
        seed=cfg.seed,
        query_timeout=query_timeout(cfg),
        order=e.order,
    )


def query_timeout(cfg: RunConfig) -> float:
    """How long a status query waits: a node that died answers never, and the round must
    not wait for it longer than for a training reply (nor more than a minute)."""
    return min(60.0, cfg.server.round_timeout)


def pruning_plan(cfg: RunConfig) -> PruningPlan:
    """The channel groups of the run's model, for rebuilding CA-HFP submodels."""
    from edgefleet.pruning.submodel import PruningPlan  # torch-pruning only when needed

    info = dataset_info(cfg.data.dataset)
    model = build_model(cfg.train.model, info.input_shape, info.num_classes)
    return PruningPlan(model, torch.zeros((1, *info.input_shape)))


def wrap_stopping(
    strategy: Strategy, cfg: RunConfig, keys: list[str], validate: Callable[[ArrayRecord], float]
) -> Strategy:
    """Wrap ``strategy`` in the stopping rule ``stopping.mode`` names (if any)."""
    sc = cfg.stopping
    if sc.mode in ("data-free", "observe"):
        enforce = sc.mode == "data-free"
        strategy = TaskVectorStopping(strategy, sc.tau, sc.patience, sc.norm, keys, enforce)
    if sc.mode in ("validation", "observe"):
        strategy = ValidationStopping(strategy, validate, sc.patience, sc.mode == "validation")
    return strategy


def wrap_sessions(
    strategy: Strategy, cfg: RunConfig, run_dir: Path, initial: ArrayRecord, keys: list[str]
) -> Strategy:
    """Sessions with warm start around everything else, when sessions are on."""
    if not cfg.sessions_enabled:
        return strategy
    w, s = cfg.warmstart, cfg.sessions
    folder = run_dir / "sessions"
    if cfg.server.resume and (folder / "index.json").exists():
        store = SessionStore.load(folder, w.max_stored)
    else:
        store = SessionStore(folder, w.max_stored)
    return WarmStartInitializer(
        strategy,
        store=store,
        tracker=SessionTracker(s.change_threshold, s.rounds),
        initial=initial,
        param_keys=keys,
        mode=w.mode,
        pilot_sessions=w.pilot_sessions,
        aux_rounds=w.aux_rounds,
        temperature=w.temperature,
        slots_per_round=cfg.energy.slots_per_round,
        query_timeout=query_timeout(cfg),
    )


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


@dataclass
class CentralEvaluation:
    """The seeded initial model, its trainable keys, and evaluation on data the server holds:
    the held-out test set, and (only for the validation-stopping baseline) a validation
    split carved from it, in which case test figures are on the rest."""

    initial: ArrayRecord
    keys: list[str]
    evaluate: EvaluateFn
    validate: Callable[[ArrayRecord], float]


def central_evaluation(cfg: RunConfig) -> CentralEvaluation:
    _, test_set, info = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    validation = test_set
    if cfg.stopping.mode in ("validation", "observe"):
        test_set, validation = split_local(test_set, cfg.stopping.validation_fraction, cfg.seed)
    if 0 < cfg.server.eval_samples < len(test_set):
        rng = np.random.default_rng(cfg.seed)
        test_set = test_set.subset(
            np.sort(rng.choice(len(test_set), cfg.server.eval_samples, replace=False))
        )
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.train.model, info.input_shape, info.num_classes)
    initial = get_arrays(model)

    last: list[tuple[ArrayRecord, dict[str, float]]] = []

    def evaluate_fn(_: int, arrays: ArrayRecord) -> dict[str, float]:
        # A round whose updates were all declined or dropped hands back the very record it
        # was given; its figures are the last evaluation's. Under scarce energy (few devices
        # a round, many rounds with none) the pass over the test set was most of a round.
        if last and last[0][0] is arrays:
            return dict(last[0][1])
        set_arrays(model, arrays)
        res = evaluate(model, test_set)
        out = {
            "test_loss": res.loss,
            "test_accuracy": res.accuracy,
            "test_balanced_accuracy": res.balanced_accuracy,
        }
        # Per-class counts: the sessions wrapper's accuracy on the classes present.
        for c, (ok, n) in res.per_class.items():
            out[f"class{c}_correct"], out[f"class{c}_total"] = float(ok), float(n)
        last[:] = [(arrays, dict(out))]
        return out

    def validate(arrays: ArrayRecord) -> float:
        set_arrays(model, arrays)
        return evaluate(model, validation).accuracy

    keys = [name for name, _ in model.named_parameters()]
    return CentralEvaluation(initial, keys, evaluate_fn, validate)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = parse_run_config(context.run_config)
    random.seed(cfg.seed)  # Flower's node sampling draws from the global RNG
    run_dir = prepare_run_dir(cfg)
    log(INFO, "EdgeFleet run %s: writing results to %s", run_dir.name, run_dir.resolve())
    central = central_evaluation(cfg)
    strategy = wrap_stopping(make_strategy(cfg), cfg, central.keys, central.validate)
    strategy = wrap_sessions(strategy, cfg, run_dir, central.initial, central.keys)
    if cfg.server.resume and (run_dir / "summary.json").exists():
        log(INFO, "Run %s has already finished; nothing to resume", run_dir)
        return
    writer = MetricsWriter(run_dir)
    arrays, first_round = central.initial, 1
    if cfg.server.resume:
        ckpt = resume_from(run_dir, strategy, list(central.initial))
        if ckpt is None:
            log(INFO, "resume = true but %s has no checkpoint: starting afresh", run_dir)
        else:
            arrays, first_round = ckpt.array_record(), ckpt.round + 1
            writer.keep_until(ckpt.round)
    wait_for_nodes(grid, cfg.server.min_nodes, cfg.server.node_wait_timeout)
    callbacks = strategy.round_callbacks() if isinstance(strategy, LoopStrategy) else []
    loop = RoundLoop(
        strategy,
        grid,
        evaluate_fn=central.evaluate,
        # The writer records what the callbacks before it add; the checkpoint comes last so
        # that a round it covers is always on record.
        callbacks=[*callbacks, writer, Checkpointer(run_dir, strategy)],
        round_timeout=cfg.server.round_timeout,
    )
    t0 = time.monotonic()
    outcome = loop.run(arrays, cfg.server.num_rounds, ConfigRecord(), first_round=first_round)
    extra = {}
    if isinstance(strategy, ValidationStopping) and strategy.enforce:
        # The baseline returns its best model, so its figures are those of that round.
        extra = {"best_validation_round": strategy.best_round}
        best = next((r for r in writer.rows if r["round"] == strategy.best_round), None)
        if best is not None:
            extra["final_accuracy"] = best["test_accuracy"]
    summary = write_summary(run_dir, cfg, outcome, writer.rows, time.monotonic() - t0, extra)
    log(
        INFO,
        "EdgeFleet run %s done: %d rounds (%s), final accuracy %.4f, results in %s",
        run_dir.name,
        summary["rounds_run"],
        summary["stop_reason"],
        summary["final_accuracy"] or float("nan"),
        run_dir.resolve(),
    )
