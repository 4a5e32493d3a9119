"""Ledger throughput and added latency with N concurrent writers, on either backend.

.venv/bin/python tests/store/bench_ledger.py --store sqlite --writers 64 --seconds 3 --uvloop
.venv/bin/python tests/store/bench_ledger.py --store postgres --writers 64 --seconds 3 --uvloop

With --store postgres the benchmark starts its own PostgreSQL (a temporary cluster on a
loopback port, fsync on: saltgate_devkit.services), unless --url names one (password from
--password-file). Figures: saltgate/store/ledger.py (SQLite), docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import uvloop

from saltgate.store.backends import open_database, open_gateway_store
from saltgate.store.ledger import Ledger, UsageRecord, new_request_id
from saltgate.store.pg_ledger import PgLedger
from saltgate.store.settings import StoreSettings
from saltgate_devkit.services import PostgresServer


async def _bench(settings: StoreSettings, writers: int, seconds: float) -> None:
    open_database(settings).close()  # create and migrate outside the measurement
    store = await open_gateway_store(settings)
    ledger = store.ledger
    assert isinstance(ledger, Ledger | PgLedger)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def writer(i: int) -> None:
        seq = 0
        while time.perf_counter() < deadline:
            rec = UsageRecord(
                new_request_id(),
                time.time(),
                f"tn_{i:016x}",
                f"key_{seq:012x}",
                "m",
                900,
                512,
                64,
                200,
            )
            t0 = time.perf_counter()
            await ledger.record(rec)
            latencies.append(time.perf_counter() - t0)
            seq += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(writer(i) for i in range(writers)))
    elapsed = time.perf_counter() - t0
    await store.aclose()
    st = ledger.stats()
    q = statistics.quantiles(latencies, n=100)
    print(
        f"{settings.backend} writers={writers} records={st.records} in {elapsed:.2f}s: "
        f"{st.records / elapsed:,.0f} records/s, {st.transactions} transactions "
        f"(mean batch {st.records / max(st.transactions, 1):.1f}, max {st.max_batch_seen}); "
        f"latency per record p50={q[49] * 1e3:.2f}ms p99={q[98] * 1e3:.2f}ms "
        f"max={max(latencies) * 1e3:.2f}ms"
    )


@contextlib.contextmanager
def _store(args: argparse.Namespace, workdir: Path) -> Iterator[StoreSettings]:
    if args.store == "sqlite":
        yield StoreSettings.sqlite(workdir / "bench.db")
    elif args.url:
        yield StoreSettings(
            "postgresql", args.url, password_file=args.password_file, spool_dir=workdir / "spool"
        )
    else:
        with PostgresServer() as server:
            server.create_database("bench")
            yield server.settings("bench", workdir / "spool")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    ap.add_argument("--writers", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--dir", type=Path, default=None, help="where the db goes (default: tmp)")
    ap.add_argument("--url", help="postgres: an existing database (default: start one)")
    ap.add_argument("--password-file", type=Path, help="postgres: its password, with --url")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d, _store(args, Path(d)) as settings:
        coro = _bench(settings, args.writers, args.seconds)
        if args.uvloop:
            uvloop.run(coro)
        else:
            asyncio.run(coro)


if __name__ == "__main__":
    main()
