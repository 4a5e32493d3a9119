"""Ledger throughput and added latency with N concurrent writers (figures in ledger.py).

.venv/bin/python tests/store/bench_ledger.py --writers 64 --seconds 3 [--uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import uvloop

from saltgate.store.ledger import Ledger, UsageRecord


async def _bench(db: Path, writers: int, seconds: float) -> None:
    ledger = Ledger(db)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def writer(i: int) -> None:
        seq = 0
        while time.perf_counter() < deadline:
            rec = UsageRecord(
                time.time(), f"tn_{i:016x}", f"key_{seq:012x}", "m", 900, 512, 64, 200
            )
            t0 = time.perf_counter()
            await ledger.record(rec)
            latencies.append(time.perf_counter() - t0)
            seq += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(writer(i) for i in range(writers)))
    elapsed = time.perf_counter() - t0
    await ledger.aclose()
    st = ledger.stats()
    q = statistics.quantiles(latencies, n=100)
    print(
        f"writers={writers} records={st.records} in {elapsed:.2f}s: "
        f"{st.records / elapsed:,.0f} records/s, {st.transactions} transactions "
        f"(mean batch {st.records / st.transactions:.1f}, max {st.max_batch_seen}); "
        f"latency per record p50={q[49] * 1e3:.2f}ms p99={q[98] * 1e3:.2f}ms "
        f"max={max(latencies) * 1e3:.2f}ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--writers", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--dir", type=Path, default=None, help="where the db goes (default: tmp)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        coro = _bench(Path(d) / "bench.db", args.writers, args.seconds)
        if args.uvloop:
            uvloop.run(coro)
        else:
            asyncio.run(coro)


if __name__ == "__main__":
    main()
