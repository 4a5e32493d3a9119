"""Tenants, hashed API keys and salt epochs, on either backend (docs/store.md).

The CLI (another process) writes here; a running gateway reads a snapshot of the live keys
(and of the prices set through the store, saltgate.store.model_prices) and refreshes it
when something changes, so revocations, rotations and prices take effect within a second
on every gateway without a restart: `KeyIndex` polls the SQLite file, and
saltgate.store.postgres.PgKeyIndex listens for PostgreSQL's notifications.

Why SHA-256 and no slow KDF: a key is ``"sg_"`` + 32 random bytes (256 bits of entropy).
Slow, salted KDFs exist to make guessing *low-entropy* passwords expensive; nobody can
enumerate 2**256 candidates at any hash speed, so a leaked hash table reveals no key, and a
fast hash keeps authentication cheap on the request path. No per-key salt is needed either:
precomputed tables are useless against 256-bit random inputs, and an unsalted digest lets
the gateway find a key by its hash in O(1).

Keys exist in clear only in the return value of `TenantStore.create_key`; they are never
stored, logged, or echoed in an error message.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol

from saltgate.governance.kinds import BANDS, DEFAULT_BAND
from saltgate.governance.limits import Limits
from saltgate.governance.weight import DEFAULT_WEIGHT, MAX_WEIGHT, MIN_WEIGHT, sane_weight
from saltgate.prices import MODEL_NAME, PriceBook
from saltgate.store import audit
from saltgate.store.audit import Actor
from saltgate.store.db import Database
from saltgate.store.errors import (
    ConflictError,
    InvalidInputError,
    KeyExpiredError,
    KeyNotFoundError,
    KeyRevokedError,
    StoreError,
    TenantArchivedError,
    TenantExistsError,
    TenantNotFoundError,
)
from saltgate.store.model_prices import MODEL_PRICES_SQL, store_versions
from saltgate.store.settings import DB_FILENAME, StoreSettings
from saltgate.store.sqlite import SqliteDatabase, open_db

KEY_PREFIX = "sg_"
KEY_LENGTH = len(KEY_PREFIX) + 43  # 32 random bytes, base64url without padding
TENANT_ID_PREFIX = "tn_"
KEY_ID_PREFIX = "key_"
ADMIN_TOKEN_PREFIX = "sgadm_"  # noqa: S105 (a public prefix) admin tokens (saltgate.store.admin_tokens)
# What tenant names may not start with: ids, and the secrets a name must never look like.
_RESERVED_PREFIXES = (TENANT_ID_PREFIX, KEY_PREFIX, ADMIN_TOKEN_PREFIX)

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TENANT_ID_RE = re.compile(r"tn_[0-9a-f]{16}")
_KEY_ID_RE = re.compile(r"key_[0-9a-f]{12}")


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant: `id` is stable for life and feeds the cache-salt derivation with `epoch`."""

    id: str
    name: str
    epoch: int
    created_at: float
    models: tuple[str, ...] | None = None  # the models it may use; None: all
    limits: Limits | None = None  # its limits and budget; None: unlimited
    archived_at: float | None = None  # archived: its keys stop working, its name stays taken
    weight: float = DEFAULT_WEIGHT  # its fair share of saturated replicas (docs/fairness.md)

    @property
    def epoch_label(self) -> str:
        """The epoch as the spec's derivation takes it (``lp(str(epoch))``)."""
        return str(self.epoch)

    def to_dict(self) -> dict[str, object]:
        """As the admin API and the audit log show it."""
        return {
            "object": "tenant",
            "id": self.id,
            "name": self.name,
            "epoch": self.epoch,
            "created_at": self.created_at,
            "models": None if self.models is None else list(self.models),
            "limits": limits_dict(self.limits),
            "weight": self.weight,
            "archived_at": self.archived_at,
        }


def limits_dict(limits: Limits | None) -> dict[str, object] | None:
    """Limits as a JSON object (their stored form); None when there are none."""
    stored = None if limits is None else limits.to_json()
    return None if stored is None else dict(json.loads(stored))


