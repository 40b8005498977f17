"""``deploy/composefleet.py`` without a Docker engine: what it reads from container stats, the
process killer it runs inside a container, and the reason it gives where no engine answers.
The compose test (tests/test_compose.py, opt-in; CI runs it) drives it against a real one."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.test_compose import cf


@pytest.mark.parametrize(
    ("stats", "want"),
    [
        # cgroup v2: usage less inactive_file, as `docker stats` shows it
        ({"memory_stats": {"usage": 300, "stats": {"inactive_file": 100}}}, 200),
        # cgroup v1: total_inactive_file
        ({"memory_stats": {"usage": 300, "stats": {"total_inactive_file": 50}}}, 250),
        ({"memory_stats": {"usage": 300, "stats": {}}}, 300),
        # a cache figure not below the usage is not subtracted (it would read 0 or less)
        ({"memory_stats": {"usage": 300, "stats": {"inactive_file": 300}}}, 300),
        ({"memory_stats": {}}, None),  # a stopped container
        ({}, None),
    ],
)
def test_memory_reads_usage_less_the_inactive_page_cache(stats: dict, want: int | None) -> None:
    assert cf.memory_bytes(stats) == want


def test_processes_are_read_from_docker_top_and_named_by_kind() -> None:
    top = {
        "Titles": ["PID", "RSS", "COMMAND"],
        "Processes": [
            ["4101", "94208", "/usr/local/bin/python /usr/local/bin/flwr-clientapp --insecure"],
            ["4388", "512000", "/usr/local/bin/python /usr/local/bin/flwr-clientapp --token x"],
            ["4390", "n/a", "broken row"],
            ["4391"],
        ],
    }

    def kind(cmd: str) -> str:
        return "clientapp" if "flwr-clientapp" in cmd else "other"

    assert cf.top_processes("clientapp-1", top, kind) == {
        "clientapp-1/clientapp": (4101, 94208 * 1024),
        "clientapp-1/clientapp#4388": (4388, 512000 * 1024),
    }
    assert cf.top_processes("x", {"Titles": ["UID", "CMD"], "Processes": [["0", "sh"]]}, kind) == {}
    # procps on some hosts titles the column ARGS
    args_top = {"Titles": ["PID", "RSS", "ARGS"], "Processes": [["7", "10", "prometheus"]]}
    assert cf.top_processes("prometheus", args_top, lambda c: c) == {
        "prometheus/prometheus": (7, 10240)
    }


def test_the_in_container_killer_kills_only_the_processes_it_names() -> None:
    marker = f"edgefleet-kill-me-{uuid.uuid4().hex[:8]}"
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "other"])
    try:
        out = subprocess.run(
            [sys.executable, "-c", cf._KILL_SNIPPET, marker],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        assert out.stdout.split() == [str(target.pid)]
        assert target.wait(timeout=10) == -9
        time.sleep(0.1)
        assert bystander.poll() is None
    finally:
        for p in (target, bystander):
            p.kill()
            p.wait()


def test_no_engine_is_named_as_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("docker")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-such.sock'}")
    why = cf.unavailable()
    assert why is not None and why.startswith("no Docker engine answers"), why
