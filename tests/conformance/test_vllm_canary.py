"""The isolation canary against real vLLM (issue 40; `pytest -m vllm`, docs/canary.md).

The gateway in front of the session's two replicas, the second reached through a proxy
that drops `cache_salt` from every request (what a misbuilt sidecar would do): the
canary passes on the salted replica, fails on the proxied one from vLLM's own cached-token
counts, takes it out of rotation before the gateway serves, and lets it back once the
proxy keeps the salt again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import orjson
import pytest
from tests.conformance.fleet import MODEL_NAME, Fleet, Tenancy
from tests.gateway.stack import CANARY_ID, long_prompt
from tests.support.http import async_client

from saltgate.config import CanaryConfig, GatewayConfig, ReplicaConfig
from saltgate.http import HttpServer, Request, Response, UpstreamPool
from saltgate.routing import ReplicaId, Verdict
from saltgate.serving.run import start_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

FAILURES = "saltgate_isolation_canary_failures_total"


@dataclass
class SaltDroppingProxy:
    """A pass-through front of a vLLM replica that removes `cache_salt` while `leaky`."""

    port: int
    leaky: bool = True
    tenant_posts: int = 0  # generation requests that were not the canary's
    canary_posts: int = 0
    server: HttpServer | None = field(default=None, repr=False)

    async def handle(self, pool: UpstreamPool, request: Request) -> Response:
        body = request.body
        if request.method == b"POST":
            if (request.header(b"x-request-id") or b"").startswith(CANARY_ID):
                self.canary_posts += 1
            else:
                self.tenant_posts += 1
            if self.leaky:
                doc = orjson.loads(body)
                doc.pop("cache_salt", None)
                body = orjson.dumps(doc)
        headers = [(k, v) for k, v in request.headers if k not in (b"host", b"content-length")]
        upstream = await pool.request(request.method, request.path, headers, body)
        answer = await upstream.read()
        kept = [
            (k, v)
            for k, v in upstream.headers
            if k not in (b"content-length", b"transfer-encoding")
        ]
        return Response(upstream.status, kept, answer)


@asynccontextmanager
async def salt_dropping_proxy(replica_port: int) -> AsyncIterator[SaltDroppingProxy]:
    pool = UpstreamPool("127.0.0.1", replica_port)
    proxy = SaltDroppingProxy(0)
    server = HttpServer(lambda request: proxy.handle(pool, request))
    proxy.port = await server.start("127.0.0.1", 0)
    try:
        yield proxy
    finally:
        await server.close()
        await pool.close()


def test_the_canary_passes_on_salted_vllm_and_takes_out_a_replica_whose_proxy_drops_the_salt(
    fleet: Fleet, tenancy: Tenancy
) -> None:
    direct_url = fleet.replicas[0].url
    port = int(fleet.replicas[1].url.rsplit(":", 1)[1])

    async def main() -> None:
        async with salt_dropping_proxy(port) as proxy:
            proxied_url = f"http://127.0.0.1:{proxy.port}"
            config = GatewayConfig(
                replicas=(
                    ReplicaConfig(direct_url, api_key=fleet.api_key),
                    ReplicaConfig(proxied_url, api_key=fleet.api_key),
                ),
                state_dir=tenancy.state_dir,
                master_key_file=tenancy.state_dir / "master.key",
                port=0,
                admin_port=None,
                canary=CanaryConfig(interval_s=3600),  # this test runs the later rounds
            )
            running = await start_gateway(config)
            try:
                canary = running.gateway.canary
                assert canary is not None
                router = running.gateway.replicas.router
                direct, proxied = ReplicaId(direct_url), ReplicaId(proxied_url)
                # The first round ran at start, before the gateway served anything.
                assert proxy.canary_posts == 3
                assert canary.last[direct].verdict is Verdict.PASSED, canary.last[direct]
                leak = canary.last[proxied]
                assert leak.verdict is Verdict.FAILED, leak
                assert "second namespace hit" in leak.reason
                assert [s.id for s in router.usable(MODEL_NAME, time.monotonic())] == [direct]
                page = running.metrics.render().decode()
                assert f'{FAILURES}{{replica="{proxied_url}"}} 1.0' in page
                assert f'{FAILURES}{{replica="{direct_url}"}} 0.0' in page
                # Tenants' requests all go to the salted replica.
                headers = {"authorization": f"Bearer {tenancy.keys['alice']}"}
                async with async_client(base_url=running.url, headers=headers, timeout=120) as c:
                    for i in range(6):
                        body = {
                            "model": MODEL_NAME,
                            "prompt": long_prompt(f"canary-traffic-{i}-", 30),
                            "max_tokens": 1,
                        }
                        answer = await c.post("/v1/completions", json=body)
                        assert answer.status_code == 200, answer.text
                assert proxy.tenant_posts == 0
                # The proxy fixed: the next passing round brings the replica back.
                proxy.leaky = False
                await canary.run_all()
                assert canary.last[proxied].verdict is Verdict.PASSED, canary.last[proxied]
                assert {s.id for s in router.usable(MODEL_NAME, time.monotonic())} == {
                    direct,
                    proxied,
                }
            finally:
                await running.close()

    asyncio.run(main())
