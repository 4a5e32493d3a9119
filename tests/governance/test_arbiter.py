"""The host's one count of limits (governance/arbiter.py): the supervisor's answers to its
workers' lines, decided by the same Governor a single process uses (docs/limits.md,
"Workers")."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saltgate.governance.arbiter import (
    ZERO,
    Answer,
    Arbiter,
    ArbiterError,
    admit_line,
    answer_id,
    read_admission,
    seed_line,
    settle_line,
)
from saltgate.governance.kinds import LimitKind, Scope, Subject
from saltgate.governance.limits import (
    Demand,
    Denial,
    Governor,
    Limits,
    enforced_note,
    enforcement,
)

pytestmark = pytest.mark.unit

TENANT = Subject(Scope.TENANT, "tn_arbiter000001")
KEY = Subject(Scope.KEY, "key_arbiter00001")
ONE = Demand(10, 5, 0)


def ask(
    arbiter: Arbiter,
    channel: int,
    ident: int,
    limited: list[tuple[Subject, Limits]],
    demand: Demand,
    *,
    now: float,
) -> Answer:
    """The answer to one admission, read as the worker reads it."""
    line = arbiter.answer(channel, admit_line(ident, limited, demand), now)
    assert line is not None
    got, answer = answer_id(line)
    assert got == ident
    return read_admission(answer, now)


def test_two_workers_share_one_count_and_the_denial_reads_back_exactly() -> None:
    """rpm 3 asked from two channels in turn: 3 admitted in all, the 4th refused with
    the limit, the use and the exact retry time of the Governor."""
    arbiter = Arbiter()
    limited = [(TENANT, Limits(rpm=3))]
    answers = [ask(arbiter, 1 + i % 2, i, limited, ONE, now=100.0 + i) for i in range(4)]
    assert [a.admitted for a in answers] == [True, True, True, False]
    denial = answers[3].denial
    assert denial is not None
    assert (denial.kind, denial.scope, denial.limit, denial.used, denial.requested) == (
        LimitKind.REQUESTS,
        "tenant",
        3,
        3,
        1,
    )
    assert denial.retry_at == pytest.approx(160.0)  # the first admission leaves the window
    assert denial.retry_after_s == pytest.approx(57.0)
    quota = answers[2].quotas[0]
    assert (quota.kind, quota.limit, quota.remaining) == (LimitKind.REQUESTS, 3, 0)
    assert (arbiter.holding(1), arbiter.holding(2)) == (2, 1)


def test_share_splits_between_hosts_not_workers() -> None:
    """[limits] share = 2 (two hosts, no [cluster]): this host holds floor(5 / 2) = 2 for
    all its workers together."""
    arbiter = Arbiter(share=2)
    limited = [(TENANT, Limits(rpm=5))]
    admitted = [ask(arbiter, 1 + i % 3, i, limited, ONE, now=1.0).admitted for i in range(5)]
    assert admitted == [True, True, False, False, False]


def test_settling_frees_the_lease_and_a_late_cancel_gives_it_back() -> None:
    arbiter = Arbiter()
    limited = [(TENANT, Limits(concurrency=1))]
    assert ask(arbiter, 1, 1, limited, ONE, now=1.0).admitted
    refused = ask(arbiter, 2, 1, limited, ONE, now=1.0)  # ids are per worker
    assert refused.denial is not None and refused.denial.kind == LimitKind.CONCURRENCY
    assert arbiter.answer(1, settle_line(1, Demand(3, 2, 0)), 2.0) is None
    assert ask(arbiter, 2, 2, limited, ONE, now=2.0).admitted
    # The worker gave up waiting for this answer: its ZERO settlement frees the lease.
    assert arbiter.answer(2, settle_line(2, ZERO), 2.5) is None
    assert arbiter.answer(2, settle_line(99, ZERO), 2.5) is None  # unknown: nothing
    assert ask(arbiter, 1, 2, limited, ONE, now=3.0).admitted


def test_a_worker_gone_gives_back_its_leases_and_keeps_its_reservations() -> None:
    arbiter = Arbiter()
    limited = [(TENANT, Limits(rpm=2, concurrency=1))]
    assert ask(arbiter, 1, 1, limited, ONE, now=1.0).admitted
    assert ask(arbiter, 2, 1, limited, ONE, now=1.0).denial.kind == LimitKind.CONCURRENCY  # type: ignore[union-attr]
    assert arbiter.forget(1, 2.0) == 1
    assert arbiter.holding(1) == 0
    again = ask(arbiter, 2, 2, limited, ONE, now=3.0)
    assert again.admitted  # the lease came back
    assert again.quotas[0].remaining == 0  # the window kept both requests


def test_a_budget_starts_from_the_ledger_once_per_period() -> None:
    """The first worker to see a budget starts it from the ledger's spend (this host's
    share of it, rounded up); the next finds it started; a new period starts it again."""
    arbiter = Arbiter(share=2)
    limits = Limits(budget_micro_usd=20, budget_period_s=3600)
    spent = [(4000.0, 1000), (20.0, 7), (10.0, 5)]  # (age s, micro-USD); the first is too old

    def seed(ident: int, limits: Limits, now: float) -> bool:
        line = arbiter.answer(1, seed_line(ident, TENANT, limits, spent), now)
        assert line is not None
        return bool(answer_id(line)[1][1])

    assert seed(1, limits, 5000.0) is True
    assert seed(2, limits, 5000.0) is False
    # This host holds 10 of 20; it started at ceil(7 / 2) + ceil(5 / 2) = 7: one admission
    # (reserving 4) leaves 11 >= 10.
    limited = [(TENANT, limits)]
    assert ask(arbiter, 1, 3, limited, Demand(1, 1, 4), now=5000.0).admitted
    refused = ask(arbiter, 1, 4, limited, Demand(1, 1, 4), now=5000.0)
    assert refused.denial is not None and (refused.denial.kind, refused.denial.used) == (
        LimitKind.BUDGET,
        11,
    )
    assert seed(5, Limits(budget_micro_usd=20, budget_period_s=7200), 5000.0) is True


def test_the_arbiter_decides_as_one_governor_would() -> None:
    """The same random demand, asked through the arbiter from three workers and of one
    Governor alone: every decision alike (the arbiter adds no limiter of its own)."""
    rng = random.Random(7)
    limits = Limits(rpm=20, input_tpm=900, output_tpm=400, concurrency=4)
    key_limits = Limits(rpm=12)
    arbiter, governor = Arbiter(), Governor()
    governor.set_limits(TENANT, limits)
    governor.set_limits(KEY, key_limits)
    open_tickets: list[tuple[int, int, object]] = []
    now = 0.0
    for ident in range(1, 2000):
        now += rng.expovariate(1.0)
        if open_tickets and rng.random() < 0.5:
            channel, held, ticket = open_tickets.pop(rng.randrange(len(open_tickets)))
            used = Demand(rng.randrange(50), rng.randrange(30))
            arbiter.answer(channel, settle_line(held, used), now)
            governor.settle(ticket, used, now)  # type: ignore[arg-type]
            continue
        demand = Demand(rng.randrange(1, 120), rng.randrange(1, 60))
        channel = rng.randrange(3)
        answer = ask(
            arbiter, channel, ident, [(TENANT, limits), (KEY, key_limits)], demand, now=now
        )
        decision = governor.admit([TENANT, KEY], demand, now)
        assert answer.admitted == decision.admitted, ident
        assert _fields(answer.denial) == _fields(decision.denial), ident
        assert answer.quotas == decision.quotas
        if decision.ticket is not None:
            open_tickets.append((channel, ident, decision.ticket))


def _fields(denial: Denial | None) -> tuple[object, ...] | None:
    """A denial as the worker reads it: its retry time rebuilt from the wait, to 1 us."""
    if denial is None:
        return None
    retry = None if denial.retry_at is None else round(denial.retry_at, 6)
    return (denial.kind, denial.scope, denial.limit, denial.used, denial.requested, retry)


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"not json",
        b"{}",
        b"[]",
        b'["a"]',
        b'["a", "1", [], [1, 2, 3]]',
        b'["a", 1, [["admin", "x", 1, null, null, null, null, null]], [1, 2, 3]]',
        b'["a", 1, [["tenant", 5, 1, null, null, null, null, null]], [1, 2, 3]]',
        b'["a", 1, [["tenant", "t", "1", null, null, null, null, null]], [1, 2, 3]]',
        b'["a", 1, [["tenant", "t", -1, null, null, null, null, null]], [1, 2, 3]]',
        b'["a", 1, [["tenant", "t", null, null, null, null, 5, null]], [1, 2, 3]]',
        b'["a", 1, [], [1, -2, 3]]',
        b'["a", 1, [], [1, 2]]',
        b'["a", 1, [[], [], []], [1, 2, 3]]',
        b'["s", 1, [1, 2, 3.5]]',
        b'["b", 1, ["tenant", "t", null, null, null, null, 5, 60], [[-1, 2]]]',
        b'["x", 1, 2, 3]',
    ],
)
def test_a_line_it_cannot_read_is_an_arbiter_error(line: bytes) -> None:
    with pytest.raises(ArbiterError):
        Arbiter().answer(1, line, 1.0)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=9),
        max_leaves=30,
    )
)
def test_any_json_from_a_worker_is_answered_or_refused_as_data(message: object) -> None:
    """Whatever a worker (which faces the network) writes, the supervisor answers it or
    raises ArbiterError; nothing else escapes."""
    with contextlib.suppress(ArbiterError):
        Arbiter().answer(1, json.dumps(message).encode(), 1.0)


def test_the_operator_is_told_how_limits_are_held() -> None:
    one_host = enforcement(workers=2, gateways=1, cluster=False)
    assert one_host.startswith("limits exact on this host; its 2 workers count in one place")
    assert "floor(L / 2) on its own counts meanwhile" in one_host
    assert enforcement(workers=1, gateways=1, cluster=False) == "limits exact on this host"
    hosts = enforcement(workers=2, gateways=3, cluster=False)
    assert "not exact between gateways" in hosts and "floor(L / 3)" in hosts
    assert "floor(L / 6) on its own counts" in hosts
    fleet = enforcement(workers=2, gateways=4, cluster=True)
    assert fleet.startswith("limits exact for the fleet") and "floor(L / 8)" in fleet


def test_set_limits_says_what_each_gateway_enforces() -> None:
    exact = enforced_note(Limits(rpm=1), gateways=1, cluster=False)
    assert exact.startswith("enforced: exactly, for each host")
    split = enforced_note(Limits(rpm=1, input_tpm=9), gateways=2, cluster=False)
    assert "each of the 2 gateways ([limits] share) enforces rpm=0 input_tpm=4" in split
    assert "rpm = 0 admits nothing there" in split
    assert enforced_note(Limits(rpm=1), gateways=2, cluster=True).startswith(
        "enforced: exactly, for the fleet"
    )
    assert enforced_note(None, gateways=2, cluster=False) == "enforced: nothing limited"
