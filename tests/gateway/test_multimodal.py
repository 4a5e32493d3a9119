"""Issue 40's multimodal rows, through a real gateway in front of the simulator.

The simulator keys its multimodal caches as vLLM does (a part's uuid verbatim, else a
content hash; no salt: saltgate/sim/multimodal.py), so each test has a positive control
that leaks: tenant B talking to the replica directly, or the gateway with salting off.
Tenant A ("alice") sends first, tenant B ("bob") attacks.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.gateway.stack import MODEL, Stack, run, stack
from tests.support.adversarial_media import (
    Case,
    cases,
    data_url,
    embeds_cases,
    remote_cases,
)
from tests.support.http import async_client

from saltgate.sim.multimodal import MediaCache, features
from saltgate.sim.tokenizer import apply_chat_template

CHAT = "/v1/chat/completions"
ALICE_IMAGE = data_url("alice's scan of a passport ", 4000)  # 70 feature tokens
BOB_IMAGE = data_url("bob's doodle ", 100)  # 9 feature tokens


def image(url: str | None, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": None if url is None else {"url": url}, **extra}


def ask(*parts: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "describe"}, *parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def prompt_tokens_with(url: str) -> int:
    """The prompt length of ask(image(url)) when built from the image at ``url``."""
    raw = base64.b64decode(url.partition(",")[2])
    parts = [
        {"type": "text", "text": "describe"},
        {"type": "text", "text": "<image>" + features(raw)},
    ]
    return len(apply_chat_template([{"role": "user", "content": parts}]))


def media(s: Stack) -> MediaCache:
    return s.sims[0].server.media


def replica_uuid(s: Stack) -> str:
    """The uuid the replica saw on the last request's first image part."""
    body = orjson.loads(s.forwarded()[-1].body)
    parts = body["messages"][0]["content"]
    uuid: str = next(p["uuid"] for p in parts if p.get("type") == "image_url")
    return uuid


async def usage(client: httpx.AsyncClient, body: dict[str, Any], url: str = CHAT) -> int:
    resp = await client.post(url, json=body)
    assert resp.status_code == 200, resp.text
    tokens: int = resp.json()["usage"]["prompt_tokens"]
    return tokens


def test_simulator_builds_prompts_from_features() -> None:
    assert prompt_tokens_with(ALICE_IMAGE) != prompt_tokens_with(BOB_IMAGE)


def test_another_tenant_s_uuid_never_selects_its_image(tmp_path: Path) -> None:
    """Row 1: B's part carries A's uuid (the one A sent, and the one the replica saw)."""

    async def main() -> None:
        async with (
            stack(tmp_path, replicas=1) as s,
            s.client("alice") as alice,
            s.client("bob") as bob,
        ):
            mine = await usage(alice, ask(image(ALICE_IMAGE, uuid="alice-cat")))
            assert mine == prompt_tokens_with(ALICE_IMAGE)
            seen = replica_uuid(s)
            assert seen.startswith("sg1m_")  # the client's uuid did not reach it
            for uuid in ("alice-cat", seen):
                got = await usage(bob, ask(image(BOB_IMAGE, uuid=uuid)))
                assert got == prompt_tokens_with(BOB_IMAGE)  # built from B's own image
            assert media(s).hits_by_key[seen] == 0
            # Positive control: B straight to the replica, with the uuid it saw.
            async with async_client(base_url=s.sims[0].url, timeout=30) as direct:
                leaked = await usage(direct, ask(image(BOB_IMAGE, uuid=seen)))
            assert leaked == prompt_tokens_with(ALICE_IMAGE)  # B's prompt: A's image
            assert media(s).hits_by_key[seen] == 1

    run(main)


def test_a_uuid_only_part_is_refused_so_it_is_no_oracle(tmp_path: Path) -> None:
    """Row 1, null media: vLLM answers a cached uuid (200, with its image) apart from an
    unknown one (400 cache miss); the gateway answers both the same, before any replica."""

    async def main() -> None:
        async with (
            stack(tmp_path, replicas=1) as s,
            s.client("alice") as alice,
            s.client("bob") as bob,
        ):
            await usage(alice, ask(image(ALICE_IMAGE)))
            seen = replica_uuid(s)
            before = len(s.forwarded())
            answers = []
            for uuid in ("sg1m_" + "x" * 43, seen):
                resp = await bob.post(CHAT, json=ask(image(None, uuid=uuid)))
                assert resp.status_code == 400
                error = resp.json()["error"]
                assert error["code"] == "missing_media"
                assert error["param"] == "messages[0].content[1].image_url"
                answers.append(resp.content)
            assert answers[0] == answers[1]
            assert len(s.forwarded()) == before
            async with async_client(base_url=s.sims[0].url, timeout=30) as direct:
                hit = await usage(direct, ask(image(None, uuid=seen)))
                miss = await direct.post(CHAT, json=ask(image(None, uuid="sg1m_" + "x" * 43)))
            assert hit == prompt_tokens_with(ALICE_IMAGE)  # control: the leak and the oracle
            assert miss.status_code == 400
            assert "Cache miss for image at index 0" in miss.text

    run(main)


