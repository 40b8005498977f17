"""Tests for edgefleet.task.datasets and .sources: loaders, hold-outs, search order, and what
a truncated or corrupt source or cache file does (rebuilt from the source, or an error naming
the file)."""

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

from edgefleet.task import datasets, sources
from edgefleet.task.cache import DataCorruptError
from edgefleet.task.datasets import (
    DATASETS,
    ArrayDataset,
    DataNotFoundError,
    dataset_info,
    load_dataset,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
FASHION_DEB = Path("/usr/share/datasets/fashion-mnist")

needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"shared data folder {SHARED} is missing"
)


@pytest.fixture(autouse=True, scope="module")
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep the tests off ~/.cache and independent of the caller's environment."""
    cache = tmp_path_factory.mktemp("edgefleet-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGEFLEET_CACHE_DIR", str(cache))
        mp.delenv("EDGEFLEET_DATA_DIR", raising=False)
        yield cache


@pytest.fixture(autouse=True)
def _fresh_loads() -> Iterator[None]:
    """Each test reads its files anew (load_dataset keeps loads per process)."""
    datasets._load_cached.cache_clear()
    yield
    datasets._load_cached.cache_clear()


# --- dataset_info ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", DATASETS)
def test_dataset_info(name: str) -> None:
    info = dataset_info(name)
    assert info.name == name
    assert len(info.input_shape) == 3
    assert len(info.class_names) == info.num_classes >= 2


def test_every_data_set_has_a_loader() -> None:
    assert set(sources._FILE_LOADERS) == set(datasets.FILE_DATASETS)
    assert set(sources._FILE_LOADERS) | set(sources._BUILTIN_LOADERS) == set(DATASETS)


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
        "from edgefleet.task.datasets import load_dataset\n"
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
    train_idx, test_idx = sources._group_holdout(
        source, sources.HOLDOUT_FRACTION, sources.HOLDOUT_SEED
    )
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
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "_DEBIAN_FASHION_DIR", tmp_path / "deb")
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
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torchvision's downloads, failing as offline; the list of those tried."""
    torchvision = pytest.importorskip("torchvision")
    tried: list[str] = []

    def fail(self: object) -> None:
        tried.append(type(self).__name__)
        raise RuntimeError("offline (test)")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", fail)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", fail)
    return tried


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, downloads: list[str]) -> Path:
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mnist", ["empty/MNIST/raw", "empty/mnist", "cache/MNIST/raw", "t10k-labels-idx1"]),
        ("cifar10", ["empty/cifar10-jpg.tar.gz", "empty/cifar-10-batches-py"]),
        ("pneumonia", ["empty/pneumoniamnist.npz", "cache/pneumoniamnist.npz", "medmnist"]),
        ("bccd", ["empty/bccd_cells_28.npz", "cache/bccd_cells_28.npz"]),
        pytest.param(
            "fashion-mnist",
            ["empty/FashionMNIST/raw", "empty/fashion-mnist", str(FASHION_DEB), "apt-get"],
            marks=pytest.mark.skipif(FASHION_DEB.is_dir(), reason="package installed"),
        ),
    ],
)
def test_missing_data_lists_paths(
    offline: Path, downloads: list[str], name: str, expected: list[str]
) -> None:
    """With data-dir set, a missing copy is an error at once (no download tried) naming the
    data set, every place looked in, the files expected and the fix in the user's words."""
    with pytest.raises(DataNotFoundError) as err:
        load_dataset(name, str(offline / "empty"))
    message = str(err.value)
    assert downloads == []
    assert f"data set {name!r} not found" in message
    assert "Files expected:" in message and "--set data-dir=PATH" in message
    assert "data_dir" not in message  # the Python argument's name, not the user's key
    for fragment in expected:
        fragment = str(offline / fragment) if "/" in fragment and fragment[0] != "/" else fragment
        assert fragment in message
    assert isinstance(err.value, FileNotFoundError)
    # Flower simulations ship exceptions between processes.
    assert str(pickle.loads(pickle.dumps(err.value))) == message


@pytest.mark.parametrize(("name", "tv_class"), [("mnist", "MNIST"), ("cifar10", "CIFAR10")])
def test_without_data_dir_a_missing_copy_is_downloaded(
    offline: Path, downloads: list[str], monkeypatch: pytest.MonkeyPatch, name: str, tv_class: str
) -> None:
    """No data-dir: after the local places, torchvision is asked (here it fails offline) and
    its failure is in the message."""
    monkeypatch.chdir(offline / "empty")  # no ../shared/data from here
    with pytest.raises(DataNotFoundError) as err:
        load_dataset(name)
    assert downloads == [tv_class]
    assert "offline (test)" in str(err.value) and "go online" in str(err.value)


def test_no_download_without_torchvision(
    offline: Path, downloads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "torchvision" else find_spec(n, *a)
    )
    monkeypatch.chdir(offline / "empty")
    with pytest.raises(DataNotFoundError, match="pip install torchvision"):
        load_dataset("mnist")
    assert downloads == []


