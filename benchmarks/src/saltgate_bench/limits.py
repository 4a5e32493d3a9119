"""`saltgate-bench limits`: the tenants' limits measured on a fleet (issue 23's targets).

    .venv/bin/saltgate-bench limits [--gateways 4] [--rpm 600] [--duration 180] --json out.json

One Redis (the `[cluster]` bus and shared limits engine), simulated replicas, and N
`saltgate serve` processes on one store, started here on loopback. Measured, each from
what the clients saw or what Redis and the ledger hold afterwards, never from the
gateways' own counters:

- window: a tenant limited to L requests (and L x 64 input, L x 16 output tokens) per
  minute sends 10 x L per minute, round robin over the gateways; the admitted requests
  and their tokens (from each answer's usage), counted in every 60 s window ending at an
  admitted request's send time (the gateway admits a request before anything else it
  does with it), stay <= 1.02 x L. The control arm runs the same gateways without a
  shared engine and without `[limits] share`: N x L, the silent multiplication the
  shared engine prevents.
- concurrency: 64 admissions at once at a cap, 100,000 times, through the shared engine's
  admission script in the same Redis (limits_race.py); 0 trials admit more than
  the cap. The control (check, then add) over-admits.
- budget: a tenant with a spend budget, 16 clients at once until it is spent; the spend
  in the ledger stays <= the budget + one request's reservation.
- cancelled: streams cancelled after their first token (real HTTP through the gateways
  to the replicas); afterwards every lease and token reservation in Redis is back to 0,
  and every key of the tenant is gone once its window has passed.
- latency: one admission through SharedLimits into the fleet's Redis (every limit kind
  set, thousands of entries in the window), and through the in-process Governor.

With `--workers N` (N > 1) it measures one host instead (issue 42): one `saltgate serve
--workers N` without [cluster] or [limits] share, the workers counting in one place (the
supervisor: governance/arbiter.py). No Redis; the window phase only (the tenant's requests
on 8 connections, which the workers share by least connections; each worker's requests
are read from /metrics), and the latency of one admission through the supervisor (a real
second process serving the arbiter over a socket pair, as a worker asks it), one at a time
and 32 at once, against the in-process Governor.

Table on stdout, --json FILE, a progress bar per phase; exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import socket
import string
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson
from redis.asyncio import Redis

from saltgate.admin.scopes import USAGE_READ
from saltgate.gateway.host_limits import HostLimits
from saltgate.gateway.shared_limits import SharedLimits
from saltgate.governance.answers import reservation
from saltgate.governance.kinds import LimitKind, Scope, Subject
from saltgate.governance.limits import (
    DEFAULT_LEASE_TTL_S,
    WINDOW_S,
    Demand,
    Governor,
    Limits,
)
from saltgate.http import UpstreamError, UpstreamPool
from saltgate.prices import Price, PriceVersion
from saltgate.store.admin_tokens import AdminTokens
from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore
from saltgate_bench.gateway_setup import (
    GatewayState,
    gateway_config,
    prepare_gateway_state,
    serve_argv,
    write_gateway_config,
)
from saltgate_bench.limits_race import RaceResult, race
from saltgate_bench.procs import (
    BenchError,
    machine_info,
    positive,
    source_state,
    workdir,
)
from saltgate_bench.replay_client import RequestShape, cached_tokens_of
from saltgate_bench.replay_procs import Fleet, SimSettings, wait_ready
from saltgate_devkit.procs import Proc, free_port
from saltgate_devkit.services import RedisServer, ServiceError

HELP = "the limits on a fleet: any 60 s window, concurrency races, budget, cancelled streams"
MODEL = "sim-model"
ROUTE = "/v1/completions"
PRICE = Price(10.0, 1.0, 30.0)  # USD per million tokens: a request costs about $0.001
WINDOW_SLACK = 1.02  # issue 23: at most 1.02 x L in any 60 s window
LATENCY_P99_MS = 2.0  # issue 23: admission adds at most 2 ms at p99 on the fleet
TENANTS = ("probe", "window-shared", "window-alone", "budget", "streams")
# The window arm's token limits, per request allowed by the rpm: prompts of 16-112 words
# (64 on average) and 4-28 output tokens (16), so every limit is close to binding.
INPUT_PER_REQUEST = 64
OUTPUT_PER_REQUEST = 16
# Limits that never refuse a request, for the latency and the cancelled streams.
UNBOUNDED = Limits(rpm=10**9, input_tpm=10**12, output_tpm=10**12)
BUDGET_CLIENTS = 16
FALLBACK = "limits: Redis unreachable"  # what a gateway logs as it falls back to its share
HOST_FALLBACK = "limits: the supervisor unreachable"  # the same, a worker of --workers N
HOST_CONNECTIONS = 8  # the window's connections to a --workers gateway
HOST_CONCURRENCY = 32  # admissions at once in the host's throughput measure
# A second process serving the arbiter as the supervisor does (serving/supervisor.py).
ARBITER_CHILD = """
import asyncio, socket, sys
from saltgate.governance.arbiter import Arbiter
from saltgate.runtime import install_uvloop
from saltgate.serving.supervisor import arbitrate
install_uvloop()
asyncio.run(arbitrate(Arbiter(), 1, socket.socket(fileno=int(sys.argv[1])), "bench"))
"""


def fallbacks_in(logs: Iterable[str]) -> int:
    """The fallbacks to the local share that gateways' logs record."""
    return sum(log.count(FALLBACK) for log in logs)


