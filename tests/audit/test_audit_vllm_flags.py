"""`saltgate audit deployment` and the vLLM flags saltgate relies on (saltgate.audit.vllm_line):
pure judgements, then simulated replicas started with each flag missing (each finding
appears, naming the flag to add) and with all of them right (none does)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from tests.support.gateways import spawn, write_gateway_config

from saltgate.audit.deployment import (
    BindObservation,
    DeploymentReport,
    Finding,
    RepeatProbe,
    Severity,
    judge_bind_address,
    judge_prefix_caching,
    judge_prompt_tokens_details,
    run_deployment_audit,
)
from saltgate.audit.findings import NOTHING_TO_CHANGE, REFUSED, UNREACHED
from saltgate.audit.vllm_line import API_KEY, HOST, PREFIX_CACHING, PROMPT_TOKENS_DETAILS
from saltgate.config import GatewayConfig, ReplicaConfig
from saltgate.sim.run import SimConfig, start_sim

REPLICA_KEY = "replica-secret-key-0123456789"
FLAG_CHECKS = (
    "replica-direct-access",  # the --api-key check
    "prefix-caching-hash",
    "prompt-tokens-details",
    "prefix-caching",
    "replica-bind-address",
)


def flag_findings(report: DeploymentReport) -> dict[str, Finding]:
    found = {f.check: f for f in report.findings if f.check in FLAG_CHECKS}
    assert set(found) == set(FLAG_CHECKS), report.to_json()
    return found


# -- pure ---------------------------------------------------------------------------------


def test_prompt_tokens_details_judgement() -> None:
    missing = judge_prompt_tokens_details("r", RepeatProbe(200, None, 480.0))
    assert missing.severity is Severity.MEDIUM and PROMPT_TOKENS_DETAILS in missing.fix
    reported = judge_prompt_tokens_details("r", RepeatProbe(200, 0, None))
    assert reported.severity is Severity.OK and reported.fix == NOTHING_TO_CHANGE
    refused = judge_prompt_tokens_details("r", RepeatProbe(401, None, None))
    assert refused.severity is Severity.INFO and refused.fix == REFUSED
    unreachable = judge_prompt_tokens_details("r", RepeatProbe(None, None, None))
    assert unreachable.severity is Severity.INFO and unreachable.fix == UNREACHED


def test_prefix_caching_judgement_prefers_the_answer_then_the_counters_then_the_info() -> None:
    on, off = {"enable_prefix_caching": "True"}, {"enable_prefix_caching": "False"}

    def judge(labels: dict[str, str] | None, probe: RepeatProbe) -> Finding:
        return judge_prefix_caching("r", labels, probe)

    assert judge(None, RepeatProbe(200, 480, None)).severity is Severity.OK
    no_hit = judge(on, RepeatProbe(200, 0, 480.0))  # the answer's own count wins
    assert no_hit.severity is Severity.MEDIUM and PREFIX_CACHING in no_hit.fix
    assert judge(None, RepeatProbe(200, None, 480.0)).severity is Severity.OK
    assert judge(None, RepeatProbe(200, None, 0.0)).severity is Severity.MEDIUM
    assert judge(off, RepeatProbe(200, 480, None)).severity is Severity.MEDIUM
    assert judge(on, RepeatProbe(401, None, None)).severity is Severity.OK
    assert judge(None, RepeatProbe(401, None, None)).severity is Severity.INFO


def test_bind_address_judgement() -> None:
    def judge(obs: BindObservation) -> Finding:
        return judge_bind_address("r", obs)

    public = judge(BindObservation("vllm.example", ("8.8.8.8",)))
    assert public.severity is Severity.MEDIUM and HOST in public.fix
    assert judge(BindObservation("h", ("2606:4700::1111",))).severity is Severity.MEDIUM
    assert judge(BindObservation("10.0.1.1", ("10.0.1.1",))).severity is Severity.OK
    assert judge(BindObservation("h", ("fd00::5",))).severity is Severity.OK
    everywhere = judge(BindObservation("localhost", ("127.0.0.1",), ("10.1.1.1",), ("10.1.1.1",)))
    assert everywhere.severity is Severity.MEDIUM and "127.0.0.1" in everywhere.fix
    assert "10.1.1.1" in everywhere.summary
    loopback = judge(BindObservation("localhost", ("127.0.0.1", "::1"), ("10.1.1.1",), ()))
    assert loopback.severity is Severity.OK and loopback.fix == NOTHING_TO_CHANGE
    unknown = judge(BindObservation("nowhere.invalid", (), error="gaierror"))
    assert unknown.severity is Severity.INFO


# -- simulated replicas -------------------------------------------------------------------


async def audit(url: str, api_key: str | None) -> DeploymentReport:
    """The deployment audit of one replica; no tenant key, so the gateway is not asked."""
    config = GatewayConfig(
        replicas=(ReplicaConfig(url, api_key=api_key),),
        state_dir=Path("unused"),
        master_key_file=Path("unused"),
    )
    return await run_deployment_audit(config, probe_default_kv_port=False, timeout=10)


def flag_to_change(finding: Finding) -> bool:
    return finding.fix.startswith("start vLLM")


def test_a_replica_started_with_saltgates_flags_has_no_flag_finding() -> None:
    """The negative control: bound to loopback, with a key, caching and details on."""

    async def body() -> DeploymentReport:
        sim = await start_sim(SimConfig(port=0, api_key=REPLICA_KEY, hash_algo="sha256_cbor"))
        try:
            return await audit(sim.url, REPLICA_KEY)
        finally:
            await sim.close()

    report = asyncio.run(body())
    found = flag_findings(report)
    assert found["replica-direct-access"].severity is Severity.LOW  # refuses without a key
    for check in FLAG_CHECKS[1:]:
        assert found[check].severity is Severity.OK, found[check]
    assert not any(map(flag_to_change, found.values())), report.to_json()
    # The bind check did try another address of this host: its OK is not for want of one.
    assert "no other address" not in found["replica-bind-address"].summary
    assert REPLICA_KEY not in json.dumps(report.to_json())


def test_each_missing_flag_is_reported_in_process() -> None:
    """One flag off at a time, each against its own replica: only its finding turns."""
    cases = {
        "prompt-tokens-details": SimConfig(
            port=0, api_key=REPLICA_KEY, enable_prompt_tokens_details=False
        ),
        "prefix-caching": SimConfig(port=0, api_key=REPLICA_KEY, enable_prefix_caching=False),
        "replica-direct-access": SimConfig(port=0),  # no --api-key
        "replica-bind-address": SimConfig(host="0.0.0.0", port=0, api_key=REPLICA_KEY),
    }

    async def body(config: SimConfig) -> DeploymentReport:
        sim = await start_sim(config)
        try:
            return await audit(f"http://127.0.0.1:{sim.port}", config.api_key)
        finally:
            await sim.close()

    for check, config in cases.items():
        found = flag_findings(asyncio.run(body(config)))
        turned = {c for c, f in found.items() if flag_to_change(f)}
        assert turned == {check}, (check, found)
        assert found[check].severity in (Severity.MEDIUM, Severity.HIGH), found[check]


def test_a_replica_missing_every_flag_fails_the_cli_audit(tmp_path: Path) -> None:
    """`saltgate sim` with vLLM's flag names turned off and on every interface, audited by
    the CLI: every flag finding with its fix, and exit status 1 (no key is high)."""
    sim, url = spawn(
        ["sim", "--host", "0.0.0.0", "--port", "0",
         "--no-enable-prompt-tokens-details", "--no-enable-prefix-caching"],
        "saltgate sim:",
    )  # fmt: skip
    try:
        port = urlsplit(url).port
        config = write_gateway_config(
            tmp_path / "gw.toml",
            state_dir=tmp_path / "state",
            replicas=[f"http://127.0.0.1:{port}"],
        )
        out = tmp_path / "findings.json"
        done = subprocess.run(
            [sys.executable, "-m", "saltgate.cli", "audit", "deployment",
             "--config", str(config), "--json", str(out)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        sim.send_signal(signal.SIGINT)
        sim.wait(30)
    assert done.returncode == 1, done.stdout + done.stderr
    findings = {f["check"]: f for f in json.loads(out.read_text())["findings"]}
    assert findings["replica-direct-access"]["severity"] == "high"
    assert API_KEY in findings["replica-direct-access"]["fix"]
    assert PROMPT_TOKENS_DETAILS in findings["prompt-tokens-details"]["fix"]
    assert PREFIX_CACHING in findings["prefix-caching"]["fix"]
    assert f"{HOST} 127.0.0.1" in findings["replica-bind-address"]["fix"]
    for check in ("prompt-tokens-details", "prefix-caching", "replica-bind-address"):
        assert findings[check]["severity"] == "medium", findings[check]
        assert findings[check]["fix"] in done.stdout  # the table has a fix column
