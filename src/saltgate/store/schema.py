"""The store's schema, versioned, for both backends (pure data: the SQL text only).

One logical version number covers both: a database at version N has the same tables and
meaning on SQLite and on PostgreSQL. Each backend has its own statements per version;
PostgreSQL came at version 3 and starts from a baseline that creates version 3 at once.
Append only: a released migration is never edited.

Both record what was applied in one table, `schema_version` (version, name, applied_at).
SQLite also keeps ``PRAGMA user_version`` equal to the version, because that is what
saltgate releases before the table read, and how they refuse a newer database.
"""

# ruff: noqa: S608 - statements built from the constants below, never from input

from __future__ import annotations

import re
from dataclasses import dataclass

# PostgreSQL NOTIFY channel on which the trigger below says "tenants, keys or prices changed".
LISTEN_AUTH_SQL = "LISTEN saltgate_auth"
# pg_advisory_xact_lock key: gateways and CLIs starting together migrate one at a time.
MIGRATION_LOCK_ID = 0x5A17_6A7E


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


# The same statement on both backends. NULL: the tenant may use every model; else a JSON
# array of the model names it may use (saltgate tenants set-models). The gateways see a
# change through the auth generation, which every UPDATE of tenants bumps.
TENANT_MODELS = Migration(
    5, "tenants: allowed models", ("ALTER TABLE tenants ADD COLUMN allowed_models TEXT",)
)

# The same statements on both backends. NULL: no limits; else a JSON object of the limits
# set (saltgate.governance.limits.Limits: saltgate tenants set-limits / keys set-limits).
# They reach the gateways as models do, through the auth generation.
LIMITS = Migration(
    6,
    "tenants and keys: limits and budgets",
    (
        "ALTER TABLE tenants ADD COLUMN limits TEXT",
        "ALTER TABLE api_keys ADD COLUMN limits TEXT",
    ),
)

# The same statement on both backends: the key's priority band ("interactive" or
# "batch"), set when the key is created (saltgate keys create --priority). When the
# replicas are saturated the fair queue serves every waiting interactive request before any
# batch one, fairly within a band (issue 23). Keys from before are interactive.
KEY_PRIORITY = Migration(
    7,
    "keys: priority band",
    (
        "ALTER TABLE api_keys ADD COLUMN priority TEXT NOT NULL DEFAULT 'interactive' "
        "CHECK (priority IN ('interactive', 'batch'))",
    ),
)


def _admin_plane(blob: str, real: str, integer: str, append_only: tuple[str, ...]) -> Migration:
    """Version 8 on one backend (its column types and its append-only triggers).

    Admin tokens are stored as SHA-256 digests like API keys (saltgate.store.admin_tokens);
    ``tenant_id`` NULL: the token may act on every tenant. The audit log is append-only
    (triggers refuse UPDATE and DELETE) and each entry carries the SHA-256 of its
    predecessor's hash and its own canonical encoding (saltgate.store.audit), so an edit
    made past the triggers is found by `saltgate audit-log verify`. Keys gain an expiry
    (a rotation's grace period) and tenants an archive time (their keys stop working).
    """
    return Migration(
        8,
        "admin tokens and audit log",
        (
            f"""CREATE TABLE admin_tokens (
                id TEXT PRIMARY KEY,
                token_hash {blob} NOT NULL UNIQUE CHECK (length(token_hash) = 32),
                scopes TEXT NOT NULL,
                tenant_id TEXT REFERENCES tenants(id),
                created_at {real} NOT NULL,
                created_by TEXT NOT NULL,
                last_used_at {real},
                revoked_at {real}
            )""",
            f"""CREATE TABLE audit_log (
                seq {integer} PRIMARY KEY,
                ts {real} NOT NULL,
                actor TEXT NOT NULL,
                action TEXT NOT NULL,
                resource_type TEXT NOT NULL,
                resource_id TEXT NOT NULL,
                tenant_id TEXT,
                before_json TEXT,
                after_json TEXT,
                request_id TEXT,
                prev_hash {blob} NOT NULL CHECK (length(prev_hash) = 32),
                entry_hash {blob} NOT NULL CHECK (length(entry_hash) = 32)
            )""",
            "CREATE INDEX audit_log_tenant ON audit_log(tenant_id, seq)",
            # The admin API pages a tenant's keys by id (keyset pagination).
            "CREATE INDEX api_keys_tenant_page ON api_keys(tenant_id, id)",
            # When each key was last used, written by the gateways' ledgers once a minute
            # (saltgate.store.ledger.KeyUse): the key list's "last used" without a scan.
            f"CREATE TABLE key_last_used (key_id TEXT PRIMARY KEY, ts {real} NOT NULL)",
            f"ALTER TABLE api_keys ADD COLUMN expires_at {real}",
            f"ALTER TABLE tenants ADD COLUMN archived_at {real}",
            *append_only,
        ),
    )


