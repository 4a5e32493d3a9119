"""A simulated replica on a free loopback port, with a client for it, for one test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from tests.support.http import async_client

from saltgate.sim.run import RunningSim, SimConfig, start_sim


@asynccontextmanager
async def sim(**kw: Any) -> AsyncIterator[tuple[RunningSim, httpx.AsyncClient]]:
    """`saltgate sim` in-process with ``SimConfig(**kw)``; closed when the block ends."""
    running = await start_sim(SimConfig(port=0, **kw))
    async with async_client(base_url=running.url, timeout=30) as client:
        try:
            yield running, client
        finally:
            await running.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())  # type: ignore[arg-type]
