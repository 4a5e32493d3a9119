"""The admin plane's one service: every admin operation, its access rule and its audit.

One method per row of saltgate.admin.scopes.ROUTES (the same name). Each takes the
`Caller` (scopes, the tenant it is pinned to, the actor the audit log names), checks the
operation's scope and the pinning, runs on the store's own thread, and returns typed
records; every change is written to the audit log in its own transaction (the stores do
that with the caller's actor). The HTTP admin API (saltgate.admin.api), the console and
the CLI's admin commands are front ends over it: they parse their input, call one method
and render its records, and keep no access rule of their own.

The rules (docs/admin-api.md):
- a token pinned to a tenant finds only that tenant's objects; another tenant's are "not
  found", as if they did not exist;
- what the operator sets on a tenant (its name, models, limits, budget and fair-share
  weight) is not the tenant's to undo: a pinned token cannot change it (403), and a rename
  cannot be used to learn which names exist;
- a token mints only tokens within its own scopes and pin, and revokes only tokens whose
  scopes are within its own.

Refusals are `ApiError`s (status, OpenAI error shape); store errors pass through as
`StoreError`s for the front end to render.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from saltgate.admin import openapi, scopes, usage
from saltgate.admin.store import AdminStore
from saltgate.admin.tokens import AdminPrincipal
from saltgate.governance.kinds import BANDS
from saltgate.governance.limits import LimitError, Limits, LimitsEdit
from saltgate.policy.errors import ApiError
from saltgate.prices import Price
from saltgate.store import audit
from saltgate.store.admin_tokens import AdminTokenInfo, AdminTokens
from saltgate.store.audit import Actor, AuditEntry
from saltgate.store.db import Database
from saltgate.store.errors import (
    ConflictError,
    InvalidInputError,
    KeyExpiredError,
    KeyNotFoundError,
    KeyRevokedError,
    PriceNotFoundError,
    StoreError,
    StoreUnavailableError,
    TenantArchivedError,
    TenantExistsError,
    TenantNotFoundError,
    TokenNotFoundError,
    TokenRevokedError,
)
from saltgate.store.model_prices import ModelPrice, PriceStore, effective_prices
from saltgate.store.tenants import ApiKeyInfo, Tenant, TenantStore, last_used
from saltgate.store.usage_rollups import UsageReader

T = TypeVar("T")

MAX_GRACE_S = 30 * 86400.0
Document = dict[str, Any]  # an OpenAI-shaped usage or costs document (saltgate.admin.usage)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who calls: the admin token's id (None: an operator at the CLI), its scopes, the
    tenant it is pinned to (None: every tenant), and the actor its changes are audited as."""

    token_id: str | None
    scopes: frozenset[str]
    pinned: str | None
    actor: Actor

    @classmethod
    def of(cls, principal: AdminPrincipal, request_id: str | None = None) -> Caller:
        """An admin token's caller (the API's, the console's session's)."""
        actor = Actor(principal.token_id, request_id)
        return cls(principal.token_id, principal.scopes, principal.tenant_id, actor)

    @classmethod
    def operator(cls) -> Caller:
        """A local operator (the CLI): every scope, every tenant, audited as the OS user."""
        return cls(None, frozenset(scopes.SCOPES), None, Actor.cli())


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list: up to `limit` items, and whether more follow."""

    items: list[T]
    has_more: bool


@dataclass(frozen=True, slots=True)
class KeyView:
    """An API key's metadata and when it was last used (None: never, or not yet rolled up)."""

    key: ApiKeyInfo
    last_used_at: float | None

    def to_dict(self) -> dict[str, object]:
        return {**self.key.to_dict(), "last_used_at": self.last_used_at}


@dataclass(frozen=True, slots=True)
class NewKey:
    """A key just minted: its value is shown this once."""

    key: ApiKeyInfo
    value: str
    replaces: ApiKeyInfo | None = None  # a rotation's old key (works for its grace)

    def to_dict(self) -> dict[str, object]:
        shown = {**self.key.to_dict(), "value": self.value}
        return shown if self.replaces is None else {**shown, "replaces": self.replaces.to_dict()}


