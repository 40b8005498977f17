"""A device's own data (``--node-config data-path=...``) instead of a partition of the run's
data set: an ``.npz`` file or a folder of images, shaped and normalised like the run's data set.

Use :func:`load_local_data`. Everything wrong with the files (missing, truncated, a corrupt
image, labels that are fractional or outside the data set's classes, pixels outside its range)
raises :class:`LocalDataError` naming the file and the problem, which the ClientApp turns into
an error reply: the server counts the device as declined and logs why, and the device's
battery status still answers.
"""

from __future__ import annotations

import functools
import logging
import zipfile
import zlib
from pathlib import Path

import numpy as np

from edgefleet.task.datasets import ArrayDataset, DatasetInfo, dataset_info, normalise, pixel_max

log = logging.getLogger(__name__)

_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class LocalDataError(ValueError):
    """A device's ``data-path`` is missing, unreadable, empty or does not fit the run's data
    set; the message names the file and the problem."""


def load_local_data(path: str | Path, dataset: str) -> ArrayDataset:
    """A device's own data, shaped and normalised like the run's data set ``dataset`` so that
    the global model fits it.

    - an ``.npz`` file with ``x`` (N, H, W) or (N, H, W, C) raw pixels (0-255, or 0-16 for
      ``digits``) and ``y`` integer labels in [0, num_classes) (whole numbers stored as floats
      are accepted; fractions are not);
    - a folder in ImageFolder layout, ``<class>/<image>``: a class folder named like one of
      the data set's classes (``"3"``, ``"pneumonia"``, ``"Platelets"``) gets that class's
      label, otherwise folders are numbered in sorted order. Images are converted to the data
      set's channels (L or RGB) and resized to its size with Pillow (no torchvision).

    Cached per process like :func:`edgefleet.task.datasets.load_dataset`. Raises
    LocalDataError.
    """
    return _load_local_cached(str(Path(path).expanduser().resolve()), dataset)


@functools.lru_cache(maxsize=4)
def _load_local_cached(path: str, dataset: str) -> ArrayDataset:
    info = dataset_info(dataset)
    root = Path(path)
    if not root.exists():
        raise LocalDataError(
            f"data-path {root} is neither an .npz file nor a folder: it does not exist"
        )
    if root.is_file() and root.suffix == ".npz":
        x, y = _read_npz(root, info)
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
    data = ArrayDataset(normalise(dataset, x), y)
    log.info("loaded %d local samples from %s (as %s)", len(data), root, dataset)
    return data


def _read_npz(root: Path, info: DatasetInfo) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(root) as npz:  # allow_pickle=False: a data file never runs code
            if "x" not in npz or "y" not in npz:
                raise LocalDataError(
                    f"{root}: an .npz data-path needs arrays 'x' and 'y', it has "
                    f"{sorted(npz.files)}"
                )
            x, y = np.asarray(npz["x"]), np.asarray(npz["y"])
    except LocalDataError:
        raise
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as err:
        raise LocalDataError(f"{root} is truncated or not a valid .npz file ({err})") from err
    return _check_pixels(root, x, info), _integer_labels(root, y, len(x))


def _integer_labels(root: Path, y: np.ndarray, n: int) -> np.ndarray:
    """``y`` as int64 (N,), refusing what a cast would silently change (3.7 -> 3)."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]  # MedMNIST's (N, 1)
    if y.ndim != 1:
        raise LocalDataError(
            f"{root}: 'y' must hold one label per image, shape ({n},), got {y.shape}"
        )
    if np.issubdtype(y.dtype, np.integer):
        return y.astype(np.int64)
    if not np.issubdtype(y.dtype, np.floating):
        raise LocalDataError(f"{root}: labels must be integers, got dtype {y.dtype}")
    bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))
    if len(bad):
        raise LocalDataError(
            f"{root}: labels must be whole class numbers, but {len(bad)} are not "
            f"(e.g. y[{bad[0]}] = {y[bad[0]]})"
        )
    return y.astype(np.int64)


def _check_pixels(root: Path, x: np.ndarray, info: DatasetInfo) -> np.ndarray:
    """(N, H, W[, C]) raw pixels in range -> (N, H', W', C') with the data set's size and
    channels."""
    if x.ndim == 3:
        x = x[:, :, :, None]
    if x.ndim != 4:
        raise LocalDataError(f"{root}: images must be (N, H, W) or (N, H, W, C), got {x.shape}")
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise LocalDataError(f"{root}: pixels must be numbers, got dtype {x.dtype}")
    top = pixel_max(info.name)
    if x.size and not np.isfinite(x).all():
        raise LocalDataError(f"{root}: pixels must be finite, {np.sum(~np.isfinite(x))} are not")
    if x.size and (x.min() < 0 or x.max() > top):
        raise LocalDataError(
            f"{root}: pixels must be raw values in [0, {top:g}] for {info.name}, got "
            f"[{x.min()}, {x.max()}]"
        )
    if np.issubdtype(x.dtype, np.floating) and x.size and x.max() <= 1.0 < top:
        log.warning("%s: every pixel is in [0, 1]; raw values in [0, %g] were expected", root, top)
    return _fit_images(x, info)


def _fit_images(x: np.ndarray, info: DatasetInfo) -> np.ndarray:
    """(N, H, W, C) raw pixels -> (N, H', W', C') with the data set's size and channels."""
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
            try:
                with Image.open(file) as img:
                    resized = img.convert(mode).resize((width, height), Image.Resampling.BILINEAR)
            except (OSError, ValueError, Image.DecompressionBombError) as err:
                # PIL: unidentified format, truncated data, or an absurd size
                raise LocalDataError(f"{file} is not a readable image ({err})") from err
            images.append(np.asarray(resized).reshape(height, width, channels))
            targets.append(label)
    if not images:
        return np.empty((0, height, width, channels), np.uint8), np.empty(0, np.int64)
    return np.stack(images), np.asarray(targets, dtype=np.int64)
