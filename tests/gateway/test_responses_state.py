"""Issue 40, "Responses state", through a real gateway in front of a simulator that keeps
responses as vLLM's store does (VLLM_ENABLE_RESPONSES_API_STORE=1: every answer kept by
id, served and continued for anyone who names it; saltgate.sim.unsafe).

Positive control first: straight to that replica, bob continues and reads alice's
response by its id, and his prompt carries her conversation. Through the gateway the
replica keeps nothing (`store` false on every request), a `previous_response_id` or
`background` is a 400 that never reaches it, and the routes by id are not served."""

from __future__ import annotations

from pathlib import Path

import orjson
from tests.gateway.stack import MODEL, run, stack
from tests.support.http import async_client

from saltgate.sim.run import SimConfig
from saltgate.sim.unsafe import UnsafeOptions

STORE_ON = SimConfig(port=0, unsafe=UnsafeOptions(responses_store=True))
ALICE_SECRET = "alice's launch date is the ninth of march"


def test_a_stored_response_is_everyones_without_the_gateway(tmp_path: Path) -> None:
    """The leak the gateway closes: an id is a bearer capability on such a replica."""

    async def main() -> None:
        async with (
            stack(tmp_path, replicas=1, sim=STORE_ON) as s,
            async_client(base_url=s.sims[0].url, timeout=30) as direct,
        ):
            body = {"model": MODEL, "input": ALICE_SECRET, "max_output_tokens": 4}
            alone = await direct.post("/v1/responses", json={**body, "input": "hi"})
            created = await direct.post("/v1/responses", json=body)  # alice's
            assert created.status_code == 200, created.text
            alice_id = created.json()["id"]
            read = await direct.get(f"/v1/responses/{alice_id}")  # bob reads it
            assert read.status_code == 200 and read.json()["id"] == alice_id
            continued = await direct.post(  # bob continues it
                "/v1/responses",
                json={**body, "input": "hi", "previous_response_id": alice_id},
            )
            assert continued.status_code == 200, continued.text
            grown = continued.json()["usage"]["input_tokens"]
            assert grown > alone.json()["usage"]["input_tokens"] + 5  # her text in his prompt

    run(main)


def test_through_the_gateway_the_replica_keeps_no_response(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, replicas=1, sim=STORE_ON) as s,
            s.client("alice") as alice,
            s.client("bob") as bob,
        ):
            body = {"model": MODEL, "input": ALICE_SECRET, "max_output_tokens": 4}
            for asked in ({}, {"store": True}):  # vLLM's default is to store: not here
                created = await alice.post("/v1/responses", json={**body, **asked})
                assert created.status_code == 200, created.text
                alice_id = created.json()["id"]
                assert orjson.loads(s.forwarded()[-1].body)["store"] is False
                async with async_client(base_url=s.sims[0].url, timeout=30) as direct:
                    kept = await direct.get(f"/v1/responses/{alice_id}")
                assert kept.status_code == 404, kept.text  # nothing kept to continue

            forwarded = len(s.forwarded())
            for extra, param in (
                ({"previous_response_id": alice_id}, "previous_response_id"),
                ({"background": True}, "background"),
            ):
                refused = await bob.post("/v1/responses", json={**body, "input": "hi", **extra})
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert (error["param"], error["code"]) == (param, "response_state_refused")
                assert "keeps no response state" in error["message"]
                assert alice_id not in refused.text
            for method, path in (
                ("GET", f"/v1/responses/{alice_id}"),
                ("DELETE", f"/v1/responses/{alice_id}"),
                ("POST", f"/v1/responses/{alice_id}/cancel"),
            ):
                answered = await bob.request(method, path)
                assert answered.status_code in (404, 405), (method, answered.text)
                assert ALICE_SECRET not in answered.text
            assert len(s.forwarded()) == forwarded  # none of it reached the replica
            by_id = [r.path for r in s.taps[0].seen if r.path.startswith(b"/v1/responses/")]
            assert by_id == []

    run(main)


def test_the_fast_path_and_the_copy_forward_the_same_store(tmp_path: Path) -> None:
    """`store` false is spliced on the usual path and set on the copied one (a stripped
    field present): both reach the replica as false, never as a duplicate key."""

    async def main() -> None:
        async with stack(tmp_path, replicas=1, sim=STORE_ON) as s, s.client("alice") as alice:
            for extra in ({}, {"priority": 5}, {"store": True, "session_id": "x"}):
                body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}
                assert (await alice.post("/v1/responses", json=body)).status_code == 200
                raw = s.forwarded()[-1].body
                assert raw.count(b'"store"') == 1 and orjson.loads(raw)["store"] is False

    run(main)
