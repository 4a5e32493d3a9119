"""The simulated replica's scheduler: admission queue, prefill, decode, and its KV blocks.

Time model (docs/sim.md): a request waits while `max_concurrency` requests are running
(vllm:num_requests_waiting); prefills run one at a time, as one accelerator computes them,
taking `prefill_ms_per_1k_tokens` per thousand UNCACHED prompt tokens, in turns of at most
`prefill_chunk_tokens` when that is set (vLLM's chunked prefill); then every output
token takes `decode_ms_per_token`, concurrently with other requests. All waiting is done
with event-loop sleeps against absolute deadlines, so a replica costs almost no CPU and a
prefix-cache hit shows in time to first token as it does on a GPU.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from saltgate.kvevents.wire import KVEvent
from saltgate.sim.blockpool import BlockPool, NotEnoughBlocks, RequestTooLarge
from saltgate.sim.metrics import RequestTimes, SimMetrics
from saltgate.sim.tokenizer import filler_pieces


@dataclass(frozen=True, slots=True)
class TimeModel:
    prefill_ms_per_1k_tokens: float = 20.0
    decode_ms_per_token: float = 2.0
    # A prefill holds the accelerator for at most this many tokens, then waits its turn
    # again behind the prefills that arrived meanwhile, so a short prompt is not stuck
    # behind a long one (vLLM schedules long prompts in chunks). 0: a prompt in one go.
    prefill_chunk_tokens: int = 0

    def prefill_seconds(self, uncached_tokens: int) -> float:
        return uncached_tokens * self.prefill_ms_per_1k_tokens / 1_000_000.0

    @property
    def decode_seconds(self) -> float:
        return self.decode_ms_per_token / 1000.0


@dataclass(slots=True)
class Generation:
    """What one request produced; filled in as it runs."""

    prompt_tokens: int
    cached_tokens: int = 0
    created_cache_tokens: int = 0
    """Prompt tokens this request's prefill wrote to the prefix cache (full blocks not hit),
    as vLLM counts them when the first output is ready."""
    completion_tokens: int = 0
    finish_reason: str = "length"
    pieces: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class ContextTooLong(ValueError):
    """The prompt plus the requested output does not fit the KV cache."""


async def sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


class ReplicaEngine:
    """One simulated vLLM engine: a block pool, a queue and a time model."""

    def __init__(
        self,
        *,
        pool: BlockPool,
        time_model: TimeModel,
        max_concurrency: int,
        max_model_len: int,
        publish: Callable[[list[KVEvent]], None] | None = None,
    ) -> None:
        self.pool = pool
        self.time_model = time_model
        self.max_concurrency = max_concurrency
        self.max_model_len = max_model_len
        self._publish = publish
        self._admission = asyncio.Semaphore(max_concurrency)
        self._prefill = asyncio.Lock()
        self._blocks_freed = asyncio.Condition()
        self._ids = itertools.count()
        self.num_running = 0
        self.num_waiting = 0
        self.metrics = SimMetrics()

    @property
    def requests_finished(self) -> int:
        """Requests that ended, however they ended (vllm:request_success_total)."""
        return sum(self.metrics.success.values())

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse a request needing more blocks than the pool has: waiting would not help.

        vLLM's context-length checks come first (saltgate.sim.protocol); this one is the
        simulator's own, for a pool smaller than one request.
        """
        needed = -(-(prompt_len + max_tokens) // self.pool.block_size)
        if needed > self.pool.capacity:
            raise ContextTooLong(
                f"The request needs {needed} KV-cache blocks but the replica has only "
                f"{self.pool.capacity}; shorten the prompt or the completion."
            )

    def _flush_events(self) -> None:
        events = self.pool.take_events()
        if events and self._publish is not None:
            self._publish(events)

    async def generate(
        self, prompt: list[int], max_tokens: int, cache_salt: str | None, gen: Generation
    ) -> AsyncGenerator[str, None]:
        """Run one request; yields each output token's text (the first is the first token).

        ``max_tokens=0`` is a pooling request: a prefill and no output, finished "stop".
        """
        request_id = f"sim-{next(self._ids)}"
        arrived = admitted = time.monotonic()
        first_token: float | None = None
        self.num_waiting += 1
        admitted_ok = started = completed = False
        try:
            await self._admission.acquire()
            admitted_ok = True
            admitted = time.monotonic()
            self.num_waiting -= 1
            self.num_running += 1
            gen.cached_tokens = await self._allocate(request_id, prompt, cache_salt)
            full = len(prompt) // self.pool.block_size * self.pool.block_size
            gen.created_cache_tokens = max(0, full - gen.cached_tokens)
            started = True
            await self._prefill_turns(len(prompt) - gen.cached_tokens)
            self.pool.prompt_computed(request_id)
            self._flush_events()
            first_token = time.monotonic()
            if max_tokens == 0:
                gen.finish_reason = "stop"
            async for piece in self._decode(request_id, len(prompt), max_tokens, gen, first_token):
                yield piece
            completed = True
        finally:
            if started:
                self.pool.finish(request_id)
                self._flush_events()
                async with self._blocks_freed:
                    self._blocks_freed.notify_all()
            if admitted_ok:
                self.num_running -= 1
                self._admission.release()
            else:
                self.num_waiting -= 1
            self.metrics.finished(
                RequestTimes(
                    arrived=arrived,
                    admitted=admitted,
                    first_token=first_token,
                    finished=time.monotonic(),
                    prompt_tokens=len(prompt) if started else 0,
                    cached_tokens=gen.cached_tokens,
                    completion_tokens=gen.completion_tokens,
                    finished_reason=gen.finish_reason if completed else "abort",
                )
            )

    async def _prefill_turns(self, uncached: int) -> None:
        """Compute `uncached` prompt tokens on the one accelerator, a chunk per turn; the
        lock is first come, first served, so turns alternate between waiting prefills."""
        chunk = self.time_model.prefill_chunk_tokens or uncached
        while True:
            part = min(chunk, uncached)
            async with self._prefill:
                await sleep_until(time.monotonic() + self.time_model.prefill_seconds(part))
            uncached -= part
            if uncached <= 0:
                return

    async def _decode(
        self, request_id: str, prompt_len: int, max_tokens: int, gen: Generation, t0: float
    ) -> AsyncGenerator[str, None]:
        """The output tokens, one per decode step from ``t0`` (the first token's time)."""
        tokens, pieces = filler_pieces(max_tokens, seed=prompt_len)
        step = self.time_model.decode_seconds
        previous = t0
        caching_output = True
        for i, piece in enumerate(pieces):
            if i:
                await sleep_until(t0 + i * step)
                # The previous token's KV is computed now (the last one's never is).
                caching_output = caching_output and self._cache_output(request_id, tokens[i - 1])
            now = time.monotonic()
            self.metrics.token(now - previous if i else None)
            previous = now
            gen.completion_tokens = i + 1
            gen.pieces.append(piece)
            yield piece
        self._flush_events()

    def _cache_output(self, request_id: str, token: int) -> bool:
        """Add a decoded token to the request's blocks; False once the pool is full.

        vLLM would preempt a request here; the simulator instead stops caching that
        request's output, which changes no timing and keeps the prompt's blocks intact.
        """
        try:
            self.pool.append_output(request_id, [token])
        except NotEnoughBlocks:
            return False
        return True

    async def _allocate(self, request_id: str, prompt: list[int], salt: str | None) -> int:
        """Take KV blocks for the prompt, waiting for running requests to free some."""
        while True:
            try:
                return self.pool.begin(request_id, prompt, salt)
            except RequestTooLarge as exc:
                raise ContextTooLong(str(exc)) from None
            except NotEnoughBlocks:
                async with self._blocks_freed:
                    await self._blocks_freed.wait()

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset()
        self._flush_events()
        return ok
