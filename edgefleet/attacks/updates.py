"""Model-poisoning updates as pure NumPy: each takes flat float vectors (an update is the
trained model minus the model the server sent, over its floating-point arrays) and returns
the update a malicious device sends instead. :mod:`edgefleet.attacks.mods` wraps them as
Flower mods; :func:`flatten` / :func:`unflatten` go between a model's arrays and one vector.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from statistics import NormalDist

import numpy as np

State = dict[str, np.ndarray]


def sign_flip(update: np.ndarray, honest_norm: float | None = None) -> np.ndarray:
    """``-update``, rescaled to L2 norm ``honest_norm`` when given (by default it keeps its
    own norm, so a norm screen sees an honest-sized update pointing the wrong way).

    A zero update has no direction to flip: it comes back as zeros whatever ``honest_norm``.
    """
    flipped = -np.asarray(update, dtype=np.float64)
    if honest_norm is None:
        return flipped
    if not (math.isfinite(honest_norm) and honest_norm >= 0):
        raise ValueError(f"sign_flip: honest_norm={honest_norm!r} must be finite and >= 0")
    norm = float(np.linalg.norm(flipped))
    if norm == 0.0:
        return flipped
    return flipped * (honest_norm / norm)


def alie_z(n_devices: int, n_colluders: int) -> float:
    """ALIE's z (Baruch et al. 2019, "A Little Is Enough"): with n devices of which f
    collude, s = floor(n/2 + 1) - f honest devices must be won over for the colluders to hold
    a majority, and z = Phi^-1((n - s) / n) is the largest shift (in standard deviations) that
    leaves that many honest updates farther from the mean than the colluders' update.

    Needs 1 <= f <= floor(n/2) (else s <= 0: the colluders are a majority already, and
    Phi^-1(>= 1) is undefined)."""
    n, f = int(n_devices), int(n_colluders)
    if n != n_devices or f != n_colluders:
        raise ValueError(f"alie_z: n_devices={n_devices!r}, n_colluders={n_colluders!r}: integers")
    if not 1 <= f <= n // 2:
        raise ValueError(
            f"alie_z: n_colluders={f} with n_devices={n}: need 1 <= n_colluders <= "
            f"floor(n_devices / 2) = {n // 2} (s = floor(n/2 + 1) - f must be >= 1)"
        )
    s = math.floor(n / 2 + 1) - f
    return NormalDist().inv_cdf((n - s) / n)


def alie(mean: np.ndarray, std: np.ndarray, z: float) -> np.ndarray:
    """ALIE's update: ``mean - z * std`` per coordinate, from the honest updates' coordinate-
    wise mean and standard deviation.

    Sign: minus, the same direction on every coordinate and in every round. The paper's
    argument needs only that each coordinate stays within z standard deviations of the mean
    (so coordinate-wise defences such as the median or trimmed mean keep it); either sign
    passes. A fixed sign makes the bias the same each round, so it builds up in the global
    model rather than cancelling between rounds, and it is the form most reimplementations
    use, so results compare with theirs.
    """
    if not math.isfinite(z):
        raise ValueError(f"alie: z={z!r} must be finite")
    mean = np.asarray(mean, dtype=np.float64)
    std = np.asarray(std, dtype=np.float64)
    if mean.shape != std.shape:
        raise ValueError(f"alie: mean {mean.shape} and std {std.shape} differ in shape")
    return mean - z * std


def ipm(honest_mean: np.ndarray, epsilon: float) -> np.ndarray:
    """Inner-product manipulation (Xie et al. 2019, "Fall of Empires"): ``-epsilon *
    honest_mean``, whose inner product with the true mean is negative. A small epsilon
    (the paper's 0.1) hides among honest updates; a large one (the paper's 100) overwhelms a
    plain mean."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"ipm: epsilon={epsilon!r} must be finite and > 0")
    return -epsilon * np.asarray(honest_mean, dtype=np.float64)


def float_keys(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """The names of the floating-point arrays, in order: the ones an update is made of
    (integer buffers such as BatchNorm's batch counter are left as the device has them)."""
    return [k for k, v in arrays.items() if np.asarray(v).dtype.kind == "f"]


def flatten(arrays: Mapping[str, np.ndarray], keys: list[str]) -> np.ndarray:
    """The arrays named ``keys`` as one float64 vector."""
    if not keys:
        return np.zeros(0, dtype=np.float64)
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in keys])


def unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray], keys: list[str]) -> State:
    """``vector`` cut back into arrays shaped and typed as ``like``'s arrays ``keys``."""
    out: State = {}
    start = 0
    for k in keys:
        ref = np.asarray(like[k])
        out[k] = vector[start : start + ref.size].reshape(ref.shape).astype(ref.dtype)
        start += ref.size
    if start != len(vector):
        raise ValueError(f"unflatten: vector has {len(vector)} entries, the arrays {start}")
    return out
