"""The release a user installs: ``python -m build`` makes a wheel and an sdist; the wheel,
installed (not editable) into a virtual environment of its own, runs a tiny scenario,
serves the dashboard (its page is package data) and holds the Flower app's definition that
``edgefleet run`` on Flower's Simulation Engine copies.

The venv reuses the test venv's packages (torch, Flower: gigabytes) through a ``.pth`` line
and gets only the wheel itself, ``--no-deps``; everything runs from a temporary folder
with ``PYTHONPATH`` unset, so ``import edgefleet`` can only find the installed wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import socket
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

SCENARIO = """
[federation]
num-supernodes = 2

[run-config]
num-server-rounds = 2
dataset = "mnist-5k"
model = "smallcnn"
local-steps = 2
output-dir = "runs"
run-name = "tiny"
"""


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # From a copy of the tracked tree: building in place would leave build files behind.
    src = out / "src"
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel installed (not editable) and the test venv's packages visible."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    (site_dir,) = root.glob("lib/python*/site-packages")
    # Only the packages, not their .pth files: an editable edgefleet there stays unseen.
    (site_dir / "test-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    wheel = dist / f"edgefleet-{VERSION}-py3-none-any.whl"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install",
         "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _python(venv: Path, code: str, cwd: Path) -> str:
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_build_makes_a_wheel_with_the_package_data_and_an_sdist(dist: Path) -> None:
    wheel = dist / f"edgefleet-{VERSION}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("index.html", "dashboard.js", "vendor/uPlot.iife.min.js"):
        assert f"edgefleet/dashboard/static/{data}" in names
    assert "edgefleet/flower-app.toml" in names
    # Test-only code (fault injection, the deployment harness) stays out of the wheel.
    assert not {n for n in names if n.startswith("fleetharness/")}
    assert "edgefleet/client/faults.py" not in names
    sdist = dist / f"edgefleet-{VERSION}.tar.gz"
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "CHANGELOG.md", "edgefleet/cli.py"} <= members
    assert "examples/energy-fedsag/pyproject.toml" in members


def test_the_installed_wheel_is_what_imports(venv: Path, tmp_path: Path) -> None:
    out = _python(venv, "import edgefleet, importlib.metadata as m; "
                  "print(edgefleet.__file__); print(m.version('edgefleet'))", tmp_path)  # fmt: skip
    path, version = out.split()
    assert Path(path).is_relative_to(venv) and not Path(path).is_relative_to(ROOT)
    assert version == VERSION


def test_the_wheel_holds_the_flower_app_that_edgefleet_run_copies(
    venv: Path, tmp_path: Path
) -> None:
    """``edgefleet run`` on the Simulation Engine copies the Flower app (pyproject.toml and
    the package); an installed wheel has no project folder, so it ships the definition."""
    _python(venv, "from pathlib import Path; from edgefleet.simulation.engine import app_copy; "
            "app_copy(Path('app'))", tmp_path)  # fmt: skip
    app = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app["components"]["serverapp"] == "edgefleet.server.app:app"
    assert app["config"]["num-server-rounds"] == 5
    assert (tmp_path / "app" / "edgefleet" / "dashboard" / "static" / "index.html").is_file()


@pytest.fixture
def tiny_run(venv: Path, tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "tiny.toml").write_text(SCENARIO)
    proc = subprocess.run(
        [str(venv / "bin" / "edgefleet"), "run", "tiny.toml", "--engine", "inprocess",
         "--workers", "1", "--quiet"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    yield tmp_path / "runs" / "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_installed_wheel_runs_a_scenario_and_serves_its_dashboard(
    venv: Path, tiny_run: Path
) -> None:
    assert (tiny_run / "summary.json").is_file()
    assert len((tiny_run / "metrics.jsonl").read_text().splitlines()) == 2
    port = _free_port()
    server = subprocess.Popen(
        [str(venv / "bin" / "edgefleet"), "dashboard", str(tiny_run), "--port", str(port)],
        cwd=tiny_run.parent, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                page = urllib.request.urlopen(base + "/", timeout=5).read().decode()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    out = server.stdout.read().decode() if server.stdout else ""
                    pytest.fail(f"the dashboard did not answer (exit {server.poll()}):\n{out}")
                time.sleep(0.3)
        scripts = re.findall(r'src="(static/[^"]+)"', page)
        assert "static/dashboard.js" in scripts
        for script in scripts:  # package data, served from site-packages
            assert urllib.request.urlopen(f"{base}/{script}", timeout=5).status == 200
    finally:
        server.terminate()
        server.wait(timeout=30)
