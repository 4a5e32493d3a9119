"""`saltgate audit deployment --config FILE`: check a deployment from the operator's seat.

Questions (docs/audit.md): can a replica be reached without the gateway's credentials;
are its metrics or KV-event endpoints readable; which prefix-caching hash algorithm the
replicas run; does a client-chosen cache_salt (or no salt at all) reach a replica
through the gateway; do responses reveal the replica.

Each judgement is a pure function from what was observed to a Finding; the `_Checks`
class only gathers the observations (HTTP, TCP) and calls them.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from saltgate.config import GatewayConfig, ReplicaConfig
from saltgate.http.tls import client_context

__all__ = [
    "CANARY_TOKENS",
    "DeploymentReport",
    "Finding",
    "Severity",
    "judge_canary",
    "judge_hash_algo",
    "judge_kv_endpoint",
    "judge_metrics_exposure",
    "judge_plaintext_upstream",
    "judge_replica_access",
    "judge_response_headers",
    "judge_salting_config",
    "parse_cache_config_info",
    "parse_counter",
    "parse_zmtp_greeting",
    "run_deployment_audit",
    "zmtp_greeting",
]

CANARY_TOKENS = 512  # whole blocks at every block size vLLM uses (16 .. 128, 256 on some)
DEFAULT_KV_EVENTS_PORT = 5557  # vLLM's default KV-event endpoint is tcp://*:5557


class Severity(StrEnum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"
    INFO = "info"
    OK = "ok"

    @property
    def rank(self) -> int:
        return list(Severity).index(self)


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    target: str
    severity: Severity
    summary: str

    def to_json(self) -> dict[str, str]:
        return {
            "check": self.check,
            "target": self.target,
            "severity": self.severity.value,
            "summary": self.summary,
        }


@dataclass(slots=True)
class DeploymentReport:
    findings: list[Finding] = field(default_factory=list)

    @property
    def worst(self) -> Severity:
        return min((f.severity for f in self.findings), key=lambda s: s.rank, default=Severity.OK)

    def to_json(self) -> dict[str, Any]:
        counts = {s.value: sum(f.severity is s for f in self.findings) for s in Severity}
        return {
            "worst": self.worst.value,
            "counts": counts,
            "findings": [f.to_json() for f in self.findings],
        }


# -- pure judgements ----------------------------------------------------------------------


def judge_salting_config(config: GatewayConfig) -> Finding:
    if not config.salting:
        return Finding(
            "salting",
            "config",
            Severity.HIGH,
            "[testing] disable_salting = true: requests reach replicas unsalted, so every "
            "tenant shares one cache namespace",
        )
    return Finding("salting", "config", Severity.OK, "the gateway derives every cache salt")


def judge_plaintext_upstream(config: GatewayConfig) -> list[Finding]:
    """How each replica's links leave the gateway: verified TLS, loopback, or in clear
    across a network (what only `[gateway] allow_plaintext_upstream = true` lets load)."""
    findings = []
    for replica in config.replicas:
        if replica.plaintext_remote:
            findings.append(
                Finding(
                    "plaintext-upstream",
                    replica.url,
                    Severity.HIGH,
                    "plain http:// across the network (allow_plaintext_upstream): prompts, "
                    "derived cache salts and the replica's API key cross in clear. Use "
                    "https:// with tls_ca_file (docs/deployment.md)",
                )
            )
        else:
            how = "https, certificate and name verified" if replica.tls else "loopback"
            findings.append(Finding("plaintext-upstream", replica.url, Severity.OK, how))
        if replica.kv_plaintext_remote:
            findings.append(
                Finding(
                    "plaintext-upstream",
                    str(replica.kv_events_endpoint),
                    Severity.HIGH,
                    "KV events over tcp:// across the network without CURVE "
                    "(allow_plaintext_upstream): cache salts and token ids in clear. Set "
                    "kv_events_curve_server_key_file (docs/kv-relay.md)",
                )
            )
    return findings


def judge_replica_access(url: str, status: int | None, error: str | None) -> Finding:
    """A replica asked for /v1/models without any credentials."""
    check = "replica-direct-access"
    if status is None:
        return Finding(check, url, Severity.OK, f"not reachable from this host ({error})")
    if status in (401, 403):
        return Finding(
            check,
            url,
            Severity.LOW,
            f"reachable from this host; refuses requests without its API key ({status}). "
            "Whoever holds that key bypasses the gateway: keep replicas on a private network",
        )
    if status == 200:
        return Finding(
            check,
            url,
            Severity.HIGH,
            "answers without credentials: anyone who reaches it bypasses the gateway and "
            "chooses its own cache_salt (or none). Set the replica's --api-key and firewall it",
        )
    return Finding(check, url, Severity.INFO, f"reachable; /v1/models answered {status}")


def judge_metrics_exposure(url: str, status: int | None, body: bytes) -> Finding:
    """A replica's /metrics fetched without credentials (vLLM serves it unauthenticated)."""
    check = "replica-metrics"
    if status == 200 and b"vllm:" in body:
        return Finding(
            check,
            url,
            Severity.MEDIUM,
            "/metrics is readable without credentials: prefix-cache hit counters and queue "
            "lengths let an observer see other tenants' cache hits. Firewall the metrics port",
        )
    if status is None:
        return Finding(check, url, Severity.OK, "/metrics not reachable from this host")
    return Finding(check, url, Severity.OK, f"/metrics answered {status} without credentials")


