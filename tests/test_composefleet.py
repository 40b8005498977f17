"""``deploy/composefleet.py`` without a Docker engine: what it reads from container stats, the
process killer it runs inside a container, and the reason it gives where no engine answers.
The compose test (tests/test_compose.py, opt-in; CI runs it) drives it against a real one."""

from __future__ import annotations

import os
import shutil
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


def _compose_file(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    data: dict = yaml.safe_load((cf.ROOT / name).read_text())
    return data


def test_only_the_fleet_proxy_is_published_beyond_the_hosts_loopback() -> None:
    """docker-compose.yml as written (no engine needed): the SuperLink publishes nothing and
    sits on an internal network; the one port on every interface is fleet-proxy's; the
    Control API's proxy and the other services publish on 127.0.0.1 only. (The old file
    published the SuperLink's 8000, all three of its APIs, on every interface.)"""
    base = _compose_file("docker-compose.yml")
    services = base["services"]
    assert "ports" not in services["superlink"]
    assert list(services["superlink"]["networks"]) == ["superlink-net"]
    assert base["networks"]["superlink-net"]["internal"] is True
    for name, service in {**services, **_compose_file(cf.OVERLAYS[3])["services"]}.items():
        for port in service.get("ports", []):
            if name == "fleet-proxy":
                assert not str(port).startswith("127.0.0.1:"), port
            else:
                assert str(port).startswith("127.0.0.1:"), (name, port)
    assert services["fleet-proxy"]["command"] == ["fleet"]
    assert services["control-proxy"]["command"] == ["control"]
    routes = (cf.DEPLOY / "fleet-proxy" / "fleet-routes.conf").read_text()
    assert "/v1/control" not in routes.split("location / {")[0].split("^/v1/fleet/")[1]


def test_every_superexec_and_its_api_share_a_secret_and_services_are_hardened() -> None:
    base = _compose_file("docker-compose.yml")
    services = base["services"]
    flag = "--superexec-auth-secret-file"

    def cmd(service: dict) -> str:
        return " ".join(map(str, service.get("entrypoint", []) + service.get("command", [])))

    assert f"{flag} /app/secrets/superexec" in cmd(services["superlink"])
    assert f"{flag} /app/secrets/superexec" in cmd(services["serverapp"])
    for i in range(1, cf.NUM_NODES + 1):
        assert f"{flag} /app/secrets/node-runtime" in cmd(services[f"supernode-{i}"])
        assert f"{flag} /app/secrets/node-runtime" in cmd(services[f"clientapp-{i}"])
        # a node never holds the SuperLink's secret
        assert all("superexec-secret" not in v for v in services[f"supernode-{i}"]["volumes"])
    for name, service in services.items():
        if service.get("restart") == "no":  # one-shot
            continue
        assert service.get("cap_drop") == ["ALL"], name
        assert service.get("read_only") is True, name
        assert service.get("security_opt") == ["no-new-privileges:true"], name
    auth = _compose_file("deploy/compose.auth.yml")["services"]
    assert [v.rsplit(":", 2)[1] for v in auth["supernode-register"]["volumes"]] == [
        "/app/certificates/ca.crt",
        "/app/pubkeys",
    ]


def test_gen_certs_writes_private_keys_0600_and_public_keys_apart(tmp_path: Path) -> None:
    if shutil.which("openssl") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("openssl and ssh-keygen make the certificates and keys")
    out = tmp_path / "certs"
    script = str(cf.DEPLOY / "gen-certs.sh")
    subprocess.run(
        ["bash", script, "-o", str(out), "-n", "2", "-u", str(os.getuid())],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    for private in ("ca.key", "server.key", "keys/node-1", "keys/node-2"):
        assert (out / private).stat().st_mode & 0o777 == 0o600, private
    assert sorted(p.name for p in (out / "keys").iterdir()) == ["node-1", "node-2"]
    assert sorted(p.name for p in (out / "pubkeys").iterdir()) == ["node-1.pub", "node-2.pub"]
    assert (out / "ca.crt").stat().st_mode & 0o777 == 0o644
