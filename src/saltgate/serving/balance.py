"""How worker processes share the connections of their one listening socket.

A board in shared memory (a memfd the parent makes and every worker maps) holds each
worker's count of open client connections, or -1 while it does not accept (starting,
draining, dead). A worker leaves a new connection to another that holds fewer
(`BoardGate.defer`), so connections spread like "least connections" however they
arrive; the HTTP server's acceptor takes the connection anyway if nobody else did
within a couple of milliseconds (http/server.py).

A slot is one aligned 8-byte word written only by its worker (and by the parent once
the worker is dead), read by everybody without a lock: a stale read costs one
connection going to a worker that was not quite the least loaded, nothing else.
"""

from __future__ import annotations

import mmap
import os
from typing import Final

NOT_ACCEPTING: Final = -1
_SLOT_BYTES: Final = 8


class ConnectionBoard:
    """Open connections per worker, shared by the parent and its workers."""

    def __init__(self, fd: int, workers: int) -> None:
        if workers < 1:
            raise ValueError("a board needs at least one worker")
        self.fd = fd
        self.workers = workers
        self._map = mmap.mmap(fd, workers * _SLOT_BYTES)
        self._slots = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, workers: int) -> ConnectionBoard:
        """A new board (the parent's), every worker marked as not accepting; its `fd` is
        what the workers are given."""
        fd = os.memfd_create("saltgate-workers", 0)  # close-on-exec: passed explicitly
        os.ftruncate(fd, workers * _SLOT_BYTES)
        board = cls(fd, workers)
        for i in range(workers):
            board.mark_down(i)
        return board

    def connections(self, worker: int) -> int | None:
        """The worker's open connections, or None while it does not accept."""
        value = int(self._slots[worker])
        return None if value == NOT_ACCEPTING else value

    def mark_down(self, worker: int) -> None:
        """The worker does not accept (it drains, or died): leave it out of the share."""
        self._slots[worker] = NOT_ACCEPTING

    def gate(self, worker: int) -> BoardGate:
        return BoardGate(self, worker)

    def close(self) -> None:
        self._slots.release()
        self._map.close()
        os.close(self.fd)


class BoardGate:
    """One worker's view of the board: the `AcceptGate` its acceptor asks (acceptor.py).
    Between `start` and `stop` it counts the worker's connections; after `stop`
    (draining) the connections that close no longer touch the board, which may be gone
    by then."""

    __slots__ = ("_board", "_index", "_live", "_slots")

    def __init__(self, board: ConnectionBoard, index: int) -> None:
        self._board = board
        self._index = index
        self._slots = board._slots
        self._live = False

    def start(self) -> None:
        """Count from zero: this worker accepts (a restarted one starts empty)."""
        self._live = True
        self._slots[self._index] = 0

    def stop(self) -> None:
        self._live = False
        self._board.mark_down(self._index)

    def defer(self) -> bool:
        slots = self._slots
        mine = slots[self._index]
        return any(0 <= slots[i] < mine for i in range(len(slots)) if i != self._index)

    def opened(self) -> None:
        if self._live:
            self._slots[self._index] += 1

    def closed(self) -> None:
        if self._live:
            self._slots[self._index] -= 1