STREAM_MAX_TOKENS = 64  # cut after the first: midway


@dataclass(frozen=True, slots=True)
class Options:
    gateways: int
    workers: int
    replicas: int
    rpm: int
    overload: float
    duration_s: float
    control_duration_s: float
    trials: int
    control_trials: int
    burst: int
    cap: int
    streams: int
    stream_clients: int
    budget_usd: float
    latency_samples: int
    wait_expiry: bool
    startup_timeout_s: float
    progress: bool
    seed: int


@dataclass(slots=True)
class Sent:
    """One request as the client saw it: when it left, the answer's status and usage."""

    at: float
    status: int = 0
    code: str = ""
    input_tokens: int = 0  # uncached: prompt - cached, as the limit counts it
    output_tokens: int = 0
    cost_micro_usd: int = 0  # its reservation, for the budget
    error: str = ""


def max_in_window(events: Iterable[tuple[float, int]], span: float = WINDOW_S) -> int:
    """The largest sum of amounts in any window (s - span, s]: the sliding-log meaning of
    a limit, checked at every event (a window's sum only grows at an event)."""
    ordered = sorted(events)
    best = total = 0
    left = 0
    for at, amount in ordered:
        total += amount
        while ordered[left][0] <= at - span:
            total -= ordered[left][1]
            left += 1
        best = max(best, total)
    return best


def window_figures(sent: Sequence[Sent], limits: Limits, gateways: int) -> dict[str, Any]:
    """Admitted requests and tokens in the fullest 60 s window, against the limits."""
    admitted = [s for s in sent if s.status == 200]
    rejected = [s for s in sent if s.status == 429]
    peaks = {
        LimitKind.REQUESTS: max_in_window((s.at, 1) for s in admitted),
        LimitKind.INPUT_TOKENS: max_in_window((s.at, s.input_tokens) for s in admitted),
        LimitKind.OUTPUT_TOKENS: max_in_window((s.at, s.output_tokens) for s in admitted),
    }
    ratios = {}
    for kind, peak in peaks.items():
        limit = limits.windowed(kind)
        assert limit is not None
        ratios[kind] = round(peak / limit, 4)
    return {
        "gateways": gateways,
        "limits": {
            "rpm": limits.rpm,
            "input_tpm": limits.input_tpm,
            "output_tpm": limits.output_tpm,
        },
        "sent": len(sent),
        "admitted": len(admitted),
        "rejected_429": len(rejected),
        "errors": len(sent) - len(admitted) - len(rejected),
        "span_s": round(max(s.at for s in sent) - min(s.at for s in sent), 1) if sent else 0.0,
        "max_window": peaks,
        "max_window_ratio": ratios,
        "worst_ratio": max(ratios.values()),
    }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]


Limited = list[tuple[Subject, Limits]]


def latency_limits() -> Limited:
    """What the latency figures admit into: a tenant with every kind of limit and its key,
    all too large to refuse, so each admission checks and records every log."""
    every = replace(UNBOUNDED, concurrency=10**6)
    return [
        (Subject(Scope.TENANT, "bench-latency"), every),
        (Subject(Scope.KEY, "bench-latency"), Limits(rpm=10**9)),
    ]


def local_latencies(limited: Limited, samples: int) -> list[float]:
    """One admission and its settlement at a time in an in-process Governor (the
    comparison for the shared engines), sorted seconds."""
    governor = Governor()
    for subject, limits in limited:
        governor.set_limits(subject, limits)
    subjects = [subject for subject, _ in limited]
    local: list[float] = []
    for i in range(samples):
        start = time.perf_counter()
        decision = governor.admit(subjects, Demand(100, 100), i * 0.001)
        local.append(time.perf_counter() - start)
        assert decision.ticket is not None
        governor.settle(decision.ticket, Demand(50, 50), i * 0.001)
    return sorted(local)


