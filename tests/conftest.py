"""Fixtures shared across test packages (servers the project starts for its tests)."""

from tests.support.postgres import (
    pg_store,
    postgres_server,
    private_postgres,
    store_settings,
)

__all__ = ["pg_store", "postgres_server", "private_postgres", "store_settings"]
