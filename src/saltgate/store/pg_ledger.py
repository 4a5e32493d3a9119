"""The usage ledger on PostgreSQL: group commit over the network, a local spool when down.

The promise is the SQLite ledger's (saltgate.store.ledger): `record` returns only once its
record is durable, and the gateway awaits it before a response completes. Here durable
means committed in PostgreSQL, or, while PostgreSQL is out of reach, fsync'd to the local
spool (saltgate.store.spool), from which it is replayed when the database is back.

Group commit: one flusher takes everything queued and writes it with one INSERT .. SELECT
FROM unnest(...) statement, one transaction and one round trip per batch; records that
arrive while that commit is in flight form the next batch, so the batch size follows the
load without a timer. Every record carries a unique request id and the insert skips ids
already present, so a commit retried after an unknown outcome (the connection broke
during COMMIT: was it applied?) is spooled and replayed without counting anything twice.

A batch the database refuses (it answered, with an error about the data or the schema)
is spooled too, without leaving direct mode; its replay inserts record by record and sets
aside, in a file beside the spool, only the records still refused, so one bad record
neither blocks the spool nor takes good records with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from saltgate.prices import PriceVersion
from saltgate.store.errors import StoreError
from saltgate.store.ledger import (
    KEY_USE_INTERVAL_S,
    PRICE_INSERT,
    KeyUse,
    LedgerError,
    LedgerStats,
    UsageRecord,
    price_rows,
    release,
)
from saltgate.store.postgres import UNREACHABLE, conninfo, describe_error
from saltgate.store.settings import StoreSettings
from saltgate.store.spool import Spool

log = logging.getLogger(__name__)

_INSERT = (
    "INSERT INTO usage (request_id, ts, tenant_id, key_id, model, prompt_tokens, "
    "cached_tokens, completion_tokens, status, cost_micro_usd, price_version, replica) "
    "SELECT * FROM unnest(%s::text[], %s::float8[], %s::text[], %s::text[], %s::text[], "
    "%s::int4[], %s::int4[], %s::int4[], %s::int4[], %s::int8[], %s::text[], %s::text[]) "
    "ON CONFLICT (request_id) DO NOTHING"
)
_PRICE_INSERT = PRICE_INSERT.replace("?", "%s")
# Ordered by key id, so gateways writing the same keys lock their rows in one order.
_KEY_USE_UPSERT = (
    "INSERT INTO key_last_used (key_id, ts) "
    "SELECT * FROM unnest(%s::text[], %s::float8[]) ORDER BY 1 "
    "ON CONFLICT (key_id) DO UPDATE SET ts = GREATEST(key_last_used.ts, excluded.ts)"
)
# The database did not answer (or cannot be asked: StoreError from reading its password).
_DOWN = (*UNREACHABLE, PoolTimeout, StoreError)

_Item = tuple[UsageRecord, "asyncio.Future[None]"]


async def insert_records(
    conn: psycopg.AsyncConnection[tuple[Any, ...]], records: Sequence[UsageRecord]
) -> None:
    """One statement (one transaction in autocommit mode) for the whole batch."""
    columns = [list(column) for column in zip(*records, strict=True)]
    await conn.execute(_INSERT, columns)


class PgLedger:
    """Group-committing usage writer for a PostgreSQL store, with a spool for outages."""

    def __init__(
        self,
        settings: StoreSettings,
        *,
        spool: Spool | None = None,
        max_batch: int = 2048,
        commit_timeout_s: float = 2.0,
        retry_interval_s: float = 0.5,
        prices: Iterable[PriceVersion] = (),
        key_use_interval_s: float = KEY_USE_INTERVAL_S,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if spool is None:
            if settings.spool_dir is None:
                raise ValueError("a PostgreSQL ledger needs a spool directory")
            spool = Spool(settings.spool_dir)
        self.settings = settings
        self.spool = spool
        self.max_batch = max_batch
        self.commit_timeout_s = commit_timeout_s
        self.retry_interval_s = retry_interval_s
        self.prices = tuple(prices)
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[tuple[Any, ...]]] | None = None
        self._pending: list[_Item] = []
        self._wakeup = asyncio.Event()
        self._recovery_needed = asyncio.Event()
        self._healthy = False
        self._closed = False
        self._flusher: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[None] | None = None
        self._transactions = 0
        self._records = 0
        self._max_batch_seen = 0
        self.spooled = 0
        self.replayed = 0
        self.key_use = KeyUse()
        self.key_use_interval_s = key_use_interval_s
        self._key_use_writer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect, then replay what an earlier process left in the spool, in the background.

        If the database does not answer now, start in spooling mode (StoreError is for
        the key index to raise: a gateway cannot authenticate without a first load).
        """
        loop = asyncio.get_running_loop()
        try:
            self._pool = await self._open_pool()
            self._healthy = True
        except (*_DOWN, psycopg.Error) as exc:
            log.warning(
                "ledger store %s unreachable at start (%s); spooling usage to %s",
                self.settings.describe(),
                describe_error(exc),
                self.spool.directory,
            )
        self._flusher = loop.create_task(self._flush_loop())
        self._recovery = loop.create_task(self._recovery_loop())
        self._key_use_writer = loop.create_task(self._key_use_loop())
        if not self._healthy or self.spool.sealed():
            self._recovery_needed.set()

    @property
    def healthy(self) -> bool:
        """True while records go straight to PostgreSQL (False: to the spool)."""
        return self._healthy

    async def record(self, rec: UsageRecord) -> None:
        """Return once `rec` is committed (or spooled); raise LedgerError if neither."""
        if self._closed or self._flusher is None:
            raise LedgerError("usage ledger is closed" if self._closed else "ledger not started")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((rec, fut))
        self._wakeup.set()
        # A cancelled wait cancels only `fut`: the record stays queued and is committed.
        await fut

    def stats(self) -> LedgerStats:
        return LedgerStats(self._transactions, self._records, self._max_batch_seen)

    async def aclose(self) -> None:
        """Commit (or spool) everything queued, then stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wakeup.set()
        if self._flusher is not None:
            await self._flusher
        for task in (self._recovery, self._key_use_writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._write_key_use()
        await self.spool.seal()
        if self._pool is not None:
            await self._pool.close()

    # -- flushing -------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                batch = self._pending[: self.max_batch]
                del self._pending[: self.max_batch]
                try:
                    await self._commit(batch)
                except Exception as exc:  # a bug must fail these records, not all later ones
                    log.exception("ledger commit failed")
                    release(batch, f"usage records not committed: {type(exc).__name__}")
            if self._closed:
                return

    async def _commit(self, batch: Sequence[_Item]) -> None:
        records = [rec for rec, _ in batch]
        error: str | None = None
        if self._healthy:
            try:
                await asyncio.wait_for(self._insert(records), self.commit_timeout_s)
            except _DOWN as exc:
                self._unreachable(exc)
            except psycopg.Error as exc:
                log.error(
                    "ledger store %s refused %d usage records (%s); spooled, to be "
                    "replayed one by one",
                    self.settings.describe(),
                    len(records),
                    describe_error(exc),
                )
                self._recovery_needed.set()
            else:
                self._transactions += 1
                self._records += len(records)
                self._max_batch_seen = max(self._max_batch_seen, len(records))
                self.key_use.note(records)
                release(batch, None)
                return
        # Not committed, or not known to be: the spool keeps them until they are.
        try:
            await self.spool.append(records)
            self.spooled += len(records)
        except OSError as exc:
            error = (
                f"usage records neither reached {self.settings.describe()} nor could be "
                f"spooled to {self.spool.directory}: {exc.strerror or exc}"
            )
            log.error("%s", error)
        release(batch, error)

    async def _key_use_loop(self) -> None:
        while True:
            await asyncio.sleep(self.key_use_interval_s)
            await self._write_key_use()

    async def _write_key_use(self) -> None:
        """Store the keys' last use; while the store is out of reach, keep the marks for
        the next write (a hint for operators: the usage rows hold the record)."""
        taken = self.key_use.take()
        if not taken:
            return
        stored = False
        if self._healthy and self._pool is not None:
            try:
                async with self._pool.connection(timeout=self.commit_timeout_s) as conn:
                    columns = [[k for k, _ in taken], [ts for _, ts in taken]]
                    await asyncio.wait_for(
                        conn.execute(_KEY_USE_UPSERT, columns), self.commit_timeout_s
                    )
                stored = True
            except (*_DOWN, psycopg.Error) as exc:
                log.warning("keys' last use not stored: %s", describe_error(exc))
        if not stored:
            self.key_use.restore(taken)

    async def _insert(self, records: Sequence[UsageRecord]) -> None:
        assert self._pool is not None
        async with self._pool.connection(timeout=self.commit_timeout_s) as conn:
            await insert_records(conn, records)

    def _unreachable(self, exc: BaseException) -> None:
        if self._healthy:
            self._healthy = False
            log.warning(
                "ledger store %s unreachable (%s); spooling usage to %s",
                self.settings.describe(),
                describe_error(exc),
                self.spool.directory,
            )
        self._recovery_needed.set()

    # -- recovery -------------------------------------------------------------------------

    async def _recovery_loop(self) -> None:
        while True:
            await self._recovery_needed.wait()
            self._recovery_needed.clear()
            while not await self._try_recover_logged():
                await asyncio.sleep(self.retry_interval_s)

    async def _try_recover_logged(self) -> bool:
        try:
            return await self._try_recover()
        except Exception:  # a bug here must not end recovery for the process's life
            log.exception("ledger recovery failed; retrying")
            return False

    async def _try_recover(self) -> bool:
        """Reconnect and replay every claimable sealed segment; True when done."""
        try:
            conn = await asyncio.wait_for(
                psycopg.AsyncConnection.connect(conninfo(self.settings), autocommit=True),
                self.commit_timeout_s,
            )
        except (*_DOWN, psycopg.Error):
            return False
        try:
            async with conn:
                if not self._healthy:
                    pool, self._pool = self._pool, await self._open_pool()
                    if pool is not None:
                        await pool.close(timeout=0)
                    self._healthy = True  # new records go to PostgreSQL from here on
                    log.warning(
                        "ledger store %s reachable again; replaying the spool",
                        self.settings.describe(),
                    )
                await self._replay(conn)
        except (*_DOWN, psycopg.Error) as exc:
            self._unreachable(exc)
            return False
        return True

    async def _replay(self, conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
        """Replay sealed segments until none is left that this process can claim."""
        started = time.monotonic()
        replayed = 0
        while True:
            # A batch that chose the spool just before recovery may have started a
            # segment after the last seal: seal again, and take it too.
            await self.spool.seal()
            claimed = 0
            for path in self.spool.sealed():
                segment = self.spool.claim(path)  # one at a time: a failure leaks no lock
                if segment is None:
                    continue
                claimed += 1
                done = False
                try:
                    refused: list[UsageRecord] = []
                    for start in range(0, len(segment.records), self.max_batch):
                        chunk = segment.records[start : start + self.max_batch]
                        refused += await self._insert_or_sort_out(conn, chunk)
                        self.key_use.note(chunk)  # the requests happened, stored or not
                    if refused:
                        kept = await asyncio.to_thread(self.spool.set_aside, segment, refused)
                        log.error(
                            "ledger store %s refused %d spooled usage records; they are kept in %s",
                            self.settings.describe(),
                            len(refused),
                            kept,
                        )
                    done = True
                finally:
                    segment.release(remove=done)
                replayed += len(segment.records)
            if not claimed:
                break
        if replayed:
            self.replayed += replayed
            log.warning(
                "replayed %d spooled usage records into %s in %.1f s",
                replayed,
                self.settings.describe(),
                time.monotonic() - started,
            )

    async def _insert_or_sort_out(
        self, conn: psycopg.AsyncConnection[tuple[Any, ...]], chunk: Sequence[UsageRecord]
    ) -> list[UsageRecord]:
        """Insert `chunk`; if the database refuses it, insert record by record and return
        the records it still refuses. A database that stops answering raises."""
        timeout = self.commit_timeout_s * 5
        try:
            await asyncio.wait_for(insert_records(conn, chunk), timeout)
        except _DOWN:
            raise
        except psycopg.Error:
            refused = []
            for rec in chunk:
                try:
                    await asyncio.wait_for(insert_records(conn, [rec]), timeout)
                except _DOWN:
                    raise
                except psycopg.Error:
                    refused.append(rec)
            return refused
        return []

    async def _open_pool(self) -> AsyncConnectionPool[psycopg.AsyncConnection[tuple[Any, ...]]]:
        pool: AsyncConnectionPool[psycopg.AsyncConnection[tuple[Any, ...]]] = AsyncConnectionPool(
            conninfo(self.settings),
            min_size=1,
            max_size=2,
            kwargs={"autocommit": True},
            open=False,
            name="saltgate-ledger",
        )
        try:
            await pool.open(wait=True, timeout=self.commit_timeout_s)
            # The versions records name, before any record (a spool's replay included).
            async with (
                pool.connection(timeout=self.commit_timeout_s) as conn,
                conn.cursor() as cursor,
            ):
                # Bounded like every other statement here: a database that connects and
                # then holds this insert (a lock on the table) must not hold up start.
                await asyncio.wait_for(
                    cursor.executemany(_PRICE_INSERT, price_rows(self.prices, time.time())),
                    self.commit_timeout_s,
                )
        except BaseException:
            await pool.close(timeout=0)
            raise
        return pool
