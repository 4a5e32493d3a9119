"""The servers the project starts for its tests: a missing piece is a clear failure."""

from __future__ import annotations

import asyncio
import itertools
import os
import pwd
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError

from saltgate.http import HttpServer, Request, Response, UpstreamPool
from saltgate_devkit import services
from saltgate_devkit.services import HaproxyServer, PostgresServer, RedisServer, ServiceError


def test_missing_postgres_binaries_name_the_setup_script(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(services, "PG_MAJOR", 99)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(services.PG_BINDIR_ENV, raising=False)
    with pytest.raises(ServiceError, match="PostgreSQL 99 is not installed") as err:
        PostgresServer()
    assert "scripts/services-setup.sh" in str(err.value)


def test_postgresql_runs_as_the_unprivileged_user_only_as_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As root (CI), PostgreSQL runs as the user the setup script creates, and a missing
    one is named; as another user it runs as that user and needs none. The effective uid
    is the test's, so both cases run whoever runs the suite."""
    monkeypatch.setenv(services.PG_USER_ENV, "saltgate-no-such-user")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert services._run_as() is None  # not root: whatever user is configured
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(ServiceError, match="'saltgate-no-such-user' does not exist") as err:
        PostgresServer()
    assert "refuses to run as root" in str(err.value)
    assert "scripts/services-setup.sh" in str(err.value)
    me = pwd.getpwuid(os.getuid())  # a user that exists
    monkeypatch.setenv(services.PG_USER_ENV, me.pw_name)
    assert services._run_as() == me


def test_haproxy_balances_every_request_of_one_kept_alive_connection() -> None:
    """The fleet benchmark's balancer: round robin per request, not per connection, so
    one client connection's requests reach every gateway in turn."""

    async def main() -> None:
        seen: list[int] = []

        def handler(index: int) -> Callable[[Request], Awaitable[Response]]:
            async def handle(request: Request) -> Response:
                if request.path != b"/health":
                    seen.append(index)
                return Response(200, [(b"content-type", b"text/plain")], b"ok")

            return handle

        servers = [HttpServer(handler(i)) for i in range(2)]
        ports = [await s.start("127.0.0.1", 0) for s in servers]
        balancer = HaproxyServer(ports)
        await asyncio.to_thread(balancer.start)
        pool = UpstreamPool("127.0.0.1", balancer.port, max_idle=1)
        try:
            for _ in range(8):
                resp = await pool.request(b"GET", b"/x", [])
                assert resp.status == 200 and await resp.read() == b"ok"
            assert pool.open_connections == 1  # one client connection throughout
            assert seen.count(0) == seen.count(1) == 4
            assert all(a != b for a, b in itertools.pairwise(seen))
        finally:
            await pool.close()
            balancer.destroy()
            for s in servers:
                await s.close()

    asyncio.run(main())


def test_redis_server_requires_its_password() -> None:
    async def main(server: RedisServer) -> None:
        good = Redis.from_url(server.url(), password=server.password_file.read_text().strip())
        bad = Redis.from_url(server.url(), password="not-it")
        try:
            assert await good.ping()
            with pytest.raises(AuthenticationError):
                await bad.ping()
        finally:
            await good.aclose()
            await bad.aclose()

    server = RedisServer()
    try:
        server.start()
        assert oct(server.password_file.stat().st_mode & 0o777) == "0o600"
        asyncio.run(main(server))
    finally:
        server.destroy()