@pytest.mark.parametrize("salting", [True, False])
def test_same_bytes_hit_within_a_tenant_never_across(tmp_path: Path, salting: bool) -> None:
    """Row 3: the content hash is shared; the gateway's uuid makes it per namespace.
    ``salting=False`` (no uuid set) is the positive control: B hits A's entry."""

    async def main() -> None:
        async with stack(tmp_path, replicas=1, salting=salting) as s:
            cache = media(s)
            async with s.client("alice") as alice, s.client("bob") as bob:
                await usage(alice, ask(image(ALICE_IMAGE)))
                alice_key = cache.stored[-1]
                await usage(alice, ask(image(ALICE_IMAGE)))
                assert cache.hits_by_key[alice_key] == 1  # within A: the caches still hit
                await usage(bob, ask(image(ALICE_IMAGE)))
                assert cache.hits_by_key[alice_key] == (1 if salting else 2)
                if salting:
                    bob_key = cache.stored[-1]
                    assert bob_key != alice_key
                    await usage(bob, ask(image(ALICE_IMAGE)))
                    assert cache.hits_by_key[bob_key] == 1  # within B too

    run(main)


def _code(resp: httpx.Response, route: str) -> str:
    doc = resp.json()
    if route.startswith("/v1/messages"):
        assert doc["type"] == "error"  # Anthropic's shape on Anthropic's routes
        return str(doc["error"]["message"])
    return str(doc["error"]["code"])


async def _refused_before_any_replica(s: Stack, batch: list[Case]) -> list[httpx.Response]:
    before = len(s.forwarded())
    out = []
    async with s.client("bob") as bob:
        for case in batch:
            resp = await bob.post(case.route, json={"model": MODEL, **case.body})
            assert resp.status_code == 400, (case.name, resp.text)
            out.append(resp)
    assert s.forwarded()[before:] == []
    return out


def test_remote_media_is_refused_and_never_reaches_a_replica(tmp_path: Path) -> None:
    """Row 2: 169.254.169.254, loopback ports (Anthropic url image to 127.0.0.1:22), every
    modality and route."""

    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            batch = list(remote_cases())
            for case, resp in zip(batch, await _refused_before_any_replica(s, batch), strict=True):
                said = _code(resp, case.route)
                if "file:" in case.name:
                    assert "data: URL" in said or said == "invalid_media_url", case.name
                elif case.route.startswith("/v1/messages"):
                    assert "remote media URLs are not accepted" in said, case.name
                else:
                    assert said == "remote_media_refused", case.name
                    assert "fetch" in resp.json()["error"]["message"]

    run(main)


def test_embeds_are_refused_and_never_reach_a_replica(tmp_path: Path) -> None:
    """Row 4: *_embeds parts and the prompt_embeds field."""

    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            for resp in await _refused_before_any_replica(s, list(embeds_cases())):
                assert resp.json()["error"]["code"] == "embeds_refused"

    run(main)


def test_mm_kwargs_never_reach_a_replica(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("bob") as bob:
            body = ask(image(BOB_IMAGE))
            body["mm_processor_kwargs"] = {"max_pixels": 1 << 30}
            body["media_io_kwargs"] = {"video": {"num_frames": 100000}}
            await usage(bob, body)
            seen = orjson.loads(s.forwarded()[-1].body)
            assert "mm_processor_kwargs" not in seen
            assert "media_io_kwargs" not in seen

    run(main)


async def _attack(target: httpx.AsyncClient, corpus: list[Case]) -> list[httpx.Response]:
    out = []
    for case in corpus:
        if case.raw is not None:
            headers = {"content-type": "application/json"}
            resp = await target.post(case.route, content=case.raw, headers=headers)
        else:
            resp = await target.post(case.route, json={"model": MODEL, **case.body})
        assert resp.status_code < 500, (case.name, resp.text)
        out.append(resp)
    return out


def test_adversarial_corpus_never_reaches_another_tenant_s_media(tmp_path: Path) -> None:
    """Every case of the corpus (tests/support/adversarial_media.py) from B, after A cached
    an image: no request a replica receives carries A's uuid, no answer carries it or
    A's media, and A's cache entry never serves B. Control: the same corpus sent to the
    replica directly does reach A's entry."""

    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            cache = media(s)
            async with s.client("alice") as alice:
                await usage(alice, ask(image(ALICE_IMAGE, uuid="alice-cat")))
            seen = replica_uuid(s)
            alice_b64 = ALICE_IMAGE.partition(",")[2].encode()
            corpus = cases(["alice-cat", seen], BOB_IMAGE, MODEL)
            before = len(s.forwarded())
            async with s.client("bob") as bob:
                answers = await _attack(bob, corpus)
            reached = s.forwarded()[before:]
            assert reached, "the corpus must also hold cases that reach the replica"
            for request in reached:
                assert b"alice-cat" not in request.body
                assert seen.encode() not in request.body
                assert alice_b64 not in request.body
            for case, resp in zip(corpus, answers, strict=True):
                assert b"alice-cat" not in resp.content, case.name
                assert seen.encode() not in resp.content, case.name
                assert alice_b64[:64] not in resp.content, case.name
            assert cache.hits_by_key[seen] == 0
            async with async_client(base_url=s.sims[0].url, timeout=30) as direct:
                await _attack(direct, corpus)
            assert cache.hits_by_key[seen] > 0  # the control: the corpus does reach it

    run(main)
