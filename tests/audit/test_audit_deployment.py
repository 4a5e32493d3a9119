"""`saltgate audit deployment`: pure judgements, then real deployments over loopback
(simulated replicas, the gateway, real ZMQ sockets), one careless and one careful."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import zmq
from tests.gateway.stack import run, stack
from tests.support.gateways import write_gateway_config
from tests.support.tls import make_pki

from saltgate.audit.deployment import (
    CanaryObservation,
    DeploymentReport,
    Severity,
    judge_canary,
    judge_hash_algo,
    judge_kv_endpoint,
    judge_plaintext_upstream,
    judge_replica_access,
    judge_response_headers,
    parse_cache_config_info,
    parse_counter,
    parse_zmtp_greeting,
    run_deployment_audit,
    zmtp_greeting,
)
from saltgate.config import GatewayConfig, ReplicaConfig, create_master_key, load_config
from saltgate.serving.run import RunningGateway, start_gateway
from saltgate.sim.run import SimConfig, start_sim
from saltgate.sim.server import SimServer
from saltgate.store.tenants import TenantStore

REPLICA_KEY = "replica-secret-key-0123456789"


def by_check(report: DeploymentReport) -> dict[str, list[Severity]]:
    out: dict[str, list[Severity]] = {}
    for f in report.findings:
        out.setdefault(f.check, []).append(f.severity)
    return out


# -- pure ---------------------------------------------------------------------------------


def test_hash_algorithm_comes_from_cache_config_info() -> None:
    metrics = SimServer(SimConfig(hash_algo="sha256_cbor")).metrics().decode()
    labels = parse_cache_config_info(metrics)
    assert labels is not None and labels["prefix_caching_hash_algo"] == "sha256_cbor"
    assert judge_hash_algo("r", labels).severity is Severity.OK
    for algo, severity in (
        ("builtin", Severity.HIGH),
        ("xxhash", Severity.MEDIUM),
        ("sha256_cbor_64bit", Severity.MEDIUM),
        ("sha256", Severity.OK),
        ("something-new", Severity.INFO),
    ):
        finding = judge_hash_algo("r", {**labels, "prefix_caching_hash_algo": algo})
        assert finding.severity is severity, algo
        assert algo in finding.summary
    assert judge_hash_algo("r", None).severity is Severity.INFO
    off = judge_hash_algo("r", {**labels, "enable_prefix_caching": "False"})
    assert off.severity is Severity.INFO and "off" in off.summary
    assert parse_cache_config_info("up 1\n") is None
    assert parse_counter(metrics, "vllm:prefix_cache_hits_total") == 0.0
    assert parse_counter('x{a="1"} 2\nx{a="2"} 3.5\n', "x") == 5.5
    assert parse_counter("y 1\n", "x") is None


def test_zmtp_greeting_names_the_mechanism() -> None:
    opening = zmtp_greeting()
    assert len(opening) == 11 and opening[0] == 0xFF and opening[9:] == b"\x7f\x03"
    peer = opening + b"\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    assert len(peer) == 64 and parse_zmtp_greeting(peer) == "NULL"
    curve = peer[:12] + b"CURVE".ljust(20, b"\x00") + peer[32:]
    assert parse_zmtp_greeting(curve) == "CURVE"
    assert parse_zmtp_greeting(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b" " * 40) is None
    assert parse_zmtp_greeting(b"\xff") is None
    assert judge_kv_endpoint("e", "NULL", None).severity is Severity.HIGH
    assert judge_kv_endpoint("e", "PLAIN", None).severity is Severity.MEDIUM
    assert judge_kv_endpoint("e", "CURVE", None).severity is Severity.OK
    assert judge_kv_endpoint("e", None, None).severity is Severity.INFO
    assert judge_kv_endpoint("e", None, "ConnectionRefusedError").severity is Severity.OK


def test_replica_access_and_headers_judgements() -> None:
    assert judge_replica_access("r", 200, None).severity is Severity.HIGH
    assert judge_replica_access("r", 401, None).severity is Severity.LOW
    assert judge_replica_access("r", None, "ConnectError").severity is Severity.OK
    clean = judge_response_headers("g", [("content-type", "application/json")], ["10.0.0.5:8000"])
    assert clean.severity is Severity.OK
    leaky = judge_response_headers(
        "g", [("Server", "uvicorn"), ("x-debug", "upstream 10.0.0.5:8000")], ["10.0.0.5:8000"]
    )
    assert leaky.severity is Severity.MEDIUM
    assert "server" in leaky.summary and "x-debug (names a replica's address)" in leaky.summary


def test_canary_judgement_needs_its_control() -> None:
    def judge(kind: str, control: int, cached: int | None, delta: float | None) -> Severity:
        return judge_canary("g", CanaryObservation(kind, control, cached, delta)).severity

    assert judge("client-salt", 0, 512, None) is Severity.INFO  # nothing can be concluded
    assert judge("client-salt", 496, 496, 496.0) is Severity.HIGH
    assert judge("client-salt", 496, 0, 0.0) is Severity.OK
    assert judge("unsalted", 496, 496, 496.0) is Severity.HIGH
    assert judge("unsalted", 496, 0, 0.0) is Severity.OK
    # without usage in the response, the replicas' hit counters decide
    assert judge("unsalted", 496, None, 496.0) is Severity.HIGH
    assert judge("unsalted", 496, None, 0.0) is Severity.OK


def test_plaintext_links_off_loopback_are_high_findings(tmp_path: Path) -> None:
    """What only allow_plaintext_upstream lets load is reported; https and loopback are ok."""
    path = tmp_path / "g.toml"
    path.write_text(
        "[gateway]\nallow_plaintext_upstream = true\n"
        '[[replicas]]\nurl = "http://10.0.0.5:8000"\nkv_events_endpoint = "tcp://10.0.0.5:5557"\n'
        '[[replicas]]\nurl = "https://10.0.0.6:8443"\n'
        '[[replicas]]\nurl = "http://127.0.0.1:8000"\nkv_events_endpoint = "tcp://127.0.0.1:5557"\n'
    )
    found = [(f.target, f.severity) for f in judge_plaintext_upstream(load_config(path))]
    assert found == [
        ("http://10.0.0.5:8000", Severity.HIGH),
        ("tcp://10.0.0.5:5557", Severity.HIGH),
        ("https://10.0.0.6:8443", Severity.OK),
        ("http://127.0.0.1:8000", Severity.OK),
    ]


# -- deployments --------------------------------------------------------------------------


def test_https_replicas_are_audited_through_their_ca(tmp_path: Path) -> None:
    """A replica verified against tls_ca_file is reached by the audit too (not reported
    "not reachable" because the system's trust store does not know its CA)."""

    async def body() -> None:
        pki = make_pki(tmp_path / "pki")
        sim = await start_sim(
            SimConfig(
                port=0,
                api_key=REPLICA_KEY,
                tls_cert=str(pki.server.cert),
                tls_key=str(pki.server.key),
            )
        )
        try:
            config = GatewayConfig(
                replicas=(ReplicaConfig(sim.url, api_key=REPLICA_KEY, tls_ca_file=pki.ca),),
                state_dir=tmp_path,
                master_key_file=tmp_path / "master.key",
            )
            report = await run_deployment_audit(config, probe_default_kv_port=False)
        finally:
            await sim.close()
        checks = by_check(report)
        assert checks["plaintext-upstream"] == [Severity.OK]
        assert checks["replica-direct-access"] == [Severity.LOW], report.to_json()
        assert checks["prefix-caching-hash"] == [Severity.OK]

    run(body)


def write_config(path: Path, config: GatewayConfig, gateway_port: int, env_key: str | None) -> Path:
    return write_gateway_config(
        path,
        state_dir=config.state_dir,
        replicas=(r.url for r in config.replicas),
        master_key_file=config.master_key_file,
        port=gateway_port,
        admin_port=None,
        replica_extra=f'api_key_env = "{env_key}"\n' if env_key else "",
        sections="" if config.salting else "[testing]\ndisable_salting = true\n",
    )


def zmq_pub(curve: bool) -> tuple[zmq.Socket[bytes], str]:
    """A bound PUB socket on loopback, like vLLM's tcp://*:5557 but on 127.0.0.1 only."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    if curve:
        _, secret = zmq.curve_keypair()
        sock.curve_secretkey = secret
        sock.curve_server = True
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


# `saltgate` with the audit extra's libraries hidden, as the runtime install has them.
WITHOUT_AUDIT_EXTRA = (
    "import sys; sys.modules.update(dict.fromkeys(('numpy', 'scipy', 'matplotlib', 'tqdm')));"
    "from saltgate.cli import main; sys.exit(main(sys.argv[1:]))"
)


def test_careless_deployment_is_flagged_by_the_cli(tmp_path: Path) -> None:
    """Replicas without a key, salting off, an open KV-event socket: `saltgate audit
    deployment` as a process, without the audit extra (the runtime install: it refused
    wanting numpy), reports each and exits 1, every finding with its fix."""

    async def body() -> None:
        pub, endpoint = zmq_pub(curve=False)
        try:
            async with stack(tmp_path, replicas=1, salting=False) as s:
                replicas = tuple(ReplicaConfig(sim.url) for sim in s.sims)
                config = replace(s.gateway.gateway.config, replicas=replicas)
                path = write_config(tmp_path / "gw.toml", config, s.gateway.port, None)
                out = tmp_path / "findings.json"
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", WITHOUT_AUDIT_EXTRA, "audit", "deployment",
                    "--config", str(path), "--api-key", s.keys["alice"],
                    "--kv-events", endpoint, "--json", str(out),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            pub.close(linger=0)
        assert proc.returncode == 1, stderr.decode()
        report = json.loads(out.read_text())
        found = {(f["check"], f["target"]): f["severity"] for f in report["findings"]}
        sim_url = config.replicas[0].url
        assert found[("salting", "config")] == "high"
        assert found[("replica-direct-access", sim_url)] == "high"
        assert found[("replica-metrics", sim_url)] == "medium"
        assert found[("prefix-caching-hash", sim_url)] == "ok"
        assert found[("kv-events-endpoint", endpoint)] == "high"
        assert found[("requests-salted", s.url)] == "high"  # the unsalted canary hit
        assert found[("client-salt-stripped", s.url)] == "ok"  # the gateway still strips
        assert found[("response-reveals-replica", s.url)] == "ok"
        assert report["worst"] == "high"
        assert s.keys["alice"] not in out.read_text() + stdout.decode()
        # The table's fix column, as the JSON's, is never empty (it was for most findings).
        fixes = {f["fix"] for f in report["findings"]}
        assert all(fix.strip() for fix in fixes), report["findings"]
        table = stdout.decode().splitlines()[2:]
        assert len(table) == len(report["findings"])
        for line, finding in zip(table, report["findings"], strict=True):
            assert line.rstrip().endswith(finding["fix"]), line

    run(body)


@asynccontextmanager
async def careful_deployment(tmp: Path) -> AsyncIterator[tuple[RunningGateway, str, list[str]]]:
    """A replica that requires its key, the gateway holding it, salting on."""
    sim = await start_sim(SimConfig(port=0, api_key=REPLICA_KEY, hash_algo="sha256_cbor"))
    state = tmp / "state"
    state.mkdir(mode=0o700)
    create_master_key(state / "master.key")
    with TenantStore.from_state_dir(state) as store:
        store.create_tenant("alice")
        key = store.create_key("alice")[1]
    config = GatewayConfig(
        replicas=(ReplicaConfig(sim.url, api_key=REPLICA_KEY),),
        state_dir=state,
        master_key_file=state / "master.key",
        port=0,
        admin_port=None,
    )
    gateway = await start_gateway(config)
    try:
        yield gateway, key, [sim.url]
    finally:
        await gateway.close()
        await sim.close()


def test_careful_deployment_has_no_high_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUDIT_TEST_REPLICA_KEY", REPLICA_KEY)

    async def body() -> None:
        pub, endpoint = zmq_pub(curve=True)
        try:
            async with careful_deployment(tmp_path) as (gateway, key, sim_urls):
                path = write_config(
                    tmp_path / "gw.toml",
                    gateway.gateway.config,
                    gateway.port,
                    "AUDIT_TEST_REPLICA_KEY",
                )
                config = load_config(path)
                report = await run_deployment_audit(
                    config, api_key=key, kv_endpoints=[endpoint], probe_default_kv_port=False
                )
                # positive control for the salt and header checks: a "gateway" that is
                # really the replica, passing the client's cache_salt and its own headers
                naked = await run_deployment_audit(
                    config, gateway=sim_urls[0], api_key=REPLICA_KEY, probe_default_kv_port=False
                )
        finally:
            pub.close(linger=0)
        checks = by_check(report)
        assert report.worst is not Severity.HIGH, report.to_json()
        assert checks["replica-direct-access"] == [Severity.LOW]
        assert checks["plaintext-upstream"] == [Severity.OK]  # a replica on loopback
        assert checks["prefix-caching-hash"] == [Severity.OK]
        assert checks["kv-events-endpoint"] == [Severity.OK]
        assert checks["client-salt-stripped"] == [Severity.OK]
        assert checks["requests-salted"] == [Severity.OK]
        assert checks["response-reveals-replica"] == [Severity.OK]
        naked_checks = by_check(naked)
        assert naked_checks["client-salt-stripped"] == [Severity.HIGH], naked.to_json()
        assert naked_checks["response-reveals-replica"] == [Severity.MEDIUM]
        assert REPLICA_KEY not in json.dumps(report.to_json() | naked.to_json())

    run(body)


def test_without_an_api_key_the_canary_says_it_did_not_run(tmp_path: Path) -> None:
    async def body() -> None:
        async with careful_deployment(tmp_path) as (gateway, _, _):
            report = await run_deployment_audit(
                gateway.gateway.config,
                gateway=gateway.url,
                probe_default_kv_port=False,
            )
        checks = by_check(report)
        for check in ("client-salt-stripped", "requests-salted", "response-reveals-replica"):
            assert checks[check] == [Severity.INFO]
        assert any("--api-key" in f.fix for f in report.findings)

    run(body)
