"""Latency of one admission under limits: the shared Redis script, and the local log.

Starts a throwaway redis-server (saltgate.bench.services), admits and settles 3,000
requests through `SharedLimits` (one round trip each, every limit kind set, 3,000 entries
in the window), then 20,000 through the in-process `Governor`. docs/limits.md quotes it.

    .venv/bin/python scripts/limits_latency.py
"""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis

from saltgate.bench.services import RedisServer
from saltgate.gateway.shared_limits import SharedLimits
from saltgate.governance.limits import Demand, Governor, Limits

# Every kind of limit set, high enough that nothing is refused.
ALL = Limits(rpm=10**9, input_tpm=10**12, output_tpm=10**12, concurrency=10**6)


async def main():
    srv = RedisServer()
    srv.start()
    try:
        c = Redis.from_url(srv.url(), password=srv.password_file.read_text().strip())
        eng = SharedLimits(c, lease_ttl_s=600)
        lim = [
            (
                ("tenant", "t"),
                ALL,
            ),
            (("key", "k"), Limits(rpm=10**9)),
        ]
        ts = []
        for _ in range(3000):
            t = time.perf_counter()
            tk, _, _ = await eng.admit(lim, Demand(100, 100))
            ts.append(time.perf_counter() - t)
            await eng.settle(tk, Demand(50, 50))
        ts.sort()
        print(
            "redis admit (3000 entries in window): "
            f"p50 {ts[1500] * 1e3:.3f} ms p99 {ts[2970] * 1e3:.3f} ms"
        )
        await c.aclose()
    finally:
        srv.destroy()
    g = Governor()
    g.set_limits(("tenant", "t"), ALL)
    ts = []
    for i in range(20000):
        t = time.perf_counter()
        d = g.admit([("tenant", "t")], Demand(100, 100), i * 0.001)
        ts.append(time.perf_counter() - t)
        g.settle(d.ticket, Demand(50, 50), i * 0.001)
    ts.sort()
    print(f"local admit: p50 {ts[10000] * 1e6:.1f} us p99 {ts[19800] * 1e6:.1f} us")


asyncio.run(main())
