"""The HTTP edge alone: saltgate's server against uvicorn (httptools, uvloop) on one core.

Should the gateway sit on a well-kept server instead of its own? Both answer a 4.4 KB
POST with a small JSON body from memory, pinned to CPU 1 with wrk on CPU 0, rounds
interleaved; the figures are requests/s and p50 at c=1 and c=32. uvicorn is the most used
asyncio server with the same parser (llhttp) and loop (uvloop), so the difference is the
server layer itself (ASGI's scope, receive and send per request).

    scripts/bench-setup.sh && .bench/venv/bin/pip install 'uvicorn[standard]==0.34.0'
    PYTHONPATH=src .bench/venv/bin/python scripts/edge_compare.py [--rounds 3] [--duration 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ANSWER = b'{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":1}}'

SERVERS = {
    "saltgate-edge": """
import asyncio, uvloop
from saltgate.http import HttpServer, Request, Response
ANSWER = {answer!r}
async def handle(request: Request) -> Response:
    return Response(200, [(b"content-type", b"application/json")], ANSWER)
async def main() -> None:
    await HttpServer(handle).start("127.0.0.1", {port})
    await asyncio.Event().wait()
uvloop.run(main())
""",
    "uvicorn": """
import uvicorn
ANSWER = {answer!r}
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({{"type": "http.response.start", "status": 200, "headers": HEADERS}})
    await send({{"type": "http.response.body", "body": ANSWER}})
uvicorn.run(app, host="127.0.0.1", port={port}, loop="uvloop", http="httptools",
            log_level="warning", access_log=False, lifespan="off")
""",
}

WRK_LUA = """
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{body}'
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise SystemExit(f"server on {port} did not start")


def wrk(port: int, conc: int, duration: int, script: Path) -> tuple[float, float]:
    out = subprocess.run(
        ["taskset", "-c", "0", "wrk", "-t1", f"-c{conc}", f"-d{duration}s", "--latency",
         "-s", str(script), f"http://127.0.0.1:{port}/v1/chat/completions"],
        capture_output=True, text=True, check=True, timeout=duration + 30,
    ).stdout  # fmt: skip
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)\b", out)
    if rps is None or p50 is None:
        raise SystemExit(f"cannot read wrk's output:\n{out}")
    scale = {"us": 1.0, "ms": 1e3, "s": 1e6}[p50.group(2)]
    return float(rps.group(1)), float(p50.group(1)) * scale


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=4, help="seconds per point")
    parser.add_argument("--concurrency", default="1,32")
    args = parser.parse_args()
    body = '{"model":"m","messages":[{"role":"user","content":"' + "x" * 4300 + '"}]}'
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(WRK_LUA.format(body=body))
        for _ in range(args.rounds):
            for name, source in SERVERS.items():
                port = free_port()
                code = source.format(answer=ANSWER, port=port)
                proc = subprocess.Popen(
                    ["taskset", "-c", "1", sys.executable, "-c", code], start_new_session=True
                )
                try:
                    wait_listening(port)
                    wrk(port, 32, 1, script)  # warm-up
                    for conc in (int(c) for c in args.concurrency.split(",")):
                        results.setdefault((name, conc), []).append(
                            wrk(port, conc, args.duration, script)
                        )
                finally:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(10)
    print("| server | conc | req/s (median) | p50 (median) |")
    print("|---|---|---|---|")
    for (name, conc), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rps = statistics.median(r for r, _ in runs)
        p50 = statistics.median(p for _, p in runs)
        print(f"| {name} | {conc} | {rps:,.0f} | {p50:.0f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
