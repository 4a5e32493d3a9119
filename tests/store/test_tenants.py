"""Tenants, hashed keys, epochs (on both backends) and the gateway's SQLite KeyIndex.

The admin operations run once per backend (`store_settings`: a real SQLite file, then a
real PostgreSQL database); the KeyIndex tests are SQLite's (PostgreSQL's PgKeyIndex has
tests/store/test_postgres.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import multiprocessing
import re
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tests.store.open_db_child import open_each_when_all_are_ready
from tests.support.leaks import leaks
from tests.support.waiting import eventually_blocking

from saltgate.governance.limits import Limits
from saltgate.store.audit import list_entries
from saltgate.store.backends import migrate_store, open_database
from saltgate.store.errors import (
    ConflictError,
    InvalidInputError,
    KeyNotFoundError,
    KeyRevokedError,
    StoreError,
    TenantExistsError,
    TenantNotFoundError,
)
from saltgate.store.ledger import Ledger, UsageRecord, new_request_id
from saltgate.store.schema import SCHEMA_VERSION, SQLITE_MIGRATIONS
from saltgate.store.settings import StoreSettings
from saltgate.store.sqlite import open_db
from saltgate.store.tenants import LIVE_KEYS_SQL, KeyIndex, KeySnapshot, TenantStore, db_path

KEY_RE = re.compile(r"sg_[A-Za-z0-9_-]{43}")


def test_create_tenant_ids_and_duplicate(store_settings: StoreSettings) -> None:
    with TenantStore(open_database(store_settings)) as store:
        a = store.create_tenant("acme")
        b = store.create_tenant("globex")
        assert re.fullmatch(r"tn_[0-9a-f]{16}", a.id)
        assert a.id != b.id
        assert a.epoch == 0 and a.epoch_label == "0"
        with pytest.raises(TenantExistsError, match="'acme' already exists"):
            store.create_tenant("acme")
        assert [t.name for t in store.list_tenants()] == ["acme", "globex"]
        assert store.get_tenant(a.id) == a == store.get_tenant("acme")


@pytest.mark.parametrize("name", ["", "-x", "a b", "x" * 65, "tn_0123456789abcdef", "sg_x", "é"])
def test_invalid_tenant_names(store_settings: StoreSettings, name: str) -> None:
    with (
        TenantStore(open_database(store_settings)) as store,
        pytest.raises(StoreError, match="invalid tenant name"),
    ):
        store.create_tenant(name)


@pytest.mark.unit
def test_db_file_private_and_versioned(tmp_path: Path) -> None:
    with TenantStore.from_state_dir(tmp_path / "state") as store:
        store.create_tenant("acme")
    path = db_path(tmp_path / "state")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    versions = conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
    assert versions == [(m.version,) for m in SQLITE_MIGRATIONS]
    conn.close()
    # Reopening keeps the data (no re-migration).
    with TenantStore.from_state_dir(tmp_path / "state") as store:
        assert [t.name for t in store.list_tenants()] == ["acme"]


def test_processes_opening_a_new_database_at_once_all_open_it(tmp_path: Path) -> None:
    """Four processes open each of 20 new databases together, as the workers of `saltgate
    serve --workers N` open a new state directory: every open succeeds. (Putting a new file
    in WAL mode fails at once, unless someone waits, for each that tries while another
    holds the file; before store/sqlite.py waited, about half of these rounds lost an open.)"""
    processes, rounds = 4, 20
    paths = [tmp_path / f"saltgate-{i}.db" for i in range(rounds)]
    errors = tmp_path / "errors.txt"
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Barrier(processes)
    openers = [
        spawn.Process(target=open_each_when_all_are_ready, args=(paths, ready, errors))
        for _ in range(processes)
    ]
    for opener in openers:
        opener.start()
    for opener in openers:
        opener.join(timeout=120)
    assert [opener.exitcode for opener in openers] == [0] * processes
    assert not errors.exists(), errors.read_text()
    for path in paths:
        conn = sqlite3.connect(path)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        conn.close()


@pytest.mark.unit
def test_an_older_schema_migrates_and_keeps_its_rows(tmp_path: Path) -> None:
    """A version-1 database (usage indexed by ts, no version table, no request ids) opens
    as the current version, its rows kept, what it had recorded in the version table."""
    path = tmp_path / "saltgate.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for stmt in SQLITE_MIGRATIONS[0].statements:
        conn.execute(stmt)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO usage VALUES (1, 1.0, 't', 'k', 'm', 10, 4, 2, 200)")
    conn.close()
    migrate_store(StoreSettings.sqlite(path))
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION > 2
    assert conn.execute("SELECT prompt_tokens, cached_tokens FROM usage").fetchall() == [(10, 4)]
    indexes = conn.execute("SELECT name FROM sqlite_master WHERE tbl_name = 'usage'").fetchall()
    assert ("usage_ts",) not in indexes and ("usage_request_id",) in indexes
    recorded = conn.execute(
        "SELECT version, applied_at IS NULL FROM schema_version ORDER BY version"
    ).fetchall()
    # Version 1 was applied before the table; every later one by this open.
    assert recorded == [(1, 1)] + [(m.version, 0) for m in SQLITE_MIGRATIONS[1:]]
    tenant_columns = [row[1] for row in conn.execute("PRAGMA table_info(tenants)")]
    assert "allowed_models" in tenant_columns and "limits" in tenant_columns
    key_columns = [row[1] for row in conn.execute("PRAGMA table_info(api_keys)")]
    assert "limits" in key_columns and "priority" in key_columns
    conn.close()

    # The old row has no request id; new ones do, and a second record with the same id is
    # dropped rather than counted twice.
    async def meter() -> None:
        ledger = Ledger(path)
        rec = UsageRecord(new_request_id(), 2.0, "t", "k", "m", 5, None, 1, 200, 9, "pv_x")
        await ledger.record(rec)
        await ledger.record(rec._replace(prompt_tokens=99))
        await ledger.aclose()

    asyncio.run(meter())
    conn = sqlite3.connect(path)
    # Version 4: the old row kept (its id too) without a recorded cost; cached tokens may
    # now be unknown (NULL).
    assert conn.execute(
        "SELECT id, prompt_tokens, cached_tokens, cost_micro_usd, price_version FROM usage "
        "ORDER BY ts"
    ).fetchall() == [(1, 10, 4, None, None), (2, 5, None, 9, "pv_x")]
    conn.close()


@pytest.mark.unit
def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"
    TenantStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this saltgate supports"):
        TenantStore(path)


def test_keys_are_stored_only_as_sha256(store_settings: StoreSettings) -> None:
    db = open_database(store_settings)
    with TenantStore(db) as store:
        t = store.create_tenant("acme")
        key_id, key = store.create_key("acme")
        assert KEY_RE.fullmatch(key)
        assert re.fullmatch(r"key_[0-9a-f]{12}", key_id)
        [(stored,)] = db.query("SELECT key_hash FROM api_keys")
        digest = hashlib.sha256(key.encode()).digest()
        assert bytes(stored) == digest
        [info] = store.list_keys(t.id)
        assert (info.id, info.tenant_id, info.revoked_at) == (key_id, t.id, None)
        # The metadata holds neither the key nor the one thing stored of it.
        assert not leaks(repr(info), api_key=key, key_hash=digest)
    if store_settings.sqlite_path is not None:
        # The clear key appears nowhere on disk (db, WAL, shm), in no form; its digest
        # does, which the same scan finds.
        state = store_settings.sqlite_path.parent
        blobs = b"".join(p.read_bytes() for p in state.iterdir())
        assert not leaks(blobs, api_key=key)
        assert leaks(blobs, key_hash=digest)


@pytest.mark.unit
def test_authenticate(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"
    with TenantStore(path) as store:
        t = store.create_tenant("acme")
        key_id, key = store.create_key("acme")
        _, other = store.create_key("acme")
    index = KeyIndex(path)
    try:
        p = index.authenticate(key)
        assert p is not None
        assert (p.tenant_id, p.tenant_name, p.key_id, p.epoch) == (t.id, "acme", key_id, 0)
        assert index.authenticate(other) is not None
        assert len(index) == 2
        # One changed character, wrong length, wrong prefix, non-ASCII, empty.
        flipped = key[:-1] + ("A" if key[-1] != "A" else "B")
        for bad in (flipped, key[:-1], "xx" + key[2:], key[:-1] + "é", ""):
            assert index.authenticate(bad) is None
    finally:
        index.close()


@pytest.mark.unit
def test_tenant_id_survives_key_rotation(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"
    store = TenantStore(path)
    index = KeyIndex(path, max_staleness=None)
    old_id, old = store.create_key(store.create_tenant("acme").id)
    assert index.refresh_if_changed()
    before = index.authenticate(old)
    new_id, new = store.create_key("acme")
    store.revoke_key(old_id)
    assert index.refresh_if_changed()
    after = index.authenticate(new)
    assert index.authenticate(old) is None
    assert before is not None and after is not None
    assert after.tenant_id == before.tenant_id
    assert after.epoch == before.epoch  # same salt: the cache stays warm
    assert after.key_id == new_id != before.key_id
    index.close()
    store.close()


@pytest.mark.unit
def test_rotate_salt_moves_epoch(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"
    store = TenantStore(path)
    t = store.create_tenant("acme")
    _, key = store.create_key("acme")
    index = KeyIndex(path, max_staleness=None)
    assert store.rotate_salt("acme") == 1
    assert store.rotate_salt(t.id) == 2
    assert index.refresh_if_changed()
    p = index.authenticate(key)
    assert p is not None and p.epoch == 2 and p.epoch_label == "2" and p.tenant_id == t.id
    assert store.get_tenant("acme").epoch == 2
    with pytest.raises(TenantNotFoundError, match="'nobody'"):
        store.rotate_salt("nobody")
    index.close()
    store.close()


def test_rotation_and_keys_on_either_backend(store_settings: StoreSettings) -> None:
    with TenantStore(open_database(store_settings)) as store:
        t = store.create_tenant("acme")
        old_id, _ = store.create_key("acme")
        new_id, _ = store.create_key(t.id)
        assert [k.id for k in store.list_keys("acme")] == [old_id, new_id]
        assert store.rotate_salt("acme") == 1
        assert store.rotate_salt(t.id) == 2
        assert store.get_tenant("acme").epoch == 2
        revoked = store.revoke_key(old_id)
        assert revoked.revoked_at is not None
        assert [k.revoked_at is None for k in store.list_keys()] == [False, True]
        with pytest.raises(TenantNotFoundError, match="'nobody'"):
            store.rotate_salt("nobody")


def test_allowed_models_on_either_backend(store_settings: StoreSettings) -> None:
    """A tenant's model list is stored, listed and cleared; every change moves the auth
    generation (what tells the gateways to reload, as a key change does), and the
    gateway's snapshot carries the list with each key."""
    db = open_database(store_settings)
    with TenantStore(db) as store:
        store.create_tenant("acme")
        store.create_tenant("globex")
        assert store.get_tenant("acme").models is None  # every model, by default
        [(before,)] = db.query("SELECT auth_generation FROM meta")
        t = store.set_models("acme", ["m2", "m1", "m2"])
        assert t.models == ("m1", "m2") == store.get_tenant("acme").models
        [(after,)] = db.query("SELECT auth_generation FROM meta")
        assert after > before
        assert [x.models for x in store.list_tenants()] == [("m1", "m2"), None]
        _, key = store.create_key("acme")
        principal = KeySnapshot(db.query(LIVE_KEYS_SQL)).lookup(key)
        assert principal is not None and principal.models == frozenset({"m1", "m2"})
        for bad in ([], [""], [" m1"]):
            with pytest.raises(StoreError, match="invalid model list"):
                store.set_models("acme", bad)
        assert store.set_models("acme", None).models is None
        assert store.get_tenant("acme").models is None
        principal = KeySnapshot(db.query(LIVE_KEYS_SQL)).lookup(key)
        assert principal is not None and principal.models is None
        with pytest.raises(TenantNotFoundError):
            store.set_models("nobody", ["m1"])


