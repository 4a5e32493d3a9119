"""The fair queue and the saturation gate against their promises, without sockets or clock.

The property tests replay random arrivals, releases, removals and corrections against an
independent model of VTC (its own counters and lift) and check: every release goes to a
backlogged tenant with the smallest counter of the highest waiting band; a tenant's
requests leave in arrival order (locality aside); a returning tenant banks no credit;
a locality turn stays within its quantum; removed and expired requests never leave.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saltgate.governance.fairness import (
    FALLBACK_STEP_TOKENS,
    MIN_STEP_TOKENS,
    SHORT_STEPS,
    FairQueue,
    SaturationGate,
    Waiter,
    service,
    step_tokens,
)
from saltgate.governance.kinds import Band
from saltgate.routing import ReplicaId

pytestmark = pytest.mark.unit

TENANTS = ("a", "b", "c")
R = ReplicaId("r")
OTHER = ReplicaId("other")
FAR = 1e9  # a deadline nothing reaches


def test_service_counts_output_twice() -> None:
    assert service(100, 10) == 120.0


@dataclass
class Model:
    """VTC as the paper states it, kept apart from the implementation."""

    weights: dict[str, float]
    counters: dict[str, float] = field(default_factory=dict)
    backlog: dict[tuple[str, str], list[Waiter[int]]] = field(default_factory=dict)
    last_served: dict[str, float] = field(default_factory=dict)  # per band

    def arrive(self, w: Waiter[int]) -> None:
        queue = self.backlog.setdefault((w.band, w.tenant), [])
        if not any(q for (_, t), q in self.backlog.items() if t == w.tenant):  # from idle
            live = [self.counters[t] for (b, t), q in self.backlog.items() if q and b == w.band]
            start = min(live) if live else self.last_served.get(w.band, 0.0)
            self.counters[w.tenant] = max(self.counters.get(w.tenant, 0.0), start)
        queue.append(w)

    def leave(self, w: Waiter[int]) -> None:
        self.backlog[(w.band, w.tenant)].remove(w)

    def top_band(self) -> str | None:
        for band in (Band.INTERACTIVE, Band.BATCH):
            if any(q for (b, _), q in self.backlog.items() if b == band):
                return band
        return None

    def minimum(self, band: str) -> float:
        return min(self.counters[t] for (b, t), q in self.backlog.items() if q and b == band)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.sampled_from(TENANTS),
            st.integers(1, 50),
            st.sampled_from((Band.INTERACTIVE, Band.BATCH)),
        ),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 200)),
        st.tuples(st.just("correct"), st.integers(0, 200), st.integers(0, 80)),
    ),
    max_size=120,
)


def test_a_tenant_in_both_bands_keeps_one_counter_and_its_place() -> None:
    """A tenant joining the batch band while it waits in the interactive one is not
    returning from idle: lifting it there moved the counter its interactive place was
    filed under, and the next release found no one to release (an IndexError)."""
    q: FairQueue[str] = FairQueue(quantum_tokens=0)
    q.push("a1", "a", 1, deadline=FAR)
    q.push("a2", "a", 1, deadline=FAR, band=Band.BATCH)
    assert (w := q.pop()) is not None and w.item == "a1"
    q.push("b1", "b", 1, deadline=FAR)
    q.push("b2", "b", 1, deadline=FAR, band=Band.BATCH)  # a waits in batch, at counter 1
    assert q.counters["b"] == 0.0  # from idle to the last served in its band (a, at 0)
    assert [w.item for w in iter(q.pop, None)] == ["b1", "a2", "b2"]


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from(({}, {"a": 2.0}, {"b": 0.5, "c": 3.0})))
def test_releases_follow_vtc(script: list[tuple[Any, ...]], weights: dict[str, float]) -> None:
    """No locality here (quantum aside): every release is the smallest counter of the
    highest band, each tenant's requests in arrival order, and nothing leaves twice."""
    q: FairQueue[int] = FairQueue(quantum_tokens=0)
    model = Model(weights)
    pushed: list[Waiter[int]] = []
    released: list[Waiter[int]] = []
    for op in script:
        if op[0] == "push":
            _, tenant, cost, band = op
            weight = weights.get(tenant, 1.0)
            w = q.push(len(pushed), tenant, cost, deadline=FAR, band=band, weight=weight)
            model.arrive(w)
            pushed.append(w)
        elif op[0] == "pop":
            band = model.top_band()
            peeked = q.peek()
            out = q.pop()
            assert (out is None) == (band is None)
            if out is None or band is None:
                continue
            assert peeked is out
            w = out
            assert w.band == band
            assert model.counters[w.tenant] == pytest.approx(model.minimum(band))
            assert model.backlog[(band, w.tenant)][0] is w, "a tenant's requests in order"
            model.last_served[band] = model.counters[w.tenant]
            model.counters[w.tenant] += w.cost / weights.get(w.tenant, 1.0)
            model.leave(w)
            released.append(w)
        elif op[0] == "remove" and pushed:
            w = pushed[op[1] % len(pushed)]
            was = w.waiting
            assert q.remove(w) is was
            if was:
                model.leave(w)
        elif op[0] == "correct" and released:
            w = released[op[1] % len(released)]
            q.correct(w.tenant, w.cost, op[2])
            model.counters[w.tenant] += (op[2] - w.cost) / weights.get(w.tenant, 1.0)
        assert len(q) == sum(len(v) for v in model.backlog.values())
        for tenant, counter in model.counters.items():
            assert q.counters[tenant] == pytest.approx(counter)
    assert len({id(w) for w in released}) == len(released)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(TENANTS), min_size=1, max_size=60), st.integers(1, 20))
