"""`saltgate audit deployment --config FILE`: check a deployment from the operator's seat.

Questions (docs/audit.md): can a replica be reached without the gateway's credentials;
are its metrics or KV-event endpoints readable; which prefix-caching hash algorithm the
replicas run; were they started with the flags saltgate relies on (saltgate.audit.vllm_line:
cached-token details, prefix caching, a private bind address); does a client-chosen
cache_salt (or no salt at all) reach a replica through the gateway; do responses reveal
the replica.

Each judgement is a pure function from what was observed to a Finding; the `_Checks`
class only gathers the observations (HTTP, TCP) and calls them. The probes of engine state
no metric shows (Responses store, media fetching, embeds, LoRA routes, per-request
metrics, KV tiers) are saltgate.audit.engine_probes, judged by .engine_state and .kv_tiers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import secrets
import socket
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from saltgate.audit.engine_probes import MediaListener, probe_engine_state
from saltgate.audit.findings import (
    NOTHING_TO_CHANGE,
    REFUSED,
    UNREACHED,
    DeploymentReport,
    Finding,
    Severity,
)
from saltgate.audit.kv_tiers import parse_cache_config_info
from saltgate.audit.vllm_line import (
    API_KEY,
    EXPECTED_HASH_ALGOS,
    HASH_ALGO,
    HOST,
    PREFIX_CACHING,
    PROMPT_TOKENS_DETAILS,
)
from saltgate.config import GatewayConfig, ReplicaConfig
from saltgate.epp.envoy import fail_open_findings, replica_choice_findings
from saltgate.http.tls import client_context

__all__ = [
    "CANARY_TOKENS",
    "BindObservation",
    "DeploymentReport",
    "Finding",
    "RepeatProbe",
    "Severity",
    "judge_bind_address",
    "judge_canary",
    "judge_envoy_config",
    "judge_hash_algo",
    "judge_kv_endpoint",
    "judge_metrics_exposure",
    "judge_plaintext_upstream",
    "judge_prefix_caching",
    "judge_prompt_tokens_details",
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


# -- pure judgements ----------------------------------------------------------------------


def judge_salting_config(config: GatewayConfig) -> Finding:
    if not config.salting:
        return Finding(
            "salting",
            "config",
            Severity.HIGH,
            "[testing] disable_salting = true: requests reach replicas unsalted, so every "
            "tenant shares one cache namespace",
            "remove [testing] disable_salting from the config",
        )
    return Finding("salting", "config", Severity.OK, "the gateway derives every cache salt")


def judge_envoy_config(source: str, document: Any) -> list[Finding]:
    """An Envoy configuration in front of `saltgate epp` (docs/epp.md): high for what
    lets a request reach a replica without the EPP (ext_proc `failure_mode_allow: true`,
    a connection manager without the filter, a route that disables it); medium for a
    replicas' cluster where Envoy may choose a replica the EPP did not name."""
    found = fail_open_findings(document)
    findings = [
        Finding(
            "envoy-fail-closed",
            source,
            Severity.HIGH,
            finding,
            "failure_mode_allow: false on the ext_proc filter and no route that disables "
            "it: the configuration `saltgate epp --envoy-config` prints",
        )
        for finding in found
    ] or [
        Finding(
            "envoy-fail-closed",
            source,
            Severity.OK,
            "every route passes the EPP, and Envoy refuses requests while it is down",
        )
    ]
    chosen = replica_choice_findings(document)
    findings += [
        Finding(
            "envoy-replica-choice",
            source,
            Severity.MEDIUM,
            f"{finding}: a request may reach a replica the EPP left out (its isolation "
            "canary failed, it refuses the gateway's key)",
            "the override-host policy on the envoy.lb metadata with a fallback that picks "
            "nothing, as `saltgate epp --envoy-config` prints it",
        )
        for finding in chosen
    ] or [
        Finding(
            "envoy-replica-choice",
            source,
            Severity.OK,
            "Envoy sends each request to a replica the EPP named, or to none",
        )
    ]
    return findings


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
                    "derived cache salts and the replica's API key cross in clear",
                    "use https:// with tls_ca_file (docs/deployment.md), then drop "
                    "allow_plaintext_upstream",
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
                    "(allow_plaintext_upstream): cache salts and token ids in clear",
                    "set kv_events_curve_server_key_file (docs/kv-relay.md)",
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
            "Whoever holds that key bypasses the gateway",
            "keep replicas on a private network only the gateways reach",
        )
    if status == 200:
        return Finding(
            check,
            url,
            Severity.HIGH,
            "answers without credentials: anyone who reaches it bypasses the gateway and "
            "chooses its own cache_salt (or none). Set the replica's --api-key and firewall it",
            f"start vLLM with {API_KEY} (the key in [[replicas]] api_key_file)",
        )
    return Finding(
        check,
        url,
        Severity.INFO,
        f"reachable; /v1/models answered {status}",
        "check what answers at this URL: the replica's /v1/models should need its key",
    )


