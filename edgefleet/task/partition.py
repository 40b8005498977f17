"""How a data set is divided: among devices (:func:`partition_indices`, and
:func:`group_partition_indices` for the sessions scenario's device groups) and, on each device,
into local train and test parts (:func:`split_local`).

Partitions come from flwr-datasets' partitioners, fitted on the labels. A fit is kept on disk
(``<cache>/partitions/``, see :mod:`edgefleet.task.cache`) under a key of everything that
defines it: the labels' length and sha256 (which fix the data set as the partitioner sees it,
including the order its source file gave), the scheme and its parameters, the number of
partitions, the seed, the sha256 of this module's source and the versions of numpy, datasets
and flwr-datasets. So on a machine that has run a configuration before, a device's first
build reads one small file and never imports datasets or flwr-datasets (several seconds per
simulated device). The file holds every partition of the fit, written by the first process
that fits it while the others wait; the indices are exactly those of fitting in memory. Where
the cache cannot be written, the fit happens in memory as before.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from edgefleet.settings import (
    anything,
    at_least,
    choice,
    half_open_fraction,
    positive,
    setting,
)
from edgefleet.task.cache import CachedFile, cache_dir, key_digest, load_or_build
from edgefleet.task.datasets import DATASETS, ArrayDataset, check_choice

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner

log = logging.getLogger(__name__)


class Partition(StrEnum):
    """How the data is split over devices (``partition``)."""

    IID = "iid"
    DIRICHLET = "dirichlet"
    SHARDS = "shards"


PARTITIONS: tuple[str, ...] = tuple(m.value for m in Partition)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = setting(
        "dataset", "mnist-5k", choice(DATASETS), " ".join(f"`{d}`" for d in DATASETS)
    )
    data_dir: str = setting(
        "data-dir", "", anything, "where local copies are looked for (see Data)"
    )
    partition: str = setting(
        "partition",
        "dirichlet",
        choice(PARTITIONS),
        "`iid`, `dirichlet` (with `alpha`), `shards` (with `shards-per-device`)",
    )
    alpha: float = setting("alpha", 0.5, positive, "Dirichlet concentration (small = skewed)")
    shards_per_device: int = setting(
        "shards-per-device", 2, at_least(1), "label shards per device for `shards`"
    )
    local_test_fraction: float = setting(
        "local-test-fraction",
        0.2,
        half_open_fraction,
        "share of each device's data kept for local evaluation",
    )


PARTITION_CACHE_FOLDER = "partitions"
_FORMAT = 1
# Bounded: a sweep over many seeds must not keep every fit alive.
_MEMORY_CACHE_SIZE = 32
_PARTITIONS: dict[str, list[np.ndarray]] = {}


def _source_digest() -> str:
    try:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    except OSError:  # e.g. imported from a zip: no file to hash, so never reuse a fit
        return "unknown"


_CODE_DIGEST = _source_digest()


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

    Schemes (flwr-datasets partitioners, fitted once per machine and argument set):

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
    parts = _all_partitions(
        y, int(num_partitions), scheme, float(alpha), int(shards_per_partition), int(seed)
    )
    return parts[int(partition_id)].copy()


def partition_key(
    labels: np.ndarray, num_partitions: int, scheme: str, alpha: float, shards: int, seed: int
) -> dict[str, Any]:
    """Everything that defines a fit; two fits with equal keys give equal partitions."""
    params = {"iid": {}, "dirichlet": {"alpha": alpha}, "shards": {"shards": shards}}[scheme]
    y = np.ascontiguousarray(labels, dtype="<i8")
    return {
        "format": _FORMAT,
        "labels": {"n": len(y), "sha256": hashlib.sha256(y.tobytes()).hexdigest()},
        "scheme": scheme,
        "params": params,
        "num_partitions": num_partitions,
        "seed": seed,
        "code": _CODE_DIGEST,
        "libraries": _library_versions(),
    }


@cache
def _library_versions() -> dict[str, str]:
    # Read from the installed metadata: importing datasets just to ask costs seconds.
    out = {"numpy": np.__version__}
    for dist in ("datasets", "flwr-datasets"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


def _check_labels(labels: np.ndarray) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got shape {y.shape} {y.dtype}")
    return y


def _check_partition_args(
    n: int, num_partitions: int, partition_id: int, scheme: str, alpha: float, shards: int
) -> None:
    check_choice(scheme, PARTITIONS, "partition scheme")
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition_id must be in [0, {num_partitions}), got {partition_id} "
            f"(num_partitions={num_partitions})"
        )
    if num_partitions > n:
        raise ValueError(f"more devices than samples: num_partitions={num_partitions} > {n}")
    if scheme == Partition.DIRICHLET and not (np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha}")
    if scheme == Partition.SHARDS:
        if shards < 1:
            raise ValueError(f"shards_per_partition must be >= 1, got {shards}")
        if num_partitions * shards > n:
            # flwr-datasets would compute a shard size of 0 and divide by zero.
            raise ValueError(
                f"too few samples for shards: num_partitions * shards_per_partition = "
                f"{num_partitions * shards} > {n} samples"
            )


# --- the fit, in memory and on disk -----------------------------------------------------------


def _all_partitions(
    labels: np.ndarray, num_partitions: int, scheme: str, alpha: float, shards: int, seed: int
) -> list[np.ndarray]:
    """Every partition of one fit: from this process's memory, the disk cache, or a fit."""
    key = partition_key(labels, num_partitions, scheme, alpha, shards, seed)
    digest = key_digest(key)
    if digest in _PARTITIONS:
        return _PARTITIONS[digest]

    def fit() -> list[np.ndarray]:
        return _fit_all(labels, num_partitions, scheme, alpha, shards, seed)

    entry = CachedFile(cache_dir() / PARTITION_CACHE_FOLDER / f"{digest}.npz", key)
    try:
        parts = load_or_build(
            entry,
            lambda f: _read_partitions(f, len(labels), num_partitions),
            lambda f: _write_partitions(f, fit()),
            lock=digest,
        )
    except OSError as err:  # a read-only or full cache: only a speed-up, so fit in memory
        log.warning("partition cache %s not usable (%s); fitting in memory", entry.path, err)
        parts = fit()
    if len(_PARTITIONS) >= _MEMORY_CACHE_SIZE:
        _PARTITIONS.pop(next(iter(_PARTITIONS)))
    _PARTITIONS[digest] = parts
    return parts