def test_backlogged_tenants_stay_within_one_request_of_each_other(
    arrivals: list[str], cost: int
) -> None:
    """VTC's bound: among tenants backlogged throughout, service never differs by more
    than one request's."""
    q: FairQueue[None] = FairQueue(quantum_tokens=0)
    for tenant in TENANTS:
        for _ in range(100):
            q.push(None, tenant, cost, deadline=FAR)
    served = dict.fromkeys(TENANTS, 0)
    for _ in range(150):
        w = q.pop()
        assert w is not None
        served[w.tenant] += cost
        assert max(served.values()) - min(served.values()) <= cost


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    """b sends nothing while a is served 50 times; then both are backlogged: b gets its
    turn at once but no run of releases to make up for its idle time."""
    q: FairQueue[None] = FairQueue(quantum_tokens=0)
    for _ in range(50):
        q.push(None, "a", 10, deadline=FAR)
        assert q.pop() is not None
    for _ in range(20):
        q.push(None, "a", 10, deadline=FAR)
        q.push(None, "b", 10, deadline=FAR)
    order = [w.tenant for w in iter(q.pop, None)]
    assert order[:2] in (["a", "b"], ["b", "a"])
    # never two of b in a row: it was lifted to a's counter
    assert all(not (x == y == "b") for x, y in itertools.pairwise(order))


def test_a_tenant_of_weight_two_gets_twice_the_releases() -> None:
    """Both backlogged throughout with equal requests: the tenant of weight 2 is charged
    half per request, so it gets about two releases for every one of the other's."""
    q: FairQueue[None] = FairQueue(quantum_tokens=0)
    for _ in range(200):
        q.push(None, "heavy", 10, deadline=FAR, weight=2.0)
        q.push(None, "light", 10, deadline=FAR)
    released = [w.tenant for w in itertools.islice(iter(q.pop, None), 150)]
    heavy, light = released.count("heavy"), released.count("light")
    assert heavy + light == 150
    assert 1.9 <= heavy / light <= 2.1, (heavy, light)
    assert q.counters["heavy"] == pytest.approx(q.counters["light"], abs=10)


def test_without_weights_the_same_tenants_alternate() -> None:
    """The control: the same backlog with weight 1 each is released half and half."""
    q: FairQueue[None] = FairQueue(quantum_tokens=0)
    for _ in range(200):
        q.push(None, "heavy", 10, deadline=FAR)
        q.push(None, "light", 10, deadline=FAR)
    released = [w.tenant for w in itertools.islice(iter(q.pop, None), 150)]
    assert abs(released.count("heavy") - released.count("light")) <= 1


