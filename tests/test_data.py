"""Tests for edgefleet.task.data: loaders, hold-outs, partitioners and local splits."""

from __future__ import annotations

import gzip
import pickle
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edgefleet.task import data
from edgefleet.task.data import (
    DATASETS,
    PARTITIONS,
    ArrayDataset,
    DataNotFoundError,
    dataset_info,
    load_dataset,
    partition_indices,
    split_local,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
FASHION_DEB = Path("/usr/share/datasets/fashion-mnist")

needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"shared data folder {SHARED} is missing"
)


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep the tests off ~/.cache and independent of the caller's environment."""
    cache = tmp_path_factory.mktemp("edgefleet-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGEFLEET_CACHE_DIR", str(cache))
        mp.delenv("EDGEFLEET_DATA_DIR", raising=False)
        yield cache


@pytest.fixture
def fresh_partitioners() -> Iterator[None]:
    """Force a new fit, so determinism is tested across fits and not through the cache."""
    data._PARTITIONERS.clear()
    yield
    data._PARTITIONERS.clear()


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


# --- dataset_info ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", DATASETS)
def test_dataset_info(name: str) -> None:
    info = dataset_info(name)
    assert info.name == name
    assert len(info.input_shape) == 3
    assert len(info.class_names) == info.num_classes >= 2


def test_dataset_info_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'") as err:
        dataset_info("imagenet")
    assert all(name in str(err.value) for name in DATASETS)
    with pytest.raises(ValueError, match="mnist-5k"):
        load_dataset("imagenet")


# --- built-in data sets -----------------------------------------------------------------------


def _check_loaded(name: str, train: ArrayDataset, test: ArrayDataset) -> None:
    info = dataset_info(name)
    for part in (train, test):
        assert part.x.dtype == np.float32 and part.y.dtype == np.int64
        assert part.x.shape == (len(part), *info.input_shape)
        assert part.y.min() >= 0 and part.y.max() < info.num_classes
    # Normalised with the per-dataset constants: roughly zero mean, unit variance.
    assert abs(float(train.x.mean())) < 0.1
    assert 0.8 < float(train.x.std()) < 1.2


def test_mnist_5k() -> None:
    train, test, info = load_dataset("mnist-5k")
    _check_loaded("mnist-5k", train, test)
    assert (len(train), len(test)) == (4000, 1000)
    assert info.input_shape == (1, 28, 28)
    # Stratified hold-out of 20 % of 500 images per class.
    assert np.bincount(test.y).tolist() == [100] * 10
    assert np.bincount(train.y).tolist() == [400] * 10
    train_images = {row.tobytes() for row in train.x}
    assert not any(row.tobytes() in train_images for row in test.x)
    assert load_dataset("mnist-5k") is load_dataset("mnist-5k")


def test_digits() -> None:
    train, test, info = load_dataset("digits")
    _check_loaded("digits", train, test)
    assert len(train) + len(test) == 1797
    assert info.input_shape == (1, 8, 8)
    per_class = np.bincount(train.y) + np.bincount(test.y)
    assert np.bincount(test.y).tolist() == [round(0.2 * c) for c in per_class]
    first = load_dataset("digits")
    assert first is load_dataset("digits")
    assert first[0] is train


