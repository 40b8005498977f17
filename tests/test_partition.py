"""Tests for edgefleet.task.partition: flwr-datasets partitions, the on-disk partition cache
(equal to fitting, keyed by everything that defines a fit), device groups and local splits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from edgefleet.task import partition
from edgefleet.task.datasets import ArrayDataset, load_dataset
from edgefleet.task.partition import (
    PARTITION_CACHE_FOLDER,
    PARTITIONS,
    group_partition_indices,
    partition_indices,
    split_local,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _module_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep the tests off ~/.cache and independent of the caller's environment."""
    cache = tmp_path_factory.mktemp("edgefleet-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGEFLEET_CACHE_DIR", str(cache))
        mp.delenv("EDGEFLEET_DATA_DIR", raising=False)
        yield cache


@pytest.fixture
def fresh_partitioners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[], None]]:
    """Force a new fit, so determinism is tested across fits and not through a cache: no fit
    in memory and an empty disk cache. Calling the fixture's value forces another."""
    count = iter(range(1000))

    def refit() -> None:
        partition._PARTITIONS.clear()
        monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / f"cache{next(count)}"))

    refit()
    yield refit
    partition._PARTITIONS.clear()


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return load_dataset("mnist-5k")[0].y


def _all_partitions(y: np.ndarray, n: int, scheme: str, **kwargs: float) -> list[np.ndarray]:
    return [partition_indices(y, n, i, scheme, **kwargs) for i in range(n)]  # type: ignore[arg-type]


def _assert_disjoint(parts: list[np.ndarray]) -> np.ndarray:
    union = np.concatenate(parts)
    assert len(np.unique(union)) == len(union), "partitions overlap"
    return union


def _max_class_share(y: np.ndarray, idx: np.ndarray) -> float:
    return float(np.bincount(y[idx]).max() / len(idx))


# --- partitioning -----------------------------------------------------------------------------


def test_iid_balanced_and_covering(labels: np.ndarray) -> None:
    parts = _all_partitions(labels, 7, "iid")
    assert {len(p) for p in parts} == {571, 572}
    assert np.array_equal(np.sort(_assert_disjoint(parts)), np.arange(len(labels)))
    # Random, not contiguous blocks of the (label-sorted) source file.
    assert max(_max_class_share(labels, p) for p in parts) < 0.2


def test_dirichlet_small_alpha_is_skewed(labels: np.ndarray) -> None:
    parts = _all_partitions(labels, 10, "dirichlet", alpha=0.05)
    assert np.array_equal(np.sort(_assert_disjoint(parts)), np.arange(len(labels)))
    assert min(len(p) for p in parts) >= 10  # the chosen min_partition_size
    assert np.mean([_max_class_share(labels, p) for p in parts]) > 0.5


def test_dirichlet_large_alpha_is_near_uniform(labels: np.ndarray) -> None:
    parts = _all_partitions(labels, 10, "dirichlet", alpha=1000.0)
    assert np.array_equal(np.sort(_assert_disjoint(parts)), np.arange(len(labels)))
    assert max(_max_class_share(labels, p) for p in parts) < 0.15
    assert all(340 <= len(p) <= 460 for p in parts)


def test_dirichlet_extreme_settings_terminate(caplog: pytest.LogCaptureFixture) -> None:
    y = np.arange(40) % 4
    parts = _all_partitions(y, 20, "dirichlet", alpha=0.01)
    assert np.array_equal(np.sort(_assert_disjoint(parts)), np.arange(40))
    assert "min_partition_size" in caplog.text  # relaxed, and said so


def test_shards_one_or_two_classes_each(labels: np.ndarray) -> None:
    # 4000 samples, 400 per class, 20 shards of 200: every shard is a single class.
    parts = _all_partitions(labels, 10, "shards", shards_per_partition=2)
    assert all(len(np.unique(labels[p])) <= 2 for p in parts)
    assert np.array_equal(np.sort(_assert_disjoint(parts)), np.arange(len(labels)))


