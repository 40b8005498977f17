"""``--node-config data-path=...``: a device's own data (npz or ImageFolder layout)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgefleet.client.device import get_device
from edgefleet.config import DEFAULTS
from edgefleet.task.data import LocalDataError, load_local_data


def _write_folder(root: Path, classes: dict[str, int], size: tuple[int, int]) -> None:
    rng = np.random.default_rng(0)
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def test_npz_is_normalised_like_the_run_data_set(tmp_path: Path) -> None:
    x = np.full((4, 28, 28), 255, dtype=np.uint8)
    np.savez(tmp_path / "d.npz", x=x, y=np.array([0, 1, 2, 3]))
    data = load_local_data(tmp_path / "d.npz", "mnist-5k")
    assert data.x.shape == (4, 1, 28, 28) and data.x.dtype == np.float32
    np.testing.assert_allclose(data.x[0, 0, 0, 0], (1.0 - 0.1307) / 0.3081, rtol=1e-5)
    np.testing.assert_array_equal(data.y, [0, 1, 2, 3])


def test_image_folder_is_resized_and_labelled_by_class_name(tmp_path: Path) -> None:
    _write_folder(tmp_path / "imgs", {"3": 2, "7": 1}, size=(40, 30))
    data = load_local_data(tmp_path / "imgs", "mnist-5k")
    assert data.x.shape == (3, 1, 28, 28)
    np.testing.assert_array_equal(data.y, [3, 3, 7])


def test_bad_local_data_is_refused_with_its_reason(tmp_path: Path) -> None:
    np.savez(tmp_path / "bad.npz", x=np.zeros((2, 28, 28)), y=np.array([0, 10]))
    with pytest.raises(LocalDataError, match="labels must be in"):
        load_local_data(tmp_path / "bad.npz", "mnist-5k")
    with pytest.raises(LocalDataError, match="neither"):
        load_local_data(tmp_path / "missing", "mnist-5k")


def test_a_device_with_data_path_trains_on_its_own_data(tmp_path: Path) -> None:
    x = np.random.default_rng(1).integers(0, 256, size=(20, 28, 28), dtype=np.uint8)
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(20) % 10)
    node = {"partition-id": 0, "num-partitions": 1, "data-path": str(tmp_path / "d.npz")}
    device = get_device(dict(DEFAULTS), node)
    assert len(device.train_data) + len(device.test_data) == 20