# Usage rollups (version 9): the ledger summed per bucket, kept by triggers in the same
# transaction as the ledger rows, so no path that writes the ledger (the ledger, a replayed
# spool, a store copy, a prune) can leave them behind. Usage queries read them, never the
# ledger (docs/usage-api.md). Each: table, bucket width in seconds, the ledger columns it
# keeps apart. A replica not recorded (rows from before version 9) is ''. Daily buckets by
# key, model or replica are summed from the hourly table: a third upsert per record saved
# on SQLite, where each costs about three ledger inserts; the tenant-only daily table
# answers every tenant's daily series without reading a row per key and hour.
ROLLUP_DIMS = ("tenant_id", "key_id", "model", "replica")
ROLLUPS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("usage_rollup_tenant_1d", 86400, ("tenant_id",)),
    ("usage_rollup_1h", 3600, ROLLUP_DIMS),
    ("usage_rollup_1m", 60, ROLLUP_DIMS),
)
# Each sum, and the ledger expression summed into it ({r}: the row, NEW. in a row trigger).
# Unknown cached tokens are counted apart (requests, and their prompt tokens), never as 0;
# so are requests recorded without a cost.
ROLLUP_SUMS: tuple[tuple[str, str], ...] = (
    ("requests", "1"),
    ("errors", "CASE WHEN {r}status >= 400 THEN 1 ELSE 0 END"),
    ("input_tokens", "{r}prompt_tokens"),
    ("cached_tokens", "coalesce({r}cached_tokens, 0)"),
    ("cached_unknown_requests", "CASE WHEN {r}cached_tokens IS NULL THEN 1 ELSE 0 END"),
    (
        "cached_unknown_input_tokens",
        "CASE WHEN {r}cached_tokens IS NULL THEN {r}prompt_tokens ELSE 0 END",
    ),
    ("output_tokens", "{r}completion_tokens"),
    ("cost_micro_usd", "coalesce({r}cost_micro_usd, 0)"),
    ("unpriced_requests", "CASE WHEN {r}cost_micro_usd IS NULL THEN 1 ELSE 0 END"),
)


def _key(dims: tuple[str, ...]) -> str:
    """Bucket first: the ledger's rows arrive in time order, so a commit's upserts land in
    the last few pages of each table instead of one page per tenant (which multiplied the
    pages a commit writes to the WAL)."""
    return ", ".join(("bucket", *dims))


def _rollup_table(table: str, dims: tuple[str, ...], suffix: str = "") -> str:
    columns = ", ".join(f"{d} TEXT NOT NULL" for d in dims)
    sums = ", ".join(f"{name} BIGINT NOT NULL" for name, _ in ROLLUP_SUMS)
    return (
        f"CREATE TABLE {table} (bucket BIGINT NOT NULL, {columns}, {sums}, "
        f"PRIMARY KEY ({_key(dims)})){suffix}"
    )


