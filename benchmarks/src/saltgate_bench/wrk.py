"""Driving wrk: the load it sends (a ~4.4 KB chat request), its Lua script, running it
pinned and time-bounded, and parsing what it prints (`wrk --latency`)."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from saltgate_bench.procs import BenchError, Tools, pinned

MODEL = "sim-model"
CHAT_PATH = "/v1/chat/completions"
BODY_BYTES = 4400
WRK_SLACK_S = 30.0
_TIME_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    duration_s: float
    rps: float
    p50_ms: float
    p75_ms: float
    p90_ms: float
    p99_ms: float
    non_2xx: int = 0
    socket_errors: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        return self.non_2xx + sum(self.socket_errors.values())


def parse_time_ms(text: str) -> float:
    """wrk's time format ('12.34us', '1.20ms', '2.00s', '1.50m') in milliseconds."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(us|ms|s|m|h)\s*", text)
    if match is None:
        raise ValueError(f"not a wrk time: {text!r}")
    return float(match.group(1)) * _TIME_UNITS_MS[match.group(2)]


def parse_wrk_output(text: str) -> WrkResult:
    """Parse `wrk --latency` output; raise ValueError naming what is missing."""
    percentiles: dict[int, float] = {}
    for match in re.finditer(r"^\s*(50|75|90|99)(?:\.0+)?%\s+(\S+)\s*$", text, re.MULTILINE):
        percentiles[int(match.group(1))] = parse_time_ms(match.group(2))
    missing = [p for p in (50, 75, 90, 99) if p not in percentiles]
    if missing:
        raise ValueError(f"wrk output has no latency distribution for {missing} (need --latency)")
    total = re.search(r"^\s*(\d+) requests in ([0-9.]+)(us|ms|s|m|h)", text, re.MULTILINE)
    rps = re.search(r"^Requests/sec:\s+([0-9.]+)", text, re.MULTILINE)
    if total is None or rps is None:
        raise ValueError("wrk output has no request count or Requests/sec line")
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    socket_errors = {}
    if sock is not None:
        socket_errors = {
            k: int(v)
            for k, v in zip(("connect", "read", "write", "timeout"), sock.groups(), strict=True)
        }
    return WrkResult(
        requests=int(total.group(1)),
        duration_s=parse_time_ms(total.group(2) + total.group(3)) / 1000.0,
        rps=float(rps.group(1)),
        p50_ms=percentiles[50],
        p75_ms=percentiles[75],
        p90_ms=percentiles[90],
        p99_ms=percentiles[99],
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=socket_errors,
    )


def chat_body(*, stream: bool, size: int = BODY_BYTES) -> bytes:
    """A chat request of about `size` bytes: a long system prompt, a short user turn."""
    doc: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": ""},
            {
                "role": "user",
                "content": "Summarise the refund policy for annual plans in three bullets.",
            },
        ],
        "max_tokens": 16,
        "temperature": 0,
    }
    if stream:
        doc["stream"] = True
        doc["stream_options"] = {"include_usage": True}
    base = len(json.dumps(doc, separators=(",", ":")))
    sentence = (
        "You are the support assistant of a software company; answer briefly, cite the "
        "policy section you rely on, and never invent prices or dates. "
    )
    doc["messages"][0]["content"] = (sentence * (size // len(sentence) + 1))[: max(0, size - base)]
    return json.dumps(doc, separators=(",", ":")).encode()


def wrk_script(body: bytes, api_key: str) -> str:
    """A wrk Lua script POSTing `body` to the chat route with a bearer key."""
    text = body.decode()
    if "]==]" in text or "]==]" in api_key:
        raise ValueError("body or key contains the Lua long-bracket terminator")
    return (
        'wrk.method = "POST"\n'
        f"wrk.path = {_lua_string(CHAT_PATH)}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = {_lua_string("Bearer " + api_key)}\n'
        f"wrk.body = {_lua_string(text)}\n"
    )


def _lua_string(text: str) -> str:
    return f"[==[{text}]==]"


def run_wrk(
    tools: Tools,
    cpu: int | None,
    port: int,
    script: Path,
    *,
    concurrency: int,
    duration_s: int,
    tls: bool = False,
) -> WrkResult:
    """One wrk run (one thread, `--latency`) against 127.0.0.1:port, pinned to ``cpu``;
    over HTTPS with ``tls`` (wrk keeps its connections: one handshake each)."""
    argv = [
        tools.need("wrk"),
        "-t1",
        f"-c{concurrency}",
        f"-d{duration_s}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        f"{'https' if tls else 'http'}://127.0.0.1:{port}{CHAT_PATH}",
    ]
    try:
        done = subprocess.run(  # noqa: S603 - argv built here
            pinned(tools, cpu, argv),
            capture_output=True,
            text=True,
            timeout=duration_s + WRK_SLACK_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"wrk did not finish within {duration_s + WRK_SLACK_S:.0f}s") from None
    if done.returncode != 0:
        raise BenchError(f"wrk failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    try:
        return parse_wrk_output(done.stdout)
    except ValueError as exc:
        raise BenchError(f"{exc}; wrk said:\n{done.stdout}\n{done.stderr}") from None