def _write_partitions(f: BinaryIO, parts: list[np.ndarray]) -> None:
    offsets = np.cumsum([0] + [len(p) for p in parts], dtype=np.int64)
    indices = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
    np.savez(f, offsets=offsets, indices=indices)


def _read_partitions(f: BinaryIO, n_labels: int, num_partitions: int) -> list[np.ndarray]:
    with np.load(f) as npz:
        offsets, indices = npz["offsets"], npz["indices"]
    ok = (
        offsets.shape == (num_partitions + 1,)
        and indices.ndim == 1
        and np.issubdtype(indices.dtype, np.integer)
        and offsets[0] == 0
        and offsets[-1] == len(indices)
        and bool(np.all(np.diff(offsets) >= 0))
        and (len(indices) == 0 or (indices.min() >= 0 and indices.max() < n_labels))
    )
    if not ok:
        raise ValueError(f"not a partition file for {num_partitions} partitions of {n_labels}")
    parts = np.split(indices.astype(np.int64), offsets[1:-1])
    if not all(bool(np.all(np.diff(p) > 0)) for p in parts):
        raise ValueError("partition indices are not sorted and unique")
    return parts


def _fit_all(
    labels: np.ndarray, num_partitions: int, scheme: str, alpha: float, shards: int, seed: int
) -> list[np.ndarray]:
    partitioner = _fit(labels, num_partitions, scheme, alpha, shards, seed)
    parts = []
    with _quiet_partitioning():
        for i in range(num_partitions):
            part = partitioner.load_partition(i)
            # One Arrow column read; indexing the Dataset by name would go row by row.
            parts.append(np.sort(np.asarray(part.with_format("arrow")["idx"], dtype=np.int64)))
    return parts


@contextmanager
def _quiet_partitioning() -> Iterator[None]:
    # Dirichlet re-sampling warns on every retry, and datasets' sort triggers a pyarrow
    # deprecation warning; neither is actionable for callers.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The specified min_partition_size")
        warnings.filterwarnings("ignore", category=FutureWarning, module="pyarrow")
        yield


def _fit(
    labels: np.ndarray, num_partitions: int, scheme: str, alpha: float, shards: int, seed: int
) -> Partitioner:
    """A fitted flwr-datasets partitioner whose rows carry ``idx``, the index into ``labels``."""
    from datasets import Dataset
    from flwr_datasets.partitioner import IidPartitioner, ShardPartitioner

    # Rows in seeded random order: IidPartitioner cuts contiguous blocks without shuffling, and
    # the others would otherwise slice each class in file order (e.g. BCCD crops of one image).
    order = np.random.default_rng(seed).permutation(len(labels))
    ds = Dataset.from_dict({"idx": order, "label": labels[order].astype(np.int64)})
    partitioner: Partitioner
    if scheme == Partition.DIRICHLET:
        return _fit_dirichlet(ds, num_partitions, alpha, seed)
    if scheme == Partition.IID:
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


# --- device groups (sessions scenario) --------------------------------------------------------


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
    partition (flwr-datasets), as in the sessions experiments of arXiv 2410.05662. The
    Dirichlet fit is cached like :func:`partition_indices`' (its key's labels are the group's,
    so groups, overlap and seed are part of it).
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


# --- a device's own split ---------------------------------------------------------------------


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
