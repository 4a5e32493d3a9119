"""vLLM's Responses store behind saltgate (issue 40, "Responses state"; `pytest -m vllm`).

The replica runs with VLLM_ENABLE_RESPONSES_API_STORE=1, the setting that makes a response
id a bearer capability. Straight to it (the positive control), bob continues alice's
response by its id and is billed for her conversation, the leak the issue confirmed on
real vLLM. Through saltgate, the replica keeps nothing (`store` false), a
`previous_response_id` is refused before it reaches the replica, and so is reading or
deleting by id.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest
from tests.conformance.fleet import MODEL_NAME, Fleet, Tenancy, gateway
from tests.support.http import async_client

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RUN = secrets.token_hex(3)
ALICE_SAYS = f"{RUN} alice's unreleased plan: ship the gateway on the ninth of march " * 4


def test_16_a_stored_response_is_nobody_elses_through_saltgate(
    store_fleet: Fleet, tenancy: Tenancy
) -> None:
    replica = store_fleet.replicas[0]
    body = {"model": MODEL_NAME, "max_output_tokens": 2}

    async def main() -> None:
        direct_headers = {"authorization": f"Bearer {store_fleet.api_key}"}
        async with async_client(base_url=replica.url, headers=direct_headers, timeout=120) as d:
            alone = await d.post("/v1/responses", json={**body, "input": "hi"})
            assert alone.status_code == 200, alone.text
            hers = await d.post("/v1/responses", json={**body, "input": ALICE_SAYS})
            assert hers.status_code == 200, hers.text
            her_id = hers.json()["id"]
            # The control: anyone holding the id continues her conversation.
            his = await d.post(
                "/v1/responses", json={**body, "input": "hi", "previous_response_id": her_id}
            )
            assert his.status_code == 200, his.text
            grown = his.json()["usage"]["input_tokens"]
            assert grown > alone.json()["usage"]["input_tokens"] + 20, (grown, alone.text)

            async with gateway(store_fleet, tenancy, replicas=(0,)) as url:
                as_alice = {"authorization": f"Bearer {tenancy.keys['alice']}"}
                as_bob = {"authorization": f"Bearer {tenancy.keys['bob']}"}
                async with async_client(base_url=url, headers=as_alice, timeout=120) as alice:
                    made = await alice.post("/v1/responses", json={**body, "input": ALICE_SAYS})
                    assert made.status_code == 200, made.text
                    made_id = made.json()["id"]
                # vLLM kept nothing under her id: nothing to continue or read.
                kept = await d.get(f"/v1/responses/{made_id}")
                assert kept.status_code == 404, kept.text
                async with async_client(base_url=url, headers=as_bob, timeout=120) as bob:
                    for previous in (made_id, her_id):  # hers stored before saltgate
                        refused = await bob.post(
                            "/v1/responses",
                            json={**body, "input": "hi", "previous_response_id": previous},
                        )
                        assert refused.status_code == 400, refused.text
                        assert refused.json()["error"]["param"] == "previous_response_id"
                    read = await bob.get(f"/v1/responses/{her_id}")
                    assert read.status_code == 404 and ALICE_SAYS[:20] not in read.text

    asyncio.run(main())


def test_17_with_the_store_kept_each_response_is_its_owners_only(
    store_fleet: Fleet, tenancy: Tenancy
) -> None:
    """`[responses] store = true` in front of vLLM's store: alice continues her response
    (its conversation in her prompt), bob naming it gets the unknown-id answer."""
    body = {"model": MODEL_NAME, "max_output_tokens": 2}

    async def main() -> None:
        async with gateway(store_fleet, tenancy, replicas=(0,), responses_store=True) as url:
            as_alice = {"authorization": f"Bearer {tenancy.keys['alice']}"}
            as_bob = {"authorization": f"Bearer {tenancy.keys['bob']}"}
            async with (
                async_client(base_url=url, headers=as_alice, timeout=120) as alice,
                async_client(base_url=url, headers=as_bob, timeout=120) as bob,
            ):
                alone = await alice.post("/v1/responses", json={**body, "input": "hi"})
                made = await alice.post("/v1/responses", json={**body, "input": ALICE_SAYS})
                assert made.status_code == 200, made.text
                her_id = made.json()["id"]
                follow = {**body, "input": "hi", "previous_response_id": her_id}
                mine = await alice.post("/v1/responses", json=follow)
                assert mine.status_code == 200, mine.text
                grown = mine.json()["usage"]["input_tokens"]
                assert grown > alone.json()["usage"]["input_tokens"] + 20, mine.text
                theirs = await bob.post("/v1/responses", json=follow)
                assert theirs.status_code == 404, theirs.text
                said = theirs.json()["error"]["message"]
                assert said == f"Response with id '{her_id}' not found.", said
                assert (await alice.get(f"/v1/responses/{her_id}")).status_code == 200
                assert (await bob.get(f"/v1/responses/{her_id}")).status_code == 404

    asyncio.run(main())