_INFO_LINE = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_cache_config_info(metrics: str) -> dict[str, str] | None:
    """The labels of vLLM's vllm:cache_config_info gauge, or None if absent."""
    match = _INFO_LINE.search(metrics)
    if match is None:
        return None
    return dict(_LABEL.findall(match.group("labels")))


def parse_counter(metrics: str, name: str) -> float | None:
    """The sum over label sets of one Prometheus counter (e.g. vllm:prefix_cache_hits_total)."""
    total = None
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", re.MULTILINE)
    for match in pattern.finditer(metrics):
        try:
            total = (total or 0.0) + float(match.group(1))
        except ValueError:
            continue
    return total


_HASH_ALGO_VERDICTS: dict[str, tuple[Severity, str]] = {
    "sha256": (Severity.OK, "SHA-256 over pickle: collision-resistant block hashes"),
    "sha256_cbor": (Severity.OK, "SHA-256 over canonical CBOR: collision-resistant"),
    "sha256_cbor_64bit": (
        Severity.MEDIUM,
        "SHA-256 truncated to 64 bits: birthday collisions (~2^32 blocks) are within reach; "
        "use sha256 or sha256_cbor",
    ),
    "xxhash": (
        Severity.MEDIUM,
        "xxHash is not collision-resistant: crafted prompts could collide with another "
        "namespace's blocks; use sha256 or sha256_cbor",
    ),
    "xxhash_cbor": (
        Severity.MEDIUM,
        "xxHash is not collision-resistant: crafted prompts could collide with another "
        "namespace's blocks; use sha256 or sha256_cbor",
    ),
    "builtin": (
        Severity.HIGH,
        "Python's hash() is not collision-resistant (CVE-2025-25183): use sha256",
    ),
}


def judge_hash_algo(url: str, labels: dict[str, str] | None) -> Finding:
    check = "prefix-caching-hash"
    if labels is None:
        return Finding(
            check, url, Severity.INFO, "unknown: no vllm:cache_config_info in /metrics here"
        )
    if labels.get("enable_prefix_caching", "True").lower() != "true":
        return Finding(check, url, Severity.INFO, "prefix caching is off on this replica")
    algo = labels.get("prefix_caching_hash_algo")
    if algo is None:
        return Finding(check, url, Severity.INFO, "cache_config_info names no hash algorithm")
    severity, why = _HASH_ALGO_VERDICTS.get(
        algo, (Severity.INFO, "an algorithm this audit does not know")
    )
    return Finding(check, url, severity, f"{algo}: {why}")


_ZMTP_SIGNATURE_END = 0x7F


def zmtp_greeting() -> bytes:
    """The first 11 bytes of a ZMTP 3 greeting: signature and major version.

    A ZMTP 3 peer answers them with its whole 64-byte greeting, mechanism included. Sending
    no mechanism of our own matters: a CURVE server that reads a NULL offer hangs up
    before it announces anything.
    """
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03"