@dataclass(frozen=True, slots=True)
class ApiKeyInfo:
    """Metadata of one API key; the key itself is not recoverable."""

    id: str
    tenant_id: str
    created_at: float
    revoked_at: float | None
    limits: Limits | None = None  # narrowing its tenant's; None: the tenant's alone
    priority: str = DEFAULT_BAND.value  # its band (BANDS), fixed when it is created
    expires_at: float | None = None  # works until then (a rotation's grace); None: no end

    def to_dict(self) -> dict[str, object]:
        """As the admin API and the audit log show it (never the key or its hash)."""
        return {
            "object": "api_key",
            "id": self.id,
            "tenant_id": self.tenant_id,
            "redacted_value": KEY_PREFIX + "...",
            "created_at": self.created_at,
            "revoked_at": self.revoked_at,
            "expires_at": self.expires_at,
            "priority": self.priority,
            "limits": limits_dict(self.limits),
        }


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from, as the gateway needs it for salts and metering."""

    tenant_id: str
    tenant_name: str
    key_id: str
    epoch: int
    models: frozenset[str] | None = None  # the models it may use; None: all
    limits: Limits | None = None  # the tenant's limits; None: unlimited
    key_limits: Limits | None = None  # the key's own, narrowing the tenant's
    priority: str = DEFAULT_BAND.value  # the key's band (BANDS): the fair queue's order
    weight: float = DEFAULT_WEIGHT  # the tenant's fair share, bounded (sane_weight)
    # Whether admission has anything to check: decided once, when the key snapshot builds
    # the principal, not on every request.
    limited: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        limited = any(lim is not None and not lim.empty for lim in (self.limits, self.key_limits))
        object.__setattr__(self, "limited", limited)

    @property
    def epoch_label(self) -> str:
        """The epoch as the spec's derivation takes it (``lp(str(epoch))``)."""
        return str(self.epoch)


# The live keys with what a request needs of their tenant: the gateway's snapshot. A key
# with an expiry is in it until then: KeySnapshot.lookup checks the time (no change to
# the store marks the moment a rotation's grace ends).
LIVE_KEYS_SQL = (
    "SELECT k.key_hash, t.id, t.name, k.id, t.epoch, t.allowed_models, t.limits, k.limits, "
    "k.priority, k.expires_at, t.weight FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
    "WHERE k.revoked_at IS NULL AND t.archived_at IS NULL"
)


_SELECT_TENANTS = (
    "SELECT id, name, epoch, created_at, allowed_models, limits, archived_at, weight FROM tenants"
)
_SELECT_KEYS = (
    "SELECT id, tenant_id, created_at, revoked_at, limits, expires_at, priority FROM api_keys"
)


def _allowed_models(stored: str | None) -> tuple[str, ...] | None:
    """The ``allowed_models`` column: NULL for every model, else a JSON array of names."""
    return None if stored is None else tuple(json.loads(stored))


def _tenant(
    row: tuple[str, str, int, float, str | None, str | None, float | None, float],
) -> Tenant:
    tid, name, epoch, created_at, models, limits, archived_at, weight = row
    return Tenant(
        tid,
        name,
        int(epoch),
        created_at,
        _allowed_models(models),
        Limits.from_json(limits),
        archived_at,
        float(weight),
    )


def _checked_weight(weight: float) -> float:
    """A weight as stored: within [MIN_WEIGHT, MAX_WEIGHT], else InvalidInputError."""
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise InvalidInputError(
            f"weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}, got {weight!r}"
        )
    return float(weight)


def _key(row: tuple[str, str, float, float | None, str | None, float | None, str]) -> ApiKeyInfo:
    kid, tid, created_at, revoked_at, limits, expires_at, priority = row
    return ApiKeyInfo(
        kid,
        tid,
        created_at,
        revoked_at,
        Limits.from_json(limits),
        priority=priority,
        expires_at=expires_at,
    )


def db_path(state_dir: str | os.PathLike[str]) -> Path:
    """The database file inside a state directory."""
    return Path(state_dir) / DB_FILENAME


