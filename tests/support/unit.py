"""The `unit` mark: a test that needs no network and starts no process, so that `make check`
runs all of them in seconds before every commit (docs/testing.md).

The mark is checked, not trusted. While a unit test runs (its fixtures included), an
audit hook (PEP 578) refuses to create an internet socket or to start a process, and the
test fails naming what it tried, even if the code under test caught the refusal. A test
that needs either is not a unit test: it belongs to `make test` alone, so drop its mark.
Local files, SQLite, threads and an asyncio loop's own socket pair are allowed.
"""

from __future__ import annotations

import _posixsubprocess
import functools
import socket
import sys
from collections.abc import Generator
from typing import Any

import pytest

MARK = "unit"

_FORK_EXEC_EVENT = "_posixsubprocess.fork_exec"
_PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system"}
) | {_FORK_EXEC_EVENT}
_INTERNET = (socket.AF_INET, socket.AF_INET6)


class NotAUnitTest(RuntimeError):
    """What a unit test gets for trying to reach the network or start a process."""


class _Guard:
    """One per process: audit hooks cannot be removed, so the hook is installed once and
    acts only while `running` names a unit test."""

    def __init__(self) -> None:
        self.running: str | None = None
        self.refused: list[str] = []
        sys.addaudithook(self._audit)
        # CPython audits subprocess.Popen but not the call beneath it, which
        # multiprocessing's spawn makes directly: audit it too.
        fork_exec = _posixsubprocess.fork_exec

        def audited_fork_exec(*args: Any) -> int:
            sys.audit(_FORK_EXEC_EVENT)
            return fork_exec(*args)

        _posixsubprocess.fork_exec = audited_fork_exec

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.running is None:
            return
        if event in _PROCESS_EVENTS:
            self._refuse(f"started a process ({event})")
        elif event == "socket.__new__" and args[1] in _INTERNET:
            self._refuse(f"opened an internet socket ({socket.AddressFamily(args[1]).name})")

    def _refuse(self, what: str) -> None:
        self.refused.append(what)
        raise NotAUnitTest(_refusal(what))


def _refusal(what: str) -> str:
    return f"a test marked `{MARK}` {what}: drop the mark (tests/support/unit.py)"


@functools.cache
def _guard() -> _Guard:
    return _Guard()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    """Guard a unit test's setup, call and teardown."""
    if item.get_closest_marker(MARK) is None:
        return (yield)
    guard = _guard()
    guard.running, guard.refused = item.nodeid, []
    try:
        return (yield)
    finally:
        guard.running = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Fail a unit test that tried, even where the code under test swallowed the refusal."""
    report = yield
    if item.get_closest_marker(MARK) is not None and _guard().refused:
        if report.passed:
            report.outcome = "failed"
            report.longrepr = _refusal("; ".join(_guard().refused))
        _guard().refused = []
    return report
