"""The warm ClientApp worker's pieces (issue 16): argument handling and FAB switching.
The worker against real Flower processes is tests/test_deployment_worker.py."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from edgefleet.client import worker
from edgefleet.client.worker import WarmApp, WorkerError, parse_supernode_args

PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "tinyapp"
version = "1.0.0"
license = "Apache-2.0"
dependencies = ["flwr"]

[tool.flwr.app]
publisher = "tester"

[tool.flwr.app.components]
serverapp = "tinyapp.client:app"
clientapp = "tinyapp.client:app"
"""


def _fab(root: Path, version: int) -> tuple[bytes, str]:
    """A one-module app whose module says which build it is."""
    app = root / f"v{version}"
    (app / "tinyapp").mkdir(parents=True)
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / "tinyapp" / "__init__.py").write_text("")
    (app / "tinyapp" / "client.py").write_text(
        f"from flwr.clientapp import ClientApp\nVERSION = {version}\napp = ClientApp()\n"
    )
    content = build_fab_from_disk(app)
    return content, hashlib.sha256(content).hexdigest()


def test_each_fab_runs_its_own_code_and_is_installed_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    installs = []
    real_install = worker.fp.install_from_fab

    def counting(content: bytes, **kwargs: object) -> object:
        installs.append(hashlib.sha256(content).hexdigest())
        return real_install(content, **kwargs)

    monkeypatch.setattr(worker.fp, "install_from_fab", counting)
    path_before = list(sys.path)
    one, two = _fab(tmp_path, 1), _fab(tmp_path, 2)
    warm = WarmApp()
    try:
        app1 = warm.load("tester/tinyapp", "1.0.0", one[1], one[0])
        assert sys.modules["tinyapp.client"].VERSION == 1
        assert warm.load("tester/tinyapp", "1.0.0", one[1], one[0]) is app1
        assert installs == [one[1]]
        warm.load("tester/tinyapp", "1.0.0", two[1], two[0])
        assert sys.modules["tinyapp.client"].VERSION == 2
        warm.load("tester/tinyapp", "1.0.0", one[1], one[0])  # back to the first build
        assert sys.modules["tinyapp.client"].VERSION == 1
        assert installs == [one[1], two[1], one[1]]
        app_dirs = [p for p in sys.path if "tester.tinyapp" in p]
        assert len(app_dirs) == 1 and app_dirs[0].endswith(one[1][:8])  # one FAB folder, first
        assert sys.path[0] == app_dirs[0]
    finally:
        for name in [m for m in sys.modules if m.partition(".")[0] == "tinyapp"]:
            del sys.modules[name]
        sys.path[:] = path_before


def test_supernode_arguments() -> None:
    args = parse_supernode_args(
        ["--insecure", "--superlink", "1.2.3.4:8000", "--port", "9100", "--preload", "torch,numpy",
         "--node-config", "partition-id=0 num-partitions=2"]
    )  # fmt: skip
    assert args.address == "127.0.0.1:9100"
    assert args.preload == ["torch", "numpy"]
    assert args.passthrough == [
        "--insecure", "--superlink", "1.2.3.4:8000", "--port", "9100",
        "--node-config", "partition-id=0 num-partitions=2",
    ]  # fmt: skip
    assert parse_supernode_args(["--host", "0.0.0.0", "--preload="]).address == "127.0.0.1:9094"
    assert parse_supernode_args(["--host=::1", "--port=1"]).address == "[::1]:1"
    tls = parse_supernode_args(["--ssl-ca-certfile", "ca.crt", "--isolation", "process"])
    assert tls.root_certificates == "ca.crt" and "--isolation" not in tls.passthrough
    with pytest.raises(WorkerError, match="--isolation subprocess: edgefleet supernode runs"):
        parse_supernode_args(["--isolation", "subprocess"])


def test_bad_secret_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(WorkerError, match="cannot read --superexec-auth-secret-file"):
        worker._read_secret(str(tmp_path / "missing"))
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(WorkerError, match="is empty"):
        worker._read_secret(str(tmp_path / "empty"))


def test_a_process_keeps_the_devices_of_one_run_config_only() -> None:
    from edgefleet.client import device as dev

    node = {"partition-id": 0, "num-partitions": 4}
    first = dev.get_device({"local-steps": 1}, node)
    assert dev.get_device({"local-steps": 1}, node) is first  # cached within a run
    second = dev.get_device({"local-steps": 2}, node)  # a later run on the same worker
    assert second is not first
    assert list(dev._DEVICES.values()) == [second]


def _first_retry_after(pull_and_inflate: Callable[..., object]) -> float:
    """Seconds between a message object's first pull (not there yet) and its retry."""
    from flwr.proto.message_pb2 import ObjectTree
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    calls: list[float] = []

    def pull(object_id: str) -> bytes:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise ObjectUnavailableError(object_id)
        raise RuntimeError("seen the retry")

    with pytest.raises(RuntimeError, match="seen the retry"):
        pull_and_inflate(ObjectTree(object_id="a" * 64), pull, lambda _: None)
    return calls[1] - calls[0]


def test_the_worker_retries_an_object_pull_sooner_than_flower() -> None:
    # A worker claims a task within 20 ms, often before the SuperNode holds every object of
    # the message; Flower's first retry comes after 1 s, the worker's after 20 ms.
    from flwr.supernode.runtime import run_clientapp as flower_task

    flower_pull = flower_task.pull_and_inflate_object_from_tree
    assert _first_retry_after(flower_pull) > 0.7
    with worker._quick_object_pulls():
        assert _first_retry_after(flower_task.pull_and_inflate_object_from_tree) < 0.2
    assert flower_task.pull_and_inflate_object_from_tree is flower_pull
