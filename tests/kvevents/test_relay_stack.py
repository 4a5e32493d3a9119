"""The relay fed by simulated replicas behind the gateway, in-process and as real commands.

What was in the clear upstream (salts, token ids, raw block hashes) must not appear in
anything the relay publishes; the raw streams, read from the replicas' own replay sockets,
are the positive control that it was there to leak.
"""

from __future__ import annotations

import asyncio
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from tests.gateway.stack import MODEL, long_prompt, run, stack
from tests.support.http import async_client
from tests.support.kv_relay import assert_nothing_leaks, collect, raw_stream
from tests.support.waiting import eventually

from saltgate.config import load_config, load_master_key
from saltgate.derivations.derive import derive_subkeys
from saltgate.kvevents.relay import KvRelay
from saltgate.kvevents.settings import CurveKeyPair, KvRelaySettings, KvUpstream
from saltgate.serving.run import start_gateway
from saltgate.sim.run import RunningSim, SimConfig, start_sim
from saltgate.store.tenants import TenantStore

# Few blocks, so the second tenant's prompt evicts the first's: BlockRemoved events too.
KV_SIM = SimConfig(
    port=0,
    num_blocks=40,
    kv_events_endpoint="tcp://127.0.0.1:*",
    kv_events_replay_endpoint="tcp://127.0.0.1:*",
    prefill_ms_per_1k_tokens=0,
    decode_ms_per_token=0,
)


def prompt(seed: str) -> str:
    """About 26 blocks: two different ones do not fit a replica together."""
    return long_prompt(seed, 200)


DESCRIBE = re.compile(r"kv relay on (\S+) \(replay (\S+)\), \d+ upstreams, server key (\S+)")


@dataclass
class Upstream:
    endpoint: str
    replay: str


def upstream_of(sim: RunningSim) -> Upstream:
    assert sim.publisher is not None
    endpoint, replay = sim.publisher.bound_endpoint, sim.publisher.bound_replay_endpoint
    assert endpoint is not None and replay is not None
    return Upstream(endpoint, replay)


def test_relay_in_front_of_simulated_replicas_leaks_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, sim=KV_SIM) as s:
            upstreams = [upstream_of(sim) for sim in s.sims]
            allowed = CurveKeyPair(*(k.decode() for k in zmq.curve_keypair()))
            k_kv = s.gateway.gateway.subkeys.kv_events
            settings = KvRelaySettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", (allowed.public,))
            relay = KvRelay([KvUpstream(u.endpoint, u.replay) for u in upstreams], k_kv, settings)
            relay.start()
            try:
                assert relay.wait_ready(10)
                for tenant, seed in (("alice", "a"), ("alice", "a"), ("bob", "a"), ("bob", "b")):
                    async with s.client(tenant) as client:
                        r = await client.post(
                            "/v1/completions",
                            json={
                                "model": MODEL,
                                "prompt": prompt(seed),
                                "max_tokens": 2,
                            },
                        )
                        assert r.status_code == 200, r.text
                raw = [p for u in upstreams for _, p in raw_stream(u.replay)]
                relayed = await asyncio.to_thread(
                    collect,
                    relay.publish_endpoint,
                    relay.replay_endpoint,
                    relay.server_keys.public,
                    allowed,
                    len(raw),
                )
                assert {r.replica_id for r in relayed} <= set(relay.replica_ids.values())
                assert relay.stats.missed_upstream == 0
                assert_nothing_leaks(raw, relayed, k_kv)
            finally:
                relay.close()

    run(main)


async def _read_until_relay(proc: asyncio.subprocess.Process) -> tuple[str, re.Match[str]]:
    """The command's output up to the relay's line, and that line parsed."""
    assert proc.stdout is not None
    lines = ""
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        if not line:
            raise AssertionError(f"exited before the relay started: {lines}")
        lines += line
        if match := DESCRIBE.search(line):
            return lines, match


