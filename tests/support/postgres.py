"""PostgreSQL for the tests: one server per session, a fresh database per test.

The server is the project's own (saltgate_devkit.services.PostgresServer): a temporary
cluster on a free loopback port, run as an unprivileged user, stopped at the end. A test
that needs it and cannot have it fails with the reason (ServiceError names what is
missing and how to install it); it is never skipped. Tests that stop the server on
purpose (outages) take a private one with `private_postgres`.

A test that fails shows what these servers logged while it ran (`log_section`): a slow
statement or a lock wait is named there with its time, which a client-side timeout alone
cannot tell.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from saltgate.store.settings import StoreSettings
from saltgate_devkit.services import PostgresServer

BACKENDS = ("sqlite", "postgresql")
LOG_SECTION_CHARS = 8000

# The servers whose logs a failing test shows, and each log's size when the test began.
_SERVERS = pytest.StashKey[list[PostgresServer]]()
_LOG_SIZES = pytest.StashKey[dict[Path, int]]()


def _servers(config: pytest.Config) -> list[PostgresServer]:
    return config.stash.setdefault(_SERVERS, [])


def _log_size(server: PostgresServer) -> int:
    try:
        return server.log.stat().st_size
    except OSError:
        return 0


def note_log_sizes(item: pytest.Item) -> None:
    """At a test's start: where each server's log stands (a server started later: at 0)."""
    item.stash[_LOG_SIZES] = {s.log: _log_size(s) for s in _servers(item.config)}


def log_section(item: pytest.Item) -> str:
    """What the servers logged since the test began, the end of it if long ("" if nothing)."""
    sizes = item.stash.get(_LOG_SIZES, {})
    parts = []
    for server in _servers(item.config):
        try:
            with server.log.open("rb") as f:
                f.seek(sizes.get(server.log, 0))
                text = f.read().decode(errors="replace")
        except OSError as exc:
            text = f"(log unreadable: {exc.strerror})\n"
        if text:
            parts.append(f"--- {server.log} ---\n{text[-LOG_SECTION_CHARS:]}")
    return "\n".join(parts)


def _serving(config: pytest.Config) -> Iterator[PostgresServer]:
    server = PostgresServer()
    _servers(config).append(server)
    try:
        server.start()
        yield server
    finally:
        _servers(config).remove(server)
        server.destroy()


@pytest.fixture(scope="session")
def postgres_server(pytestconfig: pytest.Config) -> PostgresServer:
    """The session's server, removed when pytest ends rather than in a fixture teardown:
    pytest tears session fixtures down inside the last test's teardown, under that test's
    timeout, and by then the cluster holds a database per test (gigabytes, tens of
    thousands of files). Beside two CPU hogs its removal took the last test past 120 s."""
    server = PostgresServer()
    pytestconfig.add_cleanup(server.destroy)  # also when start fails half-way
    _servers(pytestconfig).append(server)
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
def private_postgres(pytestconfig: pytest.Config) -> Iterator[PostgresServer]:
    """A server for this test alone, which it may stop and start (outage tests)."""
    yield from _serving(pytestconfig)
