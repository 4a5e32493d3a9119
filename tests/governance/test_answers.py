"""Governance's answers and the gate's placement, without sockets: the 429s, the rate-limit
headers, the queue's 503 / 529, a request's reservation, and which replicas may take a
waiting request (tests/gateway/test_limits.py and test_fairshare.py check the same through
a running gateway)."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from saltgate.derivations.derive import ROUTE_CHAT
from saltgate.governance.answers import (
    denial_error,
    go_duration,
    overloaded,
    rate_headers,
    reservation,
    rfc3339,
)
from saltgate.governance.fairness import SaturationGate
from saltgate.governance.kinds import LimitKind, Scope
from saltgate.governance.limits import DEFAULT_OUTPUT_ALLOWANCE, Demand, Denial, Quota
from saltgate.governance.placement import placeable
from saltgate.prices import PriceVersion
from saltgate.routing import Plan, ReplicaId, Router, RouterConfig
from saltgate.routing.rendezvous import Member

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("seconds", "written"),
    [
        (0.0, "0ms"),
        (0.1204, "121ms"),  # rounded up: waiting that long is always enough
        (1.5, "1.5s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (3725.25, "1h2m5.25s"),
    ],
)
def test_go_duration_writes_openai_resets(seconds: float, written: str) -> None:
    assert go_duration(seconds) == written


@given(st.floats(min_value=0, max_value=4_102_444_800))  # up to 2100
def test_rfc3339_matches_the_datetime_library(wall: float) -> None:
    expected = datetime.fromtimestamp(wall, UTC).isoformat(timespec="seconds")
    assert rfc3339(wall) == expected.replace("+00:00", "Z")


QUOTAS = (
    Quota(LimitKind.REQUESTS, 10, 9, 6.0),
    Quota(LimitKind.INPUT_TOKENS, 1000, 500, 60.0),
    Quota(LimitKind.OUTPUT_TOKENS, 1000, 100, 1.5),
)


def test_openai_headers_give_requests_and_the_tighter_token_limit() -> None:
    assert dict(rate_headers(QUOTAS, anthropic=False, wall=0.0)) == {
        b"x-ratelimit-limit-requests": b"10",
        b"x-ratelimit-remaining-requests": b"9",
        b"x-ratelimit-reset-requests": b"6s",
        b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-tokens": b"100",  # output's: fewer left than input's
        b"x-ratelimit-reset-tokens": b"1.5s",
    }


def test_anthropic_headers_give_each_kind_with_a_wall_clock_reset() -> None:
    headers = dict(rate_headers(QUOTAS, anthropic=True, wall=1_800_000_000.0))
    assert headers[b"anthropic-ratelimit-requests-reset"] == b"2027-01-15T08:00:06Z"
    assert headers[b"anthropic-ratelimit-input-tokens-remaining"] == b"500"
    assert headers[b"anthropic-ratelimit-output-tokens-limit"] == b"1000"
    assert len(headers) == 9


def _denial(kind: LimitKind, retry_at: float | None, *, limit: int = 10) -> Denial:
    return Denial(kind, Scope.KEY, limit, 10, 1, retry_at, 100.0)


def test_a_rate_limit_is_retried_after_it_frees() -> None:
    error = denial_error(_denial(LimitKind.OUTPUT_TOKENS, 102.5), "m", False, [])
    assert (error.status, error.type, error.code) == (429, "tokens", "rate_limit_exceeded")
    assert "output tokens per min (TPM) of this API key" in error.message
    assert dict(error.headers) == {b"retry-after": b"3", b"retry-after-ms": b"2500"}


def test_a_concurrency_denial_says_retry_within_a_second() -> None:
    error = denial_error(_denial(LimitKind.CONCURRENCY, 700.0), "m", False, [])
    assert error.type == "requests"
    assert dict(error.headers)[b"retry-after-ms"] == b"1000"


def test_a_spent_budget_stops_the_sdks_retrying() -> None:
    error = denial_error(_denial(LimitKind.BUDGET, 200.0), "m", False, [(b"a", b"b")])
    assert (error.type, error.code) == ("insufficient_quota", "insufficient_quota")
    assert error.headers == ((b"a", b"b"), (b"x-should-retry", b"false"))
    anthropic = denial_error(_denial(LimitKind.BUDGET, None), "m", True, [])
    assert orjson.loads(anthropic.body())["error"]["type"] == "rate_limit_error"


def test_waiting_cannot_help_a_request_too_large_or_a_limit_of_zero() -> None:
    large = denial_error(_denial(LimitKind.INPUT_TOKENS, None), "m", False, [])
    assert large.message.startswith("Request too large for m")
    zero = denial_error(_denial(LimitKind.REQUESTS, None, limit=0), "", False, [])
    assert "Limit 0" in zero.message and "admits nothing" in zero.message
    for error in (large, zero):
        assert dict(error.headers) == {b"x-should-retry": b"false"}


def test_overloaded_is_503_on_openai_routes_and_529_on_anthropic_ones() -> None:
    openai = overloaded(anthropic=False, retry_after_s=0.2)
    assert (openai.status, openai.code, dict(openai.headers)) == (
        503,
        "overloaded",
        {b"retry-after": b"1"},
    )
    anthropic = overloaded(anthropic=True, retry_after_s=30.0)
    assert anthropic.status == 529
    assert orjson.loads(anthropic.body())["error"]["type"] == "overloaded_error"


def test_a_reservation_is_the_prompt_estimate_and_the_output_allowance_priced() -> None:
    price = PriceVersion("v1", "m", input=2_000_000, cached_input=1_000_000, output=4_000_000)
    demand = reservation(price, ROUTE_CHAT, 399, None)
    assert demand.input_tokens == 100 and demand.output_tokens == DEFAULT_OUTPUT_ALLOWANCE
    assert demand.cost_micro_usd == price.cost_micro_usd(100, None, DEFAULT_OUTPUT_ALLOWANCE)
    assert reservation(None, "/v1/embeddings", 399, 50) == Demand(100, 0, 0)


# -- which replicas may take a waiting request ---------------------------------------------
A, B = ReplicaId("a"), ReplicaId("b")


def _router() -> Router:
    return Router(RouterConfig(), b"k" * 32, [Member(A), Member(B)])


def test_placeable_keeps_the_replicas_below_the_gate_in_order() -> None:
    router = _router()
    gate = SaturationGate(max_waiting=0)
    gate.probed(A, inflight=1, waiting=1, running=1)  # a runs one: a second would wait
    plan = Plan(None, prompt_bytes=400)
    usable = router.usable(None, 0.0)
    assert [s.id for s in placeable(gate, usable, plan)] == [A, B], "nothing in flight"
    router.started(A, 0.0, 0.0, 0.0)
    assert [s.id for s in placeable(gate, usable, plan)] == [B]
    router.started(B, 0.0, 0.0, 0.0)
    assert [s.id for s in placeable(gate, usable, plan)] == [B], "b's capacity unknown"
    gate.probed(B, inflight=1, waiting=1, running=1)
    assert placeable(gate, usable, plan) == [], "every replica full: the request waits"


def test_placeable_holds_a_long_prompt_behind_a_replica_s_prefill_backlog() -> None:
    router = _router()
    gate = SaturationGate(max_waiting=10, max_prefill_tokens=1000)
    router.started(A, 0.0, 3600.0, 3600.0)  # 900 tokens of a's not yet prefilled
    usable = router.usable(None, 0.0)
    long = Plan(None, prompt_bytes=800)  # 200 tokens: 1100 on a
    short = Plan(None, prompt_bytes=200)  # 50 tokens: within 1/16 of the budget
    assert [s.id for s in placeable(gate, usable, long)] == [B]
    assert [s.id for s in placeable(gate, usable, short)] == [A, B]


def test_placeable_counts_the_other_gateways_load_on_a_replica() -> None:
    """With [cluster], a replica's load is every gateway's: what the bus says the others
    have in flight, and not yet prefilled, there holds it back as this gateway's own would."""
    router = _router()
    gate = SaturationGate(max_waiting=0, max_prefill_tokens=1000)
    gate.probed(A, inflight=1, waiting=1, running=1)  # a runs one: a second would wait
    long = Plan(None, prompt_bytes=800)  # 200 tokens
    assert [s.id for s in placeable(gate, router.usable(None, 0.0), long)] == [A, B]
    router.set_remote_load({A: (1, 0.0)})  # the one a runs is another gateway's
    assert [s.id for s in placeable(gate, router.usable(None, 0.0), long)] == [B]
    router.set_remote_load({B: (0, 3600.0)})  # 900 tokens of the others' prefill on b
    assert [s.id for s in placeable(gate, router.usable(None, 0.0), long)] == [A]
