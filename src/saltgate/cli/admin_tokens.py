"""`saltgate admin-tokens` and `audit-log`: the admin plane's tokens and its keyed audit chain."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from saltgate.admin.service import AdminService, Caller

from saltgate.cli.common import (
    _PAGE,
    _every,
    _state_dir_arg,
    _store_settings,
    _with_service,
    store_exit_status,
)


def _add_admin_plane(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`admin-tokens` and `audit-log` (docs/admin-api.md)."""
    tokens = sub.add_parser(
        "admin-tokens",
        help="create, list and revoke admin tokens (the admin API's; docs/admin-api.md)",
    )
    asub = tokens.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = asub.add_parser("create", help="mint an admin token (printed once, stored as a hash)")
    p.add_argument(
        "--scopes", required=True, help="comma-separated scopes, or all (docs/admin-api.md)"
    )
    p.add_argument("--tenant", help="pin the token to this tenant (name or id)")
    _state_dir_arg(p)
    p.set_defaults(func=_admin_tokens_create)
    p = asub.add_parser("list", help="list admin tokens (never the tokens), with last use")
    _state_dir_arg(p)
    p.set_defaults(func=_admin_tokens_list)
    p = asub.add_parser("revoke", help="revoke an admin token by its id (refused at once)")
    p.add_argument("token_id", help="the token's id, as `admin-tokens list` shows it (adm_...)")
    _state_dir_arg(p)
    p.set_defaults(func=_admin_tokens_revoke)

    log = sub.add_parser("audit-log", help="check the audit log's hash chain")
    lsub = log.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = lsub.add_parser(
        "verify",
        help="recompute the chain of hashes; exit status 1 naming the first broken entry",
    )
    p.add_argument(
        "--expect",
        metavar="SEQ:HASH",
        help="a head kept outside the store (printed by an earlier verify): entry SEQ must "
        "still have HASH, so entries cut from the end are detected",
    )
    _state_dir_arg(p)
    p.set_defaults(func=_audit_log_verify)


def _admin_tokens_create(args: argparse.Namespace) -> int:
    from saltgate.admin.scopes import parse_scopes

    async def create(service: AdminService, caller: Caller) -> str:
        scopes = parse_scopes(args.scopes)
        minted = await service.admin_tokens_create(caller, scopes, args.tenant)
        pinned = "" if args.tenant is None else f", pinned to {args.tenant}"
        print(f"created {minted.token.id} ({','.join(sorted(scopes))}{pinned})", file=sys.stderr)
        return minted.value

    return _with_service(args, create)


def _admin_tokens_list(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    def when(ts: float | None) -> str:
        return "never" if ts is None else datetime.fromtimestamp(ts, UTC).isoformat("T", "seconds")

    async def show(service: AdminService, caller: Caller) -> str:
        rows = []
        tokens = await _every(
            lambda after: service.admin_tokens_list(caller, after=after, limit=_PAGE),
            lambda t: t.id,
        )
        for t in tokens:
            state = "revoked" if t.revoked_at is not None else "active"
            rows.append(
                f"{t.id}\t{t.to_dict()['redacted_value']}\t{state}\tscopes "
                f"{','.join(sorted(t.scopes))}\ttenant {t.tenant_id or 'all'}"
                f"\tlast used {when(t.last_used_at)}"
            )
        return "\n".join(rows)

    return _with_service(args, show)


def _admin_tokens_revoke(args: argparse.Namespace) -> int:
    async def revoke(service: AdminService, caller: Caller) -> str:
        return f"revoked {(await service.admin_tokens_revoke(caller, args.token_id)).id}"

    return _with_service(args, revoke)


def _audit_log_verify(args: argparse.Namespace) -> int:
    from saltgate.config import ConfigError
    from saltgate.store.audit import expected_head, head_problem, verify_chain
    from saltgate.store.backends import open_database
    from saltgate.store.errors import StoreError

    try:
        expect = None if args.expect is None else expected_head(args.expect)
        settings, _ = _store_settings(args)
        db = open_database(settings, create=False)
        try:
            check = verify_chain(db)
            problem = None if expect is None else head_problem(db, check, expect)
        finally:
            db.close()
    except (ConfigError, StoreError, ValueError) as exc:
        print(f"saltgate audit-log verify: {exc}", file=sys.stderr)
        return store_exit_status(exc)
    if not check.ok:
        print(
            f"saltgate audit-log verify: entry {check.broken_seq} is broken: {check.reason} "
            f"({check.checked} entries before it are intact)",
            file=sys.stderr,
        )
        return 1
    if problem is not None:
        print(f"saltgate audit-log verify: {problem}", file=sys.stderr)
        return 1
    keyed = (
        f"keyed from entry {check.keyed_from}"
        if check.keyed_from is not None
        else "NOT keyed (written without the master key: rewriting it is not detected)"
    )
    head = "" if check.head is None else f"; head {check.head[0]}:{check.head[1].hex()}"
    print(f"audit log intact: {check.checked} entries, {keyed}{head}")
    return 0
