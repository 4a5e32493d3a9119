"""ExceptionWatch (tests/support/exceptions.py) fires, so a watch that stays silent means
something: on an exception the loop's thread handles while the loop runs (any build), and
on the leak it exists for, a coroutine compiled with mypyc suspended in an except block.

The leak crosses tasks only while nothing but compiled coroutines sit between the
suspended one and its task's root (a plain Python coroutine keeps the exception in its
own state, swapped out when it suspends): the watch sees exactly what other tasks see.
What it cannot see (a cancellation handled a compiled level below) is in its docstring.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.machinery
import importlib.util
import subprocess
import sys
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

import pytest
import uvloop
from tests.support.exceptions import ExceptionWatch
from tests.support.waiting import eventually

PROBE = """
import asyncio


async def wait_in_handler(release: asyncio.Event) -> None:
    try:
        raise LookupError("handled by a suspended compiled coroutine")
    except LookupError:
        await release.wait()
"""

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


async def start_watch() -> ExceptionWatch:
    return ExceptionWatch()


@pytest.mark.parametrize("loop", LOOPS)
def test_the_watch_reports_an_exception_handled_while_the_loop_runs(loop: str) -> None:
    """Run from an except block, the loop runs every callback, the watch's samples too,
    while its thread handles that exception."""
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        watch = runner.run(start_watch())
        try:
            raise LookupError("handled around the loop")
        except LookupError:
            runner.run(eventually(lambda: bool(watch.seen), what="the watch reports it"))
        watch.stop()
    with pytest.raises(AssertionError, match="handled around the loop"):
        watch.check()


@pytest.fixture(scope="module")
def compiled_probe(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """PROBE compiled with mypyc into a C extension, as the compiled build's modules are."""
    where = tmp_path_factory.mktemp("probe")
    (where / "watch_probe.py").write_text(PROBE)
    done = subprocess.run(
        [sys.executable, "-m", "mypyc", "watch_probe.py"],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    [built] = [p for p in where.glob("watch_probe.*") if p.name.endswith(suffixes)]
    spec = importlib.util.spec_from_file_location("watch_probe", built)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def under_python(probe: ModuleType, release: asyncio.Event) -> None:
    await probe.wait_in_handler(release)


async def other_task_and_watch(
    start: Callable[[asyncio.Event], Coroutine[Any, Any, None]],
) -> tuple[list[str], list[str]]:
    """What another task and the watch see while `start`'s task waits in the handler."""
    watch = ExceptionWatch()
    release = asyncio.Event()
    task = asyncio.create_task(start(release))
    seen = []
    for _ in range(20):  # the watch samples every 1 ms: several times each pause
        await asyncio.sleep(0.002)
        seen.append(repr(sys.exc_info()[1]))
    release.set()
    await task
    watch.stop()
    return seen, watch.seen


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("root", ["compiled", "python"])
def test_the_watch_sees_a_compiled_coroutine_suspended_in_a_handler_as_other_tasks_do(
    compiled_probe: ModuleType, loop: str, root: str
) -> None:
    """The compiled coroutine as its task's root, like the gateway's request path (the
    compiled HTTP server's connection task, compiled down to the exchange): its exception
    is the thread's while it waits, every task sees it and the watch reports it. Awaited
    by a Python coroutine, it reaches no other task, and the watch reports nothing."""
    starts = {
        "compiled": compiled_probe.wait_in_handler,
        "python": functools.partial(under_python, compiled_probe),
    }
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        seen, reported = runner.run(other_task_and_watch(starts[root]))
    leaked = repr(LookupError("handled by a suspended compiled coroutine"))
    if root == "compiled":
        assert set(seen) == {leaked} and set(reported) == {leaked}
    else:
        assert set(seen) == {"None"} and reported == []