class Bench:
    """Every phase on one Redis, one set of replicas and one store; gateways per arm."""

    def __init__(self, options: Options, work: Path) -> None:
        self.o = options
        self.work = work
        self.rng = random.Random(options.seed)
        self.redis: RedisServer | None = None
        self.sims: Fleet | None = None
        self.state: GatewayState | None = None
        self.tenant_ids: dict[str, str] = {}
        self.gateways: list[Proc] = []
        self.ports: list[int] = []
        self.admin_ports: list[int] = []
        self.metrics_token = ""
        self.price = PriceVersion.of(MODEL, PRICE)

    def log(self, message: str) -> None:
        print(f"[limits] {message}", file=sys.stderr, flush=True)

    # -- the fleet -----------------------------------------------------------------------

    async def start(self) -> None:
        try:
            if self.o.workers == 1:  # one host needs no Redis
                self.redis = RedisServer()
                self.redis.start()
        except ServiceError as exc:
            raise BenchError(str(exc)) from None
        sim = SimSettings(
            # 4 ms a token: a 64-token stream lasts long enough to be cut midway even when
            # the machine is busy; the window's answers (at most 28 tokens) stay short.
            prefill_ms_per_1k_tokens=20.0,
            decode_ms_per_token=4.0,
            max_concurrency=512,
        )
        self.sims = Fleet(sim, self.o.replicas, self.work, "limits")
        await self.sims.start(self.o.startup_timeout_s)
        store = StoreSettings.sqlite(self.work / "store.db")
        self.state = prepare_gateway_state(self.work / "state", TENANTS, store)
        with TenantStore(open_database(store)) as db:
            self.metrics_token = AdminTokens(db.db).create([USAGE_READ])[1]
            self.tenant_ids = {t.name: t.id for t in db.list_tenants()}
            db.set_limits("window-shared", self.window_limits)
            db.set_limits("window-alone", self.window_limits)
            budget = Limits(
                budget_micro_usd=round(self.o.budget_usd * 1_000_000), budget_period_s=86400
            )
            db.set_limits("budget", budget)
            # A gateway reads the rest of a stream its client left (to meter it): the lease
            # is held until then, so a client may have many streams out at once.
            cap = self.o.stream_clients * 64
            db.set_limits("streams", replace(UNBOUNDED, concurrency=cap))

    @property
    def window_limits(self) -> Limits:
        rpm = self.o.rpm
        return Limits(
            rpm=rpm, input_tpm=rpm * INPUT_PER_REQUEST, output_tpm=rpm * OUTPUT_PER_REQUEST
        )

    def key(self, tenant: str) -> str:
        assert self.state is not None
        return self.state.api_keys[TENANTS.index(tenant)]

    async def up(self, tag: str, *, shared: bool) -> None:
        """N gateways on the store; with `shared`, on the Redis engine ([cluster]) and
        configured as docs/limits.md says a fleet is (`[limits] share = N`: the share each
        enforces on its own counts while Redis does not answer)."""
        assert self.state is not None and self.sims is not None and self.redis is not None
        prices = (
            f"\n[prices.{MODEL}]\ninput = {PRICE.input_per_mtok}\n"
            f"cached_input = {PRICE.cached_input_per_mtok}\noutput = {PRICE.output_per_mtok}\n"
        )
        self.gateways, self.ports = [], []
        for i in range(self.o.gateways):
            port = free_port()
            text = gateway_config(
                self.state,
                self.sims.urls,
                port=port,
                admin_port=free_port(),
                cluster=self.redis.settings(f"{tag}{i}") if shared else None,
            )
            share = f"\n[limits]\nshare = {self.o.gateways}\n" if shared else ""
            config = write_gateway_config(self.work / f"{tag}-gw{i}.toml", text + prices + share)
            self.gateways.append(
                Proc(f"{tag}-gw{i}", serve_argv(config), self.work / f"{tag}-gw{i}.log")
            )
            self.ports.append(port)
        shape = RequestShape(MODEL, 16, tenant_keys=(self.key("probe"),))
        for proc, port in zip(self.gateways, self.ports, strict=True):
            await wait_ready(proc, port, shape, self.o.startup_timeout_s)

    async def up_host(self) -> None:
        """One gateway, `serve --workers N`, without [cluster] or [limits] share."""
        assert self.state is not None and self.sims is not None
        prices = (
            f"\n[prices.{MODEL}]\ninput = {PRICE.input_per_mtok}\n"
            f"cached_input = {PRICE.cached_input_per_mtok}\noutput = {PRICE.output_per_mtok}\n"
        )
        port, admin_port = free_port(), free_port()
        text = gateway_config(self.state, self.sims.urls, port=port, admin_port=admin_port)
        config = write_gateway_config(self.work / "host.toml", text + prices)
        argv = [*serve_argv(config), "--workers", str(self.o.workers)]
        self.gateways = [Proc("host", argv, self.work / "host.log")]
        self.ports, self.admin_ports = [port], [admin_port]
        shape = RequestShape(MODEL, 16, tenant_keys=(self.key("probe"),))
        await wait_ready(self.gateways[0], port, shape, self.o.startup_timeout_s)
        # The supervisor opens its admin port once every worker is up: wait for it too.
        deadline = time.monotonic() + self.o.startup_timeout_s
        while len(await self.served_per_worker(missing_ok=True)) < self.o.workers:
            if time.monotonic() > deadline:
                raise BenchError(f"the workers' /metrics never showed {self.o.workers} workers")
            await asyncio.sleep(0.2)

    async def served_per_worker(self, *, missing_ok: bool = False) -> dict[str, float]:
        """Requests each worker of the host has answered (its /metrics); with `missing_ok`,
        none while the admin port does not answer yet."""
        pool = UpstreamPool("127.0.0.1", self.admin_ports[0], connect_timeout=5.0)
        try:
            auth = [(b"authorization", b"Bearer " + self.metrics_token.encode())]
            resp = await pool.request(b"GET", b"/metrics", auth, b"")
            text = (await resp.read()).decode()
        except UpstreamError:
            if missing_ok:
                return {}
            raise
        finally:
            await pool.close()
        prefix = 'saltgate_worker_requests_total{worker="'
        return {
            line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(prefix)
        }

    def fallbacks(self) -> int:
        """How often a gateway found Redis unanswering (0.5 s) and fell back to its share,
        from their logs: each such second, the fleet can admit past a limit."""
        logs = [p.log_path.read_text(errors="replace") for p in self.gateways]
        return fallbacks_in(logs) + sum(log.count(HOST_FALLBACK) for log in logs)

    def down(self) -> None:
        for proc in self.gateways:
            proc.stop()
        self.gateways, self.ports = [], []

    def stop(self) -> None:
        self.down()
        if self.sims is not None:
            self.sims.stop()
        if self.redis is not None:
            with contextlib.suppress(ServiceError):
                self.redis.destroy()

    def redis_client(self) -> Redis:
        assert self.redis is not None
        return Redis.from_url(
            self.redis.url(), password=self.redis.password_file.read_text().strip()
        )

    # -- requests ------------------------------------------------------------------------

    def body(self, *, words: int, max_tokens: int, stream: bool = False) -> bytes:
        # Words of 5 letters: one token each to the replicas' tokenizer (docs/sim.md), as
        # text is about 4 characters a token, which the admission's estimate assumes.
        letters = string.ascii_lowercase
        prompt = " ".join("".join(self.rng.choices(letters, k=5)) for _ in range(words))
        doc: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        if stream:
            doc["stream"] = True
        return orjson.dumps(doc)

    async def post(self, pool: UpstreamPool, key: str, body: bytes, out: Sent) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"authorization", b"Bearer " + key.encode()),
        ]
        try:
            resp = await pool.request(b"POST", ROUTE.encode(), headers, body)
            answer = await resp.read()
        except UpstreamError as exc:
            out.error = str(exc)
            return
        out.status = resp.status
        try:
            doc = orjson.loads(answer)
        except orjson.JSONDecodeError:
            out.error = "not JSON"
            return
        if resp.status == 200:
            usage = doc.get("usage") or {}
            prompt = int(usage.get("prompt_tokens") or 0)
            out.input_tokens = prompt - (cached_tokens_of(usage) or 0)
            out.output_tokens = int(usage.get("completion_tokens") or 0)
        elif isinstance(doc.get("error"), dict):
            out.code = str(doc["error"].get("code") or "")

    def bar(self, desc: str, total: int | None, unit: str = "req") -> Any:
        from tqdm import tqdm  # type: ignore[import-untyped]  # noqa: PLC0415 - only for runs

        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not self.o.progress)

    # -- the phases ----------------------------------------------------------------------

    async def window(self, tenant: str, duration_s: float) -> list[Sent]:
        """10 x L per minute, evenly spaced, round robin over the gateways."""
        rate = self.o.overload * self.o.rpm / WINDOW_S
        count = max(1, int(rate * duration_s))
        key = self.key(tenant)
        per_port = HOST_CONNECTIONS if self.o.workers > 1 else 1
        pools = [
            UpstreamPool("127.0.0.1", p, connect_timeout=5.0, response_timeout=60.0)
            for p in self.ports
            for _ in range(per_port)
        ]
        sent: list[Sent] = []
        tasks = []
        bar = self.bar(tenant, count)
        t0 = time.monotonic()
        try:
            for i in range(count):
                delay = t0 + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                body = self.body(
                    words=self.rng.randint(16, 112), max_tokens=self.rng.randint(4, 28)
                )
                out = Sent(time.monotonic() - t0)
                sent.append(out)
                task = asyncio.create_task(self.post(pools[i % len(pools)], key, body, out))
                task.add_done_callback(lambda _t: bar.update())
                tasks.append(task)
            await asyncio.gather(*tasks)
        finally:
            bar.close()
            for pool in pools:
                await pool.close()
        return sent

    async def budget(self) -> dict[str, Any]:
        """Clients at once until the budget is spent; the ledger's spend afterwards."""
        key = self.key("budget")
        pools = [
            UpstreamPool("127.0.0.1", p, connect_timeout=5.0, response_timeout=60.0)
            for p in self.ports
        ]
        sent: list[Sent] = []
        spent = asyncio.Event()
        bar = self.bar("budget", None)

        async def client(n: int) -> None:
            refusals = 0
            while refusals < 3 and len(sent) < 100_000:
                body = self.body(words=self.rng.randint(16, 112), max_tokens=16)
                out = Sent(
                    time.monotonic(),
                    cost_micro_usd=reservation(self.price, ROUTE, len(body), 16).cost_micro_usd,
                )
                sent.append(out)
                await self.post(pools[(n + len(sent)) % len(pools)], key, body, out)
                bar.update()
                if out.code == "insufficient_quota":
                    refusals += 1
                    spent.set()

        try:
            await asyncio.gather(*(client(n) for n in range(BUDGET_CLIENTS)))
        finally:
            bar.close()
            for pool in pools:
                await pool.close()
        admitted = sum(1 for s in sent if s.status == 200)
        assert self.state is not None and self.state.store is not None
        tenant_id = self.tenant_ids["budget"]
        db = open_database(self.state.store)
        try:
            deadline = time.monotonic() + 30.0
            while True:
                [(rows, spend)] = db.query(
                    "SELECT count(*), coalesce(sum(cost_micro_usd), 0) FROM usage "
                    "WHERE tenant_id = ? AND status = 200",
                    (tenant_id,),
                )
                if rows >= admitted or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        finally:
            db.close()
        budget = round(self.o.budget_usd * 1_000_000)
        one = max(s.cost_micro_usd for s in sent)
        return {
            "budget_micro_usd": budget,
            "spend_micro_usd": int(spend),
            "one_reservation_micro_usd": one,
            "over_budget_micro_usd": max(0, int(spend) - budget),
            "sent": len(sent),
            "admitted": admitted,
            "ledger_records": int(rows),
            "refused_insufficient_quota": sum(1 for s in sent if s.code == "insufficient_quota"),
            "errors": sum(1 for s in sent if s.status not in (200, 429)),
            "ok": int(spend) <= budget + one and int(rows) == admitted,
        }

    async def cancelled(self) -> dict[str, Any]:
        """Streams cut after their first token; then what Redis holds for the tenant."""
        key = self.key("streams")
        counts = {"cancelled_midway": 0, "finished": 0, "rejected": 0, "errors": 0}
        left: dict[str, int] = {}
        bar = self.bar("cancelled streams", self.o.streams)
        queue = iter(range(self.o.streams))

        async def client() -> None:
            for i in queue:
                port = self.ports[i % len(self.ports)]
                body = self.body(words=32, max_tokens=STREAM_MAX_TOKENS, stream=True)
                counts[await _cut_stream(port, key, body)] += 1
                bar.update()

        try:
            await asyncio.gather(*(client() for _ in range(self.o.stream_clients)))
        finally:
            bar.close()
        ended = time.monotonic()
        prefix = f"sg:lim:tenant:{self.tenant_ids['streams']}:"
        leases_key = prefix + "concurrency"
        redis = self.redis_client()
        leases_zero = counters_gone = None
        try:
            left = {
                k: int(await redis.get(prefix + k + ":s") or 0)
                for k in (LimitKind.REQUESTS, LimitKind.INPUT_TOKENS, LimitKind.OUTPUT_TOKENS)
            }
            # Leases are returned as the requests end; the windowed counters keep what was
            # used until it leaves the window, then their keys expire.
            limit_s = WINDOW_S + 10.0 if self.o.wait_expiry else 30.0
            while time.monotonic() - ended < limit_s:
                now = time.monotonic() - ended
                if leases_zero is None and int(await redis.zcard(leases_key)) == 0:
                    leases_zero = now
                keys = [k async for k in redis.scan_iter(match=prefix + "*")]
                if counters_gone is None and all(k.decode() == leases_key for k in keys):
                    counters_gone = now
                if leases_zero is not None and (
                    counters_gone is not None or not self.o.wait_expiry
                ):
                    break
                await asyncio.sleep(0.25)
            # A lease whose settlement never reached Redis is freed by its expiry: when?
            held = await redis.zrange(leases_key, 0, -1, withscores=True)
            expiries = [float(entry[1]) for entry in held]
            seconds, micros = (int(v) for v in await redis.time())
            clock_us = seconds * 1_000_000 + micros
            expires_in = max(((at - clock_us) / 1e6 for at in expiries), default=None)
        finally:
            await redis.aclose()
        reserved = self.o.streams * STREAM_MAX_TOKENS
        ok = (
            counts["cancelled_midway"] >= self.o.streams * 0.99
            and (expires_in is None or expires_in <= DEFAULT_LEASE_TTL_S)
            and left[LimitKind.OUTPUT_TOKENS] <= reserved
            and (
                not self.o.wait_expiry
                or (counters_gone is not None and counters_gone <= WINDOW_S + 2)
            )
        )
        return {
            "streams": self.o.streams,
            **counts,
            "output_tokens_reserved": reserved,
            "in_window_when_done": left,
            "leases_zero_after_s": _rounded(leases_zero),
            "leases_left": len(expiries),
            "leases_left_expire_in_s": _rounded(expires_in),
            "counters_gone_after_s": _rounded(counters_gone),
            "lease_ttl_s": DEFAULT_LEASE_TTL_S,
            "window_s": WINDOW_S,
            "ok": ok,
        }

    async def latency(self) -> dict[str, Any]:
        """One admission (and its settlement) at a time: through Redis, then in-process."""
        client = self.redis_client()
        engine = SharedLimits(client, lease_ttl_s=DEFAULT_LEASE_TTL_S)
        limited = latency_limits()
        shared: list[float] = []
        try:
            for _ in range(self.o.latency_samples):
                start = time.perf_counter()
                ticket, _, _ = await engine.admit(limited, Demand(100, 100))
                shared.append(time.perf_counter() - start)
                assert ticket is not None
                await engine.settle(ticket, Demand(50, 50))
        finally:
            await client.aclose()
        local = local_latencies(limited, self.o.latency_samples * 5)
        shared.sort()
        p99 = percentile(shared, 99) * 1000
        return {
            "samples": len(shared),
            "shared_p50_ms": round(percentile(shared, 50) * 1000, 3),
            "shared_p99_ms": round(p99, 3),
            "local_p50_us": round(percentile(local, 50) * 1e6, 1),
            "local_p99_us": round(percentile(local, 99) * 1e6, 1),
            "ok": p99 <= LATENCY_P99_MS,
        }

    async def host_latency(self) -> dict[str, Any]:
        """One admission (and its settlement) at a time through a second process serving
        the arbiter, as a worker asks its supervisor; then HOST_CONCURRENCY at once (the
        admissions a second); each against the in-process Governor."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", ARBITER_CHILD, str(theirs.fileno()), pass_fds=(theirs.fileno(),)
        )
        theirs.close()
        engine = await HostLimits.open(ours, timeout_s=5.0)
        limited = latency_limits()
        one: list[float] = []
        try:
            for _ in range(self.o.latency_samples):
                start = time.perf_counter()
                ticket, _, _ = await engine.admit(limited, Demand(100, 100))
                one.append(time.perf_counter() - start)
                assert ticket is not None
                engine.settle(ticket, Demand(50, 50))
            per_client = max(1, self.o.latency_samples * 4 // HOST_CONCURRENCY)

            async def client() -> None:
                for _ in range(per_client):
                    ticket, _, _ = await engine.admit(limited, Demand(100, 100))
                    assert ticket is not None
                    engine.settle(ticket, Demand(50, 50))

            start = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(HOST_CONCURRENCY)))
            host_rate = per_client * HOST_CONCURRENCY / (time.perf_counter() - start)
        finally:
            await engine.aclose()
            await child.wait()
        local = local_latencies(limited, self.o.latency_samples * 5)
        one.sort()
        p99 = percentile(one, 99) * 1000
        return {
            "engine": "supervisor",
            "samples": len(one),
            "shared_p50_ms": round(percentile(one, 50) * 1000, 3),
            "shared_p99_ms": round(p99, 3),
            "shared_per_s_at_32": round(host_rate),
            "local_p50_us": round(percentile(local, 50) * 1e6, 1),
            "local_p99_us": round(percentile(local, 99) * 1e6, 1),
            "local_per_s": round(len(local) / sum(local)),
            "ok": p99 <= LATENCY_P99_MS,
        }

    async def run_host(self) -> dict[str, Any]:
        """--workers N: one host's window and the cost of its shared decision."""
        o = self.o
        report: dict[str, Any] = {"load_before": list(os.getloadavg())}
        try:
            await self.start()
            self.log(f"one gateway, --workers {o.workers}, no [cluster]: one count per host")
            await self.up_host()
            before = await self.served_per_worker()
            host = window_figures(
                await self.window("window-shared", o.duration_s), self.window_limits, 1
            )
            after = await self.served_per_worker()
            served = {w: after[w] - before.get(w, 0.0) for w in sorted(after)}
            report["window"] = [
                {
                    "arm": f"workers x{o.workers}",
                    "control": False,
                    **host,
                    "workers": o.workers,
                    "served_per_worker": served,
                    "redis_fallbacks": self.fallbacks(),
                    "ok": host["worst_ratio"] <= WINDOW_SLACK
                    and host["errors"] == 0
                    and len(served) == o.workers
                    and all(served.values()),
                }
            ]
            self.down()
            report["latency"] = await self.host_latency()
        finally:
            self.stop()
        report["load_after"] = list(os.getloadavg())
        return report

    async def races(self) -> list[dict[str, Any]]:
        assert self.redis is not None
        password = self.redis.password_file.read_text().strip()
        out: list[dict[str, Any]] = []
        for racy, trials in ((False, self.o.trials), (True, self.o.control_trials)):
            desc = "control: check, then add" if racy else "concurrency trials"
            bar = self.bar(desc, trials, "trial")
            try:
                result: RaceResult = await race(
                    self.redis.port,
                    password,
                    trials=trials,
                    burst=self.o.burst,
                    cap=self.o.cap,
                    racy=racy,
                    tick=bar.update,
                )
            finally:
                bar.close()
            out.append(
                {
                    **result.as_dict(),
                    "control": racy,
                    "ok": (result.over_admissions > 0)
                    if racy
                    else (result.over_admissions == 0 and result.leases_left == 0),
                }
            )
        return out

    async def run(self) -> dict[str, Any]:
        if self.o.workers > 1:
            return await self.run_host()
        o = self.o
        report: dict[str, Any] = {"load_before": list(os.getloadavg())}
        try:
            await self.start()
            self.log(f"{o.gateways} gateways on one Redis engine ([cluster])")
            await self.up("shared", shared=True)
            window_limits = self.window_limits
            shared = window_figures(
                await self.window("window-shared", o.duration_s), window_limits, o.gateways
            )
            windows = [
                {
                    "arm": "shared",
                    "control": False,
                    **shared,
                    "redis_fallbacks": self.fallbacks(),
                    "ok": shared["worst_ratio"] <= WINDOW_SLACK and shared["errors"] == 0,
                }
            ]
            report["budget"] = await self.budget()
            report["cancelled"] = await self.cancelled()
            report["latency"] = await self.latency()
            report["concurrency"] = await self.races()
            self.down()
            self.log(f"control: {o.gateways} gateways without a shared engine or [limits] share")
            await self.up("alone", shared=False)
            alone = window_figures(
                await self.window("window-alone", o.control_duration_s), window_limits, o.gateways
            )
            windows.append(
                {
                    "arm": "alone",
                    "control": True,
                    **alone,
                    "redis_fallbacks": None,
                    "ok": alone["worst_ratio"] > WINDOW_SLACK,
                }
            )
            report["window"] = windows
        finally:
            self.stop()
        report["load_after"] = list(os.getloadavg())
        return report


