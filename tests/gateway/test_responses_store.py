"""`[responses] store = true` (issue 40, "Responses state"): replicas keep responses as
vLLM's store does (the simulator's, saltgate.sim.unsafe), and each is its owner's only.
Alice continues and reads her own, on the replica that holds it, also after a restart;
bob naming her id gets the answer for an unknown id and reaches no replica."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.gateway.stack import MODEL, run, stack
from tests.support.http import async_client

from saltgate.serving.run import start_gateway
from saltgate.sim.run import SimConfig
from saltgate.sim.unsafe import UnsafeOptions

STORE_ON = SimConfig(port=0, unsafe=UnsafeOptions(responses_store=True))
BODY = {"model": MODEL, "max_output_tokens": 2}
HERS = "alice's plan, stored on a replica: ship on the ninth of march " * 3


def test_a_tenant_continues_and_reads_only_its_own_responses(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, replicas=2, sim=STORE_ON, responses_store=True) as s,
            s.client("alice") as alice,
            s.client("bob") as bob,
        ):
            alone = await alice.post("/v1/responses", json={**BODY, "input": "hi"})
            made = await alice.post("/v1/responses", json={**BODY, "input": HERS})
            assert made.status_code == 200, made.text
            her_id = made.json()["id"]
            first = [i for i, t in enumerate(s.taps) if t.seen and HERS in t.seen[-1].body.decode()]
            continued = await alice.post(
                "/v1/responses", json={**BODY, "input": "hi", "previous_response_id": her_id}
            )
            assert continued.status_code == 200, continued.text
            grown = continued.json()["usage"]["input_tokens"]
            assert grown > alone.json()["usage"]["input_tokens"] + 10  # her conversation
            went = [
                i for i, t in enumerate(s.taps) if t.seen and her_id in t.seen[-1].body.decode()
            ]
            assert went == first, (went, first)  # the replica that holds it
            read = await alice.get(f"/v1/responses/{her_id}")
            assert read.status_code == 200 and read.json()["id"] == her_id

            forwarded = len(s.forwarded())
            unknown = "resp_0000000000000000"
            seen: dict[str, list[bytes]] = {}
            for rid in (her_id, unknown):
                for answer in (
                    await bob.post(
                        "/v1/responses", json={**BODY, "input": "hi", "previous_response_id": rid}
                    ),
                    await bob.get(f"/v1/responses/{rid}"),
                    await bob.delete(f"/v1/responses/{rid}"),
                    await bob.post(f"/v1/responses/{rid}/cancel"),
                ):
                    assert answer.status_code == 404, answer.text
                    assert (
                        answer.json()["error"]["message"] == f"Response with id '{rid}' not found."
                    )
                    assert HERS[:20] not in answer.text
                    seen.setdefault(rid, []).append(answer.content.replace(rid.encode(), b"ID"))
            assert seen[her_id] == seen[unknown]  # her id: the same bytes as nobody's
            assert len(s.forwarded()) == forwarded  # bob reached no replica
            by_id = [r for t in s.taps for r in t.seen if r.method == b"GET" and b"resp_" in r.path]
            assert len(by_id) == 1  # alice's read only

            # A restarted gateway (the same store) still knows whose it is.
            again = await start_gateway(s.gateway.gateway.config)
            try:
                headers = {"authorization": f"Bearer {s.keys['alice']}"}
                async with async_client(base_url=again.url, headers=headers, timeout=30) as a2:
                    body = {**BODY, "input": "hi", "previous_response_id": her_id}
                    assert (await a2.post("/v1/responses", json=body)).status_code == 200
            finally:
                await again.close()

    run(main)


def test_a_continuation_whose_replica_is_gone_is_refused_not_rerouted(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, replicas=2, sim=STORE_ON, responses_store=True) as s,
            s.client("alice") as alice,
        ):
            made = await alice.post("/v1/responses", json={**BODY, "input": HERS})
            her_id = made.json()["id"]
            held = [i for i, t in enumerate(s.taps) if t.seen and HERS in t.seen[-1].body.decode()]
            config = s.gateway.gateway.config
            others = tuple(r for i, r in enumerate(config.replicas) if i not in held)
            assert len(held) == 1 and len(others) == 1
            # The same store, a fleet without the holding replica.
            again = await start_gateway(replace(config, replicas=others))
            try:
                headers = {"authorization": f"Bearer {s.keys['alice']}"}
                async with async_client(base_url=again.url, headers=headers, timeout=30) as a2:
                    body = {**BODY, "input": "hi", "previous_response_id": her_id}
                    gone = await a2.post("/v1/responses", json=body)
                    assert gone.status_code == 503, gone.text
                    assert gone.json()["error"]["code"] == "response_replica_gone"
            finally:
                await again.close()
            assert not any(her_id in r.body.decode() for t in s.taps for r in t.seen)

    run(main)


def test_a_streamed_response_is_recorded_for_its_owner(tmp_path: Path) -> None:
    """The id of a streamed response is read from its `response.created` event and recorded
    before the client sees it: its owner's continuation is forwarded to the replica, another
    tenant's is the gateway's unknown-id 404. (The simulator keeps whole answers only, so
    the replica itself does not know a streamed id: its own 404 shows the request got there.)"""

    async def main() -> None:
        async with (
            stack(tmp_path, replicas=1, sim=STORE_ON, responses_store=True) as s,
            s.client("alice") as alice,
            s.client("bob") as bob,
        ):
            streamed = await alice.post(
                "/v1/responses", json={**BODY, "input": "hi", "stream": True}
            )
            assert streamed.status_code == 200, streamed.text
            created = next(
                line for line in streamed.text.splitlines() if '"response.created"' in line
            )
            rid = created.split('"id":"', 1)[1].split('"', 1)[0]
            assert rid.startswith("resp_"), created
            owners = s.gateway.gateway.owners
            assert owners is not None
            tenant = s.gateway.gateway.keys.authenticate(s.keys["alice"])
            assert tenant is not None
            assert await owners.replica_of(rid, tenant.tenant_id) is not None
            follow = {**BODY, "input": "hi", "previous_response_id": rid}
            before = len(s.forwarded())
            theirs = await bob.post("/v1/responses", json=follow)
            assert theirs.status_code == 404 and len(s.forwarded()) == before, theirs.text
            await alice.post("/v1/responses", json=follow)
            assert len(s.forwarded()) == before + 1  # hers went to the replica

    run(main)
