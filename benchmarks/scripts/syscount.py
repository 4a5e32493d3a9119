"""System calls per gateway request, counted by strace rather than timed.

Kernel time is a large share of what a request costs the gateway (docs/benchmarks.md), and
it comes in system calls and wake-ups: this counts them. It starts the overhead
benchmark's nginx backend (scripts/bench-setup.sh), runs `saltgate serve` in front of it,
attaches `strace -c` to every thread of the gateway once it serves, sends N requests with
C connections each sending one at a time, detaches, and prints the calls per request by
name. Replica probes are held off while it counts (they are not per-request work).

    .venv/bin/python benchmarks/scripts/syscount.py [--requests 2000] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from saltgate_bench import overhead as bench
from saltgate_bench.gateway_setup import gateway_config, serve_argv, write_gateway_config
from saltgate_devkit.procs import free_port


def send(port: int, request: bytes, n: int) -> None:
    """``n`` requests on one kept-alive connection, each after the previous answer."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(n):
            sock.sendall(request)
            data = b""
            while True:
                data += sock.recv(65536)
                head, sep, rest = data.partition(b"\r\n\r\n")
                if not sep:
                    continue
                length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
                if len(rest) >= length:
                    break


def wait_serving(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the gateway did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="syscount-"))
    runner = bench.probe_bench(workdir)
    try:
        backends = runner.start_nginx()
        runner.prepare_saltgate()
        assert runner.gateway_state is not None
        port = free_port()
        text = gateway_config(
            runner.gateway_state,
            backends.urls,
            port=port,
            admin_port=free_port(),
            router_settings=["probe_interval_s = 3600"],
        )
        argv = serve_argv(write_gateway_config(workdir / "gateway.toml", text))
        gateway = subprocess.Popen(  # noqa: S603 (our own saltgate, our own config)
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_serving(port)
            request = bench.probe_request(runner.api_key)
            send(port, request, 50)  # warm-up
            threads = [f"-p{t}" for t in os.listdir(f"/proc/{gateway.pid}/task")]
            out = workdir / "strace.txt"
            tracer = subprocess.Popen(["strace", "-c", "-o", str(out), *threads])  # noqa: S603, S607
            time.sleep(1.0)  # attached
            per = args.requests // args.concurrency
            workers = [
                threading.Thread(target=send, args=(port, request, per))
                for _ in range(args.concurrency)
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            tracer.send_signal(signal.SIGINT)
            tracer.wait(30)
        finally:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(30)
        n = per * args.concurrency
        print(f"syscalls per request ({n} requests, {args.concurrency} connection(s)):")
        total = 0.0
        for line in out.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 5 and fields[-1] != "total" and fields[3].isdigit():
                calls = int(fields[3])
                total += calls / n
                print(f"  {fields[-1]:<20} {calls / n:6.2f}")
        print(f"  {'total':<20} {total:6.2f}")
    finally:
        runner.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
