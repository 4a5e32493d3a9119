"""`saltgate epp --workers 2` behind a real Envoy with the configuration `saltgate epp
--envoy-config` prints: Envoy's requests are served by both EPP processes (one port,
SO_REUSEPORT), the host's limits are held exactly across them (the gateway's
supervisor counts them once), and a killed worker is restarted while requests keep
being served.

Envoy that cannot run here fails these tests, saying so: they are never skipped.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from tests.epp.test_through_envoy import completion, envoy_binary
from tests.gateway.stack import Tap, new_state_dir, run
from tests.serving.test_workers import gone, worker_pids
from tests.support.gateways import (
    SALTGATE,
    cli,
    metrics_token,
    per_worker,
    series,
    write_gateway_config,
)
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.config import load_config
from saltgate.epp.supervisor import reserve
from saltgate.governance.limits import Limits
from saltgate.sim.run import SimConfig, start_sim
from saltgate.store.tenants import TenantStore
from saltgate_devkit.procs import Proc, free_port

EPP_WORKER = b"saltgate.epp.worker"
BURST = 24  # requests at once: Envoy opens a connection to the EPP for each under way


@dataclass
class EppFleet:
    epps: list[Proc]  # `saltgate epp --workers 2`, or (the control) lone EPPs on one port
    envoy: Proc
    taps: list[Tap]  # in front of the two simulated replicas
    keys: dict[str, str]
    url: str
    metrics_urls: list[str]
    metrics_headers: dict[str, str]

    async def burst(self, tenant: str, n: int = BURST) -> list[httpx.Response]:
        """`n` requests at once, each on its own connection to Envoy."""
        headers = {"authorization": f"Bearer {self.keys[tenant]}"}

        async def one(i: int) -> httpx.Response:
            async with async_client(base_url=self.url, headers=headers, timeout=30) as http:
                return await http.post("/v1/completions", json=completion(f"burst {i}"))

        return list(await asyncio.gather(*(one(i) for i in range(n))))

    async def metrics(self, i: int = 0) -> dict[str, float]:
        async with async_client(timeout=10) as http:
            page = await http.get(self.metrics_urls[i], headers=self.metrics_headers)
            assert page.status_code == 200, page.text
            return series(page.text)

    async def per_worker_requests(self) -> dict[int, float]:
        return per_worker(await self.metrics(), "saltgate_worker_requests_total")

    def posts(self, tap: int) -> int:
        return sum(r.method == b"POST" for r in self.taps[tap].seen)


@asynccontextmanager
async def epp_fleet(
    tmp: Path, *, workers: int = 2, lone: int = 0, limits: Limits | None = None
) -> AsyncIterator[EppFleet]:
    """Envoy in front of `saltgate epp --workers {workers}`, or (``lone`` > 0, the
    control) of ``lone`` single `saltgate epp` processes on the one grpc_port, each
    counting limits alone; tenants alice (with ``limits``) and bob, two simulated
    replicas."""
    binary = envoy_binary()
    sims = [await start_sim(SimConfig(port=0, model="sim-model")) for _ in range(2)]
    taps = [Tap(s) for s in sims]
    for tap in taps:
        await tap.start()
    state = tmp / "state"
    keys = new_state_dir(state, ("alice", "bob"))
    if limits is not None:
        with TenantStore.from_state_dir(state) as store:
            store.set_limits("alice", limits)
    envoy_port = free_port()
    grpc_port = free_port()
    metrics_ports = [free_port() for _ in range(max(lone, 1))]
    paths = []
    for i, metrics_port in enumerate(metrics_ports):
        path = tmp / f"gateway-{i}.toml"
        text = (
            f"[epp]\ngrpc_port = {grpc_port}\nenvoy_port = {envoy_port}\n"
            f"metrics_port = {metrics_port}\n[canary]\nenabled = false\n"
        )
        paths.append(
            write_gateway_config(
                path,
                state_dir=state,
                replicas=[f"http://127.0.0.1:{t.port}" for t in taps],
                admin_port=None,
                gateway_extra='host = "127.0.0.1"\n',
                sections=text,
            )
        )
    bootstrap = tmp / "envoy.yaml"
    bootstrap.write_text(cli("epp", "--config", str(paths[0]), "--envoy-config"))
    argv = [["--workers", str(workers)]] if not lone else [[]] * lone
    epps = [
        Proc(f"epp-{i}", [str(SALTGATE), "epp", "--config", str(p), *a], tmp / f"epp-{i}.log")
        for i, (p, a) in enumerate(zip(paths, argv, strict=True))
    ]
    envoy = Proc(
        "envoy",
        [str(binary), "-c", str(bootstrap), "--use-dynamic-base-id", "--concurrency", "1"],
        tmp / "envoy.log",
    )
    headers = metrics_token(load_config(paths[0]).store_settings)
    fleet = EppFleet(
        epps,
        envoy,
        taps,
        keys,
        f"http://127.0.0.1:{envoy_port}",
        [f"http://127.0.0.1:{p}/metrics" for p in metrics_ports],
        headers,
    )
    try:

        async def serving() -> bool:
            assert envoy.alive(), f"envoy exited: {envoy.tail()}"
            for epp in epps:
                assert epp.alive(), f"the EPP exited: {epp.tail()}"
            try:
                for i in range(len(metrics_ports)):
                    await fleet.metrics(i)
                async with async_client(timeout=5) as http:
                    return (await http.get(f"{fleet.url}/health")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(serving, timeout_s=60, what="every EPP serves, and Envoy through them")
        yield fleet
    finally:
        envoy.stop()
        for epp in epps:
            epp.stop(timeout=30)
        for tap in taps:
            await tap.close()
        for s in sims:
            await s.close()


def test_envoy_s_requests_are_served_by_both_epp_workers(tmp_path: Path) -> None:
    async def body() -> None:
        async with epp_fleet(tmp_path) as f:
            pids = worker_pids(f.epps[0].pid, EPP_WORKER)
            assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2, pids
            before = await f.per_worker_requests()
            answers = await f.burst("bob")
            assert [a.status_code for a in answers] == [200] * BURST, [a.text for a in answers]
            after = await f.per_worker_requests()
            served = {i: after[i] - before.get(i, 0.0) for i in after}
            assert served[0] > 0 and served[1] > 0, served  # both processes answered
            assert sum(served.values()) == BURST, served
            values = await f.metrics()
            assert values["saltgate_workers_alive"] == 2
            # the merged families count every worker's requests
            ok = 'saltgate_requests_total{method="POST",status="200"}'
            assert values[ok] == BURST, {k: v for k, v in values.items() if "requests" in k}

    run(body)


def test_two_epp_workers_hold_one_limit_exactly(tmp_path: Path) -> None:
    """rpm 3: a burst over both workers admits exactly 3, the rest are OpenAI's 429."""

    async def body() -> None:
        async with epp_fleet(tmp_path, limits=Limits(rpm=3)) as f:
            before = await f.per_worker_requests()
            answers = await f.burst("alice")
            after = await f.per_worker_requests()
            statuses = sorted(a.status_code for a in answers)
            assert statuses == [200] * 3 + [429] * (BURST - 3), [a.text for a in answers]
            refused = next(a for a in answers if a.status_code == 429)
            assert refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text
            served = {i: after[i] - before.get(i, 0.0) for i in after}
            assert served[0] > 0 and served[1] > 0, served  # the burst reached both
            values = await f.metrics()
            # counted in one place: no worker fell back to its share of the limit
            assert per_worker(values, "saltgate_limits_shared_up") == {0: 1.0, 1: 1.0}

    run(body)


