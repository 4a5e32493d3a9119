"""A watch on the exception the event loop's thread is handling between tasks."""

from __future__ import annotations

import asyncio
import sys


class ExceptionWatch:
    """Samples, every millisecond from the event loop itself, the exception the thread is
    handling: between tasks there is none. A compiled coroutine that suspends inside an
    except or finally block leaves its exception there for every other task to see
    (saltgate/buildinfo.py) when only compiled coroutines lead from it to its task's
    root; under a Python coroutine it reaches no other task, nor the watch
    (tests/support/test_exceptions.py shows both, with mypyc).

    Blind to an exception thrown into the task (a cancellation: a client abort, a
    shutdown) and handled a compiled level below: the level it came in by resets the
    thread's exception as the suspension passes out, so no task sees it, and the handler
    resumes without it and crashes the interpreter if it re-raises. The hazard check
    (tests/architecture/test_builds.py) and a child process cutting a stream
    (tests/http/test_http_edge.py) catch that one."""

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
