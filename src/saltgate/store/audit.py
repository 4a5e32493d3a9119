"""The audit log: every change to tenants, keys, limits, models, salts and admin tokens,
from the admin API and the CLI alike, append-only and chained by hash (docs/admin-api.md).

Each entry's hash is SHA-256 over its predecessor's hash and the canonical JSON of its
fields (sorted keys, no spaces, ASCII), so editing, inserting or deleting any entry
breaks every hash after it: `verify_chain` names the first entry that no longer fits.
The first entry chains to 32 zero bytes. Writers append inside the transaction of the
change they describe, so a change and its entry commit together or not at all.

Entries hold ids and settings, never a secret: no key, token, hash or salt (a salt
rotation records the epoch, which is not secret).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from saltgate.store.db import Database

GENESIS_HASH = bytes(32)
# pg_advisory_xact_lock key: appends on PostgreSQL take turns (SQLite's BEGIN IMMEDIATE
# already serialises writers), so two never chain to the same predecessor.
AUDIT_LOCK_ID = 0x5A17_A0D1
CLI_ACTOR_PREFIX = "cli:"

_COLUMNS = (
    "seq, ts, actor, action, resource_type, resource_id, tenant_id, before_json, "
    "after_json, request_id, prev_hash, entry_hash"
)
SELECT_ENTRIES = f"SELECT {_COLUMNS} FROM audit_log"  # noqa: S608 (constants only)
INSERT_ENTRY = f"INSERT INTO audit_log ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"  # noqa: S608


@dataclass(frozen=True, slots=True)
class Actor:
    """Who makes a change: an admin token's id, or ``cli:`` and the OS user."""

    name: str
    request_id: str | None = None

    @classmethod
    def cli(cls) -> Actor:
        """A local process run by an operator (the CLI, `saltgate up`)."""
        try:
            user = getpass.getuser()
        except (OSError, KeyError):  # no login name and no passwd entry (a bare container)
            user = "unknown"
        return cls(CLI_ACTOR_PREFIX + user)


@dataclass(frozen=True, slots=True)
class AuditEntry:
    seq: int
    ts: float
    actor: str
    action: str
    resource_type: str
    resource_id: str
    tenant_id: str | None
    before: str | None  # canonical JSON, as hashed
    after: str | None
    request_id: str | None
    prev_hash: bytes
    entry_hash: bytes

    def to_dict(self) -> dict[str, Any]:
        """The entry as the admin API shows it (hashes in hex)."""
        return {
            "object": "audit_log",
            "id": self.seq,
            "effective_at": self.ts,
            "actor": self.actor,
            "type": self.action,
            "resource_type": self.resource_type,
            "resource_id": self.resource_id,
            "tenant_id": self.tenant_id,
            "before": None if self.before is None else json.loads(self.before),
            "after": None if self.after is None else json.loads(self.after),
            "request_id": self.request_id,
            "hash": self.entry_hash.hex(),
        }


def canonical(value: object) -> str:
    """The one JSON text of a value: what is stored and hashed."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def entry_hash(prev_hash: bytes, fields: tuple[object, ...]) -> bytes:
    """SHA-256 of the previous hash and the canonical JSON of an entry's fields (seq
    through request_id, in column order)."""
    return hashlib.sha256(prev_hash + canonical(list(fields)).encode("ascii")).digest()


def _entry(row: tuple[Any, ...]) -> AuditEntry:
    seq, ts, actor, action, rtype, rid, tid, before, after, req, prev, own = row
    return AuditEntry(
        int(seq), float(ts), actor, action, rtype, rid, tid, before, after, req,
        bytes(prev), bytes(own),
    )  # fmt: skip


def append(
    db: Database,
    actor: Actor,
    action: str,
    resource_type: str,
    resource_id: str,
    *,
    tenant_id: str | None,
    before: Mapping[str, object] | None,
    after: Mapping[str, object] | None,
) -> AuditEntry:
    """Add one entry after the last; call inside the transaction of the change."""
    if db.backend == "postgresql":
        db.execute("SELECT pg_advisory_xact_lock(?)", (AUDIT_LOCK_ID,))
    last = db.query("SELECT seq, entry_hash FROM audit_log ORDER BY seq DESC LIMIT 1")
    seq, prev = (int(last[0][0]) + 1, bytes(last[0][1])) if last else (1, GENESIS_HASH)
    fields: tuple[object, ...] = (
        seq,
        time.time(),
        actor.name,
        action,
        resource_type,
        resource_id,
        tenant_id,
        None if before is None else canonical(before),
        None if after is None else canonical(after),
        actor.request_id,
    )
    own = entry_hash(prev, fields)
    db.execute(INSERT_ENTRY, (*fields, prev, own))
    return _entry((*fields, prev, own))


def list_entries(
    db: Database, *, after_seq: int = 0, limit: int = 100, tenant_id: str | None = None
) -> list[AuditEntry]:
    """Entries with seq > `after_seq`, oldest first (keyset pages); of one tenant if given."""
    if tenant_id is None:
        rows = db.query(SELECT_ENTRIES + " WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit))
    else:
        rows = db.query(
            SELECT_ENTRIES + " WHERE tenant_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (tenant_id, after_seq, limit),
        )
    return [_entry(row) for row in rows]


@dataclass(frozen=True, slots=True)
class ChainCheck:
    """What `verify_chain` found: how many entries fit, and the first that does not."""

    checked: int
    broken_seq: int | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.broken_seq is None


VERIFY_PAGE = 1000


def verify_chain(db: Database) -> ChainCheck:
    """Recompute every hash in order; the first entry whose stored hashes, or whose
    place in the sequence, do not match what its predecessor and its fields give."""
    prev, expected_seq, checked = GENESIS_HASH, 1, 0
    with db.read_snapshot():
        while True:
            page = list_entries(db, after_seq=expected_seq - 1, limit=VERIFY_PAGE)
            for e in page:
                if e.seq != expected_seq:
                    return ChainCheck(checked, expected_seq, "missing (deleted?)")
                if e.prev_hash != prev:
                    return ChainCheck(checked, e.seq, "does not chain to the entry before it")
                fields = (
                    e.seq, e.ts, e.actor, e.action, e.resource_type, e.resource_id,
                    e.tenant_id, e.before, e.after, e.request_id,
                )  # fmt: skip
                if entry_hash(prev, fields) != e.entry_hash:
                    return ChainCheck(checked, e.seq, "its contents do not match its hash")
                prev, expected_seq, checked = e.entry_hash, expected_seq + 1, checked + 1
            if len(page) < VERIFY_PAGE:
                return ChainCheck(checked)
