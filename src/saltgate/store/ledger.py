"""Usage ledger: one row per completed request, group-committed to SQLite.

(The PostgreSQL ledger, saltgate.store.pg_ledger, keeps the same promise over the network.)

The gateway awaits `Ledger.record` before it completes a response, and `record` returns
only after the row's transaction has committed — so a crash can lose no record of a
response a client received. Under load, records that arrive close together share one
commit (group commit; see `Ledger` for when it waits).

Why WAL with synchronous=NORMAL is enough: a WAL commit hands the frames to the kernel with
write() before COMMIT returns; only the fsync is deferred to checkpoints. A killed process
(SIGKILL, OOM, segfault) cannot take data already in the kernel's page cache with it, so
every acknowledged record survives a *process* crash (tests/store/test_ledger.py kills a
writer to prove it). Only a kernel crash or power loss could drop the last commits; pass
``synchronous="FULL"`` to fsync each group commit if that matters more than latency.

Group commit is what makes a record per request affordable: 64 writers share a commit,
and a record's latency stays under a millisecond at p99 (tests/store/bench_ledger.py; the
figures are in docs/dev/benchmarks-history.md, "SQLite ledger group commit"). WAL checkpoints,
which fsync, run on a thread of their own every second, so the loop seldom waits for one
(`Ledger._checkpoint` says when it does, and why the WAL must be rewound).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

from saltgate.prices import PriceVersion
from saltgate.store.sqlite import open_db, transaction

# A record already there (same request id: a retried commit, a replayed spool) is dropped.
USAGE_INSERT = (
    "INSERT INTO usage (request_id, ts, tenant_id, key_id, model, prompt_tokens, "
    "cached_tokens, completion_tokens, status, cost_micro_usd, price_version, replica) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO NOTHING"
)
# A price version is kept from the first time a gateway billed with it (its effective_from).
PRICE_INSERT = (
    "INSERT INTO prices (version, model, input_micro_usd_per_mtok, "
    "cached_input_micro_usd_per_mtok, output_micro_usd_per_mtok, effective_from) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (version) DO NOTHING"
)


def price_rows(prices: Iterable[PriceVersion], now: float) -> list[tuple[object, ...]]:
    """The `prices` rows of the versions a gateway bills with, first used `now`."""
    return [(p.version, p.model, p.input, p.cached_input, p.output, now) for p in prices]


class LedgerError(Exception):
    """A record could not be committed (or the ledger is closed); the response should fail."""


class UsageRecord(NamedTuple):
    """One completed request, as metered; a tuple, so it is the row SQLite inserts.

    `request_id` is unique per request (`new_request_id`): the ledger keeps one record per
    id, so committing a record twice (a retry after an unknown outcome) counts it once.
    `cached_tokens` is None when the replica did not report it (unknown, not 0); the cost
    is what the request was billed when recorded, with the price version it used (both
    None for a model without a price); `replica` names the replica that answered (its URL
    without user:password; None if none did). docs/billing.md describes every column.
    """

    request_id: str
    ts: float
    tenant_id: str
    key_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    status: int
    cost_micro_usd: int | None = None
    price_version: str | None = None
    replica: str | None = None


def new_request_id() -> str:
    """32 hex digits: the time in ms, then 80 random bits (unique across gateways).

    Time first, so the unique index on request ids grows at its right edge like the table
    instead of touching a random page per insert. The bits need to be unique, not secret:
    `random` (seeded from the OS, and reseeded in a forked child) costs a third of a
    microsecond less per request than os.urandom's system call; two ids collide only if
    two requests in the same millisecond draw the same 80 bits.
    """
    return f"{time.time_ns() // 1_000_000:012x}{random.getrandbits(80):020x}"


# How often a gateway writes when each key was last used (table key_last_used): often
# enough for an operator's "last used", rarely enough to cost the request path nothing.
KEY_USE_INTERVAL_S = 60.0
KEY_USE_UPSERT = (
    "INSERT INTO key_last_used (key_id, ts) VALUES (?, ?) ON CONFLICT (key_id) "
    "DO UPDATE SET ts = CASE WHEN excluded.ts > key_last_used.ts THEN excluded.ts "
    "ELSE key_last_used.ts END"
)


class KeyUse:
    """When each key was last used since the last write, from committed records.

    A commit adds a dict store per record; the marks go to the store in one statement per
    KEY_USE_INTERVAL_S (and at close), never in the usage transaction, which stays one
    table's pages (each more page per commit cost ~20 us: docs/dev/benchmarks-history.md).
    """

    __slots__ = ("marks",)

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def note(self, records: Iterable[UsageRecord]) -> None:
        marks = self.marks
        for rec in records:
            marks[rec.key_id] = rec.ts

    def take(self) -> list[tuple[str, float]]:
        """The marks, by key id (every writer locks rows in one order), and forget them."""
        taken, self.marks = self.marks, {}
        return sorted(taken.items())

    def restore(self, taken: Iterable[tuple[str, float]]) -> None:
        """Marks a write failed to store, kept for the next (newer ones win)."""
        for key_id, ts in taken:
            if self.marks.get(key_id, ts) <= ts:
                self.marks[key_id] = ts


class UsageLedger(Protocol):
    """Where the gateway meters: `Ledger` (SQLite) or PgLedger."""

    async def record(self, rec: UsageRecord) -> None:
        """Return once `rec` is durable; raise LedgerError if it could not be made so."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LedgerStats:
    """Counters of committed work; transactions < records shows batching happened."""

    transactions: int
    records: int
    max_batch_seen: int