def test_slim_install_without_torchvision(tmp_path: Path) -> None:
    _fake_pneumonia(tmp_path, 3)
    code = (
        "import sys; sys.modules['torchvision'] = None\n"
        "from edgefleet.task.data import load_dataset\n"
        "assert len(load_dataset('mnist-5k')[0]) == 4000\n"
        f"assert len(load_dataset('pneumonia', {str(tmp_path)!r})[1]) == 3\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


# --- search order, fake local files ---------------------------------------------------------


def _fake_pneumonia(folder: Path, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    images = np.random.default_rng(n).integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = (np.arange(n) % 2).astype(np.uint8)[:, None]
    np.savez(
        folder / "pneumoniamnist.npz",
        train_images=images,
        train_labels=labels,
        val_images=images,
        val_labels=labels,
        test_images=images,
        test_labels=labels,
    )


def test_search_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    _fake_pneumonia(tmp_path / "shared" / "data", 5)  # ../shared/data from the project
    assert len(load_dataset("pneumonia")[0]) == 5
    _fake_pneumonia(tmp_path / "env", 7)
    monkeypatch.setenv("EDGEFLEET_DATA_DIR", str(tmp_path / "env"))
    assert len(load_dataset("pneumonia")[0]) == 7
    assert len(load_dataset("pneumonia", str(tmp_path / "shared" / "data"))[0]) == 5


def _fake_cifar_tar(path: Path, per_class: int) -> None:
    from PIL import Image

    src = path.parent / "cifar-src"
    for split in ("train", "test"):
        for label, cls in enumerate(dataset_info("cifar10").class_names):
            (src / split / cls).mkdir(parents=True)
            for i in range(per_class):
                pixels = np.full((32, 32, 3), 20 * label + i, dtype=np.uint8)
                Image.fromarray(pixels).save(src / split / cls / f"{i:04d}.jpg", quality=95)
    with tarfile.open(path, "w:gz") as tar:
        for split in ("train", "test"):
            tar.add(src / split, arcname=split)


def test_cifar10_from_jpeg_tarball(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(cache))
    _fake_cifar_tar(tmp_path / "cifar10-jpg.tar.gz", per_class=2)
    train, test, _ = load_dataset("cifar10", str(tmp_path))
    assert train.x.shape == (20, 3, 32, 32) and test.x.shape == (20, 3, 32, 32)
    assert sorted(train.y.tolist()) == sorted(list(range(10)) * 2)
    # Decoded once into the cache; the extracted JPEGs are cleaned up.
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == ["cifar10-jpg.npz"]
    assert not any(p.is_dir() for p in cache.iterdir())
    # The .npz alone is enough afterwards.
    (tmp_path / "cifar10-jpg.tar.gz").unlink()
    again, _, _ = load_dataset("cifar10", str(tmp_path / "elsewhere"))
    np.testing.assert_array_equal(again.x, train.x)


# --- shared local copies ----------------------------------------------------------------------


@needs_shared
def test_pneumonia() -> None:
    train, test, info = load_dataset("pneumonia", str(SHARED))
    _check_loaded("pneumonia", train, test)
    assert (len(train), len(test)) == (4708, 624)  # val split left out
    assert np.bincount(test.y).tolist() == [234, 390]
    assert info.class_names == ("normal", "pneumonia")


@needs_shared
def test_bccd_holdout_grouped_by_source() -> None:
    train, test, _ = load_dataset("bccd", str(SHARED))
    _check_loaded("bccd", train, test)
    with np.load(SHARED / "bccd_cells_28.npz") as npz:
        y, source = npz["y"], npz["source"]
    train_idx, test_idx = data._group_holdout(source, data.HOLDOUT_FRACTION, data.HOLDOUT_SEED)
    np.testing.assert_array_equal(train.y, y[train_idx])
    np.testing.assert_array_equal(test.y, y[test_idx])
    assert not set(source[train_idx]) & set(source[test_idx])
    assert len(train) + len(test) == len(y)
    assert 0.15 < len(test) / len(y) < 0.25
    assert set(test.y.tolist()) == {0, 1, 2}


@needs_shared
def test_mnist_from_shared_gz(_session_cache: Path, tmp_path: Path) -> None:
    train, test, _ = load_dataset("mnist", str(SHARED))
    _check_loaded("mnist", train, test)
    assert (len(train), len(test)) == (60000, 10000)
    assert np.bincount(test.y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert (_session_cache / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file()


@needs_shared
def test_mnist_from_torchvision_layout(
    _session_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, _, _ = load_dataset("mnist", str(SHARED))  # fills <session cache>/MNIST/raw
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path))
    train, _, _ = load_dataset("mnist", str(_session_cache))
    np.testing.assert_array_equal(train.y, reference.y)
    assert not (tmp_path / "MNIST").exists(), "raw idx files should be read in place"


def _write_idx_gz(folder: Path, sizes: dict[str, int]) -> None:
    """Tiny idx files in the official format (big-endian magic, dims, uint8 payload)."""
    folder.mkdir(parents=True)
    for prefix, n in sizes.items():
        images = np.arange(n * 28 * 28, dtype=np.uint64).astype(np.uint8)
        header = np.array([0x803, n, 28, 28], dtype=">u4").tobytes()
        with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(header + images.tobytes())
        header = np.array([0x801, n], dtype=">u4").tobytes()
        with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(header + (np.arange(n) % 10).astype(np.uint8).tobytes())


def test_fashion_mnist_from_debian_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchvision")
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "_DEBIAN_FASHION_DIR", tmp_path / "deb")
    _write_idx_gz(tmp_path / "deb", {"train": 12, "t10k": 5})
    (tmp_path / "empty").mkdir()
    train, test, _ = load_dataset("fashion-mnist", str(tmp_path / "empty"))
    assert (len(train), len(test)) == (12, 5)
    assert train.y.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert (tmp_path / "cache" / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte").is_file()


@pytest.mark.skipif(not FASHION_DEB.is_dir(), reason="Debian's dataset-fashion-mnist missing")
def test_fashion_mnist_from_debian_package(tmp_path: Path) -> None:
    train, test, info = load_dataset("fashion-mnist", str(tmp_path))
    _check_loaded("fashion-mnist", train, test)
    assert (len(train), len(test)) == (60000, 10000)
    assert np.bincount(test.y).tolist() == [1000] * 10
    assert info.class_names[-1] == "ankle boot"


@needs_shared
@pytest.mark.slow  # first decode of 60k JPEGs: 20-50 s depending on machine load
def test_cifar10_from_shared_tarball() -> None:
    train, test, _ = load_dataset("cifar10", str(SHARED))
    _check_loaded("cifar10", train, test)
    assert (len(train), len(test)) == (50000, 10000)
    assert np.bincount(test.y).tolist() == [1000] * 10


# --- missing data -----------------------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    torchvision = pytest.importorskip("torchvision")

    def fail(self: object) -> None:
        raise RuntimeError("offline (test)")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", fail)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", fail)
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mnist", ["empty/MNIST/raw", "empty/mnist", "cache/MNIST/raw", "offline (test)"]),
        ("cifar10", ["empty/cifar10-jpg.tar.gz", "empty/cifar-10-batches-py", "go online"]),
        ("pneumonia", ["empty/pneumoniamnist.npz", "cache/pneumoniamnist.npz", "medmnist"]),
        ("bccd", ["empty/bccd_cells_28.npz", "cache/bccd_cells_28.npz"]),
        pytest.param(
            "fashion-mnist",
            ["empty/FashionMNIST/raw", "empty/fashion-mnist", str(FASHION_DEB), "apt-get"],
            marks=pytest.mark.skipif(FASHION_DEB.is_dir(), reason="package installed"),
        ),
    ],
)
def test_missing_data_lists_paths(offline: Path, name: str, expected: list[str]) -> None:
    with pytest.raises(DataNotFoundError) as err:
        load_dataset(name, str(offline / "empty"))
    message = str(err.value)
    for fragment in expected:
        fragment = str(offline / fragment) if "/" in fragment and fragment[0] != "/" else fragment
        assert fragment in message
    assert isinstance(err.value, FileNotFoundError)
    # Flower simulations ship exceptions between processes.
    assert str(pickle.loads(pickle.dumps(err.value))) == message


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
    labels: np.ndarray, scheme: str, fresh_partitioners: None
) -> None:
    first = partition_indices(labels, 5, 2, scheme, alpha=0.3, seed=11)
    assert first.dtype == np.int64
    assert np.all(np.diff(first) > 0), "indices must be sorted and unique"
    data._PARTITIONERS.clear()
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


# --- local split and ArrayDataset -------------------------------------------------------------


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


def test_array_dataset() -> None:
    ds = _toy(6)
    sub = ds.subset(np.array([4, 1]))
    assert len(sub) == 2 and sub.y.tolist() == [4, 1]
    with pytest.raises(ValueError, match="y has 5"):
        ArrayDataset(np.zeros((4, 1, 1, 1), np.float32), np.zeros(5, np.int64))
