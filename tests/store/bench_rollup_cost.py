"""What the usage rollups add to a SQLite ledger commit: the same commits with the rollup
triggers and with them dropped, interleaved so the machine's load hits both alike.

.venv/bin/python tests/store/bench_rollup_cost.py [--commits 3000] [--prefill 200000]

Each commit is what `Ledger._commit` does (BEGIN IMMEDIATE, one executemany, COMMIT; WAL,
synchronous=NORMAL) with 1 record (an idle gateway) and with 64 (group commit under
load), records of 50 tenants x 3 keys x 2 models x 2 replicas at the current time, on a
ledger prefilled with `--prefill` rows. Figures: docs/benchmarks.md ("Usage queries").
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from saltgate.store.ledger import USAGE_INSERT, UsageRecord, new_request_id
from saltgate.store.sqlite import open_db

TRIGGERS = ("usage_rollup_insert",)


def records(n: int, rng: random.Random, ts: float) -> list[UsageRecord]:
    out = []
    for _ in range(n):
        t = rng.randrange(50)
        out.append(
            UsageRecord(
                new_request_id(),
                ts,
                f"tn_{t}",
                f"key_{t}_{rng.randrange(3)}",
                f"model_{rng.randrange(2)}",
                1000,
                500,
                100,
                200,
                1234,
                "pv_x",
                f"http://replica-{rng.randrange(2)}:8000",
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--commits", type=int, default=3000)
    ap.add_argument("--prefill", type=int, default=200_000)
    args = ap.parse_args()
    rng = random.Random(1)
    work = Path(tempfile.mkdtemp())
    conns = {}
    for name in ("rollups", "none"):
        conn = open_db(work / f"{name}.db")
        conn.execute("PRAGMA synchronous=NORMAL")
        if name == "none":
            for trigger in TRIGGERS:
                conn.execute(f"DROP TRIGGER {trigger}")
        start = time.time() - 86400
        conn.execute("BEGIN IMMEDIATE")
        for i in range(0, args.prefill, 1000):
            conn.executemany(USAGE_INSERT, records(1000, rng, start + i * 86400 / args.prefill))
        conn.execute("COMMIT")
        conns[name] = conn
    for batch in (1, 64):
        times: dict[str, list[float]] = {name: [] for name in conns}
        for _ in range(args.commits):
            for name, conn in conns.items():  # interleaved: load changes hit both
                recs = records(batch, rng, time.time())
                t0 = time.perf_counter()
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany(USAGE_INSERT, recs)
                conn.execute("COMMIT")
                times[name].append(time.perf_counter() - t0)
        line = ", ".join(
            f"{name} median {statistics.median(t) * 1e6:.0f} us" for name, t in times.items()
        )
        print(f"commit of {batch:2} records: {line}")


if __name__ == "__main__":
    main()
