"""Timing hook of benchmarks/sim_overhead.py, inert unless EDGEFLEET_BENCH_TRACE names a file.

sim_overhead.py puts this folder first on the run's PYTHONPATH, which every process of the run
inherits (Ray passes it on to its actors), so EdgeFleet's code is timed without changing it.
When a module below is imported, a few of its functions are wrapped; each call appends one
JSON line ``{"kind", "pid", "t0", "dt", ...}`` to the file (O_APPEND: whole lines from many
processes). Kept free of heavy imports: it runs in every Python process of the run.
"""

import os

if os.environ.get("EDGEFLEET_BENCH_TRACE"):
    import functools
    import importlib.abc
    import json
    import sys
    import time

    _PATH = os.environ["EDGEFLEET_BENCH_TRACE"]

    def _emit(kind, **fields):
        line = json.dumps({"kind": kind, "pid": os.getpid(), **fields}, default=str) + "\n"
        fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _timed(kind, fn, info=lambda args, result: {}):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.time()
            result = None
            try:
                result = fn(*args, **kwargs)
                return result
            finally:
                _emit(kind, t0=t0, dt=time.time() - t0, **info(args, result))

        return wrapper

    def _device(mod):
        orig = mod.get_device

        def get_device(run_config, node_config):
            before = len(mod._DEVICES)
            t0 = time.time()
            try:
                return orig(run_config, node_config)
            finally:
                _emit("get_device", t0=t0, dt=time.time() - t0, miss=len(mod._DEVICES) > before)

        mod.get_device = get_device

    def _train(mod):
        mod.train_local = _timed("train_local", mod.train_local)

    def _loop(mod):
        loop = mod.RoundLoop
        loop.run_round = _timed("round", loop.run_round, lambda a, r: {"round": a[1]})
        loop.evaluate = _timed("central_eval", loop.evaluate)

    def _ray(mod):
        mod.init = _timed("ray_init", mod.init)

    _PATCHES = {
        "edgefleet.client.device": _device,
        "edgefleet.task.train": _train,
        "edgefleet.strategies.loop": _loop,
        "ray": _ray,
    }

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner, patch):
            self.inner, self.patch = inner, patch

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            self.patch(module)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            patch = _PATCHES.get(name)
            if patch is None:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader, patch)
                    return spec
            return None

    sys.meta_path.insert(0, _Finder())
