"""Upgrades (issue 43): only `saltgate store migrate` migrates an existing store.

A store at schema version 10 (built here from the migrations themselves, with a tenant
and a key in it) is refused by the gateway and by every admin command, unchanged, with
a message naming `saltgate store migrate`, exit status 2; `store status` lists the steps
to 12 and exits 3; `store migrate` brings it to 12 (SQLite: after an online backup), again
is a no-op, and the commands then work with the tenant and its key as they were. On both
backends. Before the change any command migrated the store silently.

Version 12 (issue 42) moves each tenant's weight out of its stored limits into its own
column: a weight set before the migration survives it, on both backends.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from saltgate.cli import main
from saltgate.config import create_master_key
from saltgate.store.backends import open_gateway_store, schema_status
from saltgate.store.errors import SchemaVersionError
from saltgate.store.postgres import conninfo
from saltgate.store.schema import (
    POSTGRES_MIGRATIONS,
    POSTGRES_VERSION_TABLE,
    SCHEMA_VERSION,
    SQLITE_MIGRATIONS,
    SQLITE_VERSION_TABLE,
    Migration,
    migration_steps,
    statement_words,
)
from saltgate.store.settings import StoreSettings
from saltgate.store.sqlite import read_schema_version
from saltgate.store.tenants import hash_api_key, new_api_key

OLD = 10
STEPS = (
    "11: responses kept on replicas: their owners (add table responses)",
    "12: tenants: the fair-share weight beside the limits (add column tenants.weight; move "
    "each weight stored in tenants.limits into tenants.weight)",
)
KEY = new_api_key()
MIGRATE_HINT = "saltgate store migrate"
assert OLD + len(STEPS) == SCHEMA_VERSION  # a new version adds its step to STEPS


def _up_to(migrations: tuple[Migration, ...], version: int) -> list[Migration]:
    return [m for m in migrations if m.version <= version]


def old_store(settings: StoreSettings, version: int = OLD) -> None:
    """A store as saltgate left it at `version`: its migrations applied and recorded, one
    tenant (acme) with one key (KEY)."""
    rows = (
        "INSERT INTO tenants (id, name, epoch, created_at) VALUES ('tn_0', 'acme', 0, 1.0)",
        "INSERT INTO api_keys (id, tenant_id, key_hash, created_at) "
        "VALUES ('key_000000000001', 'tn_0', ?, 1.0)",
    )
    if settings.backend == "sqlite":
        assert settings.sqlite_path is not None
        settings.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(settings.sqlite_path, isolation_level=None)
        conn.execute(SQLITE_VERSION_TABLE)
        for m in _up_to(SQLITE_MIGRATIONS, version):
            for stmt in m.statements:
                conn.execute(stmt)
            conn.execute("INSERT INTO schema_version VALUES (?, ?, 0)", (m.version, m.name))
        conn.execute(rows[0])
        conn.execute(rows[1], (hash_api_key(KEY),))
        conn.execute(f"PRAGMA user_version = {version}")
        conn.close()
        return
    with psycopg.connect(conninfo(settings), autocommit=True) as pg:
        pg.execute(POSTGRES_VERSION_TABLE)
        for m in _up_to(POSTGRES_MIGRATIONS, version):
            for stmt in m.statements:
                pg.execute(stmt)
            pg.execute("INSERT INTO schema_version VALUES (%s, %s, 0)", (m.version, m.name))
        pg.execute(rows[0])
        pg.execute(rows[1].replace("?", "%s"), (hash_api_key(KEY),))


def write_config(settings: StoreSettings, tmp_path: Path) -> Path:
    """A gateway's config on `settings`, its master key made (the state dir's)."""
    (tmp_path / "state").mkdir(mode=0o700, exist_ok=True)
    create_master_key(tmp_path / "state" / "master.key")
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nport = 0\nadmin_port = 0\nstate_dir = "{tmp_path / "state"}"\n'
        f'{settings.toml()}[[replicas]]\nurl = "http://127.0.0.1:1"\n'
    )
    return config


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    """`saltgate serve` as a process: refused, it exits at once (a timeout here means it
    started serving on the old store)."""
    return saltgate_process("serve", "--config", str(config))


def saltgate_process(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "saltgate.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def authenticates(settings: StoreSettings) -> bool:
    store = await open_gateway_store(settings)
    try:
        return store.keys.authenticate(KEY) is not None
    finally:
        await store.aclose()


def test_an_older_store_is_refused_until_store_migrate(
    store_settings: StoreSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old_store(store_settings)
    c = ("--config", str(write_config(store_settings, tmp_path)))

    # The gateway refuses, as a configuration error, saying what to run.
    done = serve(Path(c[1]))
    assert done.returncode == 2, done.stderr
    assert f"at schema version {OLD}; this saltgate uses {SCHEMA_VERSION}" in done.stderr
    assert MIGRATE_HINT in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(SchemaVersionError, match=MIGRATE_HINT):
        asyncio.run(authenticates(store_settings))
    # So does every admin command, writing or reading, and nothing changes.
    for command in (
        ("tenants", "list"),
        ("tenants", "create", "beta"),
        ("keys", "create", "acme"),
        ("keys", "list"),
        ("usage",),
        ("admin-tokens", "list"),
        ("prices", "list"),
    ):
        code, _, err = run(capsys, *command, *c)
        assert (code, err.count("\n")) == (2, 0), (command, err)
        assert MIGRATE_HINT in err, command
    assert schema_status(store_settings).version == OLD

    # status: the version, this saltgate's, and the step; exit 3.
    code, out, _ = run(capsys, "store", "status", *c)
    assert code == 3
    assert f"schema version: {OLD}" in out and f"this saltgate: {SCHEMA_VERSION}" in out
    assert out.splitlines()[-len(STEPS) :] == [f"  {step}" for step in STEPS]
    code, out, _ = run(capsys, "store", "status", "--json", *c)
    assert code == 3
    assert json.loads(out) == {
        "backend": store_settings.backend,
        "store": store_settings.describe(),
        "schema_version": OLD,
        "expected_version": SCHEMA_VERSION,
        "state": "pending",
        "steps": list(STEPS),
    }

    # migrate: to the current version; on SQLite after a backup of the old store.
    code, out, err = run(capsys, "store", "migrate", *c)
    assert (code, err) == (0, "")
    assert f"from schema version {OLD} to {SCHEMA_VERSION}" in out
    assert all(step in out for step in STEPS)
    if store_settings.backend == "sqlite":
        assert store_settings.sqlite_path is not None
        backup = store_settings.sqlite_path.with_name(f"saltgate.db.pre-v{SCHEMA_VERSION}")
        assert f"to {backup}" in out
        assert read_schema_version(backup) == OLD
        with sqlite3.connect(backup) as conn:
            assert conn.execute("SELECT name FROM tenants").fetchall() == [("acme",)]
        assert oct(backup.stat().st_mode & 0o777) == oct(0o600)
    else:
        assert "pg_dump" in out
    assert run(capsys, "store", "status", *c)[0] == 0

    # Again: nothing to do (and no second backup).
    code, out, err = run(capsys, "store", "migrate", *c)
    assert (code, err) == (0, "") and out.endswith("current; nothing to do")

    # The commands and the gateway's store work, with the tenant and its key as they were.
    code, out, _ = run(capsys, "tenants", "list", *c)
    assert code == 0 and "\tacme\t" in out
    assert asyncio.run(authenticates(store_settings))


def test_a_newer_store_is_refused_by_every_command(
    store_settings: StoreSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old_store(store_settings, SCHEMA_VERSION)
    if store_settings.backend == "sqlite":
        assert store_settings.sqlite_path is not None
        with sqlite3.connect(store_settings.sqlite_path) as conn:
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    else:
        with psycopg.connect(conninfo(store_settings), autocommit=True) as pg:
            pg.execute("INSERT INTO schema_version VALUES (%s, 'future', 0)", (SCHEMA_VERSION + 1,))
    c = ("--config", str(write_config(store_settings, tmp_path)))
    newer = f"version {SCHEMA_VERSION + 1} is newer than this saltgate supports"
    code, out, _ = run(capsys, "store", "status", *c)
    assert code == 4 and "newer than this saltgate" in out
    for command in (("store", "migrate"), ("tenants", "list")):
        code, _, err = run(capsys, *command, *c)
        assert code == 2 and newer in err, command
    done = serve(Path(c[1]))
    assert done.returncode == 2 and newer in done.stderr


def test_a_new_store_is_still_created_at_the_current_version(
    store_settings: StoreSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """First runs keep working: an empty store is given the schema by any command."""
    c = ("--config", str(write_config(store_settings, tmp_path)))
    if store_settings.backend == "postgresql":  # an empty database: status says so
        code, out, _ = run(capsys, "store", "status", "--json", *c)
        assert code == 3 and json.loads(out)["state"] == "new"
        assert len(json.loads(out)["steps"]) == len(POSTGRES_MIGRATIONS)
    else:  # no file: status reads, and creates none
        code, _, err = run(capsys, "store", "status", *c)
        assert code == 1 and "no saltgate database at" in err
        assert store_settings.sqlite_path is not None
        assert not store_settings.sqlite_path.exists()
    assert run(capsys, "tenants", "create", "acme", *c)[0] == 0
    assert run(capsys, "store", "status", *c)[0] == 0
    assert schema_status(store_settings).version == SCHEMA_VERSION


def test_saltgate_up_refuses_an_older_state_dir(tmp_path: Path) -> None:
    settings = StoreSettings.in_state_dir(tmp_path / "state")
    old_store(settings)
    done = saltgate_process("up", "--port", "0", "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("saltgate up: the store ") and MIGRATE_HINT in done.stderr
    assert schema_status(settings).version == OLD


@pytest.mark.unit
def test_serve_check_refuses_an_older_sqlite_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve --check` (ExecStartPre) says before a start what `serve` would refuse."""
    settings = StoreSettings.in_state_dir(tmp_path / "state")
    config = write_config(settings, tmp_path)
    assert run(capsys, "serve", "--check", "--config", str(config))[0] == 0  # new: created
    old_store(settings)
    code, _, err = run(capsys, "serve", "--check", "--config", str(config))
    assert code == 2 and f"at schema version {OLD}" in err and MIGRATE_HINT in err
    assert run(capsys, "store", "migrate", "--no-backup", "--config", str(config))[0] == 0
    assert settings.sqlite_path is not None
    assert not settings.sqlite_path.with_name(f"saltgate.db.pre-v{SCHEMA_VERSION}").exists()
    code, out, _ = run(capsys, "serve", "--check", "--config", str(config))
    assert code == 0 and f"schema version {SCHEMA_VERSION}" in out


