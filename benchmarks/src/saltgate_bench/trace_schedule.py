"""From a request trace to a replay schedule: sessions, tenants, token blocks, send times.

Pure: no sockets, no clocks. The trace format is Mooncake's
(github.com/kvcache-ai/Mooncake, FAST25-release/traces): one JSON object a line with
`timestamp` (ms), `input_length`, `output_length` and `hash_ids`, one id per 512-token
block, chained (an id always follows the same predecessor).

Decisions, each a function here so tests pin them:
- Tokens: each hash id becomes a fixed block of `block_tokens` pseudo-random token ids
  (SHAKE-128 of the id), or of as many one-token words for text prompts, so equal ids
  give equal prefixes. A prompt is the blocks of all
  its ids: the input length rounded up to whole 512-token blocks, then scaled by
  block_tokens / 512. Output lengths are scaled by the same factor (at least 1 token).
- Sessions: a request continues the session that introduced the deepest block it shares
  with earlier requests, ignoring position 0 (the system prompt every request shares);
  sharing nothing beyond it starts a new session.
- Tenants: each new session draws its tenant from a Zipf law over T tenants (weight of
  tenant i proportional to 1 / (i + 1) ** s) with a seeded generator: tenant 0 is hot.
- Time: the schedule keeps the trace's gaps, divided by the time scale S.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
TOKEN_ID_FLOOR = 16  # the simulator reserves ids 0..15 for special tokens
TOKEN_ID_CEILING = 32000  # the simulator's vocabulary size
# Named after the harness's first home, src/saltgate/bench: a new name would change every
# prompt the trace expands to, and so every figure measured since.
_TOKEN_DOMAIN = b"saltgate/bench/replay/block/v1"
_TEXT_DOMAIN = b"saltgate/bench/replay/text/v1"


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of the schedule, as the load generator sends it."""

    index: int  # position in the schedule
    trace_index: int  # position in the trace (0-based)
    at_s: float  # send time, seconds after the replay starts
    tenant: int
    session: int  # index of the session's first request in the trace
    hash_ids: tuple[int, ...]
    max_tokens: int


def _int_field(doc: dict[str, object], name: str, where: str) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: '{name}' must be a non-negative integer, got {value!r}")
    return value


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRequest]:
    """Parse and check a trace: fields, time order, and the hash chains sessions rely on."""
    out: list[TraceRequest] = []
    predecessor: dict[int, int | None] = {}
    last_ts = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"{where}: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise TraceError(f"{where}: expected a JSON object")
        ts = _int_field(doc, "timestamp", where)
        if ts < last_ts:
            raise TraceError(f"{where}: timestamp {ts} goes back in time (previous {last_ts})")
        last_ts = ts
        ids = doc.get("hash_ids")
        if not isinstance(ids, list) or not ids:
            raise TraceError(f"{where}: 'hash_ids' must be a non-empty list of integers")
        for pos, h in enumerate(ids):
            if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                raise TraceError(f"{where}: hash_ids[{pos}] is not a non-negative integer")
            before = ids[pos - 1] if pos else None
            if predecessor.setdefault(h, before) != before:
                raise TraceError(
                    f"{where}: hash id {h} follows {before}, but earlier it followed "
                    f"{predecessor[h]}; the chains are broken, sessions cannot be rebuilt"
                )
        out.append(
            TraceRequest(
                ts,
                _int_field(doc, "input_length", where),
                _int_field(doc, "output_length", where),
                tuple(ids),
            )
        )
    if not out:
        raise TraceError(f"{source}: no requests")
    return out


def load_trace(path: Path) -> list[TraceRequest]:
    try:
        with path.open(encoding="utf-8") as f:
            return parse_trace(f, str(path))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None


def reconstruct_sessions(requests: Sequence[TraceRequest]) -> list[int]:
    """The session of each request: the index of the request that started it."""
    owner: dict[int, int] = {}
    sessions: list[int] = []
    for i, req in enumerate(requests):
        session = i
        for h in reversed(req.hash_ids[1:]):
            found = owner.get(h)
            if found is not None:
                session = found
                break
        for h in req.hash_ids:
            owner.setdefault(h, session)
        sessions.append(session)
    return sessions