def judge_metrics_exposure(url: str, status: int | None, body: bytes) -> Finding:
    """A replica's /metrics fetched without credentials (vLLM serves it unauthenticated)."""
    check = "replica-metrics"
    if status == 200 and b"vllm:" in body:
        return Finding(
            check,
            url,
            Severity.MEDIUM,
            "/metrics is readable without credentials: prefix-cache hit counters and queue "
            "lengths let an observer see other tenants' cache hits",
            "let only the gateways and Prometheus reach the replica's port (vLLM serves "
            "/metrics on its API port, without the API key)",
        )
    if status is None:
        return Finding(check, url, Severity.OK, "/metrics not reachable from this host")
    return Finding(check, url, Severity.OK, f"/metrics answered {status} without credentials")


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
            check,
            url,
            Severity.INFO,
            "unknown: no vllm:cache_config_info in /metrics here",
            f"start vLLM with {HASH_ALGO} sha256 (this audit cannot see the algorithm)",
        )
    if labels.get("enable_prefix_caching", "True").lower() != "true":
        return Finding(
            check,
            url,
            Severity.INFO,
            "prefix caching is off on this replica",
            f"when prefix caching is turned on, add {HASH_ALGO} sha256",
        )
    algo = labels.get("prefix_caching_hash_algo")
    if algo is None:
        return Finding(
            check,
            url,
            Severity.INFO,
            "cache_config_info names no hash algorithm",
            f"start vLLM with {HASH_ALGO} sha256",
        )
    severity, why = _HASH_ALGO_VERDICTS.get(
        algo, (Severity.INFO, "an algorithm this audit does not know")
    )
    fix = (
        NOTHING_TO_CHANGE if algo in EXPECTED_HASH_ALGOS else f"start vLLM with {HASH_ALGO} sha256"
    )
    return Finding(check, url, severity, f"{algo}: {why}", fix)


# -- the flags of saltgate's vLLM line (vllm_line.py), seen from outside -------------------


@dataclass(frozen=True, slots=True)
class RepeatProbe:
    """One random prompt sent twice straight to a replica (with its key), nothing between."""

    status: int | None  # the repeat's HTTP status; None when it could not be sent
    cached: int | None  # the repeat's usage.prompt_tokens_details.cached_tokens, if reported
    hits_delta: float | None  # growth of vllm:prefix_cache_hits over the repeat, if readable


def judge_prompt_tokens_details(url: str, probe: RepeatProbe) -> Finding:
    """vLLM leaves usage.prompt_tokens_details null without --enable-prompt-tokens-details."""
    check = "prompt-tokens-details"
    if probe.status != 200:
        return Finding(check, url, Severity.INFO, *_not_probed(probe.status))
    if probe.cached is None:
        return Finding(
            check,
            url,
            Severity.MEDIUM,
            "answers carry no usage.prompt_tokens_details.cached_tokens: the ledger cannot "
            "tell cached tokens from uncached ones, so they are billed at the full price",
            f"start vLLM with {PROMPT_TOKENS_DETAILS}",
        )
    return Finding(check, url, Severity.OK, "answers report their cached tokens")