def _tenant_index(table: str) -> str:
    """A tenant's series, read by (tenant, bucket). Only a new row (a group's first record
    in a bucket) adds an entry; the sums' updates leave it alone."""
    return f"CREATE INDEX {table}_tenant ON {table}(tenant_id, bucket)"


def _select(width: int, dims: tuple[str, ...], r: str, pg: bool) -> list[str]:
    # Floor to the second: PostgreSQL rounds a float cast to an integer, SQLite truncates
    # (ts is never negative), and SQLite may lack floor().
    second = f"CAST(floor({r}ts) AS BIGINT)" if pg else f"CAST({r}ts AS BIGINT)"
    bucket = f"{second} / {width} * {width}"
    values = [f"coalesce({r}{d}, '')" if d == "replica" else f"{r}{d}" for d in dims]
    sums = [expr.format(r=r) for _, expr in ROLLUP_SUMS]
    return [bucket, *values, *(s if r else f"sum({s})" for s in sums)]


def _group(dims: tuple[str, ...]) -> str:
    return ", ".join(str(i) for i in range(1, len(dims) + 2))


def rollup_select(width: int, dims: tuple[str, ...], source: str, pg: bool) -> str:
    """The ledger rows of `source` summed as a rollup table holds them (reconcile's too)."""
    values = ", ".join(_select(width, dims, "", pg))
    return f"SELECT {values} FROM {source} GROUP BY {_group(dims)}"


def rollup_upsert(table: str, width: int, dims: tuple[str, ...], source: str, pg: bool) -> str:
    """Add the ledger rows of `source` (a table, or NEW for one SQLite row) to `table`."""
    names = ", ".join(("bucket", *dims, *(n for n, _ in ROLLUP_SUMS)))
    updates = ", ".join(f"{n} = {table}.{n} + excluded.{n}" for n, _ in ROLLUP_SUMS)
    if source == "NEW":
        select = f"VALUES ({', '.join(_select(width, dims, 'NEW.', pg))})"
    else:
        # Ordered by the key: concurrent commits lock rollup rows in one order (PostgreSQL).
        select = f"{rollup_select(width, dims, source, pg)} ORDER BY {_group(dims)}"
    return (
        f"INSERT INTO {table} ({names}) {select} ON CONFLICT ({_key(dims)}) DO UPDATE SET {updates}"
    )


def _sqlite_unroll(table: str, width: int, dims: tuple[str, ...]) -> tuple[str, str]:
    """Take one deleted row (OLD) out of `table`; a bucket left without requests goes."""
    where = " AND ".join(
        f"{col} = {val}"
        for col, val in zip(("bucket", *dims), _select(width, dims, "OLD.", False), strict=False)
    )
    sets = ", ".join(
        f"{n} = {n} - {expr}"
        for (n, _), expr in zip(
            ROLLUP_SUMS, _select(width, dims, "OLD.", False)[len(dims) + 1 :], strict=True
        )
    )
    return (
        f"UPDATE {table} SET {sets} WHERE {where}",
        f"DELETE FROM {table} WHERE {where} AND requests = 0",
    )


def rollup_backfill(pg: bool) -> tuple[str, ...]:
    """Sum the whole ledger into the (empty) rollups: the migration, and a bulk load."""
    source = "usage" if pg else "usage WHERE true"  # WHERE: SQLite's upsert-after-SELECT rule
    return tuple(rollup_upsert(t, w, d, source, pg) for t, w, d in ROLLUPS)


SQLITE_ROLLUP_TRIGGER = "usage_rollup_insert"


def sqlite_rollup_trigger() -> str:
    inserts = " ".join(rollup_upsert(t, w, d, "NEW", False) + ";" for t, w, d in ROLLUPS)
    return f"CREATE TRIGGER {SQLITE_ROLLUP_TRIGGER} AFTER INSERT ON usage BEGIN {inserts} END"