@pytest.mark.unit
@pytest.mark.parametrize("migrations", [SQLITE_MIGRATIONS, POSTGRES_MIGRATIONS])
def test_every_migration_is_described_in_words(migrations: tuple[Migration, ...]) -> None:
    """`store status` derives each step's words from its statements, so they cannot drift
    from what it does; every version says something, and a current store has no step."""
    steps = migration_steps(migrations, 0)
    assert [int(step.split(":")[0]) for step in steps] == [m.version for m in migrations]
    assert all(step.endswith(")") and " (" in step for step in steps), steps
    assert migration_steps(migrations, SCHEMA_VERSION) == ()
    assert migration_steps(migrations, OLD) == STEPS


@pytest.mark.unit
def test_what_the_steps_say() -> None:
    [v4] = [m for m in SQLITE_MIGRATIONS if m.version == 4]
    words = [statement_words(stmt) for stmt in v4.statements]
    assert words[0] == "rebuild table usage (rewrites every row)"
    assert "add table prices" in words
    assert statement_words("ALTER TABLE api_keys ADD COLUMN priority TEXT") == (
        "add column api_keys.priority"
    )
    assert statement_words("DROP INDEX usage_ts") == "drop index usage_ts"
    assert statement_words("CREATE TRIGGER t AFTER INSERT ON usage BEGIN END") == (
        "add trigger t on usage"
    )
    assert statement_words("DROP TABLE usage") is None  # part of the rebuild above


