"""A ZMQ publisher of KV events that behaves like vLLM's ZmqEventPublisher on the wire.

- PUB socket: BINDS when the endpoint contains "*" or "::" or starts with ipc:// or
  inproc://, otherwise CONNECTS (so one subscriber can bind and many replicas connect).
- Each batch goes out as ``[topic, seq (8 bytes BE), msgpack payload]``; seq starts at 0
  and grows by one per batch.
- The last ``buffer_steps`` batches are kept. With ``replay_endpoint`` a ROUTER socket is
  bound there: a request ``[identity, b"", start_seq (8 bytes BE)]`` (what a REQ socket, or
  a DEALER sending ``[b"", start_seq]``, produces) is answered with
  ``[identity, b"", seq, payload]`` for every buffered batch with seq >= start_seq, then
  the end marker ``[identity, b"", (-1 as 8 signed bytes BE), b""]``. Malformed requests
  are ignored, as vLLM does.

Design: ``publish`` encodes and sends on the caller's thread under a lock (a PUB send never
blocks: at the high-water mark ZMQ drops), so sequence numbers follow call order and a
batch is on its way when ``publish`` returns (``close`` lingers briefly to flush it). vLLM
queues to a thread only to keep serialisation off its GPU loop, which a simulator does not
need. Replay must answer while the caller is idle, so one daemon thread alone owns the
ROUTER socket (ZMQ sockets are not thread-safe) and polls it with a short timeout so
``close`` stops it promptly. A thread rather than asyncio keeps the publisher usable from
both sync and async code.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

import zmq

from saltgate.kvevents.wire import (
    REPLAY_END_SEQ,
    EventBatch,
    KVEvent,
    encode_batch,
    encode_seq,
)

__all__ = ["KvEventPublisher", "should_bind"]

_POLL_MS = 50
_CLOSE_LINGER_MS = 500


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcard, IPv6-any, ipc and inproc endpoints; else connect."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class KvEventPublisher:
    """Publishes KV-event batches on a PUB socket and serves replay requests."""

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be positive, got {buffer_steps}")
        self.endpoint = endpoint
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._ctx = context if context is not None else zmq.Context.instance()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._replay: zmq.Socket[bytes] | None = None

        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if should_bind(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except BaseException:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        if self._replay is not None:
            self._thread = threading.Thread(
                target=self._serve_replay, name="kv-event-replay", daemon=True
            )
            self._thread.start()

    @property
    def bound_endpoint(self) -> str | None:
        """The PUB socket's actual address when it bound (resolves a "tcp://host:*" port)."""
        if not should_bind(self.endpoint):
            return None
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def bound_replay_endpoint(self) -> str | None:
        """The ROUTER socket's actual address, if replay is served."""
        if self._replay is None:
            return None
        return self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._next_seq

    def publish(self, events: Iterable[KVEvent], ts: float | None = None) -> int:
        """Send one batch (even an empty one, as vLLM may); returns its sequence number."""
        batch = EventBatch(
            ts=time.time() if ts is None else ts,
            events=tuple(events),
            data_parallel_rank=self.data_parallel_rank,
        )
        payload = encode_batch(batch)
        with self._lock:
            if self._closed:
                raise RuntimeError("the KV-event publisher is closed")
            seq = self._next_seq
            self._pub.send_multipart([self._topic, encode_seq(seq), payload])
            self._buffer.append((seq, payload))
            self._next_seq = seq + 1
        return seq

    def _snapshot(self, start_seq: int) -> list[tuple[int, bytes]]:
        with self._lock:
            return [(s, p) for s, p in self._buffer if s >= start_seq]

    def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while not self._stop.is_set():
            try:
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return  # socket closed under us: we are shutting down
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # not a replay request; vLLM ignores these too
            ident = frames[0]
            start = int.from_bytes(frames[2], "big")
            try:
                for seq, payload in self._snapshot(start):  # as vLLM 0.32 answers
                    sock.send_multipart([ident, b"", self._topic, encode_seq(seq), payload])
                sock.send_multipart([ident, b"", b"", REPLAY_END_SEQ, b""])
            except zmq.ZMQError:
                continue  # the requester went away; serve the next one

    def close(self) -> None:
        """Stop the replay thread and close both sockets (the context is left open)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * _POLL_MS / 1000 + 1)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close(linger=_CLOSE_LINGER_MS)

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
