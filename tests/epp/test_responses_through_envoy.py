"""`[responses] store = true` through Envoy and the EPP (as tests/gateway/test_responses_store.py
at the gateway): the EPP records who made each response and which replica holds it before
the answer is released, sends a continuation to that replica only, and answers a read,
delete or cancel by id itself (an ImmediateResponse after asking the holding replica),
the owner's only. Another tenant naming the id gets the unknown-id 404 and reaches no
replica.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tests.epp.test_through_envoy import MODEL, EnvoyStack, envoy_stack
from tests.gateway.stack import run

from saltgate.gateway.responses import ResponseOwners
from saltgate.sim.run import SimConfig
from saltgate.sim.unsafe import UnsafeOptions
from saltgate.store.db import Database

STORE_ON = SimConfig(port=0, model=MODEL, unsafe=UnsafeOptions(responses_store=True))
STORE = "[responses]\nstore = true\n"
BODY = {"model": MODEL, "max_output_tokens": 2}
HERS = "alice's plan, stored on a replica: ship on the ninth of march " * 3
UNKNOWN = "resp_0000000000000000"


def posts(s: EnvoyStack) -> list[int]:
    """How many POSTs each replica received."""
    return [sum(r.method == b"POST" for r in tap.seen) for tap in s.taps]


async def bobs_tries(bob: httpx.AsyncClient, rid: str) -> list[httpx.Response]:
    """Everything another tenant can do with a response id."""
    follow = {**BODY, "input": "hi", "previous_response_id": rid}
    return [
        await bob.post("/v1/responses", json=follow),
        await bob.get(f"/v1/responses/{rid}"),
        await bob.delete(f"/v1/responses/{rid}"),
        await bob.post(f"/v1/responses/{rid}/cancel"),
    ]


async def stored_by_alice(s: EnvoyStack, alice: httpx.AsyncClient) -> tuple[str, int]:
    """A response alice stores: its id and the tap of the replica holding it."""
    made = await alice.post("/v1/responses", json={**BODY, "input": HERS})
    assert made.status_code == 200, made.text
    [holder] = [i for i, t in enumerate(s.taps) if t.seen and HERS in t.seen[-1].body.decode()]
    return made.json()["id"], holder


def test_a_tenant_continues_and_reads_only_its_own_responses_through_envoy(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with (
            envoy_stack(tmp_path, sim=STORE_ON, sections=STORE) as s,
            s.client("alice") as alice,
            s.client("bob") as bob,
        ):
            alone = await alice.post("/v1/responses", json={**BODY, "input": "hi"})
            her_id, holder = await stored_by_alice(s, alice)
            expected = posts(s)
            expected[holder] += 3
            for _ in range(3):  # every continuation, to the replica that holds it
                continued = await alice.post(
                    "/v1/responses", json={**BODY, "input": "hi", "previous_response_id": her_id}
                )
                assert continued.status_code == 200, continued.text
                grown = continued.json()["usage"]["input_tokens"]
                assert grown > alone.json()["usage"]["input_tokens"] + 10  # her conversation
            assert posts(s) == expected
            read = await alice.get(f"/v1/responses/{her_id}")
            assert read.status_code == 200, read.text
            assert read.json()["id"] == her_id

            before = posts(s)
            seen: dict[str, list[bytes]] = {}
            for rid in (her_id, UNKNOWN):
                for answer in await bobs_tries(bob, rid):
                    assert answer.status_code == 404, answer.text
                    error = answer.json()["error"]["message"]
                    assert error == f"Response with id '{rid}' not found."
                    assert HERS[:20] not in answer.text
                    seen.setdefault(rid, []).append(answer.content.replace(rid.encode(), b"ID"))
            assert seen[her_id] == seen[UNKNOWN]  # her id: the same bytes as nobody's
            assert posts(s) == before  # bob reached no replica
            reads = [r for t in s.taps for r in t.seen if r.method == b"GET" and b"resp_" in r.path]
            assert len(reads) == 1  # alice's read only

            streamed = await alice.post(
                "/v1/responses", json={**BODY, "input": "hi", "stream": True}
            )
            assert streamed.status_code == 200, streamed.text
            lines = streamed.text.splitlines()
            created = next(line for line in lines if '"response.created"' in line)
            rid = created.split('"id":"', 1)[1].split('"', 1)[0]
            owners = s.epp.gateway.owners
            tenant = s.epp.gateway.keys.authenticate(s.keys["alice"])
            assert owners is not None and tenant is not None
            assert await owners.replica_of(rid, tenant.tenant_id) is not None  # kept

    run(body)


def test_positive_control_without_the_owner_check_bob_reads_alices_response(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner check switched off (any tenant's id found for anyone): bob's read by id
    through Envoy returns alice's stored response, which the test above refuses."""
    by_tenant = ResponseOwners.replica_of

    async def anyones(self: ResponseOwners, response_id: str, tenant_id: str) -> str | None:
        def read(db: Database) -> str | None:
            rows = db.query("SELECT replica FROM responses WHERE id = ?", (response_id,))
            return str(rows[0][0]) if rows else None

        return await self._store.run(read) or await by_tenant(self, response_id, tenant_id)

    monkeypatch.setattr(ResponseOwners, "replica_of", anyones)

    async def body() -> None:
        async with (
            envoy_stack(tmp_path, sim=STORE_ON, sections=STORE) as s,
            s.client("alice") as alice,
            s.client("bob") as bob,
        ):
            her_id, _ = await stored_by_alice(s, alice)
            leaked = await bob.get(f"/v1/responses/{her_id}")
            assert leaked.status_code == 200, leaked.text
            assert leaked.json()["id"] == her_id  # hers, not the unknown-id 404

    run(body)
