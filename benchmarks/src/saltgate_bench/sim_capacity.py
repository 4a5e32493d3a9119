"""How much one simulated replica sustains on one core, and how many fit on one machine.

    scripts/bench-setup.sh   # wrk and taskset
    .venv/bin/saltgate-bench sim-capacity [--duration 5] [--replicas 64]

Throughput: one `saltgate sim` pinned to core 1 with a zero time model (so the CPU cost
per request is all there is), wrk pinned to core 0 posting a ~4.4 KB chat request, whole
and streamed (16 output tokens). Footprint: N replicas started at once with the default
time model; resident memory and idle CPU per replica, and a request answered by each.
Results go to docs/benchmarks.md ("Replica simulator").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from saltgate.sim.run import sim_command
from saltgate_bench.cpu import proc_ticks
from saltgate_bench.procs import (
    BenchError,
    default_tools_venv,
    find_tools,
    http_request,
    pinned,
    workdir,
)
from saltgate_bench.wrk import chat_body, run_wrk, wrk_script
from saltgate_devkit.procs import Proc, free_port

CONCURRENCY = 32
JSON = {"content-type": "application/json"}  # the simulator, as vLLM, refuses other bodies


def _sim_argv(port: int, *, zero_time: bool) -> list[str]:
    if zero_time:
        return sim_command(port, prefill_ms_per_1k_tokens=0, decode_ms_per_token=0)
    return sim_command(port)


def _wait_ready(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http_request(port, "GET", "/health", timeout=1.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise BenchError(f"simulated replica on port {port} not ready within {timeout:.0f}s")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_seconds(pid: int) -> float:
    return sum(proc_ticks(pid).values()) / os.sysconf("SC_CLK_TCK")


def throughput(duration: int, work: Path) -> list[tuple[str, float, float, float]]:
    """(mode, requests/s, p50 ms, p99 ms) for whole and streamed answers on one core."""
    tools = find_tools(default_tools_venv())
    port = free_port()
    sim = Proc("sim", pinned(tools, 1, _sim_argv(port, zero_time=True)), work / "sim.log")
    rows = []
    try:
        _wait_ready(port)
        for mode, stream in (("whole", False), ("streamed", True)):
            script = work / f"{mode}.lua"
            script.write_text(wrk_script(chat_body(stream=stream), "unused"))
            result = run_wrk(tools, 0, port, script, concurrency=CONCURRENCY, duration_s=duration)
            if result.errors:
                raise BenchError(
                    f"{mode}: {result.errors} failed requests ({result.non_2xx} non-2xx, "
                    f"socket errors {result.socket_errors})"
                )
            rows.append((mode, result.rps, result.p50_ms, result.p99_ms))
    finally:
        sim.stop()
    return rows


def footprint(replicas: int, work: Path) -> tuple[float, float, float]:
    """(start seconds, mean RSS MB, idle CPU % of a core) per replica for `replicas` at once."""
    ports = [free_port() for _ in range(replicas)]
    start = time.monotonic()
    procs = [
        Proc(f"sim{i}", _sim_argv(p, zero_time=False), work / f"sim{i}.log")
        for i, p in enumerate(ports)
    ]
    try:
        for port in ports:
            _wait_ready(port, timeout=120.0)
        started = time.monotonic() - start
        body = b'{"model":"sim-model","prompt":"hello","max_tokens":4}'
        for port in ports:
            status = http_request(
                port, "POST", "/v1/completions", body, headers=JSON, timeout=10.0
            )[0]
            if status != 200:
                raise BenchError(f"replica on port {port} answered {status}")
        cpu0 = [_cpu_seconds(p.pid) for p in procs]
        time.sleep(5.0)
        idle = [(_cpu_seconds(p.pid) - c) / 5.0 * 100 for p, c in zip(procs, cpu0, strict=True)]
        rss = [_rss_mb(p.pid) for p in procs]
    finally:
        for proc in procs:
            proc.stop()
    return started / replicas, sum(rss) / len(rss), sum(idle) / len(idle)


HELP = "how much one simulated replica sustains on one core, and how many fit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk point")
    parser.add_argument("--replicas", type=int, default=64, help="replicas for the footprint")


def run(args: argparse.Namespace) -> int:
    """The `saltgate-bench sim-capacity` command."""
    with workdir("sg-simcap-") as tmp:
        try:
            rows = throughput(args.duration, tmp)
            per_start, rss, idle = footprint(args.replicas, tmp)
        except BenchError as exc:
            print(f"sim_capacity: {exc}", file=sys.stderr)
            return 1
    print(f"One replica on one core, wrk c={CONCURRENCY}, ~4.4 KB chat, 16 output tokens:")
    print("| answer | requests/s | p50 ms | p99 ms |\n|---|---|---|---|")
    for mode, rps, p50, p99 in rows:
        print(f"| {mode} | {rps:,.0f} | {p50:.2f} | {p99:.2f} |")
    memory_bound = int(24 * 1024 / rss)
    print(
        f"\n{args.replicas} replicas at once: {per_start * 1000:.0f} ms to start each, "
        f"{rss:.1f} MB resident each, {idle:.2f}% of a core each when idle; "
        f"24 GiB holds about {memory_bound} replicas (before their KV-cache maps fill)."
    )
    return 0
