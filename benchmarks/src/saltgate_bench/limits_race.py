"""Concurrency-cap races against a real Redis, fast enough for 100,000 trials.

A trial: 64 admissions sent at once at a cap of C (16 on each of 4 connections, written
in one go, so Redis interleaves the connections at will), then every admitted one settled.
The admissions are the shared engine's own: SharedLimits builds each ticket and the
script's arguments (gateway/shared_limits.py); only the transport is this module's, raw
RESP over asyncio streams, because redis-py costs ~1 ms of Python per call and 100,000
trials are 6.4 million admissions.

The positive control, `racy`, is what a non-atomic engine does (read the count, then add
if below the cap, as two commands): it over-admits, so the check can fail.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from saltgate.gateway.shared_limits import ADMIT_SCRIPT, SETTLE_SCRIPT, SharedLimits, settle_call
from saltgate.governance.kinds import Scope, Subject
from saltgate.governance.limits import DEFAULT_LEASE_TTL_S, Demand, Limits

CONNECTIONS = 4


class RespError(Exception):
    """Redis answered an error (the message is Redis's)."""


def command(*parts: str | int | bytes) -> bytes:
    """One command in RESP."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        raw = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


def _value(line: bytes) -> int | bytes:
    kind, rest = line[:1], line[1:]
    if kind == b":":
        return int(rest)
    if kind == b"-":
        raise RespError(rest.decode(errors="replace"))
    return rest


class Connection:
    """One connection: commands written in one go (a pipeline), replies read in bulk.

    The replies parsed are what these scripts and commands return: integers, simple
    strings, one-line bulk strings (a script's SHA) and flat arrays of integers.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._lines: list[bytes] = []
        self._rest = b""

    async def call(self, *commands: bytes) -> list[int | bytes | list[int | bytes]]:
        self._writer.write(b"".join(commands))
        return [await self._reply() for _ in commands]

    async def _reply(self) -> int | bytes | list[int | bytes]:
        line = await self._line()
        if line[:1] == b"*":
            return [_value(await self._line()) for _ in range(int(line[1:]))]
        if line[:1] == b"$":
            return await self._line()
        return _value(line)

    async def _line(self) -> bytes:
        while not self._lines:
            data = await self._reader.read(1 << 16)
            if not data:
                raise RespError("Redis closed the connection")
            *self._lines, self._rest = (self._rest + data).split(b"\r\n")
            self._lines.reverse()
        return self._lines.pop()

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()


async def connect(port: int, password: str) -> Connection:
    conn = Connection(*await asyncio.open_connection("127.0.0.1", port))
    await conn.call(command("AUTH", password))
    return conn


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode(), usedforsecurity=False).hexdigest()


@dataclass(frozen=True, slots=True)
class RaceResult:
    engine: str  # "redis-script" (the shared engine) or "racy" (the control)
    trials: int
    burst: int
    cap: int
    over_admissions: int  # trials that admitted more than the cap
    max_admitted: int
    under_admissions: int  # trials that admitted fewer than the cap (none expected)
    leases_left: int  # in Redis after the last trial

    def as_dict(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "trials": self.trials,
            "burst": self.burst,
            "cap": self.cap,
            "over_admissions": self.over_admissions,
            "max_admitted": self.max_admitted,
            "under_admissions": self.under_admissions,
            "leases_left": self.leases_left,
        }


async def race(
    port: int,
    password: str,
    *,
    trials: int,
    burst: int,
    cap: int,
    racy: bool = False,
    parallel: int = 16,
    tick: Callable[[int], None] = lambda _n: None,
) -> RaceResult:
    """`trials` bursts of `burst` simultaneous admissions at concurrency cap `cap`.

    `parallel` trials run at once, each on its own tenant (its own keys in Redis), so a
    round trip on this busy machine carries many trials; each tenant's trial starts with
    no lease held, and its admitted requests are settled before its next."""
    conns = [await connect(port, password) for _ in range(CONNECTIONS)]
    # The engine builds the tickets and the scripts' arguments; its own client, never
    # used here, connects to nothing.
    engine = SharedLimits(Redis(), lease_ttl_s=DEFAULT_LEASE_TTL_S)
    slots = [_Slot.of(engine, f"bench-race-{i}", cap) for i in range(parallel)]
    share = [burst // CONNECTIONS + (i < burst % CONNECTIONS) for i in range(CONNECTIONS)]
    try:
        await conns[0].call(command("SCRIPT", "LOAD", ADMIT_SCRIPT))
        await conns[0].call(command("SCRIPT", "LOAD", SETTLE_SCRIPT))
        await conns[0].call(command("DEL", *(slot.key for slot in slots)))
        over = under = most = done = 0
        ids = itertools.count()
        while done < trials:
            running = slots[: min(parallel, trials - done)]
            rounds = _racy_round if racy else _round
            counts = await rounds(conns, share, running, cap, ids)
            for count in counts:
                over += count > cap
                under += count < min(cap, burst)
                most = max(most, count)
            done += len(running)
            tick(len(running))
        [left] = await conns[0].call(
            command("EVAL", _SUM_ZCARD, len(slots), *(x.key for x in slots))
        )
        await conns[0].call(command("DEL", *(slot.key for slot in slots)))
    finally:
        for conn in conns:
            await conn.close()
    return RaceResult(
        "racy" if racy else "redis-script",
        trials,
        burst,
        cap,
        over,
        most,
        under,
        left if isinstance(left, int) else -1,
    )


# The leases held under every trial tenant, in one reply.
_SUM_ZCARD = "local n = 0 for _, k in ipairs(KEYS) do n = n + redis.call('ZCARD', k) end return n"


@dataclass(frozen=True, slots=True)
class _Slot:
    """One trial tenant: its lease key and its two commands with the ticket id cut out."""

    key: str
    admit: tuple[bytes, bytes]
    settle: tuple[bytes, bytes]

    @classmethod
    def of(cls, engine: SharedLimits, subject: str, cap: int) -> _Slot:
        ticket = engine.ticket(
            [(Subject(Scope.TENANT, subject), Limits(concurrency=cap))], Demand(1, 1)
        )
        keys, args = engine.admit_call(ticket)
        admit = command("EVALSHA", _sha(ADMIT_SCRIPT), len(keys), *keys, *args)
        keys, args = settle_call(ticket, Demand(0, 0))
        settle = command("EVALSHA", _sha(SETTLE_SCRIPT), len(keys), *keys, *args)
        cut = ticket.id.encode()
        head, tail = admit.split(cut)
        settle_head, settle_tail = settle.split(cut)
        return cls(keys[0], (head, tail), (settle_head, settle_tail))


def _id(n: int) -> bytes:
    return b"%016x" % n  # as long as the engine's own ids, so the commands stay well formed


async def _round(
    conns: Sequence[Connection],
    share: Sequence[int],
    slots: Sequence[_Slot],
    cap: int,
    ids: Iterator[int],
) -> list[int]:
    """One burst per slot, all at once; then every admitted ticket settled."""

    async def one(conn: Connection, n: int) -> list[tuple[int, bytes]]:
        sent = [(j, _id(next(ids))) for j in range(len(slots)) for _ in range(n)]
        replies = await conn.call(*(slots[j].admit[0] + i + slots[j].admit[1] for j, i in sent))
        return [s for s, r in zip(sent, replies, strict=True) if isinstance(r, list) and r[0] == 1]

    found = await asyncio.gather(*(one(c, n) for c, n in zip(conns, share, strict=True)))
    admitted = [a for part in found for a in part]
    if admitted:
        await conns[0].call(*(slots[j].settle[0] + i + slots[j].settle[1] for j, i in admitted))
    counts = [0] * len(slots)
    for j, _ in admitted:
        counts[j] += 1
    return counts


async def _racy_round(
    conns: Sequence[Connection],
    share: Sequence[int],
    slots: Sequence[_Slot],
    cap: int,
    ids: Iterator[int],
) -> list[int]:
    """Check, then add, as two steps: what an engine without one atomic step does."""

    async def one(conn: Connection, n: int) -> list[int]:
        asked = [j for j in range(len(slots)) for _ in range(n)]
        seen = await conn.call(*(command("ZCARD", slots[j].key) for j in asked))
        took = [j for j, c in zip(asked, seen, strict=True) if isinstance(c, int) and c < cap]
        if took:
            await conn.call(*(command("ZADD", slots[j].key, 0, _id(next(ids))) for j in took))
        return took

    found = await asyncio.gather(*(one(c, n) for c, n in zip(conns, share, strict=True)))
    await conns[0].call(command("DEL", *(slot.key for slot in slots)))
    counts = [0] * len(slots)
    for part in found:
        for j in part:
            counts[j] += 1
    return counts