# --------------------------------------------------------------------------- keys


def new_api_key() -> str:
    """A fresh API key: ``sg_`` + 43 base64url characters (32 random bytes)."""
    raw = secrets.token_bytes(32)
    return KEY_PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def hash_api_key(key: str) -> bytes:
    """SHA-256 of the key's ASCII bytes: the only form a key (or an admin token) is
    stored in."""
    return hashlib.sha256(key.encode("ascii")).digest()


def _looks_like_key(presented: str) -> bool:
    """Cheap shape check; the shape is public, so rejecting early leaks nothing."""
    return len(presented) == KEY_LENGTH and presented.startswith(KEY_PREFIX) and presented.isascii()


def _describe_ref(ref: str, pattern: re.Pattern[str], what: str) -> str:
    """Echo a user-given reference only if it has the expected shape, so a key pasted into
    the wrong argument never ends up in an error message or a log."""
    for prefix, secret in ((KEY_PREFIX, "an API key"), (ADMIN_TOKEN_PREFIX, "an admin token")):
        if ref.startswith(prefix):
            return f"{what} (that argument looks like {secret}, not a {what}; not shown)"
    if pattern.fullmatch(ref):
        return f"{what} {ref!r}"
    return f"{what} (argument not shown: not a valid {what})"


# --------------------------------------------------------------------------- store


