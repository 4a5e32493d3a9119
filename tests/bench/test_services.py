"""The servers the project starts for its tests: a missing piece is a clear failure."""

from __future__ import annotations

import os

import pytest

from saltgate.bench import services
from saltgate.bench.services import PostgresServer, ServiceError


def test_missing_postgres_binaries_name_the_setup_script(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(services, "PG_MAJOR", 99)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(services.PG_BINDIR_ENV, raising=False)
    with pytest.raises(ServiceError, match="PostgreSQL 99 is not installed") as err:
        PostgresServer()
    assert "scripts/services-setup.sh" in str(err.value)


def test_a_missing_unprivileged_user_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """As root (CI), PostgreSQL runs as the user the setup script creates; as another
    user it runs as that user and needs none."""
    monkeypatch.setenv(services.PG_USER_ENV, "saltgate-no-such-user")
    if os.geteuid() != 0:
        assert services._run_as() is None
        return
    with pytest.raises(ServiceError, match="'saltgate-no-such-user' does not exist") as err:
        PostgresServer()
    assert "refuses to run as root" in str(err.value)
    assert "scripts/services-setup.sh" in str(err.value)
