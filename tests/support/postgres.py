"""PostgreSQL for the tests: one server per session, a fresh database per test.

The server is the project's own (saltgate.bench.services.PostgresServer): a temporary
cluster on a free loopback port, run as an unprivileged user, stopped at the end. A test
that needs it and cannot have it fails with the reason (ServiceError names what is
missing and how to install it); it is never skipped. Tests that stop the server on
purpose (outages) take a private one with `private_postgres`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from saltgate.bench.services import PostgresServer
from saltgate.store.settings import StoreSettings

BACKENDS = ("sqlite", "postgresql")


def _serving() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def postgres_server(pytestconfig: pytest.Config) -> PostgresServer:
    """The session's server, removed when pytest ends rather than in a fixture teardown:
    pytest tears session fixtures down inside the last test's teardown, under that test's
    timeout, and by then the cluster holds a database per test (gigabytes, tens of
    thousands of files). Beside two CPU hogs its removal took the last test past 120 s."""
    server = PostgresServer()
    pytestconfig.add_cleanup(server.destroy)  # also when start fails half-way
    server.start()
    return server


def new_database(server: PostgresServer, tmp_path: Path) -> StoreSettings:
    """A fresh, empty database on `server`, as a `[store]` with its spool under tmp_path."""
    name = f"t_{secrets.token_hex(6)}"
    server.create_database(name)
    return server.settings(name, tmp_path / "spool")


@pytest.fixture
def pg_store(postgres_server: PostgresServer, tmp_path: Path) -> StoreSettings:
    """A PostgreSQL store of its own for this test (on the session's server)."""
    return new_database(postgres_server, tmp_path)


@pytest.fixture(params=BACKENDS)
def store_settings(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSettings:
    """The test runs once per backend, each time on a fresh, empty store."""
    if request.param == "sqlite":
        return StoreSettings.in_state_dir(tmp_path / "state")
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return new_database(server, tmp_path)


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A server for this test alone, which it may stop and start (outage tests)."""
    yield from _serving()
