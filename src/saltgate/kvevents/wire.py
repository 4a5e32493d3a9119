"""vLLM's KV-cache event wire format (vllm/distributed/kv_events.py), both generations.

ZMQ multipart message: ``[topic, seq (8-byte big-endian unsigned), payload]``.
The payload is msgpack: ``[ts (float64), [event, ...], data_parallel_rank]`` (the rank is
left out when None). vLLM >= 0.28 sends each event as a MAP whose first key is ``"type"``
(msgspec tagged struct, defaults omitted); older releases sent a positional ARRAY whose
first element is the type tag. Field order (both forms):

- BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, then only when set: extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window. (Older arrays stop early: ``[tag, hashes, parent, tokens,
  block_size, lora_id]`` in 0.9, then medium, lora_name, extra_keys, group_idx appended.)
- BlockRemoved: block_hashes, medium, then group_idx when set.
- AllBlocksCleared: no fields.

Hashes are unsigned 64-bit ints (low 64 bits of the digest). On decode, a 32-byte digest
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) or a negative int64 is folded to that same
unsigned form so consumers see one representation. ``extra_keys`` holds one entry per
block: for a salted block 0 it is ``("<salt>",)`` (the bare salt, in clear text), else None.

:func:`encode_batch` reproduces vLLM 0.32's bytes exactly (kv_event_samples.json).
:func:`decode_batch` accepts both forms and raises :class:`WireError` on anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

__all__ = [
    "MEDIUM_GPU",
    "REPLAY_END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "WireError",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "make_frames",
    "parse_frames",
    "parse_replay_frames",
    "replay_request",
]

MEDIUM_GPU = "GPU"
_U64 = (1 << 64) - 1
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
"""Payloads larger than this are refused before unpacking (a bound for untrusted input)."""

REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame that ends a replay answer (paired with an empty payload)."""


class WireError(ValueError):
    """Bytes that are not a vLLM KV-event message; the message says what is wrong."""


ExtraKey = tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that entered the prefix cache, in chain order."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple[ExtraKey, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache."""

    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: what one engine step produced."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------------------- encoding

