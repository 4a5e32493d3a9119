"""The audit log: every change to tenants, keys, limits, models, salts and admin tokens,
from the admin API and the CLI alike, append-only and chained by hash (docs/admin-api.md).

Each entry's hash is HMAC-SHA256 under K_audit, a key derived from the master key
(docs/spec.md section 13) and never stored in the database, over its predecessor's hash
and the canonical JSON of its fields (sorted keys, no spaces, ASCII). Editing, inserting
or deleting an entry breaks every hash after it, and without the master key nobody can
compute them again: `verify_chain` names the first entry that no longer fits. The first
entry chains to 32 zero bytes. Writers append inside the transaction of the change they
describe, so a change and its entry commit together or not at all.

Chains from before the key are plain SHA-256 (`entry_hash` without a key). They go on
unchanged: the first entry written with the key is keyed, and every one after it must
be (`ChainCheck.keyed_from` says where keying began). A writer without the key (a store
opened without its master key) refuses to append to a keyed chain rather than break it.

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
from pathlib import Path
from typing import Any

from saltgate.derivations.derive import audit_entry_mac, derive_audit_key
from saltgate.secretfiles import load_master_key
from saltgate.store.db import Database
from saltgate.store.errors import StoreError

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


def entry_hash(prev_hash: bytes, fields: tuple[object, ...], key: bytes | None = None) -> bytes:
    """The hash of an entry: HMAC-SHA256 under `key` (K_audit) of the previous hash and the
    canonical JSON of its fields (seq through request_id, in column order); without a key,
    the plain SHA-256 of chains written before the key."""
    encoded = canonical(list(fields)).encode("ascii")
    if key is None:
        return hashlib.sha256(prev_hash + encoded).digest()
    return audit_entry_mac(key, prev_hash, encoded)


def audit_key(master_key_file: Path | None) -> bytes | None:
    """K_audit from the master key file, if there is one (None: the store was opened
    without it, and can append only to a chain not yet keyed)."""
    if master_key_file is None or not master_key_file.exists():
        return None
    return derive_audit_key(load_master_key(master_key_file))


def _fields(e: AuditEntry) -> tuple[object, ...]:
    return (
        e.seq, e.ts, e.actor, e.action, e.resource_type, e.resource_id, e.tenant_id,
        e.before, e.after, e.request_id,
    )  # fmt: skip


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
    last = db.query(SELECT_ENTRIES + " ORDER BY seq DESC LIMIT 1")
    key = db.audit_key
    if last and key is None:
        previous = _entry(last[0])
        if entry_hash(previous.prev_hash, _fields(previous)) != previous.entry_hash:
            raise StoreError(
                "the audit log is keyed with the master key: open the store with it "
                "(--config naming master_key_file, or master.key in --state-dir) to record "
                "changes"
            )
    seq, prev = (int(last[0][0]) + 1, bytes(last[0][11])) if last else (1, GENESIS_HASH)
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
    own = entry_hash(prev, fields, key)
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
    """What `verify_chain` found: how many entries fit, the first that does not, from
    which entry the chain is keyed (None: not keyed), and the last entry's seq and hash
    (for `--expect`)."""

    checked: int
    broken_seq: int | None = None
    reason: str = ""
    keyed_from: int | None = None
    head: tuple[int, bytes] | None = None

    @property
    def ok(self) -> bool:
        return self.broken_seq is None


VERIFY_PAGE = 1000


def verify_chain(db: Database, key: bytes | None = None) -> ChainCheck:
    """Recompute every hash in order; the first entry whose stored hashes, or whose
    place in the sequence, do not match what its predecessor and its fields give.

    With `key` (K_audit; by default the store's own), an entry is keyed when its HMAC
    fits; an unkeyed entry is accepted only before the first keyed one. Without a key a
    keyed entry cannot be checked, and is reported as such."""
    key = key if key is not None else db.audit_key
    prev, expected_seq, checked = GENESIS_HASH, 1, 0
    keyed_from: int | None = None
    head: tuple[int, bytes] | None = None
    with db.read_snapshot():
        while True:
            page = list_entries(db, after_seq=expected_seq - 1, limit=VERIFY_PAGE)
            for e in page:
                broken = _broken(e, expected_seq, prev, key, keyed_from)
                if broken:  # a gap names the entry that is missing
                    where = min(e.seq, expected_seq)
                    return ChainCheck(checked, where, broken, keyed_from, head)
                if keyed_from is None and key is not None and _keyed(e, key):
                    keyed_from = e.seq
                head = (e.seq, e.entry_hash)
                prev, expected_seq, checked = e.entry_hash, expected_seq + 1, checked + 1
            if len(page) < VERIFY_PAGE:
                return ChainCheck(checked, keyed_from=keyed_from, head=head)


def _keyed(e: AuditEntry, key: bytes) -> bool:
    return entry_hash(e.prev_hash, _fields(e), key) == e.entry_hash


def _broken(
    e: AuditEntry, expected_seq: int, prev: bytes, key: bytes | None, keyed_from: int | None
) -> str:
    """Why `e` does not fit the chain so far ("" when it does)."""
    if e.seq != expected_seq:
        return "missing (deleted?)"
    if e.prev_hash != prev:
        return "does not chain to the entry before it"
    keyed = key is not None and _keyed(e, key)
    plain = not keyed and entry_hash(prev, _fields(e)) == e.entry_hash
    if keyed or (plain and keyed_from is None):
        return ""
    if plain:
        return f"it is not keyed, after keyed entries from {keyed_from} (rewritten?)"
    if key is None:
        return "it is keyed, or its contents do not match its hash: verify with the master key"
    return "its contents do not match its hash"


def expected_head(text: str) -> tuple[int, bytes]:
    """``SEQ:HASH`` (as verify prints the head) parsed; ValueError saying the form."""
    seq, _, digest = text.partition(":")
    try:
        parsed = (int(seq), bytes.fromhex(digest))
    except ValueError:
        parsed = (0, b"")
    if parsed[0] < 1 or len(parsed[1]) != 32:
        raise ValueError("--expect: give SEQ:HASH, an entry number and its 64 hex digits")
    return parsed


def head_problem(db: Database, check: ChainCheck, expect: tuple[int, bytes]) -> str | None:
    """Why an intact chain does not hold the head kept outside it (None: it does): the
    entry is gone (the end was cut) or has another hash (the chain was rewritten)."""
    seq, digest = expect
    if check.head is None or check.head[0] < seq:
        last = 0 if check.head is None else check.head[0]
        return f"entry {seq} is missing: the log ends at {last} (entries cut from the end?)"
    [entry] = list_entries(db, after_seq=seq - 1, limit=1)
    if entry.entry_hash != digest:
        return f"entry {seq} has another hash than expected (the chain was rewritten)"
    return None
