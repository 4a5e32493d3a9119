"""The gateway's configuration file (TOML), read into typed, validated objects.

Every mistake in the file is reported as a ConfigError naming the key and what is
expected, so `saltgate serve --config FILE` fails with one clear line, not a traceback.
Secrets (the master key, replica API keys) are referenced by file or environment
variable; their values never appear in an error. A parser: the settings types live with
what they configure (kvevents/settings.py, routing/router.py, prices.py,
store/settings.py), and loading a configuration loads no network or database library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from saltgate.kvevents.settings import (
    KvRelaySettings,
    KvUpstream,
    client_key_lines,
    parse_client_key,
)
from saltgate.policy.egress import MediaSettings
from saltgate.policy.forwarded import TrustedProxies
from saltgate.prices import Price, parse_prices
from saltgate.routing.cluster import ClusterSettings
from saltgate.routing.router import RouterConfig

# Re-exported: callers import these from here (saltgate.secretfiles has them for the store).
from saltgate.secretfiles import SECRET_FILE_MAX_BYTES as SECRET_FILE_MAX_BYTES  # noqa: PLC0414
from saltgate.secretfiles import ConfigError as ConfigError  # noqa: PLC0414
from saltgate.secretfiles import create_master_key as create_master_key  # noqa: PLC0414
from saltgate.secretfiles import create_secret_file as create_secret_file  # noqa: PLC0414
from saltgate.secretfiles import load_master_key as load_master_key  # noqa: PLC0414
from saltgate.secretfiles import open_secret_file as open_secret_file  # noqa: PLC0414
from saltgate.secretfiles import read_secret_file as read_secret_file  # noqa: PLC0414
from saltgate.store.settings import StoreSettings

CLIENT_GONE_MODES = ("finish", "abort")
LOG_FORMATS = ("text", "json")
TLS_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file")


UPSTREAM_SCHEMES = {"http": 80, "https": 443}
LOOPBACK_NAMES = ("localhost",)


def parse_authority(url: str) -> tuple[str, int, str]:
    """Split http(s)://host:port/prefix into (host, port, prefix)."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise ValueError("no credentials in the URL: give the replica's key as api_key_file")
    if parts.scheme not in UPSTREAM_SCHEMES or not parts.hostname:
        raise ValueError(f"upstream URL must look like https://host:port, got {url!r}")
    return parts.hostname, parts.port or UPSTREAM_SCHEMES[parts.scheme], parts.path.rstrip("/")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (127.0.0.0/8, ::1, localhost), the
    one place a plaintext link to a replica crosses no network."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def kv_plaintext_remote(upstream: KvUpstream) -> bool:
    """A KV-event link (or its replay link) that crosses a network without CURVE."""
    if upstream.curve_server_key is not None:
        return False
    links = (upstream.endpoint, upstream.replay_endpoint or "")
    return any(plaintext_zmq_remote(e) for e in links)