# --- truncated and corrupt files -------------------------------------------------------------


def _damage(path: Path, how: str, where: float = 0.5) -> bytes:
    """Truncate ``path`` at ``where`` of its length, or flip the byte there (same size);
    returns the old bytes."""
    data = path.read_bytes()
    at = int(len(data) * where)
    if how == "truncate":
        path.write_bytes(data[:at])
    else:
        flipped = bytearray(data)
        flipped[at] ^= 0xFF
        path.write_bytes(bytes(flipped))
    return data


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_cifar_cache_is_rebuilt_from_the_tarball(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(cache))
    _fake_cifar_tar(tmp_path / "cifar10-jpg.tar.gz", per_class=2)
    first, _, _ = load_dataset("cifar10", str(tmp_path))
    good = _damage(cache / "cifar10-jpg.npz", how)
    datasets._load_cached.cache_clear()
    again, _, _ = load_dataset("cifar10", str(tmp_path))
    np.testing.assert_array_equal(again.x, first.x)
    np.testing.assert_array_equal(again.y, first.y)
    assert (cache / "cifar10-jpg.npz").read_bytes() == good  # rebuilt, the same bytes
    assert "cifar10-jpg.npz is not usable" in caplog.text


def test_a_truncated_tarball_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    tar = tmp_path / "cifar10-jpg.tar.gz"
    _fake_cifar_tar(tar, per_class=2)
    _damage(tar, "truncate")
    with pytest.raises(DataCorruptError, match="truncated or corrupt") as err:
        load_dataset("cifar10", str(tmp_path))
    assert str(tar) in str(err.value) and "sha256sum -c SHA256SUMS" in str(err.value)
    assert not (tmp_path / "cache" / "cifar10-jpg.npz").exists()


def test_a_corrupt_jpeg_in_the_tarball_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src" / "test" / "cat"
    src.mkdir(parents=True)
    (src / "0000.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    tar = tmp_path / "cifar10-jpg.tar.gz"
    with tarfile.open(tar, "w:gz") as out:
        out.add(tmp_path / "src" / "test", arcname="train")
        out.add(tmp_path / "src" / "test", arcname="test")
    with pytest.raises(DataCorruptError, match=r"member train/cat/0000.jpg is not a readable"):
        load_dataset("cifar10", str(tmp_path))


def test_cifar_cache_without_its_tarball(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: Path
) -> None:
    """With the tarball gone, an intact cache file is still used, an unstamped one (an older
    EdgeFleet's) is used once it decodes, and a damaged one is refused by name and removed."""
    cache = offline / "cache"
    _fake_cifar_tar(tmp_path / "cifar10-jpg.tar.gz", per_class=1)
    first, _, _ = load_dataset("cifar10", str(tmp_path))
    (tmp_path / "cifar10-jpg.tar.gz").unlink()
    npz, stamp = cache / "cifar10-jpg.npz", cache / ".cifar10-jpg.npz.stamp.json"
    stamp.unlink()
    datasets._load_cached.cache_clear()
    np.testing.assert_array_equal(load_dataset("cifar10", str(tmp_path))[0].x, first.x)
    assert stamp.is_file()
    _damage(npz, "flip")
    datasets._load_cached.cache_clear()
    with pytest.raises(DataCorruptError) as err:
        load_dataset("cifar10", str(tmp_path))
    assert f"cache file {npz} is corrupt" in str(err.value)
    assert "cifar10-jpg.tar.gz" in str(err.value)  # how to get it back
    assert not npz.exists() and not stamp.exists()


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_unpacked_idx_file_is_unpacked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGEFLEET_CACHE_DIR", str(cache))
    _write_idx_gz(tmp_path / "data" / "mnist", {"train": 12, "t10k": 5})
    first, test, _ = load_dataset("mnist", str(tmp_path / "data"))
    assert (len(first), len(test)) == (12, 5)
    unpacked = cache / "MNIST" / "raw" / "train-images-idx3-ubyte"
    good = _damage(unpacked, how)
    datasets._load_cached.cache_clear()
    again, _, _ = load_dataset("mnist", str(tmp_path / "data"))
    np.testing.assert_array_equal(again.x, first.x)
    assert unpacked.read_bytes() == good


def test_a_damaged_unpacked_idx_file_with_no_source_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: Path
) -> None:
    _write_idx_gz(tmp_path / "data" / "mnist", {"train": 12, "t10k": 5})
    load_dataset("mnist", str(tmp_path / "data"))
    unpacked = offline / "cache" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    _damage(unpacked, "flip")
    datasets._load_cached.cache_clear()
    with pytest.raises(DataCorruptError) as err:
        load_dataset("mnist", str(offline / "empty"))  # the .gz copies are not searched
    assert f"cache file {unpacked} is corrupt" in str(err.value)
    assert "No download was tried: data-dir is set" in str(err.value)