def _sqlite_rollups() -> tuple[str, ...]:
    deletes = " ".join(s + ";" for t, w, d in ROLLUPS for s in _sqlite_unroll(t, w, d))
    return (
        "ALTER TABLE usage ADD COLUMN replica TEXT",
        *(_rollup_table(t, d, " WITHOUT ROWID") for t, _, d in ROLLUPS),
        *(_tenant_index(t) for t, _, _ in ROLLUPS),
        *rollup_backfill(pg=False),  # the rollups start equal to the ledger
        sqlite_rollup_trigger(),
        f"CREATE TRIGGER usage_rollup_delete AFTER DELETE ON usage BEGIN {deletes} END",
    )


def _postgres_unroll(table: str, width: int, dims: tuple[str, ...]) -> str:
    """Take the deleted rows (old_rows) out of `table`; buckets left without requests go."""
    cols = ("bucket", *dims)
    names = (*cols, *(n for n, _ in ROLLUP_SUMS))
    summed = ", ".join(
        f"{expr} AS {name}"
        for expr, name in zip(_select(width, dims, "", True), names, strict=True)
    )
    match = " AND ".join(f"{table}.{c} = o.{c}" for c in cols)
    sets = ", ".join(f"{n} = {table}.{n} - o.{n}" for n, _ in ROLLUP_SUMS)
    old = f"(SELECT {summed} FROM old_rows GROUP BY {_group(dims)}) o"
    return (
        f"UPDATE {table} SET {sets} FROM {old} WHERE {match}; "
        f"DELETE FROM {table} USING {old} WHERE {match} AND {table}.requests = 0"
    )


def _postgres_rollups() -> tuple[str, ...]:
    inserts = " ".join(rollup_upsert(t, w, d, "new_rows", True) + ";" for t, w, d in ROLLUPS)
    deletes = " ".join(_postgres_unroll(t, w, d) + ";" for t, w, d in ROLLUPS)
    return (
        "ALTER TABLE usage ADD COLUMN replica TEXT",
        *(_rollup_table(t, d) for t, _, d in ROLLUPS),
        *(_tenant_index(t) for t, _, _ in ROLLUPS),
        *rollup_backfill(pg=True),
        # Statement triggers: one aggregated upsert per table for a whole batch of records.
        "CREATE FUNCTION saltgate_usage_rollup_insert() RETURNS trigger LANGUAGE plpgsql "
        f"AS $$ BEGIN {inserts} RETURN NULL; END $$",
        "CREATE TRIGGER usage_rollup_insert AFTER INSERT ON usage REFERENCING NEW TABLE AS "
        "new_rows FOR EACH STATEMENT EXECUTE FUNCTION saltgate_usage_rollup_insert()",
        "CREATE FUNCTION saltgate_usage_rollup_delete() RETURNS trigger LANGUAGE plpgsql "
        f"AS $$ BEGIN {deletes} RETURN NULL; END $$",
        "CREATE TRIGGER usage_rollup_delete AFTER DELETE ON usage REFERENCING OLD TABLE AS "
        "old_rows FOR EACH STATEMENT EXECUTE FUNCTION saltgate_usage_rollup_delete()",
    )


ROLLUPS_NAME = "usage rollups"


def _responses(real: str) -> Migration:
    """Version 11 on one backend: with `[responses] store = true`, each response a replica
    keeps, under its owner: the tenant that made it and the replica that holds it
    (gateway/responses.py). Read by id only; a response deleted through the gateway goes."""
    return Migration(
        11,
        "responses kept on replicas: their owners",
        (
            f"""CREATE TABLE responses (
                id TEXT PRIMARY KEY,
                tenant_id TEXT NOT NULL,
                replica TEXT NOT NULL,
                created_at {real} NOT NULL
            )""",
        ),
    )