@pytest.mark.parametrize("weight", [5e-324, 1e-300, 1e308, 0.0, -1.0, math.nan, math.inf])
def test_any_weight_leaves_the_queue_working(weight: float) -> None:
    """Issue 41 finding 1: weight 5e-324 made a release's charge inf, the correction after
    it NaN, and the next pop an IndexError on an empty heap (every request 500 until a
    restart). Whatever weight a request brings, the counters stay finite and every
    waiter is released."""
    q: FairQueue[str] = FairQueue(quantum_tokens=0)
    q.push("x1", "x", 100, deadline=FAR, weight=weight)
    assert (w := q.pop()) is not None and w.item == "x1"
    q.correct("x", 100, 1)  # it used less than its estimate
    q.push("x2", "x", 100, deadline=FAR, weight=weight)
    q.push("y1", "y", 100, deadline=FAR)
    assert sorted(w.item for w in iter(q.pop, None)) == ["x2", "y1"]
    assert all(math.isfinite(c) for c in q.counters.values()), q.counters


def test_a_counter_gone_bad_does_not_stop_releases() -> None:
    """Whatever slips past: an amount that would make a counter inf is not applied, and
    a band whose heap lost every entry is rebuilt from the tenants waiting there."""
    q: FairQueue[str] = FairQueue(quantum_tokens=0)
    q.push("x1", "x", 1, deadline=FAR)
    q.push("y1", "y", 1, deadline=FAR)
    q.correct("x", 0, math.inf)
    assert q.counters["x"] == 0.0
    q.counters["x"] = math.nan  # as the old code left it
    assert sorted(w.item for w in iter(q.pop, None)) == ["x1", "y1"]


def test_service_elsewhere_puts_a_tenant_behind_a_quiet_one() -> None:
    """Gateway B's queue: noisy was served through another gateway (charge_elsewhere),
    quiet was not; quiet waits here, then noisy joins: all of quiet's requests go first.
    Without the service from elsewhere (the control) noisy joins at quiet's counter and
    they alternate. (Had noisy been alone here, quiet would join at noisy's counter
    whatever it was: VTC lifts a returning tenant to the smallest counter waiting.)"""
    for shared in (True, False):
        q: FairQueue[str] = FairQueue(quantum_tokens=0)
        if shared:
            q.charge_elsewhere("noisy", 5000.0)
        for i in range(3):
            q.push(f"q{i}", "quiet", 100, deadline=FAR)
        for i in range(3):
            q.push(f"n{i}", "noisy", 100, deadline=FAR)
        order = [w.item for w in iter(q.pop, None)]
        expected = (
            ["q0", "q1", "q2", "n0", "n1", "n2"] if shared else ["q0", "n0", "q1", "n1", "q2", "n2"]
        )
        assert order == expected, shared


def test_service_elsewhere_is_not_swallowed_by_the_lift() -> None:
    """A tenant not waiting here is lifted to this queue's level before the service from
    elsewhere is added, so it counts above the level a returning tenant starts at; a
    tenant waiting here is simply charged; a correction downward applies as is."""
    q: FairQueue[None] = FairQueue(quantum_tokens=0)
    for _ in range(10):
        q.push(None, "a", 100, deadline=FAR)
    for _ in range(5):
        assert q.pop() is not None  # a's counter: 500; the band's level: 400 .. 500
    q.charge_elsewhere("b", 50.0)  # b never waited here
    assert q.counters["b"] == pytest.approx(500.0 + 50.0)
    q.charge_elsewhere("a", 30.0)  # a waits here: charged as if served here
    assert q.counters["a"] == pytest.approx(530.0)
    q.charge_elsewhere("b", -20.0)  # a correction of what b was charged elsewhere
    assert q.counters["b"] == pytest.approx(530.0)
    q.charge_elsewhere("c", -5.0)  # nothing known of c: nothing to correct
    q.charge_elsewhere("c", math.nan)
    assert "c" not in q.counters
    q.push(None, "b", 100, deadline=FAR)  # b arrives: its counter stands (above a's min)
    assert q.counters["b"] == pytest.approx(530.0)


def test_an_idle_queue_takes_service_from_elsewhere_at_face_value() -> None:
    """Nothing waits or was served here: no level to lift to, the counters are the sum."""
    q: FairQueue[None] = FairQueue()
    q.charge_elsewhere("a", 10.0)
    q.charge_elsewhere("a", 5.0)
    assert q.counters == {"a": 15.0}


