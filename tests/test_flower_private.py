"""The warm worker's Flower internals (edgefleet/client/flower_private.py): every name is
there in the installed Flower, the worker uses no other, and a Flower that moved one (or
another release) fails at import with a message that says so."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import flwr
import pytest

from edgefleet.client import flower_private, worker

ADAPTER = Path(flower_private.__file__)
WORKER = Path(worker.__file__)
PI_DIR = Path(__file__).resolve().parents[1] / "deploy" / "pi"


def _load_fresh() -> ModuleType:
    """The adapter executed again, as a module of its own (the real one stays as it is)."""
    spec = importlib.util.spec_from_file_location("flower_private_again", ADAPTER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_name_imports_through_the_adapter() -> None:
    for name in flower_private.__all__:
        assert getattr(flower_private, name) is not None, name
    for name in flower_private.RUN_CLIENTAPP_FUNCTIONS:
        assert callable(getattr(flower_private.run_clientapp, name)), name


def test_the_worker_uses_flower_only_through_the_adapter_and_flwr_app() -> None:
    tree = ast.parse(WORKER.read_text())
    flwr_imports = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flwr")
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("flwr")
    ]
    assert flwr_imports == ["flwr.app"]
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "fp"
    }
    assert used and used <= set(flower_private.__all__), used - set(flower_private.__all__)


def test_another_flower_release_is_refused_at_import(monkeypatch) -> None:
    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    with pytest.raises(ImportError) as err:  # the fresh module's FlowerVersionError
        _load_fresh()
    assert type(err.value).__name__ == "FlowerVersionError"
    assert "checked against flwr 1.42.x; flwr 1.43.0 is installed" in str(err.value)


def test_a_moved_internal_is_named_at_import(monkeypatch) -> None:
    import flwr.supercore.heartbeat

    monkeypatch.delattr(flwr.supercore.heartbeat, "HeartbeatSender")
    with pytest.raises(ImportError, match="lacks a Flower internal .*HeartbeatSender"):
        _load_fresh()


def test_the_boards_copy_runs_as_a_script(tmp_path: Path) -> None:
    """What ``scp -r deploy/pi`` puts on a board: real files, worker.py beside its adapter,
    no EdgeFleet package. Without arguments the worker prints its usage (exit status 2)."""
    board = tmp_path / "edgefleet"
    board.mkdir()
    for name in ("worker.py", "flower_private.py"):
        shutil.copy(PI_DIR / name, board / name)  # follows the links, as scp does
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(board / "worker.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "usage: python -m edgefleet.client.worker supernode|worker" in proc.stderr
