"""saltgate in front of two real vLLM replicas (issue 4, tests 1-6; `pytest -m vllm`).

The replicas (conftest.py) run vLLM 0.32 on CPU with a tiny random-weight model. What each
test sees of vLLM's prefix cache comes from vLLM itself: `cached_tokens` in the usage, and
the KV events it publishes (read from its replay socket, which keeps every batch).
"""

from __future__ import annotations

import asyncio
import secrets
from functools import partial
from typing import Any

import httpx
import pytest
import zmq
from tests.conformance.fleet import (
    BLOCK_SIZE,
    MODEL_NAME,
    Fleet,
    Tenancy,
    VllmReplica,
    events_since,
    gateway,
    next_seq,
    stored,
)
from tests.gateway.stack import long_prompt
from tests.support import completions
from tests.support.completions import cached
from tests.support.http import async_client
from tests.support.kv_relay import assert_nothing_leaks, collect, raw_stream

from saltgate.derivations.derive import cache_salt
from saltgate.kvevents.relay import KvRelay
from saltgate.kvevents.settings import CurveKeyPair, KvRelaySettings, KvUpstream
from saltgate.kvevents.wire import KVEvent, decode_batch
from saltgate.policy.request import ALLOWED_POST_ROUTES
from saltgate.sim.hashing import block_hashes, event_hash
from saltgate.sim.run import SimConfig, start_sim

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

RUN = secrets.token_hex(3)  # fresh prompts per run: a warm cache must not fake a result
CLIENT_SALT = "sg1_client-chosen-salt-in-the-clear"


def text(tag: str, words: int = 80) -> str:
    return long_prompt(f"{tag}{RUN}x", words)


def derived_salt(tenancy: Tenancy, tenant: str) -> str:
    return cache_salt(tenancy.subkeys.salt, tenancy.tenant_ids[tenant], "0", None)


def as_tenant(url: str, tenancy: Tenancy, tenant: str) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {tenancy.keys[tenant]}"}
    return async_client(base_url=url, headers=headers, timeout=120)


def direct(replica: VllmReplica, fleet: Fleet) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {fleet.api_key}"}
    return async_client(base_url=replica.url, headers=headers, timeout=120)


complete = partial(completions.complete, model=MODEL_NAME, max_tokens=1)


def salts_of(events: list[KVEvent]) -> set[str]:
    """Every string in every BlockStored's extra_keys (vLLM sends the bare salt)."""
    out: set[str] = set()
    for event in stored(events):
        for keys in event.extra_keys or ():
            out.update(str(k) for k in keys or ())
    return out


# ------------------------------------------------------------------------------ 1


ROUTE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [
            {"role": "system", "content": text("chat")},
            {"role": "user", "content": "hi"},
        ],
        "max_tokens": 2,
    },
    "/v1/completions": {"prompt": text("completions"), "max_tokens": 2},
    "/v1/responses": {"input": text("responses"), "max_output_tokens": 2},
    "/v1/messages": {"messages": [{"role": "user", "content": text("messages")}], "max_tokens": 2},
}
TOKENIZER_BODIES: dict[str, dict[str, Any]] = {
    "/tokenize": {"prompt": text("tokenize")},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
}
# (the pooling replica that serves it: 0 embedding, 1 classifier; body)
POOLING_BODIES: dict[str, tuple[int, dict[str, Any]]] = {
    "/v1/embeddings": (0, {"input": text("embeddings")}),
    "/pooling": (0, {"input": text("pooling")}),
    "/score": (0, {"text_1": text("score"), "text_2": "a dog"}),
    "/v1/score": (0, {"text_1": text("v1score"), "text_2": "a dog"}),
    "/rerank": (0, {"query": text("rerank"), "documents": ["a dog", "a fox"]}),
    "/v1/rerank": (0, {"query": text("v1rerank"), "documents": ["a dog", "a fox"]}),
    "/v2/rerank": (0, {"query": text("v2rerank"), "documents": ["a dog", "a fox"]}),
    "/classify": (1, {"input": text("classify")}),
}


