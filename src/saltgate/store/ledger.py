"""Usage ledger: one row per completed request, group-committed to SQLite.

The gateway awaits `Ledger.record` before it completes a response, and `record` returns
only after the row's transaction has committed — so a crash can lose no record of a
response a client received. Records that arrive while a transaction is being written wait
for the next one, so under load many requests share one commit (group commit).

Why WAL with synchronous=NORMAL is enough: a WAL commit hands the frames to the kernel with
write() before COMMIT returns; only the fsync is deferred to checkpoints. A killed process
(SIGKILL, OOM, segfault) cannot take data already in the kernel's page cache with it, so
every acknowledged record survives a *process* crash (tests/store/test_ledger.py kills a
writer to prove it). Only a kernel crash or power loss could drop the last commits; pass
``synchronous="FULL"`` to fsync each group commit if that matters more than latency.

Measured on this machine (2 shared vCPUs, Python 3.11.7, SQLite 3.40.1, ext4 on virtio),
each writer awaiting `record` in a closed loop for 3 s:

    .venv/bin/python tests/store/bench_ledger.py --writers 64 --seconds 3 [--uvloop]

    writers  loop     records/s  mean batch  latency per record p50 / p99 / max
    64       asyncio     49,000          64  1.2 ms / 2.6 ms / 22 ms
    64       uvloop      50,600          64  1.2 ms / 2.9 ms / 22 ms
    8        asyncio     21,800           8  0.30 ms / 0.66 ms / 20 ms
    1        asyncio      5,500           1  0.13 ms / 0.37 ms / 18 ms
    1        uvloop       7,100           1  0.09 ms / 0.49 ms / 14 ms

So the ledger adds ~0.1 ms to an unloaded request and ~1 ms at 64 in flight (a whole
batch is written and acknowledged together); the rare ~20 ms maxima are most likely WAL
auto-checkpoints or scheduler stalls on the shared cores. 50k records/s is far above what
a few vLLM replicas complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from saltgate.store.tenants import open_db

_INSERT = (
    "INSERT INTO usage (ts, tenant_id, key_id, model, prompt_tokens, cached_tokens, "
    "completion_tokens, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


class LedgerError(Exception):
    """A record could not be committed (or the ledger is closed); the response should fail."""


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One completed request, as metered."""

    ts: float
    tenant_id: str
    key_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: int


@dataclass(frozen=True, slots=True)
class LedgerStats:
    """Counters of committed work; transactions < records shows batching happened."""

    transactions: int
    records: int
    max_batch_seen: int


def _row(r: UsageRecord) -> tuple[float, str, str, str, int, int, int, int]:
    return (
        r.ts,
        r.tenant_id,
        r.key_id,
        r.model,
        r.prompt_tokens,
        r.cached_tokens,
        r.completion_tokens,
        r.status,
    )


_Item = tuple[UsageRecord, "asyncio.Future[None]"]


class _Stop:
    """Queue sentinel: drain and exit."""


def _settle(futures: list[asyncio.Future[None]], error: str | None) -> None:
    """Runs on the event loop: resolve the futures of one batch (cancelled ones are done)."""
    for fut in futures:
        if fut.done():
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(LedgerError(error))


class Ledger:
    """Group-committing usage writer: a thread with its own connection, fed by a queue."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_batch: int = 2048,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.path = Path(path)
        self.max_batch = max_batch
        # Opened here so schema/permission errors surface to the caller; used only by the
        # writer thread afterwards.
        self._conn = open_db(self.path, check_same_thread=False)
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        self._queue: queue.SimpleQueue[_Item | _Stop] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._transactions = 0
        self._records = 0
        self._max_batch_seen = 0
        self._thread = threading.Thread(target=self._run, name="saltgate-ledger", daemon=True)
        self._thread.start()

    async def record(self, rec: UsageRecord) -> None:
        """Return once `rec` is committed; raise LedgerError if it could not be."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._closed:
                raise LedgerError("usage ledger is closed")
            self._queue.put((rec, fut))
        await fut

    def stats(self) -> LedgerStats:
        return LedgerStats(self._transactions, self._records, self._max_batch_seen)

    def close(self) -> None:
        """Commit everything queued, stop the writer, close the connection. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_Stop())
        self._thread.join()
        self._conn.close()

    async def aclose(self) -> None:
        """`close` without blocking the event loop."""
        await asyncio.to_thread(self.close)

    # writer thread

    def _run(self) -> None:
        stop = False
        while not stop:
            batch: list[_Item] = []
            item = self._queue.get()
            while True:
                if isinstance(item, _Stop):
                    # record() refuses new items once the sentinel is queued: nothing follows.
                    stop = True
                    break
                batch.append(item)
                if len(batch) >= self.max_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._commit(batch)

    def _commit(self, batch: Sequence[_Item]) -> None:
        error: str | None = None
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(_INSERT, [_row(rec) for rec, _ in batch])
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            error = f"usage records not committed: {exc}"
        else:
            self._transactions += 1
            self._records += len(batch)
            self._max_batch_seen = max(self._max_batch_seen, len(batch))
        # One wake-up per event loop per batch, not per record.
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        for _, fut in batch:
            by_loop.setdefault(fut.get_loop(), []).append(fut)
        for loop, futures in by_loop.items():
            # A closed loop has no one left to tell.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, futures, error)
