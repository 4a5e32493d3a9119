"""At the end of a run, each part's time: the seconds its tests took (setup, call and
teardown, summed over pytest-xdist's workers), by folder, slowest first. docs/testing.md
keeps the table from a quiet run and one beside busy loops, beside the suite's budget."""

from __future__ import annotations

from collections import defaultdict

import pytest

_seconds: defaultdict[str, float] = defaultdict(float)
_tests: defaultdict[str, set[str]] = defaultdict(set)


def part_of(nodeid: str) -> str:
    """The folder of tests a node id lies in: tests/gateway, or benchmarks/tests."""
    folders = nodeid.split("::", 1)[0].split("/")[:-1]
    return "/".join(folders[:2]) or "."


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    part = part_of(report.nodeid)
    _seconds[part] += report.duration
    _tests[part].add(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    terminalreporter.section("time by part (seconds of tests, summed over workers)")
    width = max(len(part) for part in _seconds)
    for part, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{part:<{width}}  {seconds:7.1f} s  {len(_tests[part])} tests")
    terminalreporter.write_line(f"{'all':<{width}}  {sum(_seconds.values()):7.1f} s")
