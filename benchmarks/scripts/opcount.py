"""Python work per gateway request, counted rather than timed: opcodes and calls.

Timings on a shared VM drift by tens of percent; the number of Python opcodes a request
executes does not, so it shows whether a change to the hot path removed work. Runs the
gateway in this process against the overhead benchmark's nginx backend (scripts/
bench-setup.sh), sends requests from a plain socket in another thread (not traced), and
traces the event loop's thread with sys.settrace for N requests after a warm-up (the
replica probes are held off while it counts: they run once a second, so on a slower or
busier machine they would add more to every request).

    .venv/bin/python benchmarks/scripts/opcount.py [--requests 500] [--top 30]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvloop

from saltgate.config import load_config
from saltgate.serving.run import start_gateway
from saltgate_bench import overhead as bench
from saltgate_bench.gateway_setup import gateway_config, write_gateway_config
from saltgate_devkit.procs import free_port


def _short(filename: str) -> str:
    return filename.rsplit("site-packages/", maxsplit=1)[-1].rsplit("/src/", maxsplit=1)[-1]


class Tracer:
    """Counts opcodes per file and per function, and calls per file, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.opcodes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.functions: collections.Counter[str] = collections.Counter()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.on:
            return None
        frame.f_trace_opcodes = True
        code = frame.f_code
        if event == "call":
            self.calls[_short(code.co_filename)] += 1
        elif event == "opcode":
            self.opcodes[_short(code.co_filename)] += 1
            self.functions[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return self

    def switch(self, on: bool) -> None:
        self.on = on
        sys.settrace(self if on else None)


def client(
    port: int,
    request: bytes,
    *,
    warmup: int,
    n: int,
    loop: asyncio.AbstractEventLoop,
    tracer: Tracer,
    done: asyncio.Event,
) -> None:
    sock = socket.create_connection(("127.0.0.1", port))

    def one() -> None:
        sock.sendall(request)
        data = b""
        while not (b"\r\n\r\n" in data and data.rstrip().endswith(b"}")):
            data += sock.recv(65536)
        if not data.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"gateway answered {data[:200]!r}")

    for _ in range(warmup):
        one()
    loop.call_soon_threadsafe(tracer.switch, True)
    time.sleep(0.2)
    for _ in range(n):
        one()
    loop.call_soon_threadsafe(tracer.switch, False)
    time.sleep(0.2)
    sock.close()
    loop.call_soon_threadsafe(done.set)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--top", type=int, default=30, help="functions to list")
    args = parser.parse_args()
    runner = bench.probe_bench(Path(tempfile.mkdtemp(prefix="opcount-")))
    tracer = Tracer()
    try:
        backends = runner.start_nginx()
        runner.prepare_saltgate()
        port = free_port()
        assert runner.gateway_state is not None
        text = gateway_config(
            runner.gateway_state, backends.urls, port=port, admin_port=free_port()
        )
        config = load_config(write_gateway_config(runner.workdir / "opcount.toml", text))
        quiet = dataclasses.replace(config.router, probe_interval_s=3600.0)
        config = dataclasses.replace(config, router=quiet)

        async def serve() -> None:
            running = await start_gateway(config)
            done = asyncio.Event()
            threading.Thread(
                target=client,
                args=(port, bench.probe_request(runner.api_key)),
                kwargs={
                    "warmup": 20,
                    "n": args.requests,
                    "loop": asyncio.get_running_loop(),
                    "tracer": tracer,
                    "done": done,
                },
                daemon=True,
            ).start()
            await done.wait()
            await running.close()

        uvloop.install()
        asyncio.run(serve())
    finally:
        runner.stop_all()
    n = args.requests
    print(
        f"per request: {sum(tracer.opcodes.values()) / n:,.0f} opcodes, "
        f"{sum(tracer.calls.values()) / n:,.0f} Python calls"
    )
    for name, count in tracer.opcodes.most_common(20):
        print(f"{count / n:8,.0f} opcodes {tracer.calls[name] / n:5.0f} calls  {name}")
    print()
    for name, count in tracer.functions.most_common(args.top):
        print(f"{count / n:8,.0f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
