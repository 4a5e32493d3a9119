"""Admin tokens in the store, on either backend: minted, listed, revoked, authenticated.

A token is ``sgadm_`` + 43 base64url characters (32 random bytes) + 8 hex digits of
CRC-32 over what precedes them: the prefix lets secret scanners find a leaked token and
the checksum lets them (and `looks_like_token`) tell a real one from a typo without the
store. As for API keys (saltgate.store.tenants), only the SHA-256 of the token is stored:
256 random bits need no slow KDF and no salt. A token exists in clear only in the return
value of `AdminTokens.create`.

Authentication reads the store every time, so a revocation holds from the next request;
a token pinned to a tenant that is archived is dead with it (it signs in, reads and mints
nothing more), and none is pinned to an archived tenant.
"""

from __future__ import annotations

import base64
import dataclasses
import hmac
import json
import secrets
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from saltgate.store import audit
from saltgate.store.audit import Actor
from saltgate.store.db import Database
from saltgate.store.errors import InvalidInputError, TokenNotFoundError, TokenRevokedError
from saltgate.store.tenants import ADMIN_TOKEN_PREFIX
from saltgate.store.tenants import hash_api_key as hash_admin_token

_BODY_CHARS = 43  # 32 random bytes, base64url without padding
_CHECKSUM_CHARS = 8
ADMIN_TOKEN_LENGTH = len(ADMIN_TOKEN_PREFIX) + _BODY_CHARS + _CHECKSUM_CHARS
# A token's last use is recorded to this resolution (a console polling every second
# writes once a minute).
LAST_USE_RESOLUTION_S = 60.0
TOKEN_ID_PREFIX = "adm_"  # noqa: S105 (an id's prefix)

_SELECT = (
    "SELECT id, scopes, tenant_id, created_at, created_by, last_used_at, revoked_at "
    "FROM admin_tokens"
)


@dataclass(frozen=True, slots=True)
class AdminTokenInfo:
    """One token's metadata; the token itself is not recoverable."""

    id: str
    scopes: frozenset[str]
    tenant_id: str | None  # pinned to this tenant; None: every tenant
    created_at: float
    created_by: str
    last_used_at: float | None
    revoked_at: float | None

    def to_dict(self) -> dict[str, Any]:
        """As the admin API and the audit log show it (redacted: the prefix only)."""
        return {
            "object": "admin_token",
            "id": self.id,
            "redacted_value": ADMIN_TOKEN_PREFIX + "...",
            "scopes": sorted(self.scopes),
            "tenant_id": self.tenant_id,
            "created_at": self.created_at,
            "created_by": self.created_by,
            "last_used_at": self.last_used_at,
            "revoked_at": self.revoked_at,
        }


def _checksum(text: str) -> str:
    return f"{zlib.crc32(text.encode('ascii')):08x}"


def new_admin_token() -> str:
    body = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode("ascii")
    head = ADMIN_TOKEN_PREFIX + body
    return head + _checksum(head)


def looks_like_token(presented: str) -> bool:
    """Shape and checksum; both are public, so refusing early leaks nothing."""
    if len(presented) != ADMIN_TOKEN_LENGTH or not presented.isascii():
        return False
    if not presented.startswith(ADMIN_TOKEN_PREFIX):
        return False
    head, check = presented[:-_CHECKSUM_CHARS], presented[-_CHECKSUM_CHARS:]
    return hmac.compare_digest(_checksum(head), check)


def _info(row: tuple[Any, ...]) -> AdminTokenInfo:
    tid, scopes, tenant_id, created_at, created_by, last_used_at, revoked_at = row
    return AdminTokenInfo(
        tid,
        frozenset(json.loads(scopes)),
        tenant_id,
        float(created_at),
        created_by,
        last_used_at,
        revoked_at,
    )


