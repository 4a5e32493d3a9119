"""The admin API under /admin/v1/, on the admin listener only (docs/admin-api.md): the
HTTP front end of saltgate.admin.service.

Each request: match a row of saltgate.admin.scopes.ROUTES (404, 405), authenticate the
bearer admin token (401; inference API keys are not admin tokens), check the route's
scope (403), parse the body and query (400), then call the service's operation of the
same name, which checks the scope and the pinning, runs on the store's thread and audits
every change with the token's id and the request id, and show the records it returns.
Every error is in OpenAI's shape; none is a 500.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import orjson

from saltgate.admin import scopes
from saltgate.admin.service import (
    MAX_GRACE_S,
    AdminService,
    Caller,
    Page,
    TenantChange,
    store_status,
)
from saltgate.admin.store import AdminStore
from saltgate.admin.tokens import AdminPrincipal, authenticate_admin
from saltgate.governance.kinds import BANDS, DEFAULT_BAND
from saltgate.governance.limits import (
    LimitError,
    Limits,
    LimitsEdit,
    json_limits_edit,
    parse_limits,
)
from saltgate.governance.weight import WEIGHT, split_weight
from saltgate.http import Request, Response
from saltgate.policy.errors import ApiError
from saltgate.prices import Price, price_from_fields
from saltgate.store.errors import StoreError
from saltgate.store.ledger import new_request_id
from saltgate.store.usage_rollups import UsageReader

JSON = (b"content-type", b"application/json")
CSV = (b"content-type", b"text/csv; charset=utf-8")
CSV_DISPOSITION = (b"content-disposition", b'attachment; filename="saltgate-usage.csv"')
ADMIN_PATH = "/admin"
DEFAULT_LIMIT = 20
MAX_LIMIT = 100
DEFAULT_GRACE_S = 86400.0  # a rotated key's old value works for a day unless told
MAX_BODY_BYTES = 64 * 1024
MAX_SEQ = 2**63 - 1  # the largest audit entry id a store can hold (SQLite and PostgreSQL)


@dataclass
class Call:
    """One authenticated call: who, the path's parameters, the query, the body."""

    caller: Caller
    params: dict[str, str]
    query: dict[str, list[str]]
    raw_body: bytes
    _body: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def tenant(self) -> str:
        return self.params["tenant_id"]

    @property
    def key(self) -> str:
        return self.params["key_id"]

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
JsonAnswer = tuple[int, dict[str, Any]]
Answer = JsonAnswer | Response
Handler = Callable[[Call], Awaitable[Answer]]


def page(found: Page[Any], last: str) -> dict[str, Any]:
    """A list in OpenAI's shape, each record as its `to_dict` shows it."""
    shown = [dict(item.to_dict()) for item in found.items]
    return {
        "object": "list",
        "data": shown,
        "first_id": str(shown[0][last]) if shown else None,
        "last_id": str(shown[-1][last]) if shown else None,
        "has_more": found.has_more,
    }


def _limits(body: dict[str, Any], *, tenant: bool) -> tuple[Limits | None, float | None]:
    """Limits from a JSON body (parse_limits: the stored field names, or budget_usd and
    budget_period; an empty object clears them), and a tenant's ``weight`` beside them
    (split_weight: absent, kept; null, 1)."""
    try:
        given, weight = split_weight(body, tenant=tenant)
        return parse_limits(given), weight
    except LimitError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None


def _limits_edit(body: dict[str, Any], *, tenant: bool) -> tuple[LimitsEdit, float | None]:
    """An edit from a JSON merge patch (json_limits_edit), and a tenant's weight as
    `_limits` takes it."""
    try:
        given, weight = split_weight(body, tenant=tenant)
        return json_limits_edit(given), weight
    except LimitError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None


