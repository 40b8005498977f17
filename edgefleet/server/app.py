"""EdgeFleet's ServerApp: parse the config, build the strategy, run the round loop, write results.

The same ServerApp runs under Flower's Simulation Engine (``flwr run .``) and the Deployment
Engine (SuperLink + SuperNodes); the one thing that tells them apart is the ``attack.*``
keys, refused under the Deployment Engine (:func:`refuse_attacks_outside_simulation`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from edgefleet import runlock
from edgefleet.algorithms.warmstart import SessionStore
from edgefleet.config import (
    SAGA_FAMILY,
    ConfigError,
    LrSchedule,
    RunConfig,
    SelectionMode,
    StoppingMode,
    ValidationSplit,
    attack_keys_set,
    parse_run_config,
)
from edgefleet.loop.asyncloop import AsyncLoop
from edgefleet.loop.base import build_loop, find_wrapper
from edgefleet.loop.context import ClassAccuracy
from edgefleet.loop.roundloop import EvaluateFn, Evaluation, RoundLoop
from edgefleet.loop.screening import Screening
from edgefleet.loop.staleness import AsyncSettings
from edgefleet.loop.timing import RoundWait, WaitMode
from edgefleet.server.baselines import AGGREGATORS
from edgefleet.server.checkpoint import (
    Checkpoint,
    Checkpointer,
    apply_checkpoint,
    check_resumable,
    run_identity,
)
from edgefleet.server.emptyrounds import EmptyRoundsStop
from edgefleet.server.fleet import FleetWriter
from edgefleet.server.polling import fast_grid
from edgefleet.server.results import MetricsWriter, prepare_run_dir, write_summary
from edgefleet.strategies.energy_selection import EnergyAgeSelection
from edgefleet.strategies.reconstruction import SubmodelReconstruction
from edgefleet.strategies.robust import RobustAggregation, RobustRule
from edgefleet.strategies.stopping import TaskVectorStopping, ValidationStopping
from edgefleet.strategies.warmstart_initializer import WarmStartInitializer
from edgefleet.task.accelerator import resolve_accelerator
from edgefleet.task.datasets import load_dataset, load_validation
from edgefleet.task.partition import split_local

if TYPE_CHECKING:
    from edgefleet.pruning.submodel import PruningPlan
    from edgefleet.task.datasets import ArrayDataset

# torch and the data layer are imported where the central evaluation is built, not here:
# under the Simulation Engine this module loads in the process that is about to start Ray.

app = ServerApp()


def build_strategy(
    cfg: RunConfig, central: CentralEvaluation | None = None, run_dir: Path | None = None
) -> Strategy:
    """EdgeFleet's strategy for ``cfg``: Flower strategies and EdgeFleet's wrappers, nested
    from the outside in as

        sessions > stopping > energy-aware selection > CA-HFP reconstruction > aggregator

    (each wrapper only when its keys turn it on; reconstruction always; in asynchronous
    mode only the layers marked ``in_async`` (the robust rule, reconstruction, energy-age
    selection, data-free stopping) wrap the aggregator: the asynchronous loop aggregates its
    buffer with it, asks the selection whom to start as slots free, and the run config
    refuses the other wrappers). Why this order:

    - **Sessions** (``WarmStartInitializer``) outermost: a session boundary changes the
      device set and the model every layer inside starts from; it announces boundaries
      inwards (``on_session``). It and selection declare the status they need; the round
      loop's status phase asks every node once a round, on one slot clock, and both read
      the answers from the round context.
    - **Stopping** (``TaskVectorStopping`` / ``ValidationStopping``) next: it watches the
      global model of the whole run (or session, from the session's start), and when it
      rests the devices inside sessions it sends no train messages at all, so selection
      below spends no status queries on a resting fleet.
    - **Energy-aware selection** (``EnergyAgeSelection``) above reconstruction: it decides
      which nodes get a train message; what those messages and replies hold is the
      business of the layers below.
    - **Reconstruction** (``SubmodelReconstruction``) right around the aggregator: it turns
      CA-HFP's compact submodel replies into full-size ones before any aggregation rule
      sees them, so FedAvg, FedProx and FedSAG all aggregate full-size updates. It passes
      full-size replies through, so it is always on: a SuperNode may be given a keep ratio
      (``--node-config keep-ratio=...``) that the server's config does not know.
    - **Aggregator** innermost: ``FedAvg``, ``FedProx``, ``FedSAG`` (SAGA memory), the
      field's baselines (``MIFA``, ``FedVARP``, ``Scaffold``), or under energy-aware
      selection with ``fedavg`` the plain mean of the participants (``EqualWeightFedAvg``:
      EH-FedAvg, the paper's baseline). With ``robust.rule``, ``RobustAggregation`` wraps
      the aggregator (directly inside the reconstruction, so the rule sees the submodels'
      masks), except for the SAGA family (FedSAG, MIFA, FedVARP), which takes the rule
      itself (its memory and correction means). The round loop's reply screening runs
      before any of them.

    ``central`` (the initial model, its trainable keys, server-side validation) is needed by
    stopping and sessions, ``run_dir`` by sessions (their session store).
    """
    common: dict[str, Any] = {
        "fraction_train": cfg.server.fraction_train,
        "fraction_evaluate": cfg.server.fraction_evaluate,
        "min_train_nodes": 1,
        "min_evaluate_nodes": 1,
        # Flower's own wait for nodes has no timeout: the ServerApp waits for the fleet in
        # wait_for_nodes() and the round loop bounds any later wait (BoundedGrid).
        "min_available_nodes": 1,
    }
    if cfg.energy.selection == SelectionMode.ENERGY_AGE:
        common["fraction_train"] = 1.0  # the selection wrapper has already chosen
    strategy = AGGREGATORS[cfg.server.strategy](cfg, common)
    for layer in LAYERS:
        if layer.on(cfg) and (layer.in_async or not cfg.aggregation.enabled):
            strategy = layer.wrap(strategy, cfg, central, run_dir)
    return strategy


@dataclass(frozen=True)
class Layer:
    """One wrapper of :func:`build_strategy`'s stack: whether the run config turns it on, and
    how it wraps the strategy inside it (``central``, ``run_dir``: as build_strategy's).
    ``in_async``: also around the aggregator of the asynchronous loop, which the run config
    lets no other wrapper into (:func:`edgefleet.config._check_async`)."""

    name: str
    on: Callable[[RunConfig], bool]
    wrap: Callable[[Strategy, RunConfig, CentralEvaluation | None, Path | None], Strategy]
    in_async: bool = False


def _needs(central: CentralEvaluation | None, what: str) -> CentralEvaluation:
    if central is None:
        raise ValueError(f"build_strategy: {what} needs the central evaluation")
    return central


def _sessions(
    inner: Strategy, cfg: RunConfig, central: CentralEvaluation | None, run_dir: Path | None
) -> Strategy:
    central = _needs(central, "sessions")
    if run_dir is None:
        raise ValueError("build_strategy: sessions need the run folder for their store")
    t = cfg.train
    return WarmStartInitializer.from_config(
        inner,
        cfg.warmstart,
        cfg.sessions,
        # A fresh run's folder is new (prepare_run_dir), so only a resumed run finds a store.
        store=SessionStore.open(run_dir / "sessions", cfg.warmstart.max_stored),
        initial=central.initial,
        param_keys=central.keys,
        lr=t.lr,
        lr_min_ratio=t.lr_min_ratio if t.lr_schedule == LrSchedule.SESSION_POLY else 1.0,
        slots_per_round=cfg.energy.slots_per_round,
        query_timeout=query_timeout(cfg),
        first_answer_timeout=first_answer_timeout(cfg),
    )


# build_strategy's wrappers, innermost first (its docstring says why in this order).
LAYERS: tuple[Layer, ...] = (
    Layer(
        # Right inside the reconstruction, which hands it the submodels' masks; the FedSAG
        # family takes the rule itself (AGGREGATORS).
        "robust rule",
        lambda cfg: cfg.robust.rule != RobustRule.OFF and cfg.server.strategy not in SAGA_FAMILY,
        lambda inner, cfg, *_: RobustAggregation.from_config(inner, cfg.robust),
        in_async=True,
    ),
    Layer(
        "CA-HFP reconstruction",
        lambda cfg: True,  # full-size replies pass through; a SuperNode may set a keep ratio
        lambda inner, cfg, *_: SubmodelReconstruction.from_config(
            inner, cfg.pruning, partial(pruning_plan, cfg)
        ),
        # async: each submodel made full size against its own version (full_size_reply)
        in_async=True,
    ),
    Layer(
        "energy-age selection",
        lambda cfg: cfg.energy.selection == SelectionMode.ENERGY_AGE,
        lambda inner, cfg, *_: EnergyAgeSelection.from_config(
            inner,
            cfg.energy,
            seed=cfg.seed,
            query_timeout=query_timeout(cfg),
            first_answer_timeout=first_answer_timeout(cfg),
        ),
        in_async=True,  # async: it chooses who starts as slots free (choose_to_start)
    ),
    Layer(
        "data-free stopping",
        lambda cfg: cfg.stopping.mode in (StoppingMode.DATA_FREE, StoppingMode.OBSERVE),
        lambda inner, cfg, central, _: TaskVectorStopping.from_config(
            inner, cfg.stopping, _needs(central, "stopping").keys
        ),
        in_async=True,  # its round is a version there: tau and patience count versions
    ),
    Layer(
        "validation stopping",
        lambda cfg: cfg.stopping.mode in (StoppingMode.VALIDATION, StoppingMode.OBSERVE),
        lambda inner, cfg, central, _: ValidationStopping.from_config(
            inner, cfg.stopping, _needs(central, "stopping").validate
        ),
    ),
    Layer("sessions", lambda cfg: cfg.sessions_enabled, _sessions),
)


def refuse_attacks_outside_simulation(run_config: Mapping[str, object], grid: Grid) -> None:
    """``attack.*`` keys are for the Simulation Engine (and EdgeFleet's in-process test
    grids): under the Deployment Engine (the ServerApp's grid is Flower's ``HttpGrid``, to a
    SuperLink with real SuperNodes) a run that sets one stops here, before any round."""
    keys = attack_keys_set(run_config)
    if not keys:
        return  # (importing flwr.superlink.grid costs seconds a run: only when it matters)
    from flwr.superlink.grid import HttpGrid

    if isinstance(grid, HttpGrid):
        raise ConfigError(
            f"run config {', '.join(repr(k) for k in keys)}: attack.* keys make devices "
            "attack, for evaluating defences on the Simulation Engine only; this run is on "
            "the Deployment Engine (real SuperNodes). Remove them, or run the scenario with "
            "`edgefleet run` / `flwr run` on a simulation federation"
        )


def screening_for(cfg: RunConfig) -> Screening:
    """The bounds EdgeFleet's ServerApp screens replies against. It knows its ClientApp: a
    device sees at most ``local-steps`` x ``batch-size`` samples a round, and its energy mod
    charges one round's cost (``energy.train-slots`` + 1) for a reply. (The cost, not
    ``energy.capacity``: a SuperNode's ``--node-config capacity`` may be larger than the run
    config's, while the cost is the same for every device.)"""
    t = cfg.train
    return Screening.from_config(cfg.screening, t.local_steps * t.batch_size, cfg.energy.round_cost)


def round_wait(cfg: RunConfig) -> RoundWait:
    """How long a round waits for each device (``timeout-mode`` and its keys)."""
    return RoundWait.from_config(cfg.server)


def query_timeout(cfg: RunConfig) -> float:
    """How long a status query waits: a node that died answers never, and the round must
    not wait for it longer than for a training reply (nor more than a minute)."""
    return min(60.0, cfg.server.round_timeout)


def first_answer_timeout(cfg: RunConfig) -> float:
    """How long a status query waits for nodes that have never answered: their ClientApps
    may still be starting (on a loaded machine a Ray actor and its first data load take
    minutes), which must not turn into an empty round and change a seeded run's rows.
    A node that dies meanwhile is answered for by Flower (an error once it is offline)."""
    s = cfg.server
    first = s.first_round_timeout if s.timeout_mode == WaitMode.EXPECTED else 0.0
    return max(s.round_timeout, s.node_wait_timeout, first)


def pruning_plan(cfg: RunConfig) -> PruningPlan:
    """The channel groups of the run's model, for rebuilding CA-HFP submodels."""
    from edgefleet.pruning.submodel import plan_for  # torch-pruning only when needed

    return plan_for(cfg.train.model, cfg.data.dataset)


def fleet_census(loop: RoundLoop, cfg: RunConfig, first_round: int) -> None:
    """One status query to every online node before the first round: it fixes the fleet's
    partitioning (the ``num-partitions`` EdgeFleet's devices report; the checkpoint keeps
    it) in a fresh run, and in a resumed run checks it and the devices' ids against the
    checkpoint's, so that a run of 3 SuperNodes never resumes on 10 simulated devices, nor on
    a fleet none of whose devices it has seen (``FleetMismatch``). Nodes whose ClientApp
    cannot answer are not checked. The query carries the first round's slot on the loop's
    fleet clock, so batteries advance to where that round finds them anyway. (Before round
    1, not a round's status phase; the loop sends it, as it sends every message.)"""
    loop.census(first_round, query_timeout(cfg), first_answer_timeout(cfg))


# A resumed run goes on once the fleet has stopped growing for this long: nodes reconnecting
# to a restarted SuperLink come back within seconds, a board that lost power may be away for
# hours, and the run should not wait node-wait-timeout for it at every restart.
RESUME_SETTLE_S = 15.0


def wait_for_nodes(
    grid: Grid,
    wanted: int,
    timeout: float,
    settle: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Wait up to ``timeout`` s for ``wanted`` nodes; go on with whoever is there after that.
    With ``settle`` (a resumed run), go on sooner: once at least one node is online and their
    number has not changed for ``settle`` s.

    FedAvg's own wait (``min_available_nodes``) has no timeout and hangs a server whose
    fleet is short of nodes.
    """
    start = clock()
    deadline = start + timeout
    pause = 0.1  # the Simulation Engine registers its nodes within a moment of starting
    last, since = -1, start
    while (n := len(list(grid.get_node_ids()))) < wanted and clock() < deadline:
        if n != last:
            last, since = n, clock()
        elif settle is not None and n > 0 and clock() - since >= settle:
            log(INFO, "Resuming with %d of %d nodes: none joined in %.0f s", n, wanted, settle)
            return n
        log(INFO, "Waiting for nodes: %d of %d online", n, wanted)
        sleep(pause)
        pause = min(1.0, pause * 2)
    if n < wanted:
        log(WARNING, "Only %d of %d nodes online after %.0f s; going on", n, wanted, timeout)
    if n == 0:
        raise RuntimeError(f"no node came online within {timeout:.0f} s")
    return n


def _channels_last(data: ArrayDataset) -> ArrayDataset:
    """The same images, stored (N, H, W, C) but still indexed (N, C, H, W)."""
    if data.x.ndim != 4:
        return data
    x = np.ascontiguousarray(data.x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    return type(data)(x, data.y)


@dataclass
class CentralEvaluation:
    """The seeded initial model, its trainable keys, and evaluation on data the server holds:
    the held-out test set, and (only for the validation-stopping baseline) a validation
    split carved from it, in which case test figures are on the rest."""

    initial: ArrayRecord
    keys: list[str]
    evaluate: EvaluateFn
    validate: Callable[[ArrayRecord], dict[str, float]]


def central_evaluation(cfg: RunConfig) -> CentralEvaluation:
    import torch

    # lazy: torch (task.models, task.train) only for the server's central evaluation
    from edgefleet.task.models import build_model
    from edgefleet.task.train import evaluate, get_arrays, set_arrays

    # Resolved before any data is loaded: an accelerator this machine lacks ends the run here.
    accelerator = resolve_accelerator(cfg.train.accelerator)
    _, test_set, info = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    validation = test_set
    if cfg.stopping.mode in (StoppingMode.VALIDATION, StoppingMode.OBSERVE):
        official = None
        if cfg.stopping.validation_split == ValidationSplit.OFFICIAL:
            official = load_validation(cfg.data.dataset, cfg.data.data_dir)
        if official is not None:  # the test set stays whole, as in the stopping paper
            validation = official
            log(INFO, "Validation baselines on %s's official validation split (%d images)",
                cfg.data.dataset, len(official))  # fmt: skip
        else:
            frac = cfg.stopping.validation_fraction
            test_set, validation = split_local(test_set, frac, cfg.seed)
            log(INFO, "Validation baselines on %.0f%% of the test set (%d images); test figures"
                " on the rest", 100 * frac, len(validation))  # fmt: skip
    if 0 < cfg.server.eval_samples < len(test_set):
        rng = np.random.default_rng(cfg.seed)
        test_set = test_set.subset(
            np.sort(rng.choice(len(test_set), cfg.server.eval_samples, replace=False))
        )
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.train.model, info.input_shape, info.num_classes)
    initial = get_arrays(model)  # built on the CPU: the same initial model on any accelerator
    # The server evaluates every round while the devices wait for the next one: channels-last
    # convolutions took 30% less CPU here (same predictions; the loss may differ in the 8th
    # significant digit). set_arrays copies into the parameters, keeping their layout.
    model = model.to(accelerator).to(memory_format=torch.channels_last)
    test_set, validation = _channels_last(test_set), _channels_last(validation)

    def evaluate_fn(_: int, arrays: ArrayRecord) -> Evaluation:
        set_arrays(model, arrays)
        res = evaluate(model, test_set)
        out = {
            "test_loss": res.loss,
            "test_accuracy": res.accuracy,
            "test_balanced_accuracy": res.balanced_accuracy,
        }
        # Per-class counts: the sessions wrapper's accuracy on the classes present.
        per_class = {c: ClassAccuracy(ok, n) for c, (ok, n) in res.per_class.items()}
        return Evaluation(out, per_class)

    def validate(arrays: ArrayRecord) -> dict[str, float]:
        set_arrays(model, arrays)
        res = evaluate(model, validation)
        return {
            "accuracy": res.accuracy,
            "loss": res.loss,
            "balanced_accuracy": res.balanced_accuracy,
        }

    keys = [name for name, _ in model.named_parameters()]
    return CentralEvaluation(initial, keys, evaluate_fn, validate)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = parse_run_config(context.run_config)
    refuse_attacks_outside_simulation(context.run_config, grid)
    random.seed(cfg.seed)  # Flower's node sampling draws from the global RNG
    run_dir = prepare_run_dir(cfg)  # a resume that would not continue the same run stops here
    ckpt = check_resumable(cfg, run_dir) if cfg.server.resume else None
    log(INFO, "EdgeFleet run %s: writing results to %s", run_dir.name, run_dir.resolve())
    central = central_evaluation(cfg)
    strategy = build_strategy(cfg, central, run_dir)
    writer = MetricsWriter(run_dir)
    log(INFO, "EdgeFleet strategy:")
    strategy.summary()
    settle = RESUME_SETTLE_S if ckpt is not None else None
    wait_for_nodes(grid, cfg.server.min_nodes, cfg.server.node_wait_timeout, settle)
    fast_grid(grid)
    if cfg.aggregation.enabled:
        run_async(cfg, strategy, grid, central, writer, run_dir, ckpt)
        return
    checkpointer = Checkpointer(run_dir, strategy, run_identity(cfg))
    tau = (
        cfg.stopping.tau
        if cfg.stopping.mode in (StoppingMode.DATA_FREE, StoppingMode.OBSERVE)
        else None
    )
    loop = build_loop(
        strategy,
        grid,
        # The writer records what the wrappers wrote; the checkpoint comes after so that a
        # round it covers is always on record, and a fleet gone silent stops the run last.
        after=[
            writer,
            FleetWriter(run_dir, tau),
            checkpointer,
            EmptyRoundsStop(cfg.server.max_empty_rounds, cfg.energy.deadline_retry),
        ],
        evaluate_fn=central.evaluate,
        evaluate_every=cfg.server.evaluate_every,
        wait=round_wait(cfg),
        screening=screening_for(cfg),
    )
    checkpointer.loop_state = loop.state_dict
    arrays, first_round = central.initial, 1
    if ckpt is not None:
        apply_checkpoint(ckpt, strategy, list(central.initial), loop)
        log(INFO, "Resuming run %s: round %d done", run_dir.name, ckpt.round)
        arrays, first_round = ckpt.array_record(), ckpt.round + 1
    fleet_census(loop, cfg, first_round)  # a resume on another fleet stops here
    if ckpt is not None:
        writer.keep_until(ckpt.round)
        (run_dir / "summary.json").unlink(missing_ok=True)  # written again at the end
    t0 = time.monotonic()
    outcome = loop.run(arrays, cfg.server.num_rounds, ConfigRecord(), first_round=first_round)
    extra = {}
    baseline = find_wrapper(strategy, ValidationStopping)
    if baseline is not None and baseline.enforce and baseline.keeps_best:
        # The baseline returns its best model, so its figures are those of that round.
        extra = {"best_validation_round": baseline.best_round}
        best = next((r for r in writer.rows if r["round"] == baseline.best_round), None)
        if best is not None:
            extra["final_accuracy"] = best["test_accuracy"]
    wall_s = writer.wall_offset + time.monotonic() - t0  # every part of a resumed run
    summary = write_summary(run_dir, cfg, outcome, writer.rows, wall_s, extra)
    runlock.release(run_dir)  # done writing; a failed run's lock goes with its process
    log(
        INFO,
        "EdgeFleet run %s done: %d rounds (%s), final accuracy %.4f, results in %s",
        run_dir.name,
        summary["rounds_run"],
        summary["stop_reason"],
        summary["final_accuracy"] or float("nan"),
        run_dir.resolve(),
    )


def run_async(
    cfg: RunConfig,
    strategy: Strategy,
    grid: Grid,
    central: CentralEvaluation,
    writer: MetricsWriter,
    run_dir: Path,
    ckpt: Checkpoint | None = None,
) -> None:
    """``aggregation.mode = async``: the FedBuff loop (edgefleet.loop.asyncloop) in
    place of the round loop; one metrics row and one checkpoint per global model version
    (``ckpt``: the checkpoint a resumed run continues from)."""
    a = cfg.aggregation
    tau = cfg.stopping.tau if cfg.stopping.mode == StoppingMode.DATA_FREE else None
    checkpointer = Checkpointer(run_dir, strategy, run_identity(cfg))
    settings = AsyncSettings.from_config(a)
    loop = AsyncLoop(
        strategy,
        grid,
        settings,
        evaluate_fn=central.evaluate,
        evaluate_every=cfg.server.evaluate_every,
        callbacks=[writer, FleetWriter(run_dir, tau), checkpointer],
        screening=screening_for(cfg),
        reply_timeout=cfg.server.round_timeout,
        node_wait_timeout=cfg.server.node_wait_timeout,
        checkpoint=checkpointer.save,  # mid-buffer too: no accepted update is lost
        max_empty=cfg.server.max_empty_rounds,
    )
    checkpointer.loop_state = loop.state_dict
    arrays, first = central.initial, 1
    if ckpt is not None:
        apply_checkpoint(ckpt, strategy, list(central.initial), loop)
        log(INFO, "Resuming run %s: version %d done", run_dir.name, ckpt.round)
        arrays, first = ckpt.array_record(), ckpt.round + 1
        writer.keep_until(ckpt.round)
        (run_dir / "summary.json").unlink(missing_ok=True)
    t0 = time.monotonic()
    outcome = loop.run(arrays, cfg.server.num_rounds, ConfigRecord(), first_version=first)
    extra = {"aggregation": "async", "versions": outcome.rounds_run}
    wall_s = writer.wall_offset + time.monotonic() - t0  # every part of a resumed run
    summary = write_summary(run_dir, cfg, outcome, writer.rows, wall_s, extra)
    runlock.release(run_dir)
    log(INFO, "EdgeFleet run %s done: %d versions (%s), final accuracy %.4f, results in %s",
        run_dir.name, outcome.rounds_run, summary["stop_reason"],
        summary["final_accuracy"] or float("nan"), run_dir.resolve())  # fmt: skip
