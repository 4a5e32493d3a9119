"""Routing through the real gateway: simulated replicas, taps and the gateway over loopback."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.gateway.stack import MODEL, Stack, Tap, long_prompt, run, stack
from tests.support.completions import cached, complete
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.config import ReplicaConfig
from saltgate.http import HttpServer
from saltgate.routing import RouterConfig
from saltgate.serving.run import start_gateway

FAST_PROBES = RouterConfig(probe_interval_s=0.1, probe_timeout_s=1.0, probe_failures=2)


def served(s: Stack) -> list[int]:
    """Generation requests each replica has received so far."""
    return [sum(r.method == b"POST" for r in tap.seen) for tap in s.taps]


async def send(s: Stack, client: httpx.AsyncClient, prompt: str, **extra: Any) -> tuple[int, int]:
    """(the replica that served it, cached tokens)."""
    before = served(s)
    doc = await complete(client, prompt, **extra)
    after = served(s)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert len(changed) == 1, (before, after)
    return changed[0], cached(doc)


def prompt(seed: str) -> str:
    return long_prompt(seed, words=800)  # over the 4096-byte floor: it gets a route key


async def fresh_keys_reach(s: Stack, client: httpx.AsyncClient, replica: int) -> bool:
    """Whether new route keys reach `replica`: fresh prompts until one lands there, at most
    100. Each key's replica is a draw keyed by the run's random master key (1 in 3 here), so
    a fixed two dozen would miss a member in 1 run of 17,000; 100 miss it by chance in
    under 1 of 10^17."""
    for i in range(100):
        if (await send(s, client, prompt(f"fresh{i}_")))[0] == replica:
            return True
    return False


async def kill(tap: Tap) -> None:
    """Stop a replica's front: no new connections, and kept-alive ones closed once idle
    (HttpServer.close leaves a connection that is mid-request, e.g. a probe, open)."""
    server = tap.server
    assert server is not None
    await server.close()
    await eventually(lambda: _shut(server), what="the front is shut")


def _shut(server: HttpServer) -> bool:
    for conn in list(server.connections):
        conn.shutdown()
    return not server.connections


def available(s: Stack, index: int) -> bool:
    return next(ok for i, _, ok in s.gateway.gateway.replicas.available() if i == index)


def test_a_conversation_stays_on_one_replica_and_hits_its_cache(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=3) as s, s.client("alice") as alice:
            homes = set()
            for c in range(10):
                messages: list[dict[str, str]] = [
                    {"role": "system", "content": prompt(f"sys{c}_")},
                    {"role": "user", "content": f"question {c}"},
                ]
                seen = set()
                for turn in range(3):
                    before = served(s)
                    resp = await alice.post(
                        "/v1/chat/completions",
                        json={"model": MODEL, "messages": messages, "max_tokens": 2},
                    )
                    assert resp.status_code == 200, resp.text
                    doc = resp.json()
                    seen |= {i for i, n in enumerate(served(s)) if n != before[i]}
                    if turn:
                        assert cached(doc) > 0
                    reply = doc["choices"][0]["message"]["content"]
                    messages += [
                        {"role": "assistant", "content": reply},
                        {"role": "user", "content": f"and then {turn}?"},
                    ]
                assert len(seen) == 1  # every turn on the replica holding the history
                homes |= seen
            assert len(homes) > 1  # and conversations are spread over the replicas

    run(main)


@pytest.mark.parametrize("hot", [True, False], ids=["hot-key-spreads", "control-no-expansion"])
def test_a_hot_key_spreads_over_more_than_one_replica_under_load(tmp_path: Path, hot: bool) -> None:
    # The caps are out of the way (in-flight 100, prefill guard off), so only the warm set
    # can spread the key.
    router = RouterConfig(
        per_replica_rate=1.0 if hot else 1e6, max_inflight_delta=100, max_prefill_delta=0
    )

    async def main() -> None:
        async with stack(tmp_path, replicas=3, router=router) as s, s.client("alice") as alice:
            body = prompt("shared-system-prompt")
            for _ in range(3):  # three waves of 8 concurrent requests with one route key
                await asyncio.gather(
                    *(
                        complete(alice, body, prompt_cache_key="team", max_tokens=20)
                        for _ in range(8)
                    )
                )
            used = [n for n in served(s) if n]
            assert sum(used) == 24
            if hot:
                assert len(used) > 1 and max(used) < 24
            else:
                assert len(used) == 1

    run(main)


def test_a_killed_replica_is_skipped_before_the_first_byte_and_rejoins_after_its_probe(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, replicas=3, router=FAST_PROBES) as s,
            s.client("alice") as alice,
        ):
            texts = [prompt(f"kill{i}_") for i in range(6)]
            homes = [(await send(s, alice, t))[0] for t in texts]
            victim = homes[0]
            tap = s.taps[victim]
            await kill(tap)
            # Not yet noticed by a probe: the request fails to connect and goes elsewhere.
            moved, _ = await send(s, alice, texts[0])
            assert moved != victim
            stream = {"model": MODEL, "prompt": texts[0], "max_tokens": 4, "stream": True}
            async with alice.stream("POST", "/v1/completions", json=stream) as resp:
                assert resp.status_code == 200
                lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
            assert lines[-1] == "data: [DONE]"
            await eventually(lambda: not available(s, victim), what="the victim is out")
            for text, home in zip(texts, homes, strict=True):
                now, hits = await send(s, alice, text)
                if home != victim:
                    assert (now, hits > 0) == (home, True)  # the other keys stay, still warm
                else:
                    assert now != victim
            assert tap.server is not None
            await tap.server.start("127.0.0.1", tap.port)
            await eventually(lambda: available(s, victim), what="the victim is back")
            # The moved conversation stays where its freshest cache is (prefix affinity) ...
            _, hits = await send(s, alice, texts[0])
            assert hits > 0
            # ... and the replica is a member again: new keys ranked to it go to it.
            assert await fresh_keys_reach(s, alice, victim)

    run(main)


async def dying_replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A replica that starts a stream, sends one event and drops the connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        ),
        0,
    )
    await reader.readexactly(length)
    if head.startswith(b"GET"):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    else:
        event = b'data: {"choices":[{"index":0,"text":"partial"}]}\n\n'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event)
        )
    await writer.drain()
    writer.close()


def test_a_stream_cut_by_its_replica_ends_with_an_error_event(tmp_path: Path) -> None:
    async def main() -> None:
        server = await asyncio.start_server(dying_replica, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with stack(tmp_path, replicas=1) as s, s.client("alice") as alice:
                config = s.gateway.gateway.config
                s.gateway.reload(
                    dataclasses.replace(
                        config,
                        replicas=(ReplicaConfig(f"http://127.0.0.1:{port}", models=(MODEL,)),),
                    )
                )
                body = {"model": MODEL, "prompt": "cut", "max_tokens": 400, "stream": True}
                async with alice.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
            assert "partial" in lines[0]
            error = orjson.loads(lines[-1][len("data: ") :])["error"]
            assert "failed during the stream" in error["message"]
            assert str(port) not in lines[-1] and "127.0.0.1" not in lines[-1]
        finally:
            server.close()
            await server.wait_closed()

    run(main)


def test_reload_removes_and_adds_replicas_without_a_restart(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=3) as s, s.client("alice") as alice:
            running = s.gateway
            full = running.gateway.config
            texts = [prompt(f"reload{i}_") for i in range(9)]
            homes = [(await send(s, alice, t))[0] for t in texts]
            gone = homes[0]
            running.reload(
                dataclasses.replace(
                    full, replicas=tuple(r for i, r in enumerate(full.replicas) if i != gone)
                )
            )
            assert len(running.gateway.replicas.replicas) == 2
            for text, home in zip(texts, homes, strict=True):
                now, hits = await send(s, alice, text)
                assert now != gone
                if home != gone:
                    assert (now, hits > 0) == (home, True)  # only the removed one's keys move
            running.reload(full)
            _, hits = await send(s, alice, texts[0])
            assert hits > 0  # the moved keys stay with their fresh cache (prefix affinity)
            assert await fresh_keys_reach(s, alice, gone)  # the re-added one takes new keys

    run(main)


def test_tenants_keys_route_independently_and_each_sticks(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, replicas=3) as s,
            s.client("alice") as alice,
            s.client("bob") as bob,
        ):
            differ = 0
            for i in range(12):
                text = prompt(f"same-for-both{i}_")
                a1, _ = await send(s, alice, text)
                b1, b_hits = await send(s, bob, text)
                assert b_hits == 0  # salted apart, even when on the same replica
                a2, a_hits = await send(s, alice, text)
                b2, b_hits = await send(s, bob, text)
                assert (a2, b2) == (a1, b1) and a_hits > 0 and b_hits > 0
                differ += a1 != b1
            assert differ > 0  # 2/3 expected; 0 if the tenant did not enter the key

    run(main)


def test_two_gateways_with_the_same_master_key_choose_the_same_replicas(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=3) as s, s.client("alice") as alice:
            second = await start_gateway(s.gateway.gateway.config)
            try:
                headers = {"authorization": f"Bearer {s.keys['alice']}"}
                async with async_client(base_url=second.url, headers=headers) as other:
                    for i in range(8):
                        text = prompt(f"twin{i}_")
                        first, _ = await send(s, alice, text)
                        again, hits = await send(s, other, text)
                        assert again == first and hits > 0
            finally:
                await second.close()

    run(main)


def test_no_response_or_error_names_the_replica(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, replicas=3, router=FAST_PROBES) as s,
            s.client("alice") as alice,
        ):
            header_sets = {}
            for i in range(12):
                before = served(s)
                resp = await alice.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": prompt(f"hide{i}_"), "max_tokens": 2},
                )
                served_by = next(j for j, n in enumerate(served(s)) if n != before[j])
                header_sets[served_by] = sorted(k for k in resp.headers if k != "content-length")
                # the request id is the gateway's own, the one the replica was sent
                posts = [r for r in s.taps[served_by].seen if r.method == b"POST"]
                sent = posts[-1].header(b"x-request-id")
                assert sent is not None and resp.headers["x-request-id"] == sent.decode()
            assert len(header_sets) > 1
            assert len({tuple(h) for h in header_sets.values()}) == 1  # same header names
            # Positive control: the replicas themselves do name themselves per response.
            async with async_client() as direct:
                raw = await direct.get(f"{s.sims[0].url}/health")
            assert {"server", "x-request-id"} <= set(raw.headers)
            assert "server" not in header_sets[next(iter(header_sets))]
            for tap in s.taps:
                await kill(tap)
            resp = await alice.post(
                "/v1/completions", json={"model": MODEL, "prompt": prompt("x"), "max_tokens": 2}
            )
            assert resp.status_code == 503
            assert resp.json()["error"]["code"] == "no_replica"
            # The x-request-id is the gateway's random hex, where a 5-digit port number
            # turns up by chance in about 1 run of 15,000: not a header that names anything.
            headers = str({k: v for k, v in resp.headers.items() if k != "x-request-id"})
            for tap in s.taps:
                assert str(tap.port) not in resp.text and str(tap.port) not in headers
            assert "127.0.0.1" not in resp.text

    run(main)


def test_every_prefill_estimate_is_handed_back(tmp_path: Path) -> None:
    """Streams (at their first chunk), whole answers and abandoned streams all return
    their prefill estimate: the backlog the router balances on drains to zero."""

    async def main() -> None:
        async with stack(tmp_path, replicas=2) as s, s.client("alice") as alice:
            router = s.gateway.gateway.replicas.router
            body = {"model": MODEL, "prompt": prompt("backlog"), "max_tokens": 30, "stream": True}
            async with alice.stream("POST", "/v1/completions", json=body) as resp:
                async for _ in resp.aiter_bytes():
                    # mid-stream: the prompt is prefilled, the request still in flight
                    busy = [st for st in router.states if st.inflight]
                    assert len(busy) == 1 and busy[0].prefill == 0.0
                    break
            await asyncio.gather(
                *(complete(alice, prompt(f"whole {i}"), max_tokens=3) for i in range(4))
            )
            await eventually(
                lambda: all(st.inflight == 0 for st in router.states), what="nothing in flight"
            )
            assert all(st.prefill == 0.0 for st in router.states)

    run(main)
