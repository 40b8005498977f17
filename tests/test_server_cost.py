"""The server's per-round shortcuts give what the slow paths gave (issue 23 item 8)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from edgefleet.loop.screening import array_values, model_norm, sum_squares, update_norm
from tests.fakes import rec

RNG = np.random.default_rng(0)
ARRAYS = {
    "float32": RNG.standard_normal((3, 4)).astype(np.float32),
    "fortran": np.asfortranarray(RNG.standard_normal((5, 2))),
    "big-endian": RNG.standard_normal(7).astype(">f4"),
    "int64": np.arange(6, dtype=np.int64).reshape(2, 3),
    "scalar": np.array(3.5),
    "bool": np.array([True, False, True]),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "nan": np.array([np.nan, np.inf, 1.0], dtype=np.float16),
    "structured": np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
}


@pytest.mark.parametrize("name", list(ARRAYS))
def test_array_values_equal_flowers_numpy(name: str) -> None:
    arr = Array(ARRAYS[name])
    fast, slow = array_values(arr), arr.numpy()
    assert fast.dtype == slow.dtype and fast.shape == slow.shape
    assert fast.tobytes() == slow.tobytes()
    assert array_values(arr).shape == slow.shape  # the second read, from the header table


def _npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        _npy(np.ones(4, dtype=np.float32))[:-3],  # data cut short
        _npy(np.ones(4, dtype=np.float32)).replace(b"(4,)", b"(9,)"),  # header says more
        b"\x93NUMPY\x01\x00\xff\x00{'descr'",  # header cut short
        b"\x93NUMPY\x01\x00\x10\x00not a dict at all",
        b"not an npy",
    ],
)
def test_unreadable_arrays_fail_as_flowers_numpy_does(data: bytes) -> None:
    arr = Array(dtype="float32", shape=(4,), stype="numpy.ndarray", data=data)
    with pytest.raises(Exception) as slow:
        arr.numpy()
    with pytest.raises(type(slow.value)) as fast:
        array_values(arr)
    assert str(fast.value) == str(slow.value)


def test_array_values_are_a_read_only_view() -> None:
    arr = Array(np.ones((2, 2), dtype=np.float32))
    value = array_values(arr)
    assert not value.flags.writeable  # a caller cannot change the reply it was given


def test_norms_as_before() -> None:
    """The sums of squares run in the calling thread now (not np.dot's BLAS): same norms."""
    base = {"w": RNG.standard_normal((64, 33)).astype(np.float32), "n": np.array([3])}
    reply = ArrayRecord({"w": Array(base["w"] + 0.1), "n": Array(np.array([5]))})  # n: no update
    diff = (reply["w"].numpy().astype(np.float64) - base["w"].astype(np.float64)).ravel()
    assert update_norm(reply, base) == pytest.approx(np.sqrt(np.dot(diff, diff)), rel=1e-12)
    flat = base["w"].astype(np.float64).ravel()
    assert model_norm(rec(w=base["w"])) == pytest.approx(np.sqrt(np.dot(flat, flat)), rel=1e-12)
    assert sum_squares(np.array([3.0, 4.0])) == 25.0
