"""msgpack codec for journal records.

Plain msgpack for Python values, plus one extension type for numpy arrays
(and numpy scalars) so token ids, log-probs and rewards travel exactly:
the extension payload is ``msgpack([dtype.str, shape]) + raw little-endian
bytes``. NaN, inf and -0.0 round-trip bit for bit; nothing is ever pickled.

:func:`packb_compact` (step payloads) also stores integer arrays in the narrowest unsigned width
their value range needs, as an offset from their minimum: ``msgpack([dtype.str, stored dtype.str,
shape, minimum]) + raw bytes`` (extension 3). Decoding gives back the original dtype and values
exactly; token ids of a 32k vocabulary padded with -1 take 2 bytes each instead of 4.

:func:`pack_core` / :func:`unpack_core` (a step record's core, kept forever: envelope v3) store
what repeats from step to step once per journal instead of once per step: every map with string
keys becomes ``[shape id, *values]`` over an interned :class:`Shapes` table (a map of floats,
the metrics, becomes its shape id and raw float64 values), a lowercase hex string its bytes, a
1-d integer array of consecutive values ``[dtype, first, count]`` (other integer arrays are narrowed
however small). A core declares the shapes it
is first to use, so the table is covered by the journal's hash chain like everything else.
"""

from __future__ import annotations

import re
import threading

import msgpack
import numpy as np

from .errors import CodecError

EXT_NDARRAY = 1
EXT_NPSCALAR = 2
EXT_NARROW = 3
EXT_MAP = 4  # core v3: a str-keyed map as msgpack [shape id, *values]
EXT_FLOATS = 5  # core v3: a str-keyed map of Python floats: msgpack(shape id) + its values as '<f8'
EXT_HEX = 6  # core v3: a lowercase hex string as its bytes
EXT_RANGE = 7  # core v3: a 1-d integer array of consecutive values as msgpack [dtype, first, count]
CORE_VERSION = 3
NARROW_MIN_SIZE = 16  # smaller arrays are not worth the header
_UNSIGNED: list[np.dtype[np.unsignedinteger]] = [np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)]

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
    if isinstance(obj, np.ndarray) and obj.size >= NARROW_MIN_SIZE:
        narrowed = _narrowed(obj)
        if narrowed is not None:
            return narrowed
    return _default(obj)


def _narrowed(obj: np.ndarray) -> msgpack.ExtType | None:
    """An integer array in the narrowest unsigned width its value range needs (EXT_NARROW), or None."""
    if obj.dtype.kind not in "iu" or obj.dtype.itemsize == 1 or obj.size == 0:
        return None
    lo, hi = int(obj.min()), int(obj.max())
    span = hi - lo
    stored = next((u for u in _UNSIGNED if span <= np.iinfo(u).max), None)
    if stored is None or stored.itemsize >= obj.dtype.itemsize or not -(1 << 63) <= lo < (1 << 63):
        return None
    arr = _to_le(obj)
    shifted = (arr.astype(np.int64) - lo).astype(stored.newbyteorder("<")) if lo else arr.astype(stored.newbyteorder("<"))
    head = msgpack.packb([arr.dtype.str, shifted.dtype.str, list(arr.shape), lo])
    return msgpack.ExtType(EXT_NARROW, b"".join((head, shifted.reshape(-1).view(np.uint8))))  # type: ignore[arg-type]  # an ndarray is a buffer


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


def _ext_hook(code: int, data: bytes, shapes: Shapes | None = None):
    if code in (EXT_MAP, EXT_FLOATS, EXT_HEX, EXT_RANGE):
        if shapes is None:
            raise CodecError(f"msgpack extension type {code} belongs in a step record's core")
        return _core_ext(code, data, shapes)
    if code not in (EXT_NDARRAY, EXT_NPSCALAR, EXT_NARROW):
        raise CodecError(f"unknown msgpack extension type {code}")
    head, raw = _split_head(data)
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


