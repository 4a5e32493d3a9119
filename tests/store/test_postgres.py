"""The PostgreSQL store on a real server: migrations, and the gateway's key index
(changes by NOTIFY, authentication through an outage for the grace period, then 503)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import pytest
from tests.support.postgres import new_database
from tests.support.waiting import eventually

from saltgate.store.backends import open_database
from saltgate.store.errors import StoreError, StoreUnavailableError
from saltgate.store.postgres import PgKeyIndex, PostgresDatabase, conninfo
from saltgate.store.schema import POSTGRES_MIGRATIONS, POSTGRES_VERSION_TABLE, SCHEMA_VERSION
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore
from saltgate_devkit.services import PostgresServer


def test_migrations_apply_once_and_record_their_version(pg_store: StoreSettings) -> None:
    db = PostgresDatabase(pg_store)
    try:
        assert db.query("SELECT version, name FROM schema_version") == [
            (m.version, m.name) for m in POSTGRES_MIGRATIONS
        ]
        [(generation,)] = db.query("SELECT auth_generation FROM meta")
        assert generation == 0
    finally:
        db.close()
    PostgresDatabase(pg_store).close()  # a second open finds the work done
    db = PostgresDatabase(pg_store)
    try:
        assert db.query("SELECT count(*) FROM schema_version") == [(len(POSTGRES_MIGRATIONS),)]
    finally:
        db.close()


def test_gateways_starting_together_migrate_once(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """Eight processes' worth of first connections race on an empty database."""
    settings = new_database(postgres_server, tmp_path)
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            PostgresDatabase(settings).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    db = PostgresDatabase(settings)
    try:
        assert db.query("SELECT max(version), count(*) FROM schema_version") == [
            (SCHEMA_VERSION, len(POSTGRES_MIGRATIONS))
        ]
    finally:
        db.close()


def test_a_newer_schema_is_refused(pg_store: StoreSettings) -> None:
    db = PostgresDatabase(pg_store)
    db.execute(
        "INSERT INTO schema_version (version, name, applied_at) VALUES (?, 'future', 0)",
        (SCHEMA_VERSION + 1,),
    )
    db.close()
    with pytest.raises(StoreError, match="newer than this saltgate supports"):
        PostgresDatabase(pg_store)


def test_an_unreachable_store_is_one_clear_error(tmp_path: Path) -> None:
    settings = StoreSettings(
        "postgresql",
        "postgresql://saltgate@127.0.0.1:1/none?connect_timeout=2",
        spool_dir=tmp_path / "spool",
    )
    with pytest.raises(StoreError, match="cannot reach the store postgresql://saltgate@127"):
        open_database(settings)


def test_key_changes_reach_a_listening_gateway_by_notify(pg_store: StoreSettings) -> None:
    """Created, rotated and revoked through another connection (the CLI's): each is seen
    within a second, and far sooner than the once-a-second check would see it."""
    store = TenantStore(open_database(pg_store))
    tenant = store.create_tenant("acme")
    _, first = store.create_key("acme")

    async def run() -> None:
        index = PgKeyIndex(pg_store, check_interval_s=30.0)  # only NOTIFY can be this fast
        await index.start()
        try:
            p = index.authenticate(first)
            assert p is not None and (p.tenant_id, p.epoch) == (tenant.id, 0)
            key_id, key = await asyncio.to_thread(store.create_key, "acme")
            start = time.monotonic()
            await eventually(
                lambda: index.authenticate(key) is not None, timeout_s=1.0, what="new key"
            )
            assert time.monotonic() - start < 0.5
            await asyncio.to_thread(store.rotate_salt, "acme")
            await eventually(lambda: _epoch(index, key) == 1, timeout_s=1.0, what="rotation")
            await asyncio.to_thread(store.revoke_key, key_id)
            await eventually(
                lambda: index.authenticate(key) is None, timeout_s=1.0, what="revocation"
            )
            assert index.authenticate(first) is not None
            assert len(index) == 1
        finally:
            await index.aclose()

    try:
        asyncio.run(run())
    finally:
        store.close()


def _epoch(index: PgKeyIndex, key: str) -> int | None:
    p = index.authenticate(key)
    return None if p is None else p.epoch


def test_usage_writes_do_not_reload_the_keys(pg_store: StoreSettings) -> None:
    db = open_database(pg_store)
    with TenantStore(db) as store:
        store.create_tenant("acme")
        store.create_key("acme")

        async def run() -> None:
            index = PgKeyIndex(pg_store, check_interval_s=0.05)
            await index.start()
            try:
                reloads = index.reloads
                for i in range(20):
                    db.execute(
                        "INSERT INTO usage VALUES (?, 1.0, 't', 'k', 'm', 1, 0, 1, 200)",
                        (f"r{i}",),
                    )
                await asyncio.sleep(0.3)  # several checks of the generation
                assert index.reloads == reloads
                store.create_tenant("globex")  # an auth change does reload
                await eventually(lambda: index.reloads > reloads, timeout_s=1.0, what="reload")
            finally:
                await index.aclose()

        asyncio.run(run())