def plaintext_zmq_remote(endpoint: str) -> bool:
    """A tcp:// ZMQ endpoint off loopback (``*`` and 0.0.0.0 included: bound on every
    interface); ipc:// and inproc:// never leave the machine."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0] or rest
    host = host.rpartition(";")[2]  # "tcp://source;host:port": the remote is after ';'
    return not is_loopback(host)


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    url: str
    weight: float = 1.0
    api_key: str | None = None
    # The replica's vLLM KV-event stream, for the relay (docs/kv-relay.md).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_bind: bool = False
    # The model names it serves, pinned by the operator; None: learnt from its /v1/models.
    models: tuple[str, ...] | None = None
    # The CURVE server key (Z85) the relay pins on kv_events_endpoint: docs/kv-relay.md.
    kv_events_curve_server_key: str | None = None
    # https:// replicas: the CA bundle to verify them against (None: the system's trust
    # store) and the client certificate for mutual TLS; read by the I/O layer (http/tls.py).
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    @property
    def authority(self) -> tuple[str, int, str]:
        return parse_authority(self.url)

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "https"

    @property
    def plaintext_remote(self) -> bool:
        """Plain http to a host off loopback: prompts, salts and the API key in clear."""
        return not self.tls and not is_loopback(self.authority[0])

    @property
    def kv_plaintext_remote(self) -> bool:
        upstream = self.kv_upstream
        return upstream is not None and kv_plaintext_remote(upstream)

    @property
    def kv_upstream(self) -> KvUpstream | None:
        if self.kv_events_endpoint is None:
            return None
        return KvUpstream(
            self.kv_events_endpoint,
            self.kv_events_replay_endpoint,
            self.kv_events_bind,
            curve_server_key=self.kv_events_curve_server_key,
        )


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """[tracing]: OpenTelemetry spans sent over OTLP/HTTP (docs/observability.md)."""

    otlp_endpoint: str  # the collector's base URL; spans go to its /v1/traces
    service_name: str = "saltgate"
    sample_ratio: float = 1.0  # of the traces the gateway starts; a client's choice is kept


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """[queue]: the saturation gate and the fair queue behind it (docs/fairness.md)."""

    enabled: bool = True
    max_queue_s: float = 30.0  # a request waiting longer is answered 503 / 529
    max_waiting_per_replica: int = 2  # a replica's estimated queue at which it is saturated
    quantum_tokens: int = 4096  # service a tenant's same-prefix run may take in one turn
    # Prompt tokens sent to a replica and not yet prefilled past which it takes no more
    # (a replica with none takes any prompt); 0: no such budget; None (unset): each
    # replica's own engine step, as its /metrics reports it (docs/fairness.md).
    max_prefill_tokens_per_replica: int | None = None


@dataclass(frozen=True, slots=True)
class CanaryConfig:
    """[canary]: the isolation canary, on unless disabled (docs/canary.md)."""

    enabled: bool = True
    interval_s: float = 60.0  # between runs (each: three requests per replica)
    timeout_s: float = 30.0  # per canary request; past it the run is inconclusive


@dataclass(frozen=True, slots=True)
class EppConfig:
    """[epp]: `saltgate epp`, the Envoy External Processing server (docs/epp.md)."""

    grpc_port: int = 9002  # the ext_proc (and gRPC health) listener, on [gateway] host
    envoy_port: int = 8081  # the listener of the Envoy configuration `--envoy-config` prints
    # /metrics on [gateway] admin_host (None: none), behind an admin token as the gateway's
    metrics_port: int | None = None


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    replicas: tuple[ReplicaConfig, ...]
    state_dir: Path
    master_key_file: Path
    host: str = "127.0.0.1"
    port: int = 8000
    admin_host: str = "127.0.0.1"
    admin_port: int | None = 8001
    # Host names the admin listener answers to besides admin_host and the loopback names
    # (a DNS-rebinding page names its own host: refused, docs/admin-api.md).
    admin_allowed_hosts: tuple[str, ...] = ()
    # TLS for the admin listener (PEM files; the key mode 0600). Off loopback without it,
    # `serve` refuses to start unless allow_plaintext_admin is set (then warns).
    admin_tls_cert_file: Path | None = None
    admin_tls_key_file: Path | None = None
    allow_plaintext_admin: bool = False
    # TLS at the edge: the inference listener serves HTTPS with these PEM files (the key
    # mode 0600), both or neither; SIGHUP loads them again for new connections.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 600.0
    prices: dict[str, Price] = field(default_factory=dict)
    salting: bool = True
    router: RouterConfig = field(default_factory=RouterConfig)
    config_file: Path | None = None  # where it was read from: `saltgate serve` reloads it
    # Client-keyed mode (docs/client-keyed.md): serve EHBP next to plaintext; the HPKE key
    # file (a configuration file's default: state_dir/hpke.key); None: a key in memory.
    ehbp: bool = True
    ehbp_key_file: Path | None = None
    # Keys replaced by a rotation, still opened (never offered) until clients moved on.
    ehbp_retired_key_files: tuple[Path, ...] = ()
    require_encrypted_secret: bool = False
    # Every replica runs vLLM with --scheduling-policy priority: the gateway sets each
    # request's priority from its key's band (policy/fields.py); else none is forwarded.
    replica_priority_scheduling: bool = False
    kv_relay: KvRelaySettings | None = None  # [kv_relay]: run the KV-event relay in serve
    # When a client leaves before its answer is complete: "finish" lets the replica finish
    # and meters its exact usage; "abort" stops the replica's work at once and meters only
    # the usage already seen (docs/config.md).
    on_client_gone: str = "finish"
    store: StoreSettings | None = None  # [store]; None: SQLite in state_dir (store_settings)
    # PostgreSQL out of reach: authenticate from the keys known for this long, then 503.
    store_outage_grace_s: float = 60.0
    # SIGTERM: what is in flight may finish this long; then streams end with an error event.
    drain_grace_s: float = 30.0
    # The access log: one line per request ("stderr", "off" or a file), text or JSON.
    access_log: str = "stderr"
    log_format: str = "text"
    # Balancers whose X-Forwarded-For names the client in the access log (policy/forwarded.py).
    trusted_proxies: TrustedProxies = field(default_factory=TrustedProxies)
    # [cluster]: share routing state with the other gateways over a bus (docs/deployment.md);
    # None: this gateway routes on what it sees alone.
    cluster: ClusterSettings | None = None
    # [limits] share: how many gateways (without [cluster]) serve the same tenants; each
    # host holds L / share for its workers together (the supervisor counts), and a process
    # cut off from that count L / (share x --workers), never a silent N x L (docs/limits.md).
    limits_share: int = 1
    # [limits] lease_ttl_s: a concurrency slot whose request never ended (a gateway killed)
    # is free again after this; longer than the longest request.
    limits_lease_ttl_s: float = 600.0
    # Accept plain http:// replicas (and kv endpoints without CURVE) off loopback: warned
    # at start, counted in a metric, reported by `saltgate audit deployment`.
    allow_plaintext_upstream: bool = False
    tracing: TracingConfig | None = None  # [tracing]; None: no spans, OpenTelemetry not loaded
    queue: QueueConfig = field(default_factory=QueueConfig)  # [queue]: on unless disabled
    # [media]: remote media URLs refused (the default) or fetched under its egress policy.
    media: MediaSettings = field(default_factory=MediaSettings)
    canary: CanaryConfig = field(default_factory=CanaryConfig)  # [canary]: on by default
    # [responses] store: replicas keep responses (vLLM's store on), each its owner's only
    # (docs/fields.md); false: every request forwarded with store false, no state.
    responses_store: bool = False
    epp: EppConfig = field(default_factory=EppConfig)  # [epp]: read by `saltgate epp` alone

    @property
    def db_path(self) -> Path:
        return self.state_dir / "saltgate.db"

    @property
    def admin_plaintext_remote(self) -> bool:
        """An admin listener off loopback without TLS: admin tokens and the console's
        cookie would cross the network in clear."""
        return (
            self.admin_port is not None
            and self.admin_tls_cert_file is None
            and not is_loopback(self.admin_host)
        )

    @property
    def store_settings(self) -> StoreSettings:
        """Where tenants, keys and usage live: [store], or the embedded default."""
        settings = self.store or StoreSettings.in_state_dir(self.state_dir)
        return dataclasses.replace(settings, master_key_file=self.master_key_file)


def _expect(table: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = table[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"{where}.{key}: expected {_kind_name(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise ConfigError(f"{where}.{key}: expected {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _secret_ref(table: dict[str, Any], prefix: str, where: str, base: Path) -> str | None:
    """A secret given as `<prefix>_file` (relative to the config file) or `<prefix>_env`,
    never inline in the file."""
    if prefix in table:
        raise ConfigError(
            f"{where}.{prefix}: do not put secrets in the config file; "
            f"use {prefix}_file or {prefix}_env"
        )
    if f"{prefix}_file" in table:
        path = _relative_to(base, _expect(table, f"{prefix}_file", str, where))
        data = read_secret_file(path, f"{where}.{prefix}_file")
        text = ""
        with contextlib.suppress(UnicodeDecodeError):
            text = data.decode("utf-8").strip()
        if not text:
            raise ConfigError(f"{where}.{prefix}_file: {path} holds no UTF-8 text")
        return text
    if f"{prefix}_env" in table:
        name = _expect(table, f"{prefix}_env", str, where)
        value = os.environ.get(name)
        if not value:
            raise ConfigError(f"{where}.{prefix}_env: environment variable {name} is not set")
        return value
    return None


def _relative_to(base: Path, name: str) -> Path:
    """A path from the file: absolute as given, relative ones from the file's directory."""
    path = Path(name)
    return path if path.is_absolute() else base / path


