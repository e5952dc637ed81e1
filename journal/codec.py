"""msgpack codec for journal records.

Plain msgpack for Python values, plus one extension type for numpy arrays
(and numpy scalars) so token ids, log-probs and rewards travel exactly:
the extension payload is ``msgpack([dtype.str, shape]) + raw little-endian
bytes``. NaN, inf and -0.0 round-trip bit for bit; nothing is ever pickled.

:func:`packb_compact` (step payloads) also stores integer arrays in the narrowest unsigned width
their value range needs, as an offset from their minimum: ``msgpack([dtype.str, stored dtype.str,
shape, minimum]) + raw bytes`` (extension 3). Decoding gives back the original dtype and values
exactly; token ids of a 32k vocabulary padded with -1 take 2 bytes each instead of 4.
"""

from __future__ import annotations

import threading

import msgpack
import numpy as np

from .errors import CodecError

EXT_NDARRAY = 1
EXT_NPSCALAR = 2
EXT_NARROW = 3
NARROW_MIN_SIZE = 16  # smaller arrays are not worth the header
_UNSIGNED = [np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)]

_ALLOWED_KINDS = set("biufc")  # bool, int, uint, float, complex: fixed-size, no objects


def _to_le(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind not in _ALLOWED_KINDS:
        raise CodecError(f"cannot store numpy dtype {arr.dtype} (only bool, int, uint, float, complex)")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # not np.ascontiguousarray: it turns 0-d arrays into 1-d ones
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _default(obj):
    if isinstance(obj, np.ndarray):
        arr = _to_le(obj)
        head = msgpack.packb([arr.dtype.str, list(arr.shape)])
        # one copy of the array's bytes (join reads the buffer in place; tobytes() + concat would copy twice)
        return msgpack.ExtType(EXT_NDARRAY, b"".join((head, arr.reshape(-1).view(np.uint8))))
    if isinstance(obj, np.generic):
        arr = _to_le(np.asarray(obj))
        return msgpack.ExtType(EXT_NPSCALAR, msgpack.packb(arr.dtype.str) + arr.tobytes())
    if isinstance(obj, tuple):
        return list(obj)
    raise CodecError(f"cannot store a value of type {type(obj).__name__} in the journal")


def _narrow_default(obj):
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "iu" and obj.size >= NARROW_MIN_SIZE and obj.dtype.itemsize > 1:
        lo, hi = int(obj.min()), int(obj.max())
        span = hi - lo
        stored = next((u for u in _UNSIGNED if span <= np.iinfo(u).max), None)
        if stored is not None and stored.itemsize < obj.dtype.itemsize and -(1 << 63) <= lo < (1 << 63):
            arr = _to_le(obj)
            shifted = (arr.astype(np.int64) - lo).astype(stored.newbyteorder("<")) if lo else arr.astype(stored.newbyteorder("<"))
            head = msgpack.packb([arr.dtype.str, shifted.dtype.str, list(arr.shape), lo])
            return msgpack.ExtType(EXT_NARROW, b"".join((head, shifted.reshape(-1).view(np.uint8))))
    return _default(obj)


def _unnarrow(head, raw: bytes) -> np.ndarray:
    dtype_str, stored_str, shape, lo = head
    dtype, stored = np.dtype(dtype_str), np.dtype(stored_str)
    if dtype.kind not in "iu" or stored.kind != "u" or not isinstance(lo, int):
        raise CodecError("stored narrowed array is malformed")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * stored.itemsize != len(raw):
        raise CodecError("stored array's byte length does not match its shape")
    arr = np.frombuffer(raw, dtype=stored).reshape(shape)
    return (arr.astype(np.int64) + lo).astype(dtype) if lo else arr.astype(dtype)


def _ext_hook(code: int, data: bytes):
    if code not in (EXT_NDARRAY, EXT_NPSCALAR, EXT_NARROW):
        raise CodecError(f"unknown msgpack extension type {code}")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    head = unpacker.unpack()
    raw = data[unpacker.tell():]
    if code == EXT_NARROW:
        return _unnarrow(head, raw)
    if code == EXT_NDARRAY:
        dtype_str, shape = head
        dtype = np.dtype(dtype_str)
        if dtype.kind not in _ALLOWED_KINDS:
            raise CodecError(f"stored array has disallowed dtype {dtype_str}")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count * dtype.itemsize != len(raw):
            raise CodecError("stored array's byte length does not match its shape")
        # copy: the result must own its memory, not alias the LMDB page
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    dtype = np.dtype(head)
    if dtype.kind not in _ALLOWED_KINDS or dtype.itemsize != len(raw):
        raise CodecError("stored numpy scalar is malformed")
    return np.frombuffer(raw, dtype=dtype)[0]


_local = threading.local()


def _packer(narrow: bool = False) -> msgpack.Packer:
    # A Packer reused per thread: msgpack.packb builds a fresh one per call, which costs ~10x
    # the encoding itself on 150 KB step records (tools/bench_journal.py).
    name = "narrow_packer" if narrow else "packer"
    packer = getattr(_local, name, None)
    if packer is None:
        packer = msgpack.Packer(default=_narrow_default if narrow else _default, use_bin_type=True, strict_types=True)
        setattr(_local, name, packer)
    return packer


def packb_compact(obj) -> bytes:
    """packb, with integer arrays stored in the narrowest width their values need (read by unpackb)."""
    return _pack(_packer(narrow=True), obj)


def packb(obj) -> bytes:
    return _pack(_packer(), obj)


def _pack(packer: msgpack.Packer, obj) -> bytes:
    try:
        return packer.pack(obj)
    except (TypeError, ValueError, OverflowError, CodecError) as e:
        packer.reset()  # drop a half-packed value
        if isinstance(e, CodecError):
            raise
        raise CodecError(f"cannot encode journal record: {e}") from None


def unpackb(data: bytes):
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise CodecError(f"undecodable record: {type(e).__name__}: {e}") from None
