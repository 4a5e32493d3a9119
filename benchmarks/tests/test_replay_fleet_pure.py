"""The fleet benchmark's pure parts: which variants run, the targets, the ledger count
of what was in flight at a kill, and the [cluster] section the gateways get."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from saltgate.routing.cluster import ClusterSettings
from saltgate_bench.gateway_setup import GatewayState, check_gateway_config, gateway_config
from saltgate_bench.replay_fleet import FleetOptions, killed_in_flight, variant_label
from saltgate_bench.replay_metrics import Outcome, check_fleet_targets, markdown_table

pytestmark = pytest.mark.unit


def test_one_gateway_runs_once_and_the_rest_in_order() -> None:
    both = FleetOptions((1, 4), (True, False))
    assert both.variants() == [(1, False), (4, True), (4, False)]
    assert both.needs_bus
    assert FleetOptions((1,), (True,)).variants() == [(1, True)]
    assert not FleetOptions((2, 4), (False,)).needs_bus


def result(gateways: int, shared: bool, ratio: float, p99: float, **extra: Any) -> dict[str, Any]:
    return {
        "policy": "saltgate",
        "gateways": gateways,
        "shared_state": shared,
        "cached_token_ratio": ratio,
        "ttft_p99_ms": p99,
        "ttft_p50_ms": p99 / 4,
        "throughput_rps": 28.0,
        "output_tokens_per_s": 1200.0,
        "max_mean_load": 1.05,
        "failed": 0,
        "cross_tenant_hits": 0,
        "ledger": {"delivered_200": 10, "with_one_record": 10},
        **extra,
    }


def test_fleet_targets_compare_shared_gateways_with_one() -> None:
    lines = check_fleet_targets(
        [
            result(1, False, 0.170, 1000.0),
            result(4, True, 0.166, 1090.0),
            result(4, False, 0.120, 1500.0),
        ]
    )
    ratio = [line for line in lines if "x4 shared cached-token ratio" in line]
    p99 = [line for line in lines if "x4 shared TTFT p99" in line]
    assert ratio == [
        "PASS: saltgate x4 shared cached-token ratio 0.166 = 0.976x of one gateway's 0.170 "
        "(target >= 0.97x)"
    ]
    assert p99[0].startswith("PASS") and "1.09x" in p99[0]
    assert not any("x4 alone" in line and "ratio" in line for line in lines)  # beside it only
    missed = check_fleet_targets(
        [
            result(1, False, 0.170, 1000.0),
            result(4, True, 0.160, 1200.0, failed=2, cross_tenant_hits=1),
        ]
    )
    assert sum(line.startswith("MISS") for line in missed) == 4
    leaky = check_fleet_targets(
        [result(2, True, 0.1, 1.0, ledger={"delivered_200": 10, "with_one_record": 9})]
    )
    assert leaky == ["MISS: saltgate x2 shared ledger: 9 of 10 responses delivered with a 200 "
                     "have exactly one usage record"]  # fmt: skip
    table = markdown_table([result(4, True, 0.166, 1090.0)])
    assert "| saltgate x4 shared | 0.166 |" in table


def test_failures_are_told_apart_from_what_was_in_flight_at_the_kill() -> None:
    outcomes: list[Outcome | None] = [
        Outcome(sent_at=0.0, done_at=1.0, ok=True),  # done before the kill
        Outcome(sent_at=1.5, done_at=3.0, ok=True),  # in flight, on a surviving gateway
        Outcome(sent_at=1.8, done_at=2.0, error="broken stream"),  # in flight, on the dead one
        Outcome(sent_at=4.0, done_at=4.1, error="HTTP 503"),  # after the kill: not excused
        None,
    ]
    assert killed_in_flight(outcomes, 2.0) == {
        "in_flight_at_kill": 2,
        "failed_in_flight_at_kill": 1,
        "failed_otherwise": 1,
    }
    assert variant_label("saltgate", 4, False) == "saltgate x4 alone"


def test_a_gateway_config_with_a_cluster_section_loads(tmp_path: Path) -> None:
    state = GatewayState(tmp_path / "state", ("k",))
    cluster = ClusterSettings(
        "redis://127.0.0.1:6379/0", 'gw"1', password_file=tmp_path / "pw", publish_interval_s=0.05
    )
    text = gateway_config(state, ["http://127.0.0.1:9"], port=1, admin_port=2, cluster=cluster)
    assert tomllib.loads(text)["cluster"]["gateway_id"] == 'gw"1'
    check_gateway_config(text.replace('gw\\"1', "gw1"), tmp_path)