def _replica(item: Any, index: int, base: Path) -> ReplicaConfig:
    where = f"replicas[{index}]"
    if not isinstance(item, dict):
        raise ConfigError(f'{where}: expected a table with url = "http://host:port"')
    if "url" not in item:
        raise ConfigError(f"{where}.url: missing")
    url = _expect(item, "url", str, where)
    try:
        parse_authority(url)
    except ValueError as exc:
        raise ConfigError(f"{where}.url: {exc}") from None
    weight = float(_expect(item, "weight", (int, float), where)) if "weight" in item else 1.0
    if weight <= 0:
        raise ConfigError(f"{where}.weight: must be positive")
    kv_keys = {"kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_bind"}
    known = {
        "url",
        "weight",
        "api_key_file",
        "api_key_env",
        "api_key",
        "models",
        "kv_events_curve_server_key_file",
        *kv_keys,
        *TLS_KEYS,
    }
    unknown = set(item) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    kv: dict[str, Any] = {}
    for key in sorted(kv_keys & set(item)):
        kv[key] = _expect(item, key, bool if key == "kv_events_bind" else str, where)
    if kv and "kv_events_endpoint" not in kv:
        raise ConfigError(f"{where}.kv_events_endpoint: missing (the other kv_events_* need it)")
    if "kv_events_curve_server_key_file" in item:
        kv["kv_events_curve_server_key"] = _curve_server_key(item, where, base, kv)
    tls = _replica_tls(item, where, base, url)
    models = _pinned_models(item["models"], where) if "models" in item else None
    api_key = _secret_ref(item, "api_key", where, base)
    return ReplicaConfig(url, weight, api_key, **kv, **tls, models=models)


