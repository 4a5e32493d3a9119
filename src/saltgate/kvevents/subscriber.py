"""The consumer side of a KV-event stream over ZMQ: the relay's consumers, and the relay
itself as the follower of each replica.

Both ask a replay socket for what they missed the same way (`request_replay`), and
decide what to take with the same cursor (kvevents/sequence.py). A `RelaySubscriber`
reads the relay: CURVE-authenticated, gap-free while the relay's window reaches back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Final

import zmq

from saltgate.kvevents.sequence import SeqCursor
from saltgate.kvevents.settings import CurveKeyPair
from saltgate.kvevents.wire import (
    EventBatch,
    WireError,
    decode_batch,
    parse_frames,
    parse_replay_frames,
    replay_request,
)

REPLAY_TIMEOUT_S: Final = 2.0


class ReplayOutcome(Enum):
    COMPLETE = "complete"  # the end marker arrived
    UNREACHABLE = "unreachable"  # not connected: the request could not be sent
    TIMED_OUT = "timed out"  # no end marker in time: replace the socket


def request_replay(
    sock: zmq.Socket[bytes],
    start_seq: int,
    timeout_s: float,
    on_reply: Callable[[bytes, int, bytes], None],
    on_malformed: Callable[[], None] = lambda: None,
) -> ReplayOutcome:
    """Ask a replay socket (a DEALER to vLLM's ROUTER, or to the relay's) for every message
    from ``start_seq``; each answer goes to ``on_reply(topic, seq, payload)`` as it comes.

    After TIMED_OUT the caller must replace the socket, so that late answers to this
    request are never read as answers to the next one.
    """
    try:
        sock.send_multipart([b"", replay_request(start_seq)], zmq.NOBLOCK)
    except zmq.Again:
        return ReplayOutcome.UNREACHABLE
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            break
        try:
            reply = parse_replay_frames(sock.recv_multipart())
        except WireError:
            on_malformed()
            continue
        if reply is None:
            return ReplayOutcome.COMPLETE
        on_reply(*reply)
    return ReplayOutcome.TIMED_OUT


@dataclass(frozen=True, slots=True)
class RelayedBatch:
    """One sanitised message as a consumer receives it."""

    replica_id: str
    seq: int
    batch: EventBatch


class RelaySubscriber:
    """A consumer of the relay: CURVE-authenticated, gap-free through the replay socket.

    ``start_seq`` is the first relay sequence number wanted (0: everything still in the
    window); call :meth:`catch_up` after connecting, then :meth:`receive` in a loop.
    ``missed`` counts messages the relay no longer held when this consumer asked for
    them (it fell further behind than the relay's replay window).
    """

    def __init__(
        self,
        publish_endpoint: str,
        replay_endpoint: str,
        server_public_key: str,
        client_keys: CurveKeyPair,
        *,
        start_seq: int = 0,
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._server_key = server_public_key
        self._client_keys = client_keys
        self._replay_endpoint = replay_endpoint
        self.cursor = SeqCursor(start_seq)
        self.missed = 0
        self._sub = self._curve_client(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(publish_endpoint)
        self._replay = self._open_replay()

    def _curve_client(self, kind: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = self._server_key.encode("ascii")
        sock.curve_publickey = self._client_keys.public.encode("ascii")
        sock.curve_secretkey = self._client_keys.secret.encode("ascii")
        return sock

    def _open_replay(self) -> zmq.Socket[bytes]:
        sock = self._curve_client(zmq.DEALER)
        sock.connect(self._replay_endpoint)
        return sock

    def _take(
        self, missed: int | None, topic: bytes, seq: int, payload: bytes, out: list[RelayedBatch]
    ) -> None:
        """Append the message unless the cursor said to drop it (``missed`` is None)."""
        if missed is None:
            return
        self.missed += missed
        self.cursor.advance(seq)
        with contextlib.suppress(WireError, UnicodeDecodeError):  # taken, but unreadable
            out.append(RelayedBatch(topic.decode("ascii"), seq, decode_batch(payload)))

    def catch_up(self, timeout_s: float = REPLAY_TIMEOUT_S) -> list[RelayedBatch]:
        """Everything in the relay's window from the next wanted seq on (empty on timeout)."""
        out: list[RelayedBatch] = []

        def replayed(topic: bytes, seq: int, payload: bytes) -> None:
            self._take(self.cursor.admit_replayed(seq), topic, seq, payload, out)

        outcome = request_replay(self._replay, self.cursor.next_seq, timeout_s, replayed)
        if outcome is ReplayOutcome.TIMED_OUT:
            self._replay.close(linger=0)
            self._replay = self._open_replay()
        return out

    def receive(self, timeout_s: float) -> list[RelayedBatch]:
        """Waits up to ``timeout_s`` for live messages; fills any gap from the replay window."""
        out: list[RelayedBatch] = []
        if not self._sub.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                topic, seq, payload = parse_frames(self._sub.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return out
            except WireError:
                continue
            missed = self.cursor.admit_live(seq, lambda: out.extend(self.catch_up()))
            self._take(missed, topic, seq, payload, out)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> RelaySubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
