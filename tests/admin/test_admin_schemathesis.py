"""The admin API fuzzed by schemathesis from its OpenAPI document (docs/admin-openapi.json),
over real HTTP on a real gateway: for every operation, requests schemathesis draws from the
document (valid and invalid bodies, queries and headers), sent as the root token and as a
token pinned to alice, must get no 5xx (but 501, usage not served), only documented
statuses and content types, answers that match their documented schema, and the pinned
token never a byte of bob's. Complements test_admin_fuzz.py's fixed hostile values (the
ones findings were made of) with generated ones.

Bounded and deterministic: `derandomize` fixes Hypothesis's draws, EXAMPLES per operation
and caller (about 1,300 requests, 15-30 s: the one slow admin test, because a fuzz that
sends few requests proves little)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok
from tests.admin.test_admin_api import admin_stack
from tests.admin.test_openapi import REPO_COPY
from tests.gateway.stack import MODEL, run

from saltgate.admin import api
from saltgate.admin.scopes import SCOPES

EXAMPLES = 40
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

pytestmark = pytest.mark.timeout(300)


@dataclass
class Fuzz:
    """One run: where to send, as whom, the real ids for path parameters, the strings a
    pinned answer must not hold; what it found (collected, not raised, so that every
    operation gets its examples and the test says everything wrong at once)."""

    base_url: str
    callers: dict[str, str]
    values: dict[str, str]
    forbidden: tuple[str, ...]
    problems: list[str] = field(default_factory=list)
    sent: int = 0

    def run(self, only: set[str] | None = None) -> None:
        schema = schemathesis.openapi.from_path(str(REPO_COPY))
        for result in schema.get_all_operations():
            if not isinstance(result, Ok):  # the document itself is wrong: say where
                raise result.err()
            operation = result.ok()
            if only is None or operation.definition.raw["operationId"] in only:
                self.operation(operation)

    def operation(self, operation: Any) -> None:
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(), who=st.sampled_from(sorted(self.callers)))
        def check(case: Any, who: str) -> None:
            self.case(case, who)

        check()

    def case(self, case: Any, who: str) -> None:
        # The real ids, so that drawn bodies and queries reach the handler, not a 404.
        case.path_parameters = {k: self.values.get(k, v) for k, v in case.path_parameters.items()}
        headers = {"authorization": f"Bearer {self.callers[who]}"}
        response = case.call(base_url=self.base_url, headers=headers, timeout=30)
        self.sent += 1
        where = f"{case.method} {case.formatted_path} as {who}"
        if response.status_code == 501:  # usage not served by this stack
            return
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (FailureGroup, AssertionError) as failure:
            self.problems.append(f"{where}: {type(failure).__name__}: {str(failure)[:300]}")
        if who == "pinned" and any(s in response.text for s in self.forbidden):
            self.problems.append(f"{where}: bob's id in a pinned answer")


def fuzz(tmp_path: Path, only: set[str] | None = None) -> Fuzz:
    found: list[Fuzz] = []

    async def go() -> None:
        async with admin_stack(tmp_path) as admin:
            ids = admin.ids()
            callers = {"root": admin.root, "pinned": admin.mint(set(SCOPES), "alice")}
            values = {
                "tenant_id": ids["alice"],
                "key_id": ids["alice_key"],
                "token_id": "adm_000000000000",
                "model": MODEL,
            }
            found.append(Fuzz(admin.url, callers, values, (ids["bob"], ids["bob_key"])))
            await asyncio.to_thread(found[0].run, only)

    run(go)
    return found[0]


def test_schemathesis_finds_nothing_wrong_in_the_admin_api(tmp_path: Path) -> None:
    found = fuzz(tmp_path)
    assert found.problems == [], "\n".join(found.problems[:20])
    operations = len(list(schemathesis.openapi.from_path(str(REPO_COPY)).get_all_operations()))
    assert found.sent >= 4 * operations  # the draws reached the API


def test_schemathesis_finds_a_handler_that_breaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positive control: a limits parser that fails unexpectedly (a 500) is found."""

    def broken(body: object) -> None:
        raise TypeError("unexpected")

    monkeypatch.setattr(api, "parse_limits", broken)
    problems = fuzz(tmp_path, only={"keys_limits"}).problems
    assert problems and all("Server error" in p for p in problems), problems[:3]