def _model_prices(integer: str, real: str, changed: tuple[str, ...]) -> Migration:
    """Version 10 on one backend: prices set through the store (the admin API's
    ``PUT /admin/v1/prices/{model}``, `saltgate prices set`), one row per model, in
    micro-dollars per million tokens. A row overrides the config's ``[prices.MODEL]``;
    deleting it reverts to the config's. A change bumps the auth generation (`changed`),
    so the gateways reload prices with their keys, within a second (saltgate.store.prices).
    """
    return Migration(
        10,
        "prices set through the store",
        (
            f"""CREATE TABLE model_prices (
                model TEXT PRIMARY KEY,
                input_micro_usd_per_mtok {integer} NOT NULL CHECK (input_micro_usd_per_mtok >= 0),
                cached_input_micro_usd_per_mtok {integer} NOT NULL
                    CHECK (cached_input_micro_usd_per_mtok >= 0),
                output_micro_usd_per_mtok {integer} NOT NULL CHECK (output_micro_usd_per_mtok >= 0),
                updated_at {real} NOT NULL
            )""",
            *changed,
        ),
    )


def _tenant_weight(real: str, moved: str, kept: str, found: str, *, pg: bool) -> Migration:
    """Version 12 on one backend: a tenant's fair-share weight (docs/fairness.md) becomes
    its own column, beside its limits instead of inside their JSON (where saltgate kept it
    from version 6). A weight found there moves into the column, held within the bounds the
    fair queue applies (governance/weight.py), and leaves the JSON; limits left empty are
    NULL, as a tenant without limits is stored. `moved`: the stored weight as a number,
    `kept`: the limits without it, `found`: whether a row holds one (each on `limits`).
    On PostgreSQL the statement trigger would move the auth generation even when no row
    holds a weight (a new store): the update runs only when one does."""
    move = f"UPDATE tenants SET weight = {moved}, limits = nullif({kept}, '{{}}') WHERE {found}"
    if pg:
        move = (
            f"DO $$ BEGIN IF EXISTS (SELECT 1 FROM tenants WHERE {found}) THEN {move}; "
            "END IF; END $$"
        )
    return Migration(
        12,
        "tenants: the fair-share weight beside the limits",
        (
            f"ALTER TABLE tenants ADD COLUMN weight {real} NOT NULL DEFAULT 1 CHECK (weight > 0)",
            move,
        ),
    )


SQLITE_VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_version ("
    "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL)"
)

