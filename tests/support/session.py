"""The suite's session-wide hooks, one plugin for both folders of tests (tests/ and
benchmarks/tests, each conftest.py names it): the check that the saltgate under test is
this checkout's source (tests/support/builds.py), how pytest-xdist's workers share the
suite (tests/support/scheduling.py), the `unit` mark's guard (tests/support/unit.py), the
time by part at the end (tests/support/parts.py), and, for a failed test, what its
PostgreSQL servers logged meanwhile."""

from collections.abc import Generator
from typing import Any

import pytest
from tests.support.builds import stale_install
from tests.support.postgres import log_section, note_log_sizes
from tests.support.scheduling import GroupedScheduling

# pytester: for the tests of these plugins.
pytest_plugins = ("pytester", "tests.support.unit", "tests.support.parts")


def pytest_configure(config: pytest.Config) -> None:
    problem = stale_install()
    if problem is not None:
        raise pytest.UsageError(problem)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> GroupedScheduling:
    return GroupedScheduling(config, log)


def pytest_runtest_setup(item: pytest.Item) -> None:
    note_log_sizes(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.when != "teardown":
        section = log_section(item)
        if section:
            report.sections.append(("PostgreSQL log during the test", section))
    return report
