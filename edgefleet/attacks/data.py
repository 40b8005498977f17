"""Data-poisoning attacks: label flipping and a pixel-pattern backdoor, as pure NumPy on
(N, C, H, W) images and integer labels, plus wrappers that return a poisoned copy of an
:class:`~edgefleet.task.datasets.ArrayDataset`.

A Flower mod sees messages, never a device's data, so these cannot be mods: poison the
training set where your ClientApp loads it, for the partitions that attack, e.g.::

    data = load_partition(...)                      # your ArrayDataset
    if partition_id in attackers:
        data = backdoored(data, target=0, fraction=0.2, rng=np.random.default_rng(seed))

and measure the backdoor on the central test set with :func:`attack_success_rate`, using
the same trigger ``value`` as in training.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from edgefleet.task.datasets import ArrayDataset


def flip_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    """Each label ``y`` as ``num_classes - 1 - y`` (a copy, same dtype)."""
    if int(num_classes) != num_classes or num_classes < 2:
        raise ValueError(f"flip_labels: num_classes={num_classes!r} must be an integer >= 2")
    y = np.asarray(y)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(
            f"flip_labels: labels span [{y.min()}, {y.max()}], outside [0, {num_classes - 1}]"
        )
    return (num_classes - 1 - y).astype(y.dtype)


def label_flipped(data: ArrayDataset, num_classes: int) -> ArrayDataset:
    """``data`` with every label flipped by :func:`flip_labels` (images shared, read-only)."""
    return ArrayDataset(data.x, flip_labels(data.y, num_classes))


def add_trigger(
    images: np.ndarray, pattern_size: int = 3, value: float | None = None
) -> np.ndarray:
    """A copy of (N, C, H, W) ``images`` with a ``pattern_size`` x ``pattern_size`` square
    set to ``value`` in the bottom-right corner of every channel. ``value`` defaults to the
    largest pixel in ``images`` (white, after normalisation); pass the same value to the
    training and test sets, since a batch's maximum differs between them."""
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"add_trigger: images must be (N, C, H, W), got shape {images.shape}")
    height, width = images.shape[2:]
    if int(pattern_size) != pattern_size or not 1 <= pattern_size <= min(height, width):
        raise ValueError(
            f"add_trigger: pattern_size={pattern_size!r} must be an integer in "
            f"[1, {min(height, width)}] for {height}x{width} images"
        )
    out = images.copy()
    if value is None:
        if images.size == 0:
            return out
        value = float(images.max())
    out[:, :, height - pattern_size :, width - pattern_size :] = value
    return out


class Poisoned(NamedTuple):
    x: np.ndarray
    y: np.ndarray
    poisoned: np.ndarray  # the samples triggered and relabelled, sorted


def poison(
    x: np.ndarray,
    y: np.ndarray,
    target: int,
    fraction: float,
    rng: np.random.Generator,
    pattern_size: int = 3,
    value: float | None = None,
) -> Poisoned:
    """Copies of ``x, y`` with ``round(fraction * N)`` samples, drawn by ``rng`` without
    replacement, triggered (:func:`add_trigger`) and relabelled ``target``. ``value``
    defaults to the largest pixel of all of ``x``, not of the chosen few."""
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y):
        raise ValueError(f"poison: x has {len(x)} samples but y has {len(y)}")
    if not (math.isfinite(fraction) and 0.0 <= fraction <= 1.0):
        raise ValueError(f"poison: fraction={fraction!r} must be in [0, 1]")
    if int(target) != target or target < 0:
        raise ValueError(f"poison: target={target!r} must be a non-negative class index")
    if value is None and x.size:
        value = float(x.max())
    count = round(fraction * len(y))
    index = np.sort(rng.choice(len(y), size=count, replace=False))
    x_out, y_out = x.copy(), y.copy()
    if count:
        x_out[index] = add_trigger(x[index], pattern_size, value)
        y_out[index] = target
    return Poisoned(x_out, y_out, index)


def backdoored(
    data: ArrayDataset,
    target: int,
    fraction: float,
    rng: np.random.Generator,
    pattern_size: int = 3,
    value: float | None = None,
) -> ArrayDataset:
    """``data`` with a backdoor planted in ``fraction`` of its samples (:func:`poison`)."""
    out = poison(data.x, data.y, target, fraction, rng, pattern_size, value)
    return ArrayDataset(out.x, out.y)


def attack_success_rate(
    predict_fn: Callable[[np.ndarray], np.ndarray],
    x_test: np.ndarray,
    y_test: np.ndarray,
    target: int,
    pattern_size: int = 3,
    value: float | None = None,
) -> float:
    """The share of triggered test images whose true label is not ``target`` that
    ``predict_fn`` classes as ``target``. ``predict_fn`` maps images to labels (N,) or to
    scores (N, classes), whose argmax is taken."""
    y_test = np.asarray(y_test)
    others = y_test != target
    if not others.any():
        raise ValueError(f"attack_success_rate: every test label is the target {target}")
    triggered = add_trigger(np.asarray(x_test)[others], pattern_size, value)
    pred = np.asarray(predict_fn(triggered))
    if pred.ndim == 2:
        pred = pred.argmax(axis=1)
    if pred.shape != (int(others.sum()),):
        raise ValueError(
            f"attack_success_rate: predict_fn gave shape {pred.shape} for "
            f"{int(others.sum())} images; want (N,) labels or (N, classes) scores"
        )
    return float(np.mean(pred == target))
