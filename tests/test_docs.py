"""The documentation site's generated pages and the README's promises.

The reference and benchmark pages that ``docs/gen.py`` writes from the code and from
``benchmarks/results/`` must equal a fresh generation (a new key, option or results file
shows up there or fails here); the strict MkDocs build itself runs in ``make test``. The
README stays a short entry point that keeps the two commands CI and users rely on."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "docs" / "gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_gen"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_pages_equal_a_fresh_generation() -> None:
    stale = [
        name
        for name, text in _gen().generate().items()
        if not (ROOT / "docs" / name).exists() or (ROOT / "docs" / name).read_text() != text
    ]
    assert not stale, f"run `python docs/gen.py`: {stale} differ from a fresh generation"


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def test_every_generated_page_is_in_the_nav() -> None:
    text = (ROOT / "mkdocs.yml").read_text()
    # The mermaid fence's `!!python/name:` tag needs PyYAML's unsafe loader; the nav does not.
    nav = yaml.safe_load(text[text.index("\nnav:") :])["nav"]
    pages = _nav_pages(nav)
    for name in _gen().PAGES:
        assert name in pages, name


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    # .ci/run and users type these exactly.
    assert "make demo" in readme and "make test" in readme
    # No lab notebook in the entry point: dates and commits live in the benchmark pages.
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme)
    assert "commit " not in readme
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).exists(), link
