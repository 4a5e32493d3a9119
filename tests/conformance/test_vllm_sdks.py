"""The official client packages through saltgate in front of real vLLM 0.32 (issue 15;
`pytest -m vllm`): the same calls as tests/gateway/test_sdks.py, so the simulator's shapes
are proven, not assumed. Each test uses one replica, so a repeat finds its cache."""

from __future__ import annotations

import asyncio
import secrets

import openai
import pytest
from tests.conformance.fleet import (
    MODEL_NAME,
    Fleet,
    Tenancy,
    events_since,
    gateway,
    next_seq,
    stored,
)
from tests.gateway.stack import long_prompt
from tests.support.sdks import (
    ANTHROPIC_AUTHS,
    SMUGGLED,
    anthropic_call,
    anthropic_client,
    openai_call,
)

from saltgate.derivations.derive import cache_salt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RUN = secrets.token_hex(3)


def salt_of(tenancy: Tenancy) -> str:
    return cache_salt(tenancy.subkeys.salt, tenancy.tenant_ids["alice"], "0", None)


def replica_saw_only(fleet: Fleet, start: int, salt: str) -> None:
    firsts = [
        e for e in stored(events_since(fleet.replicas[0], start)) if e.parent_block_hash is None
    ]
    assert firsts and {e.extra_keys[0] if e.extra_keys else None for e in firsts} == {(salt,)}


def test_12_the_openai_client_on_every_api(fleet: Fleet, tenancy: Tenancy) -> None:
    async def main() -> None:
        start = next_seq(fleet.replicas[0])
        async with gateway(fleet, tenancy, replicas=(0,)) as url:
            client = openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key=tenancy.keys["alice"], max_retries=0
            )
            for api in ("chat", "completions", "responses"):
                for stream in (False, True):
                    prompt = long_prompt(f"sdk{RUN}{api}{stream}", 30)
                    first = await openai_call(client, api, MODEL_NAME, prompt, stream=stream)
                    again = await openai_call(
                        client, api, MODEL_NAME, prompt, stream=stream, extra_body=SMUGGLED
                    )
                    what = f"{api} stream={stream}"
                    assert first.prompt_tokens > 16 and first.completion_tokens > 0, what
                    assert first.cached_tokens == 0 and again.cached_tokens > 0, what
            await client.close()
        replica_saw_only(fleet, start, salt_of(tenancy))

    asyncio.run(main())


def test_13_the_anthropic_client_with_both_kinds_of_key(fleet: Fleet, tenancy: Tenancy) -> None:
    async def main() -> None:
        start = next_seq(fleet.replicas[0])
        key = tenancy.keys["alice"]
        async with gateway(fleet, tenancy, replicas=(0,)) as url:
            for auth in ANTHROPIC_AUTHS:
                sdk = anthropic_client(url, key, auth)
                client = sdk.client
                for stream in (False, True):
                    prompt = long_prompt(f"sdk{RUN}{auth}{stream}", 30)
                    first = await anthropic_call(client, MODEL_NAME, prompt, stream=stream)
                    again = await anthropic_call(
                        client, MODEL_NAME, prompt, stream=stream, extra_body=SMUGGLED
                    )
                    what = f"{auth} stream={stream}"
                    assert first.prompt_tokens > 16 and first.output_tokens > 0, what
                    assert first.cache_read == 0 and again.cache_read > 0, what
                    assert again.prompt_tokens == first.prompt_tokens, what
                await client.close()
                # Each kind of key as its case names it: both cases are not one request.
                assert sdk.credentials() == [sdk.expected(auth, key)] * 4, auth
        replica_saw_only(fleet, start, salt_of(tenancy))

    asyncio.run(main())
