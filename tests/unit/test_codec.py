import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from verlj.journal import CodecError, packb, unpackb

DTYPES = [np.int8, np.int32, np.int64, np.uint8, np.uint16, np.float16, np.float32, np.float64, np.bool_, np.complex64]


def same(a, b) -> bool:
    """Exact equality, NaN equal to NaN (bitwise for arrays), types included."""
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype.newbyteorder("<") == b.dtype
            and a.shape == b.shape
            and a.astype(a.dtype.newbyteorder("<")).tobytes() == b.tobytes()
        )
    if isinstance(a, np.generic):
        return type(a) is type(b) and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if isinstance(a, float):
        return type(b) is float and (math.isnan(a) and math.isnan(b) or a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, max_side=6))
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.binary(max_size=20),
)
values = st.recursive(
    st.one_of(scalars, arrays),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), children, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_roundtrip_is_exact(value):
    assert same(value, unpackb(packb(value)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_floats_and_big_endian(dtype):
    arr = np.arange(6).astype(dtype).reshape(2, 3)
    if np.dtype(dtype).kind in "fc":
        arr.flat[0], arr.flat[1], arr.flat[2] = np.nan, np.inf, -np.inf
    out = unpackb(packb(arr))
    assert same(arr, out)
    big = arr.astype(arr.dtype.newbyteorder(">"))
    assert np.array_equal(unpackb(packb(big)), arr, equal_nan=np.dtype(dtype).kind in "fc")


def test_numpy_scalars_keep_their_type():
    for x in [np.float32(np.nan), np.int64(-3), np.float64(-0.0), np.bool_(True)]:
        assert same(x, unpackb(packb(x)))


def test_decoded_arrays_own_their_memory():
    arr = unpackb(packb(np.arange(4, dtype=np.int64)))
    arr[0] = 7  # would raise on a read-only view of the input buffer
    assert arr[0] == 7


@pytest.mark.parametrize("bad", [object(), np.array(["a"], dtype=object), {1, 2}])
def test_refuses_unstorable_values(bad):
    with pytest.raises(CodecError):
        packb(bad)


def test_garbage_is_a_codec_error_not_a_crash():
    for junk in [b"\xc1", b"\xd4\x09\x00", b"\x92\x01", packb(np.arange(3))[:-2]]:
        with pytest.raises(CodecError):
            unpackb(junk)
