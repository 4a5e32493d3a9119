"""Admission under the tenants' limits, in the request's lifecycle (docs/limits.md).

The decisions are saltgate.governance.limits' (pure); this module holds the process's
`Governor`, reads the clock, and turns a decision into what the caller's API expects: a 429
in OpenAI's or Anthropic's shape with Retry-After, and the rate-limit headers on every
answer to a tenant with limits. A request whose tenant and key have no limits skips all of
it (gateway/server.py tests two attributes of the principal).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Final

from redis.exceptions import RedisError

from saltgate.gateway.host_limits import HostLimits, HostTicket
from saltgate.gateway.metrics import Metrics
from saltgate.gateway.shared_limits import SharedLimits, SharedTicket
from saltgate.governance.answers import denial_error, rate_headers, reservation
from saltgate.governance.kinds import Scope, Subject
from saltgate.governance.limits import (
    DEFAULT_LEASE_TTL_S,
    Demand,
    Denial,
    Governor,
    Limits,
    Quota,
    Ticket,
)
from saltgate.http import Headers
from saltgate.prices import PriceBook
from saltgate.store.tenants import Principal
from saltgate.store.usage_rollups import UsageReader, read_buckets

REFUSALS: Final = "saltgate_limit_refusals_total"
# A budget starts from the ledger's minute rollups (a spend counts from its minute's end);
# a store that could not be read is tried again after this.
BUDGET_BUCKET_S: Final = 60
BUDGET_RETRY_S: Final = 5.0
log = logging.getLogger(__name__)

# What a request admitted here holds: a ticket of this process's governor, of Redis's
# script (SharedTicket) or of the supervisor's (HostTicket).
AnyTicket = Ticket | SharedTicket | HostTicket
# The engine that counts for more than this process: [cluster]'s Redis for the fleet, or
# the supervisor of `serve --workers N` for the host.
Engine = SharedLimits | HostLimits
# After the engine failed, the local shares hold this long before it is tried again, so a
# request does not wait for a dead server's timeout each time.
SHARED_RETRY_S: Final = 1.0


class Admission:
    """The limits of the tenants and keys this process serves.

    With `shared` ([cluster]'s Redis) every gateway admits through one atomic script, so a
    limit holds for the fleet; with the supervisor's arbiter (a worker of `serve --workers
    N` without [cluster]) every worker of the host admits through its one count. Without
    either, or while it cannot be reached, this process enforces its `share` of every
    limit (L / share) on its own counts.
    """

    def __init__(
        self,
        prices: PriceBook,
        *,
        share: int = 1,
        shared: Engine | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        metrics: Metrics | None = None,
        spend: UsageReader | None = None,
    ) -> None:
        """`spend`: the store's usage rollups, from which each budget starts (None: a budget
        counts from the first request this process sees)."""
        self.governor = Governor(lease_ttl_s=lease_ttl_s)
        self.metrics = metrics
        self.spend = spend
        # (subject, period) of each budget started from the ledger, and those being read.
        self._seeded: set[tuple[Subject, int]] = set()
        self._seeding: dict[tuple[Subject, int], asyncio.Future[None]] = {}
        self._seed_retry_at: dict[tuple[Subject, int], float] = {}
        if metrics is not None:
            metrics.describe(
                REFUSALS,
                "counter",
                "Requests refused 429 by a limit or a spent budget, by tenant id, the limit "
                "(requests, input_tokens, output_tokens, concurrency, budget) and whose it "
                "is (tenant or key).",
            )
        self.prices = prices
        self.share = share
        self.shared = shared
        if isinstance(shared, HostLimits):
            log.info(
                "limits shared by this host's workers through the supervisor; while it "
                "does not answer this worker enforces 1/%d of every limit (docs/limits.md)",
                share,
            )
        elif shared is not None:
            log.info(
                "limits shared by the fleet through [cluster]'s Redis; while it is "
                "unreachable each process enforces 1/%d of every limit (docs/limits.md)",
                share,
            )
        elif share > 1:
            log.warning(
                "limits are not shared between this gateway's %d processes "
                "([limits] share x --workers): each enforces 1/%d of every tenant's and "
                "key's limit (rounded down), so together they never exceed it "
                "(docs/limits.md)",
                share,
                share,
            )
        self.shared_up = shared is not None
        self._retry_shared_at = 0.0
        self._settling: set[asyncio.Task[None]] = set()
        self._clock = time.monotonic

    async def admit(
        self, principal: Principal, route: str, model: str, body_bytes: int, max_tokens: int | None
    ) -> tuple[AnyTicket, Headers]:
        """Reserve the request in every limit, or raise the 429 that says which refused.
        Returns the ticket to settle and the headers for the answer."""
        if self.spend is not None:
            await self._start_budgets(principal)
        demand = reservation(self.prices.by_model.get(model), route, body_bytes, max_tokens)
        anthropic = route.startswith("/v1/messages")
        ticket: AnyTicket | None = None
        denial: Denial | None = None
        quotas: tuple[Quota, ...] = ()
        shared_answered = False
        if self.shared is not None and (self.shared_up or self._clock() >= self._retry_shared_at):
            limited = [
                (subject, limits)
                for subject, limits in (
                    (Subject(Scope.TENANT, principal.tenant_id), principal.limits),
                    (Subject(Scope.KEY, principal.key_id), principal.key_limits),
                )
                if limits is not None
            ]
            failure: Exception | None = None
            granted: SharedTicket | HostTicket | None = None
            try:
                granted, denial, quotas = await self.shared.admit(limited, demand)
            except (RedisError, OSError) as exc:
                failure = exc
            if failure is None:
                shared_answered = True
                if granted is not None:
                    # Counted here too, so a fallback to the share sees it (docs/limits.md).
                    local = self.governor.record(self._subjects(principal), demand, self._clock())
                    ticket = dataclasses.replace(granted, local=local)
                if not self.shared_up:
                    log.warning("limits shared through %s again", self.shared.what)
                    self.shared_up = True
            else:
                self._lost(failure)
        if not shared_answered:
            decision = self.governor.admit(self._subjects(principal), demand, self._clock())
            ticket, denial, quotas = decision.ticket, decision.denial, decision.quotas
        headers = rate_headers(quotas, anthropic, time.time())
        if ticket is None:
            assert denial is not None
            if self.metrics is not None:
                labels = (("tenant", principal.tenant_id), ("limit", denial.kind))
                self.metrics.inc(REFUSALS, (*labels, ("scope", denial.scope)))
            raise denial_error(denial, model, anthropic, headers)
        return ticket, headers

    # -- budgets from the ledger ----------------------------------------------------------
    async def _start_budgets(self, principal: Principal) -> None:
        """Before a subject's first admission here, start its budget from what the ledger
        holds for its period: a budget set after spend, or a gateway restarted mid-period,
        counts what was spent (docs/limits.md). Once per subject and period per process;
        concurrent first requests wait for the one read."""
        for subject, limits in (
            (Subject(Scope.TENANT, principal.tenant_id), principal.limits),
            (Subject(Scope.KEY, principal.key_id), principal.key_limits),
        ):
            if limits is None or limits.budget_period_s is None:
                continue
            mark = (subject, limits.budget_period_s)
            if mark in self._seeded or self._clock() < self._seed_retry_at.get(mark, 0.0):
                continue
            pending = self._seeding.get(mark)
            if pending is None:
                pending = asyncio.ensure_future(self._start_budget(principal, subject, limits))
                self._seeding[mark] = pending
            await asyncio.shield(pending)

    async def _start_budget(self, principal: Principal, subject: Subject, limits: Limits) -> None:
        period = limits.budget_period_s
        assert period is not None and self.spend is not None
        mark = (subject, period)
        wall, now = time.time(), self._clock()
        filters = {"tenant_id": [principal.tenant_id]}
        if subject.scope == Scope.KEY:
            filters["key_id"] = [principal.key_id]
        start = int(wall - period) // BUDGET_BUCKET_S * BUDGET_BUCKET_S
        failure: Exception | None = None
        spent: list[tuple[float, int]] = []  # (age in seconds, micro-dollars)
        try:
            for group in await read_buckets(
                self.spend, BUDGET_BUCKET_S, start, int(wall) + 1, group_by=(), filters=filters
            ):
                # A bucket counts from its end: never out of the period before its spend.
                age = max(wall - (group.bucket + BUDGET_BUCKET_S), 0.0)
                spent.append((age, group.sums["cost_micro_usd"]))
        except Exception as exc:  # any failure of the store: admit, and try again later
            failure = exc
        if failure is None and self.shared is not None and self.shared_up:
            try:
                await self.shared.seed_budget(subject, limits, spent)
            except (RedisError, OSError) as exc:
                failure = exc
        del self._seeding[mark]
        if failure is not None:
            log.warning(
                "limits: the %s budget could not be started from the ledger (%s); it counts "
                "from now, retried in %.0f s",
                subject.scope,
                type(failure).__name__,
                BUDGET_RETRY_S,
            )
            self._seed_retry_at[mark] = self._clock() + BUDGET_RETRY_S
            return
        self.governor.set_limits(subject, _shared(limits, self.share))
        # Each process enforces budget / share on its own counts: it starts with its share
        # of what was spent (rounded up), so together they admit at most what is left.
        share = [(now - age, -(-amount // self.share)) for age, amount in spent]
        self.governor.seed_budget(subject, share, now)
        self._seeded.add(mark)

    def _lost(self, exc: Exception) -> None:
        if self.shared_up:
            assert self.shared is not None
            log.warning(
                "limits: %s unreachable (%s); each process enforces 1/%d of "
                "every limit on its own counts until it returns (docs/limits.md)",
                self.shared.what,
                type(exc).__name__,
                self.share,
            )
        self.shared_up = False
        self._retry_shared_at = self._clock() + SHARED_RETRY_S

    def _subjects(self, principal: Principal) -> list[Subject]:
        """Install the principal's current limits (they follow the store's snapshot)."""
        tenant = Subject(Scope.TENANT, principal.tenant_id)
        key = Subject(Scope.KEY, principal.key_id)
        self.governor.set_limits(tenant, _shared(principal.limits, self.share))
        self.governor.set_limits(key, _shared(principal.key_limits, self.share))
        return [tenant, key]

    def settle(self, ticket: AnyTicket, uncached: int, output: int, cost: int) -> None:
        """The request ended: correct its reservations to what it used, free its lease.
        In Redis this runs beside the request's end, to the supervisor as one line
        unanswered; if it fails, the lease's TTL and the window free what it held."""
        used = Demand(uncached, output, cost)
        if isinstance(ticket, Ticket):
            self.governor.settle(ticket, used, self._clock())
            return
        if ticket.local is not None:
            self.governor.settle(ticket.local, used, self._clock())
        if isinstance(ticket, HostTicket):
            if isinstance(self.shared, HostLimits):
                self.shared.settle(ticket, used)
        elif isinstance(self.shared, SharedLimits):
            task = asyncio.create_task(self._settle_shared(self.shared, ticket, used))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    @staticmethod
    async def _settle_shared(shared: SharedLimits, ticket: SharedTicket, used: Demand) -> None:
        try:
            await shared.settle(ticket, used)
        except (RedisError, OSError) as exc:
            log.debug("limits: settling in Redis failed (%s)", type(exc).__name__)


# Every admission through Redis installs the local shares too (to record it): computed
# once per distinct limits, not per request.
@functools.lru_cache(maxsize=4096)
def _shared(limits: Limits | None, share: int) -> Limits | None:
    return None if limits is None else limits.share(share)
