"""What [tracing] costs per request: the gateway's CPU time and throughput, traced or not.

One `saltgate serve` (a process of its own, so its CPU time is its own) in front of one
zero-compute `saltgate sim`, driven by a closed loop of httpx clients with short
non-streamed completions; rounds alternate tracing off and on (sample_ratio 1.0, the
worst case: every request exported to an OTLP/HTTP sink in this process). The figure that
survives a busy machine is CPU seconds of the gateway per request; requests/s is shown
too. docs/benchmarks.md ("Tracing overhead") has the results.

    .venv/bin/python scripts/trace_overhead.py [--rounds 3] [--duration 10] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from saltgate.config import create_master_key
from saltgate.store.tenants import TenantStore

SALTGATE = str(Path(sys.executable).parent / "saltgate")
BODY = {"model": "sim-model", "prompt": "how much does a span cost", "max_tokens": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def otlp_sink() -> tuple[ThreadingHTTPServer, str]:
    """Accepts OTLP/HTTP exports and drops them."""

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_up(url: str) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(300):
            try:
                await http.get(url)
                return
            except httpx.TransportError:
                await asyncio.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


async def drive(url: str, key: str, seconds: float, concurrency: int) -> tuple[int, list[float]]:
    latencies: list[float] = []
    stop = time.monotonic() + seconds
    headers = {"authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits) as http:

        async def user() -> None:
            while time.monotonic() < stop:
                started = time.monotonic()
                resp = await http.post("/v1/completions", json=BODY)
                assert resp.status_code == 200, resp.text
                latencies.append(time.monotonic() - started)

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return len(latencies), latencies


async def one_round(
    tmp: Path, sim_url: str, key: str, otlp: str | None, args: argparse.Namespace
) -> dict[str, float]:
    port = free_port()
    config = tmp / f"gw-{port}.toml"
    tracing = f'[tracing]\notlp_endpoint = "{otlp}"\n' if otlp else ""
    config.write_text(
        f'[gateway]\nport = {port}\nadmin_port = {free_port()}\nstate_dir = "{tmp / "state"}"\n'
        f'access_log = "off"\n[[replicas]]\nurl = "{sim_url}"\n{tracing}'
    )
    gateway = subprocess.Popen(  # noqa: S603 (our own saltgate, our own config)
        [SALTGATE, "serve", "--config", str(config)], stdout=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_up(url + "/health")
        await drive(url, key, args.warmup, args.concurrency)
        cpu0, t0 = cpu_seconds(gateway.pid), time.monotonic()
        n, latencies = await drive(url, key, args.duration, args.concurrency)
        cpu1, t1 = cpu_seconds(gateway.pid), time.monotonic()
    finally:
        gateway.terminate()
        gateway.wait(30)
    return {
        "rps": n / (t1 - t0),
        "cpu_us": (cpu1 - cpu0) / n * 1e6,
        "p50_ms": statistics.median(latencies) * 1e3,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        state = tmp / "state"
        state.mkdir(mode=0o700)
        create_master_key(state / "master.key")
        with TenantStore.from_state_dir(state) as store:
            store.create_tenant("bench")
            key = store.create_key("bench")[1]
        sim_port = free_port()
        sim = subprocess.Popen(  # noqa: S603 (our own saltgate)
            [SALTGATE, "sim", "--port", str(sim_port), "--prefill-ms-per-1k-tokens", "0",
             "--decode-ms-per-token", "0"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        sink, otlp = otlp_sink()
        results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        try:
            sim_url = f"http://127.0.0.1:{sim_port}"
            await wait_up(sim_url + "/health")
            for _ in range(args.rounds):
                for mode in ("off", "on"):
                    r = await one_round(tmp, sim_url, key, otlp if mode == "on" else None, args)
                    results[mode].append(r)
                    print(f"tracing {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()))
        finally:
            sim.terminate()
            sim.wait(30)
            sink.shutdown()
    for mode, rounds in results.items():
        medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"median tracing {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))


if __name__ == "__main__":
    asyncio.run(main())
