"""Admin tokens and the audit log in the store, on both backends (real SQLite, real
PostgreSQL), and their CLI: `saltgate admin-tokens`, `saltgate audit-log verify`."""

from __future__ import annotations

import hashlib
import re
import sqlite3
from pathlib import Path

import pytest

from saltgate.cli import main
from saltgate.store.admin_tokens import AdminTokens, looks_like_token
from saltgate.store.audit import Actor, list_entries, verify_chain
from saltgate.store.backends import open_database
from saltgate.store.errors import StoreError, TokenRevokedError
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore, db_path

TOKEN_RE = re.compile(r"sgadm_[A-Za-z0-9_-]{43}[0-9a-f]{8}")


def test_tokens_are_shown_once_stored_hashed_and_revoked_at_once(
    store_settings: StoreSettings,
) -> None:
    db = open_database(store_settings)
    try:
        tenant = TenantStore(db).create_tenant("acme")
        tokens = AdminTokens(db, Actor("cli:tester"))
        token_id, token = tokens.create({"tenants:read", "keys:write"}, tenant.id)
        assert TOKEN_RE.fullmatch(token) and looks_like_token(token)
        stored = db.query("SELECT * FROM admin_tokens")
        assert token not in repr(stored)
        assert stored[0][1] == hashlib.sha256(token.encode()).digest()
        info = tokens.authenticate(token)
        assert info is not None and info.id == token_id and info.tenant_id == tenant.id
        assert info.scopes == {"tenants:read", "keys:write"} and info.last_used_at is not None
        assert token not in repr(info) and token not in str(info.to_dict())
        [listed] = tokens.list()
        assert listed.created_by == "cli:tester" and listed.last_used_at == info.last_used_at
        again = tokens.authenticate(token)  # within the minute: no write, the same mark
        assert again is not None and again.last_used_at == info.last_used_at
        assert tokens.list(tenant_id="tn_other") == []
        # A changed character, a good checksum over a wrong body, an inference key: refused.
        assert tokens.authenticate(token[:-1] + ("0" if token[-1] != "0" else "1")) is None
        assert tokens.authenticate("sg_" + token[6:49]) is None
        tokens.revoke(token_id)
        assert tokens.authenticate(token) is None
        with pytest.raises(TokenRevokedError):
            tokens.revoke(token_id)
        with pytest.raises(StoreError, match="no such tenant"):
            tokens.create({"tenants:read"}, "tn_missing")
        actions = [e.action for e in list_entries(db)]
        assert actions == ["tenant.created", "admin_token.created", "admin_token.revoked"]
        assert token not in repr(list_entries(db))
        assert verify_chain(db).ok
    finally:
        db.close()


def test_the_audit_log_is_append_only_and_chained(store_settings: StoreSettings) -> None:
    db = open_database(store_settings)
    try:
        store = TenantStore(db, actor=Actor("adm_0123456789ab", request_id="req-1"))
        store.create_tenant("acme")
        key_id, key = store.create_key("acme")
        store.rotate_salt("acme")
        store.revoke_key(key_id)
        entries = list_entries(db)
        assert [e.seq for e in entries] == [1, 2, 3, 4]
        assert entries[2].action == "tenant.salt_rotated"
        assert '"epoch":0' in (entries[2].before or "") and '"epoch":1' in (entries[2].after or "")
        assert {e.actor for e in entries} == {"adm_0123456789ab"}
        assert {e.request_id for e in entries} == {"req-1"}
        assert key not in repr(entries)
        assert verify_chain(db).checked == 4
        for statement in ("UPDATE audit_log SET actor = 'x'", "DELETE FROM audit_log"):
            with pytest.raises(StoreError, match="append-only"):
                db.execute(statement)
        assert verify_chain(db).checked == 4
    finally:
        db.close()


