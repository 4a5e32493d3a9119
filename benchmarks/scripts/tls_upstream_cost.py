"""CPU the gateway's upstream pool spends per request over TLS, against plain http.

The overhead benchmark (`saltgate-bench overhead --upstream-tls`) measures the whole hop,
but on a shared machine its rates drift by more than TLS costs. This isolates the part TLS
changes: the pool (saltgate.http.client, on uvloop as `saltgate serve` runs it) sending the
benchmark's 4.4 KB chat body to the overhead benchmark's nginx (scripts/bench-setup.sh)
and reading its answer, once over plain ports and once over TLS ports with the
certificate verified, alternating rounds. It reports the process's CPU time per request
(time.process_time: what this process ran, whoever else shares the core) with kept-alive
connections, and per new connection (the handshake a pool pays once per connection).

    taskset -c 1 .venv/bin/python benchmarks/scripts/tls_upstream_cost.py [--requests 20000]
        [--rounds 5] [--concurrency 8] [--connections 300]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import uvloop

from saltgate.http import UpstreamPool
from saltgate.http.tls import client_context
from saltgate_bench import overhead
from saltgate_bench.wrk import chat_body

HEADERS = [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-bench")]
PATH = b"/v1/chat/completions"


async def per_request(pool: UpstreamPool, requests: int, concurrency: int) -> float:
    """CPU seconds per request, over ``requests`` kept-alive exchanges."""
    body = chat_body(stream=False)

    async def worker(count: int) -> None:
        for _ in range(count):
            response = await pool.request(b"POST", PATH, HEADERS, body)
            await response.read()
            assert response.status == 200

    start = time.process_time()
    await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
    return (time.process_time() - start) / (requests // concurrency * concurrency)


async def per_connection(port: int, tls: ssl.SSLContext | None, count: int) -> float:
    """CPU seconds per new connection (connect, handshake, one request, close)."""
    start = time.process_time()
    for _ in range(count):
        pool = UpstreamPool("127.0.0.1", port, tls=tls)
        response = await pool.request(b"GET", b"/health", [])
        await response.read()
        await pool.close()
    return (time.process_time() - start) / count


async def main(args: argparse.Namespace, plain_port: int, tls_port: int, ca: Path) -> None:
    context = client_context(ca)
    ports = {"http": (plain_port, None), "https": (tls_port, context)}
    pools = {name: UpstreamPool("127.0.0.1", port, tls=tls) for name, (port, tls) in ports.items()}
    for pool in pools.values():  # warm-up: connections made, caches warm
        await per_request(pool, 2000, args.concurrency)
    kept: dict[str, list[float]] = {name: [] for name in pools}
    fresh: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(args.rounds):
        for name, pool in pools.items():
            kept[name].append(await per_request(pool, args.requests, args.concurrency))
            fresh[name].append(await per_connection(*ports[name], args.connections))
    for pool in pools.values():
        await pool.close()
    print(f"{args.rounds} rounds, {args.requests} requests at concurrency {args.concurrency}, ")
    print(f"{args.connections} new connections per round; CPU us, median (min-max)")
    for label, table in (("per kept-alive request", kept), ("per new connection", fresh)):
        for name, values in table.items():
            us = [v * 1e6 for v in values]
            print(
                f"  {label:24} {name:5} {statistics.median(us):8.1f} ({min(us):.1f}-{max(us):.1f})"
            )
        extra = statistics.median(table["https"]) - statistics.median(table["http"])
        print(f"  {label:24} TLS adds {extra * 1e6:.1f} us")


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--connections", type=int, default=300)
    args = parser.parse_args()
    runner = overhead.probe_bench(Path(tempfile.mkdtemp(prefix="tls-cost-")))
    runner.o = dataclasses.replace(runner.o, upstream_tls=True)
    try:
        backends = runner.start_nginx()
        assert backends.ca is not None
        uvloop.run(main(args, backends.ports[0], backends.tls_ports[0], backends.ca))
    finally:
        runner.stop_all()


if __name__ == "__main__":
    run()
