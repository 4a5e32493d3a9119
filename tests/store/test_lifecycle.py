"""`saltgate store copy` (SQLite -> PostgreSQL and back, keys keep working, a second pass)
and `saltgate usage prune` (both backends), through the command as an operator runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from saltgate.cli import main
from saltgate.governance.limits import Limits
from saltgate.prices import Price, PriceVersion
from saltgate.store.admin_tokens import AdminTokens
from saltgate.store.audit import verify_chain
from saltgate.store.backends import open_database
from saltgate.store.db import Database
from saltgate.store.ledger import (
    KEY_USE_UPSERT,
    PRICE_INSERT,
    USAGE_INSERT,
    UsageRecord,
    new_request_id,
    price_rows,
)
from saltgate.store.lifecycle import (
    COPIED_TABLES,
    LEGACY_REQUEST_ID,
    OWN_TABLES,
    PRUNE_BATCH_ROWS,
)
from saltgate.store.model_prices import MODEL_PRICES_SQL, PriceStore
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import LIVE_KEYS_SQL, KeySnapshot, TenantStore, last_used

USAGE_SQL = f"SELECT {', '.join(UsageRecord._fields)} FROM usage"
PRICES_SQL = "SELECT * FROM prices"
SMALL_SQL = tuple(
    f"SELECT * FROM {table}" for table in ("tenants", "api_keys", "admin_tokens", "key_last_used")
)
_DAY = 86400.0
JAN_2021 = 1609459200.0  # 2021-01-01T00:00:00Z


def _saltgate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def _pg_args(end: str, settings: StoreSettings) -> tuple[str, ...]:
    assert settings.password_file is not None
    return (f"--{end}", settings.url, f"--{end}-password-file", str(settings.password_file))


def _rows(db: Database, sql: str) -> set[tuple[object, ...]]:
    return {tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in db.query(sql)}


def _records(n: int, ts: float, tenant_id: str, key_id: str) -> list[UsageRecord]:
    """Rows as gateways record them: some without cached tokens (NULL), some without cost."""
    recs = []
    for i in range(n):
        priced = i % 3 != 0
        recs.append(
            UsageRecord(
                new_request_id(),
                ts + i,
                tenant_id,
                key_id,
                "m",
                100 + i,
                None if i % 2 else i,
                7,
                200 if i % 5 else 499,
                1234 + i if priced else None,
                "pv_0123456789abcdef" if priced else None,
            )
        )
    return recs


def _admin(db: Database, token: str) -> str | None:
    """The id of the admin token `token` signs in as against `db`; None: refused."""
    info = AdminTokens(db).authenticate(token)
    return None if info is None else info.id


def _authenticates(db: Database, key: str) -> tuple[str, int, str] | None:
    """(tenant id, epoch, priority band) the gateway's key snapshot of `db` gives `key`."""
    principal = KeySnapshot(db.query(LIVE_KEYS_SQL)).lookup(key)
    if principal is None:
        return None
    return (principal.tenant_id, principal.epoch, principal.priority)