@pytest.mark.parametrize("command", ["serve", "kv-relay"])
def test_the_relay_runs_inside_serve_and_on_its_own(tmp_path: Path, command: str) -> None:
    async def main() -> None:
        sims = [await start_sim(KV_SIM) for _ in range(2)]
        allowed = CurveKeyPair(*(k.decode() for k in zmq.curve_keypair()))
        state = tmp_path / "state"
        state.mkdir(mode=0o700)
        (state / "master.key").write_text("ab" * 32 + "\n")
        (state / "master.key").chmod(0o600)
        with TenantStore.from_state_dir(state) as store:
            store.create_tenant("alice")
            api_key = store.create_key("alice")[1]
        (tmp_path / "clients.txt").write_text(allowed.public + "\n")
        replicas = "".join(
            f'[[replicas]]\nurl = "{sim.url}"\nkv_events_endpoint = "{u.endpoint}"\n'
            f'kv_events_replay_endpoint = "{u.replay}"\n\n'
            for sim, u in ((sim, upstream_of(sim)) for sim in sims)
        )
        config = tmp_path / "gateway.toml"
        config.write_text(
            '[gateway]\nport = 0\nadmin_port = 0\nstate_dir = "state"\n\n'
            + replicas
            + '[kv_relay]\npublish_endpoint = "tcp://127.0.0.1:*"\n'
            'replay_endpoint = "tcp://127.0.0.1:*"\nclient_keys_file = "clients.txt"\n'
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "saltgate.cli", command, "--config", str(config),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            output, relay_line = await _read_until_relay(proc)
            publish, replay, server_key = relay_line.groups()
            body: dict[str, object] = {"model": MODEL, "max_tokens": 2}
            if command == "serve":
                served = re.search(r"serving on (http://\S+)", output)
                assert served, output
                url, headers = served.group(1), {"authorization": f"Bearer {api_key}"}
            else:  # no gateway: a client salt goes straight to the replica
                url, headers = sims[0].url, {}
                body["cache_salt"] = "sg1_client-chosen-salt-sent-straight-to-vllm"
            async with async_client(base_url=url, headers=headers, timeout=30) as client:
                for seed in ("x", "y", "z"):
                    r = await client.post("/v1/completions", json={**body, "prompt": prompt(seed)})
                    assert r.status_code == 200, r.text
            raw = [p for sim in sims for _, p in raw_stream(upstream_of(sim).replay)]
            relayed = await asyncio.to_thread(
                collect, publish, replay, server_key, allowed, len(raw)
            )
            k_kv = derive_subkeys(load_master_key(state / "master.key")).kv_events
            assert_nothing_leaks(raw, relayed, k_kv)
        finally:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 15) == 0
            for sim in sims:
                await sim.close()

    run(main)


def test_a_gateway_reload_changes_the_relays_upstreams(tmp_path: Path) -> None:
    """SIGHUP's reload of [[replicas]] reaches the relay: a replica added there is
    followed, one removed is dropped."""

    async def main() -> None:
        sims = [await start_sim(KV_SIM) for _ in range(2)]
        ups = [upstream_of(sim) for sim in sims]
        allowed = CurveKeyPair(*(k.decode() for k in zmq.curve_keypair()))
        state = tmp_path / "state"
        state.mkdir(mode=0o700)
        (state / "master.key").write_text("ab" * 32 + "\n")
        (state / "master.key").chmod(0o600)
        (tmp_path / "clients.txt").write_text(allowed.public + "\n")

        def config_with(indexes: tuple[int, ...]) -> Path:
            replicas = "".join(
                f'[[replicas]]\nurl = "{sims[i].url}"\nkv_events_endpoint = "{ups[i].endpoint}"\n'
                f'kv_events_replay_endpoint = "{ups[i].replay}"\n\n'
                for i in indexes
            )
            path = tmp_path / "gateway.toml"
            path.write_text(
                '[gateway]\nport = 0\nstate_dir = "state"\n\n'
                + replicas
                + '[kv_relay]\npublish_endpoint = "tcp://127.0.0.1:*"\n'
                'replay_endpoint = "tcp://127.0.0.1:*"\nclient_keys_file = "clients.txt"\n'
            )
            return path

        running = await start_gateway(load_config(config_with((0,))))
        try:
            relay = running.kv_relay
            assert relay is not None
            assert set(relay.replica_ids) == {ups[0].endpoint}
            running.reload(load_config(config_with((0, 1))))
            await eventually(lambda: set(relay.replica_ids) == {u.endpoint for u in ups})
            before = relay.stats.published
            async with async_client(base_url=sims[1].url, timeout=30) as client:
                r = await client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": prompt("n"), "max_tokens": 2}
                )
                assert r.status_code == 200, r.text
            await eventually(lambda: relay.stats.published > before)  # the new one's events
            running.reload(load_config(config_with((1,))))
            await eventually(lambda: set(relay.replica_ids) == {ups[1].endpoint})
        finally:
            await running.close()
            for sim in sims:
                await sim.close()

    run(main)
