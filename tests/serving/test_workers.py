"""`saltgate serve --workers 2` as real processes, against simulated replicas (docs/workers.md).

- Requests spread over both workers, and the one admin port's /metrics sums them.
- A worker killed with SIGKILL is restarted, counted and logged in one line; requests go
  on succeeding (only those in flight on the dead worker may fail); on SQLite and on
  PostgreSQL the ledger holds exactly one record per delivered 200, matched one by one
  by request id (the response's x-request-id).
- Connections queued in the listening socket when a worker dies are served by the others.
- SIGHUP changes the replicas of every worker; SIGTERM lets a long stream finish.
- Every worker answers /ready for itself, from its own view of the replicas.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import ehbp
import httpx
import orjson
from tests.gateway.stack import MODEL, Tap, run
from tests.routing.test_routing_gateway import kill
from tests.serving.test_drain import refused
from tests.support.gateways import (
    SALTGATE,
    GatewayProcess,
    per_worker,
    series,
    write_gateway_config,
)
from tests.support.http import async_client
from tests.support.leaks import leaks
from tests.support.waiting import eventually

from saltgate.config import create_master_key, load_master_key
from saltgate.ehbp.frames import KEYS_PATH, RESPONSE_NONCE_HEADER, ServerKey
from saltgate.secretfiles import create_secret_file
from saltgate.sim.run import RunningSim, SimConfig, start_sim
from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore, new_api_key

WORKERS = 2


def accept_queue(port: int) -> int:
    """Connections the kernel accepted and no worker has taken yet, on the IPv4 listener
    at ``port`` (a listening socket's rx_queue in /proc/net/tcp is its accept queue)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            return int(fields[4].split(":")[1], 16)
    return 0


def worker_pids(parent: int, module: bytes = b"saltgate.serving.worker") -> dict[int, int]:
    """Worker index -> pid of the parent's running workers, `python -m module` (from
    /proc; zombies left out)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if int(ppid) == parent and state != "Z" and module in argv:
            found[int(argv[argv.index(b"--index") + 1])] = int(entry.name)
    return found


def gone(pid: int) -> bool:
    """The process exited and every socket it had is closed. Its main thread shows "Z"
    as soon as it exits, while its other threads may still be exiting and holding the
    file table (and with it the sockets): those leave /proc/PID/task once they are done."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z" and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except OSError:
        return True


@dataclass
class Fleet:
    gateway: GatewayProcess
    sims: list[RunningSim]
    taps: list[Tap]
    key: str
    config: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.gateway.proc.pid

    def client(self, **kw: object) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.key}"}
        return async_client(base_url=self.gateway.url, headers=headers, timeout=30, **kw)

    async def metrics(self) -> dict[str, float]:
        async with async_client(timeout=10) as http:
            page = await http.get(self.gateway.metrics_url, headers=self.gateway.metrics_headers)
            return series(page.text)

    def posts(self, tap: int) -> int:
        return sum(r.method == b"POST" for r in self.taps[tap].seen)


@asynccontextmanager
async def fleet(
    tmp_path: Path,
    store: StoreSettings,
    *,
    sims: int = 1,
    configured: int | None = None,
    sim: SimConfig | None = None,
    sections: str = "",
) -> AsyncIterator[Fleet]:
    """`saltgate serve --workers 2` on `store`, in front of `sims` simulated replicas (the
    first `configured` of them in its config file, with `sections` added), with one tenant
    and its key."""
    master = tmp_path / "master.key"
    create_master_key(master)
    with TenantStore(open_database(store)) as tenants:
        tenants.create_tenant("acme")
        _, key = tenants.create_key("acme")
    running = [await start_sim(sim or SimConfig(port=0)) for _ in range(sims)]
    taps = [Tap(s) for s in running]
    for tap in taps:
        await tap.start()
    config = write_gateway_config(
        tmp_path / "gw.toml",
        state_dir=tmp_path / "state",
        master_key_file=master,
        replicas=[f"http://127.0.0.1:{t.port}" for t in taps[:configured]],
        store=store,
        sections=sections,
    )
    log = tmp_path / "gw.log"
    gateway = await GatewayProcess.start(config, log, workers=WORKERS)
    try:
        assert sorted(worker_pids(gateway.proc.pid)) == list(range(WORKERS))
        yield Fleet(gateway, running, taps, key, config, log)
    finally:
        await gateway.stop()
        for tap in taps:
            await tap.close()
        for s in running:
            await s.close()


