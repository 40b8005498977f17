"""``--node-config data-path=...``: a device's own data (npz or ImageFolder layout), and what
bad files do: a LocalDataError naming the file and the problem, which the ClientApp's
handlers answer with an error reply."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from PIL import Image

from edgefleet.client.app import ERR_BAD_CONFIG, evaluate, status, train
from edgefleet.client.device import get_device
from edgefleet.config import DEFAULTS
from edgefleet.task.local import LocalDataError, load_local_data


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


# --- bad files --------------------------------------------------------------------------------


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def _images(n: int = 4) -> np.ndarray:
    return np.random.default_rng(2).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)


def _truncated_npz(tmp: Path) -> Path:
    path = _npz(tmp / "d.npz", x=_images(), y=np.arange(4))
    path.write_bytes(path.read_bytes()[:300])
    return path


def _corrupt_npz(tmp: Path) -> Path:
    path = _npz(tmp / "d.npz", x=_images(), y=np.arange(4))
    data = bytearray(path.read_bytes())
    data[len(data) // 4] ^= 0xFF  # inside x's bytes: the zip CRC no longer matches
    path.write_bytes(bytes(data))
    return path


def _corrupt_image(tmp: Path) -> Path:
    _write_folder(tmp / "imgs", {"3": 2}, size=(28, 28))
    (tmp / "imgs" / "3" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return tmp / "imgs" / "3" / "bad.png"


def _truncated_image(tmp: Path) -> Path:
    _write_folder(tmp / "imgs", {"3": 2}, size=(64, 64))
    path = tmp / "imgs" / "3" / "1.png"
    path.write_bytes(path.read_bytes()[:200])
    return path


BAD = {
    "missing file": (lambda t: t / "nowhere.npz", "does not exist"),
    "truncated npz": (_truncated_npz, "truncated or not a valid .npz"),
    "corrupt npz": (_corrupt_npz, "truncated or not a valid .npz"),
    "not an npz": (
        lambda t: (t / "d.npz").write_text("x,y\n1,2\n") and t / "d.npz",
        "not a valid .npz",
    ),
    "corrupt image": (_corrupt_image, "is not a readable image"),
    "truncated image": (_truncated_image, "is not a readable image"),
    "fractional labels": (
        lambda t: _npz(t / "d.npz", x=_images(), y=np.array([0.0, 1.0, 2.5, 3.0])),
        r"whole class numbers, but 1 are not \(e.g. y\[2\] = 2.5\)",
    ),
    "NaN labels": (
        lambda t: _npz(t / "d.npz", x=_images(), y=np.array([0.0, np.nan, 2.0, 3.0])),
        "whole class numbers",
    ),
    "string labels": (
        lambda t: _npz(t / "d.npz", x=_images(), y=np.array(["a", "b", "c", "d"])),
        "labels must be integers",
    ),
    "labels above the classes": (
        lambda t: _npz(t / "d.npz", x=_images(), y=np.array([0, 1, 2, 10])),
        r"labels must be in \[0, 10\) for mnist-5k, got \[0, 10\]",
    ),
    "negative labels": (
        lambda t: _npz(t / "d.npz", x=_images(), y=np.array([0, -1, 2, 3])),
        r"labels must be in \[0, 10\)",
    ),
    "one-hot labels": (
        lambda t: _npz(t / "d.npz", x=_images(), y=np.eye(10)[:4]),
        r"one label per image, shape \(4,\), got \(4, 10\)",
    ),
    "labels and images differ in number": (
        lambda t: _npz(t / "d.npz", x=_images(), y=np.arange(3)),
        "4 images but 3 labels",
    ),
    "no y": (lambda t: _npz(t / "d.npz", x=_images()), "needs arrays 'x' and 'y'"),
    "object arrays": (
        lambda t: _npz(t / "d.npz", x=np.array([None] * 4, dtype=object), y=np.arange(4)),
        "not a valid .npz",
    ),
    "pixels above 255": (
        lambda t: _npz(t / "d.npz", x=_images().astype(np.int32) * 4, y=np.arange(4)),
        r"pixels must be raw values in \[0, 255\]",
    ),
    "NaN pixels": (
        lambda t: _npz(t / "d.npz", x=np.full((4, 28, 28), np.nan), y=np.arange(4)),
        "pixels must be finite",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_local_data_names_the_file_and_the_problem(tmp_path: Path, case: str) -> None:
    make, message = BAD[case]
    path = make(tmp_path)
    with pytest.raises(LocalDataError, match=message) as err:
        load_local_data(tmp_path / "imgs" if case.endswith(" image") else path, "mnist-5k")
    assert str(path) in str(err.value)


def test_whole_labels_stored_as_floats_are_accepted(tmp_path: Path) -> None:
    y = np.array([[0.0], [1.0], [9.0], [3.0]])  # (N, 1) floats, as some exports write them
    data = load_local_data(_npz(tmp_path / "d.npz", x=_images(), y=y), "mnist-5k")
    np.testing.assert_array_equal(data.y, [0, 1, 9, 3])
    assert data.y.dtype == np.int64


def _context(path: Path) -> Context:
    node = {"partition-id": 0, "num-partitions": 1, "data-path": str(path)}
    return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})


def _message(kind: str, config: dict[str, int]) -> Message:
    from tests.fakes import FakeGrid

    FakeGrid({})  # sets the task identity that building a message needs
    return Message(RecordDict({"config": ConfigRecord(config)}), dst_node_id=1, message_type=kind)


@pytest.mark.parametrize("case", sorted(BAD))
def test_handlers_answer_bad_local_data_with_an_error_reply(tmp_path: Path, case: str) -> None:
    make, message = BAD[case]
    path = make(tmp_path)
    ctx = _context(tmp_path / "imgs" if case.endswith(" image") else path)
    replies = {
        "train": train(_message(MessageType.TRAIN, {"server-round": 1}), ctx),
        "evaluate": evaluate(_message(MessageType.EVALUATE, {"server-round": 1}), ctx),
        "status": status(
            _message(MessageType.QUERY, {"server-round": 1, "slot": 0, "labels": 1}), ctx
        ),
    }
    for handler, reply in replies.items():
        assert reply.has_error(), f"{handler} did not answer with an error"
        assert reply.error.code == ERR_BAD_CONFIG
        assert str(path) in reply.error.reason, f"{handler}: {reply.error.reason}"
    # A status query that does not ask for the labels needs no data: it still answers.
    plain = status(_message(MessageType.QUERY, {"server-round": 1, "slot": 0}), ctx)
    assert not plain.has_error()
