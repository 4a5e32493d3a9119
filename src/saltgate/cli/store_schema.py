"""`saltgate store status` and `store migrate`: a store's schema version, and migrating it
on request only (every other command refuses a store at an older version; docs/upgrading.md)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from saltgate.store.backends import SchemaStatus

from saltgate.cli.common import _state_dir_arg, _store_settings, store_exit_status

# `store status`: 0 when the store is at this saltgate's version; these otherwise (1: the
# store could not be read, 2: a usage or configuration error, as everywhere).
EXIT_MIGRATION_PENDING = 3  # older, or no schema yet: `saltgate store migrate` would act
EXIT_STORE_NEWER = 4  # a newer saltgate migrated it: this one refuses it


def _add_schema_actions(ssub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = ssub.add_parser(
        "status",
        help="the store's schema version, this saltgate's, and what a migration would do",
        description="Reads the store's schema version (changing nothing) and lists the steps "
        f"`saltgate store migrate` would apply. Exit status: 0 current, "
        f"{EXIT_MIGRATION_PENDING} a migration is pending (or the store has no schema yet), "
        f"{EXIT_STORE_NEWER} the store is newer than this saltgate, 1 the store could not be "
        "read, 2 a usage or configuration error. docs/upgrading.md.",
    )
    _state_dir_arg(p)
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.set_defaults(func=_store_status)
    p = ssub.add_parser(
        "migrate",
        help="apply the pending schema migrations (back up first; the only command that migrates)",
        description="Brings the store to this saltgate's schema version, in one transaction; "
        "a store already current is left as it is. Back up first: a saltgate of the old "
        "version refuses the migrated store. On SQLite the store is first copied (an online "
        "backup) to saltgate.db.pre-vN beside it, unless --no-backup; on PostgreSQL take a "
        "pg_dump. Stop the gateways on SQLite. docs/upgrading.md.",
    )
    _state_dir_arg(p)
    p.add_argument(
        "--no-backup",
        action="store_true",
        help="SQLite: do not copy the store to saltgate.db.pre-vN first (you made your own)",
    )
    p.set_defaults(func=_store_migrate)


def _status_text(status: SchemaStatus) -> str:
    lines = [
        f"store: {status.backend} {status.store}",
        f"schema version: {status.version or 'none (no saltgate schema yet)'}",
        f"this saltgate: {status.expected}",
    ]
    if status.state == "current":
        lines.append("status: current, nothing to migrate")
    elif status.state == "newer":
        lines.append(
            "status: the store is newer than this saltgate, which refuses it: run the "
            "saltgate that migrated it, or restore the backup taken before (docs/upgrading.md)"
        )
    elif status.state == "new":
        lines.append(
            "status: no schema yet: `saltgate store migrate`, or the first gateway or command "
            "to open it, creates it:"
        )
    else:
        lines.append(
            "status: migration pending: back up the store, then `saltgate store migrate` "
            "applies, in one transaction:"
        )
    if status.state in ("new", "pending"):
        lines += [f"  {step}" for step in status.steps]
    return "\n".join(lines)


def _store_status(args: argparse.Namespace) -> int:
    import json

    from saltgate.config import ConfigError
    from saltgate.store.backends import schema_status
    from saltgate.store.errors import StoreError

    try:
        settings, _ = _store_settings(args)
        status = schema_status(settings)
    except (ConfigError, StoreError, ValueError) as exc:
        print(f"saltgate store status: {exc}", file=sys.stderr)
        return store_exit_status(exc)
    if args.json:
        print(
            json.dumps(
                {
                    "backend": status.backend,
                    "store": status.store,
                    "schema_version": status.version,
                    "expected_version": status.expected,
                    "state": status.state,
                    "steps": list(status.steps),
                },
                indent=2,
            )
        )
    else:
        print(_status_text(status))
    return {"current": 0, "newer": EXIT_STORE_NEWER}.get(status.state, EXIT_MIGRATION_PENDING)


def _store_migrate(args: argparse.Namespace) -> int:
    from saltgate.config import ConfigError
    from saltgate.store.backends import backup_sqlite, migrate_store, schema_status
    from saltgate.store.errors import StoreError

    try:
        settings, _ = _store_settings(args)
        status = schema_status(settings)
        if status.state == "current":
            return _nothing_to_do(status)
        if status.state == "pending" and settings.backend == "sqlite" and not args.no_backup:
            copy = backup_sqlite(settings)
            print(f"backed up {status.store} (schema version {status.version}) to {copy}")
        elif status.state == "pending" and settings.backend == "postgresql":
            print(
                "no backup is made of a PostgreSQL store: take one before (pg_dump, "
                "docs/upgrading.md)"
            )
        status = migrate_store(settings)  # as it was just before: another may have acted
    except (ConfigError, StoreError, ValueError) as exc:
        print(f"saltgate store migrate: {exc}", file=sys.stderr)
        return store_exit_status(exc)
    if status.state == "current":
        return _nothing_to_do(status)
    for step in status.steps:
        print(f"  {step}")
    if status.state == "new":
        print(f"created the schema of {status.store} at version {status.expected}")
    else:
        print(
            f"migrated {status.store} from schema version {status.version} to "
            f"{status.expected}; a saltgate older than this one now refuses it"
        )
    return 0


def _nothing_to_do(status: SchemaStatus) -> int:
    print(f"{status.store}: schema version {status.version}, current; nothing to do")
    return 0