SQLITE_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "tenants, hashed API keys, epochs and the usage ledger",
        (
            """CREATE TABLE meta (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                auth_generation INTEGER NOT NULL
            )""",
            "INSERT INTO meta (id, auth_generation) VALUES (1, 0)",
            """CREATE TABLE tenants (
                id TEXT PRIMARY KEY,
                name TEXT NOT NULL UNIQUE,
                epoch INTEGER NOT NULL DEFAULT 0 CHECK (epoch >= 0),
                created_at REAL NOT NULL
            )""",
            """CREATE TABLE api_keys (
                id TEXT PRIMARY KEY,
                tenant_id TEXT NOT NULL REFERENCES tenants(id),
                key_hash BLOB NOT NULL UNIQUE CHECK (length(key_hash) = 32),
                created_at REAL NOT NULL,
                revoked_at REAL
            )""",
            "CREATE INDEX api_keys_tenant ON api_keys(tenant_id)",
            # auth_generation changes on every tenant/key mutation, so a gateway can tell
            # "auth data changed" from "usage rows were appended" with one tiny read.
            "CREATE TRIGGER tenants_insert_bump AFTER INSERT ON tenants "
            "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
            "CREATE TRIGGER tenants_update_bump AFTER UPDATE ON tenants "
            "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
            "CREATE TRIGGER tenants_delete_bump AFTER DELETE ON tenants "
            "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
            "CREATE TRIGGER api_keys_insert_bump AFTER INSERT ON api_keys "
            "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
            "CREATE TRIGGER api_keys_update_bump AFTER UPDATE ON api_keys "
            "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
            "CREATE TRIGGER api_keys_delete_bump AFTER DELETE ON api_keys "
            "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END",
            # No foreign key: metering must never fail because a tenant was edited, and
            # the check would cost every insert.
            """CREATE TABLE usage (
                id INTEGER PRIMARY KEY,
                ts REAL NOT NULL,
                tenant_id TEXT NOT NULL,
                key_id TEXT NOT NULL,
                model TEXT NOT NULL,
                prompt_tokens INTEGER NOT NULL,
                cached_tokens INTEGER NOT NULL,
                completion_tokens INTEGER NOT NULL,
                status INTEGER NOT NULL
            )""",
            "CREATE INDEX usage_ts ON usage(ts)",
        ),
    ),
    Migration(
        2,
        "usage: drop the ts index",
        # The ts index cost more than the row itself on every ledger commit (one more page
        # per commit: 47 -> 20 us for a one-row commit, 135 -> 52 us for 13 rows, on this
        # machine); usage reports aggregate by scanning instead (docs/dev/benchmarks-history.md).
        ("DROP INDEX usage_ts",),
    ),
    Migration(
        3,
        "usage: a unique request id per record",
        # A retried commit (or a replayed spool) must never count a request twice. Rows
        # from before have no id (NULL, which UNIQUE lets repeat).
        (
            "ALTER TABLE usage ADD COLUMN request_id TEXT",
            "CREATE UNIQUE INDEX usage_request_id ON usage(request_id)",
        ),
    ),
    Migration(
        4,
        "usage: cached tokens may be unknown (NULL), each record's cost and price version",
        # SQLite cannot drop a NOT NULL: the table is rebuilt, ids and rows kept. Rows
        # from before have no recorded cost (NULL): reports price them and say so.
        (
            """CREATE TABLE usage_v4 (
                id INTEGER PRIMARY KEY,
                ts REAL NOT NULL,
                tenant_id TEXT NOT NULL,
                key_id TEXT NOT NULL,
                model TEXT NOT NULL,
                prompt_tokens INTEGER NOT NULL,
                cached_tokens INTEGER,
                completion_tokens INTEGER NOT NULL,
                status INTEGER NOT NULL,
                request_id TEXT,
                cost_micro_usd INTEGER,
                price_version TEXT
            )""",
            "INSERT INTO usage_v4 (id, ts, tenant_id, key_id, model, prompt_tokens, "
            "cached_tokens, completion_tokens, status, request_id) SELECT id, ts, tenant_id, "
            "key_id, model, prompt_tokens, cached_tokens, completion_tokens, status, "
            "request_id FROM usage",
            "DROP TABLE usage",
            "ALTER TABLE usage_v4 RENAME TO usage",
            "CREATE UNIQUE INDEX usage_request_id ON usage(request_id)",
            """CREATE TABLE prices (
                version TEXT PRIMARY KEY,
                model TEXT NOT NULL,
                input_micro_usd_per_mtok INTEGER NOT NULL,
                cached_input_micro_usd_per_mtok INTEGER NOT NULL,
                output_micro_usd_per_mtok INTEGER NOT NULL,
                effective_from REAL NOT NULL
            )""",
        ),
    ),
    TENANT_MODELS,
    LIMITS,
    KEY_PRIORITY,
    _admin_plane(
        "BLOB",
        "REAL",
        "INTEGER",
        (
            "CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log "
            "BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END",
            "CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log "
            "BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END",
        ),
    ),
    Migration(9, ROLLUPS_NAME, _sqlite_rollups()),
    _model_prices(
        "INTEGER",
        "REAL",
        tuple(
            f"CREATE TRIGGER model_prices_{event.lower()}_bump AFTER {event} ON model_prices "
            "BEGIN UPDATE meta SET auth_generation = auth_generation + 1; END"
            for event in ("INSERT", "UPDATE", "DELETE")
        ),
    ),
    _responses("REAL"),
    _tenant_weight(
        "REAL",
        "max(0.01, min(100.0, json_extract(limits, '$.weight')))",
        "json_remove(limits, '$.weight')",
        "json_type(limits, '$.weight') IN ('integer', 'real')",
        pg=False,
    ),
)

