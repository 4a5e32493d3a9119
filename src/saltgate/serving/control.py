"""The channel between `saltgate serve --workers N` and each of its workers.

A Unix socket pair per worker, made by the parent; the worker gets its end as an
inherited file descriptor. Frames are a 4-byte big-endian length and a body.

- Parent to worker: a pickled order (`Start`, `SendMetrics`, `Reload`, `ReopenLog`). The
  parent is the trusted side: it hands the worker its configuration, secrets included (a
  replica's API key, the EHBP private key), as a single process would have read them
  itself.
- Worker to parent: a tag byte and data (`READY`, `FAILED` + a UTF-8 message, `METRICS` +
  a JSON snapshot, `RELOADED`, `LOG_REOPENED` + "1" or "0": whether a log file was). The
  parent parses it as data only: a worker faces the network, and must not be able to run
  code in its parent.

Every order but `Start` gets exactly one answer, in order, so the parent pairs answers
with the orders it sent by position.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from saltgate.config import GatewayConfig, ReplicaConfig

_LENGTH: Final = struct.Struct(">I")
MAX_FRAME_BYTES: Final = 64 * 1024 * 1024

READY: Final = b"R"  # started and accepting
FAILED: Final = b"F"  # could not start: one line for the operator follows
USAGE_FAILED: Final = b"U"  # could not start because of the configuration or the store
METRICS: Final = b"M"  # a metrics snapshot (gateway/metrics.py Snapshot.to_json) follows
RELOADED: Final = b"L"  # the new replicas are in use
LOG_REOPENED: Final = b"O"  # then b"1": the access log file was reopened, b"0": none was


@dataclass(frozen=True, slots=True)
class Start:
    """What a worker runs: the parent's configuration (no admin port, no KV relay: the
    parent keeps those) and the EHBP private keys every worker must share, the offered one
    first, then the retired ones. (Its index and the number of workers come on its command
    line, with its file descriptors.)"""

    config: GatewayConfig
    ehbp_private_keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class SendMetrics:
    pass


@dataclass(frozen=True, slots=True)
class Reload:
    """SIGHUP: the file's [[replicas]], and its edge TLS files for new connections."""

    replicas: tuple[ReplicaConfig, ...]
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None


@dataclass(frozen=True, slots=True)
class ReopenLog:
    """SIGHUP: reopen the access log file (log rotation)."""


Order = Start | SendMetrics | Reload | ReopenLog


def frame(body: bytes) -> bytes:
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a control frame of {len(body)} bytes is over the limit")
    return _LENGTH.pack(len(body)) + body


class _OrderPickler(pickle.Pickler):
    """Pickles a dataclass as a call of its class with its fields. The default restores a
    frozen dataclass by setting its attributes one by one, which a compiled class (mypyc:
    docs/dev/benchmarks-history.md, "The compiled build") refuses as an assignment to a
    frozen field."""

    def reducer_override(self, obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = dataclasses.fields(obj)
            if all(f.init for f in fields):
                return type(obj), tuple(getattr(obj, f.name) for f in fields)
        return NotImplemented


def order_frame(order: Order) -> bytes:
    out = io.BytesIO()
    _OrderPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(order)
    return frame(out.getvalue())


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's body, or None when the other end closed the channel."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        (length,) = _LENGTH.unpack(head)
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"a control frame of {length} bytes is over the limit")
        return await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def read_order(reader: asyncio.StreamReader) -> Order | None:
    """The parent's next order (worker side), or None when the parent is gone."""
    body = await read_frame(reader)
    if body is None:
        return None
    order = pickle.loads(body)  # noqa: S301 - from the parent, the trusted side (above)
    if not isinstance(order, Start | SendMetrics | Reload | ReopenLog):
        raise TypeError(f"unknown order {type(order).__name__}")
    return order
