"""The deployment audit's KV tiers beyond the GPU prefix cache, read from /metrics (pure).

vLLM can copy KV blocks out of the accelerator: native CPU offloading
(`--kv-offloading-size`, visible in `vllm:cache_config_info`), and connectors given with
`--kv-transfer-config` (LMCache, HF3FS, Mooncake, NIXL...), visible only by their own metric
families, or by the always-registered traffic counters once they serve a hit. A tier that
keys blocks without the request's `cache_salt` hands one tenant's KV to another; a tier on
disk keeps tenants' prompt state beyond the process ("volatile cache": KV never persisted).
Which tier carries the salt is from vLLM's source (docs/audit.md, "KV tiers").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from saltgate.audit.findings import UNREACHED, Finding, Severity

__all__ = [
    "CONNECTOR_FAMILIES",
    "KV_OFFLOADING_SIZE",
    "KV_TIER_CHECKS",
    "KV_TRANSFER_CONFIG",
    "KvTiers",
    "judge_external_hits",
    "judge_kv_connectors",
    "judge_kv_offloading",
    "judge_kv_tiers",
    "judge_volatile_cache",
    "parse_cache_config_info",
    "read_kv_tiers",
]

KV_OFFLOADING_SIZE = "--kv-offloading-size"
KV_TRANSFER_CONFIG = "--kv-transfer-config"

_SALTED = "keys blocks on vLLM's block hashes, which carry the cache_salt"


@dataclass(frozen=True, slots=True)
class _Connector:
    name: str
    severity: Severity  # HIGH: known to ignore the salt; MEDIUM: unknown; LOW: carries it
    why: str
    on_disk: bool = False


CONNECTOR_FAMILIES: dict[str, _Connector] = {
    "vllm:hf3fs_": _Connector(
        "HF3FS",
        Severity.HIGH,
        "hashes blocks from token ids alone, without the cache_salt "
        "(GHSA-qj2w-6f36-hc5w): a tenant's prompt finds another tenant's KV in the store",
        on_disk=True,
    ),
    "vllm:mooncake_": _Connector(
        "Mooncake",
        Severity.MEDIUM,
        "a KV store shared across instances; nothing shows that its keys carry the cache_salt",
    ),
    "vllm:umbp_": _Connector(
        "UMBP", Severity.MEDIUM, "nothing shows that its keys carry the cache_salt"
    ),
    "vllm:hisparse_": _Connector(
        "HiSparse", Severity.MEDIUM, "nothing shows that its keys carry the cache_salt"
    ),
    "vllm:nixl_": _Connector(
        "NIXL",
        Severity.LOW,
        "moves one request's own KV between prefill and decode instances; each instance's "
        "prefix cache stays salted",
    ),
    "vllm:kv_offload_": _Connector("native KV offloading", Severity.LOW, _SALTED),
    "vllm:simple_kv_offload_": _Connector("simple CPU KV offloading", Severity.LOW, _SALTED),
}
"""Metric-family prefixes a connector registers only when configured (vLLM 0.32-0.34).
LMCache's connectors register none: they show only in the traffic counters."""

_INFO_LINE = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_SAMPLE = re.compile(
    r"^(?P<name>vllm:[A-Za-z0-9_:]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)", re.MULTILINE
)
_OFF = ("", "None", "none", "0", "0.0")
_EXTERNAL_SOURCES = ("host", "disk", "p2p", "external_unspecified")


@dataclass(frozen=True, slots=True)
class KvTiers:
    """What /metrics says about KV held anywhere but the accelerator's prefix cache."""

    info: dict[str, str] | None  # vllm:cache_config_info's labels, None when absent
    families: tuple[str, ...]  # every vllm: metric family present
    external_queries: float  # vllm:external_prefix_cache_queries
    external_hits: float  # vllm:external_prefix_cache_hits
    external_transfer: float  # vllm:prompt_tokens_by_source{source="external_kv_transfer"}
    cached_by_source: dict[str, float]  # vllm:prompt_tokens_cached_by_source by source

    @property
    def offloading(self) -> tuple[str, str] | None:
        """(size, backend) when cache_config_info says KV is offloaded, else None."""
        if self.info is None or self.info.get("kv_offloading_size", "None") in _OFF:
            return None
        return self.info["kv_offloading_size"], self.info.get("kv_offloading_backend", "?")

    def connectors(self) -> list[_Connector]:
        return [
            connector
            for prefix, connector in CONNECTOR_FAMILIES.items()
            if any(f.startswith(prefix) for f in self.families)
        ]

    @property
    def external_traffic(self) -> float:
        beyond = sum(self.cached_by_source.get(s, 0.0) for s in _EXTERNAL_SOURCES)
        return max(self.external_queries, self.external_hits, self.external_transfer, beyond)


