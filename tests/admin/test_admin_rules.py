"""The admin service's rules over real HTTP (issue 41's security review, findings 2, 5, 6,
7 and 8): what the operator sets is not a pinned token's to undo, a revoke stays within
the revoker's scopes, an archived tenant's tokens die with it, a rename is no oracle of
other tenants' names, and model names carry no terminal escapes."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from tests.admin.test_admin_api import admin_stack, completes
from tests.gateway.stack import MODEL, run

from saltgate.admin import scopes
from saltgate.admin.scopes import SCOPES
from saltgate.cli import main


def test_a_pinned_token_cannot_lift_the_operators_settings(tmp_path: Path) -> None:
    """Finding 2: a token pinned to alice, holding every scope, set alice's models to all
    and her weight to 1e308, undoing the operator's controls. Now 403 for models, rename,
    limits, budget and weight; the operator's settings stay; the key limits a pinned token
    may still narrow."""

    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            ids = admin.ids()
            alice = f"tenants/{ids['alice']}"
            root, pinned = admin.root, admin.mint(set(SCOPES), "alice")
            assert (await admin.call(root, "POST", alice, {"models": [MODEL]})).status_code == 200
            operator = {"rpm": 10, "budget_micro_usd": 1_000_000, "budget_period_s": 2592000}
            r = await admin.call(root, "PUT", f"{alice}/limits", operator)
            assert r.status_code == 200
            for method, path, body in (
                ("POST", alice, {"models": None}),
                ("POST", alice, {"name": "alice2"}),
                ("PUT", f"{alice}/limits", {"weight": 100}),
                ("PATCH", f"{alice}/limits", {"weight": 100}),
                ("POST", alice, {"weight": 100}),
                ("PUT", f"{alice}/limits", {}),
                ("PUT", f"{alice}/limits", {"rpm": 1000}),
            ):
                r = await admin.call(pinned, method, path, body)
                assert r.status_code == 403, (path, body, r.text)
                assert r.json()["error"]["code"] == "operator_only"
            shown = (await admin.call(root, "GET", alice)).json()
            assert shown["models"] == [MODEL] and shown["name"] == "alice"
            assert shown["limits"] == operator and shown["weight"] == 1
            r = await admin.call(pinned, "PUT", f"keys/{ids['alice_key']}/limits", {"rpm": 5})
            assert r.status_code == 200 and r.json()["limits"] == {"rpm": 5}
            # The operator's token still changes them.
            r = await admin.call(root, "PATCH", f"{alice}/limits", {"weight": 2})
            assert r.status_code == 200
            assert (r.json()["limits"], r.json()["weight"]) == (operator, 2)

    run(go)


def test_a_rename_tells_a_pinned_token_nothing_of_other_names(tmp_path: Path) -> None:
    """Finding 7: a pinned token renaming its tenant got 409 for a name taken elsewhere
    and 200 for a free one. Now both answers are the same refusal."""

    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            alice = f"tenants/{admin.ids()['alice']}"
            pinned = admin.mint({scopes.TENANTS_WRITE}, "alice")
            taken = await admin.call(pinned, "POST", alice, {"name": "bob"})
            free = await admin.call(pinned, "POST", alice, {"name": "nosuch-xyz"})
            assert taken.status_code == free.status_code == 403
            assert taken.json() == free.json()
            r = await admin.call(admin.root, "POST", alice, {"name": "bob"})
            assert r.status_code == 409  # the operator is told: names are theirs to know

    run(go)


def test_a_token_revokes_only_tokens_within_its_scopes(tmp_path: Path) -> None:
    """Finding 5: a token holding only admin_tokens:write revoked an `all` token."""

    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            narrow = admin.mint({scopes.ADMIN_TOKENS_WRITE})
            wide = admin.mint(set(SCOPES))
            wide_id = (await admin.call(wide, "GET", "me")).json()["id"]
            r = await admin.call(narrow, "DELETE", f"admin_tokens/{wide_id}")
            assert r.status_code == 403 and r.json()["error"]["code"] == "scope_escalation"
            assert (await admin.call(wide, "GET", "me")).status_code == 200
            peer = admin.mint({scopes.ADMIN_TOKENS_WRITE})
            peer_id = (await admin.call(peer, "GET", "me")).json()["id"]
            assert (
                await admin.call(narrow, "DELETE", f"admin_tokens/{peer_id}")
            ).status_code == 200
            assert (await admin.call(peer, "GET", "me")).status_code == 401
            assert (await admin.call(wide, "DELETE", f"admin_tokens/{wide_id}")).status_code == 200

    run(go)


def test_archiving_a_tenant_kills_its_pinned_tokens(tmp_path: Path) -> None:
    """Finding 6: an archived tenant's pinned `all` token still answered /me, read the
    audit log and minted tokens. Now it is refused like a revoked one; the operator's
    tokens and other tenants' are untouched."""

    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            ids = admin.ids()
            pinned = admin.mint(set(SCOPES), "alice")
            bobs = admin.mint(set(SCOPES), "bob")
            assert (await admin.call(pinned, "GET", "me")).status_code == 200
            r = await admin.call(admin.root, "POST", f"tenants/{ids['alice']}/archive")
            assert r.status_code == 200
            for method, path, body in (
                ("GET", "me", None),
                ("GET", "audit_logs", None),
                ("POST", "admin_tokens", {"scopes": "all"}),
            ):
                r = await admin.call(pinned, method, path, body)
                assert r.status_code == 401, (path, r.text)
            assert (await admin.call(bobs, "GET", "me")).status_code == 200
            assert (await admin.call(admin.root, "GET", "me")).status_code == 200
            # And none is minted for it any more.
            pin = {"scopes": ["tenants:read"], "tenant_id": ids["alice"]}
            r = await admin.call(admin.root, "POST", "admin_tokens", pin)
            assert r.status_code == 400, r.text

    run(go)