_STORED_REQUIRED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_STORED_OPTIONAL = (
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_REQUIRED = ("block_hashes", "medium")
_REMOVED_OPTIONAL = ("group_idx",)


def _fields(event: KVEvent) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    if isinstance(event, BlockStored):
        return "BlockStored", _STORED_REQUIRED, _STORED_OPTIONAL
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", _REMOVED_REQUIRED, _REMOVED_OPTIONAL
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared", (), ()
    raise TypeError(f"not a KV event: {type(event).__name__}")


def _plain(value: object) -> object:
    """Tuples as lists (msgpack arrays either way; lists keep packb on its fast path)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _event_obj(event: KVEvent, form: Literal["map", "array"]) -> object:
    tag, required, optional = _fields(event)
    if form == "map":
        out: dict[str, object] = {"type": tag}
        for name in required:
            out[name] = _plain(getattr(event, name))
        for name in optional:
            value = getattr(event, name)
            if value is not None:
                out[name] = _plain(value)
        return out
    arr: list[object] = [tag]
    arr.extend(_plain(getattr(event, name)) for name in required)
    tail = [_plain(getattr(event, name)) for name in optional]
    while tail and tail[-1] is None:  # msgspec array_like + omit_defaults: trailing only
        tail.pop()
    arr.extend(tail)
    return arr


def encode_batch(batch: EventBatch, form: Literal["map", "array"] = "map") -> bytes:
    """msgpack payload for ``batch``; "map" is vLLM 0.32's form, "array" the older one."""
    body: list[object] = [float(batch.ts), [_event_obj(e, form) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


# ---------------------------------------------------------------------------- decoding


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _hash(v: object, where: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        if -(1 << 63) <= v <= _U64:
            return v & _U64
        raise WireError(f"{where}: hash {v} is outside 64 bits")
    if isinstance(v, bytes):
        if not v:
            raise WireError(f"{where}: empty hash bytes")
        return int.from_bytes(v, "big") & _U64
    raise WireError(f"{where}: a block hash must be an int or bytes, got {type(v).__name__}")


def _hashes(v: object, where: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise WireError(f"{where}: block_hashes must be an array")
    return tuple(_hash(h, where) for h in v)


def _opt_int(v: object, where: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise WireError(f"{where} must be an int or nil, got {type(v).__name__}")


def _opt_str(v: object, where: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise WireError(f"{where} must be a string or nil, got {type(v).__name__}")


def _token_ids(v: object) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise WireError("BlockStored.token_ids must be an array of non-negative ints")
    return tuple(v)


def _extra_keys(v: object) -> tuple[ExtraKey, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise WireError("BlockStored.extra_keys must be an array or nil")
    out: list[ExtraKey] = []
    for entry in v:
        if entry is None:
            out.append(None)
        elif isinstance(entry, list):
            out.append(tuple(entry))
        else:
            raise WireError("BlockStored.extra_keys entries must be arrays or nil")
    return tuple(out)


def _block_stored(f: dict[str, object]) -> BlockStored:
    block_size = _opt_int(f.get("block_size"), "BlockStored.block_size")
    if block_size is None or block_size <= 0:
        raise WireError("BlockStored.block_size must be a positive int")
    return BlockStored(
        block_hashes=_hashes(f.get("block_hashes"), "BlockStored.block_hashes"),
        parent_block_hash=(
            None
            if f.get("parent_block_hash") is None
            else _hash(f["parent_block_hash"], "BlockStored.parent_block_hash")
        ),
        token_ids=_token_ids(f.get("token_ids")),
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), "BlockStored.lora_id"),
        medium=_opt_str(f.get("medium"), "BlockStored.medium"),
        lora_name=_opt_str(f.get("lora_name"), "BlockStored.lora_name"),
        extra_keys=_extra_keys(f.get("extra_keys")),
        group_idx=_opt_int(f.get("group_idx"), "BlockStored.group_idx"),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(
            f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
        ),
    )


def _block_removed(f: dict[str, object]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(f.get("block_hashes"), "BlockRemoved.block_hashes"),
        medium=_opt_str(f.get("medium"), "BlockRemoved.medium"),
        group_idx=_opt_int(f.get("group_idx"), "BlockRemoved.group_idx"),
    )


# Positional field names per tag, and how many (after the tag) the oldest form requires.
_POSITIONAL: dict[str, tuple[tuple[str, ...], int]] = {
    "BlockStored": (_STORED_REQUIRED + _STORED_OPTIONAL, 4),
    "BlockRemoved": (_REMOVED_REQUIRED + _REMOVED_OPTIONAL, 1),
    "AllBlocksCleared": ((), 0),
}


def _event(obj: object, index: int) -> KVEvent:
    where = f"event {index}"
    if isinstance(obj, dict):
        tag = obj.get("type")
        fields: dict[str, object] = obj
    elif isinstance(obj, list) and obj:
        tag = obj[0]
        if not isinstance(tag, str) or tag not in _POSITIONAL:
            raise WireError(f"{where}: unknown event type {tag!r}")
        names, minimum = _POSITIONAL[tag]
        values = obj[1:]
        if len(values) < minimum:
            raise WireError(f"{where}: {tag} array has {len(values)} fields, needs {minimum}")
        # Later releases may append fields; the ones this module knows come first.
        fields = dict(zip(names, values, strict=False))
    else:
        raise WireError(f"{where}: an event must be a map or a non-empty array")
    if tag == "BlockStored":
        return _block_stored(fields)
    if tag == "BlockRemoved":
        return _block_removed(fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireError(f"{where}: unknown event type {tag!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """Parse one payload (map or positional form). Raises WireError, never anything else."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise WireError("payload must be bytes")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, timestamp=0)
    except Exception as exc:  # msgpack raises many types on junk; all mean "malformed"
        raise WireError(f"payload is not valid msgpack: {exc}") from None
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        raise WireError("payload must be an array [ts, events] or [ts, events, dp_rank]")
    ts = obj[0]
    if not (isinstance(ts, float) or _is_int(ts)):
        raise WireError("batch ts must be a number")
    events = obj[1]
    if not isinstance(events, list):
        raise WireError("batch events must be an array")
    rank = _opt_int(obj[2], "data_parallel_rank") if len(obj) == 3 else None
    try:
        parsed = tuple(_event(e, i) for i, e in enumerate(events))
    except WireError:
        raise
    except Exception as exc:  # e.g. unhashable types in odd places: still malformed
        raise WireError(f"malformed event: {exc}") from None
    return EventBatch(ts=float(ts), events=parsed, data_parallel_rank=rank)


# ---------------------------------------------------------------------------- framing


def encode_seq(seq: int) -> bytes:
    """A sequence number as its 8-byte big-endian frame."""
    if not 0 <= seq <= _U64:
        raise ValueError(f"sequence number {seq} does not fit 8 unsigned bytes")
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number in an 8-byte big-endian frame."""
    if len(frame) != 8:
        raise WireError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def make_frames(topic: str | bytes, seq: int, payload: bytes) -> list[bytes]:
    """The multipart message vLLM's PUB socket sends: [topic, seq, payload]."""
    t = topic.encode("utf-8") if isinstance(topic, str) else topic
    return [t, encode_seq(seq), payload]


def parse_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """Split a received multipart message into (topic, seq, payload)."""
    if len(frames) != 3:
        raise WireError(f"a KV-event message has 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic), decode_seq(bytes(seq)), bytes(payload)


def replay_request(start_seq: int) -> bytes:
    """The body of a replay request: the first wanted seq, 8 bytes big-endian.

    Send it from a REQ socket (which adds the empty delimiter) or as ``[b"", body]`` from a
    DEALER; a DEALER can read every reply, a REQ socket only the first.
    """
    return encode_seq(start_seq)


def parse_replay_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes] | None:
    """A replay answer as (topic, seq, payload), or None for the end marker.

    vLLM 0.32 answers ``[topic, seq, payload]`` and ends with ``[b"", END, b""]``; older
    releases answered ``[seq, payload]`` and ended with ``[END, b""]`` (topic then b"").
    A DEALER sees an empty delimiter frame first; a REQ socket does not.
    """
    parts = [bytes(f) for f in frames]
    if parts and parts[0] == b"" and len(parts) in (3, 4):
        parts = parts[1:]
    if len(parts) == 2:
        parts = [b"", *parts]
    if len(parts) != 3:
        raise WireError(f"a replay answer has 2 or 3 frames after the delimiter, not {len(parts)}")
    topic, seq, payload = parts
    if seq == REPLAY_END_SEQ:
        return None
    return topic, decode_seq(seq), payload