def test_shards_drop_the_remainder(labels: np.ndarray) -> None:
    parts = _all_partitions(labels, 7, "shards", shards_per_partition=3)
    shard_size = len(labels) // 21
    assert all(len(p) == 3 * shard_size for p in parts)
    assert len(_assert_disjoint(parts)) == 21 * shard_size
    # A shard straddles at most two classes, so at most 2k classes per partition.
    assert all(len(np.unique(labels[p])) <= 6 for p in parts)
    assert np.mean([len(np.unique(labels[p])) for p in parts]) <= 4.5


@pytest.mark.parametrize("scheme", PARTITIONS)
def test_partitions_are_deterministic_in_seed(
    labels: np.ndarray, scheme: str, fresh_partitioners: Callable[[], None]
) -> None:
    first = partition_indices(labels, 5, 2, scheme, alpha=0.3, seed=11)
    assert first.dtype == np.int64
    assert np.all(np.diff(first) > 0), "indices must be sorted and unique"
    fresh_partitioners()
    np.testing.assert_array_equal(
        partition_indices(labels, 5, 2, scheme, alpha=0.3, seed=11), first
    )
    other = partition_indices(labels, 5, 2, scheme, alpha=0.3, seed=12)
    assert not np.array_equal(other, first)


def test_partition_accepts_numpy_integers(labels: np.ndarray) -> None:
    n, i = np.int64(4), np.int64(1)  # e.g. read from a numpy config array
    idx = partition_indices(labels, n, i, "shards", shards_per_partition=2)  # type: ignore[arg-type]
    np.testing.assert_array_equal(idx, partition_indices(labels, 4, 1, "shards"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_partitions": 0, "partition_id": 0}, "num_partitions must be >= 1"),
        ({"partition_id": -1}, r"partition_id must be in \[0, 4\)"),
        ({"partition_id": 4}, r"partition_id must be in \[0, 4\)"),
        ({"num_partitions": 11, "partition_id": 0}, "more devices than samples"),
        ({"scheme": "pathological"}, "valid choices: iid, dirichlet, shards"),
        ({"scheme": "dirichlet", "alpha": 0.0}, "alpha must be"),
        ({"scheme": "dirichlet", "alpha": -1.0}, "alpha must be"),
        ({"scheme": "dirichlet", "alpha": float("nan")}, "alpha must be"),
        ({"scheme": "shards", "shards_per_partition": 0}, "shards_per_partition must be >= 1"),
        ({"scheme": "shards", "shards_per_partition": 3}, "too few samples for shards"),
        ({"labels": np.zeros((10, 2), dtype=np.int64)}, "1-D integer array"),
        ({"labels": np.zeros(10)}, "1-D integer array"),
    ],
)
def test_partition_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "labels": np.arange(10) % 3,
        "num_partitions": 4,
        "partition_id": 1,
        "scheme": "iid",
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        partition_indices(**args)  # type: ignore[arg-type]


# --- local split ---------------------------------------------------------------------------------


def _toy(n: int) -> ArrayDataset:
    x = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1)
    return ArrayDataset(x, np.arange(n, dtype=np.int64))


def test_split_local_deterministic_and_disjoint() -> None:
    train, test = split_local(_toy(50), 0.2, seed=3)
    assert (len(train), len(test)) == (40, 10)
    assert not set(train.y.tolist()) & set(test.y.tolist())
    assert sorted(train.y.tolist() + test.y.tolist()) == list(range(50))
    again, _ = split_local(_toy(50), 0.2, seed=3)
    np.testing.assert_array_equal(again.y, train.y)
    other, _ = split_local(_toy(50), 0.2, seed=4)
    assert not np.array_equal(other.y, train.y)
    np.testing.assert_array_equal(train.x.ravel(), train.y)  # x and y stay aligned


def test_split_local_edge_cases() -> None:
    assert [len(p) for p in split_local(_toy(1), 0.5, 0)] == [1, 0]
    assert [len(p) for p in split_local(_toy(3), 0.9, 0)] == [1, 2]
    assert [len(p) for p in split_local(_toy(5), 0.0, 0)] == [5, 0]
    assert [len(p) for p in split_local(_toy(0), 0.2, 0)] == [0, 0]
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="test_fraction"):
            split_local(_toy(5), bad, 0)


