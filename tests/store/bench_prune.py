"""`saltgate usage prune` on SQLite while a gateway-like writer commits: rows deleted per
second, the longest prune transaction, and how long the writer's commits waited.

.venv/bin/python tests/store/bench_prune.py --rows 1000000 --prune-fraction 0.9

The writer is another process recording one usage row every `--interval-ms` through a
gateway's own ledger (saltgate.store.ledger.Ledger: its commit on the event loop, the
10 s busy timeout, its checkpoint thread). Figures: docs/upgrading.md ("Ledger retention").
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path

from saltgate.store.ledger import USAGE_INSERT, Ledger, UsageRecord, new_request_id
from saltgate.store.lifecycle import PRUNE_BATCH_ROWS, prune_usage
from saltgate.store.sqlite import SqliteDatabase


def _record(ts: float) -> UsageRecord:
    return UsageRecord(new_request_id(), ts, "tn_a", "key_a", "m", 1000, None, 50, 200, 12, "pv_x")


def _writer(path: Path, interval_s: float, stop: Event, out: Connection) -> None:
    """Record a row every interval; send back (start, latency) of each record."""

    async def run() -> list[tuple[float, float]]:
        ledger = Ledger(path)
        commits: list[tuple[float, float]] = []
        while not stop.is_set():
            t0 = time.monotonic()
            await ledger.record(_record(time.time()))
            commits.append((t0, time.monotonic() - t0))
            await asyncio.sleep(interval_s)
        await ledger.aclose()
        return commits

    out.send(asyncio.run(run()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--prune-fraction", type=float, default=0.9)
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--batch-rows", type=int, default=PRUNE_BATCH_ROWS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "saltgate.db"
        db = SqliteDatabase(path)
        with db.transaction():
            db.execute_many(USAGE_INSERT, (_record(float(i)) for i in range(args.rows)))
        before = float(int(args.rows * args.prune_fraction))
        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        receive, send = ctx.Pipe(duplex=False)
        writer = ctx.Process(target=_writer, args=(path, args.interval_ms / 1e3, stop, send))
        writer.start()
        time.sleep(3.0)  # the writer starts (spawn: a fresh interpreter), then a baseline
        t0 = time.monotonic()
        result = prune_usage(db, before, batch_rows=args.batch_rows)
        t1 = time.monotonic()
        time.sleep(0.5)
        stop.set()
        commits: list[tuple[float, float]] = receive.recv()
        writer.join()
        db.close()
    during = sorted(lat for start, lat in commits if t0 <= start <= t1)
    baseline = sorted(lat for start, lat in commits if start < t0)
    held = sorted(result.held_s)
    print(
        f"pruned {result.deleted} of {args.rows} rows in {result.seconds:.2f} s "
        f"({result.deleted / result.seconds:,.0f} rows/s), {len(held)} transactions: "
        f"{_spread(held)}"
    )
    for name, lats in (("baseline", baseline), ("during prune", during)):
        print(f"writer {name}: {len(lats)} records, {_spread(lats)}")


def _spread(sorted_s: list[float]) -> str:
    if not sorted_s:
        return "none"
    p99 = sorted_s[min(len(sorted_s) - 1, int(len(sorted_s) * 0.99))]
    return (
        f"median {statistics.median(sorted_s) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, "
        f"max {sorted_s[-1] * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