def test_take_charged_hands_out_what_was_charged_here_once() -> None:
    """What the bus publishes: the counter moves made here (weighted, corrections
    included), not what came from elsewhere; nothing is kept without a bus."""
    alone: FairQueue[None] = FairQueue(quantum_tokens=0)
    alone.push(None, "a", 100, deadline=FAR)
    assert alone.pop() is not None
    assert alone.take_charged() == {}  # no bus: nothing was kept
    q: FairQueue[None] = FairQueue(quantum_tokens=0, keep_charged=True)
    q.push(None, "a", 100, deadline=FAR, weight=4.0)
    q.push(None, "b", 10, deadline=FAR)
    assert q.pop() is not None and q.pop() is not None
    q.correct("b", 10, 30)
    q.charge_elsewhere("c", 7.0)
    assert q.take_charged() == {"a": 25.0, "b": 30.0}
    assert q.take_charged() == {}


def test_bands_are_strict_and_fair_within() -> None:
    q: FairQueue[None] = FairQueue(quantum_tokens=0)
    for _ in range(3):
        q.push(None, "big", 1, deadline=FAR, band=Band.BATCH)
    for _ in range(4):
        q.push(None, "a", 1, deadline=FAR)
        q.push(None, "b", 1, deadline=FAR)
    order = [(w.band, w.tenant) for w in iter(q.pop, None)]
    assert [b for b, _ in order] == [Band.INTERACTIVE] * 8 + [Band.BATCH] * 3
    firsts = [t for _, t in order[:8]]
    assert sorted(firsts[:2]) == sorted(firsts[2:4]) == ["a", "b"]


def test_with_fifo_the_order_is_arrival() -> None:
    q: FairQueue[int] = FairQueue(fifo=True)
    for i in range(5):
        q.push(i, "noisy", 100, deadline=FAR)
    q.push(5, "quiet", 1, deadline=FAR)
    assert [w.item for w in iter(q.pop, None)] == [0, 1, 2, 3, 4, 5]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from((b"k1", b"k2", None)), st.integers(1, 40)), max_size=30),
    st.integers(0, 200),
)
def test_a_turn_takes_same_key_requests_up_to_its_quantum(
    mine: list[tuple[bytes | None, int]], quantum: int
) -> None:
    """Tenant a's requests sharing the key of the one that opened its turn follow it
    (ahead of a's other requests and of b) while the turn's charge is under the quantum,
    and the turn never charges more than the quantum plus one request."""
    q: FairQueue[int] = FairQueue(quantum_tokens=quantum)
    for i, (key, cost) in enumerate(mine):
        q.push(i, "a", cost, deadline=FAR, locality=key)
    q.push(-1, "b", 1, deadline=FAR)
    first = q.pop()
    assert first is not None
    if first.tenant != "a" or first.locality is None:
        return
    key = first.locality
    turn = [first]
    charged = first.cost
    while (w := q.pop()) is not None and w.tenant == "a" and w.locality == key:
        assert charged < quantum, "a turn stops once its quantum is used"
        turn.append(w)
        charged += w.cost
    assert charged <= quantum + max(c for _, c in mine)
    same_left = [i for i, (k, _) in enumerate(mine) if k == key and i > turn[-1].item]
    if same_left:
        assert charged >= quantum, "the turn ended early with same-key requests waiting"
    assert [w.item for w in turn] == sorted(w.item for w in turn), "in arrival order"


