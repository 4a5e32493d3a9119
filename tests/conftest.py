"""Fixtures shared across test packages (servers the project starts for its tests)."""

from tests.support.postgres import (
    pg_store,
    postgres_server,
    private_postgres,
    store_settings,
)
from tests.support.redis import redis_server

__all__ = ["pg_store", "postgres_server", "private_postgres", "redis_server", "store_settings"]
