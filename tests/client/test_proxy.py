"""`saltgate proxy`: a plain OpenAI client gets client-keyed caching through it."""

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
from tests.gateway.stack import MODEL, long_prompt, run, stack
from tests.support.http import async_client

from saltgate.client.proxy import ProxyConfig, start_proxy
from saltgate.client.secret import ENV_VAR
from saltgate.client.transport import GatewayKeyError
from saltgate.ehbp.frames import ServerKey
from saltgate_devkit.procs import free_port

SECRET = "proxy-user-" + "7" * 40


def test_a_plain_openai_client_gets_client_keyed_caching(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            assert s.gateway.ehbp is not None
            config = ProxyConfig(
                s.url,
                s.keys["alice"],
                port=0,
                user_cache_secret=SECRET,
                pin=(s.gateway.ehbp.keyring.current.config.fingerprint,),
                state_dir=tmp_path / "home",
            )
            running = await start_proxy(config)
            try:
                client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="not-used")
                prompt = long_prompt("agent")
                messages: Any = [{"role": "user", "content": prompt}]
                first = await client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=2
                )
                assert first.usage is not None and first.usage.prompt_tokens_details is not None
                assert first.usage.prompt_tokens_details.cached_tokens == 0
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
                assert (usage.prompt_tokens_details.cached_tokens or 0) > 0
                text = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
                assert text.choices[0].text
                streamed = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=3, stream=True
                )
                assert [c async for c in streamed]
                models = await client.models.list()
                assert models.data
                await client.close()
            finally:
                await running.close()
            forwarded = s.seen_bodies()
            assert len(forwarded) == 4
            assert not any(SECRET.encode() in b for b in forwarded)
            assert {orjson.loads(b)["cache_salt"] for b in forwarded} == {s.salt("alice", SECRET)}
            # the proxy's salt is the user's, not the tenant-wide one
            async with s.client("alice") as plain:
                resp = await plain.post(
                    "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
                )
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    run(main)


def test_the_proxy_refuses_to_start_against_an_unpinned_key(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            config = ProxyConfig(
                s.url,
                s.keys["alice"],
                port=0,
                user_cache_secret=SECRET,
                pin=(ServerKey.generate().config.fingerprint,),
                state_dir=tmp_path / "home",
            )
            with pytest.raises(GatewayKeyError, match="not pinned"):
                await start_proxy(config)

    run(main)


def test_the_saltgate_proxy_command(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            port = free_port()
            # The key comes from the environment, so it is not in the process list.
            env = {
                **os.environ,
                "HOME": str(tmp_path / "home"),
                ENV_VAR: SECRET,
                "SALTGATE_API_KEY": s.keys["alice"],
            }
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "saltgate.cli",
                "proxy",
                "--upstream",
                s.url,
                "--port",
                str(port),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
            try:
                assert proc.stdout is not None and proc.stderr is not None
                banner = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
                assert f"http://127.0.0.1:{port}/v1" in banner
                assert "trust-on-first-use" in banner
                async with async_client(timeout=30) as client:
                    resp = await client.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
                    )
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"]
            finally:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 30)
            stderr = (await proc.stderr.read()).decode()
            assert "trusting gateway" in stderr  # trust on first use is announced
            assert SECRET not in stderr and s.keys["alice"] not in stderr
            assert proc.returncode == 0
            [proxied] = [orjson.loads(b)["cache_salt"] for b in s.seen_bodies()]
            # The same tenant without the secret: the replica sees another salt.
            async with s.client("alice") as plain:
                resp = await plain.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2}
                )
            assert resp.status_code == 200, resp.text
            tenant_wide = orjson.loads(s.seen_bodies()[-1])["cache_salt"]
            assert proxied == s.salt("alice", SECRET)  # derived from the user's secret
            assert tenant_wide == s.salt("alice") != proxied

    run(main)


def test_the_proxy_command_asks_for_a_key_it_was_not_given() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SALTGATE_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "saltgate.cli", "proxy", "--upstream", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "set SALTGATE_API_KEY (or pass --api-key)" in done.stderr