def _pinned_models(value: Any, where: str) -> tuple[str, ...]:
    """``models = ["name", ...]``: what the replica serves, whatever its probe says."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f'{where}.models: expected a non-empty list of names, e.g. ["m1"]')
    if not all(isinstance(name, str) and name for name in value):
        raise ConfigError(f"{where}.models: every entry must be a non-empty string")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}.models: a model is listed twice")
    return tuple(value)


def _replica_tls(item: dict[str, Any], where: str, base: Path, url: str) -> dict[str, Any]:
    """The tls_* files of an https:// replica, checked to exist (the private key also to
    be private, like every secret file); their content is the I/O layer's to load."""
    paths = {
        key: _relative_to(base, _expect(item, key, str, where)) for key in TLS_KEYS if key in item
    }
    if paths and urlsplit(url).scheme != "https":
        raise ConfigError(f"{where}.{min(paths)}: TLS settings need an https:// url")
    if ("tls_cert_file" in paths) != ("tls_key_file" in paths):
        raise ConfigError(f"{where}: tls_cert_file and tls_key_file go together (mutual TLS)")
    for key, path in paths.items():
        if key == "tls_key_file":
            os.close(open_secret_file(path, f"{where}.{key}"))
        elif not path.is_file():
            raise ConfigError(f"{where}.{key}: {path} is not a readable file")
    return paths


def _curve_server_key(item: dict[str, Any], where: str, base: Path, kv: dict[str, Any]) -> str:
    """The Z85 public key of the CURVE server the relay subscribes to (a public key: any
    file mode), for an endpoint the relay connects to."""
    key = f"{where}.kv_events_curve_server_key_file"
    if "kv_events_endpoint" not in kv or kv.get("kv_events_bind"):
        raise ConfigError(f"{key}: needs a kv_events_endpoint the relay connects to (not bind)")
    path = _relative_to(base, _expect(item, "kv_events_curve_server_key_file", str, where))
    lines = _public_key_lines(path, key)
    try:
        return parse_client_key(lines[0] if len(lines) == 1 else "")
    except ValueError as exc:
        raise ConfigError(f"{key}: {path} must hold one key: {exc}") from None