class TenantStore:
    """Administrative operations (the CLI's and the admin API's): tenants, keys, salt
    rotation, on either backend. Every change is recorded in the audit log, in its own
    transaction, as made by `actor` (by default the OS user running this process).

    Give it a database path (SQLite) or an open `Database`
    (saltgate.store.backends.open_database builds one from `[store]` settings).
    """

    def __init__(
        self, target: str | os.PathLike[str] | Database, *, actor: Actor | None = None
    ) -> None:
        if isinstance(target, str | os.PathLike):  # a SQLite file: its master key beside it
            key_file = StoreSettings.sqlite(Path(target)).master_key_file
            target = SqliteDatabase(target, audit.audit_key(key_file))
        self._db: Database = target
        self.actor = actor or Actor.cli()

    @classmethod
    def from_state_dir(cls, state_dir: str | os.PathLike[str]) -> TenantStore:
        """Open ``state_dir/saltgate.db``."""
        return cls(db_path(state_dir))

    @property
    def db(self) -> Database:
        """The open store, for the other tables changed alongside (admin tokens)."""
        return self._db

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> TenantStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _audit(
        self,
        action: str,
        tenant_id: str,
        before: Tenant | ApiKeyInfo | None,
        after: Tenant | ApiKeyInfo,
    ) -> None:
        """Record a change; called inside the change's transaction, so both or neither."""
        shown = after.to_dict()
        audit.append(
            self._db,
            self.actor,
            action,
            str(shown["object"]),
            after.id,
            tenant_id=tenant_id,
            before=None if before is None else before.to_dict(),
            after=shown,
        )

    def _changed_tenant(self, action: str, before: Tenant) -> Tenant:
        """Read the tenant back after an UPDATE and record the change."""
        after = self.get_tenant(before.id)
        self._audit(action, before.id, before, after)
        return after

    def _changed_key(self, action: str, before: ApiKeyInfo) -> ApiKeyInfo:
        after = self._get_key(before.id)
        self._audit(action, before.tenant_id, before, after)
        return after

    # tenants

    @staticmethod
    def _check_name(name: str) -> None:
        if not _NAME_RE.fullmatch(name) or name.startswith(_RESERVED_PREFIXES):
            raise InvalidInputError(
                "invalid tenant name: use 1-64 characters of [A-Za-z0-9._-], starting with a "
                f"letter or digit, not starting with {', '.join(map(repr, _RESERVED_PREFIXES))} "
                "(reserved for tenant ids, API keys and admin tokens)"
            )

    def create_tenant(self, name: str) -> Tenant:
        """Create a tenant with a fresh random id and epoch 0."""
        self._check_name(name)
        tenant = Tenant(
            id=TENANT_ID_PREFIX + secrets.token_hex(8), name=name, epoch=0, created_at=time.time()
        )
        try:
            with self._db.transaction():
                self._db.execute(
                    "INSERT INTO tenants (id, name, epoch, created_at) VALUES (?, ?, ?, ?)",
                    (tenant.id, tenant.name, tenant.epoch, tenant.created_at),
                )
                self._audit("tenant.created", tenant.id, None, tenant)
        except ConflictError as exc:
            if self._find_tenant(name) is not None:
                raise TenantExistsError(f"tenant {name!r} already exists") from None
            raise StoreError(f"could not create tenant {name!r}: {exc}") from None
        return tenant

    def list_tenants(self, *, after_id: str = "", limit: int | None = None) -> list[Tenant]:
        """All tenants, by name; with `limit`, a page of them by id after `after_id`."""
        if limit is None:
            rows = self._db.query(_SELECT_TENANTS + " ORDER BY name")
        else:
            rows = self._db.query(
                _SELECT_TENANTS + " WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit)
            )
        return [_tenant(row) for row in rows]

    def get_tenant(self, tenant: str) -> Tenant:
        """Look a tenant up by id (``tn_...``) or name."""
        found = self._find_tenant(tenant)
        if found is None:
            raise TenantNotFoundError(
                f"no such tenant: {_describe_ref(tenant, _NAME_RE, 'tenant name or id')}"
            )
        return found

    def _find_tenant(self, ref: str) -> Tenant | None:
        rows = self._db.query(_SELECT_TENANTS + " WHERE id = ? OR name = ?", (ref, ref))
        return _tenant(rows[0]) if rows else None

    def _live_tenant(self, tenant: str) -> Tenant:
        """A tenant that is not archived (what may still change or get keys)."""
        t = self.get_tenant(tenant)
        if t.archived_at is not None:
            raise TenantArchivedError(f"tenant {t.name} is archived")
        return t

    def rotate_salt(self, tenant: str) -> int:
        """Move the tenant to a fresh cache namespace; returns the new epoch.

        Its old cache entries become unreachable (they age out of the replicas' LRU).
        """
        with self._db.transaction():
            t = self._live_tenant(tenant)
            self._db.execute("UPDATE tenants SET epoch = epoch + 1 WHERE id = ?", (t.id,))
            after = self._changed_tenant("tenant.salt_rotated", t)
        return after.epoch

    def rename_tenant(self, tenant: str, name: str) -> Tenant:
        """Give a tenant a new name; its id, and so its cache namespace, stay."""
        self._check_name(name)
        try:
            with self._db.transaction():
                t = self._live_tenant(tenant)
                self._db.execute("UPDATE tenants SET name = ? WHERE id = ?", (name, t.id))
                return self._changed_tenant("tenant.renamed", t)
        except ConflictError:
            raise TenantExistsError(f"tenant {name!r} already exists") from None

    def archive_tenant(self, tenant: str) -> Tenant:
        """Archive a tenant: its keys stop working on every gateway within a second (the
        auth generation moves); its usage and its name stay."""
        with self._db.transaction():
            t = self._live_tenant(tenant)
            self._db.execute("UPDATE tenants SET archived_at = ? WHERE id = ?", (time.time(), t.id))
            return self._changed_tenant("tenant.archived", t)

    def set_models(self, tenant: str, models: Iterable[str] | None) -> Tenant:
        """Let the tenant use only ``models`` (None: every model); every gateway follows
        within a second, as it does a key change (the auth generation moves)."""
        names = None
        if models is not None:
            names = tuple(sorted(set(models)))
            # As prices name models: no control characters, no bidi overrides, no spaces
            # (a name with a terminal escape reached the operator's `tenants list`).
            if not names or not all(MODEL_NAME.fullmatch(n) for n in names):
                raise InvalidInputError(
                    "invalid model list: give one or more model names, each 1-256 characters "
                    "of [A-Za-z0-9._:/@+-] starting with a letter or digit (or every model: --all)"
                )
        stored = None if names is None else json.dumps(list(names))
        with self._db.transaction():
            t = self._live_tenant(tenant)
            self._db.execute("UPDATE tenants SET allowed_models = ? WHERE id = ?", (stored, t.id))
            return self._changed_tenant("tenant.models_set", t)

    def set_limits(self, tenant: str, limits: Limits | None, weight: float | None = None) -> Tenant:
        """Replace the tenant's limits (None or empty: unlimited) and, when given, its
        weight (set_weight; None: kept) in one change; every gateway follows within a
        second, as it does a key change (the auth generation moves)."""
        stored = None if limits is None else limits.to_json()
        with self._db.transaction():
            t = self._live_tenant(tenant)
            self._db.execute(
                "UPDATE tenants SET limits = ?, weight = ? WHERE id = ?",
                (stored, t.weight if weight is None else _checked_weight(weight), t.id),
            )
            return self._changed_tenant("tenant.limits_set", t)

    def set_weight(self, tenant: str, weight: float) -> Tenant:
        """Set the tenant's fair share of saturated replicas (docs/fairness.md); every
        gateway follows within a second (the auth generation moves). InvalidInputError
        outside [MIN_WEIGHT, MAX_WEIGHT]."""
        with self._db.transaction():
            t = self._live_tenant(tenant)
            self._db.execute(
                "UPDATE tenants SET weight = ? WHERE id = ?", (_checked_weight(weight), t.id)
            )
            return self._changed_tenant("tenant.weight_set", t)

    def set_key_limits(self, key_id: str, limits: Limits | None) -> ApiKeyInfo:
        """Replace a key's own limits, which narrow its tenant's (None: the tenant's)."""
        stored = None if limits is None else limits.to_json()
        with self._db.transaction():
            info = self._get_key(key_id)
            self._db.execute("UPDATE api_keys SET limits = ? WHERE id = ?", (stored, key_id))
            return self._changed_key("api_key.limits_set", info)

    def get_key(self, key_id: str) -> ApiKeyInfo:
        """One key's metadata by its id; KeyNotFoundError."""
        return self._get_key(key_id)

    def _get_key(self, key_id: str) -> ApiKeyInfo:
        rows = self._db.query(_SELECT_KEYS + " WHERE id = ?", (key_id,))
        if not rows:
            raise KeyNotFoundError(f"no such {_describe_ref(key_id, _KEY_ID_RE, 'key id')}")
        return _key(rows[0])

    # keys

    def create_key(self, tenant: str, priority: str = DEFAULT_BAND.value) -> tuple[str, str]:
        """Mint a key for a tenant (by name or id) in a priority band (BANDS);
        returns ``(key_id, key)``.

        The key is shown once: only its SHA-256 is stored.
        """
        if priority not in BANDS:
            raise StoreError(f"invalid priority {priority!r}: expected one of {', '.join(BANDS)}")
        with self._db.transaction():
            return self._insert_key(self._live_tenant(tenant).id, None, priority)

    def _insert_key(self, tenant_id: str, limits: Limits | None, priority: str) -> tuple[str, str]:
        key = new_api_key()
        info = ApiKeyInfo(
            KEY_ID_PREFIX + secrets.token_hex(6),
            tenant_id,
            time.time(),
            None,
            limits,
            priority=priority,
        )
        self._db.execute(
            "INSERT INTO api_keys (id, tenant_id, key_hash, created_at, limits, priority) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                info.id,
                tenant_id,
                hash_api_key(key),
                info.created_at,
                None if limits is None else limits.to_json(),
                priority,
            ),
        )
        self._audit("api_key.created", tenant_id, None, info)
        return info.id, key

    def list_keys(
        self, tenant: str | None = None, *, after_id: str = "", limit: int | None = None
    ) -> list[ApiKeyInfo]:
        """Key metadata (never the keys), optionally of one tenant, oldest first; with
        `limit`, a page of one tenant's keys by id after `after_id` (keyset pagination)."""
        if tenant is None:
            rows = self._db.query(_SELECT_KEYS + " ORDER BY created_at")
        elif limit is None:
            t = self.get_tenant(tenant)
            rows = self._db.query(
                _SELECT_KEYS + " WHERE tenant_id = ? ORDER BY created_at", (t.id,)
            )
        else:
            rows = self._db.query(
                _SELECT_KEYS + " WHERE tenant_id = ? AND id > ? ORDER BY id LIMIT ?",
                (self.get_tenant(tenant).id, after_id, limit),
            )
        return [_key(row) for row in rows]

    def revoke_key(self, key_id: str) -> ApiKeyInfo:
        """Revoke a key by its id; the tenant (and its warm cache) is untouched."""
        with self._db.transaction():
            info = self._get_key(key_id)
            if info.revoked_at is not None:
                raise KeyRevokedError(f"key id {key_id!r} was already revoked")
            now = time.time()
            self._db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (now, key_id))
            return self._changed_key("api_key.revoked", info)

    def rotate_key(self, key_id: str, grace_s: float) -> tuple[ApiKeyInfo, str, str]:
        """Mint a successor with the key's tenant and limits, and let the old key work for
        `grace_s` more seconds (0: revoked now); returns ``(old key, new id, new key)``."""
        if not grace_s >= 0:
            raise InvalidInputError("the grace period must be 0 seconds or more")
        with self._db.transaction():
            info = self._get_key(key_id)
            if info.revoked_at is not None:
                raise KeyRevokedError(f"key id {key_id!r} was already revoked")
            now = time.time()
            if info.expires_at is not None and info.expires_at <= now:
                raise KeyExpiredError(f"key id {key_id!r} has expired")
            self._live_tenant(info.tenant_id)
            new_id, key = self._insert_key(info.tenant_id, info.limits, info.priority)
            if grace_s == 0:
                self._db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (now, key_id))
            else:
                ends = now + grace_s
                if info.expires_at is not None:
                    ends = min(ends, info.expires_at)
                self._db.execute("UPDATE api_keys SET expires_at = ? WHERE id = ?", (ends, key_id))
            old = self._changed_key("api_key.rotated", info)
        return old, new_id, key


