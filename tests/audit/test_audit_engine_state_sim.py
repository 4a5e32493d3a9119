"""`saltgate audit deployment`'s engine-state and KV-tier checks against simulated replicas
over loopback: clean on the default simulator, and each of saltgate.sim.unsafe's switches
(vLLM started with a setting a multi-tenant replica must not have) turns exactly its own
check, naming the flag or variable. The media probe's listener is really fetched."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from saltgate.audit.deployment import DeploymentReport, Finding, Severity, run_deployment_audit
from saltgate.audit.engine_state import (
    LORA_ENV,
    MEDIA_DOMAINS,
    MEDIA_REDIRECTS,
    MM_EMBEDS,
    PER_REQUEST_METRICS,
    PROMPT_EMBEDS,
    RESPONSES_STORE_ENV,
)
from saltgate.audit.kv_tiers import KV_TIER_CHECKS
from saltgate.config import GatewayConfig, ReplicaConfig
from saltgate.sim.run import SimConfig, start_sim
from saltgate.sim.unsafe import UnsafeOptions

REPLICA_KEY = "replica-secret-key-0123456789"
PROBE_CHECKS = (
    "responses-store",
    "remote-media",
    "prompt-embeds",
    "mm-embeds",
    "runtime-lora",
    "per-request-metrics",
)
ENGINE_CHECKS = PROBE_CHECKS + KV_TIER_CHECKS


async def audit_sim(options: UnsafeOptions) -> DeploymentReport:
    sim = await start_sim(SimConfig(port=0, api_key=REPLICA_KEY, unsafe=options))
    try:
        config = GatewayConfig(
            replicas=(ReplicaConfig(sim.url, api_key=REPLICA_KEY),),
            state_dir=Path("unused"),
            master_key_file=Path("unused"),
        )
        return await run_deployment_audit(config, probe_default_kv_port=False, timeout=10)
    finally:
        await sim.close()


def needs_change(finding: Finding) -> bool:
    """A setting to change, not a tier to keep private or a check to run elsewhere."""
    return finding.severity in (Severity.HIGH, Severity.MEDIUM)


def engine_findings(report: DeploymentReport) -> dict[str, list[Finding]]:
    found: dict[str, list[Finding]] = {}
    for finding in report.findings:
        if finding.check in ENGINE_CHECKS:
            found.setdefault(finding.check, []).append(finding)
    assert set(found) == set(ENGINE_CHECKS), report.to_json()
    return found


def test_the_default_simulator_is_clean_on_every_engine_state_check() -> None:
    found = engine_findings(asyncio.run(audit_sim(UnsafeOptions())))
    for finding in (f for fs in found.values() for f in fs):
        assert finding.severity in (Severity.OK, Severity.INFO), finding
    # The simulator fetches nothing (media from data: URLs only, saltgate.sim.multimodal):
    # no fetch, and no vLLM words to read, so inconclusive, said so; the rest a positive OK.
    inconclusive = {c for c, fs in found.items() if fs[0].severity is Severity.INFO}
    assert inconclusive == {"remote-media"}, found
    assert found["remote-media"][0].summary.startswith("inconclusive: no fetch"), found
    assert MM_EMBEDS in found["mm-embeds"][0].summary  # vLLM's refusal with the flag off


# Each switch, the checks it must turn (and only those), the severity, what the fix names.
CASES: dict[str, tuple[UnsafeOptions, dict[str, tuple[Severity, tuple[str, ...]]]]] = {
    "store": (
        UnsafeOptions(responses_store=True),
        {"responses-store": (Severity.HIGH, (RESPONSES_STORE_ENV,))},
    ),
    "media": (
        UnsafeOptions(fetch_media=True),
        {"remote-media": (Severity.HIGH, (MEDIA_DOMAINS, MEDIA_REDIRECTS))},
    ),
    "prompt-embeds": (
        UnsafeOptions(prompt_embeds=True),
        {"prompt-embeds": (Severity.HIGH, (PROMPT_EMBEDS,))},
    ),
    "mm-embeds": (
        UnsafeOptions(mm_embeds=True),
        {"mm-embeds": (Severity.HIGH, (MM_EMBEDS,))},
    ),
    "lora": (
        UnsafeOptions(runtime_lora=True),
        {"runtime-lora": (Severity.HIGH, (LORA_ENV,))},
    ),
    "metrics": (
        UnsafeOptions(per_request_metrics=True),
        {"per-request-metrics": (Severity.MEDIUM, (PER_REQUEST_METRICS,))},
    ),
    "offload-unknown-backend": (
        UnsafeOptions(kv_offloading_size=4.0, kv_offloading_backend="mystery"),
        {"kv-offloading": (Severity.MEDIUM, ("--kv-offloading-size",))},
    ),
    "hf3fs": (
        UnsafeOptions(kv_connector="hf3fs"),
        {
            "kv-connectors": (Severity.HIGH, ("--kv-transfer-config",)),
            "volatile-cache": (Severity.MEDIUM, ("--kv-transfer-config",)),
        },
    ),
    "lmcache-v1": (
        UnsafeOptions(kv_connector="lmcache"),
        {"external-kv-hits": (Severity.HIGH, ("--kv-transfer-config",))},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_unsafe_setting_turns_its_own_check(case: str) -> None:
    options, expected = CASES[case]
    report = asyncio.run(audit_sim(options))
    found = engine_findings(report)
    turned = {c for c, fs in found.items() if any(map(needs_change, fs))}
    assert turned == set(expected), (case, report.to_json())
    for check, (severity, names) in expected.items():
        finding = next(filter(needs_change, found[check]))
        assert finding.severity is severity, finding
        assert all(name in finding.fix for name in names), finding
    assert REPLICA_KEY not in json.dumps(report.to_json())


def test_a_safe_kv_tier_is_reported_but_not_as_a_leak() -> None:
    """Native offloading keys on salted block hashes: LOW, no fix; NIXL likewise."""
    options = UnsafeOptions(kv_offloading_size=4.0, kv_connector="nixl")
    found = engine_findings(asyncio.run(audit_sim(options)))
    assert [f.severity for f in found["kv-offloading"]] == [Severity.LOW]
    assert [f.severity for f in found["kv-connectors"]] == [Severity.LOW]
    assert found["external-kv-hits"][0].severity is Severity.LOW  # the audit's repeat hit
    assert found["volatile-cache"][0].severity is Severity.OK
    tiers = [f for check in KV_TIER_CHECKS for f in found[check]]
    assert not any("start vLLM" in f.fix for f in tiers)


def test_the_media_probe_sees_the_fetch_and_the_redirect_on_its_listener() -> None:
    """Not just the replica's words: the audit's own listener was fetched, then redirected
    to; with redirects off (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0) only the first."""
    found = engine_findings(asyncio.run(audit_sim(UnsafeOptions(fetch_media=True))))
    media = found["remote-media"][0]
    assert "fetched a loopback image URL and followed its redirect" in media.summary, media
    assert MEDIA_REDIRECTS in media.fix
    no_redirects = UnsafeOptions(fetch_media=True, media_redirects=False)
    found = engine_findings(asyncio.run(audit_sim(no_redirects)))
    media = found["remote-media"][0]
    assert media.severity is Severity.HIGH and "(not its redirect)" in media.summary, media
    assert MEDIA_DOMAINS in media.fix and MEDIA_REDIRECTS not in media.fix