def _prices(table: Any) -> dict[str, Price]:
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ConfigError("prices: expected [prices.MODEL] tables with input, cached_input, output")
    try:
        return parse_prices(table)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def parse_config(doc: dict[str, Any], base: Path) -> GatewayConfig:
    """Build a GatewayConfig from a parsed TOML document; relative paths start at `base`."""
    known = {
        "gateway",
        "replicas",
        "prices",
        "router",
        "testing",
        "ehbp",
        "kv_relay",
        "store",
        "cluster",
        "tracing",
        "limits",
        "queue",
        "media",
        "canary",
        "responses",
        "epp",
    }
    unknown = set(doc) - known
    if unknown:
        raise ConfigError(f"unknown sections {sorted(unknown)}; expected {sorted(known)}")
    gw = doc.get("gateway", {})
    if not isinstance(gw, dict):
        raise ConfigError("gateway: expected a table")
    replicas_doc = doc.get("replicas")
    if not isinstance(replicas_doc, list) or not replicas_doc:
        raise ConfigError('replicas: at least one [[replicas]] with url = "http://host:port"')
    replicas = tuple(_replica(item, i, base) for i, item in enumerate(replicas_doc))
    urls = [r.url for r in replicas]
    for i, url in enumerate(urls):
        if url in urls[:i]:
            raise ConfigError(f"replicas[{i}].url: {url} is listed twice")

    def path(key: str, default: str) -> Path:
        return _relative_to(base, _expect(gw, key, str, "gateway") if key in gw else default)

    state_dir = path("state_dir", ".state")
    kwargs = _gateway_options(gw, base)
    testing = doc.get("testing", {})
    salting = True
    if isinstance(testing, dict) and "disable_salting" in testing:
        salting = not _expect(testing, "disable_salting", bool, "testing")
    config = GatewayConfig(
        replicas=replicas,
        state_dir=state_dir,
        master_key_file=path("master_key_file", str(state_dir / "master.key")),
        prices=_prices(doc.get("prices", {})),
        salting=salting,
        router=_router(doc.get("router", {})),
        kv_relay=_kv_relay(doc.get("kv_relay"), replicas, base),
        store=_store(doc.get("store"), base, state_dir),
        cluster=_cluster(doc.get("cluster"), base),
        tracing=_tracing(doc.get("tracing")),
        queue=_queue(doc.get("queue", {})),
        media=_media(doc.get("media", {}), base),
        canary=_canary(doc.get("canary", {})),
        responses_store=_responses(doc.get("responses", {})),
        epp=_epp(doc.get("epp", {})),
        **_limits(doc.get("limits", {})),
        **_ehbp(doc.get("ehbp", {}), base, state_dir),
        **kwargs,
    )
    if not config.allow_plaintext_upstream:
        _refuse_plaintext(replicas)
    refuse_plaintext_admin(config)
    return config


def refuse_plaintext_admin(config: GatewayConfig) -> None:
    """ConfigError for an admin listener off loopback over plain HTTP, unless the
    operator opted in (allow_plaintext_admin; then `admin_plaintext_warning` says it)."""
    if config.admin_plaintext_remote and not config.allow_plaintext_admin:
        raise ConfigError(
            f"gateway.admin_host: {config.admin_host} is off loopback, and admin tokens and "
            "console sessions would cross the network in clear: set admin_tls_cert_file and "
            "admin_tls_key_file, bind 127.0.0.1 and reach it over an SSH tunnel, or set "
            "[gateway] allow_plaintext_admin = true"
        )


def admin_plaintext_warning(config: GatewayConfig) -> str | None:
    """The warning for an admin listener the operator opted to serve off loopback in clear."""
    if not config.admin_plaintext_remote:
        return None
    return (
        f"WARNING: the admin listener on {config.admin_host} is off loopback without TLS "
        "(allow_plaintext_admin): admin tokens and console sessions cross the network in "
        "clear; set admin_tls_cert_file and admin_tls_key_file"
    )


def _refuse_plaintext(replicas: tuple[ReplicaConfig, ...]) -> None:
    for i, replica in enumerate(replicas):
        if replica.plaintext_remote:
            raise ConfigError(
                f"replicas[{i}].url: plain http:// to {replica.authority[0]}, off loopback, "
                "sends prompts, cache salts and the replica's API key in clear: use "
                "https:// (tls_ca_file), or set [gateway] allow_plaintext_upstream = true"
            )
        if replica.kv_plaintext_remote:
            raise ConfigError(
                f"replicas[{i}].kv_events_endpoint: a tcp:// link off loopback without "
                "CURVE carries salts and token ids in clear: set "
                "kv_events_curve_server_key_file (docs/kv-relay.md), or set "
                "[gateway] allow_plaintext_upstream = true"
            )


