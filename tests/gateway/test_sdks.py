"""The official client packages, unchanged, end to end through the gateway.

`openai` (chat completions, completions, responses) and `anthropic` (messages, with
`x-api-key` and with a Bearer `auth_token`), each streaming and not, against simulated
replicas behind a recording tap: the answer arrives, the usage the SDK reports is what the
ledger metered, a repeat is served from the cache, and the replica only ever saw the
tenant's derived salt, even when the client passed its own in `extra_body`.
tests/conformance/test_vllm_sdks.py runs the same suites against real vLLM.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import orjson
import pytest
from tests.gateway.stack import MODEL, Stack, ledger_rows, long_prompt, run, stack
from tests.support.sdks import (
    ANTHROPIC_AUTHS,
    SMUGGLED,
    AnthropicCall,
    OpenAICall,
    anthropic_call,
    anthropic_client,
    openai_call,
)
from tests.support.up import saltgate_up

from saltgate.config import load_master_key
from saltgate.derivations.derive import cache_salt, derive_subkeys
from saltgate.store.tenants import TenantStore


def tenant_salt(s: Stack, tenant: str) -> str:
    master = load_master_key(s.state_dir / "master.key")
    with TenantStore.from_state_dir(s.state_dir) as store:
        tenant_id = store.get_tenant(tenant).id
    return cache_salt(derive_subkeys(master).salt, tenant_id, "0", None)


def replicas_saw_only(s: Stack, salt: str) -> None:
    docs = [orjson.loads(body) for body in s.seen_bodies()]
    assert docs and {d.get("cache_salt") for d in docs} == {salt}
    assert not any(set(d) & {"vllm_xargs", "kv_transfer_params"} for d in docs)


def metered_as_reported(s: Stack, reported: list[tuple[int, int, int]]) -> None:
    rows = ledger_rows(s)
    got = [(r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"]) for r in rows]
    assert got == reported
    assert all(r["status"] == 200 for r in rows)


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_openai_client(tmp_path: Path, api: str, stream: bool) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            client = openai.AsyncOpenAI(
                base_url=f"{s.url}/v1", api_key=s.keys["alice"], max_retries=0
            )
            prompt = long_prompt(f"openai-{api}", 300)
            first: OpenAICall = await openai_call(client, api, MODEL, prompt, stream=stream)
            again = await openai_call(
                client, api, MODEL, prompt, stream=stream, extra_body=SMUGGLED
            )
            await client.close()
            for call in (first, again):
                assert call.text and call.prompt_tokens > 0 and call.completion_tokens > 0
            assert first.cached_tokens == 0 and again.cached_tokens > 0  # from the cache
            replicas_saw_only(s, tenant_salt(s, "alice"))
            metered_as_reported(s, [first.usage, again.usage])

    run(main)


@pytest.mark.parametrize("auth", ANTHROPIC_AUTHS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_anthropic_client(tmp_path: Path, auth: str, stream: bool) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            key = s.keys["alice"]
            sdk = anthropic_client(s.url, key, auth)
            client = sdk.client
            prompt = long_prompt(f"anthropic-{auth}", 300)
            first: AnthropicCall = await anthropic_call(client, MODEL, prompt, stream=stream)
            again = await anthropic_call(client, MODEL, prompt, stream=stream, extra_body=SMUGGLED)
            await client.close()
            # The key went in the header this case names, and only there.
            assert sdk.credentials() == [sdk.expected(auth, key)] * 2
            for call in (first, again):
                assert call.text and call.prompt_tokens > 0 and call.output_tokens > 0
            assert first.cache_read == 0 and again.cache_read > 0
            replicas_saw_only(s, tenant_salt(s, "alice"))
            metered_as_reported(s, [first.usage, again.usage])
            sent = [r for r in s.forwarded() if r.path == b"/v1/messages"]
            # Both calls, as the replica got them: the checks below are over something.
            assert len(sent) == 2, [r.path for r in s.forwarded()]
            for r in sent:  # the tenant's key never reaches a replica, in either header
                bearer = r.header(b"authorization") or b""
                assert r.header(b"x-api-key") is None and key.encode() not in bearer, (
                    "the tenant's key reached a replica"
                )
            assert all(r.header(b"anthropic-version") for r in sent)

    run(main)


def test_a_wrong_key_is_an_sdk_authentication_error(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            bad_openai = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="sg_no", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad_openai.models.list()
            await bad_openai.close()
            bad = anthropic.AsyncAnthropic(base_url=s.url, api_key="sg_no", max_retries=0)
            with pytest.raises(anthropic.AuthenticationError):
                await anthropic_call(bad, MODEL, "hi", stream=False)
            await bad.close()
            assert s.forwarded() == []

    run(main)


def test_both_sdks_against_saltgate_up_as_a_user_starts_it(tmp_path: Path) -> None:
    """`make up`'s command, in its own process, with the demo key it prints."""

    async def main() -> None:
        async with saltgate_up(tmp_path / "state") as up:
            oai = openai.AsyncOpenAI(base_url=f"{up.url}/v1", api_key=up.api_key(), max_retries=0)
            for api in ("chat", "completions", "responses"):
                for stream in (False, True):
                    call = await openai_call(oai, api, MODEL, "hello there", stream=stream)
                    assert call.text and call.completion_tokens > 0, (api, stream)
            await oai.close()
            ant = anthropic.AsyncAnthropic(base_url=up.url, api_key=up.api_key(), max_retries=0)
            for stream in (False, True):
                reply = await anthropic_call(ant, MODEL, "hello there", stream=stream)
                assert reply.text and reply.output_tokens > 0
            await ant.close()

    run(main)