def test_limits_on_either_backend(store_settings: StoreSettings) -> None:
    """Tenant and key limits are stored, listed and cleared; a change moves the auth
    generation, and the gateway's snapshot carries both with each key."""
    db = open_database(store_settings)
    with TenantStore(db) as store:
        store.create_tenant("acme")
        key_id, key = store.create_key("acme")
        assert store.get_tenant("acme").limits is None
        [(before,)] = db.query("SELECT auth_generation FROM meta")
        limits = Limits(rpm=60, output_tpm=1000, budget_micro_usd=5_000_000, budget_period_s=86400)
        assert store.set_limits("acme", limits).limits == limits
        assert store.get_tenant("acme").limits == limits
        [(after,)] = db.query("SELECT auth_generation FROM meta")
        assert after > before
        assert store.set_key_limits(key_id, Limits(concurrency=2)).limits == Limits(concurrency=2)
        assert [k.limits for k in store.list_keys("acme")] == [Limits(concurrency=2)]
        [(after_key,)] = db.query("SELECT auth_generation FROM meta")
        assert after_key > after
        principal = KeySnapshot(db.query(LIVE_KEYS_SQL)).lookup(key)
        assert principal is not None
        assert (principal.limits, principal.key_limits) == (limits, Limits(concurrency=2))
        # Revoking keeps the key's limits on record; clearing removes them.
        assert store.revoke_key(key_id).limits == Limits(concurrency=2)
        assert store.set_limits("acme", None).limits is None
        assert store.set_limits("acme", Limits()).limits is None  # empty is none
        assert store.get_tenant("acme").limits is None
        with pytest.raises(TenantNotFoundError):
            store.set_limits("nobody", limits)
        with pytest.raises(KeyNotFoundError):
            store.set_key_limits("key_000000000000", limits)


