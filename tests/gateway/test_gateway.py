"""The trusted gateway end to end: real simulated replicas, real HTTP, real SQLite."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
from tests.gateway.stack import MODEL, ledger_rows, long_prompt, run, stack
from tests.support.completions import cached, complete
from tests.support.leaks import leaks
from tests.support.waiting import eventually

from saltgate.config import load_master_key
from saltgate.derivations.derive import cache_salt, derive_subkeys
from saltgate.store.tenants import TenantStore


@pytest.mark.parametrize("salting", [True, False], ids=["salted", "control-unsalted"])
def test_tenants_do_not_share_cache_unless_salting_is_off(tmp_path: Path, salting: bool) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1, salting=salting) as s:
            prompt = long_prompt("iso")
            async with s.client("alice") as alice, s.client("bob") as bob:
                assert cached(await complete(alice, prompt)) == 0
                assert cached(await complete(alice, prompt)) > 0
                cross = cached(await complete(bob, prompt))
            if salting:
                assert cross == 0
            else:  # positive control: the same probe detects sharing when salting is off
                assert cross > 0

    run(main)


def test_key_rotation_keeps_the_cache_and_salt_rotation_moves_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            prompt = long_prompt("rot")
            async with s.client("alice") as alice:
                await complete(alice, prompt)
            with TenantStore.from_state_dir(s.state_dir) as store:
                old_id = store.list_keys("alice")[0].id
                new_key = store.create_key("alice")[1]
                store.revoke_key(old_id)
            async with s.client("alice") as old:

                async def refused() -> bool:
                    resp = await old.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
                    assert resp.status_code in (200, 401), resp.text
                    return resp.status_code == 401

                await eventually(refused, what="the revoked key is refused")
            s.keys["alice"] = new_key
            async with s.client("alice") as alice:
                assert cached(await complete(alice, prompt)) > 0
                with TenantStore.from_state_dir(s.state_dir) as store:
                    store.rotate_salt("alice")

                async def cold() -> bool:  # a cache hit means the old namespace, still
                    return cached(await complete(alice, prompt)) == 0

                await eventually(cold, what="the new epoch's namespace is used")

    run(main)


SMUGGLED = [
    b'{"model":"sim-model","prompt":"P","cache_salt":"victim-salt"}',
    b'{"model":"sim-model","prompt":"P","cache_salt":12345}',
    b'{"model":"sim-model","prompt":"P","cache\\u005fsalt":"victim-salt"}',
    b'{"model":"sim-model","prompt":"P","cache_salt":{"nested":"victim-salt"}}',
    b'{"model":"sim-model","prompt":"P","user_cache_secret":"0123456789abcdef-victim",'
    b'"vllm_xargs":{"kv_cache_report_mode":"full"},"kv_transfer_params":{"a":1}}',
]


def test_client_supplied_salts_and_dangerous_fields_never_reach_a_replica(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("alice") as alice:
            base = (
                await alice.post("/v1/completions", json={"model": MODEL, "prompt": "P"})
            ).status_code
            assert base == 200
            for body in SMUGGLED:
                resp = await alice.post(
                    "/v1/completions",
                    content=body,
                    headers={"content-type": "application/json", "x-tenant-id": "victim"},
                )
                assert resp.status_code == 200, resp.text
            # a duplicated key is refused outright: nothing is forwarded
            dup = b'{"model":"sim-model","prompt":"P","cache_salt":"a","cache_salt":"victim-salt"}'
            before = len(s.seen_bodies())
            resp = await alice.post("/v1/completions", content=dup)
            assert resp.status_code == 400
            assert "duplicate" in resp.json()["error"]["message"].lower()
            assert len(s.seen_bodies()) == before
            master = load_master_key(s.state_dir / "master.key")
            k_salt = derive_subkeys(master).salt
            with TenantStore.from_state_dir(s.state_dir) as store:
                alice_id = store.get_tenant("alice").id
            tenant_salt = cache_salt(k_salt, alice_id, "0", None)
            user_salt = cache_salt(k_salt, alice_id, "0", "0123456789abcdef-victim")
            salts = []
            for request in s.forwarded():
                assert b"victim" not in request.body
                doc = orjson.loads(request.body)
                assert set(doc) & {"user_cache_secret", "vllm_xargs", "kv_transfer_params"} == set()
                salts.append(doc["cache_salt"])
                names = {k for k, _ in request.headers}
                assert b"x-tenant-id" not in names
                assert request.header(b"authorization") is None  # no replica key configured
            # every request landed in alice's namespace; the one with a secret in her user's
            assert salts == [tenant_salt] * 5 + [user_salt]

    run(main)


BAD_REQUESTS: list[tuple[str, str, bytes | None, dict[str, str], int]] = [
    ("POST", "/v1/completions", b"{not json", {}, 400),
    ("POST", "/v1/completions", b"[1,2,3]", {}, 400),
    ("POST", "/v1/completions", b'"just a string"', {}, 400),
    ("POST", "/v1/completions", b"\xff\xfe{}", {}, 400),
    ("POST", "/v1/completions", b'{"model":"sim-model","prompt":"x","stream":"yes"}', {}, 400),
    ("POST", "/v1/completions", b'{"model":123,"prompt":"x"}', {}, 400),
    ("POST", "/v1/completions", b'{"prompt":"x"}', {}, 400),
    ("POST", "/v1/completions", b'{"model":"sim-model","prompt":"x","max_tokens":-1}', {}, 400),
    (
        "POST",
        "/v1/completions",
        b'{"model":"sim-model","prompt":"x","user_cache_secret":7}',
        {},
        400,
    ),
    ("POST", "/v1/completions", b'{"model":"sim-model","prompt":"x"' + b"," * 10 + b"}", {}, 400),
    (
        "POST",
        "/v1/completions",
        b'{"model":"sim-model","prompt":"' + b"a" * 2_000_000 + b'"}',
        {},
        413,
    ),
    ("POST", "/v1/audio/transcriptions", b"--b--", {}, 404),
    ("GET", "/admin/secrets", None, {}, 404),
    ("DELETE", "/v1/completions", None, {}, 405),
    ("POST", "/v1/completions", b'{"model":"no-such-model","prompt":"x"}', {}, 404),
    (
        "POST",
        "/v1/completions",
        b'{"model":"sim-model","prompt":"x"}',
        {"authorization": "Bearer sg_wrong"},
        401,
    ),
    ("POST", "/v1/completions", b'{"model":"sim-model","prompt":"x"}', {"authorization": ""}, 401),
]


def test_bad_input_gets_a_clear_4xx_and_the_gateway_keeps_serving(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("alice") as alice:
            for method, path, body, headers, status in BAD_REQUESTS:
                resp = await alice.request(method, path, content=body, headers=headers)
                assert resp.status_code == status, (path, body and body[:60], resp.text[:200])
                error = resp.json()["error"]
                assert isinstance(error["message"], str) and len(error["message"]) > 10
                assert s.keys["alice"] not in resp.text
            assert cached(await complete(alice, "still serving")) == 0
            async with s.client() as anonymous:
                resp = await anonymous.post("/v1/completions", json={"model": MODEL})
                assert resp.status_code == 401
                assert resp.json()["error"]["type"] == "authentication_error"
                assert (await anonymous.get("/health")).status_code == 200

    run(main)


def test_usage_is_metered_as_the_replica_reported_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("alice") as alice:
            prompt = long_prompt("meter")
            reported = []
            for _ in range(2):
                doc = await complete(alice, prompt, max_tokens=5)
                reported.append(doc["usage"])
            for include_usage in (True, False):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": True}
                if include_usage:
                    body["stream_options"] = {"include_usage": True}
                async with alice.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    events = [line async for line in resp.aiter_lines() if line.startswith("data:")]
                assert events[-1] == "data: [DONE]"
                usage_events = [e for e in events if '"usage":{' in e]
                if include_usage:
                    assert len(usage_events) == 1
                    reported.append(orjson.loads(usage_events[0][5:])["usage"])
                else:  # the gateway asked for usage for metering, and removed it again
                    assert usage_events == []
            rows = ledger_rows(s)
            assert len(rows) == 4
            for row, usage in zip(rows, reported, strict=False):
                assert row["prompt_tokens"] == usage["prompt_tokens"]
                assert row["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
                assert row["completion_tokens"] == usage["completion_tokens"]
                assert row["status"] == 200
            assert rows[3]["completion_tokens"] == 3 and rows[3]["cached_tokens"] > 0

    run(main)


def test_chat_streams_pass_through_and_responses_hide_the_replica(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=2) as s, s.client("alice") as alice:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 4,
                "stream": True,
            }
            async with alice.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.headers["content-type"].startswith("text/event-stream")
                assert "server" not in resp.headers
                streamed_id = resp.headers["x-request-id"]  # the gateway's, not the replica's
                chunks = [line async for line in resp.aiter_lines() if line.startswith("data: {")]
            text = "".join(
                orjson.loads(c[6:])["choices"][0]["delta"].get("content", "") for c in chunks
            )
            assert text
            resp = await alice.post("/v1/chat/completions", json={**body, "stream": False})
            assert "server" not in resp.headers
            ids = [streamed_id, resp.headers["x-request-id"]]
            assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1]
            assert {r.header(b"x-request-id") for r in s.forwarded()} == {i.encode() for i in ids}
            models = (await alice.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [MODEL]

    run(main)


def test_metrics_carry_no_secrets(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("alice") as alice:
            doc = await complete(alice, "metrics")
            assert doc["usage"]["prompt_tokens"] > 0
            master = load_master_key(s.state_dir / "master.key")
            secrets = {
                "api_key": s.keys["alice"],
                "salt": orjson.loads(s.seen_bodies()[-1])["cache_salt"],
                "master_key": master,
                "salt_key": derive_subkeys(master).salt,
            }

            scrape = s.scrape
            text = await scrape()
            assert 'saltgate_requests_total{method="POST",status="200"} 1.0' in text
            assert "saltgate_tokens_total" in text
            assert not leaks(text, **secrets)
            # Positive control: each secret, once in the gateway's own metrics, is found by
            # the same scan of the same endpoint.
            for name, secret in secrets.items():
                s.gateway.gateway.metrics.inc("saltgate_planted_total", ((name, f"{secret!r}"),))
            assert leaks(await scrape(), **secrets).keys() == secrets.keys()

    run(main)
