"""The data cache's verified files: checked against their stamp before use, rebuilt from the
source when bad, refused by name when they cannot be rebuilt, built once when several
processes ask at the same time."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

import pytest

from edgefleet.task.cache import (
    CachedFile,
    CacheUnwritableError,
    DataCorruptError,
    load_or_build,
    verify_source,
)

ROOT = Path(__file__).resolve().parents[1]


def _read(f: BinaryIO) -> str:
    text = f.read().decode()
    if not text.startswith("v:"):
        raise ValueError(f"not a value file: {text[:10]!r}")
    return text


class Builder:
    def __init__(self, value: str = "v:" + "x" * 100) -> None:
        self.value, self.calls = value, 0

    def __call__(self, f: BinaryIO) -> None:
        self.calls += 1
        f.write(self.value.encode())


def _entry(tmp_path: Path, key: dict | None = None) -> CachedFile:
    return CachedFile(tmp_path / "cache" / "thing.bin", {"source": "a"} if key is None else key)


def test_built_once_then_read_from_disk(tmp_path: Path) -> None:
    build = Builder()
    assert load_or_build(_entry(tmp_path), _read, build, lock="t") == build.value
    assert load_or_build(_entry(tmp_path), _read, build, lock="t") == build.value
    assert build.calls == 1
    stamp = json.loads((tmp_path / "cache" / ".thing.bin.stamp.json").read_text())
    assert stamp["size"] == 102 and stamp["key"] == {"source": "a"}
    assert stamp["sha256"] == hashlib.sha256(build.value.encode()).hexdigest()


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(p.read_bytes()[:50]),  # truncated
        lambda p: p.write_bytes(p.read_bytes().replace(b"xxx", b"xyx", 1)),  # same size
        lambda p: p.with_name(".thing.bin.stamp.json").unlink(),  # interrupted before stamp
        lambda p: p.with_name(".thing.bin.stamp.json").write_text("{"),  # garbage stamp
    ],
    ids=["truncated", "flipped", "no-stamp", "bad-stamp"],
)
def test_a_bad_file_is_rebuilt(tmp_path: Path, damage, caplog: pytest.LogCaptureFixture) -> None:
    build = Builder()
    entry = _entry(tmp_path)
    load_or_build(entry, _read, build, lock="t")
    damage(entry.path)
    assert load_or_build(entry, _read, build, lock="t") == build.value
    assert build.calls == 2
    assert entry.path.read_text() == build.value
    assert f"{entry.path} is not usable" in caplog.text


def test_another_source_rebuilds(tmp_path: Path) -> None:
    load_or_build(_entry(tmp_path, {"source": "a"}), _read, Builder("v:old"), lock="t")
    new = Builder("v:new")
    assert load_or_build(_entry(tmp_path, {"source": "b"}), _read, new, lock="t") == "v:new"
    assert new.calls == 1


def test_a_stamp_that_matches_but_does_not_decode_is_rebuilt(tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    load_or_build(entry, lambda f: f.read(), Builder("garbage"), lock="t")
    assert load_or_build(entry, _read, Builder(), lock="t").startswith("v:")


def test_a_source_that_builds_garbage_is_named(tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    with pytest.raises(DataCorruptError, match=r"/data/src.gz is corrupt: thing.bin built"):
        load_or_build(entry, _read, Builder("garbage"), lock="t", source="/data/src.gz")
    assert not entry.path.exists() and not entry.stamp_path.exists()


def test_a_failing_build_leaves_nothing(tmp_path: Path) -> None:
    def fails(f: BinaryIO) -> None:
        f.write(b"v:half")
        raise DataCorruptError("/data/src.gz is truncated (test)")

    entry = _entry(tmp_path)
    with pytest.raises(DataCorruptError, match="truncated"):
        load_or_build(entry, _read, fails, lock="t")
    assert sorted(p.name for p in entry.path.parent.iterdir()) == [".t.lock"]


def test_stale_temporaries_are_cleared_on_build(tmp_path: Path) -> None:
    entry = _entry(tmp_path)
    entry.path.parent.mkdir(parents=True)
    stale = entry.path.with_name(".thing.bin.123.abc.tmp")  # from a builder killed mid-write
    stale.write_bytes(b"v:half")
    load_or_build(entry, _read, Builder(), lock="t")
    assert not stale.exists()


def test_without_a_source(tmp_path: Path) -> None:
    """``build=None``: an intact file is used, an unstamped one that decodes is adopted, a
    damaged one is removed and named, a missing one is FileNotFoundError."""
    load_or_build(_entry(tmp_path), _read, Builder(), lock="t")
    anything = _entry(tmp_path, key=None)
    assert load_or_build(anything, _read, None, lock="t").startswith("v:")
    anything.stamp_path.unlink()
    assert load_or_build(anything, _read, None, lock="t").startswith("v:")
    assert anything.stamp_path.is_file()  # adopted: decoded, then stamped
    anything.path.write_bytes(b"v:changed")
    with pytest.raises(DataCorruptError, match="how to get it") as err:
        load_or_build(anything, _read, None, lock="t", how="how to get it")
    assert f"cache file {anything.path} is corrupt" in str(err.value)
    assert not anything.path.exists() and not anything.stamp_path.exists()
    with pytest.raises(FileNotFoundError):
        load_or_build(anything, _read, None, lock="t")


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    """Simulated devices starting together: one builds, the others wait and read its file."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from edgefleet.task.cache import CachedFile, load_or_build\n"
        "def build(f):\n"
        "    with open(sys.argv[2], 'a') as log:\n"
        "        log.write('built\\n')\n"
        "    f.write(b'v:' + b'y' * 1000)\n"
        "    time.sleep(0.5)\n"
        "value = load_or_build(CachedFile(Path(sys.argv[1]), {'k': 1}), lambda f: f.read(),\n"
        "                      build, lock='race')\n"
        "print(len(value))\n"
    )
    entry, log = tmp_path / "cache" / "thing.bin", tmp_path / "builds.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(entry), str(log)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert outs == ["1002"] * 4
    assert log.read_text() == "built\n"


