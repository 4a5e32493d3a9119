"""Admin tokens on the admin plane: who a request is from (docs/admin-api.md).

The token format, its hashed storage and its rows are saltgate.store.admin_tokens'; this
module turns a presented bearer token into an `AdminPrincipal`, or None. Inference API
keys (``sg_``) are never admin tokens: their shape is refused before the store is read.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from saltgate.admin.store import AdminStore
from saltgate.store.admin_tokens import AdminTokenInfo, AdminTokens


@dataclass(frozen=True, slots=True)
class AdminPrincipal:
    """An authenticated admin token: its id (never the token), scopes and pinned tenant."""

    token_id: str
    scopes: frozenset[str]
    tenant_id: str | None  # pinned: sees and changes only this tenant; None: every tenant


# The id of the admin token the current request was accepted with, for the admin
# listener's access line (saltgate.serving.admin_listener sets it to None per request).
AUTHENTICATED: ContextVar[str | None] = ContextVar("saltgate_admin_token_id", default=None)


def principal(info: AdminTokenInfo) -> AdminPrincipal:
    return AdminPrincipal(info.id, info.scopes, info.tenant_id)


async def authenticate_admin(store: AdminStore, token: str) -> AdminPrincipal | None:
    """The principal of a live (unrevoked) admin token, its use recorded; else None.

    Read from the store every time, so a revoked token is refused from the next request.
    The digest is compared in constant time (AdminTokens.authenticate).
    """
    info = await store.run(lambda db: AdminTokens(db).authenticate(token))
    if info is None:
        return None
    AUTHENTICATED.set(info.id)
    return principal(info)