def test_a_tenants_weight_on_either_backend(store_settings: StoreSettings) -> None:
    """The weight is the tenant's own column (issue 42): 1 for a new tenant, set alone or
    with the limits in one change (which keeps it when not given), bounded, audited, and
    carried by every key's principal; the limits never hold it."""
    db = open_database(store_settings)
    with TenantStore(db) as store:
        assert store.create_tenant("acme").weight == 1.0
        _, key = store.create_key("acme")
        [(before,)] = db.query("SELECT auth_generation FROM meta")
        assert store.set_weight("acme", 2.5).weight == 2.5
        [(after,)] = db.query("SELECT auth_generation FROM meta")
        assert after > before  # every gateway follows
        limits = Limits(rpm=60)
        tenant = store.set_limits("acme", limits)  # the weight kept
        assert (tenant.limits, tenant.weight) == (limits, 2.5)
        tenant = store.set_limits("acme", None, 4.0)  # both in one change
        assert (tenant.limits, tenant.weight) == (None, 4.0)
        assert db.query("SELECT limits FROM tenants") == [(None,)]
        for bad in (0.0, -1.0, 5e-324, 100.5, math.nan, math.inf):
            with pytest.raises(InvalidInputError, match="weight must be a number"):
                store.set_weight("acme", bad)
            with pytest.raises(InvalidInputError, match="weight must be a number"):
                store.set_limits("acme", limits, bad)
        assert store.get_tenant("acme") == tenant  # nothing changed by the refusals
        principal = KeySnapshot(db.query(LIVE_KEYS_SQL)).lookup(key)
        assert principal is not None and (principal.weight, principal.limited) == (4.0, False)
        [entry] = [e for e in list_entries(db) if e.action == "tenant.weight_set"]
        assert entry.before is not None and entry.after is not None
        assert (json.loads(entry.before)["weight"], json.loads(entry.after)["weight"]) == (1, 2.5)
        with pytest.raises(TenantNotFoundError):
            store.set_weight("nobody", 2.0)