def test_copy_moves_a_sqlite_store_to_postgresql_and_keys_keep_working(
    pg_store: StoreSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = StoreSettings.in_state_dir(tmp_path / "state")
    src = open_database(source)
    tenants = TenantStore(src)
    acme, beta = tenants.create_tenant("acme"), tenants.create_tenant("beta")
    acme_key_id, acme_key = tenants.create_key("acme")
    revoked_id, revoked_key = tenants.create_key("acme")
    tenants.revoke_key(revoked_id)
    late_id, late_key = tenants.create_key("beta")  # revoked between the two passes
    tenants.rotate_salt("beta")
    tenants.set_models("acme", ["m"])
    tenants.set_limits("acme", Limits(rpm=60, budget_micro_usd=5, budget_period_s=86400), 2.5)
    tenants.set_key_limits(acme_key_id, Limits(concurrency=2))
    _, batch_key = tenants.create_key("acme", "batch")
    tokens = AdminTokens(src)
    token_id, token = tokens.create(["usage:read"])
    assert tokens.authenticate(token) is not None  # its last use, to be copied too
    gone_id, gone_token = tokens.create(["tenants:read"])
    tokens.revoke(gone_id)
    late_token_id, late_token = tokens.create(["audit_log:read"])  # revoked between passes
    src.execute(KEY_USE_UPSERT, (acme_key_id, 1500.0))
    price = PriceVersion.of("m", Price(1.0, 0.5, 2.0))
    src.execute_many(PRICE_INSERT, price_rows([price], 1.0))
    PriceStore(src).set("m", Price(2.0, 0.2, 4.0))  # over the config's, with its version
    src.execute_many(USAGE_INSERT, _records(12, 1000.0, acme.id, acme_key_id))
    src.execute(  # a response a replica keeps for acme ([responses] store)
        "INSERT INTO responses (id, tenant_id, replica, created_at) VALUES (?, ?, ?, ?)",
        ("resp_acme1", acme.id, "https://10.0.1.1:8443", 1000.0),
    )
    # A row from before schema version 3: no request id, which PostgreSQL requires.
    src.execute(
        "INSERT INTO usage (ts, tenant_id, key_id, model, prompt_tokens, cached_tokens, "
        "completion_tokens, status) VALUES (5.0, ?, ?, 'm', 10, 0, 1, 200)",
        (acme.id, acme_key_id),
    )
    [(legacy_id,)] = src.query("SELECT id FROM usage WHERE request_id IS NULL")
    to = _pg_args("to", pg_store)
    code, out, err = _saltgate(capsys, "store", "copy", "--from", source.url, *to)
    assert (code, err) == (0, ""), err
    assert pg_store.password_file is not None
    assert pg_store.password_file.read_text().strip() not in out
    table = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:11]}
    audited = str(len(src.query("SELECT seq FROM audit_log")))
    assert table == {
        "tenants": ["2", "2"],
        "api_keys": ["4", "4"],
        "prices": ["2", "2"],
        "model_prices": ["1", "1"],
        "admin_tokens": ["3", "3"],
        "audit_log": [audited, audited],
        "key_last_used": ["1", "1"],
        "responses": ["1", "1"],
        "usage": ["13", "13"],
    }
    assert "verified" in out

    dst = open_database(pg_store)
    for sql in (*SMALL_SQL, "SELECT * FROM audit_log"):
        assert _rows(dst, sql) == _rows(src, sql)
    assert verify_chain(dst).checked == int(audited) > 0  # the chain moved intact
    copied = TenantStore(dst).get_tenant("acme")
    assert copied.limits == Limits(rpm=60, budget_micro_usd=5, budget_period_s=86400)
    assert copied.weight == 2.5  # the tenant's own setting moves with it (issue 42)
    assert _rows(dst, PRICES_SQL) == _rows(src, PRICES_SQL)
    assert _rows(dst, MODEL_PRICES_SQL) == _rows(src, MODEL_PRICES_SQL) != set()
    legacy = LEGACY_REQUEST_ID.format(legacy_id)
    expected = {(legacy, *r[1:]) if r[0] is None else r for r in _rows(src, USAGE_SQL)}
    assert _rows(dst, USAGE_SQL) == expected
    assert any(r[6] is None for r in expected) and any(r[9] is None for r in expected)
    # Keys created before the copy authenticate against the new store, as the same tenant
    # in the same cache namespace; a revoked key stays revoked.
    assert _authenticates(dst, acme_key) == (acme.id, 0, "interactive")
    assert _authenticates(dst, batch_key) == (acme.id, 0, "batch")
    assert _authenticates(dst, late_key) == (beta.id, 1, "interactive")
    assert _authenticates(dst, revoked_key) is None
    # So do admin tokens, hashed: the live one signs in there, the revoked one does not.
    assert _admin(dst, token) == token_id
    assert _admin(dst, late_token) == late_token_id
    assert _admin(dst, gone_token) is None

    # Again into the now filled store: refused, and nothing changes.
    code, out, err = _saltgate(capsys, "store", "copy", "--from", source.url, *to)
    assert code == 1 and "is not empty (2 tenants, 4 api_keys, 13 usage)" in err
    assert "--since" in err and len(dst.query(USAGE_SQL)) == 13

    # The source goes on: new usage, a revocation, a rotation. A second pass adds only the
    # new rows (the since window overlaps rows already copied: they are skipped).
    new = _records(5, 2000.0, beta.id, late_id)
    src.execute_many(USAGE_INSERT, new)
    tenants.revoke_key(late_id)
    tokens.revoke(late_token_id)
    src.execute(KEY_USE_UPSERT, (acme_key_id, 2500.0))
    tenants.rotate_salt("acme")
    tenants.set_limits("acme", None, 4.0)
    PriceStore(src).set("m", Price(3.0, 0.3, 6.0))
    since = ("--since", "1970-01-01T00:16:40")  # ts 1000: the first pass's rows too
    code, out, err = _saltgate(capsys, "store", "copy", "--from", source.url, *to, *since)
    assert (code, err) == (0, ""), err
    assert out.splitlines()[10].split() == ["usage", "17", "17"]
    assert _rows(dst, MODEL_PRICES_SQL) == _rows(src, MODEL_PRICES_SQL)  # the new price
    assert verify_chain(dst).checked == len(src.query("SELECT seq FROM audit_log"))
    assert len(dst.query(USAGE_SQL)) == 18
    assert set(new) <= _rows(dst, USAGE_SQL)
    assert _authenticates(dst, late_key) is None
    assert _authenticates(dst, acme_key) == (acme.id, 1, "interactive")
    assert _admin(dst, late_token) is None
    assert last_used(dst, [acme_key_id]) == {acme_key_id: 2500.0}
    copied = TenantStore(dst).get_tenant("acme")
    assert (copied.limits, copied.weight) == (None, 4.0)

    # And back: PostgreSQL to a new SQLite file, the same rows.
    back = StoreSettings.sqlite(tmp_path / "back.db")
    code, out, err = _saltgate(
        capsys, "store", "copy", *_pg_args("from", pg_store), "--to", back.url
    )
    assert (code, err) == (0, ""), err
    round_trip = open_database(back)
    assert _rows(round_trip, USAGE_SQL) == _rows(dst, USAGE_SQL)
    assert _rows(round_trip, MODEL_PRICES_SQL) == _rows(dst, MODEL_PRICES_SQL)
    for sql in SMALL_SQL:
        assert _rows(round_trip, sql) == _rows(dst, sql)
    assert _admin(round_trip, token) == token_id
    assert _authenticates(round_trip, acme_key) == (acme.id, 1, "interactive")
    assert _authenticates(round_trip, batch_key) == (acme.id, 1, "batch")
    for db in (src, dst, round_trip):
        db.close()