def test_the_lock_is_released_when_its_holder_dies(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from edgefleet.task.cache import cache_lock\n"
        "with cache_lock('dies', Path(sys.argv[1])):\n"
        "    os._exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, timeout=60)
    assert done.returncode == 3
    from filelock import FileLock

    with FileLock(str(tmp_path / ".dies.lock"), timeout=10):  # Timeout if still held
        pass


def test_verify_source_against_sha256sums(tmp_path: Path) -> None:
    folder = tmp_path / "shared" / "mnist"
    folder.mkdir(parents=True)
    good = folder / "train-images-idx3-ubyte.gz"
    good.write_bytes(b"the real thing")
    digest = hashlib.sha256(b"the real thing").hexdigest()
    sums = tmp_path / "shared" / "SHA256SUMS"
    sums.write_text(f"{digest}  mnist/train-images-idx3-ubyte.gz\n{'0' * 64}  other.npz\n")
    fid = verify_source(good)
    assert (fid.size, fid.sha256) == (14, digest)
    good.write_bytes(b"the real thin")  # truncated by one byte
    os.utime(good, ns=(1, 1))  # a new mtime as well: the identity is not taken from a memo
    with pytest.raises(DataCorruptError) as err:
        verify_source(good)
    assert str(good) in str(err.value) and str(sums) in str(err.value)
    assert "sha256sum -c SHA256SUMS" in str(err.value)
    unlisted = folder / "notes.txt"
    unlisted.write_text("anything")
    assert verify_source(unlisted).size == 8


def test_an_unusable_cache_folder_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    entry = CachedFile(tmp_path / "a-file" / "cache" / "thing.bin", {"source": "a"})
    with pytest.raises(CacheUnwritableError, match="set EDGEFLEET_CACHE_DIR") as err:
        load_or_build(entry, _read, Builder(), lock="t")
    assert str(tmp_path / "a-file" / "cache") in str(err.value)
    assert isinstance(err.value, OSError)  # where the cache is only a speed-up, work goes on