def _gateway_options(gw: dict[str, Any], base: Path) -> dict[str, Any]:
    """The [gateway] settings other than the state and master-key paths."""
    kwargs: dict[str, Any] = {}
    for key, kind in (
        ("host", str),
        ("port", int),
        ("admin_host", str),
        ("admin_port", int),
        ("max_body_bytes", int),
        ("upstream_timeout_s", (int, float)),
        ("store_outage_grace_s", (int, float)),
        ("drain_grace_s", (int, float)),
        ("allow_plaintext_upstream", bool),
        ("allow_plaintext_admin", bool),
        ("replica_priority_scheduling", bool),
    ):
        if key in gw:
            kwargs[key] = _expect(gw, key, kind, "gateway")
    kwargs.update(_admin_listener(gw, base))
    kwargs.update(_tls_pair(gw, base, ""))  # TLS at the edge: the inference listener's
    _check_graces(kwargs)
    for key, choices in (("on_client_gone", CLIENT_GONE_MODES), ("log_format", LOG_FORMATS)):
        if key in gw:
            value = _expect(gw, key, str, "gateway")
            if value not in choices:
                raise ConfigError(
                    f"gateway.{key}: expected one of {', '.join(choices)}, got {value!r}"
                )
            kwargs[key] = value
    if "access_log" in gw:
        target = _expect(gw, "access_log", str, "gateway")
        kwargs["access_log"] = (
            target if target in ("stderr", "off") else str(_relative_to(base, target))
        )
    if "trusted_proxies" in gw:
        items = _expect(gw, "trusted_proxies", list, "gateway")
        if not all(isinstance(item, str) for item in items):
            raise ConfigError('gateway.trusted_proxies: expected strings ("10.0.0.0/8")')
        try:
            kwargs["trusted_proxies"] = TrustedProxies.parse(items)
        except ValueError as exc:
            raise ConfigError(f"gateway.trusted_proxies: {exc}") from None
    unknown = set(gw) - {*kwargs, "state_dir", "master_key_file", *ADMIN_LISTENER_KEYS}
    if unknown:
        raise ConfigError(f"gateway: unknown keys {sorted(unknown)}")
    return kwargs


def _check_graces(kwargs: dict[str, Any]) -> None:
    if kwargs.get("store_outage_grace_s", 1) <= 0:
        raise ConfigError("gateway.store_outage_grace_s: must be positive")
    if "drain_grace_s" in kwargs:
        if not 0 < kwargs["drain_grace_s"] <= 3600:
            raise ConfigError("gateway.drain_grace_s: expected seconds, more than 0, at most 3600")
        kwargs["drain_grace_s"] = float(kwargs["drain_grace_s"])


ADMIN_LISTENER_KEYS: Final = ("admin_allowed_hosts", "admin_tls_cert_file", "admin_tls_key_file")
_HOST_NAME: Final = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]{1,253})")


def _admin_listener(gw: dict[str, Any], base: Path) -> dict[str, Any]:
    """[gateway] admin_allowed_hosts and the admin listener's TLS files."""
    out: dict[str, Any] = {}
    if "admin_allowed_hosts" in gw:
        names = _expect(gw, "admin_allowed_hosts", list, "gateway")
        if not all(isinstance(n, str) and _HOST_NAME.fullmatch(n) for n in names):
            raise ConfigError(
                "gateway.admin_allowed_hosts: expected host names without a port, such as "
                '["admin.internal", "10.0.0.4", "[fd00::4]"]'
            )
        out["admin_allowed_hosts"] = tuple(n.lower() for n in names)
    out.update(_tls_pair(gw, base, "admin_"))
    return out


def _tls_pair(gw: dict[str, Any], base: Path, prefix: str) -> dict[str, Path]:
    """A listener's ``<prefix>tls_cert_file`` and ``<prefix>tls_key_file``: both or neither
    (their content is loaded by the listener, serving/listener_tls.py)."""
    cert, key = f"{prefix}tls_cert_file", f"{prefix}tls_key_file"
    files = [k for k in (cert, key) if k in gw]
    if len(files) == 1:
        raise ConfigError(f"gateway.{cert} and {key}: give both (PEM files)")
    return {k: _relative_to(base, _expect(gw, k, str, "gateway")) for k in files}