def test_1_derived_salts_are_accepted_on_every_allowed_route(
    fleet: Fleet, pooling_fleet: Fleet, tenancy: Tenancy
) -> None:
    """Over 30 s, and must be: the first test to ask starts the session's four real vLLM
    replicas (two generating, two pooling), and their start-up, most of its time, is
    charged here."""
    routes = {*ROUTE_BODIES, *TOKENIZER_BODIES, *POOLING_BODIES}
    assert routes == set(ALLOWED_POST_ROUTES), "a body for every allowed route"
    salt = derived_salt(tenancy, "alice")

    async def main() -> None:
        starts = [next_seq(r) for r in fleet.replicas]
        async with gateway(fleet, tenancy) as url, as_tenant(url, tenancy, "alice") as client:
            for route, body in ROUTE_BODIES.items():
                for stream in (False, True):
                    r = await client.post(
                        route, json={"model": MODEL_NAME, **body, "stream": stream}
                    )
                    assert r.status_code == 200, f"{route} stream={stream}: {r.text}"
            for route, body in TOKENIZER_BODIES.items():
                r = await client.post(route, json={"model": MODEL_NAME, **body})
                assert r.status_code == 200, f"{route}: {r.text}"
        events = [
            e for r, s in zip(fleet.replicas, starts, strict=True) for e in events_since(r, s)
        ]
        firsts = [e for e in stored(events) if e.parent_block_hash is None]
        assert len(firsts) >= len(ROUTE_BODIES)  # each route's prompt started a new chain
        assert {e.extra_keys[0] if e.extra_keys else None for e in firsts} == {(salt,)}
        # The pooling routes: salted too, since vLLM runs their prompts through the cache.
        for index, replica in enumerate(pooling_fleet.replicas):
            start = next_seq(replica)
            bodies = {r: b for r, (i, b) in POOLING_BODIES.items() if i == index}
            async with (
                gateway(pooling_fleet, tenancy, replicas=(index,)) as url,
                as_tenant(url, tenancy, "alice") as client,
            ):
                for route, body in bodies.items():
                    r = await client.post(route, json={"model": MODEL_NAME, **body})
                    assert r.status_code == 200, f"{route}: {r.text}"
                    assert r.json()["usage"]["prompt_tokens"] > 0
            firsts = [
                e for e in stored(events_since(replica, start)) if e.parent_block_hash is None
            ]
            assert firsts and {e.extra_keys[0] if e.extra_keys else None for e in firsts} == {
                (salt,)
            }

    asyncio.run(main())


# ------------------------------------------------------------------------------ 2


def test_2_tenants_are_isolated_and_salting_off_shows_the_leak(
    fleet: Fleet, tenancy: Tenancy
) -> None:
    async def run(salting: bool, prompt: str) -> tuple[int, int, int]:
        async with gateway(fleet, tenancy, replicas=(0,), salting=salting) as url:
            async with as_tenant(url, tenancy, "alice") as alice:
                first = cached(await complete(alice, prompt))
                repeat = cached(await complete(alice, prompt))
            async with as_tenant(url, tenancy, "bob") as bob:
                other = cached(await complete(bob, prompt))
        return first, repeat, other

    salted = asyncio.run(run(True, text("isolated")))
    assert salted[0] == 0 and salted[1] > 0 and salted[2] == 0, salted
    # Positive control: the same test, salting switched off (test-only config), must see
    # bob hit alice's blocks.
    unsalted = asyncio.run(run(False, text("leaky")))
    assert unsalted[0] == 0 and unsalted[1] > 0 and unsalted[2] > 0, unsalted


# ------------------------------------------------------------------------------ 3


def test_3_client_cache_salt_and_vllm_xargs_never_reach_vllm(
    fleet: Fleet, tenancy: Tenancy
) -> None:
    replica = fleet.replicas[0]
    smuggled: dict[str, Any] = {
        "cache_salt": CLIENT_SALT,
        "vllm_xargs": {"kv_cache_report_mode": "full"},
    }

    async def main() -> tuple[list[KVEvent], list[KVEvent]]:
        start = next_seq(replica)
        async with (
            gateway(fleet, tenancy, replicas=(0,)) as url,
            as_tenant(url, tenancy, "alice") as alice,
        ):
            prompt = text("smuggle")
            await complete(alice, prompt, **smuggled)
            hit = await complete(alice, prompt, **smuggled)
            assert cached(hit) > 0
        through_gateway = events_since(replica, start)
        # Positive control: the same requests straight to vLLM.
        start = next_seq(replica)
        async with direct(replica, fleet) as client:
            prompt = text("smuggle-direct")
            await complete(client, prompt, **smuggled)
            await complete(client, prompt, **smuggled)
        return through_gateway, events_since(replica, start)

    through_gateway, straight = asyncio.run(main())
    assert CLIENT_SALT in salts_of(straight)
    chains = [e.block_hashes for e in stored(straight)]
    assert len(chains) == 2 and chains[0] == chains[1], "report mode re-published the hit"

    assert CLIENT_SALT not in salts_of(through_gateway)
    assert salts_of(through_gateway) == {derived_salt(tenancy, "alice")}
    assert len(stored(through_gateway)) == 1, "no BlockStored re-published for the cache hit"


# ------------------------------------------------------------------------------ 4


def test_4_replicas_refuse_requests_without_their_api_key(fleet: Fleet, tenancy: Tenancy) -> None:
    async def main() -> None:
        for replica in fleet.replicas:
            async with async_client(base_url=replica.url, timeout=60) as anonymous:
                body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}
                assert (await anonymous.post("/v1/completions", json=body)).status_code == 401
                wrong = {"authorization": "Bearer not-the-key"}
                r = await anonymous.post("/v1/completions", json=body, headers=wrong)
                assert r.status_code == 401
                assert (await anonymous.get("/v1/models")).status_code == 401
        async with gateway(fleet, tenancy) as url, as_tenant(url, tenancy, "bob") as bob:
            for _ in range(4):  # least-loaded picking reaches both replicas
                await complete(bob, "hello through the gateway")
            models = await bob.get("/v1/models")
            assert models.status_code == 200
            assert [m["id"] for m in models.json()["data"]] == [MODEL_NAME]
        # The gateway given a wrong key: vLLM's /health takes none, its /v1/models refuses
        # it, and the gateway says so instead of relaying vLLM's 401 to the tenant.
        wrong_key = "not-the-replicas-key"
        async with (
            gateway(fleet, tenancy, api_key=wrong_key) as url,
            as_tenant(url, tenancy, "bob") as bob,
        ):
            ready = await bob.get("/ready")
            assert ready.status_code == 503, ready.text
            reasons = {r["reason"] for r in ready.json()["replicas"]["list"]}
            assert reasons == {"credentials_refused"}, ready.text
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}
            answer = await bob.post("/v1/completions", json=body)
            assert answer.status_code == 503 and "no_replica" in answer.text, answer.text

    asyncio.run(main())