@dataclass(frozen=True, slots=True)
class NewAdminToken:
    """An admin token just minted: its value is shown this once."""

    token: AdminTokenInfo
    value: str

    def to_dict(self) -> dict[str, object]:
        return {**self.token.to_dict(), "value": self.value}


@dataclass(frozen=True, slots=True)
class PriceCleared:
    """A store price deleted, and the price now in effect (None: the model is unpriced)."""

    deleted: ModelPrice
    effective: ModelPrice | None

    def to_dict(self) -> dict[str, object]:
        now = None if self.effective is None else self.effective.to_dict()
        return {**self.deleted.to_dict(), "deleted": True, "effective": now}


@dataclass(frozen=True, slots=True)
class TenantChange:
    """What `tenants_update` changes: a new name, the models (None: every model), the
    fair-share weight (None: kept); any of them."""

    name: str | None = None
    set_models: bool = False
    models: tuple[str, ...] | None = None
    weight: float | None = None


# Store errors as statuses: what the caller can act on. Others (the store did not answer) 503.
_STATUS: tuple[tuple[type[StoreError], int], ...] = (
    (TenantNotFoundError, 404),
    (KeyNotFoundError, 404),
    (TokenNotFoundError, 404),
    (PriceNotFoundError, 404),
    (TenantExistsError, 409),
    (TenantArchivedError, 409),
    (KeyRevokedError, 409),
    (KeyExpiredError, 409),
    (TokenRevokedError, 409),
    (ConflictError, 409),
    (InvalidInputError, 400),
    (StoreUnavailableError, 503),
)


def store_status(error: StoreError) -> int:
    """The HTTP status a front end answers a store error with."""
    return next((status for kind, status in _STATUS if isinstance(error, kind)), 503)


def not_found(what: str) -> ApiError:
    return ApiError(404, f"no such {what}", code="not_found")


# What a limits operation does: replace them all (None: clear them), or edit some.
LimitsChange = Limits | LimitsEdit | None


def _changed(current: Limits | None, change: LimitsChange) -> Limits | None:
    """The limits after `change`, read against what is stored in the same transaction."""
    if not isinstance(change, LimitsEdit):
        return change
    try:
        return change.apply(current)
    except LimitError as exc:  # the edit and what was kept do not hold together
        raise ApiError(400, str(exc), param=exc.field) from None


def _operator_only(what: str) -> ApiError:
    return ApiError(
        403,
        f"a token pinned to a tenant cannot change its tenant's {what}: the operator sets "
        "them (an unpinned token or the CLI; docs/admin-api.md)",
        code="operator_only",
    )


def _visible(
    caller: Caller, what: str, find: Callable[[], T], tenant_of: Callable[[T], str | None]
) -> T:
    """An object the caller may see. To a pinned token a missing one and another tenant's
    are the same "not found": it cannot tell what exists elsewhere (an unpinned caller is
    told the store's reason, which describes the reference without echoing a secret)."""
    try:
        found = find()
    except (TenantNotFoundError, KeyNotFoundError, TokenNotFoundError):
        if caller.pinned is None:
            raise
        raise not_found(what) from None
    if not scopes.may_see(caller.pinned, tenant_of(found)):
        raise not_found(what)
    return found


def _tenant(store: TenantStore, caller: Caller, ref: str) -> Tenant:
    return _visible(caller, "tenant", lambda: store.get_tenant(ref), lambda t: t.id)


def _key(store: TenantStore, caller: Caller, key_id: str) -> ApiKeyInfo:
    return _visible(caller, "key", lambda: store.get_key(key_id), lambda k: k.tenant_id)


def _page(items: list[T], limit: int) -> Page[T]:
    """`items` holds up to limit + 1: one more means there is more."""
    return Page(items[:limit], len(items) > limit)