def _body(stream: bool, max_tokens: int = 4) -> dict[str, object]:
    body: dict[str, object] = {
        "model": MODEL,
        "prompt": f"w {random.random()}",
        "max_tokens": max_tokens,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _usage(resp: httpx.Response, stream: bool) -> dict[str, int]:
    """The answer's usage; for a stream, only if it ended with [DONE] (delivered whole)."""
    if not stream:
        return dict(resp.json()["usage"])
    lines = resp.text.splitlines()
    assert "data: [DONE]" in lines, resp.text[-300:]
    [usage] = [
        doc["usage"]
        for ln in lines
        if ln.startswith("data: {") and (doc := orjson.loads(ln[6:])).get("usage")
    ]
    return dict(usage)


def test_requests_spread_over_both_workers_and_metrics_sum_them(tmp_path: Path) -> None:
    store = StoreSettings.in_state_dir(tmp_path / "state")

    async def main() -> None:
        async with fleet(tmp_path, store) as f:
            sent: Counter[str] = Counter()

            async def user(n: int) -> None:
                for session in range(5):  # a new connection per session, 3 requests on each
                    async with f.client() as http:
                        for i in range(3):
                            stream = (n + session + i) % 2 == 0
                            resp = await http.post("/v1/completions", json=_body(stream))
                            assert resp.status_code == 200, resp.text
                            usage = _usage(resp, stream)
                            sent["requests"] += 1
                            sent["prompt"] += usage["prompt_tokens"]
                            sent["completion"] += usage["completion_tokens"]

            await asyncio.gather(*(user(n) for n in range(8)))
            values = await f.metrics()
        assert sent["requests"] == 120
        assert values['saltgate_requests_total{method="POST",status="200"}'] == 120
        for kind in ("prompt", "completion"):  # over the tenant and model labels
            prefix = f'saltgate_tokens_total{{kind="{kind}",'
            assert sum(v for k, v in values.items() if k.startswith(prefix)) == sent[kind]
        assert values['saltgate_request_duration_seconds_count{route="/v1/completions"}'] == 120
        served = per_worker(values, "saltgate_worker_requests_total")
        assert sum(served.values()) == 120 and all(served[i] > 0 for i in range(WORKERS)), served
        assert values["saltgate_workers_alive"] == WORKERS
        assert per_worker(values, "saltgate_worker_restarts_total") == {0: 0.0, 1: 0.0}
        replica = f"http://127.0.0.1:{f.taps[0].port}"  # labelled by URL, not by index
        for i in range(WORKERS):  # a gauge is each worker's own view
            assert values[f'saltgate_replica_healthy{{replica="{replica}",worker="{i}"}}'] == 1.0
            assert f'saltgate_store_unreachable_seconds{{worker="{i}"}}' in values

    run(main)


@dataclass
class Outcome:
    start: float
    end: float = 0.0
    request_id: str | None = None  # a 200 delivered whole
    error: str | None = None


@dataclass
class Load:
    outcomes: list[Outcome] = field(default_factory=list)

    def delivered(self) -> int:
        return sum(o.request_id is not None for o in self.outcomes)


async def _load(f: Fleet, load: Load, stop: asyncio.Event, users: int = 6) -> None:
    """Keep-alive clients, each on a new connection every 10 requests (so a restarted
    worker gets some), half of the requests streamed, until `stop`."""

    async def user(n: int) -> None:
        rng = random.Random(n)
        while not stop.is_set():
            async with f.client() as http:
                for _ in range(10):
                    if stop.is_set():
                        break
                    await _request(http, load, rng)

    await asyncio.gather(*(user(n) for n in range(users)))


async def _request(http: httpx.AsyncClient, load: Load, rng: random.Random) -> None:
    stream = rng.random() < 0.5
    outcome = Outcome(time.monotonic())
    load.outcomes.append(outcome)
    try:
        resp = await http.post("/v1/completions", json=_body(stream, rng.randint(1, 8)))
        if resp.status_code == 200:
            _usage(resp, stream)
            outcome.request_id = resp.headers["x-request-id"]
        else:
            outcome.error = f"{resp.status_code}: {resp.text[:200]}"
    except (httpx.HTTPError, AssertionError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.end = time.monotonic()


def _ledger(store: StoreSettings) -> Counter[tuple[str, int]]:
    db = open_database(store, create=False)
    try:
        return Counter(
            (str(rid), int(status))
            for rid, status in db.query("SELECT request_id, status FROM usage")
        )
    finally:
        db.close()


def test_a_killed_worker_is_restarted_and_each_delivered_200_has_one_record(
    store_settings: StoreSettings, tmp_path: Path
) -> None:
    load = Load()
    times: dict[str, float] = {}
    planted = new_api_key()

    async def main() -> None:
        sim = SimConfig(port=0, prefill_ms_per_1k_tokens=0, decode_ms_per_token=2)
        async with fleet(tmp_path, store_settings, sim=sim) as f:
            stop = asyncio.Event()
            running = asyncio.create_task(_load(f, load, stop))
            await eventually(lambda: load.delivered() >= 100, timeout_s=60, what="the load runs")
            victim = worker_pids(f.pid)[1]
            times["kill"] = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            await eventually(lambda: gone(victim), what="the killed worker exits")
            times["dead"] = time.monotonic()

            async def restarted() -> bool:
                values = await f.metrics()
                restarts = per_worker(values, "saltgate_worker_restarts_total")
                return restarts == {0: 0.0, 1: 1.0} and values["saltgate_workers_alive"] == 2

            await eventually(restarted, timeout_s=30, what="worker 1 restarted")
            assert set(worker_pids(f.pid)) == {0, 1} and worker_pids(f.pid)[1] != victim
            before = per_worker(await f.metrics(), "saltgate_worker_requests_total")[1]
            after = load.delivered() + 100

            async def new_worker_serves() -> bool:
                served = per_worker(await f.metrics(), "saltgate_worker_requests_total")[1]
                return load.delivered() >= after and served > before

            await eventually(new_worker_serves, timeout_s=60, what="the new worker 1 serves")
            async with f.client() as http:  # the log scan's positive control, below
                http.headers["x-request-id"] = planted
                await _request(http, load, random.Random(0))
            stop.set()
            await asyncio.wait_for(running, 60)
            await f.gateway.stop()
            assert f.gateway.proc.returncode == 0
            log = f.log.read_text()
            # The supervisor's word on worker 1: its death and restart, once, as a warning.
            lines = [ln for ln in log.splitlines() if "[supervisor]" in ln and "worker 1" in ln]
            assert len(lines) == 1, lines
            assert " WARNING [supervisor] saltgate.serving.supervisor: " in lines[0], lines
            assert f"worker 1 (pid {victim}) was killed by SIGKILL after " in lines[0], lines
            assert lines[0].endswith("restarting it (restart 1)"), lines
            master = load_master_key(tmp_path / "master.key")
            assert not leaks(log, api_key=f.key, master_key=master)
            # The key-shaped request id a client chose is in the access log lines there,
            # and the same scan finds it.
            assert leaks(log, planted=planted)

    run(main)
    failed = [o for o in load.outcomes if o.error is not None]
    in_flight = [o for o in load.outcomes if o.start < times["kill"] < (o.end or times["kill"] + 1)]
    assert all(o.start < times["dead"] for o in failed), [
        o for o in failed if o.start >= times["dead"]
    ][:3]
    assert len(failed) <= len(in_flight), (len(failed), len(in_flight), failed[:3])
    delivered = [o.request_id for o in load.outcomes if o.request_id is not None]
    assert len(delivered) == len(set(delivered))
    records = _ledger(store_settings)
    for request_id in delivered:  # one record per delivered 200, matched by request id
        assert records[(request_id, 200)] == 1, request_id
    assert all(n == 1 for n in records.values())
    undelivered = set(records) - {(rid, 200) for rid in delivered}
    # Committed, then the kill took the answer with it: at most one per failed request.
    assert len(undelivered) <= len(failed), (undelivered, failed)
    print(
        f"{store_settings.backend}: {len(delivered)} delivered, {len(failed)} failed of "
        f"{len(in_flight)} in flight at the kill; {len(records)} records"
    )


def test_connections_queued_when_a_worker_dies_are_served_by_the_other(tmp_path: Path) -> None:
    """Both workers stopped (SIGSTOP), so requests wait in the accept queue; then one is
    killed and the other continues: every queued request is answered. (With a listening
    socket per worker, SO_REUSEPORT, the dead worker's share would be reset.)"""
    store = StoreSettings.in_state_dir(tmp_path / "state")

    async def main() -> None:
        async with fleet(tmp_path, store) as f:
            pids = worker_pids(f.pid)
            for pid in pids.values():
                os.kill(pid, signal.SIGSTOP)
            try:
                async with f.client(limits=httpx.Limits(max_keepalive_connections=0)) as http:
                    queued = [
                        asyncio.create_task(http.post("/v1/completions", json=_body(False)))
                        for _ in range(16)
                    ]
                    port = urlsplit(f.gateway.url).port
                    assert port is not None
                    await eventually(
                        lambda: accept_queue(port) == len(queued), what="every connection queued"
                    )
                    assert not any(t.done() for t in queued)
                    os.kill(pids[0], signal.SIGKILL)
                    await eventually(lambda: gone(pids[0]), what="worker 0 exits")
                    os.kill(pids[1], signal.SIGCONT)
                    answers = await asyncio.gather(*queued)
            finally:
                os.kill(pids[1], signal.SIGCONT)
            assert [r.status_code for r in answers] == [200] * 16

    run(main)


async def _fresh_requests(f: Fleet, n: int) -> None:
    """`n` requests at once, each on a connection of its own (so both workers serve)."""

    async def one() -> None:
        async with f.client() as http:
            resp = await http.post("/v1/completions", json=_body(False))
            assert resp.status_code == 200, resp.text

    await asyncio.gather(*(one() for _ in range(n)))


async def _reload_to_second_replica(f: Fleet) -> str:
    """Point the config file at the second replica, SIGHUP, and return the parent's line."""
    text = f.config.read_text()
    old, new = (f"127.0.0.1:{t.port}" for t in f.taps[:2])
    f.config.write_text(text.replace(old, new))
    since = f.gateway.log.stat().st_size
    os.kill(f.pid, signal.SIGHUP)
    return await f.gateway.event("reloaded", since=since)


def test_sighup_changes_the_replicas_of_every_worker(tmp_path: Path) -> None:
    store = StoreSettings.in_state_dir(tmp_path / "state")

    async def main() -> None:
        async with fleet(tmp_path, store, sims=2, configured=1) as f:
            await _fresh_requests(f, 20)
            assert (f.posts(0), f.posts(1)) == (20, 0)
            before = per_worker(await f.metrics(), "saltgate_worker_requests_total")
            line = await _reload_to_second_replica(f)
            assert " INFO [supervisor] saltgate.serving.supervisor: " in line, line
            assert line.endswith(f"reloaded {f.config}: 1 replicas in 2 of 2 workers"), line
            await _fresh_requests(f, 40)
            after = per_worker(await f.metrics(), "saltgate_worker_requests_total")
            assert all(after[i] > before[i] for i in range(WORKERS)), (before, after)
            assert (f.posts(0), f.posts(1)) == (20, 40)  # every worker sends to the new one

    run(main)


async def _ready_everywhere(f: Fleet, n: int = 20) -> set[int]:
    """The /ready statuses of `n` checks, each on a connection of its own, and that both
    workers answered some (each answers for itself)."""
    before = per_worker(await f.metrics(), "saltgate_worker_requests_total")

    async def one() -> int:
        async with async_client(base_url=f.gateway.url, timeout=30) as http:
            return (await http.get("/ready")).status_code

    statuses = set(await asyncio.gather(*(one() for _ in range(n))))
    after = per_worker(await f.metrics(), "saltgate_worker_requests_total")
    assert all(after[i] > before[i] for i in range(WORKERS)), (before, after)
    return statuses


def test_every_worker_answers_ready_for_itself(tmp_path: Path) -> None:
    store = StoreSettings.in_state_dir(tmp_path / "state")

    async def main() -> None:
        async with fleet(tmp_path, store, sims=1) as f:
            assert await _ready_everywhere(f) == {200}
            await kill(f.taps[0])  # the only replica: no worker can serve now

            async def every_worker_refuses() -> bool:
                return await _ready_everywhere(f) == {503}

            await eventually(every_worker_refuses, what="both workers see it down", timeout_s=30)

    run(main)


def test_a_reload_while_a_worker_restarts_reaches_it_too(tmp_path: Path) -> None:
    """SIGHUP while a killed worker is being replaced (its backoff, then its start): the
    new worker, whichever configuration it started with, ends up on the new replicas."""
    store = StoreSettings.in_state_dir(tmp_path / "state")

    async def main() -> None:
        async with fleet(tmp_path, store, sims=2, configured=1) as f:
            victim = worker_pids(f.pid)[1]
            os.kill(victim, signal.SIGKILL)
            await eventually(lambda: gone(victim), what="the killed worker exits")
            await eventually(
                lambda: victim not in worker_pids(f.pid).values() and 1 in worker_pids(f.pid),
                timeout_s=30,
                what="worker 1's replacement starting",
            )
            line = await _reload_to_second_replica(f)
            assert line.endswith(" workers") and "1 replicas in " in line, line

            async def both_alive() -> bool:
                return (await f.metrics())["saltgate_workers_alive"] == 2

            await eventually(both_alive, timeout_s=30, what="worker 1 back")
            before = per_worker(await f.metrics(), "saltgate_worker_requests_total")
            await _fresh_requests(f, 40)
            after = per_worker(await f.metrics(), "saltgate_worker_requests_total")
            assert all(after[i] > before[i] for i in range(WORKERS)), (before, after)
            assert (f.posts(0), f.posts(1)) == (0, 40)

    run(main)


def test_sigterm_lets_a_long_stream_finish_and_refuses_new_connections(tmp_path: Path) -> None:
    store = StoreSettings.in_state_dir(tmp_path / "state")

    async def main() -> None:
        sim = SimConfig(port=0, decode_ms_per_token=100)  # 20 tokens: a 2 s stream
        async with fleet(tmp_path, store, sim=sim) as f, f.client() as http:
            body = _body(True, max_tokens=20)
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: {")
                started = time.monotonic()
                os.kill(f.pid, signal.SIGTERM)

                closed = functools.partial(refused, f.gateway.url)
                await eventually(closed, what="new connections refused while draining")
                rest = [line async for line in lines]
                assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
                took = time.monotonic() - started
                request_id = resp.headers["x-request-id"]
            assert took > 1.0, "the stream ended early"
            assert await asyncio.wait_for(f.gateway.proc.wait(), 30) == 0
            assert worker_pids(f.pid) == {}
        assert _ledger(store) == Counter({(request_id, 200): 1})

    run(main)


def _serve_exits(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SALTGATE), "serve", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_worker_that_cannot_start_fails_the_serve_with_its_reason(tmp_path: Path) -> None:
    """Every worker reads the master key itself: a missing one gives the single
    process's message and exit status 2."""
    config = write_gateway_config(
        tmp_path / "gw.toml",
        state_dir=tmp_path / "state",
        master_key_file=tmp_path / "missing.key",
        replicas=["http://127.0.0.1:9"],
        store=StoreSettings.in_state_dir(tmp_path / "state"),
    )
    single, done = _serve_exits(config), _serve_exits(config, "--workers", "2")
    assert (done.returncode, single.returncode) == (2, 2)
    assert done.stderr.strip() == single.stderr.strip()
    assert "missing.key" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    bad = _serve_exits(config, "--workers", "0")
    assert bad.returncode == 2 and "--workers must be at least 1" in bad.stderr


def test_workers_do_not_outlive_a_killed_parent(tmp_path: Path) -> None:
    """SIGKILL leaves the parent no time to stop anything: its workers see their control
    channel close, drain and exit, and the port closes with them."""
    store = StoreSettings.in_state_dir(tmp_path / "state")

    async def main() -> None:
        async with fleet(tmp_path, store) as f:
            pids = worker_pids(f.pid)
            f.gateway.proc.kill()
            await f.gateway.proc.wait()
            for pid in pids.values():
                await eventually(functools.partial(gone, pid), what=f"worker pid {pid} exits")
            port = int(f.gateway.url.rsplit(":", 1)[1])
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                return
            writer.close()
            raise AssertionError("the port still accepts connections")

    run(main)


def test_every_worker_opens_ehbp_with_the_one_key_clients_fetched(tmp_path: Path) -> None:
    """A client fetches the HPKE key config once and then reaches any worker: each must
    hold the same private key (a key per worker would answer 422, key config mismatch),
    and the same retired key of a rotation (`[ehbp] retired_key_files`), not offered."""
    store = StoreSettings.in_state_dir(tmp_path / "state")
    retired = ServerKey.generate()
    create_secret_file(tmp_path / "old.key", "old EHBP key", retired.private_bytes().hex() + "\n")
    sections = f'[ehbp]\nretired_key_files = ["{tmp_path / "old.key"}"]\n'

    async def main() -> None:
        async with fleet(tmp_path, store, sections=sections) as f:
            async with async_client() as plain:
                config = (await plain.get(f.gateway.url + KEYS_PATH)).content
            assert config != retired.config.encode()
            offered = ehbp.ServerIdentity.unmarshal_public_config(config)
            old = ehbp.ServerIdentity.unmarshal_public_config(retired.config.encode())
            before = per_worker(await f.metrics(), "saltgate_worker_requests_total")

            async def sealed(identity: ehbp.ServerIdentity) -> None:
                async with async_client(
                    base_url=f.gateway.url,
                    transport=ehbp.AsyncEHBPTransport(identity),  # a connection of its own
                    headers={"authorization": f"Bearer {f.key}"},
                    timeout=30,
                ) as client:
                    resp = await client.post("/v1/completions", json=_body(False))
                    assert resp.status_code == 200, resp.text
                    assert RESPONSE_NONCE_HEADER in resp.headers

            await asyncio.gather(*(sealed(key) for key in [offered, old] * 12))
            after = per_worker(await f.metrics(), "saltgate_worker_requests_total")
            assert all(after[i] > before[i] for i in range(WORKERS)), (before, after)
            values = await f.metrics()
            assert values['saltgate_ehbp_requests_total{outcome="opened"}'] == 24
            assert 'saltgate_ehbp_requests_total{outcome="rejected"}' not in values
            assert 'saltgate_ehbp_requests_total{outcome="key_config"}' not in values

    run(main)