class AdminApi:
    """`handle` answers /admin/... requests (None for any other path): the HTTP front end
    of saltgate.admin.service, which holds every rule."""

    def __init__(
        self,
        store: AdminStore,
        usage: UsageReader | None = None,
        prices: Mapping[str, Price] | None = None,
    ) -> None:
        self.store = store
        self.service = AdminService(store, usage, prices)
        self._handlers: dict[str, Handler] = {
            "me": self._me,
            "openapi": self._openapi,
            "tenants_list": self._tenants_list,
            "tenants_create": self._tenants_create,
            "tenants_get": self._tenants_get,
            "tenants_update": self._tenants_update,
            "tenants_archive": self._tenants_archive,
            "tenants_rotate_salt": self._tenants_rotate_salt,
            "tenants_limits": self._tenants_limits,
            "tenants_limits_edit": self._tenants_limits_edit,
            "keys_list": self._keys_list,
            "keys_create": self._keys_create,
            "keys_get": self._keys_get,
            "keys_revoke": self._keys_revoke,
            "keys_rotate": self._keys_rotate,
            "keys_limits": self._keys_limits,
            "keys_limits_edit": self._keys_limits_edit,
            "audit_logs_list": self._audit_logs_list,
            "admin_tokens_list": self._admin_tokens_list,
            "admin_tokens_create": self._admin_tokens_create,
            "admin_tokens_revoke": self._admin_tokens_revoke,
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
            status = store_status(error)
            response = Response(status, [JSON], ApiError(status, str(error)).body())
        response.headers.append((b"x-request-id", request_id.encode()))
        return response

    async def _handle(self, request: Request, path: str, request_id: str) -> Answer:
        method = request.method.decode("ascii", "replace")
        found = scopes.match(method, path)
        if found is None:
            raise ApiError(404, "no such admin route", code="not_found")
        principal = await self._authenticate(request)
        if found.route is None:
            allow = ", ".join(sorted(found.allowed)).encode()
            raise ApiError(405, f"use {allow.decode()} here", headers=[(b"allow", allow)])
        caller = Caller.of(principal, request_id)
        # The service checks again in each operation; checked here first so that a token
        # lacking the scope learns nothing from the body's validation (403 before 400).
        self.service.authorize(caller, found.route.name)
        if len(request.body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
        query = parse_qs(request.query.decode("utf-8", "replace"), keep_blank_values=True)
        call = Call(caller, found.params, query, request.body)
        return await self._handlers[found.route.name](call)

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

    # -- handlers: parse, call the service, show ------------------------------------------

    async def _me(self, call: Call) -> JsonAnswer:
        me = await self.service.me(call.caller)
        return 200, {
            "object": "admin_token",
            "id": me.token_id,
            "scopes": sorted(me.scopes),
            "tenant_id": me.pinned,
        }

    async def _openapi(self, call: Call) -> JsonAnswer:
        return 200, await self.service.openapi(call.caller)

    async def _tenants_list(self, call: Call) -> JsonAnswer:
        found = await self.service.tenants_list(call.caller, after=call.after(), limit=call.limit())
        return 200, page(found, "id")

    async def _tenants_create(self, call: Call) -> JsonAnswer:
        name = call.body().get("name")
        if not isinstance(name, str):
            raise ApiError(400, 'give the tenant\'s name: {"name": "..."}', param="name")
        return 201, (await self.service.tenants_create(call.caller, name)).to_dict()

    async def _tenants_get(self, call: Call) -> JsonAnswer:
        return 200, (await self.service.tenants_get(call.caller, call.tenant)).to_dict()

    async def _tenants_update(self, call: Call) -> JsonAnswer:
        """Rename (``name``), choose the models (``models``: a list, or null for all), set
        the fair-share ``weight`` (null: 1); any of them."""
        body = call.body()
        unknown = sorted(set(body) - {"name", "models", WEIGHT})
        if unknown or not body:
            raise ApiError(
                400, "give name, models (a list of names, or null for all) and/or weight"
            )
        name, models = body.get("name"), body.get("models")
        if "name" in body and not isinstance(name, str):
            raise ApiError(400, "name must be a string", param="name")
        if models is not None and not (
            isinstance(models, list) and all(isinstance(m, str) for m in models)
        ):
            raise ApiError(400, "models must be a list of model names, or null", param="models")
        try:
            _, weight = split_weight(body, tenant=True)
        except LimitError as exc:
            raise ApiError(400, str(exc), param=exc.field) from None
        change = TenantChange(
            name, "models" in body, None if models is None else tuple(models), weight
        )
        return 200, (await self.service.tenants_update(call.caller, call.tenant, change)).to_dict()

    async def _tenants_archive(self, call: Call) -> JsonAnswer:
        return 200, (await self.service.tenants_archive(call.caller, call.tenant)).to_dict()

    async def _tenants_rotate_salt(self, call: Call) -> JsonAnswer:
        return 200, (await self.service.tenants_rotate_salt(call.caller, call.tenant)).to_dict()

    async def _tenants_limits(self, call: Call) -> JsonAnswer:
        limits, weight = _limits(call.body(), tenant=True)
        t = await self.service.tenants_limits(call.caller, call.tenant, limits, weight)
        return 200, t.to_dict()

    async def _tenants_limits_edit(self, call: Call) -> JsonAnswer:
        edit, weight = _limits_edit(call.body(), tenant=True)
        t = await self.service.tenants_limits(call.caller, call.tenant, edit, weight)
        return 200, t.to_dict()

    async def _keys_list(self, call: Call) -> JsonAnswer:
        found = await self.service.keys_list(
            call.caller, call.tenant, after=call.after(), limit=call.limit()
        )
        return 200, page(found, "id")

    async def _keys_create(self, call: Call) -> JsonAnswer:
        priority = call.body().get("priority", DEFAULT_BAND.value)
        if not isinstance(priority, str):
            raise ApiError(400, f"priority must be one of: {', '.join(BANDS)}", param="priority")
        return 201, (await self.service.keys_create(call.caller, call.tenant, priority)).to_dict()

    async def _keys_get(self, call: Call) -> JsonAnswer:
        return 200, (await self.service.keys_get(call.caller, call.key)).to_dict()

    async def _keys_revoke(self, call: Call) -> JsonAnswer:
        return 200, (await self.service.keys_revoke(call.caller, call.key)).to_dict()

    async def _keys_rotate(self, call: Call) -> JsonAnswer:
        grace = call.body().get("grace_period_s", DEFAULT_GRACE_S)
        if isinstance(grace, bool) or not isinstance(grace, int | float):
            raise ApiError(
                400,
                f"grace_period_s must be seconds from 0 to {MAX_GRACE_S:.0f}",
                param="grace_period_s",
            )
        rotated = await self.service.keys_rotate(call.caller, call.key, float(grace))
        return 201, rotated.to_dict()

    async def _keys_limits(self, call: Call) -> JsonAnswer:
        limits, _ = _limits(call.body(), tenant=False)
        return 200, (await self.service.keys_limits(call.caller, call.key, limits)).to_dict()

    async def _keys_limits_edit(self, call: Call) -> JsonAnswer:
        edit, _ = _limits_edit(call.body(), tenant=False)
        return 200, (await self.service.keys_limits(call.caller, call.key, edit)).to_dict()

    async def _audit_logs_list(self, call: Call) -> JsonAnswer:
        limit, after = call.limit(), call.after()
        if after and not (after.isdigit() and int(after) <= MAX_SEQ):
            raise ApiError(400, "after must be an id from a previous page", param="after")
        found = await self.service.audit_logs_list(
            call.caller, after_seq=int(after or 0), limit=limit
        )
        return 200, page(found, "id")

    async def _admin_tokens_list(self, call: Call) -> JsonAnswer:
        found = await self.service.admin_tokens_list(
            call.caller, after=call.after(), limit=call.limit()
        )
        return 200, page(found, "id")

    async def _admin_tokens_create(self, call: Call) -> JsonAnswer:
        body = call.body()
        try:
            wanted = scopes.parse_scopes(body.get("scopes", ""))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="scopes") from None
        tenant_ref = body.get("tenant_id", call.caller.pinned)
        if tenant_ref is not None and not isinstance(tenant_ref, str):
            raise ApiError(400, "tenant_id must be a tenant's id, or null", param="tenant_id")
        minted = await self.service.admin_tokens_create(call.caller, wanted, tenant_ref)
        return 201, minted.to_dict()

    async def _admin_tokens_revoke(self, call: Call) -> JsonAnswer:
        token_id = call.params["token_id"]
        return 200, (await self.service.admin_tokens_revoke(call.caller, token_id)).to_dict()

    async def _usage_completions(self, call: Call) -> JsonAnswer:
        return 200, await self.service.usage_completions(call.caller, call.args())

    async def _costs(self, call: Call) -> JsonAnswer:
        return 200, await self.service.costs(call.caller, call.args())

    async def _usage_completions_csv(self, call: Call) -> Response:
        stream = self.service.usage_completions_csv(call.caller, call.args())
        return Response(200, [CSV, CSV_DISPOSITION], stream=stream)

    async def _usage_reconcile(self, call: Call) -> JsonAnswer:
        return 200, await self.service.usage_reconcile(call.caller, call.args())

    async def _prices_list(self, call: Call) -> JsonAnswer:
        shown = [p.to_dict() for p in await self.service.prices_list(call.caller)]
        return 200, {"object": "list", "data": shown, "has_more": False}

    async def _prices_set(self, call: Call) -> JsonAnswer:
        try:
            price = price_from_fields(call.body())
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        changed = await self.service.prices_set(call.caller, call.params["model"], price)
        return 200, changed.to_dict()

    async def _prices_clear(self, call: Call) -> JsonAnswer:
        cleared = await self.service.prices_clear(call.caller, call.params["model"])
        return 200, cleared.to_dict()
