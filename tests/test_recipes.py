"""Recipes that cannot rot: the shell blocks in the tutorials marked ``<!-- tested -->`` run
here as a user would type them (in a fresh folder beside the project's scenarios, with a
HOME of their own, bounded in time, removed afterwards), and every page's deployment
commands keep the rules that once broke clean machines: Flower's home outside the project,
per-run dependency installation off on the SuperLink, ``mkdir -p ~/.flwr`` before its config.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
MARK = "<!-- tested -->"
# Every page a user copies commands from: the site and the edge guide it includes.
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "deploy" / "EDGE.md"]


def marked_blocks(text: str) -> list[str]:
    """The ```bash blocks that directly follow a ``<!-- tested -->`` line."""
    return re.findall(re.escape(MARK) + r"\n```bash\n(.*?)\n```", text, flags=re.S)


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_marker_finds_marked_blocks_only() -> None:
    text = f"```bash\nnot me\n```\n{MARK}\n```bash\necho me\n```\n"
    assert marked_blocks(text) == ["echo me"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "page",
    [p for p in TUTORIALS if marked_blocks(p.read_text())],
    ids=lambda p: p.name,
)
def test_tested_blocks_run(page: Path, tmp_path: Path) -> None:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    # The recipes are typed from the project root: its scenarios, not its run folders.
    (work / "scenarios").symlink_to(ROOT / "scenarios")
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(home),
        "USER": os.environ.get("USER", "user"),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    script = "set -euo pipefail\n" + "\n".join(marked_blocks(page.read_text())) + "\n"
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
    )
    assert proc.returncode == 0, f"{page.name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_deployment_commands_keep_the_rules(page: Path) -> None:
    for block in bash_blocks(page.read_text()):
        # A Flower home inside the project is packed into every app bundle (FAB).
        assert not re.search(r"FLWR_HOME=(\$PWD|\$\(pwd\)|\.)", block), page
        # `cat >> ~/.flwr/config.toml` fails where ~/.flwr does not exist yet.
        if re.search(r">>?\s*~/\.flwr/", block):
            assert "mkdir -p ~/.flwr" in block, page
        # The SuperLink runs `uv sync` per run unless told not to.
        for command in re.split(r"\n(?![ \t])", block):
            if command.lstrip().startswith("flower-superlink"):
                assert "--disable-runtime-dependency-installation" in command, (page, command)