def _ehbp(table: Any, base: Path, state_dir: Path) -> dict[str, Any]:
    """[ehbp]: enabled (default true), key_file (made 0600 if absent; by default in the state
    directory, so that a restart keeps the key clients pinned), retired_key_files (keys a
    rotation replaced, still opened), require_encrypted_secret."""
    if not isinstance(table, dict):
        raise ConfigError("ehbp: expected a table")
    unknown = set(table) - {"enabled", "key_file", "retired_key_files", "require_encrypted_secret"}
    if unknown:
        raise ConfigError(f"ehbp: unknown keys {sorted(unknown)}")
    out: dict[str, Any] = {"ehbp_key_file": state_dir / "hpke.key"}
    if "enabled" in table:
        out["ehbp"] = _expect(table, "enabled", bool, "ehbp")
    if "key_file" in table:
        out["ehbp_key_file"] = _relative_to(base, _expect(table, "key_file", str, "ehbp"))
    if "retired_key_files" in table:
        names = _expect(table, "retired_key_files", list, "ehbp")
        if not all(isinstance(name, str) for name in names):
            raise ConfigError("ehbp.retired_key_files: expected a list of file names")
        out["ehbp_retired_key_files"] = tuple(_relative_to(base, name) for name in names)
    if "require_encrypted_secret" in table:
        required = _expect(table, "require_encrypted_secret", bool, "ehbp")
        if required and not out.get("ehbp", True):
            raise ConfigError(
                "ehbp.require_encrypted_secret: needs ehbp.enabled = true (clients could "
                "not send a secret at all)"
            )
        out["require_encrypted_secret"] = required
    return out


def _kv_relay(
    table: Any, replicas: tuple[ReplicaConfig, ...], base: Path
) -> KvRelaySettings | None:
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError("kv_relay: expected a table")
    if not any(r.kv_events_endpoint for r in replicas):
        raise ConfigError("kv_relay: no [[replicas]] has a kv_events_endpoint to subscribe to")
    return kv_relay_settings(table, base, "kv_relay.")


def kv_relay_settings(table: dict[str, Any], base: Path, where: str = "") -> KvRelaySettings:
    """[kv_relay] (or `saltgate kv-relay`'s options as such a table): the settings, with
    the consumers' keys from ``client_keys_file`` (public keys: any mode) read here."""
    rest = {k: v for k, v in table.items() if k != "client_keys_file"}
    file_keys: list[str] = []
    if "client_keys_file" in table:
        name = _expect(table, "client_keys_file", str, where.rstrip(".") or "kv_relay")
        file_keys = _public_key_lines(_relative_to(base, name), f"{where}client_keys_file")
    try:
        return KvRelaySettings.from_table(rest, file_keys)
    except ValueError as exc:
        raise ConfigError(f"{where}{exc}") from None


def _public_key_lines(path: Path, what: str) -> list[str]:
    """The CURVE public keys in a file, one a line (public: any file mode)."""
    try:
        return client_key_lines(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{what}: cannot read {path}: {reason}") from None


def _store(table: Any, base: Path, state_dir: Path) -> StoreSettings | None:
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError("store: expected a table")
    try:
        return StoreSettings.from_table(table, base, state_dir)
    except ValueError as exc:
        raise ConfigError(f"store.{exc}") from None


def _cluster(table: Any, base: Path) -> ClusterSettings | None:
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError("cluster: expected a table")
    try:
        return ClusterSettings.from_table(table, base)
    except ValueError as exc:
        raise ConfigError(f"cluster.{exc}") from None


def _tracing(table: Any) -> TracingConfig | None:
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError("tracing: expected a table")
    unknown = set(table) - {"otlp_endpoint", "service_name", "sample_ratio"}
    if unknown:
        raise ConfigError(f"tracing: unknown keys {sorted(unknown)}")
    if "otlp_endpoint" not in table:
        raise ConfigError('tracing.otlp_endpoint: required, e.g. "http://collector:4318"')
    endpoint = _expect(table, "otlp_endpoint", str, "tracing")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f'tracing.otlp_endpoint: expected "http(s)://host:port", got {endpoint!r}'
        )
    if parts.username or parts.password:
        raise ConfigError("tracing.otlp_endpoint: credentials in the URL are not supported")
    ratio = (
        float(_expect(table, "sample_ratio", (int, float), "tracing"))
        if "sample_ratio" in table
        else 1.0
    )
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"tracing.sample_ratio: expected a number from 0 to 1, got {ratio:g}")
    name = _expect(table, "service_name", str, "tracing") if "service_name" in table else "saltgate"
    if not name:
        raise ConfigError("tracing.service_name: must not be empty")
    return TracingConfig(endpoint.rstrip("/"), name, ratio)


