"""The saturation gate and the fair queue in the request's lifecycle ([queue], docs/fairness.md).

The decisions are saltgate.governance.fairness' (pure); this module holds the process's
queue and gate, reads the clock, and is driven by the request's pass (gateway/governor.py)
and the replica set, whose listener it is (`ReplicaListener`, given when both are built in
serving/run.py `open_gateway`):

- `acquire` (the pass's first attempt): the request joins its tenant's queue in its
  key's priority band, and gets a replica once one of its replicas is below the gate and
  it is next in fair order; with nothing queued and a replica free that is at once,
  without joining the queue (`FairQueue.serve_now`: charged as a release would).
- `release` runs whenever a place may have freed: a request left a replica or its
  prompt is prefilled (its first output; `freed`), a probe showed a replica's queue
  (`queue_seen`, which also teaches the gate the replica's capacity). It hands replicas
  out while a request has one below the gate, the first such in fair order (one held
  back does not hold up the other tenants'; which replicas may take it is
  `governance.placement.placeable`'s); the attempt is taken here, so two releases never
  count on the same place.
- A request still waiting after `max_queue_s` gets 503 (OpenAI routes) or 529
  `overloaded_error` (Anthropic), with Retry-After (`governance.answers.overloaded`);
  one whose client leaves is out of the queue at once (`Client.on_gone`, or its task
  cancelled with on_client_gone = "abort").
- `done` (the pass's settlement): its tenant is charged what the replica metered.
- With [cluster], the bus publishes what the queue charged and adds the other gateways'
  service to its counters (gateway/cluster.py): the `on_charge` it was built with wakes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from saltgate.config import QueueConfig
from saltgate.gateway.metrics import Metrics, duration_buckets
from saltgate.gateway.replicas import Attempt, ReplicaSet, replica_label
from saltgate.governance.answers import overloaded
from saltgate.governance.fairness import (
    FALLBACK_STEP_TOKENS,
    MIN_STEP_TOKENS,
    FairQueue,
    SaturationGate,
    Waiter,
)
from saltgate.governance.kinds import band_of
from saltgate.governance.placement import placeable
from saltgate.http import Client
from saltgate.policy.errors import ApiError
from saltgate.routing import Plan, ReplicaId
from saltgate.store.tenants import Principal

log = logging.getLogger(__name__)

_WAITING: Final = "saltgate_queue_waiting"
_WAIT: Final = "saltgate_queue_wait_seconds"
_TIMEOUTS: Final = "saltgate_queue_timeouts_total"
CLIENT_LEFT: Final = 499
TIMED_OUT: Final = 503


@dataclass(slots=True, eq=False)
class Queued:
    """A request waiting in the queue: its plan, the future its replica is handed by,
    and when it started waiting."""

    plan: Plan
    future: asyncio.Future[Attempt | int | None]
    since: float


def fair_queue(config: QueueConfig, *, shared: bool) -> FairQueue[Queued]:
    """The process's fair queue; ``shared``: a cluster bus tells the other gateways
    what it charges (it keeps it for `FairQueue.take_charged`)."""
    return FairQueue(quantum_tokens=config.quantum_tokens, keep_charged=shared)


class FairShare:
    """One gateway process's saturation gate and fair queue (module doc), a listener of
    the replica set (`ReplicaListener`). ``queue``: `fair_queue`'s; ``on_charge``: told
    whenever the queue charged a tenant (the cluster bus's wake-up; None without one)."""

    def __init__(
        self,
        config: QueueConfig,
        metrics: Metrics,
        queue: FairQueue[Queued],
        *,
        on_charge: Callable[[], None] | None = None,
    ) -> None:
        self.max_queue_s = config.max_queue_s
        self.queue = queue
        self.gate = SaturationGate(
            config.max_waiting_per_replica, config.max_prefill_tokens_per_replica
        )
        self.metrics = metrics
        self._timer: asyncio.TimerHandle | None = None
        # The step size each replica's prefill budget was last said to be (None: fallback).
        self._steps: dict[ReplicaId, int | None] = {}
        self._on_charge = on_charge
        metrics.gauge(
            _WAITING,
            "Requests waiting in saltgate's fair queue for a replica, by tenant id.",
            lambda: [((("tenant", t),), float(n)) for t, n in self.queue.waiting().items()],
        )
        metrics.histogram(
            _WAIT,
            "Time requests waited in the fair queue before a replica took them, by tenant id.",
            duration_buckets(config.max_queue_s),
        )
        metrics.describe(
            _TIMEOUTS,
            "counter",
            "Requests answered 503 / 529 after max_queue_s in the fair queue, by tenant id.",
        )

    # -- the exchange's side ---------------------------------------------------------------
    async def acquire(
        self,
        replicas: ReplicaSet,
        principal: Principal,
        plan: Plan,
        client: Client,
        *,
        cost: float,
        anthropic: bool,
    ) -> Attempt | ApiError | None:
        """A replica for the request's first attempt, once it is its turn; None when no
        replica serves it at all; the ApiError to answer when it waited too long or its
        client left.

        The fast path: with nothing waiting and one of its replicas below the gate, the
        request has its replica at once, charged as a release charges it, without a
        future, a waiter or a timer; only a request that must wait queues."""
        now = time.monotonic()
        band = band_of(principal.priority)
        weight = principal.weight
        if not len(self.queue):
            usable = replicas.router.usable(plan.model, now)
            if not usable:
                return None
            free = placeable(self.gate, usable, plan)
            if free:
                attempt = replicas.acquire(plan, (), free)
                if attempt is not None:
                    self.queue.serve_now(
                        principal.tenant_id, cost, band=band, locality=plan.key, weight=weight
                    )
                    self.metrics.observe(_WAIT, (("tenant", principal.tenant_id),), 0.0)
                    self._charged()
                return attempt
        future: asyncio.Future[Attempt | int | None] = asyncio.get_running_loop().create_future()
        waiter = self.queue.push(
            Queued(plan, future, now),
            principal.tenant_id,
            cost,
            deadline=now + self.max_queue_s,
            band=band,
            locality=plan.key,
            weight=weight,
        )
        self._release_safely(replicas)
        if not future.done():
            client.on_gone = lambda: self._left(waiter)
            self._arm()  # whatever release did: a waiter is never left without its timer
        cancelled: BaseException | None = None
        try:
            outcome = await future
        except asyncio.CancelledError as exc:
            cancelled = exc  # handled below, outside the handler (buildinfo.py)
        client.on_gone = None
        if cancelled is not None:
            self._abandon(waiter)
            raise cancelled
        if outcome == TIMED_OUT:
            return overloaded(anthropic, self.max_queue_s)
        if outcome == CLIENT_LEFT:
            return ApiError(CLIENT_LEFT, "The client closed the request while it waited.")
        assert not isinstance(outcome, int)
        return outcome

    def done(self, tenant: str, charged: float, used: float) -> None:
        """A request the queue released ended: charge its tenant what it used."""
        self.queue.correct(tenant, charged, used)
        self._charged()

    def _charged(self) -> None:
        if self._on_charge is not None:
            self._on_charge()

    def _left(self, waiter: Waiter[Queued]) -> None:
        if self.queue.remove(waiter):
            waiter.item.future.set_result(CLIENT_LEFT)

    def _abandon(self, waiter: Waiter[Queued]) -> None:
        """The waiting task was cancelled: out of the queue, or, if a replica was already
        handed to it, that replica freed and the charge taken back."""
        if self.queue.remove(waiter):
            return
        future = waiter.item.future
        if future.done() and not future.cancelled():
            attempt = future.result()
            if isinstance(attempt, Attempt):
                attempt.close()
                self.queue.correct(waiter.tenant, waiter.cost, 0.0)
                self._charged()

    # -- the replica set's listener --------------------------------------------------------
    def acquired(self) -> None:
        """A place was taken: the gate reads the router's counts when it next decides."""

    def freed(self, replicas: ReplicaSet) -> None:
        self.release(replicas)

    def queue_seen(
        self,
        replicas: ReplicaSet,
        replica: ReplicaId,
        *,
        inflight: int,
        waiting: float | None,
        running: float | None,
        step: int | None,
    ) -> None:
        """A probe read a replica's queue with ``inflight`` requests on it (every gateway's)
        and ``step``, the largest engine step it has run (the derived prefill budget)."""
        self.gate.probed(replica, inflight, waiting, running)
        self._stepped(replica, step)
        self.release(replicas)

    def _stepped(self, replica: ReplicaId, step: int | None) -> None:
        """Take the replica's engine step for its prefill budget, saying in one line when
        it falls back (and again once it reports one)."""
        if self.gate.max_prefill_tokens is not None:
            return
        taken = self.gate.stepped(replica, step)
        if taken == self._steps.get(replica, -1):
            return
        self._steps[replica] = taken
        if taken is None:
            log.warning(
                "replica %s reports no engine step size yet (vllm:iteration_tokens_total in "
                "its /metrics, or no step of %d tokens or more): its prefill budget is %d "
                "tokens until it does ([queue] max_prefill_tokens_per_replica sets one)",
                replica_label(replica),
                MIN_STEP_TOKENS,
                FALLBACK_STEP_TOKENS,
            )
        else:
            log.info(
                "replica %s runs engine steps of up to %d tokens: its prefill budget",
                replica_label(replica),
                taken,
            )

    def _release_safely(self, replicas: ReplicaSet) -> None:
        """`release`, its failure logged rather than thrown at the request just queued
        (which then waits for its turn or its deadline, as any other)."""
        try:
            self.release(replicas)
        except Exception:
            log.exception("releasing from the fair queue failed; the waiters keep their timers")

    def release(self, replicas: ReplicaSet) -> None:
        """Hand replicas to waiting requests in fair order while one of them has a
        replica below the gate."""
        queue = self.queue
        if not len(queue):
            return
        now = time.monotonic()
        while self._release_one(queue, replicas, now):
            pass

    def _release_one(self, queue: FairQueue[Queued], replicas: ReplicaSet, now: float) -> bool:
        """Release the first request, in fair order, that one of its replicas can take
        (one held back by the gate does not hold up the other tenants'); whether one
        left the queue (then look again: the order changed)."""
        for waiter in queue.candidates():
            entry = waiter.item
            if entry.future.done():  # its task was cancelled and has not run yet
                queue.remove(waiter)
                return True
            plan = entry.plan
            usable = replicas.router.usable(plan.model, now)
            attempt = None  # no replica serves it at all
            if usable:
                free = placeable(self.gate, usable, plan)
                if not free:
                    continue  # its turn waits for one of its replicas
                attempt = replicas.acquire(plan, (), free)
            queue.pop(waiter)
            if attempt is None:  # no replica serves it at all: 503, and nothing served
                queue.correct(waiter.tenant, waiter.cost, 0.0)
            self.metrics.observe(_WAIT, (("tenant", waiter.tenant),), now - entry.since)
            entry.future.set_result(attempt)
            self._charged()
            return True
        return False

    def _arm(self) -> None:
        if self._timer is None:
            deadline = self.queue.next_deadline()
            if deadline is not None:
                self._timer = asyncio.get_running_loop().call_later(
                    max(deadline - time.monotonic(), 0.0), self._expire
                )

    def _expire(self) -> None:
        self._timer = None
        for waiter in self.queue.expire(time.monotonic()):
            self.metrics.inc(_TIMEOUTS, (("tenant", waiter.tenant),))
            if not waiter.item.future.done():
                waiter.item.future.set_result(TIMED_OUT)
        self._arm()

    def forget(self, replicas: ReplicaSet) -> None:
        """Only ``replicas``' remain (a reload): the gate forgets the others' capacity."""
        kept = {r.id for r in replicas.replicas}
        self.gate.forget(kept)
        self._steps = {r: step for r, step in self._steps.items() if r in kept}
        self.release(replicas)
