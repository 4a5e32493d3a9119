"""Every route the gateway forwards gets the same policy: authenticated, stripped, salted
where vLLM's cache serves it, metered. Through a real gateway in front of simulated
replicas, with a tap recording the exact bytes each replica received."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from tests.gateway.stack import MODEL, ledger_rows, run, stack
from tests.policy.test_request import SALTED
from tests.support.http import async_client

from saltgate.config import load_master_key
from saltgate.derivations.derive import cache_salt, derive_subkeys
from saltgate.policy.request import (
    ALLOWED_POST_ROUTES,
    GENERATION_ROUTES,
    POOLING_ROUTES,
    TOKENIZER_ROUTES,
)
from saltgate.store.tenants import TenantStore

TEXT = "the quick brown fox jumps over the lazy dog " * 8
USER_TURN = [{"role": "user", "content": TEXT}]
ROUTE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": USER_TURN, "max_tokens": 2},
    "/v1/completions": {"prompt": TEXT, "max_tokens": 2},
    "/v1/responses": {"input": TEXT, "max_output_tokens": 2},
    "/v1/messages": {"messages": USER_TURN, "max_tokens": 2},
    "/v1/messages/count_tokens": {"messages": USER_TURN},
    "/v1/embeddings": {"input": TEXT},
    "/pooling": {"input": TEXT},
    "/classify": {"input": TEXT},
    "/score": {"text_1": TEXT, "text_2": "a dog"},
    "/v1/score": {"text_1": TEXT, "text_2": "a dog"},
    "/rerank": {"query": TEXT, "documents": ["a dog", "a fox"]},
    "/v1/rerank": {"query": TEXT, "documents": ["a dog", "a fox"]},
    "/v2/rerank": {"query": TEXT, "documents": ["a dog", "a fox"]},
    "/tokenize": {"prompt": TEXT},
    "/detokenize": {"tokens": [1, 2, 3]},
}
SMUGGLED = {
    "cache_salt": "victim-salt",
    "vllm_xargs": {"kv_cache_report_mode": "all"},
    "kv_transfer_params": {"remote_block_ids": [1]},
    "ec_transfer_params": {"x": 1},
}


def test_every_route_has_a_body_here() -> None:
    assert set(ROUTE_BODIES) == set(ALLOWED_POST_ROUTES)


def test_every_route_is_authenticated_stripped_salted_and_metered(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            async with s.client() as anonymous:
                for route, body in ROUTE_BODIES.items():
                    resp = await anonymous.post(route, json={"model": MODEL, **body})
                    assert resp.status_code == 401, route
            assert s.forwarded() == []
            async with s.client("alice") as alice:
                for route, body in ROUTE_BODIES.items():
                    resp = await alice.post(route, json={"model": MODEL, **body, **SMUGGLED})
                    assert resp.status_code == 200, (route, resp.text)
            master = load_master_key(s.state_dir / "master.key")
            with TenantStore.from_state_dir(s.state_dir) as store:
                alice_id = store.get_tenant("alice").id
            salt = cache_salt(derive_subkeys(master).salt, alice_id, "0", None)
            seen = {r.path.decode(): orjson.loads(r.body) for r in s.forwarded()}
            # The client's salt is nowhere, not even as a duplicate key the parse would hide.
            assert not [r.path for r in s.forwarded() if b"victim-salt" in r.body]
            assert set(seen) == set(ROUTE_BODIES)
            for route, doc in seen.items():
                assert not set(doc) & set(SMUGGLED) - {"cache_salt"}, route
                assert doc.get("cache_salt") == (salt if SALTED[route] else None), route
            rows = {r["request_id"]: r for r in ledger_rows(s)}
            assert len(rows) == len(ROUTE_BODIES)
            for row in rows.values():
                assert row["status"] == 200 and row["tenant_id"] == alice_id
            prompts = sorted(r["prompt_tokens"] for r in rows.values())
            metered = len(GENERATION_ROUTES) + len(POOLING_ROUTES)
            assert all(p > 0 for p in prompts[-metered:])
            assert prompts[: len(TOKENIZER_ROUTES)] == [0] * len(TOKENIZER_ROUTES)

    run(main)


@pytest.mark.parametrize("route", sorted(POOLING_ROUTES))
def test_positive_control_a_tap_would_see_a_client_salt_that_got_through(
    tmp_path: Path, route: str
) -> None:
    """The check above reads the tap's record of what a replica received: sent past the
    gateway's policy (straight to the tap), the client's salt is there for it to find."""

    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            async with async_client(base_url=f"http://127.0.0.1:{s.taps[0].port}") as direct:
                body = {"model": MODEL, **ROUTE_BODIES[route], **SMUGGLED}
                resp = await direct.post(route, json=body)
                assert resp.status_code == 200, resp.text
            [request] = s.forwarded()
            assert orjson.loads(request.body)["cache_salt"] == "victim-salt"

    run(main)


def test_closed_routes_say_why_and_forward_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("alice") as alice:
            resp = await alice.post("/v1/audio/transcriptions", content=b"--boundary--")
            assert resp.status_code == 404
            assert resp.json()["error"]["code"] == "route_closed"
            assert "multipart" in resp.json()["error"]["message"]
            assert s.forwarded() == []

    run(main)