def test_locality_keeps_a_prefix_together_against_strict_alternation() -> None:
    q: FairQueue[str] = FairQueue(quantum_tokens=100)
    for i in range(3):
        q.push(f"a{i}", "a", 10, deadline=FAR, locality=b"doc")
        q.push(f"b{i}", "b", 10, deadline=FAR, locality=b"other")
    assert [w.item for w in iter(q.pop, None)] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    strict: FairQueue[str] = FairQueue(quantum_tokens=0)
    for i in range(3):
        strict.push(f"a{i}", "a", 10, deadline=FAR, locality=b"doc")
        strict.push(f"b{i}", "b", 10, deadline=FAR, locality=b"other")
    assert [w.item for w in iter(strict.pop, None)] == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_removed_requests_never_leave_and_expiry_is_by_deadline() -> None:
    q: FairQueue[int] = FairQueue()
    ws = [q.push(i, TENANTS[i % 3], 5, deadline=float(i)) for i in range(9)]
    assert q.remove(ws[4]) and not q.remove(ws[4])
    assert len(q) == 8
    assert q.waiting() == {"a": 3, "b": 2, "c": 3}
    assert q.next_deadline() == 0.0
    assert [w.item for w in q.expire(3.0)] == [0, 1, 2, 3]
    assert q.next_deadline() == 5.0  # 4 was removed
    rest = [w.item for w in iter(q.pop, None)]
    assert sorted(rest) == [5, 6, 7, 8]
    assert q.expire(100.0) == [] and q.next_deadline() is None and len(q) == 0


def test_push_refuses_an_unknown_band() -> None:
    with pytest.raises(ValueError, match="priority band"):
        FairQueue[None]().push(None, "a", 1, deadline=FAR, band="urgent")  # type: ignore[arg-type]


def test_gate_learns_capacity_from_a_queue_and_counts_dispatches_at_once() -> None:
    gate = SaturationGate(max_waiting=2)
    assert not gate.saturated(R, 1000), "capacity unknown: not held back"
    gate.probed(R, inflight=10, waiting=3)  # runs 7
    assert gate.waiting(R, 10) == 3 and gate.saturated(R, 10)
    assert gate.waiting(R, 8) == 1 and not gate.saturated(R, 8)  # two ended since
    assert gate.saturated(R, 9)  # one dispatched again: 2 waiting
    gate.probed(R, inflight=9, waiting=0)  # it ran all nine: capacity at least 9
    assert gate.waiting(R, 9) == 0 and not gate.saturated(R, 10)
    assert gate.saturated(R, 11)
    gate.probed(R, inflight=9, waiting=None)  # the metric is gone: nothing to go by
    assert gate.waiting(R, 50) is None
    gate.probed(R, inflight=12, waiting=2, running=7)  # 3 still on their way: not capacity
    assert gate.waiting(R, 12) == 5
    gate.forget([OTHER])
    assert gate.waiting(R, 50) is None


def test_a_queue_seen_between_two_steps_does_not_close_the_replica() -> None:
    """A probe that catches a request before the engine's next step starts it sees a
    queue with nothing running (vLLM counts it waiting until then). Learning a capacity
    of 0 from it held every request back for good at a gate of 0 (nothing sent, nothing
    running, no later probe to correct it): the capacity learnt is at least 1."""
    gate = SaturationGate(max_waiting=0)
    gate.probed(R, inflight=1, waiting=1, running=0)
    assert gate.waiting(R, 0) == 0
    assert not gate.saturated(R, 0), "an idle replica must take a request"
    assert gate.saturated(R, 1)
    gate.probed(R, inflight=1, waiting=1)  # without the running metric, the same
    assert not gate.saturated(R, 0)


def test_a_gate_of_zero_keeps_the_replica_queue_empty() -> None:
    gate = SaturationGate(max_waiting=0)
    gate.probed(R, inflight=5, waiting=1)  # runs 4
    assert not gate.saturated(R, 3)
    assert gate.saturated(R, 4), "all four places taken: the next would wait there"


def test_a_prefill_budget_holds_long_prompts_and_lets_short_ones_by() -> None:
    """With a budget, a replica prefilling one long prompt takes a short one (at most
    1/16 of the budget, even past it) but not a second long one; with nothing to prefill
    it takes any prompt, even one over the budget, so nothing starves. Without a budget
    (the control) the second long prompt goes too."""
    gate = SaturationGate(max_waiting=2, max_prefill_tokens=8192)
    assert not gate.saturated(R, 0, prefill=0, request=12_000), "idle: a long prompt goes"
    assert not gate.saturated(R, 1, prefill=12_000, request=300), "a short one goes beside"
    assert gate.saturated(R, 1, prefill=12_000, request=600), "a longer one waits"
    assert not gate.saturated(R, 1, prefill=6_000, request=300), "a short one fits beside"
    assert gate.saturated(R, 1, prefill=6_000, request=6_000), "a second long one waits"
    assert not gate.saturated(R, 2, prefill=2_000, request=6_000), "once most is prefilled"
    assert not SaturationGate(max_waiting=2).saturated(R, 1, prefill=6_000, request=6_000)
    gate.probed(R, inflight=5, waiting=2, running=3)  # the queue rule still holds
    assert gate.saturated(R, 5, prefill=0, request=10)
    with pytest.raises(ValueError):
        SaturationGate(max_waiting=0, max_prefill_tokens=-1)