POSTGRES_VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_version ("
    "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at DOUBLE PRECISION)"
)

POSTGRES_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        3,
        "baseline: tenants, hashed API keys, epochs, the usage ledger with request ids",
        (
            """CREATE TABLE meta (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                auth_generation BIGINT NOT NULL
            )""",
            "INSERT INTO meta (id, auth_generation) VALUES (1, 0)",
            """CREATE TABLE tenants (
                id TEXT PRIMARY KEY,
                name TEXT NOT NULL UNIQUE,
                epoch INTEGER NOT NULL DEFAULT 0 CHECK (epoch >= 0),
                created_at DOUBLE PRECISION NOT NULL
            )""",
            """CREATE TABLE api_keys (
                id TEXT PRIMARY KEY,
                tenant_id TEXT NOT NULL REFERENCES tenants(id),
                key_hash BYTEA NOT NULL UNIQUE CHECK (length(key_hash) = 32),
                created_at DOUBLE PRECISION NOT NULL,
                revoked_at DOUBLE PRECISION
            )""",
            "CREATE INDEX api_keys_tenant ON api_keys(tenant_id)",
            # One statement-level trigger per table bumps the generation and notifies every
            # gateway listening; NOTIFY is delivered at commit, once per transaction.
            """CREATE FUNCTION saltgate_auth_changed() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                    UPDATE meta SET auth_generation = auth_generation + 1 WHERE id = 1;
                    PERFORM pg_notify('saltgate_auth', '');
                    RETURN NULL;
                END $$""",
            "CREATE TRIGGER tenants_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE "
            "ON tenants FOR EACH STATEMENT EXECUTE FUNCTION saltgate_auth_changed()",
            "CREATE TRIGGER api_keys_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE "
            "ON api_keys FOR EACH STATEMENT EXECUTE FUNCTION saltgate_auth_changed()",
            # The request id is the key: a replayed or retried record is dropped by
            # ON CONFLICT. No foreign key and no other index, as on SQLite.
            """CREATE TABLE usage (
                request_id TEXT PRIMARY KEY,
                ts DOUBLE PRECISION NOT NULL,
                tenant_id TEXT NOT NULL,
                key_id TEXT NOT NULL,
                model TEXT NOT NULL,
                prompt_tokens INTEGER NOT NULL,
                cached_tokens INTEGER NOT NULL,
                completion_tokens INTEGER NOT NULL,
                status INTEGER NOT NULL
            )""",
        ),
    ),
    Migration(
        4,
        "usage: cached tokens may be unknown (NULL), each record's cost and price version",
        (
            "ALTER TABLE usage ALTER COLUMN cached_tokens DROP NOT NULL",
            "ALTER TABLE usage ADD COLUMN cost_micro_usd BIGINT",
            "ALTER TABLE usage ADD COLUMN price_version TEXT",
            """CREATE TABLE prices (
                version TEXT PRIMARY KEY,
                model TEXT NOT NULL,
                input_micro_usd_per_mtok BIGINT NOT NULL,
                cached_input_micro_usd_per_mtok BIGINT NOT NULL,
                output_micro_usd_per_mtok BIGINT NOT NULL,
                effective_from DOUBLE PRECISION NOT NULL
            )""",
        ),
    ),
    TENANT_MODELS,
    LIMITS,
    KEY_PRIORITY,
    _admin_plane(
        "BYTEA",
        "DOUBLE PRECISION",
        "BIGINT",
        (
            """CREATE FUNCTION saltgate_audit_append_only() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                    RAISE EXCEPTION 'the audit log is append-only';
                END $$""",
            "CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE OR TRUNCATE "
            "ON audit_log FOR EACH STATEMENT EXECUTE FUNCTION saltgate_audit_append_only()",
        ),
    ),
    Migration(9, ROLLUPS_NAME, _postgres_rollups()),
    _model_prices(
        "BIGINT",
        "DOUBLE PRECISION",
        (
            "CREATE TRIGGER model_prices_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE "
            "ON model_prices FOR EACH STATEMENT EXECUTE FUNCTION saltgate_auth_changed()",
        ),
    ),
    _responses("DOUBLE PRECISION"),
    _tenant_weight(
        "DOUBLE PRECISION",
        "greatest(0.01, least(100.0, (limits::jsonb ->> 'weight')::double precision))",
        "(limits::jsonb - 'weight')::text",
        "jsonb_typeof(limits::jsonb -> 'weight') = 'number'",
        pg=True,
    ),
)

