"""Wait for a condition instead of sleeping a fixed time and hoping the code was faster.

A fixed sleep races the code under test: too short on a loaded machine, wasted time on
an idle one. These poll the condition and fail, naming what was awaited, once the timeout
has passed (generous: only a failing test ever reaches it). The condition is checked
once more after the last pause, so a stalled loop cannot fail a condition that holds.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.01
TIMEOUT_S = 10.0


class _Deadline:
    def __init__(self, timeout_s: float, what: str) -> None:
        self.at = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.what = what

    def check(self) -> None:
        if time.monotonic() >= self.at:
            raise AssertionError(f"{self.what}: not true within {self.timeout_s} s")


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    *,
    timeout_s: float = TIMEOUT_S,
    what: str = "condition",
) -> None:
    """Return once ``condition()`` (a plain or an async callable) is true."""

    async def holds() -> bool:
        result = condition()
        return bool(await result) if inspect.isawaitable(result) else bool(result)

    deadline = _Deadline(timeout_s, what)
    while not await holds():
        deadline.check()
        await asyncio.sleep(POLL_S)


def eventually_blocking(
    condition: Callable[[], bool], *, timeout_s: float = TIMEOUT_S, what: str = "condition"
) -> None:
    """`eventually` for tests without an event loop (threads, subprocesses, ZMQ)."""
    deadline = _Deadline(timeout_s, what)
    while not condition():
        deadline.check()
        time.sleep(POLL_S)