def _table(table: Any, name: str, known: tuple[str, ...]) -> dict[str, Any]:
    """The [name] table, refused when it is not one or holds a key not in ``known``."""
    if not isinstance(table, dict):
        raise ConfigError(f"{name}: expected a table")
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"{name}: unknown keys {unknown}; expected {list(known)}")
    return table


def _limits(table: Any) -> dict[str, Any]:
    table = _table(table, "limits", ("lease_ttl_s", "share"))
    out: dict[str, Any] = {}
    if "share" in table:
        share = _expect(table, "share", int, "limits")
        if share < 1:
            raise ConfigError("limits.share: expected the number of gateways (1 or more)")
        out["limits_share"] = share
    if "lease_ttl_s" in table:
        ttl = _expect(table, "lease_ttl_s", (int, float), "limits")
        if not ttl >= 1:
            raise ConfigError("limits.lease_ttl_s: expected seconds, at least 1")
        out["limits_lease_ttl_s"] = float(ttl)
    return out


def _queue(table: Any) -> QueueConfig:
    known = (
        "enabled",
        "max_queue_s",
        "max_waiting_per_replica",
        "quantum_tokens",
        "max_prefill_tokens_per_replica",
    )
    table = _table(table, "queue", known)
    out: dict[str, Any] = {}
    if "enabled" in table:
        out["enabled"] = _expect(table, "enabled", bool, "queue")
    if "max_queue_s" in table:
        wait = _expect(table, "max_queue_s", (int, float), "queue")
        if not 0 < wait <= 3600:
            raise ConfigError("queue.max_queue_s: expected seconds, more than 0 and at most 3600")
        out["max_queue_s"] = float(wait)
    for key in ("max_waiting_per_replica", "quantum_tokens", "max_prefill_tokens_per_replica"):
        if key in table:
            value = _expect(table, key, int, "queue")
            if value < 0:
                raise ConfigError(f"queue.{key}: expected an integer, 0 or more")
            out[key] = value
    return QueueConfig(**out)


def _media(table: Any, base: Path) -> MediaSettings:
    if not isinstance(table, dict):
        raise ConfigError("media: expected a table")
    try:
        return MediaSettings.from_table(table, base)
    except ValueError as exc:
        raise ConfigError(f"media.{exc}") from None


def _responses(table: Any) -> bool:
    """[responses]: store (default false)."""
    table = _table(table, "responses", ("store",))
    return bool(_expect(table, "store", bool, "responses")) if "store" in table else False


def _canary(table: Any) -> CanaryConfig:
    table = _table(table, "canary", ("enabled", "interval_s", "timeout_s"))
    out: dict[str, Any] = {}
    if "enabled" in table:
        out["enabled"] = _expect(table, "enabled", bool, "canary")
    for key, low in (("interval_s", 1), ("timeout_s", 0.1)):
        if key in table:
            value = _expect(table, key, (int, float), "canary")
            if not low <= value <= 86_400:
                raise ConfigError(f"canary.{key}: expected seconds, {low:g} to 86400")
            out[key] = float(value)
    return CanaryConfig(**out)


def _epp(table: Any) -> EppConfig:
    known = ("grpc_port", "envoy_port", "metrics_port")
    table = _table(table, "epp", known)
    out: dict[str, int] = {}
    for key in known:
        if key in table:
            value = _expect(table, key, int, "epp")
            if not 0 <= value <= 65_535:
                raise ConfigError(f"epp.{key}: expected a port, 0 to 65535")
            out[key] = value
    return EppConfig(**out)


def _router(table: Any) -> RouterConfig:
    if not isinstance(table, dict):
        raise ConfigError("router: expected a table")
    try:
        return RouterConfig.from_table(table)
    except ValueError as exc:
        raise ConfigError(f"router.{exc}") from None


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return dataclasses.replace(parse_config(doc, path.parent), config_file=path)