def test_a_truncated_mnist_gz_is_named(offline: Path) -> None:
    _write_idx_gz(offline / "data" / "mnist", {"train": 12, "t10k": 5})
    bad = offline / "data" / "mnist" / "train-images-idx3-ubyte.gz"
    _damage(bad, "truncate")
    with pytest.raises(DataCorruptError) as err:
        load_dataset("mnist", str(offline / "data"))
    assert f"{bad} is truncated or corrupt" in str(err.value)
    assert not (offline / "cache" / "MNIST" / "raw" / "train-images-idx3-ubyte").exists()


def test_a_truncated_raw_idx_file_is_named(offline: Path) -> None:
    """Raw idx files are read in place: their header says how long they must be."""
    folder = offline / "data" / "MNIST" / "raw"
    _write_idx_gz(folder, {"train": 12, "t10k": 5})
    for gz in folder.glob("*.gz"):
        gz.with_suffix("").write_bytes(gzip.decompress(gz.read_bytes()))
        gz.unlink()
    _damage(folder / "t10k-images-idx3-ubyte", "truncate")
    with pytest.raises(DataCorruptError, match="truncated") as err:
        load_dataset("mnist", str(offline / "data"))
    assert str(folder / "t10k-images-idx3-ubyte") in str(err.value)


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_damaged_source_npz_is_named(tmp_path: Path, how: str) -> None:
    _fake_pneumonia(tmp_path, 6)
    path = tmp_path / "pneumoniamnist.npz"
    _damage(path, how, where=0.25)  # inside train_images (a damaged val split goes unread)
    with pytest.raises(DataCorruptError) as err:
        load_dataset("pneumonia", str(tmp_path))
    assert f"{path} is truncated or corrupt" in str(err.value)
    assert "shared data folder" in str(err.value)
    assert isinstance(err.value, ValueError)  # a ClientApp answers it with an error reply


def test_a_source_is_checked_against_sha256sums(tmp_path: Path) -> None:
    _fake_pneumonia(tmp_path, 6)
    (tmp_path / "SHA256SUMS").write_text("00" * 32 + "  pneumoniamnist.npz\n")
    with pytest.raises(DataCorruptError, match="SHA256SUMS") as err:
        load_dataset("pneumonia", str(tmp_path))
    assert str(tmp_path / "pneumoniamnist.npz") in str(err.value)
    import hashlib

    digest = hashlib.sha256((tmp_path / "pneumoniamnist.npz").read_bytes()).hexdigest()
    (tmp_path / "SHA256SUMS").write_text(f"{digest}  pneumoniamnist.npz\n")
    datasets._load_cached.cache_clear()
    assert len(load_dataset("pneumonia", str(tmp_path))[0]) == 6


def test_damaged_mnist_5k_cache_is_rebuilt(_session_cache: Path) -> None:
    first, test, _ = load_dataset("mnist-5k")
    entry = _session_cache / "mnist-5k.npz"
    assert entry.is_file() and (_session_cache / ".mnist-5k.npz.stamp.json").is_file()
    _damage(entry, "flip")
    datasets._load_cached.cache_clear()
    again, again_test, _ = load_dataset("mnist-5k")
    np.testing.assert_array_equal(again.x, first.x)
    np.testing.assert_array_equal(again_test.y, test.y)


@needs_shared
def test_idx_reader_matches_torchvision(_session_cache: Path) -> None:
    torchvision = pytest.importorskip("torchvision")
    train, test, _ = load_dataset("mnist", str(SHARED))  # unpacks into the session cache
    reference = torchvision.datasets.MNIST(str(_session_cache), train=False, download=False)
    want = datasets.normalise("mnist", reference.data.numpy())
    np.testing.assert_array_equal(test.x, want)
    np.testing.assert_array_equal(test.y, reference.targets.numpy())


# --- ArrayDataset ---------------------------------------------------------------------------


def _toy(n: int) -> ArrayDataset:
    x = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1)
    return ArrayDataset(x, np.arange(n, dtype=np.int64))


def test_array_dataset() -> None:
    ds = _toy(6)
    sub = ds.subset(np.array([4, 1]))
    assert len(sub) == 2 and sub.y.tolist() == [4, 1]
    with pytest.raises(ValueError, match="y has 5"):
        ArrayDataset(np.zeros((4, 1, 1, 1), np.float32), np.zeros(5, np.int64))


def test_official_validation_split_is_pneumonias_own_and_none_elsewhere() -> None:
    from edgefleet.task.datasets import load_validation

    assert load_validation("mnist-5k") is None
    if not (SHARED / "pneumoniamnist.npz").exists():
        pytest.skip(f"no {SHARED / 'pneumoniamnist.npz'} (CI has ../shared/data)")
    val = load_validation("pneumonia", str(SHARED))
    assert val is not None and len(val) == 524 and set(np.unique(val.y)) == {0, 1}
    train, test, _ = load_dataset("pneumonia", str(SHARED))
    assert len(train) == 4708 and len(test) == 624  # neither holds the validation images
