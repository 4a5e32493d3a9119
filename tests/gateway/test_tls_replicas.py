"""https:// replicas: the gateway verifies the replica's certificate and name against the
configured CA before it sends a byte of a request, presents its own certificate when the
replica requires one, and says why when it refuses; plain http off loopback is refused
unless allowed, and then warned about, counted and audited.

The replica is the simulator serving TLS from a CA each test mints (tests/support/tls.py),
with a recorder on its HTTP handler: a refused replica must have received nothing."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.gateway.stack import MODEL, new_state_dir, run
from tests.support.http import async_client
from tests.support.tls import Pair, Pki, make_pki

from saltgate.config import ConfigError, GatewayConfig, ReplicaConfig
from saltgate.gateway.replicas import tls_context
from saltgate.http import Request, Response, UpstreamError, UpstreamPool
from saltgate.http.tls import client_context
from saltgate.routing import RouterConfig
from saltgate.serving.run import RunningGateway, start_gateway
from saltgate.sim.run import RunningSim, SimConfig, start_sim

REPLICA_KEY = "replica-secret-key-tls-0123456789"
BODY = {"model": MODEL, "prompt": "hello over tls", "max_tokens": 2}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class Recorded:
    """A simulated https replica and every request its HTTP layer handed it."""

    sim: RunningSim
    seen: list[bytes] = field(default_factory=list)


@asynccontextmanager
async def tls_sim(served: Pair, client_ca: Path | None = None) -> AsyncIterator[Recorded]:
    sim = await start_sim(
        SimConfig(
            port=0,
            api_key=REPLICA_KEY,
            tls_cert=str(served.cert),
            tls_key=str(served.key),
            tls_client_ca=str(client_ca) if client_ca else None,
        )
    )
    recorded = Recorded(sim)
    handle = sim.server.http.handler

    async def record(request: Request) -> Response:
        recorded.seen.append(request.method + b" " + request.path)
        return await handle(request)

    sim.server.http.handler = record
    try:
        yield recorded
    finally:
        await sim.close()


@asynccontextmanager
async def gateway(tmp: Path, replica: ReplicaConfig) -> AsyncIterator[tuple[RunningGateway, str]]:
    tmp.mkdir(exist_ok=True)
    state = tmp / "state"
    key = new_state_dir(state, ("alice",))["alice"]
    config = GatewayConfig(
        replicas=(replica,),
        state_dir=state,
        master_key_file=state / "master.key",
        port=0,
        admin_port=0,
        access_log="off",
        router=RouterConfig(probe_failures=1),  # one failed probe logs the replica down
    )
    running = await start_gateway(config)
    try:
        yield running, key
    finally:
        await running.close()


async def complete(running: RunningGateway, key: str) -> httpx.Response:
    async with async_client(base_url=running.url, timeout=30) as client:
        return await client.post(
            "/v1/completions", json=BODY, headers={"authorization": f"Bearer {key}"}
        )


def https(sim: RunningSim, **tls: Any) -> ReplicaConfig:
    return ReplicaConfig(sim.url, api_key=REPLICA_KEY, **tls)


def test_a_request_reaches_an_https_replica_verified_against_the_ca(
    tmp_path: Path, pki: Pki
) -> None:
    async def body() -> None:
        async with tls_sim(pki.server) as replica:
            assert replica.sim.url.startswith("https://127.0.0.1:")
            async with gateway(tmp_path, https(replica.sim, tls_ca_file=pki.ca)) as (gw, key):
                response = await complete(gw, key)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
        assert b"POST /v1/completions" in replica.seen

    run(body)


# (what the replica serves, what OpenSSL says of it)
REFUSED = {
    "unknown CA": ("unknown_ca", "unable to get local issuer certificate"),
    "wrong host name": ("wrong_host", "mismatch, certificate is not valid for '127.0.0.1'"),
    "expired": ("expired", "certificate has expired"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_replica_failing_verification_gets_no_request_and_the_log_says_why(
    tmp_path: Path, pki: Pki, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    served_name, verdict = REFUSED[case]
    served: Pair = getattr(pki, served_name)

    async def body() -> None:
        async with tls_sim(served) as replica:
            pool = UpstreamPool("127.0.0.1", replica.sim.port, tls=client_context(pki.ca))
            with pytest.raises(UpstreamError) as refused:
                await pool.request(b"GET", b"/health", [])
            await pool.close()
            assert verdict in str(refused.value)
            replica_config = https(replica.sim, tls_ca_file=pki.ca)
            with caplog.at_level(logging.WARNING, "saltgate"):
                async with gateway(tmp_path, replica_config) as (gw, key):
                    response = await complete(gw, key)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "no_replica"
            assert replica.seen == []  # neither the probes nor the request got through
            refusal = "is down: its probes fail (TLS handshake with upstream failed: certificate"
            assert refusal in caplog.text, caplog.text
            assert verdict in caplog.text
            assert REPLICA_KEY not in caplog.text + response.text + str(refused.value)

    run(body)


def test_the_same_replica_is_refused_without_its_ca_in_the_bundle(tmp_path: Path, pki: Pki) -> None:
    """No tls_ca_file: the system's trust store, which does not know the test's CA."""

    async def body() -> None:
        async with (
            tls_sim(pki.server) as replica,
            gateway(tmp_path, https(replica.sim)) as (gw, key),
        ):
            response = await complete(gw, key)
        assert response.status_code == 503
        assert replica.seen == []

    run(body)


def test_tls_files_that_do_not_load_are_a_config_error_naming_the_replica(
    tmp_path: Path, pki: Pki
) -> None:
    """Checked at load only for existence; what OpenSSL cannot use stops the start (and
    refuses a reload) with one line, never the key's content."""
    not_pem = tmp_path / "not-a-ca.pem"
    not_pem.write_text("hello")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tls_ca_file": not_pem}, "cannot use its TLS files"),
        ({"tls_cert_file": pki.server.cert, "tls_key_file": pki.client.key}, "key values mismatch"),
    ]
    for tls, needle in cases:
        with pytest.raises(ConfigError, match=needle) as info:
            tls_context(ReplicaConfig("https://127.0.0.1:1", **tls), 3)
        assert str(info.value).startswith("replicas[3]: ")
        assert "PRIVATE KEY" not in str(info.value)
    assert tls_context(ReplicaConfig("http://127.0.0.1:1"), 0) is None