def _tamper(path: Path, statement: str) -> None:
    """What someone with the database file can do: drop the guard, then edit."""
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER audit_log_no_update")
    conn.execute("DROP TRIGGER audit_log_no_delete")
    conn.execute(statement)
    conn.commit()
    conn.close()


def _saltgate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("statement", "broken"),
    [
        ("UPDATE audit_log SET after_json = '{\"epoch\":7}' WHERE seq = 3", 3),
        ("DELETE FROM audit_log WHERE seq = 2", 2),
        ("UPDATE audit_log SET ts = ts - 1 WHERE seq = 4", 4),
    ],
)
def test_verify_names_the_first_edited_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], statement: str, broken: int
) -> None:
    s = ("--state-dir", str(tmp_path / "state"))
    assert _saltgate(capsys, "tenants", "create", "acme", *s)[0] == 0
    assert _saltgate(capsys, "keys", "create", "acme", *s)[0] == 0
    assert _saltgate(capsys, "tenants", "rotate-salt", "acme", *s)[0] == 0
    assert _saltgate(capsys, "tenants", "set-limits", "acme", "--rpm", "5", *s)[0] == 0
    code, out, _ = _saltgate(capsys, "audit-log", "verify", *s)
    assert code == 0 and out.startswith("audit log intact: 4 entries, ")
    _tamper(db_path(tmp_path / "state"), statement)
    code, _, err = _saltgate(capsys, "audit-log", "verify", *s)
    assert code == 1 and f"entry {broken} is broken" in err


def test_admin_tokens_cli(
    store_settings: StoreSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nstate_dir = "{tmp_path / "state"}"\n{store_settings.toml()}'
        '[[replicas]]\nurl = "http://127.0.0.1:1"\n'
    )
    c = ("--config", str(config))
    assert _saltgate(capsys, "tenants", "create", "acme", *c)[0] == 0
    code, token, err = _saltgate(capsys, "admin-tokens", "create", "--scopes", "all", *c)
    assert code == 0 and TOKEN_RE.fullmatch(token) and err.startswith("created adm_")
    code, pinned, err = _saltgate(
        capsys, "admin-tokens", "create", "--scopes", "tenants:read", "--tenant", "acme", *c
    )
    assert code == 0 and TOKEN_RE.fullmatch(pinned) and "pinned to acme" in err
    code, listed, _ = _saltgate(capsys, "admin-tokens", "list", *c)
    assert code == 0 and token not in listed and pinned not in listed
    rows = listed.splitlines()
    assert len(rows) == 2 and all("\tsgadm_...\tactive\t" in r for r in rows)
    assert all(r.endswith("\tlast used never") for r in rows)
    token_id = err.split()[1]
    assert _saltgate(capsys, "admin-tokens", "revoke", token_id, *c)[:2] == (
        0,
        f"revoked {token_id}",
    )
    assert f"{token_id}\tsgadm_...\trevoked" in _saltgate(capsys, "admin-tokens", "list", *c)[1]
    code, _, err = _saltgate(capsys, "admin-tokens", "create", "--scopes", "root", *c)
    assert code == 1 and "unknown scopes root" in err
    code, _, err = _saltgate(
        capsys, "admin-tokens", "create", "--scopes", "all", "--tenant", token, *c
    )
    assert code == 1 and token not in err and "looks like an admin token" in err
    code, out, _ = _saltgate(capsys, "audit-log", "verify", *c)
    assert code == 0 and out.startswith("audit log intact: 4 entries, ")
    db = open_database(store_settings)
    try:
        entries = list_entries(db)
        assert all(e.actor.startswith("cli:") for e in entries)
        TenantStore(db).archive_tenant("acme")
    finally:
        db.close()
    assert _saltgate(capsys, "tenants", "list", *c)[1].endswith("\tlimits none\tweight 1\tarchived")
    code, _, err = _saltgate(capsys, "keys", "create", "acme", *c)
    assert code == 1 and "tenant acme is archived" in err
