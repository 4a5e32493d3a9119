"""Sequence numbers of a KV-event stream: what is next, what is a gap, what to replay.

vLLM numbers its event batches and keeps the last ones for replay; the relay does the
same downstream. A follower of such a stream (the relay upstream, a consumer of the
relay) takes messages in order, fills a gap from the replay socket, and counts what the
replay no longer had. These are the decisions; the sockets are the caller's. Pure.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Final

DEFAULT_REPLAY_WINDOW: Final = 10_000


class SeqVerdict(Enum):
    """Where a sequence number falls relative to the next one expected."""

    NEXT = "next"
    GAP = "gap"
    DUPLICATE = "duplicate"


@dataclass(slots=True)
class SeqCursor:
    """Tracks one stream's sequence numbers (a replica's, or the relay's for a consumer).

    Messages come live (PUB/SUB) and from replay, which may overlap. A publisher's live
    numbers only grow, so a live number at or below the last live one means it restarted
    (its numbers begin again at 0); a number below the expected one is otherwise a
    duplicate that replay already delivered.
    """

    next_seq: int = 0
    last_live: int = -1
    restarts: int = 0

    def live(self, seq: int) -> SeqVerdict:
        """Classify (and remember) a number from the live stream."""
        if seq <= self.last_live:
            self.next_seq = 0
            self.restarts += 1
        self.last_live = seq
        return self.replayed(seq)

    def replayed(self, seq: int) -> SeqVerdict:
        """Classify a number from a replay answer."""
        if seq == self.next_seq:
            return SeqVerdict.NEXT
        return SeqVerdict.GAP if seq > self.next_seq else SeqVerdict.DUPLICATE

    def advance(self, seq: int) -> None:
        self.next_seq = seq + 1

    def admit_live(self, seq: int, fill: Callable[[], None]) -> int | None:
        """Whether to take live message ``seq``: None to drop it (a duplicate, or the
        gap's replay delivered it), else how many messages before it are lost for good.

        On a gap, ``fill()`` first asks the replay socket for everything from
        ``next_seq`` (taking what it gets through `admit_replayed`).
        """
        verdict = self.live(seq)
        if verdict is SeqVerdict.DUPLICATE:
            return None
        if verdict is SeqVerdict.GAP:
            fill()
            if self.next_seq > seq:
                return None
        return seq - self.next_seq

    def admit_replayed(self, seq: int) -> int | None:
        """`admit_live` for a message of a replay answer: a gap here means the replay
        window no longer reaches back to ``next_seq``."""
        if self.replayed(seq) is SeqVerdict.DUPLICATE:
            return None
        return seq - self.next_seq


@dataclass(frozen=True, slots=True)
class WindowEntry:
    seq: int
    topic: bytes
    payload: bytes


class ReplayWindow:
    """The last ``size`` republished messages, numbered from 0, for consumers to catch up."""

    def __init__(self, size: int = DEFAULT_REPLAY_WINDOW) -> None:
        if size <= 0:
            raise ValueError(f"replay_window must be positive, got {size}")
        self._entries: deque[WindowEntry] = deque(maxlen=size)
        self.next_seq = 0

    def append(self, topic: bytes, payload: bytes) -> int:
        seq = self.next_seq
        self._entries.append(WindowEntry(seq, topic, payload))
        self.next_seq = seq + 1
        return seq

    def since(self, start_seq: int) -> list[WindowEntry]:
        return [e for e in self._entries if e.seq >= start_seq]
