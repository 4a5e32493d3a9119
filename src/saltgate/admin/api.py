"""The admin API under /admin/v1/, on the admin listener only (docs/admin-api.md).

Each request: match a row of saltgate.admin.scopes.ROUTES (404, 405), authenticate the
bearer admin token (401; inference API keys are not admin tokens), check the route's
scope (403), then run its handler, whose store calls run on the store's own thread and
record every change in the audit log with the token's id and the request id. A token
pinned to a tenant finds only that tenant's objects: another tenant's are "not found",
as if they did not exist. Every error is in OpenAI's shape; none is a 500.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs

import orjson

from saltgate.admin import scopes, usage
from saltgate.admin.store import AdminStore
from saltgate.admin.tokens import AdminPrincipal, authenticate_admin
from saltgate.governance.limits import Limits, parse_limits
from saltgate.governance.priority import DEFAULT_PRIORITY, PRIORITIES
from saltgate.http import Request, Response
from saltgate.policy.errors import ApiError
from saltgate.prices import Price, price_from_fields
from saltgate.store import audit
from saltgate.store.admin_tokens import AdminTokens
from saltgate.store.audit import Actor
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
from saltgate.store.ledger import new_request_id
from saltgate.store.model_prices import PriceStore, effective_prices
from saltgate.store.tenants import ApiKeyInfo, Tenant, TenantStore, last_used
from saltgate.store.usage_rollups import UsageReader

JSON = (b"content-type", b"application/json")
CSV = (b"content-type", b"text/csv; charset=utf-8")
ADMIN_PATH = "/admin"
DEFAULT_LIMIT = 20
MAX_LIMIT = 100
DEFAULT_GRACE_S = 86400.0  # a rotated key's old value works for a day unless told
MAX_GRACE_S = 30 * 86400.0
MAX_BODY_BYTES = 64 * 1024

T = TypeVar("T")

# Store errors as HTTP: what the caller can act on. Others (the store did not answer) 503.
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


def _status(error: StoreError) -> int:
    return next((status for kind, status in _STATUS if isinstance(error, kind)), 503)


def not_found(what: str) -> ApiError:
    return ApiError(404, f"no such {what}", code="not_found")


def visible(
    call: Call, what: str, find: Callable[[], T], tenant_of: Callable[[T], str | None]
) -> T:
    """An object the caller may see. A missing one, and to a pinned token another tenant's,
    are the same "not found": a pinned token cannot even tell what exists elsewhere."""
    try:
        found = find()
    except (TenantNotFoundError, KeyNotFoundError, TokenNotFoundError):
        raise not_found(what) from None
    if not scopes.may_see(call.pinned, tenant_of(found)):
        raise not_found(what)
    return found


@dataclass
class Call:
    """One authenticated call: who, the path's parameters, the query, the body."""

    principal: AdminPrincipal
    params: dict[str, str]
    query: dict[str, list[str]]
    raw_body: bytes
    request_id: str
    _body: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def actor(self) -> Actor:
        return Actor(self.principal.token_id, self.request_id)

    @property
    def pinned(self) -> str | None:
        return self.principal.tenant_id

    def body(self) -> dict[str, Any]:
        """The JSON object sent (an empty body is an empty object); 400 otherwise."""
        if self._body is None:
            if not self.raw_body.strip():
                self._body = {}
            else:
                try:
                    parsed = orjson.loads(self.raw_body)
                except orjson.JSONDecodeError:
                    raise ApiError(400, "the body is not valid JSON") from None
                if not isinstance(parsed, dict):
                    raise ApiError(400, "the body must be a JSON object")
                self._body = parsed
        return self._body

    def args(self) -> dict[str, str]:
        """The query, each parameter's last value."""
        return {k: v[-1] for k, v in self.query.items()}

    def arg(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else None

    def limit(self) -> int:
        given = self.arg("limit")
        if given is None:
            return DEFAULT_LIMIT
        if not given.isdigit() or not 1 <= int(given) <= MAX_LIMIT:
            raise ApiError(400, f"limit must be an integer from 1 to {MAX_LIMIT}", param="limit")
        return int(given)

    def after(self) -> str:
        """The keyset cursor: the last id of the previous page."""
        given = self.arg("after") or ""
        if given and not scopes.SEGMENT.fullmatch(given):
            raise ApiError(400, "after must be an id from a previous page", param="after")
        return given


# A JSON answer (status, document), or a whole response (a streamed CSV).
Answer = tuple[int, dict[str, Any]] | Response
Handler = Callable[[Call], Awaitable[Answer]]


def page(
    items: Sequence[T], limit: int, show: Callable[[T], dict[str, Any]], last: str
) -> dict[str, Any]:
    """A list in OpenAI's shape; `items` holds up to limit + 1 (one more: there is more)."""
    shown = [show(i) for i in items[:limit]]
    return {
        "object": "list",
        "data": shown,
        "first_id": str(shown[0][last]) if shown else None,
        "last_id": str(shown[-1][last]) if shown else None,
        "has_more": len(items) > limit,
    }


def _limits(body: dict[str, Any]) -> Limits | None:
    """Limits from a JSON body (parse_limits: the stored field names, or budget_usd and
    budget_period); an empty object clears them."""
    try:
        return parse_limits(body)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


class AdminApi:
    """`handle` answers /admin/... requests (None for any other path)."""

    def __init__(
        self,
        store: AdminStore,
        usage: UsageReader | None = None,
        prices: Mapping[str, Price] | None = None,
    ) -> None:
        self.store = store
        self.usage = usage  # the rollups' reader (saltgate.admin.usage); None: not served
        self.prices = prices or {}  # the config's [prices]; the store's go over them
        self._handlers: dict[str, Handler] = {
            "me": self._me,
            "tenants_list": self._tenants_list,
            "tenants_create": self._tenants_create,
            "tenants_get": self._tenants_get,
            "tenants_update": self._tenants_update,
            "tenants_archive": self._tenants_archive,
            "tenants_rotate_salt": self._tenants_rotate_salt,
            "tenants_limits": self._tenants_limits,
            "keys_list": self._keys_list,
            "keys_create": self._keys_create,
            "keys_get": self._keys_get,
            "keys_revoke": self._keys_revoke,
            "keys_rotate": self._keys_rotate,
            "keys_limits": self._keys_limits,
            "audit_logs_list": self._audit_logs_list,
            "admin_tokens_list": self._admin_tokens_list,
            "admin_tokens_create": self._admin_tokens_create,
            "admin_tokens_revoke": self._admin_tokens_revoke,
            # OpenAI-shaped usage and costs from the rollups (saltgate.admin.usage).
            "usage_completions": self._usage_completions,
            "costs": self._costs,
            "usage_completions_csv": self._usage_completions_csv,
            "usage_reconcile": self._usage_reconcile,
            "prices_list": self._prices_list,
            "prices_set": self._prices_set,
            "prices_clear": self._prices_clear,
        }
        missing = {r.name for r in scopes.ROUTES} ^ set(self._handlers)
        assert not missing, f"routes and handlers differ: {sorted(missing)}"

    async def handle(self, request: Request) -> Response | None:
        path = request.path.decode("utf-8", "replace")
        if path != ADMIN_PATH and not path.startswith(ADMIN_PATH + "/"):
            return None
        request_id = new_request_id()
        try:
            answer = await self._handle(request, path, request_id)
            if isinstance(answer, Response):
                response = answer
            else:
                response = Response(answer[0], [JSON], orjson.dumps(answer[1]))
        except ApiError as error:
            response = Response(error.status, [JSON, *error.headers], error.body())
        except StoreError as error:
            status = _status(error)
            response = Response(status, [JSON], ApiError(status, str(error)).body())
        response.headers.append((b"x-request-id", request_id.encode()))
        return response

    async def _handle(self, request: Request, path: str, request_id: str) -> Answer:
        method = request.method.decode("ascii", "replace")
        found = scopes.match(method, path)
        if found is None:
            raise not_found("admin route")
        principal = await self._authenticate(request)
        if found.route is None:
            allow = ", ".join(sorted(found.allowed)).encode()
            raise ApiError(405, f"use {allow.decode()} here", headers=[(b"allow", allow)])
        route = found.route
        if route.scope is not None and route.scope not in principal.scopes:
            raise ApiError(
                403,
                f"this admin token lacks the scope {route.scope}",
                code="missing_scope",
            )
        if len(request.body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
        query = parse_qs(request.query.decode("utf-8", "replace"), keep_blank_values=True)
        call = Call(principal, found.params, query, request.body, request_id)
        return await self._handlers[route.name](call)

    async def _authenticate(self, request: Request) -> AdminPrincipal:
        """The request's admin token; 401 before any scope is looked at."""
        header = request.header(b"authorization")
        scheme, _, token = (header or b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401,
                "give an admin token: Authorization: Bearer sgadm_...",
                headers=[(b"www-authenticate", b'Bearer realm="saltgate-admin"')],
            )
        principal = await authenticate_admin(self.store, token.strip())
        if principal is None:
            # The same answer for a wrong, revoked or inference key: nothing to probe.
            raise ApiError(
                401,
                "invalid admin token (revoked, mistyped, or an API key: the admin API takes "
                "admin tokens only)",
                code="invalid_admin_token",
                headers=[(b"www-authenticate", b'Bearer realm="saltgate-admin"')],
            )
        return principal

    async def _run(self, fn: Callable[[Database], T]) -> T:
        return await self.store.run(fn)

    # -- helpers run on the store's thread ------------------------------------------------

    @staticmethod
    def _tenant(store: TenantStore, call: Call, ref: str) -> Tenant:
        return visible(call, "tenant", lambda: store.get_tenant(ref), lambda t: t.id)

    @staticmethod
    def _key(store: TenantStore, call: Call) -> ApiKeyInfo:
        key_id = call.params["key_id"]
        return visible(call, "key", lambda: store.get_key(key_id), lambda k: k.tenant_id)

    # -- handlers --------------------------------------------------------------------------

    async def _me(self, call: Call) -> tuple[int, dict[str, Any]]:
        p = call.principal
        return 200, {
            "object": "admin_token",
            "id": p.token_id,
            "scopes": sorted(p.scopes),
            "tenant_id": p.tenant_id,
        }

    async def _tenants_list(self, call: Call) -> tuple[int, dict[str, Any]]:
        limit, after = call.limit(), call.after()

        def read(db: Database) -> list[Tenant]:
            store = TenantStore(db)
            if call.pinned is not None:
                found = [self._tenant(store, call, call.pinned)]
                return [t for t in found if t.id > after][: limit + 1]
            return store.list_tenants(after_id=after, limit=limit + 1)

        return 200, page(await self._run(read), limit, Tenant.to_dict, "id")

    async def _tenants_create(self, call: Call) -> tuple[int, dict[str, Any]]:
        if call.pinned is not None:
            raise ApiError(403, "a token pinned to a tenant cannot create tenants")
        name = call.body().get("name")
        if not isinstance(name, str):
            raise ApiError(400, 'give the tenant\'s name: {"name": "..."}', param="name")
        tenant = await self._run(lambda db: TenantStore(db, actor=call.actor).create_tenant(name))
        return 201, tenant.to_dict()

    async def _tenants_get(self, call: Call) -> tuple[int, dict[str, Any]]:
        tenant = await self._run(
            lambda db: self._tenant(TenantStore(db), call, call.params["tenant_id"])
        )
        return 200, tenant.to_dict()

    async def _tenants_update(self, call: Call) -> tuple[int, dict[str, Any]]:
        """Rename (``name``) and/or choose the models (``models``: a list, or null for all)."""
        body = call.body()
        unknown = sorted(set(body) - {"name", "models"})
        if unknown or not body:
            raise ApiError(400, "give name and/or models (a list of names, or null for all)")
        name, models = body.get("name"), body.get("models")
        if "name" in body and not isinstance(name, str):
            raise ApiError(400, "name must be a string", param="name")
        if models is not None and not (
            isinstance(models, list) and all(isinstance(m, str) for m in models)
        ):
            raise ApiError(400, "models must be a list of model names, or null", param="models")

        def update(db: Database) -> Tenant:
            store = TenantStore(db, actor=call.actor)
            tenant = self._tenant(store, call, call.params["tenant_id"])
            if isinstance(name, str) and name != tenant.name:
                tenant = store.rename_tenant(tenant.id, name)
            if "models" in body:
                tenant = store.set_models(tenant.id, models)
            return tenant

        return 200, (await self._run(update)).to_dict()

    async def _tenant_change(
        self, call: Call, change: Callable[[TenantStore, Tenant], Tenant]
    ) -> tuple[int, dict[str, Any]]:
        def apply(db: Database) -> Tenant:
            store = TenantStore(db, actor=call.actor)
            return change(store, self._tenant(store, call, call.params["tenant_id"]))

        return 200, (await self._run(apply)).to_dict()

    async def _tenants_archive(self, call: Call) -> tuple[int, dict[str, Any]]:
        return await self._tenant_change(call, lambda store, t: store.archive_tenant(t.id))

    async def _tenants_rotate_salt(self, call: Call) -> tuple[int, dict[str, Any]]:
        def rotate(store: TenantStore, t: Tenant) -> Tenant:
            store.rotate_salt(t.id)
            return store.get_tenant(t.id)

        return await self._tenant_change(call, rotate)

    async def _tenants_limits(self, call: Call) -> tuple[int, dict[str, Any]]:
        limits = _limits(call.body())
        return await self._tenant_change(call, lambda store, t: store.set_limits(t.id, limits))

    async def _keys_list(self, call: Call) -> tuple[int, dict[str, Any]]:
        limit, after = call.limit(), call.after()

        def read(db: Database) -> tuple[list[ApiKeyInfo], dict[str, float]]:
            store = TenantStore(db)
            tenant = self._tenant(store, call, call.params["tenant_id"])
            keys = store.list_keys(tenant.id, after_id=after, limit=limit + 1)
            return keys, last_used(db, [k.id for k in keys[:limit]])

        keys, used = await self._run(read)

        def show(k: ApiKeyInfo) -> dict[str, Any]:
            return {**k.to_dict(), "last_used_at": used.get(k.id)}

        return 200, page(keys, limit, show, "id")

    async def _keys_create(self, call: Call) -> tuple[int, dict[str, Any]]:
        priority = call.body().get("priority", DEFAULT_PRIORITY)
        if priority not in PRIORITIES:
            raise ApiError(
                400, f"priority must be one of: {', '.join(PRIORITIES)}", param="priority"
            )

        def create(db: Database) -> tuple[ApiKeyInfo, str]:
            store = TenantStore(db, actor=call.actor)
            tenant = self._tenant(store, call, call.params["tenant_id"])
            key_id, value = store.create_key(tenant.id, priority)
            return store.get_key(key_id), value

        info, value = await self._run(create)
        return 201, {**info.to_dict(), "value": value}  # shown this once

    async def _keys_get(self, call: Call) -> tuple[int, dict[str, Any]]:
        def read(db: Database) -> dict[str, Any]:
            key = self._key(TenantStore(db), call)
            return {**key.to_dict(), "last_used_at": last_used(db, [key.id]).get(key.id)}

        return 200, await self._run(read)

    async def _keys_revoke(self, call: Call) -> tuple[int, dict[str, Any]]:
        def revoke(db: Database) -> ApiKeyInfo:
            store = TenantStore(db, actor=call.actor)
            return store.revoke_key(self._key(store, call).id)

        return 200, (await self._run(revoke)).to_dict()

    async def _keys_rotate(self, call: Call) -> tuple[int, dict[str, Any]]:
        grace = call.body().get("grace_period_s", DEFAULT_GRACE_S)
        if (
            isinstance(grace, bool)
            or not isinstance(grace, int | float)
            or not math.isfinite(grace)
            or not 0 <= grace <= MAX_GRACE_S
        ):
            raise ApiError(
                400,
                f"grace_period_s must be seconds from 0 to {MAX_GRACE_S:.0f}",
                param="grace_period_s",
            )

        def rotate(db: Database) -> tuple[ApiKeyInfo, ApiKeyInfo, str]:
            store = TenantStore(db, actor=call.actor)
            old, new_id, value = store.rotate_key(self._key(store, call).id, float(grace))
            return old, store.get_key(new_id), value

        old, new, value = await self._run(rotate)
        return 201, {**new.to_dict(), "value": value, "replaces": old.to_dict()}

    async def _keys_limits(self, call: Call) -> tuple[int, dict[str, Any]]:
        limits = _limits(call.body())

        def apply(db: Database) -> ApiKeyInfo:
            store = TenantStore(db, actor=call.actor)
            return store.set_key_limits(self._key(store, call).id, limits)

        return 200, (await self._run(apply)).to_dict()

    async def _audit_logs_list(self, call: Call) -> tuple[int, dict[str, Any]]:
        limit, after = call.limit(), call.after()
        if after and not after.isdigit():
            raise ApiError(400, "after must be an id from a previous page", param="after")
        entries = await self._run(
            lambda db: audit.list_entries(
                db, after_seq=int(after or 0), limit=limit + 1, tenant_id=call.pinned
            )
        )
        return 200, page(entries, limit, audit.AuditEntry.to_dict, "id")

    async def _admin_tokens_list(self, call: Call) -> tuple[int, dict[str, Any]]:
        limit, after = call.limit(), call.after()
        tokens = await self._run(
            lambda db: AdminTokens(db).list(after_id=after, limit=limit + 1, tenant_id=call.pinned)
        )
        return 200, page(tokens, limit, lambda t: t.to_dict(), "id")

    async def _admin_tokens_create(self, call: Call) -> tuple[int, dict[str, Any]]:
        body = call.body()
        try:
            wanted = scopes.parse_scopes(body.get("scopes", ""))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="scopes") from None
        tenant_ref = body.get("tenant_id", call.pinned)
        if tenant_ref is not None and not isinstance(tenant_ref, str):
            raise ApiError(400, "tenant_id must be a tenant's id, or null", param="tenant_id")

        def create(db: Database) -> tuple[str, str]:
            tenant_id = None
            if tenant_ref is not None:
                tenant_id = self._tenant(TenantStore(db), call, tenant_ref).id
            p = call.principal
            refused = scopes.may_mint(p.scopes, p.tenant_id, wanted, tenant_id)
            if refused is not None:
                raise ApiError(403, refused, code="scope_escalation")
            return AdminTokens(db, call.actor).create(wanted, tenant_id)

        token_id, value = await self._run(create)
        info = await self._run(lambda db: AdminTokens(db).get(token_id))
        return 201, {**info.to_dict(), "value": value}  # shown this once

    async def _admin_tokens_revoke(self, call: Call) -> tuple[int, dict[str, Any]]:
        def revoke(db: Database) -> dict[str, Any]:
            tokens = AdminTokens(db, call.actor)
            token_id = call.params["token_id"]
            info = visible(call, "admin token", lambda: tokens.get(token_id), lambda t: t.tenant_id)
            return tokens.revoke(info.id).to_dict()

        return 200, await self._run(revoke)

    async def _usage_completions(self, call: Call) -> tuple[int, dict[str, Any]]:
        return await self._usage_query(usage.usage_completions, call)

    async def _costs(self, call: Call) -> tuple[int, dict[str, Any]]:
        return await self._usage_query(usage.costs, call)

    async def _usage_completions_csv(self, call: Call) -> Response:
        """Every bucket of the range as CSV (usage.usage_csv), streamed. The query is
        checked first: a bad parameter is a 400, not a stream cut short."""
        reader, query = self._usage_reader(), call.args()
        usage.parse_query(query, call.pinned)
        disposition = (b"content-disposition", b'attachment; filename="saltgate-usage.csv"')
        return Response(200, [CSV, disposition], stream=usage.usage_csv(reader, query, call.pinned))

    async def _usage_reconcile(self, call: Call) -> tuple[int, dict[str, Any]]:
        """Rollups against the ledger; a pinned token reconciles only its tenant's rows."""
        return await self._usage_query(usage.reconcile, call)

    def _usage_reader(self) -> UsageReader:
        if self.usage is None:
            raise ApiError(501, "usage is not served by this listener", code="not_implemented")
        return self.usage

    async def _usage_query(
        self,
        query: Callable[
            [UsageReader, dict[str, str], str | None], Awaitable[tuple[int, dict[str, Any]]]
        ],
        call: Call,
    ) -> tuple[int, dict[str, Any]]:
        """A usage or costs page; a pinned token reads only its tenant's."""
        return await query(self._usage_reader(), call.args(), call.pinned)

    async def _prices_list(self, call: Call) -> tuple[int, dict[str, Any]]:
        """Every priced model's price in effect: the store's over the config's."""
        stored = await self._run(lambda db: PriceStore(db).stored())
        shown = [p.to_dict() for p in effective_prices(self.prices, stored)]
        return 200, {"object": "list", "data": shown, "has_more": False}

    @staticmethod
    def _unpinned(call: Call) -> None:
        """Prices are every tenant's: a token pinned to one cannot change them."""
        if call.pinned is not None:
            raise ApiError(403, "a token pinned to a tenant cannot change prices")

    async def _prices_set(self, call: Call) -> tuple[int, dict[str, Any]]:
        """Set a model's price in the store, over the config's; the gateways bill with it
        within a second."""
        self._unpinned(call)
        try:
            price = price_from_fields(call.body())
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        model = call.params["model"]
        changed = await self._run(lambda db: PriceStore(db, call.actor).set(model, price))
        return 200, changed.to_dict()

    async def _prices_clear(self, call: Call) -> tuple[int, dict[str, Any]]:
        """Delete a model's store price: the config's applies again (or none). The answer
        is the price deleted and the one now in effect (null: the model is unpriced)."""
        self._unpinned(call)
        model = call.params["model"]
        deleted = await self._run(lambda db: PriceStore(db, call.actor).clear(model))
        now = next((p for p in effective_prices(self.prices, {}) if p.version.model == model), None)
        effective = None if now is None else now.to_dict()
        return 200, {**deleted.to_dict(), "deleted": True, "effective": effective}
