"""The admin API driven from its OpenAPI document (docs/admin-openapi.json) with hostile
input, over real HTTP on a real gateway: no answer is a 5xx (but 501, usage not served),
every status is one the document lists, and a token pinned to alice never sees a byte of
bob's. Deterministic and bounded: a fixed list of hostile values per body field and query
parameter (schemathesis would draw them; this is the same idea without the dependency)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.admin.test_admin_api import Admin, admin_stack
from tests.admin.test_openapi import REPO_COPY
from tests.gateway.stack import MODEL, run

from saltgate.admin import api
from saltgate.admin.scopes import PREFIX, SCOPES

HOSTILE: list[Any] = [
    None,
    True,
    -1,
    0,
    5e-324,
    1e308,
    2**64,
    1.5,
    "",
    "\x1b[2J\u202e",
    "x" * 3000,
    "../../etc",
    [],
    ["\x00"],
    {},
    {"a": {"b": []}},
]
QUERY_HOSTILE = ["", "-1", "0", "1e400", "99999999999999999999", "\x00", "x" * 300, "page_AAAA"]


def bodies(operation: dict[str, Any]) -> list[Any]:
    """Bodies for one operation: nothing, not an object, then each documented field (and
    one unknown) set to each hostile value."""
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    schema = schema.get("schema", {})
    if "$ref" in schema:
        ref = schema["$ref"].rsplit("/", 1)[-1]
        schema = json.loads(REPO_COPY.read_text())["components"]["schemas"][ref]
    fields = [*schema.get("properties", {}), "unknown_field"]
    return [None, [1], "x", *({f: v} for f in fields for v in HOSTILE)]


def queries(operation: dict[str, Any]) -> list[dict[str, str]]:
    names = [p["name"] for p in operation.get("parameters", []) if p["in"] == "query"]
    base = {"start_time": "0"} if "start_time" in names else {}
    return [{}, *({**base, n: v} for n in names for v in QUERY_HOSTILE)]


async def fuzz(admin: Admin, only: set[str] | None = None) -> list[str]:
    """Every operation with every hostile body and query, as the root token and as a
    token pinned to alice; the problems found."""
    ids = admin.ids()
    pinned = admin.mint(set(SCOPES), "alice")
    document = json.loads(REPO_COPY.read_text())
    values = {
        "tenant_id": ids["alice"],
        "key_id": ids["alice_key"],
        "token_id": "adm_000000000000",
        "model": MODEL,
    }
    secret_of_bob = (ids["bob"], ids["bob_key"])
    problems = []
    async with admin.client(None) as c:
        for path, methods in document["paths"].items():
            for method, operation in methods.items():
                if only is not None and operation["operationId"] not in only:
                    continue
                listed = {int(s) for s in operation["responses"]} | {501}
                url = path.format(**values)
                cases: list[tuple[Any, dict[str, str]]] = [(b, {}) for b in bodies(operation)] + [
                    (None, q) for q in queries(operation)
                ]
                for body, query in cases:
                    for who, token in (("root", admin.root), ("pinned", pinned)):
                        content = b"" if body is None else json.dumps(body).encode()
                        r = await c.request(
                            method.upper(),
                            url,
                            params=query,
                            content=content,
                            headers={"authorization": f"Bearer {token}"},
                        )
                        where = f"{method.upper()} {url} {who} {body!r:.60} {query!r:.60}"
                        if r.status_code >= 500 and r.status_code != 501:
                            problems.append(f"{where}: {r.status_code} {r.text[:200]}")
                        elif r.status_code not in listed:
                            problems.append(f"{where}: {r.status_code} is not documented")
                        if who == "pinned" and any(s in r.text for s in secret_of_bob):
                            problems.append(f"{where}: bob's id in a pinned answer")
    assert PREFIX  # the document's paths are absolute
    return problems


def test_hostile_input_never_breaks_the_admin_api(tmp_path: Path) -> None:
    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            assert await fuzz(admin) == []

    run(go)


def test_the_fuzz_finds_a_handler_that_breaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positive control: limits whose parser fails unexpectedly (a 500) are found."""

    def broken(body: object) -> None:
        raise TypeError("unexpected")

    monkeypatch.setattr(api, "parse_limits", broken)

    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            problems = await fuzz(admin, only={"keys_limits"})
            assert problems and all(": 500 " in p for p in problems), problems[:3]

    run(go)