@pytest.mark.parametrize(
    "model", ["\x1b[2J\x1b[31mFAKE: all keys revoked\x1b[0m", "evil\u202etxt", "a\nb", " m", ""]
)
def test_model_names_with_control_characters_are_refused(tmp_path: Path, model: str) -> None:
    """Finding 8: a pinned token put terminal escapes into a model name the operator's
    `saltgate tenants list` printed raw."""

    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            alice = f"tenants/{admin.ids()['alice']}"
            r = await admin.call(admin.root, "POST", alice, {"models": [MODEL, model]})
            assert r.status_code == 400 and "invalid model list" in r.json()["error"]["message"]
            r = await admin.call(admin.root, "POST", alice, {"models": [MODEL, "org/m-1.5:q4@x+y"]})
            assert r.status_code == 200
            assert await completes(admin.stack, admin.stack.keys["alice"]) == 200

    run(go)


def test_the_cli_escapes_what_a_store_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model name stored before the check (written straight into the database) reaches
    the operator's terminal escaped, not as an escape sequence."""
    state = tmp_path / "state"
    assert main(["tenants", "create", "acme", "--state-dir", str(state)]) == 0
    evil = "\x1b[2Jfake\u202e"
    with sqlite3.connect(state / "saltgate.db") as db:
        db.execute("UPDATE tenants SET allowed_models = ?", (json.dumps([evil]),))
    capsys.readouterr()
    assert main(["tenants", "list", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    assert "\\x1b[2Jfake\\u202e" in out
    pass


def test_a_tenant_and_key_made_over_the_api_work_at_once(tmp_path: Path) -> None:
    """Issue 41: through `saltgate up`, a client that used a tenant and key just made over
    the admin API got 401 twice: the gateway's key snapshot was reloaded at most every
    0.5 s. An unknown key now makes the gateway look for a change first."""

    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            for n in range(5):
                r = await admin.call(admin.root, "POST", "tenants", {"name": f"new{n}"})
                assert r.status_code == 201, r.text
                r = await admin.call(admin.root, "POST", f"tenants/{r.json()['id']}/keys")
                assert r.status_code == 201, r.text
                assert await completes(admin.stack, r.json()["value"]) == 200, n

    run(go)
