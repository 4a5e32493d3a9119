"""The fairness benchmark's pure parts: the VTC service difference against a computation
done by hand, the per-phase rows, the workload's phases, and which arm is governed."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest

from saltgate.governance.limits import Limits
from saltgate.store.tenants import TenantStore
from saltgate_bench import fairness
from saltgate_bench.fairness_metrics import (
    NOISY,
    QUIET,
    Record,
    Workload,
    build_schedule,
    check_targets,
    phase_summary,
    records,
    service_difference,
    window_difference,
)
from saltgate_bench.gateway_setup import prepare_gateway_state
from saltgate_bench.procs import BenchError
from saltgate_bench.replay_metrics import Outcome
from saltgate_bench.trace_schedule import ReplayRequest

pytestmark = pytest.mark.unit


def served(tenant: int, times: tuple[float, float, float], prompt: int, output: int) -> Record:
    """A served request; ``times``: sent, first token, last token."""
    sent, first, done = times
    cost = prompt + 2 * output
    return Record(
        tenant=tenant,
        sent_at=sent,
        demand=cost,
        ok=True,
        first_token_at=first,
        done_at=done,
        service=cost,
        prompt_tokens=prompt,
    )


# Two windows of 10 s. By hand (service = input + 2 x output, spread over first..last token):
#   quiet a: sent 1, tokens 2..4,  100 + 2x10 = 120: all of it in [0, 10)
#   quiet b: sent 8, tokens 12..14, 120: asked for in [0, 10), served in [10, 20)
#   noisy c: sent 0, tokens 1..6,  1000 + 2x50 = 1100: all in [0, 10)
#   noisy d: sent 0.5, tokens 6..16, 1100: 4/10 in [0, 10) = 440, 6/10 in [10, 20) = 660
# [0, 10):  service quiet 120 -> 12/s, noisy 1540 -> 154/s; demand quiet 240 -> 24/s,
#           noisy 2200 -> 220/s. Quiet: min(154 - 12, 24 - 12) = 12; noisy: min(0, 66) = 0.
#           Difference 12/s (the quiet tenant is short of what it asked for, by 12/s).
# [10, 20): service quiet 12/s, noisy 66/s; nothing asked for: quiet min(54, -12),
#           noisy min(0, -66): both below 0, so 0 (nobody backlogged is wronged).
HAND = [
    served(QUIET, (1.0, 2.0, 4.0), 100, 10),
    served(QUIET, (8.0, 12.0, 14.0), 100, 10),
    served(NOISY, (0.0, 1.0, 6.0), 1000, 50),
    served(NOISY, (0.5, 6.0, 16.0), 1000, 50),
]


def test_the_service_difference_matches_the_hand_computation() -> None:
    assert window_difference(HAND, 0.0, 10.0) == pytest.approx(12.0)
    assert window_difference(HAND, 10.0, 20.0) == 0.0
    # the phase's figure is its worst window
    assert service_difference(HAND, 0.0, 20.0, 10.0) == pytest.approx(12.0)
    # one window over all of it: service quiet 240 -> 12/s, noisy 2200 -> 110/s; demand
    # quiet 12/s, noisy 110/s: quiet got all it asked for, so 0
    assert service_difference(HAND, 0.0, 20.0, 60.0) == 0.0


def test_a_tenant_starved_of_what_it_asked_for_shows_in_full() -> None:
    """Positive control: the quiet tenant's second request never served at all; in
    [10, 20) it asked for 120 and got 0 while the noisy tenant got 66/s: min(66, 12)."""
    starved = [
        HAND[0],
        Record(QUIET, 12.0, 120, error="HTTP 429"),
        HAND[2],
        HAND[3],
    ]
    assert window_difference(starved, 10.0, 20.0) == pytest.approx(12.0)


def test_a_request_whose_tokens_came_at_once_counts_where_they_came() -> None:
    instant = [served(QUIET, (0.0, 3.0, 3.0), 10, 0), served(NOISY, (0.0, 5.0, 5.0), 40, 0)]
    # [0, 4): quiet got 10 (2.5/s) of 10 asked, noisy 0 of 40: min(2.5, 10) = 2.5/s
    assert window_difference(instant, 0.0, 4.0) == pytest.approx(2.5)


def workload(**changes: float) -> Workload:
    base = {
        "phase_s": 20.0,
        "quiet_rps": 3.0,
        "noisy_peak_rps": 8.0,
        "quiet_blocks": 25,
        "noisy_blocks": 1024,
        "block_tokens": 8,
        "quiet_max_tokens": 16,
        "noisy_max_tokens": 64,
        "shared_fraction": 0.5,
        "documents": 4,
        "seed": 7,
    }
    return Workload(**{**base, **changes})  # type: ignore[arg-type]


def test_the_schedule_has_the_three_phases() -> None:
    w = workload()
    schedule = build_schedule(w)
    quiet = [r for r in schedule if r.tenant == QUIET]
    noisy = [r for r in schedule if r.tenant == NOISY]
    assert [r.index for r in schedule] == list(range(len(schedule)))
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(schedule))
    # the quiet tenant throughout, at about its rate; the noisy one only in the middle
    for phase in ("alone", "noisy", "after"):
        start, end = w.bounds(phase)
        n = sum(1 for r in quiet if start <= r.at_s < end)
        assert 0.6 * 60 < n < 1.4 * 60, (phase, n)
    start, end = w.bounds("noisy")
    assert noisy and all(start <= r.at_s < end for r in noisy)
    # ramp then plateau: expected 8 x 5 x 1/4 = 10 in the first quarter, 80 in the second half
    first = sum(1 for r in noisy if r.at_s < start + 5)
    second_half = sum(1 for r in noisy if r.at_s >= start + 10)
    assert first < second_half / 2, (first, second_half)
    assert {len(r.hash_ids) for r in quiet} == {25} and {len(r.hash_ids) for r in noisy} == {1024}
    assert {r.max_tokens for r in quiet} == {16} and {r.max_tokens for r in noisy} == {64}
    # a shared prefix per tenant (per document for the noisy one), the rest its own
    assert len({r.hash_ids[:12] for r in quiet}) == 1
    assert len({r.hash_ids[12] for r in quiet}) == len(quiet)
    assert 1 < len({r.hash_ids[:512] for r in noisy}) <= 4
    assert not set(quiet[0].hash_ids) & set(noisy[0].hash_ids)


def test_the_quiet_arrivals_do_not_depend_on_the_noisy_tenant() -> None:
    a = [r.at_s for r in build_schedule(workload()) if r.tenant == QUIET]
    b = [r.at_s for r in build_schedule(workload(noisy_peak_rps=2.0)) if r.tenant == QUIET]
    assert a == b
    assert a != [r.at_s for r in build_schedule(workload(seed=8)) if r.tenant == QUIET]


def test_a_phase_row_counts_what_was_sent_and_what_finished_in_it() -> None:
    w = workload(phase_s=10.0)
    schedule = [ReplayRequest(i, i, 11.0 + i, QUIET, 0, tuple(range(25)), 16) for i in range(3)]
    outcomes: list[Outcome | None] = [
        Outcome(sent_at=11.0, first_token_at=11.05, done_at=11.1, ok=True, prompt_tokens=200,
                cached_tokens=96, completion_tokens=16),
        Outcome(sent_at=12.0, done_at=12.0, error="HTTP 429"),
        Outcome(sent_at=13.0, done_at=40.0, error="unfinished 30 s after the last send"),
    ]  # fmt: skip
    rs = records(schedule, outcomes, 8)
    assert [r.demand for r in rs] == [200 + 32] * 3
    row = phase_summary(rs, w, "noisy", 10.0)
    assert row["quiet_requests"] == 3 and row["noisy_requests"] == 0
    assert row["quiet_rejected"] == 1 and row["quiet_unfinished"] == 1
    assert row["quiet_ttft_p50_ms"] == row["quiet_ttft_p99_ms"] == pytest.approx(50.0)
    assert row["cached_token_ratio"] == pytest.approx(0.48)
    assert row["total_rps"] == pytest.approx(0.1) and row["noisy_rps"] == 0.0
    assert row["service_per_s"] == pytest.approx((200 + 32) / 10)
    assert row["errors"] == {"HTTP 429": 1, "unfinished 30 s after the last send": 1}
    # nothing of it in the phases before and after
    assert phase_summary(rs, w, "alone", 10.0)["quiet_requests"] == 0
    assert phase_summary(rs, w, "after", 10.0)["total_rps"] == 0.0


def test_targets_compare_the_governed_arm_with_the_ungoverned_one() -> None:
    def row(
        router: str, phase: str, p99: float, diff: float, service: float = 1000.0
    ) -> dict[str, object]:
        return {"router": router, "gateways": 1, "phase": phase, "quiet_ttft_p99_ms": p99,
                "quiet_rejected": 0, "service_difference": diff, "cached_token_ratio": 0.4,
                "service_per_s": service}  # fmt: skip

    rows = [
        row("saltgate", "alone", 100, 0),
        row("saltgate", "noisy", 110, 10),
        row("saltgate", "after", 100, 0),
        row("saltgate-ungoverned", "noisy", 5000, 100),
    ]
    lines = check_targets(rows)
    assert all(line.startswith("PASS") for line in lines), lines
    rows[1] = row("saltgate", "noisy", 130, 30)
    lines = check_targets(rows)
    assert sum(line.startswith("MISS") for line in lines) == 2, lines


def test_the_throughput_target_misses_only_capacity_lost_to_fairness() -> None:
    """Fairness must not waste capacity: 5 % less service than the ungoverned arm misses,
    20 % more (replicas with short queues finishing more in the phase) does not."""

    def throughput_line(governed_service: float) -> str:
        rows = [
            {"router": router, "gateways": 1, "phase": phase, "quiet_ttft_p99_ms": 100.0,
             "quiet_rejected": 0, "service_difference": 0.0, "cached_token_ratio": 0.4,
             "service_per_s": governed_service if router == "saltgate" else 1000.0}
            for router, phase in [("saltgate", "alone"), ("saltgate", "noisy"),
                                  ("saltgate-ungoverned", "noisy")]
        ]  # fmt: skip
        return next(line for line in check_targets(rows) if "throughput" in line)

    assert throughput_line(1200.0).startswith("PASS"), throughput_line(1200.0)
    assert "+20%" in throughput_line(1200.0)
    assert throughput_line(950.0).startswith("PASS")
    assert throughput_line(940.0).startswith("MISS"), throughput_line(940.0)


def options(**changes: object) -> fairness.FairnessOptions:
    """The options as the command parses them with no flags, then `changes`."""
    parser = argparse.ArgumentParser()
    fairness.add_arguments(parser)
    args = parser.parse_args([])
    vars(args).update(changes)
    return fairness._options(args)


def test_only_the_governed_arm_gets_the_fair_queue_and_limits() -> None:
    o = options()
    # 2 replicas at 400 ms per 1k tokens: 5,000 prompt tokens/s, a share of 2,500; the
    # noisy tenant's peak is 10 shares of 8,192-token prompts
    assert o.workload.noisy_peak_rps == pytest.approx(25_000 / 8192)
    governed = fairness.replay_options(o, "saltgate")
    assert "[queue]\nenabled = true" in governed.gateway_sections
    assert governed.tenant_limits is not None and governed.tenant_limits.input_tpm == 300_000
    assert "max_prefill_tokens" not in governed.gateway_sections, "derived, as it ships"
    ungoverned = fairness.replay_options(o, "saltgate-ungoverned")
    assert "[queue]\nenabled = false" in ungoverned.gateway_sections, "on by default"
    for router in ("saltgate-ungoverned", "smg", "vllm-router"):
        other = fairness.replay_options(o, router)
        assert "enabled = true" not in other.gateway_sections and other.tenant_limits is None
    assert fairness.replay_options(o, "smg").peer_args == ("--max-concurrent-requests", "4")
    assert options(tenant_input_tpm=0).tenant_limits is None


def test_the_quiet_tenant_must_stay_within_its_share() -> None:
    with pytest.raises(BenchError, match="within its share"):
        options(quiet_rps=20.0)


def test_the_governed_arms_limits_reach_every_tenant_in_the_store(tmp_path: Path) -> None:
    limits = Limits(input_tpm=300_000)
    state = prepare_gateway_state(tmp_path / "state", ["tenant-0", "tenant-1"], limits=limits)
    with TenantStore.from_state_dir(state.state_dir) as db:
        assert [t.limits for t in db.list_tenants()] == [limits, limits]
    plain = prepare_gateway_state(tmp_path / "plain", ["tenant-0"])
    with TenantStore.from_state_dir(plain.state_dir) as db:
        assert [t.limits for t in db.list_tenants()] == [None]
