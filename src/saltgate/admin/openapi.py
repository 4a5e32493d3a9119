"""The admin API's OpenAPI 3.1 document, built from the route table (pure).

Every row of saltgate.admin.scopes.ROUTES is one operation here, named by the row (its
``operationId``) and carrying its scope (``x-saltgate-scope``); what only a person can say
(a summary, the body, the answer) is in OPERATIONS, one entry per row: a route added
without one fails at import. The document is served at ``GET /admin/v1/openapi.json`` and
kept in the repository as docs/admin-openapi.json (a test holds the two equal;
``python -m saltgate.admin.openapi > docs/admin-openapi.json`` writes it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final

from saltgate.admin.scopes import PREFIX, ROUTES, SCOPES, Route
from saltgate.governance.kinds import BANDS

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: tuple[str, ...], **properties: Schema) -> Schema:
    return {"type": "object", "required": list(required), "properties": properties}


_STR: Final[Schema] = {"type": "string"}
_INT: Final[Schema] = {"type": "integer"}
_NUM: Final[Schema] = {"type": "number"}
_BOOL: Final[Schema] = {"type": "boolean"}
_TIME: Final[Schema] = {"type": ["number", "null"], "description": "Unix seconds"}
_NULLABLE_STR: Final[Schema] = {"type": ["string", "null"]}
_ANY_OBJECT: Final[Schema] = {"type": "object"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


_LIMITS: Final[Schema] = {
    "type": "object",
    "description": "Each limit from 0 to its bound (docs/admin-api.md). budget_usd and "
    "budget_period are accepted instead of budget_micro_usd and budget_period_s. {} clears "
    "them.",
    "additionalProperties": False,
    "properties": {
        "rpm": {"type": "integer", "minimum": 0, "maximum": 10**9},
        "input_tpm": {"type": "integer", "minimum": 0, "maximum": 10**12},
        "output_tpm": {"type": "integer", "minimum": 0, "maximum": 10**12},
        "concurrency": {"type": "integer", "minimum": 0, "maximum": 10**6},
        "budget_micro_usd": {"type": "integer", "minimum": 0, "maximum": 10**15},
        "budget_period_s": {"type": "integer", "minimum": 1, "maximum": 366 * 86400},
        "budget_usd": {"type": ["number", "string"]},
        "budget_period": {"type": ["integer", "string"]},
    },
}

# A JSON merge patch of limits: a value sets one, null clears its kind, absent keeps it.
_LIMITS_PATCH: Final[Schema] = {
    "type": "object",
    "description": "Limits to set (as in Limits) or to clear (null; a null budget_usd, "
    "budget_period or budget_* clears the budget); the others are kept.",
    "additionalProperties": False,
    "properties": {
        name: {"anyOf": [schema, {"type": "null"}]}
        for name, schema in _LIMITS["properties"].items()
    },
}

# A tenant's fair-share weight (docs/fairness.md): a tenant field, also taken beside its
# limits in their bodies, as before it was stored apart; null there: back to 1.
_WEIGHT: Final[Schema] = {"type": "number", "minimum": 0.01, "maximum": 100}
_BANDS: Final = [band.value for band in BANDS]  # a key's priority


def _with_weight(limits: Schema, description: str) -> Schema:
    properties = {**limits["properties"], "weight": _nullable(_WEIGHT)}
    return {**limits, "description": description, "properties": properties}


_TENANT_LIMITS: Final = _with_weight(
    _LIMITS,
    f"{_LIMITS['description']} A weight given sets the tenant's fair-share weight (from "
    "0.01 to 100; null: 1); absent, it is kept.",
)
_TENANT_LIMITS_PATCH: Final = _with_weight(
    _LIMITS_PATCH,
    f"{_LIMITS_PATCH['description']} A weight sets the tenant's fair-share weight (null: 1).",
)

SCHEMAS: Final[dict[str, Schema]] = {
    "Error": _object(
        ("error",),
        error=_object(
            ("message", "type"),
            message=_STR,
            type=_STR,
            param=_NULLABLE_STR,
            code=_NULLABLE_STR,
        ),
    ),
    "Limits": _LIMITS,
    "LimitsPatch": _LIMITS_PATCH,
    "TenantLimits": _TENANT_LIMITS,
    "TenantLimitsPatch": _TENANT_LIMITS_PATCH,
    "Me": _object(
        ("object", "id", "scopes", "tenant_id"),
        object=_STR,
        id=_STR,
        scopes={"type": "array", "items": {"enum": list(SCOPES)}},
        tenant_id=_NULLABLE_STR,
    ),
    "Tenant": _object(
        (
            "object",
            "id",
            "name",
            "epoch",
            "created_at",
            "models",
            "limits",
            "weight",
            "archived_at",
        ),
        object={"const": "tenant"},
        id=_STR,
        name=_STR,
        epoch=_INT,
        created_at=_NUM,
        models=_nullable({"type": "array", "items": _STR}),
        limits=_nullable(_ref("Limits")),
        weight=_WEIGHT,
        archived_at=_TIME,
    ),
    "ApiKey": _object(
        ("object", "id", "tenant_id", "redacted_value", "created_at", "revoked_at"),
        object={"const": "api_key"},
        id=_STR,
        tenant_id=_STR,
        redacted_value=_STR,
        created_at=_NUM,
        revoked_at=_TIME,
        expires_at=_TIME,
        priority={"enum": _BANDS},
        limits=_nullable(_ref("Limits")),
        last_used_at=_TIME,
        value={"type": "string", "description": "the key, in the answer that mints it only"},
        replaces={"$ref": "#/components/schemas/ApiKey"},
    ),
    "AdminToken": _object(
        ("object", "id", "redacted_value", "scopes", "tenant_id", "created_at"),
        object={"const": "admin_token"},
        id=_STR,
        redacted_value=_STR,
        scopes={"type": "array", "items": {"enum": list(SCOPES)}},
        tenant_id=_NULLABLE_STR,
        created_at=_NUM,
        created_by=_STR,
        last_used_at=_TIME,
        revoked_at=_TIME,
        value={"type": "string", "description": "the token, in the answer that mints it only"},
    ),
    "AuditEntry": _object(
        ("object", "id", "effective_at", "actor", "type", "resource_type", "resource_id"),
        object={"const": "audit_log"},
        id=_INT,
        effective_at=_NUM,
        actor=_STR,
        type=_STR,
        resource_type=_STR,
        resource_id=_STR,
        tenant_id=_NULLABLE_STR,
        before=_nullable(_ANY_OBJECT),
        after=_nullable(_ANY_OBJECT),
        request_id=_NULLABLE_STR,
        hash=_STR,
    ),
    "ModelPrice": _object(
        ("object", "model", "input_per_mtok", "cached_input_per_mtok", "output_per_mtok"),
        object={"const": "model_price"},
        model=_STR,
        input_per_mtok=_STR,
        cached_input_per_mtok=_STR,
        output_per_mtok=_STR,
        version=_STR,
        source={"enum": ["config", "store"]},
        updated_at=_TIME,
        deleted=_BOOL,
        effective=_nullable({"$ref": "#/components/schemas/ModelPrice"}),
    ),
    "UsagePage": _object(
        ("object", "data", "has_more"),
        object={"const": "page"},
        data={"type": "array", "items": _ANY_OBJECT},
        has_more=_BOOL,
        next_page=_NULLABLE_STR,
    ),
    "Reconcile": _object(
        ("object", "ok"), object={"const": "usage.reconcile"}, ok=_BOOL, ledger=_ANY_OBJECT
    ),
}


def _list_of(item: str) -> Schema:
    return _object(
        ("object", "data", "has_more"),
        object={"const": "list"},
        data={"type": "array", "items": _ref(item)},
        first_id=_NULLABLE_STR,
        last_id=_NULLABLE_STR,
        has_more=_BOOL,
    )


@dataclass(frozen=True, slots=True)
class Operation:
    """What the route table cannot say: a summary, the body taken, the answer given."""

    summary: str
    answer: Schema
    status: int = 200
    body: Schema | None = None
    query: tuple[str, ...] = ()  # query parameters, by name


_PAGED: Final = ("limit", "after")
_USAGE: Final = (
    "start_time",
    "end_time",
    "bucket_width",
    "limit",
    "group_by",
    "tenant_ids",
    "api_key_ids",
    "models",
    "replicas",
    "top",
    "page",
)

OPERATIONS: Final[dict[str, Operation]] = {
    "me": Operation("The calling token's id, scopes and pinned tenant", _ref("Me")),
    "openapi": Operation("This document", _ANY_OBJECT),
    "tenants_list": Operation(
        "Tenants (a pinned token: its own)", _list_of("Tenant"), query=_PAGED
    ),
    "tenants_create": Operation(
        "Create a tenant (not with a pinned token)",
        _ref("Tenant"),
        201,
        _object(("name",), name=_STR),
    ),
    "tenants_get": Operation("A tenant, by id or name", _ref("Tenant")),
    "tenants_update": Operation(
        "Rename a tenant, choose its models, set its fair-share weight (not with a pinned token)",
        _ref("Tenant"),
        body={
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "properties": {
                "name": _STR,
                "models": _nullable(
                    {"type": "array", "items": {"pattern": "^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"}}
                ),
                "weight": _nullable(_WEIGHT),
            },
        },
    ),
    "tenants_archive": Operation(
        "Archive a tenant: its keys and pinned tokens stop", _ref("Tenant")
    ),
    "tenants_rotate_salt": Operation("A fresh cache namespace for a tenant", _ref("Tenant")),
    "tenants_limits": Operation(
        "Replace a tenant's limits and budget, set its weight if given (not with a pinned token)",
        _ref("Tenant"),
        body=_ref("TenantLimits"),
    ),
    "tenants_limits_edit": Operation(
        "Edit a tenant's limits, budget and weight: set those given, clear those null, keep "
        "the others (not with a pinned token)",
        _ref("Tenant"),
        body=_ref("TenantLimitsPatch"),
    ),
    "keys_list": Operation("A tenant's API keys", _list_of("ApiKey"), query=_PAGED),
    "keys_create": Operation(
        "Mint an API key (its value is in this answer only)",
        _ref("ApiKey"),
        201,
        {"type": "object", "properties": {"priority": {"enum": _BANDS}}},
    ),
    "keys_get": Operation("An API key's metadata", _ref("ApiKey")),
    "keys_revoke": Operation("Revoke an API key", _ref("ApiKey")),
    "keys_rotate": Operation(
        "Mint a key's successor; the old one works for grace_period_s",
        _ref("ApiKey"),
        201,
        {
            "type": "object",
            "properties": {"grace_period_s": {"type": "number", "minimum": 0, "maximum": 2592000}},
        },
    ),
    "keys_limits": Operation("Replace a key's own limits", _ref("ApiKey"), body=_ref("Limits")),
    "keys_limits_edit": Operation(
        "Edit a key's own limits: set those given, clear those null, keep the others",
        _ref("ApiKey"),
        body=_ref("LimitsPatch"),
    ),
    "audit_logs_list": Operation("The audit log", _list_of("AuditEntry"), query=_PAGED),
    "admin_tokens_list": Operation("Admin tokens", _list_of("AdminToken"), query=_PAGED),
    "admin_tokens_create": Operation(
        "Mint an admin token within the caller's scopes and pin",
        _ref("AdminToken"),
        201,
        {
            "type": "object",
            "required": ["scopes"],
            "properties": {
                "scopes": {
                    "anyOf": [
                        {"type": "string"},
                        {"type": "array", "items": {"enum": [*SCOPES, "all"]}},
                    ]
                },
                "tenant_id": _NULLABLE_STR,
            },
        },
    ),
    "admin_tokens_revoke": Operation(
        "Revoke an admin token whose scopes are within the caller's", _ref("AdminToken")
    ),
    "usage_completions": Operation(
        "Usage buckets, in OpenAI's Usage API shape", _ref("UsagePage"), query=_USAGE
    ),
    "usage_completions_csv": Operation(
        "Every bucket of a usage range as CSV (at most 8,784 buckets)",
        {"type": "string", "contentMediaType": "text/csv"},
        query=_USAGE,
    ),
    "usage_reconcile": Operation("The rollups against the ledger", _ref("Reconcile")),
    "costs": Operation(
        "Cost buckets, in OpenAI's Costs API shape", _ref("UsagePage"), query=_USAGE
    ),
    "prices_list": Operation("Every priced model's price in effect", _list_of("ModelPrice")),
    "prices_set": Operation(
        "Set a model's price in the store (not with a pinned token)",
        _ref("ModelPrice"),
        body=_object(
            ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok"),
            input_per_mtok={"type": ["number", "string"]},
            cached_input_per_mtok={"type": ["number", "string"]},
            output_per_mtok={"type": ["number", "string"]},
        ),
    ),
    "prices_clear": Operation(
        "Delete a model's store price (not with a pinned token)", _ref("ModelPrice")
    ),
}

_missing = {r.name for r in ROUTES} ^ set(OPERATIONS)
assert not _missing, f"routes and OpenAPI operations differ: {sorted(_missing)}"

_ERRORS: Final = {
    "400": "bad input",
    "401": "no admin token, or an unknown, revoked or inference key",
    "403": "a missing scope, escalation, or a pinned token changing what the operator sets",
    "404": "no such object (to a pinned token, another tenant's too)",
    "409": "already exists, already revoked, or an archived tenant",
}


def _path(route: Route) -> tuple[str, list[Schema]]:
    """The route's OpenAPI path and its path parameters."""
    names = re.findall(r"\{(\w+)\+?\}", route.pattern)
    path = PREFIX + re.sub(r"\{(\w+)\+\}", r"{\1}", route.pattern)
    params = [{"name": n, "in": "path", "required": True, "schema": _STR} for n in names]
    return path, params