def test_copy_refuses_bad_urls_without_showing_a_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "a.db"
    open_database(StoreSettings.sqlite(db)).close()
    url = f"sqlite:///{db}"
    cases = {
        ("--from", url, "--to", "postgresql://u:hunter2@127.0.0.1/x"): "do not put the password",
        ("--from", url, "--to", url): "the same store",
        # the store's path after the option that named it, and no option copy lacks
        ("--from", f"sqlite:///{tmp_path / 'none.db'}", "--to", url): "--from: no saltgate",
        ("--from", url, "--to", "mysql://h/x"): "--to: url: unsupported scheme",
    }
    for args, message in cases.items():
        code, out, err = _saltgate(capsys, "store", "copy", *args)
        assert code == 1 and message in err and "hunter2" not in out + err, err
        assert "--state-dir" not in err and "--config" not in err, err


def test_every_table_of_the_schema_is_copied_or_the_stores_own(
    store_settings: StoreSettings,
) -> None:
    db = open_database(store_settings)
    sql = {
        "sqlite": "SELECT name FROM sqlite_master WHERE type = 'table'",
        "postgresql": "SELECT table_name FROM information_schema.tables "
        "WHERE table_schema = current_schema()",
    }[db.backend]
    assert {name for (name,) in db.query(sql)} == {*COPIED_TABLES, *OWN_TABLES}
    db.close()


def test_prune_deletes_rows_before_the_date_only_with_yes(
    store_settings: StoreSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nstate_dir = "{tmp_path / "state"}"\n{store_settings.toml()}'
        '[[replicas]]\nurl = "http://127.0.0.1:1"\n'
    )
    c = ("--config", str(config))
    db = open_database(store_settings)
    old = 2 * PRUNE_BATCH_ROWS + 7  # more than one SQLite batch
    db.execute_many(USAGE_INSERT, _records(old, JAN_2021 - old, "tn_a", "key_a"))
    kept = _records(4, JAN_2021, "tn_a", "key_a")  # the first exactly at --before: kept
    db.execute_many(USAGE_INSERT, kept)
    prune = ("usage", "prune", "--before", "2021-01-01")

    code, out, err = _saltgate(capsys, *prune, *c)
    assert (code, err) == (0, "")
    assert out.startswith(f"{old} usage records before 2021-01-01T00:00:00+00:00 would be")
    assert "saltgate usage --until 2021-01-01 --csv" in out and "--yes" in out
    assert len(db.query(USAGE_SQL)) == old + 4

    # The last month is kept unless --force; a future date never.
    for before, message in (("7d", "within the last 31 days"), ("2999-01-01", "future")):
        code, _, err = _saltgate(capsys, "usage", "prune", "--before", before, "--yes", *c)
        assert code == 1 and message in err
    assert len(db.query(USAGE_SQL)) == old + 4

    # --config before the sub-command counts as much as after it.
    code, out, err = _saltgate(capsys, "usage", *c, *prune[1:], "--yes")
    assert (code, err) == (0, "")
    assert out.startswith(f"deleted {old} usage records before 2021-01-01T00:00:00+00:00")
    if db.backend == "sqlite":
        assert f"({old // PRUNE_BATCH_ROWS + 1} transactions" in out
    assert _rows(db, USAGE_SQL) == set(kept)
    code, out, _ = _saltgate(capsys, *prune, "--yes", *c)
    assert code == 0 and out.startswith("deleted 0 usage records")
    db.close()


def test_prune_refuses_a_missing_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    code, _, err = _saltgate(
        capsys, "usage", "prune", "--before", "2021-01-01", "--state-dir", str(state)
    )
    assert code == 1 and "no saltgate database" in err
    assert not state.exists()