_Item = tuple[UsageRecord, "asyncio.Future[None]"]
CHECKPOINT_INTERVAL_S = 1.0
# One wal-index hash table's worth of frames (16 MB of 4 KB pages): past it the WAL is
# rewound. SQLite looks a page up in the WAL by searching these tables newest first.
WAL_REWIND_FRAMES = 4096


class Ledger:
    """Group-committing usage writer on the event loop's own thread.

    Without a ``busy`` callback, records that arrive during one turn of the event loop
    are committed together at the start of the next (one `call_soon`), then every waiter
    is released. A commit costs ~20-50 us of the loop's time (WAL, synchronous=NORMAL: no
    fsync), less than handing each record to a writer thread: that hand-off cost more CPU
    per request and, through the GIL, added milliseconds to the tail at low concurrency
    (docs/dev/benchmarks-history.md).

    ``busy`` (optional) says whether other requests are still being served, i.e. more
    records are on their way. Then the commit waits up to ``max_delay_s`` for them, so
    under load one transaction carries several records (each commit's fixed cost is
    most of it); when nothing else is being served, `record` commits at once, and the
    request goes on without waiting for another turn of the loop.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_batch: int = 2048,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy: Callable[[], bool] | None = None,
        max_delay_s: float = 0.001,
        wal_rewind_frames: int | None = WAL_REWIND_FRAMES,
        checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S,
        prices: Iterable[PriceVersion] = (),
        key_use_interval_s: float = KEY_USE_INTERVAL_S,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if max_delay_s < 0:
            raise ValueError("max_delay_s must be >= 0")
        self.path = Path(path)
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.wal_rewind_frames = wal_rewind_frames  # None: never (a test's control)
        self.checkpoint_interval_s = checkpoint_interval_s
        self.checkpoints = 0  # passes of the checkpoint thread, and of them the rewinds
        self.rewinds = 0
        self.wal_frames = 0  # frames in the WAL at the last pass: what page lookups search
        self._busy = busy
        self._conn = open_db(self.path)
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        # Checkpoints copy the WAL into the database and fsync: milliseconds the event loop
        # must not wait for. A thread with its own connection does them (PASSIVE: writers
        # are never blocked); the loop only appends to the WAL.
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        with transaction(self._conn):  # the versions the records will name, before them
            self._conn.executemany(PRICE_INSERT, price_rows(prices, time.time()))
        self._stop = threading.Event()
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, name="saltgate-ledger-checkpoint", daemon=True
        )
        self._checkpointer.start()
        self._pending: list[_Item] = []
        self._flush_scheduled = False
        self._flush_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transactions = 0
        self._records = 0
        self._max_batch_seen = 0
        self.key_use = KeyUse()
        self.key_use_interval_s = key_use_interval_s
        self._key_use_timer: asyncio.TimerHandle | None = None

    async def record(self, rec: UsageRecord) -> None:
        """Return once `rec` is committed; raise LedgerError if it could not be."""
        if self._closed:
            raise LedgerError("usage ledger is closed")
        loop = self._loop
        if loop is None:  # asked once: asyncio checks the process id (a system call) each time
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._pending.append((rec, fut))
        if self._busy is None:
            if not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush)
        elif self._busy():
            if self._flush_timer is None:
                self._flush_timer = loop.call_later(self.max_delay_s, self._flush)
        else:
            # Nothing else is being served, so no record is on its way: commit now, and
            # the caller goes on without waiting for another turn of the loop.
            self._flush()
        # A cancelled wait cancels only `fut`: the record stays queued and is committed.
        await fut

    def stats(self) -> LedgerStats:
        return LedgerStats(self._transactions, self._records, self._max_batch_seen)

    def close(self) -> None:
        """Commit everything queued, then close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._flush()
        if self._key_use_timer is not None:
            self._key_use_timer.cancel()
        self._write_key_use()
        self._stop.set()
        self._checkpointer.join()
        self._conn.close()

    async def aclose(self) -> None:
        self.close()

    def _checkpoint_loop(self) -> None:
        conn = open_db(self.path, check_same_thread=False)
        try:
            while not self._stop.wait(self.checkpoint_interval_s):
                with contextlib.suppress(sqlite3.Error):
                    self._checkpoint(conn)
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        """Copy the WAL into the database; rewind it once it holds `wal_rewind_frames`.

        PASSIVE copies while writers go on appending. But SQLite rewinds the WAL only
        after a checkpoint that left no frame behind, and under steady load the loop has
        always appended more before the copy ends: with PASSIVE alone the WAL grew
        without bound (200 MB in 9 s at 2,500 requests/s) and every page lookup in it
        slowed, which doubled the gateway's p99 at c=1 (docs/dev/benchmarks-history.md). RESTART
        then copies only the frames written meanwhile and rewinds, holding the writer
        for that copy and one fsync: about one commit a second waits a millisecond or two.
        """
        _busy, frames, _copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self.wal_frames = frames
        if self.wal_rewind_frames is not None and frames >= self.wal_rewind_frames:
            busy, _frames, _copied = conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
            self.rewinds += not busy
        self.checkpoints += 1

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), self.max_batch):
            self._commit(pending[start : start + self.max_batch])

    def _commit(self, batch: Sequence[_Item]) -> None:
        error: str | None = None
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(USAGE_INSERT, [rec for rec, _ in batch])
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OverflowError) as exc:  # OverflowError: an int SQLite can't hold
            error = f"usage records not committed: {exc}"
        else:
            self._transactions += 1
            self._records += len(batch)
            self._max_batch_seen = max(self._max_batch_seen, len(batch))
            self.key_use.note(rec for rec, _ in batch)
            if self._key_use_timer is None and self._loop is not None and not self._closed:
                self._key_use_timer = self._loop.call_later(
                    self.key_use_interval_s, self._write_key_use
                )
        release(batch, error)

    def _write_key_use(self) -> None:
        """Store the keys' last use; on failure keep the marks for the next write (a
        last use is a hint for operators: the usage rows hold the record)."""
        self._key_use_timer = None
        taken = self.key_use.take()
        if not taken:
            return
        try:
            with transaction(self._conn):
                self._conn.executemany(KEY_USE_UPSERT, taken)
        except sqlite3.Error:
            self.key_use.restore(taken)


def release(batch: Sequence[_Item], error: str | None) -> None:
    """Wake the waiters of ``batch``: committed, or LedgerError(error). A waiter that
    gave up (cancelled) is skipped; its record was committed all the same."""
    for _, fut in batch:
        if fut.done():
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(LedgerError(error))
