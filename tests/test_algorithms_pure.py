"""The algorithms package is plain NumPy: importing any of its modules loads no Flower."""

import pkgutil
import subprocess
import sys

import edgefleet.algorithms

MODULES = sorted(m.name for m in pkgutil.iter_modules(edgefleet.algorithms.__path__))


def test_no_algorithm_imports_flower() -> None:
    assert {"saga", "selection", "stopping", "tracker", "warmstart"} <= set(MODULES)
    # A fresh interpreter per module: one module's imports must not hide another's.
    code = (
        "import importlib, sys\n"
        "importlib.import_module(sys.argv[1])\n"
        "print(sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.')))\n"
    )
    for name in MODULES:
        module = f"edgefleet.algorithms.{name}"
        out = subprocess.run(
            [sys.executable, "-c", code, module], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert out == "[]", f"{module} imports Flower: {out}"