def judge_prefix_caching(url: str, labels: dict[str, str] | None, probe: RepeatProbe) -> Finding:
    """The repeat of a prompt must find it cached; cache_config_info says so without one."""
    check = "prefix-caching"
    fix = f"start vLLM with {PREFIX_CACHING}"
    off = (
        "a repeated prompt is computed again: no cache hits, so none of saltgate's "
        "cache-aware routing or cached-token prices apply"
    )
    if labels is not None and labels.get("enable_prefix_caching", "True").lower() != "true":
        return Finding(check, url, Severity.MEDIUM, f"prefix caching is off: {off}", fix)
    if probe.status == 200 and probe.cached is not None:  # the answer's own count decides
        hit, how = probe.cached > 0, f"cached_tokens={probe.cached}"
    elif probe.status == 200 and probe.hits_delta is not None:
        hit, how = probe.hits_delta > 0, f"vllm:prefix_cache_hits +{probe.hits_delta:g}"
    elif labels is not None:
        return Finding(check, url, Severity.OK, "cache_config_info: enable_prefix_caching=True")
    else:
        if probe.status != 200:
            return Finding(check, url, Severity.INFO, *_not_probed(probe.status))
        return Finding(
            check,
            url,
            Severity.INFO,
            "answers carry no cached tokens; /metrics had no cache_config_info",
            f"start vLLM with {PROMPT_TOKENS_DETAILS}, so the audit can see cache hits",
        )
    if hit:
        return Finding(check, url, Severity.OK, f"a repeated prompt hits the cache ({how})")
    return Finding(check, url, Severity.MEDIUM, f"{off} ({how} on the repeat)", fix)


def _not_probed(status: int | None) -> tuple[str, str]:
    """A probe that did not run: the summary and the fix."""
    if status in (401, 403):
        return (f"not checked: the replica refused the probe ({status})", REFUSED)
    if status is None:
        return ("not checked: a completion straight to the replica could not be reached", UNREACHED)
    return (
        f"not checked: a completion straight to the replica answered {status}",
        "make the replica answer a completion for its first model, then audit again",
    )


@dataclass(frozen=True, slots=True)
class BindObservation:
    """Where a replica's URL points, and which other addresses of this host also answer."""

    host: str
    addresses: tuple[str, ...]  # what the URL's host resolves to
    tried: tuple[str, ...] = ()  # this host's non-loopback addresses tried (loopback URLs)
    answering: tuple[str, ...] = ()  # those of them where the replica's port accepted
    error: str | None = None


