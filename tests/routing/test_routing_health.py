"""Breaker, probe and overload state machines, and the /metrics parser."""

from __future__ import annotations

import pytest

from saltgate.routing import (
    RUNNING_METRIC,
    Breaker,
    BreakerState,
    Overload,
    parse_gauge,
    parse_largest_step,
    parse_waiting,
)
from saltgate.routing.health import Probe, ReplicaHealth
from saltgate.sim.server import SimConfig, SimServer

pytestmark = pytest.mark.unit


def state(b: Breaker) -> BreakerState:
    """Read through a call, so the type checker does not pin the state between events."""
    return b.state


def test_breaker_opens_after_consecutive_failures_and_closes_after_a_good_trial() -> None:
    b = Breaker(failure_threshold=3, open_s=10.0)
    b.failed(0.0)
    b.failed(0.1)
    b.succeeded()  # a success in between resets the count
    b.failed(0.2)
    b.failed(0.3)
    assert state(b) is BreakerState.CLOSED and b.allows(0.3)
    b.failed(0.4)
    assert state(b) is BreakerState.OPEN
    assert not b.allows(5.0)
    assert b.allows(10.4)  # cool-down over: one trial may go
    b.started(10.4)
    assert state(b) is BreakerState.HALF_OPEN
    assert not b.allows(10.5)  # only one trial at a time
    b.succeeded()
    assert state(b) is BreakerState.CLOSED and b.allows(10.5)


def test_a_failed_trial_reopens_and_an_unreported_trial_expires() -> None:
    b = Breaker(failure_threshold=1, open_s=10.0)
    b.failed(0.0)
    b.started(10.0)
    b.failed(10.1)
    assert state(b) is BreakerState.OPEN and not b.allows(15.0) and b.allows(20.1)
    b.started(20.1)  # this trial's client goes away: nobody reports
    assert not b.allows(25.0)
    assert b.allows(30.1)


def test_a_good_probe_lets_an_open_breaker_try_at_once() -> None:
    health = ReplicaHealth(Breaker(1, 60.0), Probe(2), Overload(8, 2))
    health.breaker.failed(0.0)
    assert not health.available(1.0)
    health.probed(False)
    health.probed(False)
    assert not health.probe.up
    health.probed(True)
    assert health.probe.up and state(health.breaker) is BreakerState.HALF_OPEN
    assert health.available(1.0)


def test_probes_take_a_replica_out_after_consecutive_failures() -> None:
    p = Probe(failure_threshold=2)
    p.observed(False)
    assert p.up
    p.observed(False)
    assert not p.up
    p.observed(True)
    assert p.up


def test_overload_has_hysteresis() -> None:
    o = Overload(enter_waiting=8, exit_waiting=2)
    seen = []
    for waiting in (0, 7, 8, 5, 3, 2, 5, 7, 9, None):
        o.observed(waiting)
        seen.append(o.overloaded)
    assert seen == [False, False, True, True, True, False, False, False, True, False]


def test_waiting_is_read_from_vllm_metrics() -> None:
    page = SimServer(SimConfig()).metrics()  # the simulator names its metrics as vLLM does
    assert parse_waiting(page) == 0.0
    two_engines = (
        b"# TYPE vllm:num_requests_waiting gauge\n"
        b'vllm:num_requests_waiting{engine="0",model_name="m{x}"} 3.0\n'
        b'vllm:num_requests_waiting{engine="1",model_name="m"} 4 1700000000\n'
        b"vllm:num_requests_waiting_by_reason 99\n"
        b'vllm:num_requests_running{engine="0"} 50\n'
    )
    assert parse_waiting(two_engines) == 7.0
    assert parse_waiting(b"up 1\n") is None
    assert parse_waiting(b"vllm:num_requests_waiting NaN\n") is None
    assert parse_gauge(two_engines, RUNNING_METRIC) == 50.0  # what the saturation gate reads
    assert parse_gauge(page, RUNNING_METRIC) == 0.0


def test_the_largest_engine_step_is_read_from_vllm_metrics() -> None:
    """vLLM's vllm:iteration_tokens_total histogram (buckets of tokens per engine step):
    the smallest bound holding every step, summed over engines; the largest finite bound
    when a step went past it; None without the histogram or before any step. The
    simulator writes it as vLLM does."""
    sim = SimServer(SimConfig())
    assert parse_largest_step(sim.metrics()) is None, "no step yet"
    sim.engine.metrics.step(200)
    sim.engine.metrics.step(2048)
    assert parse_largest_step(sim.metrics()) == 2048
    sim.engine.metrics.step(2049)
    assert parse_largest_step(sim.metrics()) == 4096

    def page(*engines: tuple[int, ...]) -> bytes:
        bounds = ["1.0", "256.0", "2048.0", "8192.0", "+Inf"]
        return (
            b"".join(
                f'vllm:iteration_tokens_total_bucket{{engine="{e}",le="{le}",model_name="m"}} '
                f"{float(n)}\n".encode()
                for e, counts in enumerate(engines)
                for le, n in zip(bounds, counts, strict=True)
            )
            + b"vllm:iteration_tokens_total_count 7.0\nvllm:iteration_tokens_total_sum 9e3\n"
        )

    assert parse_largest_step(page((0, 3, 5, 5, 5))) == 2048
    assert parse_largest_step(page((0, 3, 5, 5, 5), (0, 0, 1, 2, 2))) == 8192, "two engines"
    assert parse_largest_step(page((0, 3, 5, 5, 6))) == 8192, "past the last bound"
    assert parse_largest_step(page((0, 0, 0, 0, 0))) is None
    assert parse_largest_step(b"up 1\n") is None
    assert parse_largest_step(b'vllm:iteration_tokens_total_bucket{le="x"} 1\n') is None
