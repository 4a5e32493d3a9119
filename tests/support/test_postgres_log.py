"""A failed test shows what PostgreSQL logged while it ran (tests/conftest.py): the
server's settings must name a slow statement and a lock wait, and the section must hold
this test's lines, not earlier ones."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tests.support.postgres import log_section, new_database, note_log_sizes

from saltgate_devkit.services import PostgresServer


def test_the_log_section_names_slow_statements_and_lock_waits_of_this_test_only(
    postgres_server: PostgresServer, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    name = new_database(postgres_server, tmp_path).url.rsplit("/", 1)[1]
    with postgres_server.connect(name) as conn:
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("SELECT pg_sleep(1.2) AS before_the_test")
    note_log_sizes(request.node)
    holder = postgres_server.connect(name)
    holder.autocommit = False
    holder.execute("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
    released = threading.Timer(1.5, holder.rollback)  # past deadlock_timeout (1 s)
    released.start()
    try:
        with postgres_server.connect(name) as conn:
            conn.execute("INSERT INTO t VALUES (1)")  # waits for the lock
            conn.execute("SELECT pg_sleep(1.2) AS during_the_test")
    finally:
        released.join()
        holder.close()
    section = log_section(request.node)
    assert "during_the_test" in section and "duration:" in section
    assert "still waiting for RowExclusiveLock" in section and name in section
    assert "before_the_test" not in section
    note_log_sizes(request.node)
    assert log_section(request.node) == ""  # a test during which nothing was logged