class AdminService:
    """Every admin operation (module doc); `prices` are the config's, the store's go over."""

    def __init__(
        self,
        store: AdminStore,
        usage_reader: UsageReader | None = None,
        prices: Mapping[str, Price] | None = None,
    ) -> None:
        self.store = store
        self.usage = usage_reader  # the rollups' reader; None: usage is not served here
        self.prices = prices or {}

    @staticmethod
    def authorize(caller: Caller, operation: str) -> None:
        """403 unless the caller holds the scope `operation` (a row's name) needs."""
        refused = scopes.refusal(caller.scopes, operation)
        if refused is not None:
            raise ApiError(403, refused, code="missing_scope")

    async def _run(self, caller: Caller, operation: str, fn: Callable[[Database], T]) -> T:
        self.authorize(caller, operation)
        return await self.store.run(fn)

    # -- who am I --------------------------------------------------------------------------
    async def me(self, caller: Caller) -> Caller:
        self.authorize(caller, "me")
        return caller

    async def openapi(self, caller: Caller) -> dict[str, Any]:
        """The admin API's OpenAPI document (saltgate.admin.openapi)."""
        self.authorize(caller, "openapi")
        return openapi.document()

    # -- tenants ---------------------------------------------------------------------------
    async def tenants_list(self, caller: Caller, *, after: str = "", limit: int) -> Page[Tenant]:
        def read(db: Database) -> list[Tenant]:
            store = TenantStore(db)
            if caller.pinned is not None:
                own = _tenant(store, caller, caller.pinned)
                return [own] if own.id > after else []
            return store.list_tenants(after_id=after, limit=limit + 1)

        return _page(await self._run(caller, "tenants_list", read), limit)

    async def tenants_create(self, caller: Caller, name: str) -> Tenant:
        self.authorize(caller, "tenants_create")
        if caller.pinned is not None:
            raise ApiError(403, "a token pinned to a tenant cannot create tenants")
        return await self.store.run(
            lambda db: TenantStore(db, actor=caller.actor).create_tenant(name)
        )

    async def tenants_get(self, caller: Caller, ref: str) -> Tenant:
        return await self._run(
            caller, "tenants_get", lambda db: _tenant(TenantStore(db), caller, ref)
        )

    async def tenants_update(self, caller: Caller, ref: str, change: TenantChange) -> Tenant:
        """Rename, choose the models, set the weight: the operator's (a pinned token could
        otherwise lift its own model list or share, and a rename's 409 would tell it which
        names exist elsewhere). The weight also needs the scope that sets it with the limits
        (limits:write), as it did when it was only set there."""
        if change.weight is not None:
            self.authorize(caller, "tenants_limits")

        def update(db: Database) -> Tenant:
            store = TenantStore(db, actor=caller.actor)
            tenant = _tenant(store, caller, ref)
            if caller.pinned is not None:
                raise _operator_only("name, models or weight")
            if change.name is not None and change.name != tenant.name:
                tenant = store.rename_tenant(tenant.id, change.name)
            if change.set_models:
                tenant = store.set_models(tenant.id, change.models)
            if change.weight is not None:
                tenant = store.set_weight(tenant.id, change.weight)
            return tenant

        return await self._run(caller, "tenants_update", update)

    async def _tenant_change(
        self, caller: Caller, operation: str, ref: str, fn: Callable[[TenantStore, Tenant], Tenant]
    ) -> Tenant:
        def apply(db: Database) -> Tenant:
            store = TenantStore(db, actor=caller.actor)
            return fn(store, _tenant(store, caller, ref))

        return await self._run(caller, operation, apply)

    async def tenants_archive(self, caller: Caller, ref: str) -> Tenant:
        return await self._tenant_change(
            caller, "tenants_archive", ref, lambda store, t: store.archive_tenant(t.id)
        )

    async def tenants_rotate_salt(self, caller: Caller, ref: str) -> Tenant:
        def rotate(store: TenantStore, t: Tenant) -> Tenant:
            store.rotate_salt(t.id)
            return store.get_tenant(t.id)

        return await self._tenant_change(caller, "tenants_rotate_salt", ref, rotate)

    async def tenants_limits(
        self, caller: Caller, ref: str, change: LimitsChange, weight: float | None = None
    ) -> Tenant:
        """A tenant's limits and budget, replaced or edited, and its weight when given
        (None: kept; the front ends take it among the limits, governance/weight.py): the
        operator's (a pinned token narrows its own keys' limits instead, which the tenant's
        still bound)."""

        def apply(store: TenantStore, t: Tenant) -> Tenant:
            if caller.pinned is not None:
                raise _operator_only("limits, budget or weight")
            return store.set_limits(t.id, _changed(t.limits, change), weight)

        return await self._tenant_change(caller, "tenants_limits", ref, apply)

    # -- keys ------------------------------------------------------------------------------
    async def keys_list(
        self, caller: Caller, ref: str, *, after: str = "", limit: int
    ) -> Page[KeyView]:
        def read(db: Database) -> list[KeyView]:
            store = TenantStore(db)
            tenant = _tenant(store, caller, ref)
            keys = store.list_keys(tenant.id, after_id=after, limit=limit + 1)
            used = last_used(db, [k.id for k in keys[:limit]])
            return [KeyView(k, used.get(k.id)) for k in keys]

        return _page(await self._run(caller, "keys_list", read), limit)

    async def keys_create(self, caller: Caller, ref: str, priority: str) -> NewKey:
        if priority not in BANDS:
            raise ApiError(400, f"priority must be one of: {', '.join(BANDS)}", param="priority")

        def create(db: Database) -> NewKey:
            store = TenantStore(db, actor=caller.actor)
            key_id, value = store.create_key(_tenant(store, caller, ref).id, priority)
            return NewKey(store.get_key(key_id), value)

        return await self._run(caller, "keys_create", create)

    async def keys_get(self, caller: Caller, key_id: str) -> KeyView:
        def read(db: Database) -> KeyView:
            key = _key(TenantStore(db), caller, key_id)
            return KeyView(key, last_used(db, [key.id]).get(key.id))

        return await self._run(caller, "keys_get", read)

    async def keys_revoke(self, caller: Caller, key_id: str) -> ApiKeyInfo:
        def revoke(db: Database) -> ApiKeyInfo:
            store = TenantStore(db, actor=caller.actor)
            return store.revoke_key(_key(store, caller, key_id).id)

        return await self._run(caller, "keys_revoke", revoke)

    async def keys_rotate(self, caller: Caller, key_id: str, grace_s: float) -> NewKey:
        if not (math.isfinite(grace_s) and 0 <= grace_s <= MAX_GRACE_S):
            raise ApiError(
                400,
                f"grace_period_s must be seconds from 0 to {MAX_GRACE_S:.0f}",
                param="grace_period_s",
            )

        def rotate(db: Database) -> NewKey:
            store = TenantStore(db, actor=caller.actor)
            old, new_id, value = store.rotate_key(_key(store, caller, key_id).id, grace_s)
            return NewKey(store.get_key(new_id), value, replaces=old)

        return await self._run(caller, "keys_rotate", rotate)

    async def keys_limits(self, caller: Caller, key_id: str, change: LimitsChange) -> ApiKeyInfo:
        def apply(db: Database) -> ApiKeyInfo:
            store = TenantStore(db, actor=caller.actor)
            key = _key(store, caller, key_id)
            return store.set_key_limits(key.id, _changed(key.limits, change))

        return await self._run(caller, "keys_limits", apply)

    # -- the audit log ---------------------------------------------------------------------
    async def audit_logs_list(
        self, caller: Caller, *, after_seq: int = 0, limit: int
    ) -> Page[AuditEntry]:
        entries = await self._run(
            caller,
            "audit_logs_list",
            lambda db: audit.list_entries(
                db, after_seq=after_seq, limit=limit + 1, tenant_id=caller.pinned
            ),
        )
        return _page(entries, limit)

    # -- admin tokens ----------------------------------------------------------------------
    async def admin_tokens_list(
        self, caller: Caller, *, after: str = "", limit: int
    ) -> Page[AdminTokenInfo]:
        tokens = await self._run(
            caller,
            "admin_tokens_list",
            lambda db: AdminTokens(db).list(
                after_id=after, limit=limit + 1, tenant_id=caller.pinned
            ),
        )
        return _page(tokens, limit)

    async def admin_tokens_create(
        self, caller: Caller, wanted: frozenset[str], tenant_ref: str | None
    ) -> NewAdminToken:
        """A token within the caller's scopes and pin (`tenant_ref` None: unpinned)."""

        def create(db: Database) -> NewAdminToken:
            tenant_id = None
            if tenant_ref is not None:
                tenant_id = _tenant(TenantStore(db), caller, tenant_ref).id
            refused = scopes.may_mint(caller.scopes, caller.pinned, wanted, tenant_id)
            if refused is not None:
                raise ApiError(403, refused, code="scope_escalation")
            tokens = AdminTokens(db, caller.actor)
            token_id, value = tokens.create(wanted, tenant_id)
            return NewAdminToken(tokens.get(token_id), value)

        return await self._run(caller, "admin_tokens_create", create)

    async def admin_tokens_revoke(self, caller: Caller, token_id: str) -> AdminTokenInfo:
        """Revoke a token the caller sees whose scopes are within its own (else a token
        holding only admin_tokens:write could revoke every `all` token, locking the
        operators out)."""

        def revoke(db: Database) -> AdminTokenInfo:
            tokens = AdminTokens(db, caller.actor)
            info = _visible(
                caller, "admin token", lambda: tokens.get(token_id), lambda t: t.tenant_id
            )
            extra = info.scopes - caller.scopes
            if extra:
                raise ApiError(
                    403,
                    "a token can revoke only tokens within its own scopes; this one also "
                    f"holds {scopes.scopes_label(extra)}",
                    code="scope_escalation",
                )
            return tokens.revoke(info.id)

        return await self._run(caller, "admin_tokens_revoke", revoke)

    # -- usage and costs (OpenAI's documents, saltgate.admin.usage) ------------------------
    def _reader(self) -> UsageReader:
        if self.usage is None:
            raise ApiError(501, "usage is not served by this listener", code="not_implemented")
        return self.usage

    async def _usage(
        self,
        caller: Caller,
        operation: str,
        query: Callable[[UsageReader, Mapping[str, str], str | None], Awaitable[tuple[int, Any]]],
        args: Mapping[str, str],
    ) -> Document:
        self.authorize(caller, operation)
        status, document = await query(self._reader(), args, caller.pinned)
        if status != 200:
            error = document["error"]
            raise ApiError(
                status,
                error["message"],
                type=error["type"],
                param=error["param"],
                code=error["code"],
            )
        return dict(document)

    async def usage_completions(self, caller: Caller, args: Mapping[str, str]) -> Document:
        return await self._usage(caller, "usage_completions", usage.usage_completions, args)

    async def costs(self, caller: Caller, args: Mapping[str, str]) -> Document:
        return await self._usage(caller, "costs", usage.costs, args)

    async def usage_reconcile(self, caller: Caller, args: Mapping[str, str]) -> Document:
        """Rollups against the ledger; a pinned token reconciles only its tenant's rows."""
        return await self._usage(caller, "usage_reconcile", usage.reconcile, args)

    def usage_completions_csv(
        self, caller: Caller, args: Mapping[str, str]
    ) -> AsyncGenerator[bytes, None]:
        """Every bucket of the range as CSV, streamed; the query is checked here, before a
        byte is sent (a bad parameter is a 400, not a stream cut short)."""
        self.authorize(caller, "usage_completions_csv")
        reader = self._reader()
        usage.parse_csv_query(args, caller.pinned)
        return usage.usage_csv(reader, args, caller.pinned)

    # -- prices ----------------------------------------------------------------------------
    async def prices_list(self, caller: Caller) -> list[ModelPrice]:
        """Every priced model's price in effect: the store's over the config's."""
        stored = await self._run(caller, "prices_list", lambda db: PriceStore(db).stored())
        return effective_prices(self.prices, stored)

    @staticmethod
    def _unpinned(caller: Caller) -> None:
        """Prices are every tenant's: a token pinned to one cannot change them."""
        if caller.pinned is not None:
            raise ApiError(403, "a token pinned to a tenant cannot change prices")

    async def prices_set(self, caller: Caller, model: str, price: Price) -> ModelPrice:
        """Set a model's price in the store, over the config's; the gateways bill with it
        within a second."""
        self.authorize(caller, "prices_set")
        self._unpinned(caller)
        return await self.store.run(lambda db: PriceStore(db, caller.actor).set(model, price))

    async def prices_clear(self, caller: Caller, model: str) -> PriceCleared:
        """Delete a model's store price: the config's applies again (or none)."""
        self.authorize(caller, "prices_clear")
        self._unpinned(caller)
        deleted = await self.store.run(lambda db: PriceStore(db, caller.actor).clear(model))
        now = next((p for p in effective_prices(self.prices, {}) if p.version.model == model), None)
        return PriceCleared(deleted, now)