def _run_outage(
    settings: StoreSettings,
    body: Callable[[PgKeyIndex, str], Awaitable[None]],
    *,
    grace: float,
    retry_interval_s: float = 0.25,
) -> None:
    with TenantStore(open_database(settings)) as store:
        store.create_tenant("acme")
        _, key = store.create_key("acme")

    async def run() -> None:
        index = PgKeyIndex(
            settings,
            outage_grace_s=grace,
            check_interval_s=0.1,
            retry_interval_s=retry_interval_s,
        )
        await index.start()
        try:
            await body(index, key)
        finally:
            await index.aclose()

    asyncio.run(run())


def test_an_outage_keeps_known_keys_for_the_grace_then_refuses_then_recovers(
    private_postgres: PostgresServer, tmp_path: Path
) -> None:
    settings = new_database(private_postgres, tmp_path)

    async def body(index: PgKeyIndex, key: str) -> None:
        assert index.authenticate(key) is not None
        await asyncio.to_thread(private_postgres.stop, "immediate")
        await eventually(lambda: index.down_for() > 0, timeout_s=2.0, what="the outage")
        assert index.authenticate(key) is not None  # within the grace: known keys work
        assert index.authenticate("sg_" + "x" * 43) is None  # unknown ones do not
        await eventually(lambda: index.down_for() > 1.5, timeout_s=5.0, what="the end of the grace")
        with pytest.raises(StoreUnavailableError) as err:
            index.authenticate(key)
        message = str(err.value)
        assert "key store" in message and "at most 1.5 s" in message
        assert key not in message and settings.url not in message
        await asyncio.to_thread(private_postgres.start)
        await eventually(lambda: index.down_for() == 0.0, timeout_s=5.0, what="the recovery")
        assert index.authenticate(key) is not None

    _run_outage(settings, body, grace=1.5)


def test_changes_made_during_an_outage_arrive_after_it(
    private_postgres: PostgresServer, tmp_path: Path
) -> None:
    """A notification can be lost with the connection; the reload after reconnecting is
    what brings a revocation made while this gateway was cut off."""
    settings = new_database(private_postgres, tmp_path)

    async def body(index: PgKeyIndex, key: str) -> None:
        await asyncio.to_thread(private_postgres.stop, "immediate")
        await eventually(lambda: index.down_for() > 0, timeout_s=2.0, what="the outage")
        await asyncio.to_thread(private_postgres.start)
        # Revoke while this gateway is still waiting to reconnect (its retry is slow here),
        # so no notification can reach it.
        with TenantStore(open_database(settings)) as store:
            [info] = store.list_keys("acme")
            store.revoke_key(info.id)
        assert index.down_for() > 0, "reconnected too early: the test proves nothing"
        await eventually(
            lambda: index.authenticate(key) is None, timeout_s=10.0, what="the revocation"
        )
        assert index.down_for() == 0.0

    _run_outage(settings, body, grace=60.0, retry_interval_s=4.0)


def test_a_gateway_cannot_start_without_its_store(tmp_path: Path) -> None:
    settings = StoreSettings(
        "postgresql", "postgresql://saltgate@127.0.0.1:1/none", spool_dir=tmp_path / "s"
    )

    async def run() -> None:
        with pytest.raises(StoreError, match="cannot reach the store"):
            await PgKeyIndex(settings).start()

    asyncio.run(run())


def test_a_version_3_database_migrates_keeping_its_usage_rows(pg_store: StoreSettings) -> None:
    """Version 4: old rows keep their counts and have no recorded cost; cached tokens may
    now be NULL (unknown)."""
    with psycopg.connect(conninfo(pg_store), autocommit=True) as conn:
        conn.execute(POSTGRES_VERSION_TABLE)
        for stmt in POSTGRES_MIGRATIONS[0].statements:
            conn.execute(stmt)
        conn.execute("INSERT INTO schema_version VALUES (3, 'baseline', 0)")
        conn.execute("INSERT INTO usage VALUES ('r1', 1.0, 't', 'k', 'm', 10, 4, 2, 200)")
    db = PostgresDatabase(pg_store, upgrade=True)  # as `saltgate store migrate` opens it
    try:
        db.execute(
            "INSERT INTO usage (request_id, ts, tenant_id, key_id, model, prompt_tokens, "
            "cached_tokens, completion_tokens, status) VALUES ('r2', 2.0, 't', 'k', 'm', 5, "
            "NULL, 1, 200)"
        )
        assert db.query(
            "SELECT request_id, cached_tokens, cost_micro_usd, price_version FROM usage ORDER BY ts"
        ) == [("r1", 4, None, None), ("r2", None, None, None)]
        assert db.query("SELECT count(*) FROM prices") == [(0,)]
    finally:
        db.close()
