"""The timing machinery the benchmarks' ``sitecustomize.py`` hooks share (sim_overhead's, in
this folder, and the one deploy_overhead.py writes for a node's processes).

A hook builds a :class:`Tracer` on the trace file, wraps functions of modules it names with
:meth:`Tracer.timed` and calls :meth:`Tracer.install`: when one of those modules is imported,
its patch runs right after the module's own code, so the app is timed without changing it.
Every event is one JSON line appended with O_APPEND (whole lines from many processes):
``{"kind", "pid", "t", "cpu", ...}``; a timed call adds ``t0``, ``dt`` and ``cpu0``.

Standard library only: it runs at the start of every Python process of a run.
"""

import functools
import importlib.abc
import json
import os
import sys
import time


def cpu_seconds():
    t = os.times()
    return t.user + t.system


class Tracer:
    def __init__(self, path):
        self.path = path

    def emit(self, kind, **fields):
        rec = {"kind": kind, "pid": os.getpid(), "t": time.time(), "cpu": cpu_seconds()}
        rec.update(fields)
        data = (json.dumps(rec, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def timed(self, kind, fn, info=None, keep=None):
        """``fn`` emitting ``kind`` per call; ``info(args, kwargs, result)`` adds fields,
        ``keep(args, kwargs, result)`` False leaves a call out."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0, cpu0 = time.time(), cpu_seconds()
            result = None
            try:
                result = fn(*args, **kwargs)
                return result
            finally:
                if keep is None or keep(args, kwargs, result):
                    extra = info(args, kwargs, result) if info is not None else {}
                    self.emit(kind, t0=t0, dt=time.time() - t0, cpu0=cpu0, **extra)

        return wrapper

    def install(self, patches):
        """Run ``patches[name](module)`` when the module ``name`` is imported. A patch that
        fails is reported as a ``patch_error`` event; the module loads as it is."""
        tracer = self

        class _Loader(importlib.abc.Loader):
            def __init__(self, inner, patch):
                self.inner, self.patch = inner, patch

            def create_module(self, spec):
                return self.inner.create_module(spec)

            def __getattr__(self, name):
                # runpy (`python -m module`) asks the loader for get_code and friends.
                return getattr(self.inner, name)

            def exec_module(self, module):
                self.inner.exec_module(module)
                try:
                    self.patch(module)
                except Exception as err:
                    tracer.emit("patch_error", module=module.__name__, error=repr(err))

        class _Finder(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                patch = patches.get(name)
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