def _split_head(data: bytes):
    """An extension's msgpack head and the raw bytes after it."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    head = unpacker.unpack()
    return head, data[unpacker.tell():]


# ----------------------------------------------------------------------------- compact cores (v3)

SHAPE_MAP, SHAPE_FLOATS, SHAPE_EVENT = 0, 1, 2  # a shape's kind: its first entry
_HEX = re.compile(r"(?:[0-9a-f]{2}){8,}")  # 16+ lowercase hex digits: bytes.fromhex(s).hex() == s


class Shapes:
    """A journal's interned shapes: id -> (kind, *names). SHAPE_MAP and SHAPE_FLOATS: a map's keys in
    order; SHAPE_EVENT: an event's type, schema version, then its field names. Append-only: an id,
    once declared, means the same shape for the journal's whole life."""

    def __init__(self, entries=()):
        self.entries: list[tuple] = []
        self._ids: dict[tuple, int] = {}
        self.declare(0, entries)

    def __len__(self) -> int:
        return len(self.entries)

    def intern(self, key: tuple) -> int:
        sid = self._ids.get(key)
        if sid is None:
            sid = len(self.entries)
            self.entries.append(key)
            self._ids[key] = sid
        return sid

    def declare(self, first: int, entries) -> None:
        """Take the shapes a record declares (ids first, first + 1, ...): new ones are added, known
        ones must be the same. Raises CodecError on a gap or a contradiction."""
        for sid, entry in enumerate(entries, first):
            if not isinstance(entry, (list, tuple)) or not entry or entry[0] not in (SHAPE_MAP, SHAPE_FLOATS, SHAPE_EVENT):
                raise CodecError(f"shape {sid} is malformed")
            key = tuple(entry)
            if sid < len(self.entries):
                if self.entries[sid] != key:
                    raise CodecError(f"shape {sid} is declared as {list(key)} but is already {list(self.entries[sid])}")
            elif sid == len(self.entries):
                self.intern(key)
            else:
                raise CodecError(f"shape {sid} is declared before shape {len(self.entries)}")

    def truncate(self, n: int) -> None:
        """Forget the shapes from id n on (an encoding whose record was never committed)."""
        for key in self.entries[n:]:
            del self._ids[key]
        del self.entries[n:]

    def get(self, sid, kind: int) -> tuple:
        if not isinstance(sid, int) or not 0 <= sid < len(self.entries):
            raise UnknownShapeError(f"step record uses shape {sid!r}, which no record declared")
        key = self.entries[sid]
        if key[0] != kind:
            raise CodecError(f"shape {sid} is not of the kind the record uses it as")
        return key


class UnknownShapeError(CodecError):
    """A core uses a shape id this table does not hold (a reader behind the writer: reload it)."""


def _compact(obj, shapes: Shapes):
    t = type(obj)
    if t is dict:
        if not obj or not all(type(k) is str for k in obj):
            return {k: _compact(v, shapes) for k, v in obj.items()}
        values = list(obj.values())
        if len(values) >= 2 and all(type(v) is float for v in values):
            sid = shapes.intern((SHAPE_FLOATS, *obj))
            return msgpack.ExtType(EXT_FLOATS, msgpack.packb(sid) + np.array(values, "<f8").tobytes())
        sid = shapes.intern((SHAPE_MAP, *obj))
        return msgpack.ExtType(EXT_MAP, packb_compact([sid, *(_compact(v, shapes) for v in values)]))
    if t is list or t is tuple:
        return [_compact(v, shapes) for v in obj]
    if t is str and _HEX.fullmatch(obj):
        return msgpack.ExtType(EXT_HEX, bytes.fromhex(obj))
    if t is np.ndarray and obj.dtype.kind in "iu" and obj.size >= 2:
        if obj.ndim == 1:
            first, last = int(obj[0]), int(obj[-1])
            if last - first == obj.size - 1 and bool((np.diff(obj) == 1).all()):
                return msgpack.ExtType(EXT_RANGE, msgpack.packb([obj.dtype.newbyteorder("<").str, first, int(obj.size)]))
        return _narrowed(obj) or obj  # a core's arrays are small: narrowed whatever their size
    return obj