# --- the on-disk partition cache --------------------------------------------------------------


def _fit_directly(y: np.ndarray, n: int, scheme: str, alpha: float, shards: int, seed: int):
    """Every partition as flwr-datasets gives it, with no cache in between."""
    partitioner = partition._fit(y, n, scheme, alpha, shards, seed)
    return [np.sort(partitioner.load_partition(i).with_format("numpy")[:]["idx"]) for i in range(n)]


def _cache_files(cache: Path) -> set[str]:
    folder = cache / PARTITION_CACHE_FOLDER
    return {p.name for p in folder.glob("*.npz")} if folder.is_dir() else set()


def _no_fit(*args: object, **kwargs: object) -> None:
    raise AssertionError("fitted although the partition cache holds this fit")


@pytest.mark.parametrize(
    ("scheme", "kwargs"),
    [("iid", {}), ("dirichlet", {"alpha": 0.3}), ("shards", {"shards_per_partition": 3})],
)
def test_cached_partitions_equal_fitting(
    labels: np.ndarray,
    scheme: str,
    kwargs: dict[str, float],
    fresh_partitioners: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = Path(os.environ["EDGEFLEET_CACHE_DIR"])
    first = _all_partitions(labels, 6, scheme, seed=5, **kwargs)  # fits, writes the file
    assert len(_cache_files(cache)) == 1
    partition._PARTITIONS.clear()  # a new process: nothing in memory
    with monkeypatch.context() as mp:
        mp.setattr(partition, "_fit", _no_fit)
        from_disk = _all_partitions(labels, 6, scheme, seed=5, **kwargs)
    alpha, shards = kwargs.get("alpha", 0.5), int(kwargs.get("shards_per_partition", 2))
    direct = _fit_directly(labels, 6, scheme, alpha, shards, 5)
    for got, disk, want in zip(first, from_disk, direct, strict=True):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(disk, want)
        assert disk.dtype == np.int64


def test_cached_group_partitions_equal_fitting(
    labels: np.ndarray, fresh_partitioners: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = (labels, 6)
    first = [group_partition_indices(*args, i, 2, 0.2, 0.5, seed=3) for i in range(6)]
    partition._PARTITIONS.clear()
    with monkeypatch.context() as mp:
        mp.setattr(partition, "_fit", _no_fit)
        again = [group_partition_indices(*args, i, 2, 0.2, 0.5, seed=3) for i in range(6)]
    fresh_partitioners()  # an empty cache: fitted again from nothing
    fitted = [group_partition_indices(*args, i, 2, 0.2, 0.5, seed=3) for i in range(6)]
    for a, b, c in zip(first, again, fitted, strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)


def test_every_defining_parameter_makes_its_own_entry(
    fresh_partitioners: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Path(os.environ["EDGEFLEET_CACHE_DIR"])
    y = np.arange(200) % 5
    changed = y.copy()
    changed[17] = (changed[17] + 1) % 5  # the same data set but one label

    def entries_after(call: Callable[[], object]) -> set[str]:
        before = _cache_files(cache)
        call()
        return _cache_files(cache) - before

    base = {"num_partitions": 4, "partition_id": 0, "alpha": 0.5, "seed": 1}
    assert len(entries_after(lambda: partition_indices(y, scheme="dirichlet", **base))) == 1
    variants: dict[str, Callable[[], object]] = {
        "labels": lambda: partition_indices(changed, scheme="dirichlet", **base),
        "labels order": lambda: partition_indices(y[::-1].copy(), scheme="dirichlet", **base),
        "num_partitions": lambda: partition_indices(
            y, scheme="dirichlet", **{**base, "num_partitions": 5}
        ),
        "alpha": lambda: partition_indices(y, scheme="dirichlet", **{**base, "alpha": 0.6}),
        "seed": lambda: partition_indices(y, scheme="dirichlet", **{**base, "seed": 2}),
        "scheme": lambda: partition_indices(y, scheme="iid", **base),
        "shards": lambda: partition_indices(y, scheme="shards", shards_per_partition=2, **base),
        "shards per partition": lambda: partition_indices(
            y, scheme="shards", shards_per_partition=3, **base
        ),
        "group overlap": lambda: group_partition_indices(y, 4, 0, 2, 0.0, 0.5, seed=1),
        "group overlap 2": lambda: group_partition_indices(y, 4, 0, 2, 0.4, 0.5, seed=1),
        "groups": lambda: group_partition_indices(y, 6, 0, 3, 0.0, 0.5, seed=1),
        "group seed": lambda: group_partition_indices(y, 4, 0, 2, 0.0, 0.5, seed=2),
    }
    for what, call in variants.items():
        assert len(entries_after(call)) == 1, f"changing {what} did not make a new entry"
    # Code and library versions are part of the key: a change of either refits.
    with monkeypatch.context() as mp:
        mp.setattr(partition, "_CODE_DIGEST", "other-code")
        assert len(entries_after(lambda: partition_indices(y, scheme="dirichlet", **base))) == 1
        versions = {**partition._library_versions(), "flwr-datasets": "0.0.0"}
        mp.setattr(partition, "_library_versions", lambda: versions)
        assert len(entries_after(lambda: partition_indices(y, scheme="dirichlet", **base))) == 1
    # What does not define a partition does not split the cache: alpha is no iid parameter,
    # and all partition ids of a fit share one entry.
    fresh_partitioners()
    cache = Path(os.environ["EDGEFLEET_CACHE_DIR"])
    assert len(entries_after(lambda: partition_indices(y, 4, 0, "iid", alpha=0.5))) == 1
    assert not entries_after(lambda: partition_indices(y, 4, 0, "iid", alpha=0.9))
    partition._PARTITIONS.clear()
    assert not entries_after(lambda: partition_indices(y, 4, 3, "iid"))
    stamps = list((cache / PARTITION_CACHE_FOLDER).glob(".*.stamp.json"))
    key = json.loads(stamps[0].read_text())["key"]
    assert key["scheme"] == "iid" and key["labels"]["n"] == 200 and key["seed"] == 0


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_partition_file_is_refitted(
    labels: np.ndarray,
    damage: str,
    fresh_partitioners: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = Path(os.environ["EDGEFLEET_CACHE_DIR"])
    want = _all_partitions(labels, 5, "dirichlet", alpha=0.5)
    (name,) = _cache_files(cache)
    path = cache / PARTITION_CACHE_FOLDER / name
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2 :]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    partition._PARTITIONS.clear()
    got = _all_partitions(labels, 5, "dirichlet", alpha=0.5)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert "not usable" in caplog.text and name in caplog.text
    assert path.read_bytes() != bytes(data)  # rewritten whole


def test_an_unwritable_cache_fits_in_memory(
    labels: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    partition._PARTITIONS.clear()
    idx = partition_indices(labels, 4, 1, "iid", seed=9)
    partition._PARTITIONS.clear()
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / "ok"))
    np.testing.assert_array_equal(idx, partition_indices(labels, 4, 1, "iid", seed=9))


def test_a_cached_partition_needs_no_datasets_import(tmp_path: Path) -> None:
    """The point of the cache: a device build on a warm machine skips datasets and
    flwr-datasets (seconds of imports per simulated device)."""
    code = (
        "import sys\n"
        "from edgefleet.task.datasets import load_dataset\n"
        "from edgefleet.task.partition import partition_indices\n"
        "y = load_dataset('mnist-5k')[0].y\n"
        "idx = partition_indices(y, 10, 3, 'dirichlet', alpha=0.5)\n"
        "print(len(idx), 'datasets' in sys.modules, 'flwr_datasets' in sys.modules)\n"
    )
    env = {**os.environ, "EDGEFLEET_CACHE_DIR": str(tmp_path)}

    def run() -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=ROOT,
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        )
        return out.stdout.split()

    cold, warm = run(), run()
    assert cold[1:] == ["True", "True"]  # fitted: the partitioner was imported
    assert warm == [cold[0], "False", "False"]