# ------------------------------------------------------------------------------ 5


def test_5_simulator_and_vllm_agree_on_block_hashes(fleet: Fleet, tenancy: Tenancy) -> None:
    replica = fleet.replicas[0]
    tokens = [10 + (i * 37 + len(RUN)) % 990 for i in range(5 * BLOCK_SIZE + 7)]
    expected_blocks = len(tokens) // BLOCK_SIZE

    async def main() -> None:
        sim = await start_sim(
            SimConfig(
                port=0,
                model=MODEL_NAME,
                block_size=BLOCK_SIZE,
                kv_events_endpoint="tcp://127.0.0.1:*",
                kv_events_replay_endpoint="tcp://127.0.0.1:*",
                prefill_ms_per_1k_tokens=0,
                decode_ms_per_token=0,
            )
        )
        try:
            assert sim.publisher is not None and sim.publisher.bound_replay_endpoint
            sim_replay = sim.publisher.bound_replay_endpoint
            for salt in ("sg1_agreement-" + RUN, None):
                extra: dict[str, Any] = {"cache_salt": salt} if salt else {}
                start = next_seq(replica)
                async with direct(replica, fleet) as client:
                    await complete(client, tokens, **extra)
                real = stored(events_since(replica, start))
                sim_start = len(raw_stream(sim_replay))
                async with async_client(base_url=sim.url, timeout=60) as client:
                    await complete(client, tokens, **extra)
                simulated = stored(
                    [
                        e
                        for _, p in raw_stream(sim_replay, sim_start)
                        for e in decode_batch(p).events
                    ]
                )
                want = [event_hash(h) for h in block_hashes(tokens, BLOCK_SIZE, salt)]
                assert len(want) == expected_blocks
                assert [h for e in real for h in e.block_hashes] == want
                assert [h for e in simulated for h in e.block_hashes] == want
                assert real[0].extra_keys == simulated[0].extra_keys
                assert real[0].token_ids == tuple(tokens[: expected_blocks * BLOCK_SIZE])
            # Through the gateway the block hashes are those of the derived salt.
            start = next_seq(replica)
            async with (
                gateway(fleet, tenancy, replicas=(0,)) as url,
                as_tenant(url, tenancy, "bob") as bob,
            ):
                await complete(bob, tokens)
            via_gateway = stored(events_since(replica, start))
            salt = derived_salt(tenancy, "bob")
            want = [event_hash(h) for h in block_hashes(tokens, BLOCK_SIZE, salt)]
            assert [h for e in via_gateway for h in e.block_hashes] == want
        finally:
            await sim.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------ 6


def test_6_relay_fed_by_real_vllm_events_leaks_nothing(fleet: Fleet, tenancy: Tenancy) -> None:
    allowed = CurveKeyPair(*(k.decode() for k in zmq.curve_keypair()))
    k_kv = tenancy.subkeys.kv_events
    upstreams = [KvUpstream(r.kv_endpoint, r.kv_replay_endpoint) for r in fleet.replicas]
    settings = KvRelaySettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", (allowed.public,))

    async def traffic() -> None:
        async with gateway(fleet, tenancy) as url, as_tenant(url, tenancy, "alice") as alice:
            for i in range(4):
                await complete(alice, text(f"relay-gw{i}"))
        for replica in fleet.replicas:  # enough distinct prompts to evict: BlockRemoved
            async with direct(replica, fleet) as client:
                for i in range(10):
                    await complete(
                        client, text(f"relay-{replica.index}-{i}"), cache_salt=CLIENT_SALT
                    )

    with KvRelay(upstreams, k_kv, settings) as relay:
        assert relay.wait_ready(30)
        asyncio.run(traffic())
        for replica in fleet.replicas:
            events_since(replica, 0)  # wait until each replica's publisher is quiet
        raw = [p for r in fleet.replicas for _, p in raw_stream(r.kv_replay_endpoint)]
        relayed = collect(
            relay.publish_endpoint,
            relay.replay_endpoint,
            relay.server_keys.public,
            allowed,
            len(raw),
        )
        assert relay.stats.missed_upstream == 0 and relay.stats.malformed == 0
    assert CLIENT_SALT.encode() in b"".join(raw)
    assert_nothing_leaks(raw, relayed, k_kv, evictions=True)
    assert set(relay.replica_ids.values()) == {r.replica_id for r in relayed}