def _core_ext(code: int, data: bytes, shapes: Shapes):
    if code == EXT_HEX:
        return bytes(data).hex()
    if code == EXT_RANGE:
        dtype_str, first, count = unpackb(data)
        dtype = np.dtype(dtype_str)
        if dtype.kind not in "iu" or not isinstance(first, int) or not isinstance(count, int) or count < 0:
            raise CodecError("stored integer range is malformed")
        return np.arange(first, first + count, dtype=np.int64 if dtype.kind == "i" else np.uint64).astype(dtype)
    if code == EXT_FLOATS:
        sid, raw = _split_head(data)
        key = shapes.get(sid, SHAPE_FLOATS)
        if len(raw) != 8 * (len(key) - 1):
            raise CodecError("stored float map's length does not match its shape")
        return dict(zip(key[1:], np.frombuffer(raw, "<f8").tolist()))
    sid, *values = _unpack_with(data, lambda c, d: _ext_hook(c, d, shapes))
    key = shapes.get(sid, SHAPE_MAP)
    if len(values) != len(key) - 1:
        raise CodecError("stored map's length does not match its shape")
    return dict(zip(key[1:], values))


def _unpack_with(data: bytes, hook):
    try:
        return msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
        raise CodecError(f"undecodable record: {type(e).__name__}: {e}") from None


def pack_core(step: int, wall_time: float, events: list[dict], payload_desc, shapes: Shapes) -> bytes:
    """A step record's core in the v3 encoding: ``[3, declared, step, time, payload, events]``, each
    event ``[shape id, *field values]``, ``declared`` the shapes this record is first to use
    (``[first id, [shape, ...]]``, or nil). New shapes stay in `shapes` (the caller truncates them
    again if the record is not committed)."""
    mark = len(shapes)
    out_events = []
    for event in events:
        if type(event) is not dict or type(event.get("type")) is not str or type(event.get("v")) is not int:
            raise CodecError("a journal event must be a map with a type (str) and a schema version (int): use make_event")
        fields = [k for k in event if k not in ("type", "v")]
        sid = shapes.intern((SHAPE_EVENT, event["type"], event["v"], *fields))
        out_events.append([sid, *(_compact(event[k], shapes) for k in fields)])
    desc = _compact(payload_desc, shapes)
    declared = [mark, [list(e) for e in shapes.entries[mark:]]] if len(shapes) > mark else None
    return packb_compact([CORE_VERSION, declared, step, wall_time, desc, out_events])


def is_core_v3(body: bytes) -> bool:
    """Whether a core is in the v3 encoding: a msgpack array of six whose first item is the version
    (v1/v2 records are maps)."""
    return body[:2] == bytes((0x96, CORE_VERSION))


def core_head(body: bytes) -> tuple[list | None, int]:
    """(declared, step) of a v3 core, read without its events."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(body)
    try:
        unpacker.read_array_header()
        unpacker.skip()
        declared, step = unpacker.unpack(), unpacker.unpack()
    except Exception as e:  # noqa: BLE001
        raise CodecError(f"undecodable record: {type(e).__name__}: {e}") from None
    return declared, step


def unpack_core(body: bytes, shapes: Shapes) -> dict:
    """A v3 core back as the record map ``{"v", "step", "time", "events", "payload"}`` (events as
    written). Takes the shapes it declares into `shapes` first."""
    top = _unpack_with(body, msgpack.ExtType)  # extensions resolved below, once the declarations are in
    if not isinstance(top, list) or len(top) != 6 or top[0] != CORE_VERSION:
        raise CodecError("step record's core is malformed")
    _v, declared, step, wall_time, desc, events = top
    if declared is not None:
        if not isinstance(declared, list) or len(declared) != 2 or not isinstance(declared[1], list):
            raise CodecError("step record's shape declarations are malformed")
        shapes.declare(declared[0], declared[1])
    out = []
    for event in events:
        if not isinstance(event, list) or not event:
            raise CodecError("step record holds a malformed event")
        key = shapes.get(event[0], SHAPE_EVENT)
        if len(event) != len(key) - 2:
            raise CodecError("stored event's length does not match its shape")
        out.append({"type": key[1], "v": key[2], **{k: _resolve(v, shapes) for k, v in zip(key[3:], event[1:])}})
    return {"v": CORE_VERSION, "step": step, "time": wall_time, "events": out, "payload": _resolve(desc, shapes)}


def _resolve(obj, shapes: Shapes):
    """Decode the extensions a top-level unpack left as ExtType (now that the shapes are known)."""
    if isinstance(obj, msgpack.ExtType):
        return _ext_hook(obj.code, obj.data, shapes)
    if isinstance(obj, list):
        return [_resolve(v, shapes) for v in obj]
    if isinstance(obj, dict):
        return {k: _resolve(v, shapes) for k, v in obj.items()}
    return obj


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
    return _unpack_with(data, _ext_hook)
