"""Redis for the tests: the project's own throwaway server (saltgate_devkit.services).

One per test, on a free loopback port with a random password, so a test may stop it and
start it again (bus outages). A test that needs it and cannot start it fails with the
reason (ServiceError names what is missing); it is never skipped.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from saltgate_devkit.services import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.destroy()