def last_used(db: Database, key_ids: Sequence[str]) -> dict[str, float]:
    """When each of these keys was last used, as the gateways' ledgers write it once a
    minute (saltgate.store.ledger.KeyUse); keys never used are left out."""
    if not key_ids:
        return {}
    marks = ", ".join("?" * len(key_ids))
    rows = db.query(
        f"SELECT key_id, ts FROM key_last_used WHERE key_id IN ({marks})",  # noqa: S608
        tuple(key_ids),
    )
    return {kid: float(ts) for kid, ts in rows}


# --------------------------------------------------------------------------- hot path


class KeySource(Protocol):
    """What the gateway authenticates against: `KeyIndex` (SQLite) or PgKeyIndex."""

    def authenticate(self, presented: str) -> Principal | None:
        """The principal of a live key, or None; StoreUnavailableError once the store has
        been out of reach for longer than the gateway may authenticate without it."""
        ...

    async def aclose(self) -> None: ...


class KeySnapshot:
    """The live keys by SHA-256 digest: what `authenticate` consults, on either backend."""

    __slots__ = ("_by_hash",)

    def __init__(
        self,
        rows: Iterable[
            tuple[
                bytes,
                str,
                str,
                str,
                int,
                str | None,
                str | None,
                str | None,
                str,
                float | None,
                float,
            ]
        ] = (),
    ) -> None:
        """`rows` as LIVE_KEYS_SQL returns them."""
        allowed: dict[str, frozenset[str] | None] = {}  # one set per tenant, not per key
        limits: dict[str, Limits | None] = {}
        # digest -> (digest, principal, expiry: math.inf for none)
        self._by_hash: dict[bytes, tuple[bytes, Principal, float]] = {}
        for row in rows:
            h, tid, tname, kid, epoch, models, tenant_limits, key_limits, priority, expires, w = row
            if tid not in allowed:
                names = _allowed_models(models)
                allowed[tid] = None if names is None else frozenset(names)
                limits[tid] = Limits.from_json(tenant_limits)
            principal = Principal(
                tid,
                tname,
                kid,
                int(epoch),
                allowed[tid],
                limits[tid],
                Limits.from_json(key_limits),
                priority,
                sane_weight(float(w)),
            )
            ends = math.inf if expires is None else float(expires)
            self._by_hash[bytes(h)] = (bytes(h), principal, ends)

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, presented: str) -> Principal | None:
        """The principal of a live key, or None.

        The dict lookup compares SHA-256 digests, never the secret, so its timing tells an
        attacker only about digests of their own guesses (useless without a preimage);
        `hmac.compare_digest` then confirms the full digest in constant time.
        """
        if not _looks_like_key(presented):
            return None
        digest = hash_api_key(presented)
        entry = self._by_hash.get(digest)
        if entry is None:
            return None
        stored, principal, expires = entry
        if expires != math.inf and time.time() >= expires:
            return None  # a rotated key after its grace period
        return principal if hmac.compare_digest(stored, digest) else None