SCHEMA_VERSION = SQLITE_MIGRATIONS[-1].version
assert POSTGRES_MIGRATIONS[-1].version == SCHEMA_VERSION  # both move together


def pending(migrations: tuple[Migration, ...], current: int) -> tuple[Migration, ...]:
    """The migrations to apply to a database at version `current`, in order."""
    return tuple(m for m in migrations if m.version > current)


def newer_schema_message(found: int) -> str:
    return (
        f"database schema version {found} is newer than this saltgate supports "
        f"({SCHEMA_VERSION}); upgrade saltgate (or restore the backup taken before the "
        "store was migrated: docs/upgrading.md)"
    )


def older_schema_message(where: str, found: int) -> str:
    """Why a command refuses an existing store at an older version (nothing was changed)."""
    return (
        f"the store {where} is at schema version {found}; this saltgate uses "
        f"{SCHEMA_VERSION}. Nothing was changed: a store is migrated only on request. Back "
        "it up, then run `saltgate store migrate` with this command's --config or "
        "--state-dir (`saltgate store status` lists the steps; docs/upgrading.md)"
    )


# What a statement does, in words, for `saltgate store status`: (pattern, template); the
# first that matches names it. A statement none matches is not described (a trigger's body,
# a data statement): the migration's name says what it is for.
_STATEMENT_WORDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE | re.DOTALL), words)
    for pattern, words in (
        (r"CREATE TABLE (\w+)_v\d+ \(", "rebuild table {0} (rewrites every row)"),
        (r"CREATE TABLE (?:IF NOT EXISTS )?(\w+)", "add table {0}"),
        (r"ALTER TABLE (\w+) ADD COLUMN (\w+)", "add column {0}.{1}"),
        (r"ALTER TABLE (\w+) ALTER COLUMN (\w+) DROP NOT NULL", "allow NULL in {0}.{1}"),
        (r"CREATE (?:UNIQUE )?INDEX (\w+) ON (\w+)", "add index {0} on {1}"),
        (r"DROP INDEX (\w+)", "drop index {0}"),
        (r"CREATE TRIGGER (\w+) \w+ (?:\w+ )*ON (\w+)", "add trigger {0} on {1}"),
        (r"INSERT INTO (usage_rollup\w+)", "fill {0} from the usage ledger"),
        (
            r"(?:DO \$\$ BEGIN IF .*? THEN )?UPDATE (\w+) SET (\w+) = .* limits = ",
            "move each {1} stored in {0}.limits into {0}.{1}",
        ),
    )
)


def statement_words(sql: str) -> str | None:
    """One statement in words ("add table responses"), or None if it is not described."""
    for pattern, words in _STATEMENT_WORDS:
        if found := pattern.match(sql.strip()):
            return words.format(*found.groups())
    return None


def migration_steps(migrations: tuple[Migration, ...], current: int) -> tuple[str, ...]:
    """What migrating a store at version `current` does, one line per version in words:
    "11: responses kept on replicas: their owners (add table responses)"."""
    steps = []
    for m in pending(migrations, current):
        words = [w for w in map(statement_words, m.statements) if w is not None]
        detail = f" ({'; '.join(dict.fromkeys(words))})" if words else ""
        steps.append(f"{m.version}: {m.name}{detail}")
    return tuple(steps)