def test_mutual_tls_replica_refuses_a_gateway_without_a_client_certificate(
    tmp_path: Path, pki: Pki
) -> None:
    async def body() -> None:
        async with tls_sim(pki.server, client_ca=pki.client_ca) as replica:
            pool = UpstreamPool("127.0.0.1", replica.sim.port, tls=client_context(pki.ca))
            # asyncio's TLS server hangs up without flushing its alert: the client sees
            # the close (tests/http/test_tls_client.py shows a server's alert is named)
            with pytest.raises(UpstreamError, match="upstream closed the connection"):
                await pool.request(b"GET", b"/health", [])
            await pool.close()
            without = https(replica.sim, tls_ca_file=pki.ca)
            async with gateway(tmp_path / "without", without) as (gw, key):
                refused = await complete(gw, key)
            assert refused.status_code == 503
            assert replica.seen == []
            with_cert = https(
                replica.sim,
                tls_ca_file=pki.ca,
                tls_cert_file=pki.client.cert,
                tls_key_file=pki.client.key,
            )
            async with gateway(tmp_path / "with", with_cert) as (gw, key):
                accepted = await complete(gw, key)
            assert accepted.status_code == 200, accepted.text
            assert b"POST /v1/completions" in replica.seen

    run(body)


def _plaintext_gauge(metrics: bytes) -> dict[str, float]:
    prefix = 'saltgate_plaintext_upstream_replicas{link="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.decode().splitlines()
        if line.startswith(prefix)
    }


def test_an_allowed_plaintext_replica_is_warned_once_and_counted(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """allow_plaintext_upstream lets an http:// replica off loopback load (TEST-NET-1, which
    never answers); the gateway warns once per replica, not again on a reload, and its
    gauge counts the link; an https replica (the control) counts for nothing."""
    remote = ReplicaConfig(
        "http://192.0.2.1:8000", api_key=REPLICA_KEY, kv_events_endpoint="tcp://192.0.2.1:5557"
    )

    async def body() -> None:
        state = tmp_path / "state"
        new_state_dir(state, ("alice",))
        config = GatewayConfig(
            replicas=(remote,),
            state_dir=state,
            master_key_file=state / "master.key",
            port=0,
            admin_port=0,
            access_log="off",
            allow_plaintext_upstream=True,
            router=RouterConfig(probe_timeout_s=0.2),
        )
        with caplog.at_level(logging.WARNING, "saltgate"):
            running = await start_gateway(config)
            try:
                running.reload(config)
                metrics = running.metrics.render()
            finally:
                await running.close()
        warnings = [r.getMessage() for r in caplog.records if "in clear" in r.getMessage()]
        assert warnings == [
            "replica 0 (192.0.2.1:8000) is reached over plain http across the network: "
            "prompts, cache salts and its API key cross in clear (allow_plaintext_upstream = true)",
            "replica 0 (192.0.2.1:8000): its KV events cross the network without CURVE: cache "
            "salts and token ids in clear (allow_plaintext_upstream = true)",
        ]
        assert _plaintext_gauge(metrics) == {"http": 1.0, "kv_events": 1.0}
        assert REPLICA_KEY not in caplog.text + metrics.decode()
        async with tls_sim(pki.server) as replica:
            verified = https(replica.sim, tls_ca_file=pki.ca)
            async with gateway(tmp_path / "control", verified) as (gw, _):
                assert _plaintext_gauge(gw.metrics.render()) == {"http": 0.0, "kv_events": 0.0}

    run(body)
