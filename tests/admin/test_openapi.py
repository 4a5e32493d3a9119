"""The admin API's OpenAPI document: one operation per route, kept in the repository as
docs/admin-openapi.json, served at /admin/v1/openapi.json, naming every field the API's
records show, and every path and method in it answered by the API."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from tests.admin.test_admin_api import admin_stack
from tests.gateway.stack import MODEL, run

from saltgate.admin import openapi
from saltgate.admin.scopes import PREFIX, ROUTES
from saltgate.admin.service import KeyView, NewAdminToken, NewKey, PriceCleared
from saltgate.governance.limits import Limits
from saltgate.prices import Price, PriceVersion
from saltgate.store.admin_tokens import AdminTokenInfo
from saltgate.store.audit import AuditEntry
from saltgate.store.model_prices import ModelPrice
from saltgate.store.tenants import ApiKeyInfo, Tenant, limits_dict

REPO_COPY = Path(__file__).parents[2] / "docs" / "admin-openapi.json"


def operations(document: dict[str, Any]) -> set[tuple[str, str, str, str | None]]:
    return {
        (method.upper(), path, op["operationId"], op["x-saltgate-scope"])
        for path, methods in document["paths"].items()
        for method, op in methods.items()
    }


@pytest.mark.unit
def test_one_operation_per_route_with_its_scope() -> None:
    routes = {(r.method, PREFIX + r.pattern.replace("+}", "}"), r.name, r.scope) for r in ROUTES}
    assert operations(openapi.document()) == routes


@pytest.mark.unit
def test_the_repository_copy_is_the_document() -> None:
    assert REPO_COPY.read_text() == openapi.render(), (
        "docs/admin-openapi.json is stale: python -m saltgate.admin.openapi > "
        "docs/admin-openapi.json"
    )


@pytest.mark.unit
def test_every_reference_resolves() -> None:
    text = openapi.render()
    names = set(re.findall(r'"#/components/schemas/(\w+)"', text))
    assert names and names <= set(openapi.SCHEMAS)


@pytest.mark.unit
def test_the_schemas_name_every_field_the_records_show() -> None:
    """A field added to a record and left out of the document fails here."""
    limits = Limits(rpm=1)
    key = ApiKeyInfo("key_1", "tn_1", 1.0, None, limits)
    token = AdminTokenInfo("adm_1", frozenset({"usage:read"}), None, 1.0, "cli:x", None, None)
    price = ModelPrice(PriceVersion.of(MODEL, Price(1.0, 0.5, 2.0)), "store", 1.0)
    shown = {
        "Tenant": [Tenant("tn_1", "a", 0, 1.0, ("m",), limits, weight=2.0).to_dict()],
        "ApiKey": [
            KeyView(key, 2.0).to_dict(),
            NewKey(key, "sg_x", replaces=key).to_dict(),
        ],
        "AdminToken": [NewAdminToken(token, "sgadm_x").to_dict()],
        "AuditEntry": [
            AuditEntry(
                1, 1.0, "cli:x", "a", "tenant", "tn_1", None, None, "{}", None, b"", b""
            ).to_dict()
        ],
        "ModelPrice": [PriceCleared(price, price).to_dict()],
        "Limits": [limits_dict(limits) or {}],
    }
    for schema, records in shown.items():
        named = set(openapi.SCHEMAS[schema]["properties"])
        for record in records:
            assert set(record) <= named, (schema, set(record) - named)
            assert set(openapi.SCHEMAS[schema].get("required", [])) <= set(record), schema


def test_the_api_serves_it_and_answers_every_path_in_it(tmp_path: Path) -> None:
    """Every path and method of the repository's document reaches an operation of the
    API (not "no such admin route", not 405), and the served document is that file.
    Positive control: a path the API does not have is told apart."""

    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            ids = admin.ids()
            served = await admin.call(admin.root, "GET", "openapi.json")
            assert served.status_code == 200 and served.json() == json.loads(REPO_COPY.read_text())
            assert (await admin.call(None, "GET", "openapi.json")).status_code == 401
            values = {
                "tenant_id": ids["alice"],
                "key_id": ids["alice_key"],
                "token_id": "adm_000000000000",
                "model": MODEL,
            }

            async def reaches(method: str, path: str) -> bool:
                relative = path.removeprefix(PREFIX).format(**values)
                r = await admin.call(admin.root, method, relative, {})
                unrouted = r.status_code == 404 and "admin route" in r.text
                return not unrouted and r.status_code != 405

            document = json.loads(REPO_COPY.read_text())
            missing = [
                (method, path)
                for path, methods in document["paths"].items()
                for method in methods
                if not await reaches(method.upper(), path)
            ]
            assert missing == []
            assert not await reaches("GET", PREFIX + "no_such_route")
            assert not await reaches("PATCH", PREFIX + "tenants/{tenant_id}")

    run(go)
