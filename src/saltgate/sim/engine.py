"""The simulated replica's scheduler: admission queue, prefill, decode, and its KV blocks.

Time model (docs/sim.md): a request waits while `max_concurrency` requests are running
(vllm:num_requests_waiting); prefills run one at a time, as one accelerator computes them,
taking `prefill_ms_per_1k_tokens` per thousand UNCACHED prompt tokens; then every output
token takes `decode_ms_per_token`, concurrently with other requests. All waiting is done
with event-loop sleeps against absolute deadlines, so a replica costs almost no CPU and a
prefix-cache hit shows in time to first token as it does on a GPU.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from saltgate.kvevents.wire import KVEvent
from saltgate.sim.blockpool import BlockPool, NotEnoughBlocks, RequestTooLarge
from saltgate.sim.tokenizer import filler_pieces


@dataclass(frozen=True, slots=True)
class TimeModel:
    prefill_ms_per_1k_tokens: float = 20.0
    decode_ms_per_token: float = 2.0

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
    completion_tokens: int = 0
    finish_reason: str = "length"
    pieces: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class ContextTooLong(ValueError):
    """The prompt plus the requested output does not fit the model or the KV cache."""


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
        self.requests_finished = 0

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse what vLLM would refuse: over the model length, or more blocks than exist."""
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise ContextTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {total} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the length of the "
                "prompt or completion."
            )
        needed = -(-total // self.pool.block_size)
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
    ) -> AsyncIterator[str]:
        """Run one request; yields each output token's text (the first is the first token)."""
        request_id = f"sim-{next(self._ids)}"
        self.num_waiting += 1
        admitted = False
        started = False
        try:
            await self._admission.acquire()
            admitted = True
            self.num_waiting -= 1
            self.num_running += 1
            gen.cached_tokens = await self._allocate(request_id, prompt, cache_salt)
            started = True
            async with self._prefill:
                deadline = time.monotonic() + self.time_model.prefill_seconds(
                    len(prompt) - gen.cached_tokens
                )
                await sleep_until(deadline)
            self.pool.prompt_computed(request_id)
            self._flush_events()
            if max_tokens == 0:
                return
            tokens, pieces = filler_pieces(max_tokens, seed=len(prompt))
            step = self.time_model.decode_seconds
            t0 = time.monotonic()
            caching_output = True
            for i, piece in enumerate(pieces):
                if i:
                    await sleep_until(t0 + i * step)
                    # The previous token's KV is computed now (the last one's never is).
                    caching_output = caching_output and self._cache_output(
                        request_id, tokens[i - 1]
                    )
                gen.completion_tokens = i + 1
                gen.pieces.append(piece)
                yield piece
            self._flush_events()
        finally:
            if started:
                self.pool.finish(request_id)
                self._flush_events()
                async with self._blocks_freed:
                    self._blocks_freed.notify_all()
            if admitted:
                self.num_running -= 1
                self._admission.release()
                self.requests_finished += 1
            else:
                self.num_waiting -= 1

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