def test_positive_control_lone_epps_on_one_port_each_count_the_limit(tmp_path: Path) -> None:
    """The same burst over two single `saltgate epp` on the one port (SO_REUSEPORT lets
    them share it), each counting rpm 3 alone: more than 3 pass. What the test above
    would see without the supervisor's one count."""

    async def body() -> None:
        async with epp_fleet(tmp_path, lone=2, limits=Limits(rpm=3)) as f:
            answers = await f.burst("alice")
            admitted = sum(a.status_code == 200 for a in answers)
            assert admitted > 3, [a.status_code for a in answers]

    run(body)


def test_a_killed_epp_worker_is_restarted_and_requests_keep_being_served(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with epp_fleet(tmp_path) as f:
            parent = f.epps[0].pid
            victim = worker_pids(parent, EPP_WORKER)[1]
            os.kill(victim, signal.SIGKILL)
            await eventually(lambda: gone(victim), what="the killed worker exits")
            # the other worker serves while the supervisor replaces it
            answers = await f.burst("bob", 8)
            assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]

            async def restarted() -> bool:
                values = await f.metrics()
                restarts = per_worker(values, "saltgate_worker_restarts_total")
                return restarts == {0: 0.0, 1: 1.0} and values["saltgate_workers_alive"] == 2

            await eventually(restarted, timeout_s=60, what="worker 1 restarted")
            pids = worker_pids(parent, EPP_WORKER)
            assert sorted(pids) == [0, 1] and victim not in pids.values(), pids
            before = await f.per_worker_requests()
            answers = await f.burst("bob")
            assert [a.status_code for a in answers] == [200] * BURST, [a.text for a in answers]
            after = await f.per_worker_requests()
            assert after[1] > before[1], (before, after)  # the new worker 1 serves

    run(body)