def test_priority_bands_on_either_backend(store_settings: StoreSettings) -> None:
    """A key's band is set when it is created (interactive unless asked), listed, kept by
    a revocation or a limits change, and carried to the gateway's principal; the column
    refuses anything but the two bands, even written around the store."""
    db = open_database(store_settings)
    with TenantStore(db) as store:
        store.create_tenant("acme")
        plain_id, plain = store.create_key("acme")
        batch_id, batch = store.create_key("acme", "batch")
        assert [k.priority for k in store.list_keys("acme")] == ["interactive", "batch"]
        snapshot = KeySnapshot(db.query(LIVE_KEYS_SQL))
        principals = [snapshot.lookup(k) for k in (plain, batch)]
        assert [p and p.priority for p in principals] == ["interactive", "batch"]
        assert store.set_key_limits(batch_id, Limits(rpm=5)).priority == "batch"
        assert store.revoke_key(batch_id).priority == "batch"
        with pytest.raises(StoreError, match="invalid priority 'urgent': expected one of"):
            store.create_key("acme", "urgent")
        with pytest.raises(ConflictError):
            db.execute("UPDATE api_keys SET priority = 'urgent' WHERE id = ?", (plain_id,))
        assert [k.priority for k in store.list_keys("acme")] == ["interactive", "batch"]


@pytest.mark.unit
def test_a_key_from_before_bands_is_interactive(tmp_path: Path) -> None:
    """A version-6 database's keys take the interactive band when it migrates to 7."""
    path = tmp_path / "saltgate.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for migration in SQLITE_MIGRATIONS:
        if migration.version <= 6:
            for stmt in migration.statements:
                conn.execute(stmt)
    conn.execute("PRAGMA user_version = 6")
    conn.execute("INSERT INTO tenants (id, name, created_at) VALUES ('tn_0', 'acme', 1.0)")
    conn.execute(
        "INSERT INTO api_keys (id, tenant_id, key_hash, created_at) VALUES (?, ?, ?, 1.0)",
        ("key_000000000001", "tn_0", hashlib.sha256(b"k").digest()),
    )
    conn.close()
    migrate_store(StoreSettings.sqlite(path))
    with TenantStore(path) as store:
        [key] = store.list_keys()
    assert (key.id, key.priority) == ("key_000000000001", "interactive")


