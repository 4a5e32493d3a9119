"""The replay's load generator: one asyncio process sending the schedule on time.

It uses the project's pooled HTTP/1.1 client (UpstreamPool: raw asyncio protocols and
httptools), not httpx, so a few hundred streams a second cost it little; the report
carries its own overhead (how late each send was against the schedule, and its CPU use)
so a run where the generator was the bottleneck shows it.

Every request is a streaming /v1/completions call with the prompt as text (one token per
word) or as token ids, and `stream_options.include_usage`, so the client measures time to
first token itself and reads `cached_tokens` from the usage chunk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from saltgate.http import UpstreamError, UpstreamPool
from saltgate_bench.replay_metrics import Outcome, percentile_ms
from saltgate_bench.trace_schedule import ReplayRequest, prompt_text, prompt_tokens

COMPLETIONS_PATH = b"/v1/completions"
SESSION_HEADER = b"x-session-id"
UNFINISHED = "unfinished"  # how the error of a request cut off by the drain timeout starts


class StreamReader:
    """Reads an OpenAI SSE stream incrementally: first token, usage, error, [DONE]."""

    __slots__ = ("_buf", "done", "error", "got_token", "usage")

    def __init__(self) -> None:
        self._buf = b""
        self.got_token = False
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, data: bytes) -> bool:
        """Consume bytes; True if the first token arrived in them."""
        first = False
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                first = self._event(line[5:].strip()) or first
        return first

    def _event(self, payload: bytes) -> bool:
        if payload == b"[DONE]":
            self.done = True
            return False
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            self.error = "malformed event"
        elif "error" in doc:
            err = doc["error"]
            kind = err.get("type") if isinstance(err, dict) else None
            self.error = f"error event ({kind or 'no type'})"
        else:
            usage = doc.get("usage")
            if isinstance(usage, dict):
                self.usage = usage
            if not self.got_token:
                self.got_token = any(
                    isinstance(c, dict) and (c.get("text") or (c.get("delta") or {}).get("content"))
                    for c in doc.get("choices") or ()
                )
                return self.got_token
        return False


def cached_tokens_of(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


RequestParts = tuple[list[tuple[bytes, bytes]], bytes]  # headers, body


@dataclass(frozen=True, slots=True)
class RequestShape:
    """How a target wants its requests: a key per tenant (the gateway), a cache_salt per
    tenant in the body (the peers), and the session id header (vllm-router's
    consistent_hash keys on X-Session-ID)."""

    model: str
    block_size: int
    text: bool = True  # the prompt as text (one token per word) or as token ids
    tenant_keys: Sequence[str] = ()
    tenant_salts: Sequence[str] = ()
    session_header: bool = False

    def parts(self, req: ReplayRequest) -> RequestParts:
        headers = [(b"content-type", b"application/json")]
        if self.tenant_keys:
            headers.append((b"authorization", b"Bearer " + self.tenant_keys[req.tenant].encode()))
        if self.session_header:
            headers.append((SESSION_HEADER, b"t%d-s%d" % (req.tenant, req.session)))
        doc: dict[str, Any] = {
            "model": self.model,
            "prompt": (prompt_text if self.text else prompt_tokens)(req.hash_ids, self.block_size),
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.tenant_salts:
            doc["cache_salt"] = self.tenant_salts[req.tenant]
        return headers, orjson.dumps(doc)

    def probe_parts(self) -> RequestParts:
        """A tiny whole (non-streaming) request as tenant 0: too short to fill a cache block."""
        headers = [(b"content-type", b"application/json")]
        prompt: str | list[int] = " ready" if self.text else [1, 2, 3]
        doc: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": 1}
        if self.tenant_keys:
            headers.append((b"authorization", b"Bearer " + self.tenant_keys[0].encode()))
        if self.tenant_salts:
            doc["cache_salt"] = self.tenant_salts[0]
        return headers, orjson.dumps(doc)


@dataclass(slots=True)
class ReplayRun:
    outcomes: list[Outcome | None]
    send_lag_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0

    def overhead(self) -> dict[str, Any]:
        """The load generator's own cost: lateness against the schedule and CPU share."""
        return {
            "send_lag_p50_ms": percentile_ms(self.send_lag_s, 50),
            "send_lag_p99_ms": percentile_ms(self.send_lag_s, 99),
            "send_lag_max_ms": percentile_ms(self.send_lag_s, 100),
            "cpu_pct": round(100.0 * self.cpu_s / self.wall_s, 1) if self.wall_s else None,
        }


async def _one(
    pool: UpstreamPool,
    shape: RequestShape,
    req: ReplayRequest,
    out: Outcome,
    clock: Callable[[], float],
    *,
    built: RequestParts | None,
) -> None:
    headers, body = built if built is not None else shape.parts(req)
    try:
        resp = await pool.request(b"POST", COMPLETIONS_PATH, headers, body)
        request_id = resp.header(b"x-request-id")
        if request_id is not None:
            out.request_id = request_id.decode("ascii", "replace")
        if resp.status != 200:
            await resp.read()
            out.error = f"HTTP {resp.status}"
            return
        reader = StreamReader()
        async for chunk in resp.chunks():
            if reader.feed(chunk):
                out.first_token_at = clock()
        if reader.error is not None:
            out.error = reader.error
        elif not reader.done:
            out.error = "stream ended without [DONE]"
        elif reader.usage is None or out.first_token_at is None:
            out.error = "no usage chunk" if out.first_token_at else "no token"
        else:
            out.prompt_tokens = int(reader.usage.get("prompt_tokens") or 0)
            out.cached_tokens = cached_tokens_of(reader.usage)
            out.completion_tokens = int(reader.usage.get("completion_tokens") or 0)
            out.ok = True
    except UpstreamError as exc:
        out.error = f"{'no response' if exc.before_response else 'broken stream'}: {exc}"
    finally:
        out.done_at = clock()


async def replay(
    pool: UpstreamPool,
    schedule: Sequence[ReplayRequest],
    shape: RequestShape,
    *,
    drain_timeout_s: float,
    on_done: Callable[[], None] = lambda: None,
    t0: float | None = None,
    built: Sequence[RequestParts] | None = None,
) -> ReplayRun:
    """Send every request at its time; wait for all (at most drain_timeout_s after the last).

    ``t0``: the monotonic time the schedule starts at (default: now), so that a fault
    injected beside the replay can be placed on the same clock as the outcomes.
    ``built``: each request's headers and body made beforehand (`RequestShape.parts`),
    for prompts so long that making them while sending would stall the event loop, and
    so delay the sends and the first-token times measured beside them."""
    if t0 is None:
        t0 = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    run = ReplayRun(outcomes=[None] * len(schedule))
    cpu0 = time.process_time()
    tasks: set[asyncio.Task[None]] = set()
    for req in schedule:
        delay = req.at_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        now = clock()
        run.send_lag_s.append(max(0.0, now - req.at_s))
        out = Outcome(sent_at=now)
        run.outcomes[req.index] = out
        parts = built[req.index] if built is not None else None
        task = asyncio.create_task(_one(pool, shape, req, out, clock, built=parts))
        task.add_done_callback(lambda _t: on_done())
        tasks.add(task)
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for late in run.outcomes:
            if late is not None and not late.ok and late.error is None:
                late.error = f"{UNFINISHED} {drain_timeout_s:.0f} s after the last send"
    run.wall_s = clock()
    run.cpu_s = time.process_time() - cpu0
    return run
