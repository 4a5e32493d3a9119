"""The simulated replica's scheduler: waiting queue, prefill steps, decode, and its KV blocks.

Time model (docs/sim.md): prefills run on one accelerator in steps scheduled as vLLM V1's
scheduler does: each step first continues the running requests' prefills in the order they
started, then starts waiting requests first come, first served, while the step's token
budget (`max_num_batched_tokens`, 0: one whole prompt per step) and `max_concurrency`
(vLLM's `--max-num-seqs`) allow; a running prefill takes at most
`long_prefill_token_threshold` tokens of a step when that is set. A request counts as
running (vllm:num_requests_running) from its first step, as waiting until then. A step
takes `prefill_ms_per_1k_tokens` per thousand UNCACHED prompt tokens it computes; then
every output token takes `decode_ms_per_token`, concurrently with other requests. All
waiting is done with event-loop sleeps against absolute deadlines, so a replica costs
almost no CPU and a prefix-cache hit shows in time to first token as it does on a GPU.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
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
    # vLLM's --max-num-batched-tokens: the prompt tokens one step may compute, shared by
    # the running prefills first and then the waiting requests (chunked prefill).
    # 0: no chunking, a step computes one whole prompt.
    max_num_batched_tokens: int = 0
    # vLLM's --long-prefill-token-threshold: a running prefill takes at most this many
    # tokens of a step (unless it is the only request), leaving the rest of the budget to
    # the others. 0: no cap (vLLM's default), the oldest prefill takes the whole budget.
    long_prefill_token_threshold: int = 0

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


@dataclass(slots=True, eq=False)
class _Prefill:
    """One request from its arrival to the end of its prefill."""

    prompt: list[int]
    salt: str | None
    gen: Generation
    request_id: str
    done: asyncio.Future[None]  # set when its prompt is computed (ContextTooLong: refused)
    left: int = 0  # uncached prompt tokens still to compute, from its first step
    admitted: float = 0.0  # its first step: from then it is running
    scheduled: bool = False


class ReplicaEngine:
    """One simulated vLLM engine: a block pool, a waiting queue, a stepper and a time
    model."""

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
        self._waiting: deque[_Prefill] = deque()
        self._prefilling: list[_Prefill] = []  # running, prompt not computed yet, by start
        self._stepper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
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
        arrived = time.monotonic()
        first_token: float | None = None
        item = _Prefill(
            prompt, cache_salt, gen, request_id, asyncio.get_running_loop().create_future()
        )
        self._waiting.append(item)
        self.num_waiting += 1
        self._kick()
        completed = False
        try:
            await item.done
            self.pool.prompt_computed(request_id)
            self._flush_events()
            first_token = time.monotonic()
            if max_tokens == 0:
                gen.finish_reason = "stop"
            async for piece in self._decode(request_id, len(prompt), max_tokens, gen, first_token):
                yield piece
            completed = True
        finally:
            if item.scheduled:
                if item in self._prefilling:
                    self._prefilling.remove(item)
                self.pool.finish(request_id)
                self._flush_events()
                self.num_running -= 1
                self._kick()  # its place and blocks are free
            elif item in self._waiting:
                self._waiting.remove(item)
                self.num_waiting -= 1
            self.metrics.finished(
                RequestTimes(
                    arrived=arrived,
                    admitted=item.admitted or time.monotonic(),
                    first_token=first_token,
                    finished=time.monotonic(),
                    prompt_tokens=len(prompt) if item.scheduled else 0,
                    cached_tokens=gen.cached_tokens,
                    completion_tokens=gen.completion_tokens,
                    finished_reason=gen.finish_reason if completed else "abort",
                )
            )

    def _kick(self) -> None:
        """Something changed that a step may use: start the stepper or wake it."""
        if self._stepper is None:
            if self._waiting or self._prefilling:
                self._stepper = asyncio.get_running_loop().create_task(self._steps())
        else:
            self._wake.set()

    async def _steps(self) -> None:
        """Run prefill steps while there are prefills to compute; sleep while nothing
        can be scheduled (every place or block taken) until a request ends."""
        try:
            while self._waiting or self._prefilling:
                self._wake.clear()
                step = self._schedule()
                if not step:
                    await self._wake.wait()
                    continue
                tokens = sum(n for _, n in step)
                self.metrics.step(tokens)
                await sleep_until(time.monotonic() + self.time_model.prefill_seconds(tokens))
                for item, n in step:
                    item.left -= n
                    if item.left <= 0 and item in self._prefilling:
                        self._prefilling.remove(item)
                        if not item.done.done():
                            item.done.set_result(None)
        finally:
            self._stepper = None

    def _schedule(self) -> list[tuple[_Prefill, int]]:
        """One step's prompt tokens per request, as vLLM V1 schedules them: the running
        prefills first, in the order they started, then the waiting requests in arrival
        order while the budget and `max_concurrency` allow (module doc)."""
        model = self.time_model
        budget = model.max_num_batched_tokens or None  # None: one whole prompt per step
        eligible = self.num_running + len(self._waiting)
        threshold = model.long_prefill_token_threshold if eligible > 1 else 0
        step: list[tuple[_Prefill, int]] = []

        def take(item: _Prefill) -> bool:
            """Give ``item`` its share of the step; whether the step can take more."""
            nonlocal budget
            n = item.left
            if budget is None:
                step.append((item, n))
                return False
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget)
            budget -= n
            step.append((item, n))
            return budget > 0

        for item in self._prefilling:
            if not take(item):
                return step
        waiting = self._waiting
        while waiting and self.num_running < self.max_concurrency:
            item = waiting[0]
            if item.done.done():  # its request was cancelled while it waited
                waiting.popleft()
                self.num_waiting -= 1
                continue
            try:
                cached = self.pool.begin(item.request_id, item.prompt, item.salt)
            except RequestTooLarge as exc:
                waiting.popleft()
                self.num_waiting -= 1
                item.done.set_exception(ContextTooLong(str(exc)))
                continue
            except NotEnoughBlocks:
                break  # it waits for running requests to free blocks, as in vLLM
            waiting.popleft()
            self.num_waiting -= 1
            self.num_running += 1
            item.scheduled = True
            item.admitted = time.monotonic()
            gen = item.gen
            gen.cached_tokens = cached
            full = len(item.prompt) // self.pool.block_size * self.pool.block_size
            gen.created_cache_tokens = max(0, full - cached)
            item.left = len(item.prompt) - cached
            self._prefilling.append(item)
            if not take(item):
                break
        return step

    async def _decode(
        self, request_id: str, prompt_len: int, max_tokens: int, gen: Generation, t0: float
    ) -> AsyncGenerator[str, None]:
        """The output tokens, one per decode step from ``t0`` (the first token's time).

        The first inter-token gap starts at ``t0`` too, not at a second clock read: work
        before the first yield (or the process paused there) must not shorten it, so a
        request's gaps add up to at least its steps, as its time to first token assumes.
        """
        tokens, pieces = filler_pieces(max_tokens, seed=prompt_len)
        step = self.time_model.decode_seconds
        previous = t0
        caching_output = True
        for i, piece in enumerate(pieces):
            since_previous = None
            if i:
                await sleep_until(t0 + i * step)
                # The previous token's KV is computed now (the last one's never is).
                caching_output = caching_output and self._cache_output(request_id, tokens[i - 1])
                now = time.monotonic()
                since_previous, previous = now - previous, now
            self.metrics.token(since_previous)
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

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset()
        self._flush_events()
        return ok
