"""Timing hook of benchmarks/perf/sim_overhead.py, inert unless EDGEFLEET_BENCH_TRACE names a file.

sim_overhead.py puts this folder first on the run's PYTHONPATH, which every process of the run
inherits (Ray passes it on to its actors), so EdgeFleet's code is timed without changing it.
When a module below is imported, a few of its functions are wrapped; each call appends one
JSON line (``tracehook.py``: ``{"kind", "pid", "t0", "dt", ...}``) to the file. Kept free of
heavy imports: it runs in every Python process of the run.
"""

import os

if os.environ.get("EDGEFLEET_BENCH_TRACE"):
    import time

    from tracehook import Tracer

    _tracer = Tracer(os.environ["EDGEFLEET_BENCH_TRACE"])

    def _device(mod):
        orig = mod.get_device

        def get_device(run_config, node_config):
            before = len(mod._DEVICES)
            t0 = time.time()
            try:
                return orig(run_config, node_config)
            finally:
                miss = len(mod._DEVICES) > before
                _tracer.emit("get_device", t0=t0, dt=time.time() - t0, miss=miss)

        mod.get_device = get_device

    def _train(mod):
        mod.train_local = _tracer.timed("train_local", mod.train_local)

    def _round_of(args, kwargs, result):
        return {"round": args[1]}

    def _loop(mod):
        loop = mod.RoundLoop
        loop.run_round = _tracer.timed("round", loop.run_round, info=_round_of)
        loop.evaluate = _tracer.timed("central_eval", loop.evaluate)

    def _ray(mod):
        mod.init = _tracer.timed("ray_init", mod.init)

    _tracer.install(
        {
            "edgefleet.client.device": _device,
            "edgefleet.task.train": _train,
            "edgefleet.loop.roundloop": _loop,
            "ray": _ray,
        }
    )
