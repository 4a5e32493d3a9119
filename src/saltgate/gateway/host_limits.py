"""A worker's limits, decided by its supervisor for the whole host (docs/limits.md,
"Workers").

`saltgate serve --workers N` without [cluster]: each worker asks the supervisor, over a
Unix socket pair the supervisor made, whether a request fits its tenant's and key's limits;
the supervisor's one Governor answers for every worker (governance/arbiter.py has the
lines both ends write). An answer that does not come within `TIMEOUT_S`, or a channel
closed, raises `HostUnreachable` (an OSError): the worker then falls back to its share of
every limit on its own counts (gateway/admission.py), as with Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from saltgate.governance.arbiter import (
    MAX_LINE_BYTES,
    ZERO,
    admit_line,
    answer_id,
    read_admission,
    seed_line,
    settle_line,
)
from saltgate.governance.kinds import Subject
from saltgate.governance.limits import Demand, Denial, Limits, Quota, Ticket

# An admission waits at most this for the supervisor before the worker falls back to its
# share (as long as Redis gets: gateway/shared_limits.py).
TIMEOUT_S: Final = 0.5


class HostUnreachable(ConnectionError):
    """The supervisor did not answer in time, or its channel is closed."""


@dataclass(frozen=True, slots=True)
class HostTicket:
    """An admission the supervisor counted, settled there when the request ends; `local`:
    the same admission in this worker's own governor (for a fallback to its share)."""

    id: int
    local: Ticket | None = None


def _expire(future: asyncio.Future[list[object]], timeout_s: float) -> None:
    if not future.done():
        future.set_exception(HostUnreachable(f"no answer within {timeout_s:g} s"))


class HostLimits:
    """This worker's end of the channel to the supervisor's arbiter."""

    what: Final = "the supervisor"

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, timeout_s: float
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._timeout_s = timeout_s
        self._last_id = 0
        self._waiting: dict[int, asyncio.Future[list[object]]] = {}
        self._closed = False
        self._reading = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, sock: socket.socket, *, timeout_s: float = TIMEOUT_S) -> HostLimits:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_LINE_BYTES)
        return cls(reader, writer, timeout_s=timeout_s)

    async def admit(
        self, limited: Sequence[tuple[Subject, Limits]], demand: Demand
    ) -> tuple[HostTicket | None, Denial | None, tuple[Quota, ...]]:
        """Admit into every limit or none, as the supervisor decides; HostUnreachable when
        it does not answer in time (the admission it may still make is settled at once)."""
        ident = self._next_id()
        try:
            answer = await self._ask(ident, admit_line(ident, limited, demand))
        except HostUnreachable:
            self._send(settle_line(ident, ZERO))  # counted late, if at all: give it back
            raise
        decided = read_admission(answer, asyncio.get_running_loop().time())
        return (HostTicket(ident) if decided.admitted else None), decided.denial, decided.quotas

    async def seed_budget(
        self, subject: Subject, limits: Limits, spent: Sequence[tuple[float, int]]
    ) -> bool:
        """Start the subject's budget in the supervisor from the ledger's (age in seconds,
        amount), unless it holds it already; True if this call started it."""
        ident = self._next_id()
        answer = await self._ask(ident, seed_line(ident, subject, limits, spent))
        return bool(answer[1])

    def settle(self, ticket: HostTicket, used: Demand) -> None:
        """Correct the reservations to what was used and free the lease (no answer)."""
        self._send(settle_line(ticket.id, used))

    async def aclose(self) -> None:
        self._closed = True
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading
        self._writer.close()

    def _next_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def _send(self, line: bytes) -> None:
        if not self._closed and not self._writer.is_closing():
            self._writer.write(line)

    async def _ask(self, ident: int, line: bytes) -> list[object]:
        if self._closed or self._writer.is_closing():
            raise HostUnreachable("the supervisor's channel is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[object]] = loop.create_future()
        self._waiting[ident] = future
        # A timer on the future itself: asyncio.wait_for costs a wrapper per question.
        timer = loop.call_later(self._timeout_s, _expire, future, self._timeout_s)
        try:
            self._writer.write(line)
            return await future
        finally:
            timer.cancel()
            self._waiting.pop(ident, None)

    async def _read(self) -> None:
        """Hand each answer to its question; a late one (its question gave up) is dropped."""
        try:
            while line := await self._reader.readline():
                ident, answer = answer_id(line)
                future = self._waiting.get(ident)
                if future is not None and not future.done():
                    future.set_result(answer)
        except (ConnectionError, ValueError):
            pass
        finally:
            self._closed = True
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(HostUnreachable("the supervisor's channel closed"))