def test_sighup_gives_every_epp_worker_the_new_replicas(tmp_path: Path) -> None:
    """The file's [[replicas]] reduced to the second replica, then SIGHUP to the parent:
    a burst over both workers goes to that replica alone (Envoy's cluster still lists
    both; the workers' picks follow the file)."""

    async def body() -> None:
        async with epp_fleet(tmp_path) as f:
            path = tmp_path / "gateway-0.toml"
            text = path.read_text()
            first = f"http://127.0.0.1:{f.taps[0].port}"
            assert f'url = "{first}"' in text, text
            path.write_text(text.replace(f'[[replicas]]\nurl = "{first}"', "", 1))
            assert first not in path.read_text(), path.read_text()
            os.kill(f.epps[0].pid, signal.SIGHUP)
            log = f.epps[0].log_path

            def reloaded() -> bool:
                return "1 replicas in 2 of 2 workers" in log.read_text()

            await eventually(reloaded, timeout_s=30, what="the parent reloads both workers")
            posts = f.posts(0)
            before = await f.per_worker_requests()
            answers = await f.burst("bob")
            assert [a.status_code for a in answers] == [200] * BURST, [a.text for a in answers]
            after = await f.per_worker_requests()
            assert after[0] > before[0] and after[1] > before[1], (before, after)
            assert f.posts(0) == posts  # no worker sent one to the replica taken out

    run(body)


def test_sigterm_drains_every_worker_and_then_envoy_refuses(tmp_path: Path) -> None:
    """SIGTERM to the parent: it and both workers exit cleanly; with no EPP process
    left on the port Envoy answers 5xx, and no request reaches a replica (fail closed)."""

    async def body() -> None:
        async with epp_fleet(tmp_path) as f:
            parent = f.epps[0]
            pids = worker_pids(parent.pid, EPP_WORKER)
            assert len(pids) == 2
            parent.popen.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(parent.popen.wait, 40) == 0, parent.tail()

            def workers_gone() -> bool:
                return all(gone(pid) for pid in pids.values())

            await eventually(workers_gone, what="both workers exit")
            said = parent.log_path.read_text()
            assert "EPP (ext_proc) on 127.0.0.1:" in said and "2 workers)" in said, said
            posts = f.posts(0) + f.posts(1)
            answers = await f.burst("bob", 4)
            assert all(a.status_code >= 500 for a in answers), [a.status_code for a in answers]
            assert f.posts(0) + f.posts(1) == posts

    run(body)


def test_the_port_the_parent_holds_refuses_connections_until_a_worker_listens() -> None:
    """The parent's reservation (bound with SO_REUSEPORT, not listening) lets a gRPC
    server bind the same port beside it, and refuses connections whenever no worker
    listens: before the first, and after the last is gone (fail closed). Control: gRPC
    with SO_REUSEPORT off cannot bind beside it."""

    def refused(port: int) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED

    async def body() -> None:
        held = reserve("127.0.0.1", 0)
        port = int(held.getsockname()[1])
        try:
            assert refused(port)
            server = grpc.aio.server()
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            await server.start()
            assert not refused(port)
            await server.stop(None)
            assert refused(port)
            lone = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            with pytest.raises(RuntimeError):
                lone.add_insecure_port(f"127.0.0.1:{port}")
        finally:
            held.close()

    run(body)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_grpc_port_taken_is_refused_in_one_line(tmp_path: Path, workers: int) -> None:
    """Another program listening on [epp] grpc_port: `saltgate epp` (one process, and the
    parent of two) says which listener could not bind and exits 1, no traceback."""
    state = tmp_path / "state"
    new_state_dir(state, ("alice",))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        path = write_gateway_config(
            tmp_path / "gateway.toml",
            state_dir=state,
            replicas=[f"http://127.0.0.1:{free_port()}"],
            admin_port=None,
            gateway_extra='host = "127.0.0.1"\n',
            sections=f"[epp]\ngrpc_port = {port}\n[canary]\nenabled = false\n",
        )
        argv = [str(SALTGATE), "epp", "--config", str(path), "--workers", str(workers)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port} (the EPP's listener" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
