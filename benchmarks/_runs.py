"""Shared by the claim benchmarks: one run per name, reused when it already finished.

Two engines run a scenario:

- ``simulation``: Flower's Simulation Engine (``edgefleet run``: a SuperLink, Ray actors).
- ``inprocess``: EdgeFleet's own ServerApp and ClientApp objects called directly in one child
  process: the server's ``main`` gets a grid that hands each message to the ClientApp (its
  mods included) of the node it is addressed to, one after the other, and returns the replies.
  Same apps, same config, same seeds; no SuperLink, no Ray, no message serialisation. For long
  sweeps on a loaded machine, where Ray's start-up costs minutes a run and can time out
  ("The current node timed out during startup") when its processes are niced.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from edgefleet.simulation.runner import Scenario, resolve_run_config, run_scenario

ENGINES: tuple[str, ...] = ("simulation", "inprocess")


def parse_with_smoke(p: argparse.ArgumentParser, smoke: Mapping[str, Any]) -> argparse.Namespace:
    """``p``'s arguments, with ``--smoke``: the defaults become ``smoke`` (the smallest sizes
    that still run the benchmark's whole path, in seconds; ``tests/test_benchmarks_smoke.py``
    runs it), and flags given explicitly still win."""
    shown = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in smoke.items())
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes: {shown}")
    if p.parse_known_args()[0].smoke:
        p.set_defaults(**smoke)
    return p.parse_args()


def run_once(
    out: Path,
    name: str,
    federation: dict[str, Any],
    run_config: dict[str, Any],
    timeout: float,
    engine: str = "simulation",
) -> list[dict[str, Any]]:
    """Run ``name`` on ``engine`` unless ``out/name`` holds a finished run of the same config
    (so an interrupted sweep resumes where it stopped); its metrics rows. A finished run of
    another config is an error, not silently reused."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid choices: {', '.join(ENGINES)}")
    run_dir = out / name
    config = {**run_config, "output-dir": str(out), "run-name": name}
    summary = run_dir / "summary.json"
    if summary.exists():
        wanted = resolve_run_config(Scenario(name, federation, config))[0].to_dict()
        stored = json.loads(summary.read_text())["config"]
        # Where data and results live is not a setting; keys newer than the stored run are
        # at their defaults.
        changed = sorted(
            k
            for k in set(wanted) & set(stored) - {"data-dir", "output-dir", "run-name"}
            if stored[k] != wanted[k]
        )
        if changed:
            raise SystemExit(
                f"{run_dir} holds a run with other settings ({', '.join(changed)}); "
                "remove it or choose another --out"
            )
    else:
        if run_dir.exists():  # an unfinished run: start it again
            shutil.rmtree(run_dir)
        t0 = time.monotonic()
        if engine == "simulation":
            run_scenario(Scenario(name, federation, config), timeout=timeout, quiet=True)
        else:
            run_inprocess(Scenario(name, federation, config), out / f"{name}.log", timeout)
        print(f"{name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_inprocess(scenario: Scenario, log_path: Path, timeout: float) -> None:
    """Run ``scenario`` with the ``inprocess`` engine (module docstring) in a child process,
    its output in ``log_path``. The child is forked from this process once it has imported
    torch, Flower and the apps (:func:`_preload`), so a run does not pay those imports again
    (seconds a run, most of a short one on a loaded machine), and it starts with fresh caches
    and memory: this process never runs a round itself. Torch gets one thread, as in a Ray
    actor with one CPU."""
    _, raw = resolve_run_config(scenario)
    spec = {"run_config": raw, "nodes": scenario.federation["num-supernodes"]}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _preload()
    sys.stdout.flush()
    sys.stderr.flush()
    # fork: the child inherits the imported modules; spawn would import them again.
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(spec, str(log_path)))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise subprocess.TimeoutExpired(f"in-process run {raw['run-name']}", timeout)
    if proc.exitcode != 0:
        raise RuntimeError(f"in-process run {raw['run-name']} failed; see {log_path}")


def _preload() -> None:
    """Import what every run needs, once, before the first fork. One torch thread: set before
    torch starts its thread pools, and again in each child."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch._dynamo  # noqa: F401  (torch's first optimizer imports it: seconds)
    import torch.func  # noqa: F401  (CA-HFP's curvature scores)

    import edgefleet.client.app  # noqa: F401
    import edgefleet.server.app  # noqa: F401


def _child(spec: dict[str, Any], log_path: str) -> None:
    """A forked run: stdout and stderr (file descriptors included) into ``log_path``, then
    the server's main; exit status 0 only if it returned."""
    import torch
    from flwr.common.logger import update_console_handler

    code = 1
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            torch.set_num_threads(1)
            update_console_handler(level=20, timestamps=True, colored=False)
            _serve(spec)
            code = 0
        except BaseException:  # noqa: BLE001 - the log says why; the parent sees the status
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    # The parent's exit handlers (and its buffers, flushed before the fork) are not the
    # child's to run.
    os._exit(code)


class InProcessGrid:
    """Flower's Grid as the round loop uses it: node ids, and each message handed to the
    ClientApp of its node. A ClientApp that raises answers with an Error, as Flower's engines
    answer."""

    def __init__(self, run_config: dict[str, Any], nodes: int) -> None:
        from flwr.app import Context, RecordDict
        from flwr.supercore.task_identity import TaskIdentity

        from edgefleet.client.app import app as client_app

        # Messages are stamped with the ids of the task that creates them.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
        self._app = client_app
        self._contexts = {
            i + 1: Context(
                run_id=1,
                node_id=i + 1,
                node_config={"partition-id": i, "num-partitions": nodes},
                state=RecordDict(),
                run_config=run_config,
            )
            for i in range(nodes)
        }

    def get_node_ids(self) -> list[int]:
        return list(self._contexts)

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> list:
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        replies = []
        for msg in messages:
            try:
                replies.append(self._app(msg, self._contexts[msg.metadata.dst_node_id]))
            except Exception as err:  # noqa: BLE001 - a node's failure is its reply
                error = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"ClientApp raised {err!r}")
                replies.append(Message(error, reply_to=msg))
        return replies


def _serve(spec: dict[str, Any]) -> None:
    from flwr.app import Context, RecordDict

    from edgefleet.config import DEFAULTS
    from edgefleet.server.app import app as server_app

    # As Flower builds it: the app's defaults (pyproject.toml) under the run's overrides.
    run_config = {**DEFAULTS, **spec["run_config"]}
    grid = InProcessGrid(run_config, spec["nodes"])
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    server_app(grid, context)  # type: ignore[arg-type]


if __name__ == "__main__":
    from flwr.common.logger import update_console_handler

    update_console_handler(level=20, timestamps=True, colored=False)
    _serve(json.loads(sys.argv[1]))
