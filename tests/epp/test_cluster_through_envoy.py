"""An EPP with `[cluster]` shares routing state with saltgate's gateways over the bus, as
a gateway does (docs/epp.md): a conversation started through a gateway finds its cache
when its next turn comes through Envoy and the EPP. Real Redis, real Envoy, four
simulated replicas; the control is the same traffic with neither on the bus.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tests.epp.test_through_envoy import MODEL, envoy_stack
from tests.gateway.stack import run
from tests.gateway.test_cluster_bus import conversation
from tests.support import completions
from tests.support.completions import cached
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.config import GatewayConfig, ReplicaConfig
from saltgate.serving.run import start_gateway
from saltgate.sim.run import SimConfig, start_sim
from saltgate_devkit.services import RedisServer

CONVERSATIONS = range(8)


def cluster_section(redis: RedisServer, name: str) -> str:
    settings = redis.settings(name)
    return (
        f'[cluster]\nurl = "{settings.url}"\npassword_file = "{settings.password_file}"\n'
        f'gateway_id = "{name}"\npublish_interval_s = 0.001\n'
    )


@pytest.mark.parametrize("shared", [True, False], ids=["on-the-bus", "control-alone"])
def test_a_conversation_started_at_a_gateway_finds_its_cache_through_the_epp(
    tmp_path: Path, redis_server: RedisServer, shared: bool
) -> None:
    async def body() -> None:
        sims = [await start_sim(SimConfig(port=0, model=MODEL)) for _ in range(4)]
        urls = [s.url for s in sims]
        sections = cluster_section(redis_server, "epp") if shared else ""
        try:
            async with envoy_stack(tmp_path, replicas=urls, sections=sections) as s:
                config = GatewayConfig(
                    replicas=tuple(ReplicaConfig(u) for u in urls),
                    state_dir=s.state,
                    master_key_file=s.state / "master.key",
                    port=0,
                    admin_port=0,
                    access_log="off",
                )
                if shared:
                    config = dataclasses.replace(config, cluster=redis_server.settings("gw"))
                gateway = await start_gateway(config)
                try:
                    auth = {"authorization": f"Bearer {s.keys['alice']}"}
                    async with async_client(base_url=gateway.url, headers=auth) as first:
                        for k in CONVERSATIONS:
                            await completions.complete(
                                first, conversation(k)[0], model=MODEL, max_tokens=1
                            )
                    out, into = gateway.cluster, s.epp.gateway.cluster
                    if shared:
                        assert out is not None and into is not None, "both on the bus"
                        router = out.state.router
                        await eventually(lambda: not router.shared_pending, what="published")
                        await eventually(lambda: out.state.sent > 0, what="a batch sent")
                        sent = out.state.sent
                        await eventually(
                            lambda: into.state.heard(out.sender) >= sent, what="the EPP heard"
                        )
                    else:
                        assert out is None and into is None
                    hits = 0
                    async with s.client("alice") as then:
                        for k in reversed(CONVERSATIONS):  # not the gateway's own rotation
                            doc = await completions.complete(
                                then, conversation(k)[1], model=MODEL, max_tokens=1
                            )
                            hits += cached(doc) > 0
                    if shared:
                        assert hits == len(CONVERSATIONS)
                    else:
                        assert hits <= 2, hits
                finally:
                    await gateway.close()
        finally:
            for sim in sims:
                await sim.close()

    run(body)