def judge_bind_address(url: str, obs: BindObservation) -> Finding:
    """A replica should listen on loopback or a private network, never on a public one."""
    check = "replica-bind-address"
    if obs.error is not None or not obs.addresses:
        return Finding(
            check,
            url,
            Severity.INFO,
            f"not checked: {obs.host} ({obs.error})",
            "give the replica a URL whose host resolves here",
        )
    ips = [ipaddress.ip_address(a) for a in obs.addresses]
    public = [str(ip) for ip in ips if ip.is_global]
    if public:
        return Finding(
            check,
            url,
            Severity.MEDIUM,
            f"{obs.host} is a public address ({', '.join(public)}): the replica's port faces "
            "the internet, where anyone can try its key and reach it around the gateway",
            f"start vLLM with {HOST} set to a private address, and firewall its port",
        )
    if not all(ip.is_loopback for ip in ips):
        return Finding(
            check,
            url,
            Severity.OK,
            f"a private address ({', '.join(obs.addresses)}); from here the audit cannot see "
            "whether its host also listens on other interfaces",
        )
    if obs.answering:
        return Finding(
            check,
            url,
            Severity.MEDIUM,
            "the gateway uses loopback, yet the replica's port also answers on "
            f"{', '.join(obs.answering)}: it listens on every interface (vLLM's default)",
            f"start vLLM with {HOST} 127.0.0.1",
        )
    tried = ", ".join(obs.tried) or "none: this host has no other address"
    return Finding(check, url, Severity.OK, f"loopback only (also tried: {tried})")


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
            check,
            endpoint,
            Severity.INFO,
            "something listens here, but it does not speak ZMQ",
            "check what listens on this port, and that it is meant to be reachable",
        )
    if mechanism == "NULL":
        return Finding(
            check,
            endpoint,
            Severity.HIGH,
            "a ZMQ endpoint that accepts anyone (NULL mechanism): vLLM's KV events carry "
            "cache salts in clear, raw prompt token ids and block placement",
            "bind it to a private address, or consume events only through an authenticated "
            "relay (saltgate kv-relay, docs/kv-relay.md)",
        )
    if mechanism == "PLAIN":
        return Finding(
            check,
            endpoint,
            Severity.MEDIUM,
            "a ZMQ endpoint with PLAIN authentication: the password crosses the network in clear",
            "use CURVE (saltgate kv-relay, docs/kv-relay.md)",
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
            "drop these headers in whatever sits between the gateway and its clients",
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
            "fix the replicas' prefix-caching findings above, then audit again",
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
                "make every client reach the replicas through saltgate only, and report "
                "this (SECURITY.md)",
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
            "remove [testing] disable_salting, and make every client reach the replicas "
            "through saltgate only",
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


def _random_prompt() -> list[int]:
    """CANARY_TOKENS random token ids inside any real vocabulary: cached by nobody yet."""
    return [16 + secrets.randbelow(900) for _ in range(CANARY_TOKENS)]


def _first_model_id(body: bytes) -> str | None:
    try:
        return str(orjson.loads(body)["data"][0]["id"])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None


def _local_addresses() -> tuple[str, ...]:
    """This host's non-loopback addresses: those its host name resolves to, and the source
    address of its default route (a UDP connect sends nothing)."""
    found: dict[str, None] = {}
    try:
        for *_, sockaddr in socket.getaddrinfo(socket.gethostname(), None):
            found[str(sockaddr[0])] = None
    except OSError:
        pass
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                found[str(s.getsockname()[0])] = None
        except OSError:
            continue
    return tuple(a for a in found if not ipaddress.ip_address(a).is_loopback)


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

    async def replica(self, replica: ReplicaConfig, listener: MediaListener) -> str:
        """Access, metrics, hash-algorithm, flag and engine-state checks; returns the metrics
        text it could read."""
        base = replica.url.rstrip("/")
        status, _, error = await self._get(base + "/v1/models")
        self.add(judge_replica_access(replica.url, status, error))
        status, body, _ = await self._get(base + "/metrics")
        self.add(judge_metrics_exposure(replica.url, status, body))
        if status != 200:
            status, body, _ = await self._get(base + "/metrics", self._replica_headers(replica))
        text = body.decode("utf-8", "replace") if status == 200 else ""
        labels = parse_cache_config_info(text) if text else None
        self.add(judge_hash_algo(replica.url, labels))
        probe = await self.repeat_probe(replica)
        self.add(judge_prompt_tokens_details(replica.url, probe))
        self.add(judge_prefix_caching(replica.url, labels, probe))
        self.add(judge_bind_address(replica.url, await self.bind_observation(replica.url)))
        headers = self._replica_headers(replica)
        self.report.findings += await probe_engine_state(
            self.client, replica.url, headers, listener, kept=self.config.responses_store
        )
        return text

    async def repeat_probe(self, replica: ReplicaConfig) -> RepeatProbe:
        """A random prompt (under a random salt: no one else's namespace) sent twice."""
        base, headers = replica.url.rstrip("/"), self._replica_headers(replica)
        status, body, _ = await self._get(base + "/v1/models", headers)
        model = _first_model_id(body) if status == 200 else None
        if model is None:
            return RepeatProbe(status if status != 200 else None, None, None)
        request = {
            "model": model,
            "prompt": _random_prompt(),
            "max_tokens": 1,
            "cache_salt": f"sgaudit-{secrets.token_hex(8)}",
        }
        status, _, _ = await self._post(base + "/v1/completions", request, headers)
        if status != 200:
            return RepeatProbe(status, None, None)
        before = await self._hits([replica])
        status, cached, _ = await self._post(base + "/v1/completions", request, headers)
        after = await self._hits([replica])
        delta = after - before if after is not None and before is not None else None
        return RepeatProbe(status, cached, delta)

    async def bind_observation(self, url: str) -> BindObservation:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            return BindObservation(host, (), error=_err(exc))
        addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
        if not all(ipaddress.ip_address(a).is_loopback for a in addresses):
            return BindObservation(host, addresses)
        tried = _local_addresses()
        answering = [a for a in tried if await self._accepts(a, port)]
        return BindObservation(host, addresses, tried, tuple(answering))

    async def _accepts(self, address: str, port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(address, port), self.timeout)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True

    async def kv_endpoint(self, endpoint: str) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme != "tcp" or not parts.hostname or not parts.port:
            self.add(
                Finding(
                    "kv-events-endpoint",
                    endpoint,
                    Severity.INFO,
                    "not checked: only tcp://host:port endpoints can be probed from here",
                    "give --kv-events as tcp://HOST:PORT",
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
        return _first_model_id(body) if status == 200 else None

    def _gateway_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def canary(self, kind: str, model: str) -> None:
        """Prime a random prompt on every replica directly (with the canary salt, or none),
        confirm a direct repeat hits, then send it through the gateway and look for a hit."""
        salt = f"sgaudit-{secrets.token_hex(8)}" if kind == "client-salt" else None
        body: dict[str, Any] = {"model": model, "prompt": _random_prompt(), "max_tokens": 1}
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
                    "start the gateway and give --gateway-url and a tenant's --api-key",
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
    envoy_configs: Sequence[tuple[str, Any]] = (),
) -> DeploymentReport:
    """Every check, in order; a check that cannot run says so as an `info` finding.
    ``envoy_configs``: (file name, parsed document) of Envoy configurations in front of
    `saltgate epp`."""
    async with httpx.AsyncClient(timeout=timeout, verify=_trust(config)) as client:
        checks = _Checks(config, client, gateway or gateway_url(config), api_key, timeout)
        checks.add(judge_salting_config(config))
        for source, document in envoy_configs:
            checks.report.findings += judge_envoy_config(source, document)
        checks.report.findings += judge_plaintext_upstream(config)
        async with MediaListener() as listener:
            for replica in config.replicas:
                await checks.replica(replica, listener)
        endpoints = list(dict.fromkeys(kv_endpoints))
        if probe_default_kv_port:
            hosts = dict.fromkeys(urlsplit(r.url).hostname or "" for r in config.replicas)
            endpoints += [f"tcp://{h}:{DEFAULT_KV_EVENTS_PORT}" for h in hosts if h]
        for endpoint in dict.fromkeys(endpoints):
            await checks.kv_endpoint(endpoint)
        model = await checks.model() if api_key else None
        if model is None:
            why, fix = (
                ("no tenant's key", "pass --api-key (a tenant's key)")
                if not api_key
                else ("GET /v1/models failed", "start the gateway, or give --gateway-url")
            )
            for check in ("client-salt-stripped", "requests-salted", "response-reveals-replica"):
                checks.add(
                    Finding(check, checks.gateway, Severity.INFO, f"not checked: {why}", fix)
                )
        else:
            await checks.canary("client-salt", model)
            await checks.canary("unsalted", model)
            authorities = [_authority(r.url) for r in config.replicas]
            checks.add(judge_response_headers(checks.gateway, checks.seen_headers, authorities))
        return checks.report
