"""Arrays on the wire: exact f32, rounded f16, and refusal of anything malformed."""

from __future__ import annotations

import numpy as np
import pytest

from kvasird.errors import WireError
from kvasird.inference.protocol import tensors


def test_f32_round_trips_exactly_and_f16_rounds() -> None:
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    assert np.array_equal(tensors.decode(tensors.encode(x, "f32"), "x", ("f32",), (None, 8)), x)
    half = tensors.decode(tensors.encode(x, "f16"), "x", ("f16",), (3, 8))
    assert half.dtype == np.float32 and np.abs(half - x).max() < 1e-2


@pytest.mark.parametrize("bad", [
    None,
    {"dt": "f64", "shape": [2], "data": b"\0" * 16},
    {"dt": "f32", "shape": [2, 8], "data": b"\0" * 64},     # wrong rank
    {"dt": "f32", "shape": [3], "data": b"\0" * 8},         # short data
    {"dt": "f32", "shape": [0], "data": b""},               # empty
    {"dt": "f32", "shape": [1 << 27], "data": b""},         # over the element limit
    {"dt": "f32", "shape": [1], "data": np.float32(np.nan).tobytes()},
])
def test_malformed_arrays_are_refused(bad: object) -> None:
    with pytest.raises(WireError):
        tensors.decode(bad, "x", ("f32", "i32"), (None,))


def test_dimensions_whose_product_wraps_in_int64_are_refused() -> None:
    wraps = {"dt": "f32", "shape": [1 << 32, 1 << 32], "data": b""}  # int64 product: 0
    with pytest.raises(WireError, match="exceed the limit"):
        tensors.decode(wraps, "x", ("f32",), (None, None))


def test_a_fixed_dimension_must_match() -> None:
    x = tensors.encode(np.zeros((2, 4)), "f32")
    with pytest.raises(WireError, match="shape"):
        tensors.decode(x, "x", ("f32",), (None, 8))
