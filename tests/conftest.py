"""The fixtures shared across test packages (servers the project starts for its tests),
and the session's hooks (tests/support/session.py)."""

from tests.support.postgres import (
    pg_store,
    postgres_server,
    private_postgres,
    store_settings,
)
from tests.support.redis import redis_server

pytest_plugins = ("tests.support.session",)

__all__ = ["pg_store", "postgres_server", "private_postgres", "redis_server", "store_settings"]