def parse_zmtp_greeting(data: bytes) -> str | None:
    """The security mechanism a ZMTP 3.x peer announced (NULL, PLAIN, CURVE), else None."""
    if len(data) < 32 or data[0] != 0xFF or data[9] != _ZMTP_SIGNATURE_END or data[10] < 3:
        return None
    return data[12:32].rstrip(b"\x00").decode("ascii", "replace")


def judge_kv_endpoint(endpoint: str, mechanism: str | None, error: str | None) -> Finding:
    check = "kv-events-endpoint"
    if error is not None:
        return Finding(check, endpoint, Severity.OK, f"not reachable from this host ({error})")
    if mechanism is None:
        return Finding(
            check, endpoint, Severity.INFO, "something listens here, but it does not speak ZMQ"
        )
    if mechanism == "NULL":
        return Finding(
            check,
            endpoint,
            Severity.HIGH,
            "a ZMQ endpoint that accepts anyone (NULL mechanism): vLLM's KV events carry "
            "cache salts in clear, raw prompt token ids and block placement; bind it to a "
            "private address or consume events only through an authenticated relay",
        )
    if mechanism == "PLAIN":
        return Finding(
            check,
            endpoint,
            Severity.MEDIUM,
            "a ZMQ endpoint with PLAIN authentication: the password crosses the network in "
            "clear; use CURVE",
        )
    return Finding(
        check, endpoint, Severity.OK, f"a ZMQ endpoint requiring {mechanism} authentication"
    )


# Not x-request-id: a random id per request names no replica (saltgate answers its own, the
# one it sends the replica, so logs on both sides can be joined).
_REVEALING_HEADERS = frozenset({"server", "via", "x-served-by", "x-powered-by", "set-cookie"})
_REVEALING_PREFIXES = ("x-vllm", "x-upstream", "x-backend", "x-replica", "x-envoy-upstream")


def judge_response_headers(
    target: str, headers: Iterable[tuple[str, str]], replica_authorities: Sequence[str]
) -> Finding:
    """Headers that name, fingerprint or correlate the replica that answered."""
    check = "response-reveals-replica"
    found: list[str] = []
    for name, value in headers:
        lower = name.lower()
        if lower in _REVEALING_HEADERS or lower.startswith(_REVEALING_PREFIXES):
            found.append(lower)
        elif any(authority in value for authority in replica_authorities):
            found.append(f"{lower} (names a replica's address)")
    if found:
        return Finding(
            check,
            target,
            Severity.MEDIUM,
            "responses carry headers that identify or fingerprint the replica: "
            + ", ".join(sorted(set(found))),
        )
    return Finding(check, target, Severity.OK, "no replica-identifying headers in responses")


@dataclass(frozen=True, slots=True)
class CanaryObservation:
    """One canary: what the replicas' own control showed and what came back via the gateway."""

    kind: str  # "client-salt" or "unsalted"
    control_cached: int  # cached tokens a direct repeat on a replica got (the control)
    gateway_cached: int | None  # cached tokens the gateway's response reported
    hits_delta: float | None  # growth of the replicas' prefix_cache_hits over the request


def judge_canary(target: str, obs: CanaryObservation) -> Finding:
    check = "client-salt-stripped" if obs.kind == "client-salt" else "requests-salted"
    if obs.control_cached <= 0:
        return Finding(
            check,
            target,
            Severity.INFO,
            "not checked: a repeated request straight to the replicas showed no cache hit "
            "(prefix caching off, cached_tokens not reported, or replicas unreachable)",
        )
    leaked = (obs.gateway_cached or 0) > 0
    if obs.gateway_cached is None and obs.hits_delta is not None:
        leaked = leaked or obs.hits_delta >= obs.control_cached
    evidence = (
        f"gateway response cached_tokens={obs.gateway_cached}, replicas' prefix-cache hits "
        f"+{obs.hits_delta if obs.hits_delta is not None else '?'}, direct control "
        f"cached_tokens={obs.control_cached}"
    )
    if obs.kind == "client-salt":
        if leaked:
            return Finding(
                check,
                target,
                Severity.HIGH,
                "a client-chosen cache_salt reached the replica: a client can join any "
                f"namespace whose salt it knows ({evidence})",
            )
        return Finding(
            check, target, Severity.OK, f"the client's cache_salt was replaced ({evidence})"
        )
    if leaked:
        return Finding(
            check,
            target,
            Severity.HIGH,
            "a request through the gateway hit a prefix cached WITHOUT a salt: requests "
            f"reach replicas unsalted, in one namespace shared by all ({evidence})",
        )
    return Finding(
        check,
        target,
        Severity.OK,
        f"gateway requests do not share the unsalted namespace ({evidence})",
    )


