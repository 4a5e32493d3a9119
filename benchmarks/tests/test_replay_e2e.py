"""The replay benchmark end to end, through real processes over loopback.

`saltgate-bench replay` runs as a subprocess against real `saltgate sim` replicas, a real
`saltgate serve` and the real vllm-router (scripts/bench-setup.sh installs it); if a tool
is missing the run fails and says which. The cross-tenant-hit detector gets a positive
control: the same schedule through vllm-router WITHOUT per-tenant salts must show hits.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from saltgate_bench.procs import default_tools_venv, find_tools
from saltgate_bench.replay import Bench, Options
from saltgate_bench.replay_client import RequestShape
from saltgate_bench.replay_procs import SimSettings
from saltgate_bench.trace_schedule import ReplayRequest

REQUIRED = {
    "policy",
    "cached_token_ratio",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "max_mean_load",
    "failed",
    "cross_tenant_hits",
}


def bench_replay(tmp_path: Path, *args: str, timeout: float = 240) -> dict[str, Any]:
    out = tmp_path / "replay.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "saltgate_bench.cli", "replay",
            "--replicas", "2", "--tenants", "3", "--time-scale", "10", "--no-progress",
            "--startup-timeout", "30", "--drain-timeout", "30",
            "--json", str(out), "--workdir", str(tmp_path / "work"), *args,
        ],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"bench replay failed ({done.returncode}):\n{done.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_a_short_replay_of_two_policies_reports_sane_numbers(tmp_path: Path) -> None:
    plot = tmp_path / "ttft.png"
    report = bench_replay(
        tmp_path,
        "--policy", "saltgate,vllm-router:cache_aware",
        "--duration", "40", "--plot", str(plot),
    )  # fmt: skip
    results = report["results"]
    assert [r["policy"] for r in results] == ["saltgate", "vllm-router:cache_aware"]
    n = report["schedule"]["requests"]
    assert n > 50 and sum(report["schedule"]["requests_per_tenant"]) == n
    for r in results:
        assert set(r) >= REQUIRED, r
        assert r["failed"] == 0 and r["completed"] == n, r.get("errors")
        assert 0.0 < r["cached_token_ratio"] < 1.0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] < 30_000
        assert sum(r["replica_requests"]) == n
        assert 1.0 <= r["max_mean_load"] <= 2.0
        assert r["cross_tenant_hits"] == 0
        # how late the load generator sent: reported, not judged (it follows the machine's
        # load; docs/benchmarks.md reads it beside the figures)
        assert 0 <= r["loadgen"]["send_lag_p50_ms"] <= r["loadgen"]["send_lag_p99_ms"]
    assert report["targets"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_killing_a_replica_mid_replay_fails_only_started_streams(tmp_path: Path) -> None:
    """The replay lasts 15 s (150 trace seconds at x10) so that a replica revived at 3 s has
    time to start, pass a probe and take requests on a loaded machine: with 6 s, a revival
    slowed by CPU hogs left it nothing to serve (10 before the kill, 10 after)."""
    report = bench_replay(
        tmp_path,
        "--policy", "saltgate", "--duration", "150",
        "--kill-replica-at", "1.5", "--revive-after", "1.5",
    )  # fmt: skip
    (r,) = report["results"]
    fault = r["fault"]
    assert fault["replica"] == 0 and fault["killed_at_s"] >= 1.5
    assert fault["revived_at_s"] >= fault["killed_at_s"] + 1.5
    n = report["schedule"]["requests"]
    assert r["completed"] + r["failed"] == n
    # Only what the dead replica was streaming may fail; the rest succeeded elsewhere.
    assert r["failed"] <= 0.2 * n, r["errors"]
    # It rejoined after its probe: it served requests after coming back.
    assert r["replica_requests"][0] > fault["served_before_kill"]


def control_schedule() -> list[ReplayRequest]:
    """Four tenants, one after another, sharing only block 0 (the trace's system prompt)."""
    return [ReplayRequest(i, i, 0.4 * i, i, i, (0, 100 + i, 200 + i), 4) for i in range(4)]


def test_the_detector_catches_cross_tenant_hits_when_salts_are_off(tmp_path: Path) -> None:
    tools = find_tools(default_tools_venv())
    tools.need("vllm-router")
    options = Options(
        policies=(),
        replicas=1,
        tenants=4,
        sim=SimSettings(num_blocks=1024),
        block_tokens=64,
        text_prompts=True,
        router_settings=(),
        fault=None,
        drain_timeout_s=30,
        startup_timeout_s=30,
        progress=False,
    )
    bench = Bench(options, control_schedule(), tools, tmp_path)

    async def run(policy: str, shape: RequestShape) -> dict[str, Any]:
        return await bench.run_policy(policy, shape)

    salted = bench.shape("vllm-router:cache_aware")
    unsalted = RequestShape("sim-model", 64)
    gateway = bench.shape("saltgate")
    leaky = asyncio.run(run("vllm-router:cache_aware", unsalted))
    isolated = asyncio.run(run("vllm-router:cache_aware", salted))
    saltgate = asyncio.run(run("saltgate", gateway))
    for r in (leaky, isolated, saltgate):
        assert r["completed"] == 4, r["errors"]
    # Positive control: without salts, tenants 1..3 each hit tenant 0's block 0.
    assert leaky["cross_tenant_hits"] == 3 and leaky["cross_tenant_tokens"] == 3 * 64
    assert isolated["cross_tenant_hits"] == 0 and isolated["cached_tokens"] == 0
    assert saltgate["cross_tenant_hits"] == 0 and saltgate["cached_tokens"] == 0


def test_envoy_epp_routes_the_trace_as_saltgates_own_edge(tmp_path: Path) -> None:
    """`--policy envoy-epp` (docs/epp.md): the same trace through a real Envoy with
    `saltgate epp` behind it is served whole, isolated, and cached as by saltgate's own
    edge (the same router), within this short run's noise."""
    report = bench_replay(
        tmp_path, "--policy", "saltgate,envoy-epp", "--duration", "40"
    )  # fmt: skip
    own, epp = report["results"]
    assert [own["policy"], epp["policy"]] == ["saltgate", "envoy-epp"]
    n = report["schedule"]["requests"]
    for r in (own, epp):
        assert set(r) >= REQUIRED, r
        assert r["failed"] == 0 and r["completed"] == n, r.get("errors")
        assert r["cross_tenant_hits"] == 0
    assert abs(epp["cached_token_ratio"] - own["cached_token_ratio"]) <= 0.1, (own, epp)
