"""Client-keyed mode end to end: the SDK with the official `openai` package against a real
stack over loopback, the operator probe, users who must not share, and key rotation."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from tests.gateway.stack import MODEL, Stack, long_prompt, run, stack

from saltgate.client import async_openai_client, openai_client
from saltgate.client.secret import ENV_VAR, SECRET_FILE
from saltgate.client.transport import GatewayKeyError
from saltgate.ehbp.frames import Keyring, ServerKey

SECRET_A = "user-a-" + "1" * 40
SECRET_B = "user-b-" + "2" * 40


def sdk(s: Stack, home: Path, secret: str | None = None, **kw: Any) -> openai.AsyncOpenAI:
    return async_openai_client(
        s.url + "/v1", s.keys["alice"], user_cache_secret=secret, state_dir=home, **kw
    )


async def cached_completion(client: openai.AsyncOpenAI, prompt: str) -> int:
    done = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    return done.usage.prompt_tokens_details.cached_tokens or 0


async def plaintext_cached(s: Stack, prompt: str, **extra: Any) -> int:
    async with s.client("alice") as plain:
        resp = await plain.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
        )
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_openai_package_works_through_the_sdk_streaming_and_not(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            client = sdk(s, tmp_path / "home", SECRET_A)
            prompt = long_prompt("sdk")
            messages: Any = [{"role": "user", "content": prompt}]
            chat = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=3
            )
            assert chat.choices[0].message.content
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            usage = chunks[-1].usage
            assert usage is not None and usage.prompt_tokens_details is not None
            assert (usage.prompt_tokens_details.cached_tokens or 0) > 0  # same user: a hit
            text = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert text.choices[0].text
            streamed = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=3, stream=True
            )
            assert [c.choices[0].text async for c in streamed if c.choices]
            await client.close()
            docs = [orjson.loads(b) for b in s.seen_bodies()]
            assert len(docs) == 4
            assert {d["cache_salt"] for d in docs} == {s.salt("alice", SECRET_A)}
            assert not any(SECRET_A.encode() in b for b in s.seen_bodies())

    run(main)


def test_the_synchronous_openai_client_works_too(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:

            def use_sync() -> tuple[str, list[str]]:
                with openai_client(
                    s.url + "/v1",
                    s.keys["alice"],
                    user_cache_secret=SECRET_A,
                    state_dir=tmp_path / "home",
                ) as client:
                    done = client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
                    stream = client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=3,
                        stream=True,
                    )
                    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
                    return done.choices[0].text, parts

            text, parts = await asyncio.to_thread(use_sync)
            assert text and "".join(parts)
            assert len(s.forwarded()) == 2

    run(main)


def test_the_operator_with_the_tenant_key_but_not_the_secret_cannot_probe(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            prompt = long_prompt("victim")
            user = sdk(s, tmp_path / "home", SECRET_A)
            assert await cached_completion(user, prompt) == 0  # the user warms the prefix
            # the operator: plaintext with the API key, no secret (tenant-wide namespace)
            assert await plaintext_cached(s, prompt) == 0
            # ...or with a guessed secret, or through EHBP without the secret
            assert await plaintext_cached(s, prompt, user_cache_secret="guess-" + "0" * 40) == 0
            operator = sdk(s, tmp_path / "operator", "other-" + "9" * 40)
            assert await cached_completion(operator, prompt) == 0
            # positive control: the same probe detects the hit when it holds the secret
            again = sdk(s, tmp_path / "home2", SECRET_A)
            assert await cached_completion(again, prompt) > 0
            assert await plaintext_cached(s, prompt, user_cache_secret=SECRET_A) > 0

    run(main)


def test_two_users_of_one_tenant_with_different_secrets_do_not_share(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            prompt = long_prompt("shared-doc")
            a = sdk(s, tmp_path / "a")  # each mints its own secret file
            b = sdk(s, tmp_path / "b")
            assert await cached_completion(a, prompt) == 0
            assert await cached_completion(b, prompt) == 0
            assert await cached_completion(a, prompt) > 0
            assert await cached_completion(b, prompt) > 0
            salts = {orjson.loads(x)["cache_salt"] for x in s.seen_bodies()}
            assert len(salts) == 2
            assert (tmp_path / "a" / SECRET_FILE).read_text() != (
                tmp_path / "b" / SECRET_FILE
            ).read_text()

    run(main)


SDK_SCRIPT = """
import sys
from pathlib import Path
from saltgate.client import openai_client
url, key, home, prompt = sys.argv[1:]
with openai_client(url, key, state_dir=Path(home)) as client:
    done = client.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
print(done.usage.prompt_tokens_details.cached_tokens)
"""


def test_the_same_user_in_two_processes_shares_through_the_secret_file(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            home = tmp_path / "home"
            prompt = long_prompt("two-processes")
            env = {k: v for k, v in os.environ.items() if k != ENV_VAR}

            async def process() -> int:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    SDK_SCRIPT,
                    s.url + "/v1",
                    s.keys["alice"],
                    str(home),
                    prompt,
                    stdout=subprocess.PIPE,
                    env=env,
                )
                out, _ = await asyncio.wait_for(proc.communicate(), 60)
                assert proc.returncode == 0
                return int(out.decode().strip().splitlines()[-1])

            assert await process() == 0
            assert await process() > 0  # another process, the same secret file: a hit
            secret = (home / SECRET_FILE).read_text().strip()
            salts = {orjson.loads(x)["cache_salt"] for x in s.seen_bodies()}
            assert salts == {s.salt("alice", secret)}

    run(main)


def test_rotation_is_followed_only_to_a_pinned_key(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            edge = s.gateway.ehbp
            assert edge is not None
            old, new = edge.keyring.current, ServerKey.generate()
            pinned = sdk(
                s, tmp_path / "p", SECRET_A, pin=[old.config.fingerprint, new.config.fingerprint]
            )
            tofu = sdk(s, tmp_path / "t", SECRET_A)
            prompt = long_prompt("rotation")
            assert await cached_completion(pinned, prompt) == 0
            assert await cached_completion(tofu, prompt) > 0  # served, in the user's namespace
            edge.keyring = Keyring(new)  # the operator rotates; clients hold the old key
            # pinned to both: 422 key-config, refetch, the new key is pinned, resend once,
            # served in the same namespace (the salt does not depend on the gateway's key)
            assert await cached_completion(pinned, prompt) > 0
            # trusted on first use: a changed key is refused, not silently trusted
            with pytest.raises(GatewayKeyError, match="trusted on first use"):
                await tofu.completions.create(model=MODEL, prompt="after", max_tokens=1)
            assert len(s.forwarded()) == 3

    run(main)


def test_a_gateway_key_that_does_not_match_the_pin_is_never_used(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            wrong = ServerKey.generate().config.fingerprint
            client = sdk(s, tmp_path / "home", SECRET_A, pin=wrong)
            with pytest.raises(GatewayKeyError, match="not pinned"):
                await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
            assert s.forwarded() == []

    run(main)
