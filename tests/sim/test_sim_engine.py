"""The engine's time model without sockets: chunked prefill lets a short prompt that
arrives behind a long one finish its prefill first; without chunks it waits for the whole
long prompt (the control)."""

from __future__ import annotations

import asyncio
import time

import pytest

from saltgate.sim.blockpool import BlockPool
from saltgate.sim.engine import Generation, ReplicaEngine, TimeModel

LONG, SHORT = 4000, 40  # tokens; at 1 ms per token the long prefill takes 4 s


def _engine(chunk: int) -> ReplicaEngine:
    return ReplicaEngine(
        pool=BlockPool(1024, 16, "sha256"),
        time_model=TimeModel(
            prefill_ms_per_1k_tokens=1000.0, decode_ms_per_token=0.0, prefill_chunk_tokens=chunk
        ),
        max_concurrency=8,
        max_model_len=32768,
    )


async def _first_token(
    engine: ReplicaEngine, prompt: list[int], done: list[str], name: str
) -> None:
    async for _ in engine.generate(prompt, 1, None, Generation(len(prompt))):
        done.append(name)


@pytest.mark.parametrize(("chunk", "first"), [(200, "short"), (0, "long")])
def test_a_short_prompt_behind_a_long_one_waits_one_chunk(chunk: int, first: str) -> None:
    async def main() -> list[str]:
        engine = _engine(chunk)
        done: list[str] = []
        long = asyncio.create_task(_first_token(engine, list(range(1, LONG + 1)), done, "long"))
        while engine.num_running == 0:  # the long prompt holds the accelerator first
            await asyncio.sleep(0.001)
        started = time.monotonic()
        await _first_token(engine, list(range(10**6, 10**6 + SHORT)), done, "short")
        waited = time.monotonic() - started
        await long
        assert engine.metrics.success and engine.num_running == 0
        if chunk:  # one chunk of the long prompt (0.2 s), then its own 40 ms: far below 4 s
            assert waited < LONG / 1000 / 2
        return done

    assert asyncio.run(main())[0] == first


def test_chunks_add_up_to_the_whole_prefill() -> None:
    async def main() -> float:
        engine = _engine(300)
        started = time.monotonic()
        await _first_token(engine, list(range(1, 1001)), [], "alone")
        return time.monotonic() - started

    assert asyncio.run(main()) >= 1.0  # 1,000 tokens at 1 ms each, chunked or not