# Version 11 stores as saltgate left them: the weight inside each tenant's limits JSON.
# (limits as stored, the limits and weight after the migration)
WEIGHTED = {
    "acme": ('{"rpm": 60, "weight": 2.5}', {"rpm": 60}, 2.5),
    "beta": ('{"weight": 3}', None, 3.0),  # a weight alone: no limits left
    "gamma": ('{"rpm": 5}', {"rpm": 5}, 1.0),  # never weighted: the default
    "delta": (None, None, 1.0),
    "omega": ('{"weight": 1e308}', None, 100.0),  # stored before the bounds: held to them
}


def _execute(
    settings: StoreSettings, sql: str, params: tuple[object, ...] = ()
) -> list[tuple[Any, ...]]:
    if settings.backend == "sqlite":
        assert settings.sqlite_path is not None
        with sqlite3.connect(settings.sqlite_path) as conn:
            return conn.execute(sql, params).fetchall()
    with psycopg.connect(conninfo(settings), autocommit=True) as pg:
        cur = pg.execute(sql.replace("?", "%s"), params)
        return cur.fetchall() if cur.description else []


def test_a_weight_set_before_version_12_survives_the_migration(
    store_settings: StoreSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 42: a tenant's weight was stored in its limits JSON; `store migrate` moves it
    into tenants.weight and out of the JSON (limits left empty are NULL), so the tenant
    keeps its share, its limits, and its key's principal carries the weight."""
    old_store(store_settings, OLD + 1)
    _execute(
        store_settings, "UPDATE tenants SET limits = ? WHERE id = 'tn_0'", (WEIGHTED["acme"][0],)
    )
    for i, name in enumerate(n for n in WEIGHTED if n != "acme"):
        _execute(
            store_settings,
            "INSERT INTO tenants (id, name, epoch, created_at, limits) VALUES (?, ?, 0, 1.0, ?)",
            (f"tn_{i + 1}", name, WEIGHTED[name][0]),
        )
    c = ("--config", str(write_config(store_settings, tmp_path)))
    code, out, _ = run(capsys, "store", "status", *c)
    assert code == 3 and out.splitlines()[-1] == f"  {STEPS[-1]}"
    assert run(capsys, "store", "migrate", "--no-backup", *c)[0] == 0

    rows = _execute(store_settings, "SELECT name, limits, weight FROM tenants")
    stored = {name: (None if limits is None else json.loads(limits), w) for name, limits, w in rows}
    assert stored == {name: (limits, weight) for name, (_, limits, weight) in WEIGHTED.items()}
    code, out, _ = run(capsys, "tenants", "list", *c)
    assert code == 0
    listed = {line.split("\t")[1]: line.split("\t")[-2:] for line in out.splitlines()}
    assert listed["acme"] == ["limits rpm=60", "weight 2.5"]
    assert listed["beta"] == ["limits none", "weight 3"]
    assert listed["omega"] == ["limits none", "weight 100"]

    async def principal() -> tuple[float, bool]:
        store = await open_gateway_store(store_settings)
        try:
            found = store.keys.authenticate(KEY)
            assert found is not None and found.tenant_name == "acme"
            return found.weight, found.limited
        finally:
            await store.aclose()

    assert asyncio.run(principal()) == (2.5, True)