# -- observation (I/O) --------------------------------------------------------------------


def _authority(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 80}"


def gateway_url(config: GatewayConfig) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "", "::") else config.host
    return f"http://{host}:{config.port}"


def _trust(config: GatewayConfig) -> ssl.SSLContext:
    """What the audit verifies https replicas against: the system's trust store and every
    replica's tls_ca_file, as the gateway does; it presents no client certificate, as an
    outsider would not."""
    context = client_context(None)
    for ca_file in sorted({r.tls_ca_file for r in config.replicas if r.tls_ca_file}):
        context.load_verify_locations(cafile=str(ca_file))
    return context


def _err(exc: BaseException) -> str:
    return type(exc).__name__


class _Checks:
    def __init__(
        self,
        config: GatewayConfig,
        client: httpx.AsyncClient,
        gateway: str,
        api_key: str | None,
        timeout: float,
    ) -> None:
        self.config = config
        self.client = client
        self.gateway = gateway.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.report = DeploymentReport()
        self.seen_headers: list[tuple[str, str]] = []

    def add(self, finding: Finding) -> None:
        self.report.findings.append(finding)

    async def _get(
        self, url: str, headers: dict[str, str] | None = None
    ) -> tuple[int | None, bytes, str | None]:
        try:
            response = await self.client.get(url, headers=headers or {})
        except httpx.HTTPError as exc:
            return None, b"", _err(exc)
        return response.status_code, response.content, None

    @staticmethod
    def _replica_headers(replica: ReplicaConfig) -> dict[str, str]:
        return {"authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}

    async def replica(self, replica: ReplicaConfig) -> str:
        """Access, metrics and hash-algorithm checks; returns the metrics text it could read."""
        base = replica.url.rstrip("/")
        status, _, error = await self._get(base + "/v1/models")
        self.add(judge_replica_access(replica.url, status, error))
        status, body, _ = await self._get(base + "/metrics")
        self.add(judge_metrics_exposure(replica.url, status, body))
        if status != 200:
            status, body, _ = await self._get(base + "/metrics", self._replica_headers(replica))
        text = body.decode("utf-8", "replace") if status == 200 else ""
        self.add(judge_hash_algo(replica.url, parse_cache_config_info(text) if text else None))
        return text

    async def kv_endpoint(self, endpoint: str) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme != "tcp" or not parts.hostname or not parts.port:
            self.add(
                Finding(
                    "kv-events-endpoint",
                    endpoint,
                    Severity.INFO,
                    "not checked: only tcp://host:port endpoints can be probed from here",
                )
            )
            return
        mechanism, error = None, None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port), self.timeout
            )
        except (OSError, TimeoutError) as exc:
            self.add(judge_kv_endpoint(endpoint, None, _err(exc)))
            return
        try:
            writer.write(zmtp_greeting())
            data = await asyncio.wait_for(reader.readexactly(64), self.timeout)
            mechanism = parse_zmtp_greeting(data)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            mechanism = None
        finally:
            writer.close()
        self.add(judge_kv_endpoint(endpoint, mechanism, error))

    async def _post(
        self, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int | None, int | None, list[tuple[str, str]]]:
        """POST a completion; (status, cached_tokens, response headers)."""
        try:
            response = await self.client.post(
                url,
                content=orjson.dumps(body),
                headers={"content-type": "application/json", **headers},
            )
        except httpx.HTTPError:
            return None, None, []
        cached = None
        if response.status_code == 200:
            try:
                details = response.json()["usage"]["prompt_tokens_details"]
                cached = int(details["cached_tokens"])
            except (ValueError, KeyError, TypeError):
                cached = None
        return response.status_code, cached, list(response.headers.items())

    async def _hits(self, replicas: Sequence[ReplicaConfig]) -> float | None:
        total = None
        for replica in replicas:
            status, body, _ = await self._get(
                replica.url.rstrip("/") + "/metrics", self._replica_headers(replica)
            )
            value = (
                parse_counter(body.decode("utf-8", "replace"), "vllm:prefix_cache_hits_total")
                if status == 200
                else None
            )
            if value is not None:
                total = (total or 0.0) + value
        return total

    async def model(self) -> str | None:
        status, body, _ = await self._get(self.gateway + "/v1/models", self._gateway_headers())
        if status != 200:
            return None
        try:
            return str(orjson.loads(body)["data"][0]["id"])
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return None

    def _gateway_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def canary(self, kind: str, model: str) -> None:
        """Prime a random prompt on every replica directly (with the canary salt, or none),
        confirm a direct repeat hits, then send it through the gateway and look for a hit."""
        salt = f"sgaudit-{secrets.token_hex(8)}" if kind == "client-salt" else None
        prompt = [16 + secrets.randbelow(900) for _ in range(CANARY_TOKENS)]
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        control = 0
        reachable: list[ReplicaConfig] = []
        for replica in self.config.replicas:
            url = replica.url.rstrip("/") + "/v1/completions"
            headers = self._replica_headers(replica)
            status, _, _ = await self._post(url, body, headers)
            if status != 200:
                continue
            reachable.append(replica)
            _, cached, _ = await self._post(url, body, headers)
            control = max(control, cached or 0)
        before = await self._hits(reachable)
        status, cached, headers_seen = await self._post(
            self.gateway + "/v1/completions", body, self._gateway_headers()
        )
        self.seen_headers += headers_seen
        after = await self._hits(reachable)
        delta = after - before if after is not None and before is not None else None
        if status != 200:
            answer = f"answered {status}" if status is not None else "could not be reached"
            self.add(
                Finding(
                    "client-salt-stripped" if kind == "client-salt" else "requests-salted",
                    self.gateway,
                    Severity.INFO,
                    f"not checked: the gateway {answer} for the canary",
                )
            )
            return
        self.add(judge_canary(self.gateway, CanaryObservation(kind, control, cached, delta)))