class AdminTokens:
    """The admin tokens of one store, acting as `actor` (who the audit log names)."""

    def __init__(self, db: Database, actor: Actor | None = None) -> None:
        self._db = db
        self._actor = actor or Actor.cli()

    def create(self, scopes: Iterable[str], tenant_id: str | None = None) -> tuple[str, str]:
        """Mint a token; returns ``(token_id, token)``. The token is shown once.

        `scopes` are names saltgate.admin.scopes has checked (the store keeps no list of
        them, so the admin plane owns its vocabulary)."""
        wanted = sorted(set(scopes))  # checked by the caller (saltgate.admin.scopes)
        if not wanted:
            raise InvalidInputError("an admin token needs at least one scope")
        token = new_admin_token()
        info = AdminTokenInfo(
            TOKEN_ID_PREFIX + secrets.token_hex(6),
            frozenset(wanted),
            tenant_id,
            time.time(),
            self._actor.name,
            None,
            None,
        )
        with self._db.transaction():
            if tenant_id is not None and not self._db.query(
                "SELECT 1 FROM tenants WHERE id = ? AND archived_at IS NULL", (tenant_id,)
            ):
                raise InvalidInputError("no such tenant to pin the token to (or it is archived)")
            self._db.execute(
                "INSERT INTO admin_tokens (id, token_hash, scopes, tenant_id, created_at, "
                "created_by) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    info.id,
                    hash_admin_token(token),
                    json.dumps(wanted),
                    tenant_id,
                    info.created_at,
                    info.created_by,
                ),
            )
            self._record("admin_token.created", info, None, info.to_dict())
        return info.id, token

    def list(
        self, *, after_id: str = "", limit: int = 1000, tenant_id: str | None = None
    ) -> list[AdminTokenInfo]:
        """Tokens by id after `after_id` (keyset pages); pinned to `tenant_id` if given."""
        if tenant_id is None:
            rows = self._db.query(_SELECT + " WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit))
        else:
            rows = self._db.query(
                _SELECT + " WHERE tenant_id = ? AND id > ? ORDER BY id LIMIT ?",
                (tenant_id, after_id, limit),
            )
        return [_info(row) for row in rows]

    def get(self, token_id: str) -> AdminTokenInfo:
        rows = self._db.query(_SELECT + " WHERE id = ?", (token_id,))
        if not rows:
            raise TokenNotFoundError("no such admin token id")
        return _info(rows[0])

    def revoke(self, token_id: str) -> AdminTokenInfo:
        """Revoke at once: the next request with the token is refused."""
        with self._db.transaction():
            info = self.get(token_id)
            if info.revoked_at is not None:
                raise TokenRevokedError(f"admin token {info.id} was already revoked")
            now = time.time()
            self._db.execute("UPDATE admin_tokens SET revoked_at = ? WHERE id = ?", (now, info.id))
            after = AdminTokenInfo(
                info.id,
                info.scopes,
                info.tenant_id,
                info.created_at,
                info.created_by,
                info.last_used_at,
                now,
            )
            self._record("admin_token.revoked", info, info.to_dict(), after.to_dict())
        return after

    def authenticate(self, presented: str) -> AdminTokenInfo | None:
        """The live token's metadata, its use recorded; None for anything else (a revoked
        token, or one pinned to an archived tenant).

        The row is found by the digest of the presented token, never by the secret, then
        the digest is confirmed with `hmac.compare_digest` (as KeySnapshot.lookup does).
        """
        if not looks_like_token(presented):
            return None
        digest = hash_admin_token(presented)
        rows = self._db.query(
            "SELECT token_hash, " + _SELECT.removeprefix("SELECT ") + " "  # noqa: S608 (constants)
            "WHERE token_hash = ? AND revoked_at IS NULL AND (tenant_id IS NULL OR tenant_id "
            "IN (SELECT id FROM tenants WHERE archived_at IS NULL))",
            (digest,),
        )
        if not rows or not hmac.compare_digest(bytes(rows[0][0]), digest):
            return None
        info = _info(rows[0][1:])
        now = time.time()
        if info.last_used_at is None or now - info.last_used_at >= LAST_USE_RESOLUTION_S:
            # A write (SQLite: the one write lock the gateway's ledger also takes) only
            # when the recorded use is older than the resolution, not on every request.
            self._db.execute(
                "UPDATE admin_tokens SET last_used_at = ? WHERE id = ?", (now, info.id)
            )
            info = dataclasses.replace(info, last_used_at=now)
        return info

    def _record(
        self,
        action: str,
        info: AdminTokenInfo,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
    ) -> None:
        audit.append(
            self._db,
            self._actor,
            action,
            "admin_token",
            info.id,
            tenant_id=info.tenant_id,
            before=before,
            after=after,
        )
