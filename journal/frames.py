"""A journal's records as bytes: step frames, plain (meta, snapshot) frames, the step keys.

A step frame (v2, written since records got compact payloads) is::

    MAGIC2 | checksum | chain | H(payload) | len(core) | core | payload

``core`` is the msgpack record without its payload fields (each type's ``EventSpec.payload``: the
generated samples), ``payload`` those fields, msgpack'd with narrow integers and zstd-compressed;
``checksum = H(H(payload) | len(core) | core)`` and ``chain = H(previous chain | checksum)``, H being
BLAKE3-256 (a cryptographic hash, about 4x faster than SHA-256 here; see tools/bench_journal.py).
Retention (``journal.retention``) drops the payload bytes and nothing else, so a pruned step still
proves its place in the chain, and the payload's digest stays to check an archived copy against.
A flipped bit, a missing, repeated or reordered step is caught by :mod:`verlj.journal.verify`.
v1 frames (``MAGIC | H(body) | chain | body``, everything inline) are still read, never pruned.
Meta and snapshot frames are ``MAGIC_PLAIN | H(body) | body``. The LMDB environment that holds them
is :mod:`verlj.journal.lmdb_env`'s.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any

import blake3
import zstandard

from . import codec
from .errors import CodecError, JournalError
from .events import StepRecord, payload_fields, summary_types, upcast_record

MAGIC_STEP = b"VJ\x01"
MAGIC_STEP2 = b"VJ\x02"
MAGIC_PLAIN = b"VM\x01"
HASH_LEN = 32
STEP_HEADER = len(MAGIC_STEP) + 2 * HASH_LEN  # magic, checksum, chain: the part every version shares
STEP_HEADER2 = STEP_HEADER + HASH_LEN + 4
PLAIN_HEADER = len(MAGIC_PLAIN) + HASH_LEN
GENESIS = bytes(HASH_LEN)
NO_PAYLOAD = bytes(HASH_LEN)  # the payload digest of a step without payload fields
DEFAULT_COMPRESSION_LEVEL = 1  # zstd; 0 stores payloads uncompressed (level 3: no smaller here, 1.2-1.5x slower: bench_journal.py)
_CORE_LEN = struct.Struct(">I")

_KEY = struct.Struct(">Q")


def step_key(step: int) -> bytes:
    return _KEY.pack(step)


def key_step(key: bytes | memoryview) -> int:
    return _KEY.unpack(bytes(key))[0]


def digest(*parts: bytes) -> bytes:
    """BLAKE3-256 over the concatenation of parts."""
    h = blake3.blake3()
    for p in parts:
        h.update(p)
    return h.digest()


def frame_step(body: bytes, prev_chain: bytes) -> bytes:
    """A v1 frame (read, no longer written: kept for tests of old journals)."""
    checksum = digest(body)
    return MAGIC_STEP + checksum + digest(prev_chain, checksum) + body


def frame_step2(core: bytes, payload: bytes, prev_chain: bytes) -> bytes:
    pdigest = digest(payload) if payload else NO_PAYLOAD
    core_len = _CORE_LEN.pack(len(core))
    checksum = digest(pdigest, core_len, core)
    return b"".join((MAGIC_STEP2, checksum, digest(prev_chain, checksum), pdigest, core_len, core, payload))


def frame_plain(body: bytes) -> bytes:
    return MAGIC_PLAIN + digest(body) + body


@dataclass(frozen=True)
class StepFrame:
    checksum: bytes
    chain: bytes
    body: bytes  # v1: the whole record; v2: the core (the record without its payload fields)
    payload: bytes | None = b""  # v2: the stored payload (b"" when none or pruned; None when not read)
    payload_digest: bytes = NO_PAYLOAD
    version: int = 1
    payload_len: int = 0  # v2: how many payload bytes the frame holds

    @classmethod
    def parse(cls, raw, with_payload: bool = True) -> StepFrame:
        """Split a stored frame. with_payload=False copies only the header and core out of `raw`
        (a memoryview into LMDB's map stays untouched past them): for summaries and pruning."""
        mv = memoryview(raw)
        m = len(MAGIC_STEP)
        magic = bytes(mv[:m])
        if len(mv) >= STEP_HEADER and magic == MAGIC_STEP:
            return cls(bytes(mv[m : m + HASH_LEN]), bytes(mv[m + HASH_LEN : STEP_HEADER]), bytes(mv[STEP_HEADER:]))
        if len(mv) < STEP_HEADER2 or magic != MAGIC_STEP2:
            raise JournalError("step record has no valid frame header")
        (core_len,) = _CORE_LEN.unpack_from(mv, STEP_HEADER + HASH_LEN)
        end = STEP_HEADER2 + core_len
        if end > len(mv):
            raise JournalError("step record is shorter than its frame header says")
        return cls(bytes(mv[m : m + HASH_LEN]), bytes(mv[m + HASH_LEN : STEP_HEADER]), bytes(mv[STEP_HEADER2:end]),
                   bytes(mv[end:]) if with_payload else None, bytes(mv[STEP_HEADER : STEP_HEADER + HASH_LEN]), 2, len(mv) - end)

    def core_ok(self) -> bool:
        """The checksum holds for everything but the payload's own bytes (v1: for the whole record)."""
        if self.version == 1:
            return digest(self.body) == self.checksum
        return digest(self.payload_digest, _CORE_LEN.pack(len(self.body)), self.body) == self.checksum

    def checksum_ok(self) -> bool:
        assert self.payload is not None, "frame parsed without its payload"
        return self.core_ok() and (not self.payload or digest(self.payload) == self.payload_digest)

    @property
    def pruned(self) -> bool:
        """Its payload was removed by retention (the frame still proves its place in the chain)."""
        return self.version == 2 and self.payload_len == 0 and self.payload_digest != NO_PAYLOAD

    def without_payload(self) -> bytes:
        assert self.version == 2
        return b"".join((MAGIC_STEP2, self.checksum, self.chain, self.payload_digest, _CORE_LEN.pack(len(self.body)), self.body))


_zstd = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _zstd.__dict__.setdefault("c", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def split_payload(events: list[dict], level: int) -> tuple[list[dict], bytes, dict | None]:
    """(core events, payload, payload description) of a step: its payload fields (EventSpec.payload)
    msgpack'd with narrow integers and zstd-compressed apart from the rest."""
    core_events, parts = [], []
    for i, event in enumerate(events):
        fields = payload_fields(event["type"])
        if any(f in event for f in fields):
            event = dict(event)
            parts.append([i, {f: event.pop(f) for f in fields if f in event}])
        core_events.append(event)
    payload, desc = b"", None
    if parts:
        raw = codec.packb_compact(parts)
        payload = _compressor(level).compress(raw) if level > 0 else raw
        desc = {"codec": "zstd" if level > 0 else "none", "size": len(payload), "raw_size": len(raw)}
    return core_events, payload, desc


def encode_step(step: int, wall_time: float, events: list[dict], level: int, shapes: codec.Shapes | None = None) -> tuple[bytes, bytes]:
    """(core, payload) of a step record, the core in the v3 encoding over `shapes` (the journal's
    interned shapes; a fresh table when None: the core then declares every shape it uses)."""
    core_events, payload, desc = split_payload(events, level)
    return codec.pack_core(step, wall_time, core_events, desc, codec.Shapes() if shapes is None else shapes), payload


def decode_core(body: bytes, shapes: codec.Shapes | None) -> dict:
    """A v2 or v3 core (or a v1 body) as its record map, before upcasting. `shapes`: the journal's
    table (a v3 core's own declarations are taken into it first)."""
    if codec.is_core_v3(body):
        return codec.unpack_core(body, codec.Shapes() if shapes is None else shapes)
    record = codec.unpackb(body)
    if not isinstance(record, dict):
        raise CodecError("step record is not a map")
    return record


def decode_frame(frame: StepFrame, payload: bool = True, shapes: codec.Shapes | None = None) -> StepRecord:
    """The full record of a checked frame, upcast (payload fields put back unless pruned: then
    ``record.pruned`` is true and those fields are absent). payload=False leaves them out
    without decompressing them (v2 frames; a v1 frame has them inline). `shapes`: the journal's
    interned shapes (v3 cores)."""
    record = decode_core(frame.body, shapes)
    if frame.version == 2:
        desc = record.pop("payload", None)
        if (desc is None) != (frame.payload_digest == NO_PAYLOAD):
            raise CodecError("step record's payload description does not match its frame")
        if frame.payload and payload:
            if len(frame.payload) != desc["size"]:
                raise CodecError("step record's payload has the wrong length")
            if desc["codec"] == "zstd":
                try:
                    raw = zstandard.ZstdDecompressor().decompress(frame.payload, max_output_size=desc["raw_size"])
                except zstandard.ZstdError as e:
                    raise CodecError(f"step record's payload does not decompress: {e}") from None
            elif desc["codec"] == "none":
                raw = frame.payload
            else:
                raise CodecError(f"unknown payload codec {desc['codec']!r}")
            if len(raw) != desc["raw_size"]:
                raise CodecError("step record's payload decompresses to the wrong length")
            for i, fields in codec.unpackb(raw):
                record["events"][i].update(fields)
        record["pruned"] = frame.pruned
    return upcast_record(record)


def _summary_frame(step: int, wall_time: float, events: list[dict]) -> bytes:
    """A v1 step's summary entry: its small events, framed (v2 records need none: the core is it)."""
    return frame_plain(codec.packb_compact({"step": step, "time": wall_time, "events": [e for e in events if e["type"] in summary_types()]}))


def unframe_plain(raw: bytes | memoryview, what: str) -> Any:
    raw = bytes(raw)
    if len(raw) < PLAIN_HEADER or raw[: len(MAGIC_PLAIN)] != MAGIC_PLAIN:
        raise JournalError(f"{what} has no valid frame header")
    body = raw[PLAIN_HEADER:]
    if digest(body) != raw[len(MAGIC_PLAIN) : PLAIN_HEADER]:
        raise JournalError(f"{what} fails its checksum")
    return codec.unpackb(body)
