"""Fixtures shared across test packages (servers the project starts for its tests), and
the check that the saltgate under test is this checkout's source (tests/support/builds.py)."""

import pytest
from tests.support.builds import stale_install
from tests.support.postgres import (
    pg_store,
    postgres_server,
    private_postgres,
    store_settings,
)
from tests.support.redis import redis_server

__all__ = ["pg_store", "postgres_server", "private_postgres", "redis_server", "store_settings"]


def pytest_configure(config: pytest.Config) -> None:
    problem = stale_install()
    if problem is not None:
        raise pytest.UsageError(problem)