async def run_deployment_audit(
    config: GatewayConfig,
    *,
    gateway: str | None = None,
    api_key: str | None = None,
    kv_endpoints: Sequence[str] = (),
    probe_default_kv_port: bool = True,
    timeout: float = 5.0,
) -> DeploymentReport:
    """Every check, in order; a check that cannot run says so as an `info` finding."""
    async with httpx.AsyncClient(timeout=timeout, verify=_trust(config)) as client:
        checks = _Checks(config, client, gateway or gateway_url(config), api_key, timeout)
        checks.add(judge_salting_config(config))
        checks.report.findings += judge_plaintext_upstream(config)
        for replica in config.replicas:
            await checks.replica(replica)
        endpoints = list(dict.fromkeys(kv_endpoints))
        if probe_default_kv_port:
            hosts = dict.fromkeys(urlsplit(r.url).hostname or "" for r in config.replicas)
            endpoints += [f"tcp://{h}:{DEFAULT_KV_EVENTS_PORT}" for h in hosts if h]
        for endpoint in dict.fromkeys(endpoints):
            await checks.kv_endpoint(endpoint)
        model = await checks.model() if api_key else None
        if model is None:
            why = "pass --api-key (a tenant's key)" if not api_key else "GET /v1/models failed"
            for check in ("client-salt-stripped", "requests-salted", "response-reveals-replica"):
                checks.add(Finding(check, checks.gateway, Severity.INFO, f"not checked: {why}"))
        else:
            await checks.canary("client-salt", model)
            await checks.canary("unsalted", model)
            authorities = [_authority(r.url) for r in config.replicas]
            checks.add(judge_response_headers(checks.gateway, checks.seen_headers, authorities))
        return checks.report
