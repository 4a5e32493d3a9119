"""A watch on the exception the event loop's thread is handling between tasks."""

from __future__ import annotations

import asyncio
import sys


class ExceptionWatch:
    """Samples, every millisecond from the event loop itself, the exception the thread is
    handling: between tasks there is none. A compiled coroutine that suspends inside an
    except or finally block leaves its exception there for every other task to see
    (saltgate/buildinfo.py), when only compiled coroutines lead from it to its task's
    root, as on the gateway's request path; under a Python coroutine it reaches no other
    task, nor the watch. tests/support/test_exceptions.py shows both, with mypyc."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        # What an earlier test in this thread may have left (a leak outlives its loop).
        self._before = sys.exc_info()[1]
        self._loop = asyncio.get_running_loop()
        self._next = self._loop.call_soon(self._sample)

    def _sample(self) -> None:
        handled = sys.exc_info()[1]
        if handled is not None and handled is not self._before:
            self.seen.append(repr(handled))
        self._next = self._loop.call_later(0.001, self._sample)

    def stop(self) -> None:
        self._next.cancel()

    def check(self) -> None:
        assert not self.seen, f"an exception showed between tasks: {sorted(set(self.seen))}"