def zipf_weights(tenants: int, exponent: float) -> list[float]:
    """Normalised Zipf weights: tenant i gets (1 / (i + 1) ** exponent) / H."""
    if tenants < 1:
        raise ValueError("need at least one tenant")
    raw = [1.0 / (i + 1) ** exponent for i in range(tenants)]
    total = sum(raw)
    return [w / total for w in raw]


def assign_tenants(sessions: Sequence[int], tenants: int, exponent: float, seed: int) -> list[int]:
    """The tenant of each request: its session's, drawn once per session from Zipf."""
    rng = random.Random(seed)
    cumulative = list(accumulate(zipf_weights(tenants, exponent)))
    of_session: dict[int, int] = {}
    out = []
    for session in sessions:
        tenant = of_session.get(session)
        if tenant is None:
            tenant = of_session[session] = rng.choices(range(tenants), cum_weights=cumulative)[0]
        out.append(tenant)
    return out


@lru_cache(maxsize=1 << 16)
def block_tokens(hash_id: int, size: int) -> tuple[int, ...]:
    """The fixed token block that stands for one hash id."""
    digest = hashlib.shake_128(_TOKEN_DOMAIN + hash_id.to_bytes(8, "big")).digest(2 * size)
    span = TOKEN_ID_CEILING - TOKEN_ID_FLOOR
    return tuple(
        TOKEN_ID_FLOOR + int.from_bytes(digest[2 * i : 2 * i + 2], "big") % span
        for i in range(size)
    )


def prompt_tokens(hash_ids: Sequence[int], size: int) -> list[int]:
    """A request's prompt: the blocks of its hash ids, in order."""
    out: list[int] = []
    for h in hash_ids:
        out.extend(block_tokens(h, size))
    return out


@lru_cache(maxsize=1 << 16)
def block_text(hash_id: int, size: int) -> str:
    """The same block as text: `size` words of " " + 2-6 letters, one token each.

    Such a word is exactly one piece of the simulator's tokenizer whatever precedes or
    follows it, so the text of a prompt tokenizes to the blocks of its ids, and equal ids
    give equal token prefixes, as with token-id prompts. Routers that only take text
    (smg refuses token-id prompts) see the same prefixes as text.
    """
    digest = hashlib.shake_128(_TEXT_DOMAIN + hash_id.to_bytes(8, "big")).digest(7 * size)
    words = []
    for i in range(size):
        d = digest[7 * i : 7 * i + 7]
        words.append(" " + "".join(chr(97 + b % 26) for b in d[1 : 3 + d[0] % 5]))
    return "".join(words)


def prompt_text(hash_ids: Sequence[int], size: int) -> str:
    return "".join(block_text(h, size) for h in hash_ids)


def scaled_output_tokens(output_length: int, size: int) -> int:
    return max(1, round(output_length * size / TRACE_BLOCK_TOKENS))


def build_schedule(
    requests: Sequence[TraceRequest],
    *,
    tenants: int,
    zipf_exponent: float,
    seed: int,
    block_size: int,
    time_scale: float,
    start_s: float = 0.0,
    duration_s: float | None = None,
    limit: int | None = None,
) -> list[ReplayRequest]:
    """The requests in [start, start + duration) trace seconds (at most `limit`), timed.

    Sessions and tenants are decided over the whole trace, so choosing a window does not
    change who a request belongs to.
    """
    if time_scale <= 0:
        raise ValueError("time scale must be positive")
    sessions = reconstruct_sessions(requests)
    owners = assign_tenants(sessions, tenants, zipf_exponent, seed)
    start_ms = start_s * 1000.0
    end_ms = None if duration_s is None else start_ms + duration_s * 1000.0
    out: list[ReplayRequest] = []
    for i, req in enumerate(requests):
        if req.timestamp_ms < start_ms:
            continue
        if (end_ms is not None and req.timestamp_ms >= end_ms) or (
            limit is not None and len(out) >= limit
        ):
            break
        out.append(
            ReplayRequest(
                index=len(out),
                trace_index=i,
                at_s=(req.timestamp_ms - start_ms) / 1000.0 / time_scale,
                tenant=owners[i],
                session=sessions[i],
                hash_ids=req.hash_ids,
                max_tokens=scaled_output_tokens(req.output_length, block_size),
            )
        )
    return out
