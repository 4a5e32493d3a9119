"""Fixtures shared across test packages (servers the project starts for its tests), the
check that the saltgate under test is this checkout's source (tests/support/builds.py),
how pytest-xdist's workers share the suite (tests/support/scheduling.py), and, for a
failed test, what its PostgreSQL servers logged meanwhile."""

from collections.abc import Generator
from typing import Any

import pytest
from tests.support.builds import stale_install
from tests.support.postgres import (
    log_section,
    note_log_sizes,
    pg_store,
    postgres_server,
    private_postgres,
    store_settings,
)
from tests.support.redis import redis_server
from tests.support.scheduling import GroupedScheduling

# The `unit` mark's guard, the time by part at the end, pytester for the tests of both.
pytest_plugins = ("pytester", "tests.support.unit", "tests.support.parts")

__all__ = ["pg_store", "postgres_server", "private_postgres", "redis_server", "store_settings"]


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