def _operation(route: Route) -> Schema:
    op = OPERATIONS[route.name]
    _, params = _path(route)
    params += [{"name": q, "in": "query", "schema": _STR} for q in op.query]
    media = "text/csv" if route.name == "usage_completions_csv" else "application/json"
    responses: Schema = {
        str(op.status): {"description": "OK", "content": {media: {"schema": op.answer}}},
        **{
            status: {
                "description": why,
                "content": {"application/json": {"schema": _ref("Error")}},
            }
            for status, why in _ERRORS.items()
        },
    }
    shown: Schema = {
        "operationId": route.name,
        "summary": op.summary,
        "x-saltgate-scope": route.scope,
        "security": [{"adminToken": []}],
        "responses": responses,
    }
    if params:
        shown["parameters"] = params
    if op.body is not None:
        shown["requestBody"] = {
            "required": False,
            "content": {"application/json": {"schema": op.body}},
        }
    return shown


def document() -> Schema:
    """The admin API's OpenAPI document."""
    paths: dict[str, Schema] = {}
    for route in ROUTES:
        path, _ = _path(route)
        paths.setdefault(path, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "saltgate admin API",
            "version": "1",
            "description": "The admin plane on the admin listener (docs/admin-api.md). Each "
            "operation needs an admin token holding its x-saltgate-scope (null: any token).",
        },
        "paths": paths,
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}},
        },
    }


def render() -> str:
    """The document as kept in docs/admin-openapi.json."""
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