async def _cut_stream(port: int, key: str, body: bytes) -> str:
    """Send a streaming request over a fresh connection and drop the connection as soon as
    its first event arrives: a client gone midway, as the gateway sees one."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10.0)
    except (OSError, TimeoutError):
        return "errors"
    try:
        writer.write(
            b"POST " + ROUTE.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\nauthorization: Bearer " + key.encode() + b"\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )
        seen = b""
        while b"\r\n\r\n" not in seen or b"data:" not in seen.split(b"\r\n\r\n", 1)[1]:
            chunk = await asyncio.wait_for(reader.read(65536), 30.0)
            if not chunk:
                break
            seen += chunk
        status = seen[9:12]
        if status == b"429":
            return "rejected"
        if status != b"200":
            return "errors"
        return "finished" if b"[DONE]" in seen else "cancelled_midway"
    except (OSError, TimeoutError):
        return "errors"
    finally:
        writer.transport.abort()


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def checks(report: dict[str, Any]) -> list[str]:
    """One line per target: PASS or FAIL, and the figure."""
    lines = []
    for arm in report["window"]:
        what = "control, must exceed" if arm["control"] else "<= 1.02 x L"
        lines.append(
            f"{'PASS' if arm['ok'] else 'FAIL'} window {arm['arm']} x{arm['gateways']}: fullest "
            f"60 s window {arm['worst_ratio']:.3f} x L ({what}); admitted {arm['admitted']} "
            f"of {arm['sent']}"
            + ("" if arm["redis_fallbacks"] is None else f"; {arm['redis_fallbacks']} fallbacks")
            + (f"; per worker {arm['served_per_worker']}" if "served_per_worker" in arm else "")
        )
    lat = report["latency"]
    if lat.get("engine") == "supervisor":
        lines.append(
            f"{'PASS' if lat['ok'] else 'FAIL'} latency: admission through the supervisor p50 "
            f"{lat['shared_p50_ms']} ms, p99 {lat['shared_p99_ms']} ms (<= {LATENCY_P99_MS} ms); "
            f"{lat['shared_per_s_at_32']}/s at {HOST_CONCURRENCY} at once; in-process p99 "
            f"{lat['local_p99_us']} us, {lat['local_per_s']}/s"
        )
        return lines
    for race_ in report["concurrency"]:
        what = "control, must over-admit" if race_["control"] else "0 over-admissions"
        lines.append(
            f"{'PASS' if race_['ok'] else 'FAIL'} concurrency {race_['engine']}: "
            f"{race_['over_admissions']} of {race_['trials']} trials of {race_['burst']} at a "
            f"cap of {race_['cap']} over-admitted ({what}); at most {race_['max_admitted']}"
        )
    b = report["budget"]
    lines.append(
        f"{'PASS' if b['ok'] else 'FAIL'} budget: spend {b['spend_micro_usd']} <= budget "
        f"{b['budget_micro_usd']} + one reservation {b['one_reservation_micro_usd']} micro-USD"
    )
    c = report["cancelled"]
    lines.append(
        f"{'PASS' if c['ok'] else 'FAIL'} cancelled: {c['cancelled_midway']} of {c['streams']} "
        f"streams cut midway; leases 0 after {c['leases_zero_after_s']} s, "
        f"{c['leases_left']} left, freed by their expiry within "
        f"{c['leases_left_expire_in_s']} s (TTL {c['lease_ttl_s']:.0f} s); windowed counters "
        f"gone after {c['counters_gone_after_s']} s (window {c['window_s']:.0f} s)"
    )
    lines.append(
        f"{'PASS' if lat['ok'] else 'FAIL'} latency: admission through Redis p50 "
        f"{lat['shared_p50_ms']} ms, p99 {lat['shared_p99_ms']} ms (<= {LATENCY_P99_MS} ms); "
        f"in-process p99 {lat['local_p99_us']} us"
    )
    return lines


def table(report: dict[str, Any]) -> str:
    rows = [
        "| arm | gateways | sent | admitted | 429 | fullest 60 s: requests | input tokens "
        "| output tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in report["window"]:
        r = arm["max_window_ratio"]
        peaks = arm["max_window"]
        rows.append(
            f"| {arm['arm']} | {arm['gateways']} | {arm['sent']} | {arm['admitted']} | "
            f"{arm['rejected_429']} | "
            f"{peaks[LimitKind.REQUESTS]} ({r[LimitKind.REQUESTS]:.3f} x L) | "
            f"{peaks[LimitKind.INPUT_TOKENS]} ({r[LimitKind.INPUT_TOKENS]:.3f}) | "
            f"{peaks[LimitKind.OUTPUT_TOKENS]} ({r[LimitKind.OUTPUT_TOKENS]:.3f}) |"
        )
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateways", type=positive(int), default=4, help="gateways sharing Redis")
    parser.add_argument(
        "--workers",
        type=positive(int),
        default=1,
        help="above 1: one host instead, `serve --workers N` without [cluster] (the window "
        "and the supervisor's admission cost only)",
    )
    parser.add_argument("--replicas", type=positive(int), default=2, help="simulated replicas")
    parser.add_argument(
        "--rpm", type=positive(int), default=600, help="the tenant's limit L (requests per minute)"
    )
    parser.add_argument(
        "--overload", type=positive(float), default=10.0, help="the tenant sends this many x L"
    )
    parser.add_argument(
        "--duration", type=positive(float), default=180.0, help="seconds of load in the shared arm"
    )
    parser.add_argument(
        "--control-duration",
        type=positive(float),
        default=70.0,
        help="seconds of load in the control arm (no shared engine)",
    )
    parser.add_argument("--trials", type=positive(int), default=100_000, help="concurrency trials")
    parser.add_argument(
        "--control-trials",
        type=positive(int),
        default=1000,
        help="trials of the non-atomic control",
    )
    parser.add_argument(
        "--burst", type=positive(int), default=64, help="simultaneous admissions per trial"
    )
    parser.add_argument(
        "--cap", type=positive(int), default=8, help="the concurrency cap of the trials"
    )
    parser.add_argument(
        "--streams", type=positive(int), default=10_000, help="streams cancelled midway"
    )
    parser.add_argument(
        "--stream-clients", type=positive(int), default=32, help="streams in flight at once"
    )
    parser.add_argument(
        "--budget-usd", type=positive(float), default=0.2, help="the budget tenant's budget"
    )
    parser.add_argument(
        "--latency-samples",
        type=positive(int),
        default=3000,
        help="admissions timed one at a time",
    )
    parser.add_argument(
        "--wait-expiry",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wait for the cancelled streams' keys to expire (a minute)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=positive(float),
        default=90.0,
        help="seconds a replica or gateway may take to come up",
    )
    parser.add_argument("--seed", type=int, default=1, help="prompts' random seed")
    parser.add_argument("--workdir", type=Path, help="keep logs and configs here (default: temp)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """The `saltgate-bench limits` command: 0 when every target is met."""
    options = Options(
        gateways=1 if args.workers > 1 else args.gateways,
        workers=args.workers,
        replicas=args.replicas,
        rpm=args.rpm,
        overload=args.overload,
        duration_s=args.duration,
        control_duration_s=args.control_duration,
        trials=args.trials,
        control_trials=args.control_trials,
        burst=args.burst,
        cap=args.cap,
        streams=args.streams,
        stream_clients=args.stream_clients,
        budget_usd=args.budget_usd,
        latency_samples=args.latency_samples,
        wait_expiry=args.wait_expiry,
        startup_timeout_s=args.startup_timeout,
        progress=not args.no_progress,
        seed=args.seed,
    )
    started = time.time()
    with workdir("saltgate-limits-", args.workdir) as work:
        try:
            report = asyncio.run(Bench(options, work).run())
        except BenchError as exc:
            print(f"saltgate-bench limits: {exc}", file=sys.stderr)
            return 1
    lines = checks(report)
    print(table(report))
    for line in lines:
        print(line)
    if args.json is not None:
        doc = {
            "benchmark": "limits",
            "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "wall_s": round(time.time() - started, 1),
            "source": source_state(),
            "machine": asdict(machine_info()),
            "config": asdict(options),
            **report,
            "checks": lines,
            "ok": all(line.startswith("PASS") for line in lines),
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(line.startswith("PASS") for line in lines) else 1
