"""Gateways sharing routing state over a real Redis (the cluster bus, gateway/cluster.py).

Two in-process gateways on one store, four simulated replicas, a redis-server of the
project's own (saltgate_devkit.services.RedisServer):
- a conversation that started too short for a route key finds its cache through either
  gateway, and without the bus it does not (the control);
- nothing on the bus names a salt, a prompt, an API key or a secret: only keyed digests,
  replica ids and numbers (with a positive control that leaks the prompt on purpose);
- Redis killed: both gateways keep serving on their own state and say so in their
  metrics; Redis back: they reconnect and share again;
- a forged batch is dropped and counted.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis
from tests.gateway.stack import MODEL, new_state_dir, run
from tests.support import completions
from tests.support.completions import cached
from tests.support.exceptions import ExceptionWatch
from tests.support.gateways import metrics_token
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.config import GatewayConfig, ReplicaConfig, load_master_key
from saltgate.derivations.derive import PrefixDigest, cache_salt, cluster_keys, derive_subkeys
from saltgate.gateway.cluster import ClusterBus, sender_id
from saltgate.routing import Router, RouterConfig
from saltgate.routing.cluster import ClusterSettings, decode_batch, encode_batch
from saltgate.routing.domain import ReplicaId
from saltgate.routing.rendezvous import Member
from saltgate.serving.run import RunningGateway, start_gateway
from saltgate.sim.run import RunningSim, SimConfig, start_sim
from saltgate.store.tenants import TenantStore
from saltgate_devkit.services import RedisServer

MARKER = "zqxjvbnm"  # in every prompt: a reader of the bus must never find it


@dataclass
class Fleet:
    gateways: list[RunningGateway]
    sims: list[RunningSim]
    key: str
    state: Path
    redis: RedisServer | None

    def client(self, i: int) -> httpx.AsyncClient:
        return async_client(
            base_url=self.gateways[i].url,
            headers={"authorization": f"Bearer {self.key}"},
            timeout=30,
        )

    async def metrics(self, i: int) -> str:
        port = self.gateways[i].admin_port
        headers = metrics_token(self.gateways[i].gateway.config.store_settings)
        async with async_client(timeout=10) as http:
            return (await http.get(f"http://127.0.0.1:{port}/metrics", headers=headers)).text


@asynccontextmanager
async def fleet(tmp: Path, redis: RedisServer | None, gateways: int = 2) -> AsyncIterator[Fleet]:
    sims = [await start_sim(SimConfig(port=0)) for _ in range(4)]
    state = tmp / "state"
    key = new_state_dir(state, ("acme",))["acme"]
    base = GatewayConfig(
        replicas=tuple(ReplicaConfig(s.url) for s in sims),
        state_dir=state,
        master_key_file=state / "master.key",
        port=0,
        admin_port=0,
        access_log="off",
    )
    running = []
    watch = ExceptionWatch()  # the bus failing must not leave its error behind
    try:
        for i in range(gateways):
            cluster = redis.settings(f"gw{i}") if redis is not None else None
            running.append(await start_gateway(dataclasses.replace(base, cluster=cluster)))
        yield Fleet(running, sims, key, state, redis)
    finally:
        for g in running:
            await g.close()
        for s in sims:
            await s.close()
        watch.stop()
    watch.check()


def conversation(k: int) -> tuple[str, str]:
    """Two turns; the first is too short for a route key (under 4096 bytes)."""
    first = " ".join(f"{MARKER}{k}w{i}" for i in range(150))
    return first, first + " " + " ".join(f"{MARKER}{k}t{i}" for i in range(80))


async def complete(http: httpx.AsyncClient, prompt: str) -> int:
    """Cached prompt tokens of one completion (asserting it succeeded)."""
    return cached(await completions.complete(http, prompt, model=MODEL, max_tokens=1))


def is_up(bus: ClusterBus) -> bool:
    return bus.up


def is_down(bus: ClusterBus) -> bool:
    return not bus.up


def buses(f: Fleet) -> list[ClusterBus]:
    found = [g.cluster for g in f.gateways]
    assert all(found), "every gateway has [cluster]"
    return [b for b in found if b is not None]


async def bus_up(f: Fleet) -> None:
    for bus in buses(f):
        await eventually(partial(is_up, bus), timeout_s=15, what="bus connected")


async def all_heard(source: RunningGateway, reader: RunningGateway) -> None:
    """Until ``reader`` has applied every placement ``source`` has made so far."""
    out, into = source.cluster, reader.cluster
    assert out is not None and into is not None
    router = out.state.router
    await eventually(lambda: not router.shared_pending, what="placements published")
    await eventually(lambda: out.state.sent > 0, what="a batch sent")
    sent = out.state.sent
    await eventually(lambda: into.state.heard(out.sender) >= sent, what="placements applied")


async def second_turns_hit(f: Fleet, convs: range) -> int:
    """Turn 1 of each conversation through gateway 0, turn 2 through gateway 1 (in reverse
    order, so gateway 1's own least-loaded rotation cannot match by chance); how many
    second turns found their first turn's cache."""
    async with f.client(0) as a, f.client(1) as b:
        for k in convs:
            await complete(a, conversation(k)[0])
        if f.redis is not None:
            await all_heard(f.gateways[0], f.gateways[1])
        return sum([await complete(b, conversation(k)[1]) > 0 for k in reversed(convs)])


def test_a_conversation_finds_its_cache_through_either_gateway(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async def main() -> None:
        async with fleet(tmp_path, redis_server) as f:
            await bus_up(f)
            assert await second_turns_hit(f, range(8)) == 8
            text = await f.metrics(1)
            assert "saltgate_cluster_bus_up 1.0" in text
            assert re.search(r'saltgate_cluster_batches_total\{kind="received"\} [1-9]', text)
            assert "saltgate_cluster_peers 1.0" in text

    run(main)


def test_without_the_bus_second_turns_miss(tmp_path: Path) -> None:
    """The control: the same traffic through two gateways without [cluster]."""

    async def main() -> None:
        async with fleet(tmp_path, None) as f:
            assert await second_turns_hit(f, range(8)) <= 2

    run(main)


# -- what a reader of the bus learns ------------------------------------------------------------


async def bus_entries(redis: RedisServer, stream: str) -> list[bytes]:
    client = Redis.from_url(redis.url(), password=redis.password_file.read_text().strip())
    try:
        entries: Any = await client.xrange(stream)
    finally:
        await client.aclose()
    return [bytes(fields[b"b"]) for _id, fields in entries]


def leaks(entries: list[bytes], secrets: dict[str, bytes]) -> list[str]:
    """Which of ``secrets`` appear anywhere in the bus's bytes (also as hex)."""
    found = []
    for name, value in secrets.items():
        for data in entries:
            if value in data or value.hex().encode() in data:
                found.append(name)
                break
    return found


async def traffic_and_bus(tmp: Path, redis: RedisServer) -> tuple[list[bytes], dict[str, bytes]]:
    async with fleet(tmp, redis) as f:
        await bus_up(f)
        await second_turns_hit(f, range(3))
        async with f.client(1) as b:  # a long prompt too: it has a route key
            await complete(b, " ".join(f"{MARKER}long{i}" for i in range(900)))
        master = load_master_key(f.state / "master.key")
        subkeys = derive_subkeys(master)
        with TenantStore.from_state_dir(f.state) as store:
            [tenant] = store.list_tenants()
        salt = cache_salt(subkeys.salt, tenant.id, "0", None)
        stream = cluster_keys(subkeys.route).stream
        await eventually(
            lambda: f.gateways[0].cluster is not None and f.gateways[0].cluster.state.received > 0,
            what="batches on the bus",
        )
        entries = await bus_entries(redis, stream)
        secrets = {
            "prompt text": MARKER.encode(),
            "cache salt": salt.encode(),
            "API key": f.key.encode(),
            "API key's secret part": f.key.encode()[-24:],
            "master key": master,
            "K_salt": subkeys.salt,
            "K_route": subkeys.route,
            "K_kv": subkeys.kv_events,
            "bus key": cluster_keys(subkeys.route).bus,
            "model name": MODEL.encode(),
        }
        replicas = {s.url for s in f.sims}
        for data in entries:  # what is there is what the format says, nothing more
            batch = decode_batch(cluster_keys(subkeys.route), data)
            assert batch.sender.split("/")[0] in ("gw0", "gw1")
            assert {p.replica for p in batch.placements} <= replicas
            assert all(len(d) == 32 for p in batch.placements for d in p.digests)
            assert all(len(k) == 32 for k, _ in batch.keys)
        return entries, secrets


def test_nothing_on_the_bus_names_a_salt_a_prompt_or_a_key(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async def main() -> None:
        entries, secrets = await traffic_and_bus(tmp_path, redis_server)
        assert len(entries) >= 2
        assert any(b"http://127.0.0.1:" in e for e in entries)  # the scan reads the batches
        assert leaks(entries, secrets) == []

    run(main)


def test_the_bus_scan_sees_a_prompt_put_on_the_bus(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Positive control: the same batches, their digests swapped for the prompt's own bytes
    (what a gateway publishing unkeyed prefixes would send), are caught. Rebuilt from the
    bus rather than by patching the digest function, which the compiled build ignores."""

    async def main() -> None:
        entries, secrets = await traffic_and_bus(tmp_path, redis_server)
        keys = cluster_keys(secrets["K_route"])
        prompt = conversation(0)[0].encode()
        raw = tuple(PrefixDigest(prompt[i : i + 32]) for i in range(0, 256, 32))
        leaked = []
        for data in entries:
            batch = decode_batch(keys, data)
            placements = tuple(p._replace(digests=raw) for p in batch.placements)
            leaked.append(encode_batch(keys, dataclasses.replace(batch, placements=placements)))
        assert any(decode_batch(keys, d).placements for d in leaked)
        assert "prompt text" in leaks(leaked, secrets)

    run(main)


# -- the bus goes away and comes back -----------------------------------------------------------


def test_gateways_route_alone_while_redis_is_down_and_share_again_after(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async def main() -> None:
        async with fleet(tmp_path, redis_server) as f:
            await bus_up(f)
            redis_server.stop(crash=True)
            for bus in buses(f):
                await eventually(partial(is_down, bus), what="bus loss noticed")
            async with f.client(0) as a, f.client(1) as b:
                for k in range(6):  # both keep serving, on their own state
                    await complete(a if k % 2 else b, conversation(100 + k)[0])
            for i in range(2):
                text = await f.metrics(i)
                assert "saltgate_cluster_bus_up 0.0" in text
                assert "saltgate_cluster_peers 0.0" in text
                down = re.search(r"^saltgate_cluster_bus_down_seconds (\S+)$", text, re.M)
                assert down is not None and float(down.group(1)) > 0
            redis_server.start()
            await bus_up(f)
            # Shared again: new conversations follow their cache across the gateways.
            assert await second_turns_hit(f, range(200, 206)) == 6
            assert "saltgate_cluster_bus_down_seconds 0.0" in await f.metrics(0)

    run(main)


def test_a_forged_batch_is_dropped_and_counted(tmp_path: Path, redis_server: RedisServer) -> None:
    async def main() -> None:
        async with fleet(tmp_path, redis_server, gateways=1) as f:
            await bus_up(f)
            bus = f.gateways[0].cluster
            assert bus is not None
            client = Redis.from_url(
                redis_server.url(), password=redis_server.password_file.read_text().strip()
            )
            try:
                await client.xadd(bus.keys.stream, {b"b": b"\x93" + b"f" * 60})
            finally:
                await client.aclose()
            await eventually(lambda: bus.state.rejected == 1, what="the forged batch counted")
            assert bus.state.router.remembered_prefixes() == 0
            text = await f.metrics(0)
            assert 'saltgate_cluster_batches_total{kind="rejected"} 1' in text

    run(main)


def test_two_processes_never_share_a_sender_id() -> None:
    """Containers often all run as pid 1, and a ConfigMap gives every pod one gateway_id."""
    assert sender_id("gw") != sender_id("gw")
    assert sender_id("gw").startswith("gw/")
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,64}/[0-9a-f]{8}", sender_id(None))


# The Redis ACL docs/deployment.md gives the gateways' bus user: its stream and the five
# commands the bus uses, nothing else (`ACL SETUSER saltgate on >PASSWORD resetkeys
# ~saltgate-cluster-* resetchannels -@all +xadd +xread +time +ping +client|setname`).
BUS_COMMANDS = ["-@all", "+xadd", "+xread", "+time", "+ping", "+client|setname"]


def test_the_bus_works_as_the_least_privileged_redis_user(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    password = tmp_path / "bus-password"
    password.write_text("bus-user-password\n")
    password.chmod(0o600)
    settings = ClusterSettings(
        f"redis://saltgate@127.0.0.1:{redis_server.port}/0", "gw", password_file=password
    )
    members = [Member(ReplicaId("http://r0"), 1.0)]

    async def main() -> None:
        admin = Redis.from_url(
            redis_server.url(), password=redis_server.password_file.read_text().strip()
        )
        await admin.acl_setuser(
            "saltgate",
            enabled=True,
            passwords=["+bus-user-password"],
            keys=["saltgate-cluster-*"],
            commands=BUS_COMMANDS,
            reset_keys=True,
            reset_channels=True,
        )
        routers = [Router(RouterConfig(), b"k" * 32, members) for _ in range(2)]
        pair = [ClusterBus(settings, r, cluster_keys(b"k" * 32)) for r in routers]
        try:
            for bus in pair:
                bus.start()
                await eventually(partial(is_up, bus), what="bus connected as saltgate")
            routers[0].started(ReplicaId("http://r0"), 0.0, 1000.0)
            state = routers[1].state(ReplicaId("http://r0"))
            assert state is not None
            await eventually(lambda: state.remote_prefill == 1000.0, what="backlog shared")
            assert await admin.acl_log() == []  # nothing was denied
        finally:
            for bus in pair:
                await bus.close()
            await admin.aclose()

    run(main)
