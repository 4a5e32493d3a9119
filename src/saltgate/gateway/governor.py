"""Governance in the request path: one object a request enters and settles once.

The decisions are saltgate.governance's (pure: limits, fair order, which replica may take
a waiter, the 429s and headers); this module is their I/O side as the gateway's
request path sees it (docs/design.md, "Governance"): `Governance.enter` admits a request
under its tenant's and key's limits and hands back its `Pass`, which takes the request's
first attempt (in its turn in the fair queue, [queue]) and settles what it held once,
whichever way the request ends. A request with no limits and no queue gets no pass: the
fast path costs nothing.
"""

from __future__ import annotations

from saltgate.gateway.admission import Admission, AnyTicket
from saltgate.gateway.fairshare import FairShare
from saltgate.gateway.replicas import Attempt, ReplicaSet
from saltgate.gateway.usage import Usage
from saltgate.governance.fairness import service
from saltgate.governance.limits import prompt_estimate
from saltgate.http import Client, Headers
from saltgate.policy.errors import ApiError
from saltgate.policy.request import ANTHROPIC_ROUTES
from saltgate.routing import Plan
from saltgate.store.tenants import Principal


class Pass:
    """One request's way through governance, from its admission to its one settlement:
    its reservations under its limits (``ticket``, None: it has none), the rate-limit
    headers for its answer (`headers`), and what the fair queue charged its tenant when
    it released the request (kept until `settle`; none when the queue did not)."""

    __slots__ = ("_admission", "_charged", "_fair", "_principal", "_route", "_ticket", "headers")

    def __init__(
        self,
        principal: Principal,
        route: str,
        *,
        admission: Admission | None = None,
        ticket: AnyTicket | None = None,
        headers: Headers | None = None,
        fair: FairShare | None = None,
    ) -> None:
        self._principal = principal
        self._route = route
        self._admission = admission  # None once settled, or when it has no limits
        self._ticket = ticket
        self.headers = headers
        self._fair = fair
        self._charged = -1.0

    async def first_attempt(
        self, replicas: ReplicaSet, plan: Plan, client: Client, body_bytes: int
    ) -> Attempt | None:
        """The request's first replica: with [queue], once it is its turn and a replica
        is below the gate; without, the router's pick. None: no replica serves it. A
        request that waited too long, or whose client left, is settled and gets the
        ApiError to answer (503 / 529, or the client's 499) raised."""
        fair = self._fair
        if fair is None:
            return replicas.acquire(plan, ())
        cost = float(prompt_estimate(body_bytes))
        acquired = await fair.acquire(
            replicas,
            self._principal,
            plan,
            client,
            cost=cost,
            anthropic=self._route in ANTHROPIC_ROUTES,
        )
        if isinstance(acquired, ApiError):
            self.settle(None, None)
            raise acquired
        if acquired is not None:
            self._charged = cost
        return acquired

    def settle(self, used: Usage | None, cost: int | None) -> None:
        """The request ended: its reservations corrected to what it used (None: nothing
        was metered, nothing used) and its lease freed, and its tenant charged in the fair
        queue what the replica metered instead of the estimate. Once: a later call (any
        other ending) does nothing."""
        admission, fair = self._admission, self._fair
        self._admission = self._fair = None
        if admission is not None:
            ticket = self._ticket
            assert ticket is not None
            if used is None:
                admission.settle(ticket, 0, 0, 0)
            else:
                uncached = used.prompt_tokens - (used.cached_tokens or 0)
                admission.settle(ticket, max(uncached, 0), used.completion_tokens, cost or 0)
        if fair is not None and self._charged >= 0:
            served = 0.0 if used is None else service(used.prompt_tokens, used.completion_tokens)
            fair.done(self._principal.tenant_id, self._charged, served)


class Governance:
    """The process's limits (`admission`) and fair queue (`fair`, [queue]; None: off),
    built and wired at start-up (serving/run.py) and entered by every forwarded request."""

    __slots__ = ("admission", "fair")

    def __init__(self, admission: Admission, fair: FairShare | None) -> None:
        self.admission = admission
        self.fair = fair

    async def enter(
        self,
        principal: Principal,
        route: str,
        model: str,
        body_bytes: int,
        max_tokens: int | None,
    ) -> Pass | None:
        """Admit the request under its tenant's and key's limits (a refusal raises the
        429 that says which) and hand back its pass; None when it has no limits and the
        queue is off: then nothing is held and nothing is to settle."""
        fair = self.fair
        if not principal.limited:
            return None if fair is None else Pass(principal, route, fair=fair)
        admission = self.admission
        ticket, headers = await admission.admit(principal, route, model, body_bytes, max_tokens)
        return Pass(
            principal, route, admission=admission, ticket=ticket, headers=headers, fair=fair
        )

    def forget(self, replicas: ReplicaSet) -> None:
        """The replica set was reloaded: the gate forgets the replicas it no longer has."""
        if self.fair is not None:
            self.fair.forget(replicas)