def test_a_derived_budget_is_the_replica_engine_step() -> None:
    """Without max_prefill_tokens, each replica's budget is its own engine step as its
    probes report it: a prompt of at most two steps is never held, a longer one waits
    while the replica has anything to prefill (long prompts one at a time), and an idle
    replica takes anything. Until a replica reports a step (or a step too small to
    tell), it gets the fallback; another replica's step is not its own."""
    gate = SaturationGate(max_waiting=2, max_prefill_tokens=None)
    assert gate.stepped(R, 2048) == 2048
    assert not gate.saturated(R, 1, prefill=0, request=12_000), "idle: a long prompt goes"
    assert not gate.saturated(R, 1, prefill=12_000, request=4096), "two steps: never held"
    assert gate.saturated(R, 1, prefill=100, request=4097), "longer: waits"
    fallback = (FALLBACK_STEP_TOKENS, FALLBACK_STEP_TOKENS * SHORT_STEPS)
    assert gate.prefill_budget(OTHER) == fallback
    assert not gate.saturated(OTHER, 1, prefill=100, request=fallback[1])
    assert gate.saturated(OTHER, 1, prefill=100, request=fallback[1] + 1)
    assert gate.stepped(R, MIN_STEP_TOKENS // 2) is None, "too little to tell"
    assert gate.prefill_budget(R) == fallback
    assert gate.stepped(R, None) is None
    gate.stepped(R, 4096)
    gate.forget([OTHER])
    assert gate.prefill_budget(R)[0] == FALLBACK_STEP_TOKENS, "a removed replica's step"


def test_a_budget_set_by_hand_wins_over_the_reported_step() -> None:
    gate = SaturationGate(max_waiting=2, max_prefill_tokens=8192)
    assert gate.stepped(R, 256) == 256
    assert gate.prefill_budget(R) == (8192, 8192 / 16)
    assert gate.saturated(R, 1, prefill=6_000, request=6_000)
    assert not gate.saturated(R, 1, prefill=6_000, request=300)
    off = SaturationGate(max_waiting=2, max_prefill_tokens=0)
    off.stepped(R, 256)
    assert not off.saturated(R, 1, prefill=6_000, request=6_000), "0: no budget"


def test_step_tokens_falls_back_on_too_little() -> None:
    assert step_tokens(None) is None
    assert step_tokens(MIN_STEP_TOKENS - 1) is None
    assert step_tokens(MIN_STEP_TOKENS) == MIN_STEP_TOKENS
    assert step_tokens(16384) == 16384


def test_a_request_held_back_does_not_hold_up_another_tenant() -> None:
    """`candidates` offers the next in fair order first, then the other tenants' oldest:
    the shell releases the first its replicas can take. Bands stay strict, and a
    tenant's own requests keep their order."""
    q: FairQueue[str] = FairQueue(quantum_tokens=0)
    q.push("noisy-long", "noisy", 12_000, deadline=FAR)
    q.push("noisy-next", "noisy", 12_000, deadline=FAR)
    q.push("quiet", "quiet", 300, deadline=FAR)  # lifted to noisy's counter: the tie
    q.push("batch", "other", 10, deadline=FAR, band=Band.BATCH)
    assert [w.item for w in q.candidates()] == ["noisy-long", "quiet"]
    held, quiet = list(q.candidates())
    assert q.pop(quiet) is quiet and q.counters["quiet"] == 300  # charged as released
    assert [w.item for w in q.candidates()] == ["noisy-long"]
    assert q.pop() is held
    assert [w.item for w in q.candidates()] == ["noisy-next"]
    q.pop()
    assert [w.item for w in q.candidates()] == ["batch"]  # interactive gone: batch's turn


def _state(q: FairQueue[Any]) -> tuple[Any, ...]:
    """What the next releases depend on: counters, weights, each band's floor, the turn."""
    turn = q._turn
    floors = tuple(q._bands[b].floor for b in (Band.INTERACTIVE, Band.BATCH))
    return (
        dict(q.counters),
        dict(q.weights),
        floors,
        None if turn is None else (turn.band, turn.tenant, turn.key, turn.left),
        len(q),
    )


_ARRIVAL = st.tuples(
    st.just("arrive"),
    st.sampled_from(TENANTS),
    st.sampled_from((Band.INTERACTIVE, Band.BATCH)),
    st.integers(0, 3000),
    st.sampled_from((None, b"k1", b"k2")),
    st.sampled_from((1.0, 2.0, 0.5)),
)
_STEP = st.one_of(
    _ARRIVAL,
    st.tuples(st.just("pop")),
    st.tuples(st.just("correct"), st.sampled_from(TENANTS), st.integers(0, 3000)),
    st.tuples(st.just("elsewhere"), st.sampled_from(TENANTS), st.integers(-500, 3000)),
)


@given(
    script=st.lists(st.tuples(st.booleans(), _STEP), max_size=60),
    quantum=st.sampled_from((0, 1000, 4096)),
    fifo=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_serve_now_is_push_then_pop_on_an_empty_queue(
    script: list[tuple[bool, tuple[Any, ...]]], quantum: int, fifo: bool
) -> None:
    """The gateway's fast path (a request served on arrival, without a Waiter) leaves the
    queue exactly as the request queued and released at once would: same counters, lift,
    floors, turn and weights, same service handed to the bus, so every later release is
    the same; with a request waiting it changes nothing and the request must queue."""
    fast: FairQueue[int] = FairQueue(quantum_tokens=quantum, fifo=fifo, keep_charged=True)
    slow: FairQueue[int] = FairQueue(quantum_tokens=quantum, fifo=fifo, keep_charged=True)
    charged: dict[str, float] = {}  # the estimate each tenant's last release charged
    for i, (served_now, step) in enumerate(script):
        if step[0] == "arrive":
            _, tenant, band, cost, key, weight = step
            opts: dict[str, Any] = {"band": band, "locality": key, "weight": weight}
            waited = len(slow) > 0
            if served_now:
                assert fast.serve_now(tenant, cost, **opts) is not waited
                if waited:
                    fast.push(i, tenant, cost, deadline=FAR, **opts)
                    slow.push(i, tenant, cost, deadline=FAR, **opts)
                else:
                    slow.push(i, tenant, cost, deadline=FAR, **opts)
                    released = slow.pop()
                    assert released is not None and released.item == i
                    charged[tenant] = cost
            else:
                fast.push(i, tenant, cost, deadline=FAR, **opts)
                slow.push(i, tenant, cost, deadline=FAR, **opts)
        elif step[0] == "pop":
            a, b = fast.pop(), slow.pop()
            assert (a and a.item) == (b and b.item)
            if a is not None:
                charged[a.tenant] = a.cost
        elif step[0] == "correct":
            _, tenant, used = step
            fast.correct(tenant, charged.get(tenant, 0.0), used)
            slow.correct(tenant, charged.get(tenant, 0.0), used)
        else:
            _, tenant, amount = step
            fast.charge_elsewhere(tenant, amount)
            slow.charge_elsewhere(tenant, amount)
        assert _state(fast) == _state(slow)
        assert fast.take_charged() == slow.take_charged()
    while (a := fast.pop()) is not None:  # and the same releases after it
        b = slow.pop()
        assert b is not None and a.item == b.item
    assert slow.pop() is None


def test_a_queue_that_empties_keeps_no_deadlines() -> None:
    """Released requests do not stay in the deadline heap once nothing waits (the queue's
    memory grew with every request served while the gateway was not saturated)."""
    q: FairQueue[int] = FairQueue()
    for i in range(100):
        q.push(i, "a", 1.0, deadline=FAR)
        assert q.pop() is not None
    assert len(q._deadlines) == 0
    q.push(100, "a", 1.0, deadline=1.0)
    q.push(101, "b", 1.0, deadline=2.0)
    assert q.pop() is not None
    assert [w.item for w in q.expire(5.0)] == [101]