def parse_cache_config_info(metrics: str) -> dict[str, str] | None:
    """The labels of vLLM's vllm:cache_config_info gauge, or None if absent."""
    match = _INFO_LINE.search(metrics)
    if match is None:
        return None
    return dict(_LABEL.findall(match.group("labels")))


def _family(name: str) -> str:
    for suffix in ("_total", "_created", "_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def read_kv_tiers(metrics: str) -> KvTiers:
    """Everything the KV-tier checks need from one /metrics text."""
    families: dict[str, None] = {}
    sums: dict[str, float] = {}
    by_source: dict[str, dict[str, float]] = {}
    for match in _SAMPLE.finditer(metrics) if metrics else ():
        name = match.group("name")
        families[_family(name)] = None
        if not name.endswith("_total"):
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        sums[name] = sums.get(name, 0.0) + value
        source = dict(_LABEL.findall(match.group("labels") or "")).get("source")
        if source is not None:
            per = by_source.setdefault(name, {})
            per[source] = per.get(source, 0.0) + value
    return KvTiers(
        info=parse_cache_config_info(metrics),
        families=tuple(families),
        external_queries=sums.get("vllm:external_prefix_cache_queries_total", 0.0),
        external_hits=sums.get("vllm:external_prefix_cache_hits_total", 0.0),
        external_transfer=by_source.get("vllm:prompt_tokens_by_source_total", {}).get(
            "external_kv_transfer", 0.0
        ),
        cached_by_source=by_source.get("vllm:prompt_tokens_cached_by_source_total", {}),
    )


def judge_kv_offloading(url: str, tiers: KvTiers) -> Finding:
    """`kv_offloading_size` in cache_config_info: native offloading and LMCache's MP
    connector (the `lmcache` backend) key on salted hashes; another backend is unknown."""
    check = "kv-offloading"
    if tiers.info is None:
        return Finding(
            check,
            url,
            Severity.INFO,
            "unknown: no vllm:cache_config_info here",
            "run a vLLM that exports cache_config_info (0.32 or later), or check its "
            f"{KV_OFFLOADING_SIZE} by hand",
        )
    if tiers.offloading is None:
        return Finding(check, url, Severity.OK, "no KV offloading (kv_offloading_size=None)")
    size, backend = tiers.offloading
    where = f"KV offloaded to host memory (kv_offloading_size={size}, backend {backend})"
    if backend == "native":
        return Finding(
            check,
            url,
            Severity.LOW,
            f"{where}: {_SALTED}; tenants' KV rests in host RAM",
            "keep the replica's host memory as private as its accelerator (no swap to disk)",
        )
    if backend == "lmcache":
        return Finding(
            check,
            url,
            Severity.LOW,
            f"{where}: LMCache's MP connector passes the request's cache_salt; tenants' KV "
            "rests in LMCache's tiers",
            "check LMCache's configuration keeps no tier on disk",
        )
    return Finding(
        check,
        url,
        Severity.MEDIUM,
        f"{where}: a backend this audit does not know; nothing shows it carries the cache_salt",
        f"start vLLM without {KV_OFFLOADING_SIZE}, or with --kv-offloading-backend native",
    )


def judge_kv_connectors(url: str, tiers: KvTiers) -> list[Finding]:
    """One finding per connector whose metric families are present."""
    check = "kv-connectors"
    found = tiers.connectors()
    if not found:
        return [Finding(check, url, Severity.OK, "no KV connector metric families")]
    return [
        Finding(
            check,
            url,
            connector.severity,
            f"{connector.name} connector: {connector.why}",
            f"keep the {connector.name} connector's storage as private as the accelerator"
            if connector.severity is Severity.LOW
            else f"start vLLM without the {connector.name} connector in {KV_TRANSFER_CONFIG}",
        )
        for connector in found
    ]


def _salted_tier(tiers: KvTiers) -> bool:
    """A tier known to carry the salt is configured (it may explain external traffic)."""
    offloading = tiers.offloading
    if offloading is not None and offloading[1] in ("native", "lmcache"):
        return True
    return any(c.severity is Severity.LOW for c in tiers.connectors())


def judge_external_hits(url: str, tiers: KvTiers) -> Finding:
    """Traffic counters always registered: tokens looked up in or served from a tier beyond
    the accelerator (LMCache through --kv-transfer-config shows only here)."""
    check = "external-kv-hits"
    traffic = tiers.external_traffic
    if traffic <= 0:
        return Finding(
            check,
            url,
            Severity.OK,
            "no prompt token looked up in or served from outside the accelerator's prefix "
            "cache (so far: a connector without metrics shows here only after traffic)",
        )
    counts = (
        f"external_prefix_cache queries {tiers.external_queries:g}, hits "
        f"{tiers.external_hits:g}; cached tokens by source "
        + ", ".join(f"{s} {tiers.cached_by_source.get(s, 0.0):g}" for s in _EXTERNAL_SOURCES)
    )
    if _salted_tier(tiers) or any(c.severity is Severity.HIGH for c in tiers.connectors()):
        return Finding(
            check,
            url,
            Severity.LOW,
            f"KV served from the tiers found above ({counts})",
            "see the kv-offloading and kv-connectors findings above",
        )
    return Finding(
        check,
        url,
        Severity.HIGH,
        f"a KV connector that registers no metrics answers prefix lookups ({counts}); "
        "LMCache's V1 connector (LMCacheConnectorV1) keys blocks without the cache_salt",
        f"start vLLM without that connector in {KV_TRANSFER_CONFIG}, or with "
        "--kv-offloading-backend lmcache (its MP connector passes the salt)",
    )


def judge_volatile_cache(url: str, tiers: KvTiers) -> Finding:
    """KV never persisted to disk: tenants' prompt state ends with the process."""
    check = "volatile-cache"
    disk = [c.name for c in tiers.connectors() if c.on_disk]
    if tiers.cached_by_source.get("disk", 0.0) > 0:
        disk.append(f"{tiers.cached_by_source['disk']:g} prompt tokens served from disk")
    if disk:
        return Finding(
            check,
            url,
            Severity.MEDIUM,
            f"KV is persisted to disk ({', '.join(disk)}): tenants' prompt state outlives "
            "the process and can be read from the disk",
            f"start vLLM without disk tiers in {KV_TRANSFER_CONFIG}",
        )
    if tiers.external_traffic > 0 and not _salted_tier(tiers):
        return Finding(
            check,
            url,
            Severity.INFO,
            "unknown: a connector without metrics serves KV, and where it keeps it (memory "
            "or disk) does not show",
            f"check the connector in {KV_TRANSFER_CONFIG} keeps nothing on disk",
        )
    return Finding(check, url, Severity.OK, "no disk tier: KV lives in accelerator or host memory")


KV_TIER_CHECKS = ("kv-offloading", "kv-connectors", "external-kv-hits", "volatile-cache")


def judge_kv_tiers(url: str, metrics: str | None) -> list[Finding]:
    """Every KV-tier check of one replica's /metrics text (None: it could not be read)."""
    if metrics is None:
        return [
            Finding(check, url, Severity.INFO, "not checked: /metrics could not be read", UNREACHED)
            for check in KV_TIER_CHECKS
        ]
    tiers = read_kv_tiers(metrics)
    return [
        judge_kv_offloading(url, tiers),
        *judge_kv_connectors(url, tiers),
        judge_external_hits(url, tiers),
        judge_volatile_cache(url, tiers),
    ]
