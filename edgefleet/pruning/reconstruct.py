"""Server-side reconstruction of compact CA-HFP updates into the full parameter space.

A pruned client uploads compact tensors plus the kept channels; the server turns the kept
channels into flat index maps (:meth:`PruningPlan.index_maps`) and then, with plain NumPy:

- :func:`scatter` gives one full-size update per client, for an aggregator that expects
  full-size updates (FedAvg, SAGA memory). ``fill="global"`` takes the entries the client
  pruned from the current global model, CA-HFP's reconstruction: the pruned part of the update
  is zero, so the aggregate is not dragged towards anything the client never trained.
  ``fill="zeros"`` writes zeros there, the paper's no-reconstruction ablation (pruned weights
  are pulled towards zero by every pruned client).
- :func:`elementwise_average` averages every entry only over the clients that kept it (HeteroFL
  style), the entries nobody kept keep their global value. Choose it when the aggregation rule
  is a plain weighted mean; with full masks it equals FedAvg.

Dtypes are preserved. Integer buffers (BatchNorm's ``num_batches_tracked``) are averaged like
everything else and rounded half to even. Flower's FedAvg differs here: it returns the mean
as float64 (17.5, which ``load_state_dict`` truncates to 17), so with full masks the
equivalence to FedAvg is exact for the floating-point tensors only. EdgeFleet's round loop
settles it for every aggregator: it casts the aggregate back to each array's dtype, rounding
integers half to even (``edgefleet.loop.roundloop.keep_dtypes``), as done here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

import numpy as np

from edgefleet.pruning.names import Reconstruction


class FillMode(StrEnum):
    """What a coordinate no device kept becomes."""

    GLOBAL = "global"
    ZEROS = "zeros"


FILL_MODES: tuple[str, ...] = tuple(m.value for m in FillMode)


def _same_keys(
    expected: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], what: str
) -> None:
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise ValueError(f"{what}: missing keys {missing}, unexpected keys {extra}")


def _compact_values(
    key: str, full: np.ndarray, compact: np.ndarray, index: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The compact tensor as a flat array and its map, after checking they fit ``full``."""
    compact, index = np.asarray(compact), np.asarray(index)
    if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
        raise ValueError(f"{key}: the index map must be a 1-D integer array")
    if compact.size != index.size:
        raise ValueError(f"{key}: compact tensor has {compact.size} entries, its map {index.size}")
    if compact.dtype != full.dtype:
        raise ValueError(f"{key}: compact dtype {compact.dtype} != global dtype {full.dtype}")
    if index.size and (index.min() < 0 or index.max() >= full.size):
        raise ValueError(f"{key}: index map out of bounds for {full.size} entries")
    return compact.reshape(-1), index


def compact_slice(
    full: Mapping[str, np.ndarray],
    maps: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, np.ndarray]:
    """The submodel's tensors cut from the full ones (what a compact download carries): the
    inverse of :func:`scatter` on the entries ``maps`` names."""
    return {k: full[k].reshape(-1)[maps[k]].reshape(shapes[k]) for k in full}


def scatter(
    global_arrays: Mapping[str, np.ndarray],
    compact: Mapping[str, np.ndarray],
    maps: Mapping[str, np.ndarray],
    fill: str = "global",
) -> dict[str, np.ndarray]:
    """Full-size arrays: the entries in ``maps`` from ``compact``, every other entry from
    ``global_arrays`` (``fill="global"``) or zero (``fill="zeros"``)."""
    if fill not in FILL_MODES:
        raise ValueError(f"unknown fill {fill!r}; valid choices: {', '.join(FILL_MODES)}")
    _same_keys(global_arrays, compact, "compact arrays")
    _same_keys(global_arrays, maps, "index maps")
    out: dict[str, np.ndarray] = {}
    for key, full in global_arrays.items():
        values, index = _compact_values(key, full, compact[key], maps[key])
        result = (
            np.array(full, order="C")
            if fill == Reconstruction.GLOBAL
            else np.zeros_like(full, order="C")
        )
        np.put(result, index, values)
        out[key] = result
    return out


def elementwise_average(
    global_arrays: Mapping[str, np.ndarray],
    updates: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray], float]],
) -> dict[str, np.ndarray]:
    """Per entry, the ``weight``-weighted mean of the clients' values over the clients whose
    ``(compact, maps, weight)`` update kept it; entries nobody kept (or kept with total weight
    zero) keep the global value. Cost O(total kept entries + model size)."""
    for n, (compact, maps, weight) in enumerate(updates):
        _same_keys(global_arrays, compact, f"update {n} compact arrays")
        _same_keys(global_arrays, maps, f"update {n} index maps")
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(f"update {n}: weight must be finite and >= 0, got {weight}")
    out: dict[str, np.ndarray] = {}
    for key, full in global_arrays.items():
        parts = [
            (*_compact_values(key, full, compact[key], maps[key]), float(weight))
            for compact, maps, weight in updates
        ]
        result = np.array(full, order="C")
        if parts:
            # One bincount over all clients' (index, value) pairs instead of a dense
            # accumulator per client: the work is the total number of kept entries.
            index = np.concatenate([i for _, i, _ in parts])
            num = np.bincount(
                index,
                weights=np.concatenate([v.astype(np.float64) * w for v, _, w in parts]),
                minlength=full.size,
            )
            den = np.bincount(
                index,
                weights=np.concatenate([np.full(i.size, w) for _, i, w in parts]),
                minlength=full.size,
            )
            kept = np.flatnonzero(den > 0)
            mean = num[kept] / den[kept]
            if np.issubdtype(full.dtype, np.integer):
                mean = np.rint(mean)
            np.put(result, kept, mean.astype(full.dtype))
        out[key] = result
    return out
