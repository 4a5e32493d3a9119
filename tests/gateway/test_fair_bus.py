"""The fair queue's counters shared by two gateways over a real Redis (docs/fairness.md).

Gateway A and gateway B, each with [queue] and its own simulated replica, on one store
and one cluster bus (a redis-server of the project's own). A noisy tenant is served
through A only; then, on B, whose one replica is busy, a quiet tenant queues four
requests and the noisy tenant four more. B's release order tells whether A's service
reached B's counters:

- shared: B's counter for the noisy tenant carries what A served it, so all four of the
  quiet tenant's requests leave before any of the noisy tenant's;
- the control, A as a gateway of the older wire (its bus not linked to its queue: it
  writes version-1 batches, without service): B accepts those batches, but orders the two
  tenants as if A's service never happened, alternating them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
from tests.gateway.stack import new_state_dir, run
from tests.gateway.test_cluster_bus import all_heard, is_up
from tests.gateway.test_fairshare import completion, record
from tests.support.exceptions import ExceptionWatch
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.config import GatewayConfig, QueueConfig, ReplicaConfig
from saltgate.gateway.cluster import ClusterBus
from saltgate.gateway.fairshare import FairShare
from saltgate.routing import RouterConfig
from saltgate.serving.run import RunningGateway, start_gateway
from saltgate.sim.run import RunningSim, SimConfig, start_sim
from saltgate_devkit.services import RedisServer

# One request at a time on each replica, 10 ms per output token: B's is easy to keep busy.
SIM = SimConfig(port=0, max_concurrency=1, decode_ms_per_token=10.0)
QUEUE = QueueConfig(enabled=True, max_waiting_per_replica=0, quantum_tokens=0)
TENANTS = ("noisy", "quiet", "warm")
NOISY_PROMPT = " ".join(f"noisy{i}" for i in range(400))  # ~2,800 bytes: 700 tokens each


@dataclass
class Pair:
    a: RunningGateway
    b: RunningGateway
    keys: dict[str, str]
    tenant_ids: dict[str, str]

    def client(self, gateway: RunningGateway, tenant: str) -> httpx.AsyncClient:
        return async_client(
            base_url=gateway.url,
            headers={"authorization": f"Bearer {self.keys[tenant]}"},
            timeout=60,
        )


def fair(g: RunningGateway) -> FairShare:
    share = g.gateway.governance.fair
    assert share is not None, "[queue] enabled"
    return share


def bus(g: RunningGateway) -> ClusterBus:
    assert g.cluster is not None, "[cluster] set"
    return g.cluster


@asynccontextmanager
async def pair(tmp: Path, redis: RedisServer) -> AsyncIterator[Pair]:
    sims: list[RunningSim] = [await start_sim(SIM) for _ in range(2)]
    state = tmp / "state"
    keys = new_state_dir(state, TENANTS)
    running: list[RunningGateway] = []
    watch = ExceptionWatch()
    try:
        for i, sim in enumerate(sims):
            config = GatewayConfig(
                replicas=(ReplicaConfig(sim.url),),
                state_dir=state,
                master_key_file=state / "master.key",
                port=0,
                admin_port=None,
                access_log="off",
                router=RouterConfig(probe_interval_s=0.05),
                queue=QUEUE,
                cluster=redis.settings(f"gw{i}"),
            )
            running.append(await start_gateway(config))
        ids = {}
        for tenant in TENANTS:
            principal = running[0].gateway.keys.authenticate(keys[tenant])
            assert principal is not None
            ids[tenant] = principal.tenant_id
        for bus_ in [bus(g) for g in running]:
            await eventually(partial(is_up, bus_), timeout_s=15, what="bus connected")
        yield Pair(running[0], running[1], keys, ids)
    finally:
        for g in running:
            await g.close()
        for s in sims:
            await s.close()
        watch.stop()
    watch.check()


def post(
    client: httpx.AsyncClient, prompt: str, max_tokens: int = 5
) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(client.post("/v1/completions", json=completion(prompt, max_tokens)))


async def all_ok(tasks: list[asyncio.Task[httpx.Response]]) -> None:
    for resp in await asyncio.gather(*tasks):
        assert resp.status_code == 200, resp.text


async def release_order(p: Pair, *, shared: bool) -> list[str]:
    """The run of the module doc; the tenants of B's releases after its replica frees."""
    a, b = fair(p.a), fair(p.b)
    if not shared:
        bus(p.a).state.fair = None  # A as an older gateway: batches without service
    noisy_id, quiet_id = p.tenant_ids["noisy"], p.tenant_ids["quiet"]
    replica = p.b.gateway.replicas.replicas[0].id
    async with (
        p.client(p.a, "noisy") as noisy_a,
        p.client(p.b, "noisy") as noisy_b,
        p.client(p.b, "quiet") as quiet_b,
        p.client(p.b, "warm") as warm_b,
    ):
        # B learns its replica's capacity (a queue seen by a probe), or it holds nothing.
        burst = [post(warm_b, f"warm {i}", 8) for i in range(8)]
        await eventually(
            lambda: b.gate.waiting(replica, 0) is not None,
            what="B's gate learns its replica's capacity",
        )
        await all_ok(burst)
        # The noisy tenant is served through A alone.
        await all_ok([post(noisy_a, f"{i} {NOISY_PROMPT}") for i in range(6)])
        served_at_a = a.queue.counters[noisy_id]
        assert served_at_a > 1000, served_at_a  # the quiet tenant's 4 requests: ~50
        if shared:
            await eventually(
                lambda: b.queue.counters.get(noisy_id, 0.0) >= a.queue.counters[noisy_id],
                what="B's counter carries the noisy tenant's service at A",
            )
        else:
            await all_heard(p.a, p.b)  # every batch A wrote so far, none with service
            assert bus(p.b).state.rejected == 0, "an older gateway's batches are accepted"
            assert noisy_id not in b.queue.counters
        # B's one replica busy; the quiet tenant queues, then the noisy one.
        long = post(warm_b, "the long one", 300)
        router = p.b.gateway.replicas.router
        await eventually(lambda: router.inflight(replica) == 1, what="the long request runs")
        events = record(b)
        quiet = [post(quiet_b, f"quiet {i}") for i in range(4)]
        await eventually(lambda: b.queue.waiting().get(quiet_id) == 4, what="quiet waits")
        noisy = [post(noisy_b, f"noisy {i}") for i in range(4)]
        await eventually(lambda: b.queue.waiting().get(noisy_id) == 4, what="noisy waits")
        await all_ok([long, *quiet, *noisy])
    names = {v: k for k, v in p.tenant_ids.items()}
    return [names[tenant] for event, tenant in events if event == "pop"]


def test_service_through_one_gateway_puts_a_tenant_behind_a_quiet_one_on_another(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async def main() -> None:
        async with pair(tmp_path, redis_server) as p:
            order = await release_order(p, shared=True)
            assert order == ["quiet"] * 4 + ["noisy"] * 4, order

    run(main)


def test_positive_control_without_the_service_on_the_bus_they_alternate(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async def main() -> None:
        async with pair(tmp_path, redis_server) as p:
            order = await release_order(p, shared=False)
            assert sorted(order) == ["noisy"] * 4 + ["quiet"] * 4, order
            assert order[:2] == ["quiet", "noisy"], order  # the noisy tenant's turn at once

    run(main)