def test_errors_are_clear_and_never_echo_keys(store_settings: StoreSettings) -> None:
    with TenantStore(open_database(store_settings)) as store:
        store.create_tenant("acme")
        key_id, key = store.create_key("acme")
        with pytest.raises(KeyNotFoundError, match="key_000000000000") as e1:
            store.revoke_key("key_000000000000")
        assert "no such key id" in str(e1.value)
        # A key pasted where an id belongs: refused without repeating it.
        with pytest.raises(KeyNotFoundError) as e2:
            store.revoke_key(key)
        with pytest.raises(TenantNotFoundError) as e3:
            store.create_key(key)
        for err in (e2.value, e3.value):
            assert key not in str(err) and key[3:20] not in str(err)
            assert "looks like an API key" in str(err)
        store.revoke_key(key_id)
        with pytest.raises(KeyRevokedError, match="already revoked"):
            store.revoke_key(key_id)
        with pytest.raises(TenantNotFoundError, match="'ghost'"):
            store.create_key("ghost")


@pytest.mark.unit
def test_refresh_is_cheap_and_ignores_usage_writes(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"
    with TenantStore(path) as store:
        store.create_tenant("acme")
        store.create_key("acme")
    index = KeyIndex(path, max_staleness=None)
    reloads = index.reloads
    assert not index.refresh_if_changed()

    async def meter() -> None:
        ledger = Ledger(path)
        rec = UsageRecord(new_request_id(), time.time(), "tn_x", "key_x", "m", 1, 0, 1, 200)
        await ledger.record(rec)
        await ledger.aclose()

    asyncio.run(meter())
    # Another connection committed (data_version moved) but auth data did not change.
    assert not index.refresh_if_changed()
    assert index.reloads == reloads
    index.close()


def _cli(path: Path, code: str) -> str:
    """Run store code in another process, as the `saltgate` CLI would."""
    script = f"from saltgate.store.tenants import TenantStore\nstore = TenantStore({str(path)!r})\n"
    out = subprocess.run(
        [sys.executable, "-c", script + textwrap.dedent(code)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip()


def test_revocation_and_rotation_from_another_process_apply_within_a_second(
    tmp_path: Path,
) -> None:
    path = tmp_path / "saltgate.db"
    out = _cli(path, "store.create_tenant('acme'); print(*store.create_key('acme'))")
    key_id, key = out.split()
    index = KeyIndex(path, max_staleness=0.5)  # a running gateway
    p = index.authenticate(key)
    assert p is not None and p.epoch == 0

    def epoch() -> int | None:
        principal = index.authenticate(key)
        return None if principal is None else principal.epoch

    _cli(path, "print(store.rotate_salt('acme'))")
    eventually_blocking(lambda: epoch() == 1, timeout_s=1.0, what="the rotation is seen")
    _cli(path, f"store.revoke_key({key_id!r})")
    eventually_blocking(lambda: epoch() is None, timeout_s=1.0, what="the revocation is seen")
    index.close()


def test_a_second_connection_in_the_gateway_does_not_blind_its_key_index(
    tmp_path: Path,
) -> None:
    """The gateway opens its ledger after its key index. Opening a connection must not
    release the locks the first one holds (closing any descriptor of the file would): the
    CLI could then remove the WAL index the key index maps, and from its next change on
    the gateway would keep authenticating with what it had (a revoked key kept working)."""
    path = tmp_path / "saltgate.db"
    out = _cli(path, "store.create_tenant('acme'); print(*store.create_key('acme'))")
    key_id, key = out.split()
    index = KeyIndex(path, max_staleness=0.0)
    ledger = open_db(path)  # as the gateway's ledger does, after the key index
    _cli(path, "print(store.rotate_salt('acme'))")
    eventually_blocking(
        lambda: getattr(index.authenticate(key), "epoch", None) == 1,
        timeout_s=1.0,
        what="the rotation is seen",
    )
    _cli(path, f"store.revoke_key({key_id!r})")
    eventually_blocking(
        lambda: index.authenticate(key) is None, timeout_s=1.0, what="the revocation is seen"
    )
    ledger.close()
    index.close()
