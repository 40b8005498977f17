"""The one atomic writer: readers see the old file or the new one, never half of one."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from edgefleet.fileio import atomic_write, atomic_write_bytes, atomic_write_text, remove_stale_temps

ROOT = Path(__file__).resolve().parents[1]


def _temps(path: Path) -> list[Path]:
    return list(path.parent.glob(f".{path.name}.*.tmp"))


def test_creates_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "state.json"
    atomic_write_text(path, "one\n")
    assert path.read_text() == "one\n"
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two"
    atomic_write(path, lambda f: f.write(b"three"))
    assert path.read_bytes() == b"three"
    assert not _temps(path)


def test_a_failing_writer_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pkl"
    atomic_write_bytes(path, b"old and whole")

    def half_then_fail(f: object) -> None:
        f.write(b"new but ha")  # type: ignore[attr-defined]
        raise RuntimeError("disk full (test)")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old and whole"
    assert not _temps(path)


def test_a_crash_mid_write_leaves_the_old_file(tmp_path: Path) -> None:
    """A process killed in the middle of a write (no exception handler runs)."""
    path = tmp_path / "metrics.jsonl"
    atomic_write_text(path, '{"round": 1}\n')
    code = (
        "import os, sys\n"
        "from edgefleet.fileio import atomic_write\n"
        "def crash(f):\n"
        '    f.write(b\'{"round": 1}\\n{"rou\')\n'
        "    f.flush()\n"
        "    os._exit(9)\n"
        "atomic_write(sys.argv[1], crash)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, timeout=60)
    assert done.returncode == 9
    assert path.read_text() == '{"round": 1}\n'
    (leftover,) = _temps(path)  # the half-written temporary file, beside, hidden
    remove_stale_temps(path)
    assert not _temps(path) and path.read_text() == '{"round": 1}\n'
    assert not leftover.exists()


def test_files_are_readable_by_others_like_any_new_file(tmp_path: Path) -> None:
    # tempfile.mkstemp would create 0600 files: a shared data cache would lock others out.
    umask = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "cached.npz", b"x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "cached.npz").stat().st_mode) == 0o644


def test_an_atomic_write_refuses_a_link_in_place_of_its_target(tmp_path: Path) -> None:
    from edgefleet.fileio import NotARegularFile

    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep")
    link = tmp_path / "fleet.json"
    link.symlink_to(elsewhere)
    with pytest.raises(NotARegularFile, match="fleet.json is a symbolic link .*elsewhere.txt"):
        atomic_write_text(link, "{}")
    assert link.is_symlink() and elsewhere.read_text() == "keep" and not _temps(link)
    (tmp_path / "folder").mkdir()
    with pytest.raises(NotARegularFile, match="is a folder"):
        atomic_write_text(tmp_path / "folder", "{}")


def test_open_regular_truncates_only_a_regular_file(tmp_path: Path) -> None:
    from edgefleet.fileio import NotARegularFile, open_regular, read_regular

    path = tmp_path / "flower.log"
    path.write_text("old log")
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.close(fd)
    assert path.read_text() == ""
    with pytest.raises(NotARegularFile, match="is a folder"):
        read_regular(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "absent")
