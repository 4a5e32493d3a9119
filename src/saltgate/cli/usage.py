"""`saltgate usage` and `store`: recorded usage and cost, pruning, and copying a store."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from saltgate.store.settings import StoreSettings

from saltgate.cli.common import _state_dir_arg, _store_settings, store_exit_status
from saltgate.cli.store_schema import _add_schema_actions


def _add_usage(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "usage",
        help="usage and recorded cost per tenant (or --group-by); docs/billing.md",
    )
    _state_dir_arg(p)
    p.add_argument(
        "--since", help="from (inclusive): a duration back (24h, 7d) or an ISO date/time, UTC"
    )
    p.add_argument(
        "--until", help="to (exclusive): a duration back or an ISO date/time, UTC (default: no end)"
    )
    p.add_argument(
        "--group-by",
        default="tenant",
        help="any of tenant,key,model,day, comma-separated",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json", action="store_const", const="json", dest="fmt", help="JSON instead of a table"
    )
    fmt.add_argument(
        "--csv", action="store_const", const="csv", dest="fmt", help="CSV instead of a table"
    )
    p.set_defaults(func=_usage, fmt="table")
    usub = p.add_subparsers(
        dest="action", metavar="prune", help="optional: delete old records (prune --help)"
    )
    p = usub.add_parser(
        "prune",
        help="delete usage records older than a date (export them first; docs/upgrading.md)",
        description="Deletes the usage records with ts < --before. Without --yes it only says "
        "how many would go. Export them first: saltgate usage --until DATE --csv.",
    )
    p.add_argument(
        "--before",
        required=True,
        metavar="DATE",
        help="delete records before this (exclusive): an ISO date/time, UTC, or a duration "
        "back (400d)",
    )
    p.add_argument("--yes", action="store_true", help="delete (default: only count)")
    p.add_argument(
        "--force",
        action="store_true",
        help=f"allow a --before within the last {PRUNE_PROTECTED_DAYS} days",
    )
    _state_dir_arg(p, nested=True)
    p.set_defaults(func=_usage_prune)


def _add_store(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    store = sub.add_parser(
        "store", help="a store's schema version and its migration; copy a store to another"
    )
    ssub = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    _add_schema_actions(ssub)
    p = ssub.add_parser(
        "copy",
        help="copy tenants, hashed keys, prices and usage into a new store",
        description="Copies tenants, hashed API keys (every key keeps working), prices and "
        "the usage ledger from one store to another, in one transaction on the destination, "
        "then counts both. A PostgreSQL password comes from the --*-password-* options, or "
        "as libpq finds it (PGPASSWORD, ~/.pgpass), never from the URL. docs/upgrading.md.",
    )
    for end, what in (("from", "the store to copy"), ("to", "the new store")):
        p.add_argument(
            f"--{end}",
            required=True,
            metavar="URL",
            help=f"{what}: sqlite:///path/saltgate.db or postgresql://user@host:5432/db",
        )
        pw = p.add_mutually_exclusive_group()
        pw.add_argument(f"--{end}-password-file", metavar="FILE", help="its password, in a file")
        pw.add_argument(
            f"--{end}-password-env", metavar="VAR", help="its password, in this variable"
        )
    p.add_argument(
        "--since",
        metavar="T",
        help="a second pass: only usage from then on (a duration back or an ISO date/time, "
        "UTC), into the store an earlier copy filled; rows already there are skipped",
    )
    p.set_defaults(func=_store_copy)


def _usage(args: argparse.Namespace) -> int:
    import time

    from saltgate.config import ConfigError
    from saltgate.store.backends import open_database
    from saltgate.store.errors import StoreError
    from saltgate.store.pricing import format_usage, parse_group_by, parse_time, usage_report

    try:
        settings, config = _store_settings(args)
        now = time.time()
        since = parse_time(args.since, now, "--since") if args.since else None
        until = parse_time(args.until, now, "--until") if args.until else None
        if since is not None and until is not None and since >= until:
            raise ValueError("--since must be before --until (the range is [since, until))")
        group_by = parse_group_by(args.group_by)
        db = open_database(settings, create=False)
        try:
            prices = config.prices if config is not None else {}
            rows = usage_report(db, since, prices, until=until, group_by=group_by)
        finally:
            db.close()
    except (ConfigError, StoreError, ValueError) as exc:
        print(f"saltgate usage: {exc}", file=sys.stderr)
        return store_exit_status(exc)
    print(format_usage(rows, args.fmt, group_by))
    return 0


PRUNE_PROTECTED_DAYS = 31  # `usage prune` keeps the last month unless --force


def _usage_prune(args: argparse.Namespace) -> int:
    import time
    from datetime import UTC, datetime

    from saltgate.config import ConfigError
    from saltgate.store.backends import open_database
    from saltgate.store.errors import StoreError
    from saltgate.store.lifecycle import count_usage_before, prune_usage
    from saltgate.store.pricing import parse_time

    try:
        settings, _ = _store_settings(args)
        now = time.time()
        before = parse_time(args.before, now, "--before")
        if before > now:
            raise ValueError(f"--before {args.before!r} is in the future")
        if before > now - PRUNE_PROTECTED_DAYS * 86400 and not args.force:
            raise ValueError(
                f"--before {args.before!r} is within the last {PRUNE_PROTECTED_DAYS} days, "
                "which may not be billed yet; give --force to prune it anyway"
            )
        when = datetime.fromtimestamp(before, UTC).isoformat()
        db = open_database(settings, create=False)
        try:
            if not args.yes:
                n = count_usage_before(db, before)
                print(
                    f"{n} usage records before {when} would be deleted from "
                    f"{db.describe()}. Export them first (saltgate usage --until "
                    f"{args.before} --csv), then run again with --yes."
                )
                return 0
            result = prune_usage(db, before)
        finally:
            db.close()
    except (ConfigError, StoreError, ValueError) as exc:
        print(f"saltgate usage prune: {exc}", file=sys.stderr)
        return store_exit_status(exc)
    longest_ms = result.longest_transaction_s * 1e3
    print(
        f"deleted {result.deleted} usage records before {when} in {result.seconds:.1f} s "
        f"({len(result.held_s)} transactions, the longest {longest_ms:.1f} ms)"
    )
    return 0


def _store_copy(args: argparse.Namespace) -> int:
    import time
    from datetime import UTC, datetime
    from pathlib import Path

    from saltgate.store.backends import open_database
    from saltgate.store.errors import StoreError
    from saltgate.store.lifecycle import copy_store
    from saltgate.store.pricing import parse_time
    from saltgate.store.settings import StoreSettings

    def settings(end: str) -> StoreSettings:
        table = {"url": getattr(args, end)}
        for key in ("password_file", "password_env"):
            if (value := getattr(args, f"{end}_{key}")) is not None:
                table[key] = value
        try:
            return StoreSettings.from_table(table, Path.cwd(), Path.cwd())
        except ValueError as exc:
            raise ValueError(f"--{end}: {exc}") from None

    def iso(ts: float) -> str:
        return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")

    try:
        source, destination = settings("from"), settings("to")
        if _same_store(source, destination):
            raise ValueError("--from and --to name the same store")
        since = parse_time(args.since, time.time(), "--since") if args.since else None
        src = open_database(source, create=False)
        try:
            dst = open_database(destination)
            try:
                result = copy_store(src, dst, since=since)
            finally:
                dst.close()
        finally:
            src.close()
    except (StoreError, ValueError) as exc:
        print(f"saltgate store copy: {exc}", file=sys.stderr)
        return store_exit_status(exc)
    print(f"copied {source.describe()} -> {destination.describe()}")
    scope = "" if since is None else f" (usage: ts >= {iso(since)})"
    print(f"{'table':<10} {'source':>12} {'destination':>12}{scope}")
    for c in result.counts:
        print(f"{c.table:<10} {c.source:>12} {c.destination:>12}")
    print("verified: the destination holds every row copied")
    if result.source_gained:
        print(
            f"the source gained {result.source_gained} usage records during the copy: stop "
            "its gateways or point them at the new store, then copy them too"
        )
    # An hour of overlap: rows committed late (a group commit, a spool replay) keep an
    # earlier ts, and rows already copied are skipped anyway.
    since_next = iso(result.started_at - 3600)
    print(f"a second pass copies what the source gains from now: --since {since_next}")
    return 0


def _same_store(a: StoreSettings, b: StoreSettings) -> bool:
    if a.sqlite_path is not None and b.sqlite_path is not None:
        return a.sqlite_path.resolve() == b.sqlite_path.resolve()
    return a.url == b.url