class KeyIndex:
    """The gateway's snapshot of the live keys in a SQLite store.

    `authenticate` is a hash plus a dict lookup; the snapshot is reloaded when the
    database's auth generation changes (checked at most every `max_staleness` seconds
    from `authenticate`, or whenever `refresh_if_changed` is called). Use from one thread.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_staleness: float | None = 0.5,
        book: PriceBook | None = None,
    ) -> None:
        """``book``: handed the store's prices at every reload (the gateway's PriceBook)."""
        self.path = Path(path)
        self.max_staleness = max_staleness
        self._book = book
        self._conn = open_db(self.path)
        self._keys = KeySnapshot()
        self._data_version = -1
        self._generation = -1
        self._checked_at = 0.0
        self.reloads = 0
        self.refresh_if_changed()

    @classmethod
    def from_state_dir(
        cls, state_dir: str | os.PathLike[str], *, max_staleness: float | None = 0.5
    ) -> KeyIndex:
        return cls(db_path(state_dir), max_staleness=max_staleness)

    def close(self) -> None:
        self._conn.close()

    async def aclose(self) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, presented: str) -> Principal | None:
        """The principal of a live key, or None (see `KeySnapshot.lookup`).

        A key the snapshot does not know makes it look for a change first (a PRAGMA, and a
        reload only if keys changed): a key minted a moment ago, over the admin API or the
        CLI, works on its first request rather than after up to `max_staleness`.
        """
        if self.max_staleness is not None:
            now = time.monotonic()
            if now - self._checked_at >= self.max_staleness:
                self.refresh_if_changed()
        found = self._keys.lookup(presented)
        unknown = found is None and self.max_staleness is not None
        if unknown and _looks_like_key(presented) and self.refresh_if_changed():
            found = self._keys.lookup(presented)
        return found

    def refresh_if_changed(self) -> bool:
        """Reload if tenants, keys or prices changed since the last load; True if reloaded.

        Cheap enough to call per request: ``PRAGMA data_version`` answers from the
        connection without touching the tables, and only when some other connection has
        committed (e.g. the ledger appending usage) is the one-row generation read.
        """
        self._checked_at = time.monotonic()
        (data_version,) = self._conn.execute("PRAGMA data_version").fetchone()
        if data_version == self._data_version:
            return False
        self._data_version = data_version
        (generation,) = self._conn.execute(
            "SELECT auth_generation FROM meta WHERE id = 1"
        ).fetchone()
        if generation == self._generation:
            return False
        self._reload()
        return True

    def _reload(self) -> None:
        """Read generation and live keys in one read transaction (a consistent snapshot)."""
        self._conn.execute("BEGIN")
        try:
            (generation,) = self._conn.execute(
                "SELECT auth_generation FROM meta WHERE id = 1"
            ).fetchone()
            rows = self._conn.execute(LIVE_KEYS_SQL).fetchall()
            prices = store_versions(self._conn.execute(MODEL_PRICES_SQL).fetchall())
        finally:
            self._conn.execute("COMMIT")
        self._keys = KeySnapshot(rows)
        if self._book is not None:
            self._book.stored(prices)
        self._generation = generation
        self.reloads += 1
