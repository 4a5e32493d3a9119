"""Fair release of the requests that wait past the saturation gate (docs/fairness.md).

Pure: no clock, no I/O. The gateway (gateway/fairshare.py) holds one `FairQueue`, tells it
when a request waits, when it may release one and what time it is; every rule here is
tested without sockets (tests/governance/test_fairness.py).

- Priority bands are strict: nothing of "batch" leaves while "interactive" waits.
- Within a band, tenants take turns by service received, a virtual token counter (VTC,
  Sheng et al., OSDI'24): a released request charges its tenant input + 2 x output tokens
  divided by the tenant's weight (the prompt estimate when released, corrected to the
  metered usage when it ends: `correct`). The backlogged tenant with the smallest counter
  goes next. A tenant that returns from idle (nothing waiting in any band) is lifted to the
  smallest counter of those waiting in its band (or, with none waiting, to the last one
  served there), so idling banks no credit.
- The counters are the fleet's: what this queue charged is handed out (`take_charged`)
  for the cluster bus to tell the other gateways, and what they charged is added here
  (`charge_elsewhere`), so a tenant served through another gateway waits its turn here too.
- Locality survives fairness: a turn goes on while the tenant has waiting requests of the
  same route key as the one that opened it, up to `quantum_tokens` of service (a deficit
  quantum, as in DLPM), so requests sharing a prefix go out together to the replica that
  holds it instead of being interleaved one by one with other tenants'.
- Work-conserving: a request none of whose replicas can take it now (the saturation gate
  holds it) does not hold up the other tenants': `candidates` offers their next ones,
  still in fair order, and the shell releases the first it can place.
- A waiting request that leaves (its client went away) is removed in O(1); one that waits
  past its deadline is handed back by `expire`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from saltgate.governance.kinds import BANDS, Band
from saltgate.governance.weight import sane_weight
from saltgate.routing import ReplicaId

T = TypeVar("T")

OUTPUT_WEIGHT: Final = 2.0  # VTC's w_q / w_p: an output token costs two input tokens


def service(input_tokens: int, output_tokens: int) -> float:
    """A request's service in VTC's unit (before the tenant's weight)."""
    return input_tokens + OUTPUT_WEIGHT * output_tokens


class Waiter(Generic[T]):
    """One request waiting for a replica. ``cost``: its service charged when released
    (the shell's estimate); ``locality``: its route key (None: it shares nothing);
    ``item``: what the shell needs to hand it its replica. (A plain class: compiled, a
    Generic dataclass fails at import.)"""

    __slots__ = ("band", "cost", "deadline", "item", "locality", "seq", "tenant", "waiting")

    def __init__(
        self,
        item: T,
        tenant: str,
        *,
        band: Band,
        cost: float,
        locality: bytes | None,
        deadline: float,
        seq: int = 0,
    ) -> None:
        self.item = item
        self.tenant = tenant
        self.band = band
        self.cost = cost
        self.locality = locality
        self.deadline = deadline
        self.seq = seq
        self.waiting = True  # False once released, removed or expired


@dataclass(slots=True)
class _Tenant:
    """One tenant's waiting requests in one band: FIFO, and by route key for its turns."""

    fifo: deque[Waiter[Any]] = field(default_factory=deque)
    by_key: dict[bytes, deque[Waiter[Any]]] = field(default_factory=dict)
    count: int = 0

    def head(self) -> Waiter[Any]:
        fifo = self.fifo
        while not fifo[0].waiting:  # removed ones leave lazily; count > 0 guarantees one
            fifo.popleft()
        return fifo[0]

    def same_key(self, key: bytes) -> Waiter[Any] | None:
        queue = self.by_key.get(key)
        while queue:
            if queue[0].waiting:
                return queue[0]
            queue.popleft()
        if queue is not None:
            del self.by_key[key]
        return None


@dataclass(slots=True)
class _Band:
    tenants: dict[str, _Tenant] = field(default_factory=dict)
    # (counter, seq, tenant) of backlogged tenants; an entry whose counter is no longer
    # the tenant's is stale and skipped (lazy deletion keeps every step O(log n)).
    heap: list[tuple[float, int, str]] = field(default_factory=list)
    floor: float = 0.0  # the counter of the last tenant served: where a returning one starts


@dataclass(slots=True)
class _Turn:
    band: Band
    tenant: str
    key: bytes
    left: float  # the quantum not yet used


class FairQueue(Generic[T]):
    """Per-tenant queues in strict priority bands, released in fair order (module doc).
    ``fifo``: release in arrival order instead (the unfair baseline, for comparisons)."""

    def __init__(
        self,
        *,
        quantum_tokens: float = 4096.0,
        fifo: bool = False,
        keep_charged: bool = False,
    ) -> None:
        """``keep_charged``: keep what is charged here for `take_charged` (a cluster bus
        tells the other gateways; without one nothing is kept)."""
        if quantum_tokens < 0:
            raise ValueError("quantum_tokens must be >= 0")
        self.quantum = float(quantum_tokens)
        self.fifo = fifo
        self.counters: dict[str, float] = {}  # the tenants' VTC, weighted
        self.weights: dict[str, float] = {}  # as the tenants' last requests gave them; else 1
        # Charged here since the last `take_charged`; None: not kept (no bus to tell).
        self._charged: dict[str, float] | None = {} if keep_charged else None
        self._bands = {band: _Band() for band in BANDS}
        self._deadlines: list[tuple[float, int, Waiter[T]]] = []
        self._seq = itertools.count()
        self._turn: _Turn | None = None
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def waiting(self) -> dict[str, int]:
        """Requests waiting per tenant (every band), for tenants with any."""
        totals: dict[str, int] = {}
        for band in self._bands.values():
            for name, t in band.tenants.items():
                totals[name] = totals.get(name, 0) + t.count
        return totals

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    # -- arrivals and departures -----------------------------------------------------------
    def push(
        self,
        item: T,
        tenant: str,
        cost: float,
        *,
        deadline: float,
        band: Band = Band.INTERACTIVE,
        locality: bytes | None = None,
        weight: float = 1.0,
    ) -> Waiter[T]:
        """A request starts waiting; returns its entry (for `remove`). ``weight``: its
        tenant's fair share (the tenant's limits say it; the latest request's holds)."""
        b = self._bands.get(band)
        if b is None:
            raise ValueError(f"unknown priority band {band!r}; expected one of {BANDS}")
        weight = sane_weight(weight)  # whatever slipped past the parser: never inf or NaN
        if weight == 1.0:
            self.weights.pop(tenant, None)
        else:
            self.weights[tenant] = weight
        seq = next(self._seq)
        waiter = Waiter(
            item, tenant, band=band, cost=cost, locality=locality, deadline=deadline, seq=seq
        )
        t = b.tenants.get(tenant)
        if t is None:
            counter = self.counters.get(tenant, 0.0)
            if not any(tenant in other.tenants for other in self._bands.values()):
                # Back from idle: no credit for the time it sent nothing (VTC's lift). A
                # tenant already waiting in the other band is not idle: its counter, which
                # orders it there too, stays what its service made it.
                counter = max(counter, self._level(b))
                self.counters[tenant] = counter
            t = b.tenants[tenant] = _Tenant()
            heapq.heappush(b.heap, (counter, seq, tenant))
        t.fifo.append(waiter)
        if locality is not None:
            t.by_key.setdefault(locality, deque()).append(waiter)
        t.count += 1
        self._len += 1
        heapq.heappush(self._deadlines, (deadline, seq, waiter))
        return waiter

    def serve_now(
        self,
        tenant: str,
        cost: float,
        *,
        band: Band = Band.INTERACTIVE,
        locality: bytes | None = None,
        weight: float = 1.0,
    ) -> bool:
        """A request released on arrival, when nothing waits: its tenant is lifted and
        charged, and the turn moves, exactly as `push` then `pop` would (the gateway's fast
        path: no Waiter, no deadline). False, and nothing changed, when a request waits:
        then it must `push` and wait its turn behind them."""
        if self._len:
            return False
        b = self._bands.get(band)
        if b is None:
            raise ValueError(f"unknown priority band {band!r}; expected one of {BANDS}")
        weight = sane_weight(weight)
        if weight == 1.0:
            self.weights.pop(tenant, None)
        else:
            self.weights[tenant] = weight
        counter = self.counters[tenant] = max(self.counters.get(tenant, 0.0), b.floor)
        charge = cost / weight
        turn = self._turn
        if (
            not self.fifo
            and turn is not None
            and turn.left > 0
            and (turn.band, turn.tenant, turn.key) == (band, tenant, locality)
        ):
            turn.left -= charge  # the same prefix, within the quantum: the turn goes on
        else:
            b.floor = counter
            self._turn = (
                None if locality is None else _Turn(band, tenant, locality, self.quantum - charge)
            )
        self._charge(tenant, charge)
        return True

    def remove(self, waiter: Waiter[T]) -> bool:
        """Take a waiting request out (its client left); False if it no longer waits."""
        if not waiter.waiting:
            return False
        self._leave(waiter)
        return True

    def expire(self, now: float) -> list[Waiter[T]]:
        """The requests whose deadline has passed at ``now``, taken out of the queue."""
        out: list[Waiter[T]] = []
        heap = self._deadlines
        while heap and (not heap[0][2].waiting or heap[0][0] <= now):
            waiter = heapq.heappop(heap)[2]
            if waiter.waiting:
                self._leave(waiter)
                out.append(waiter)
        return out

    def next_deadline(self) -> float | None:
        """When `expire` next has something to hand back; None while nothing waits."""
        heap = self._deadlines
        while heap and not heap[0][2].waiting:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _leave(self, waiter: Waiter[Any]) -> None:
        waiter.waiting = False
        b = self._bands[waiter.band]
        t = b.tenants[waiter.tenant]
        t.count -= 1
        self._len -= 1
        if not self._len:
            self._deadlines.clear()  # all of them released or gone: nothing left to expire
        if t.count == 0:
            del b.tenants[waiter.tenant]  # its heap entries go stale: skipped when seen
            if not b.tenants:
                b.heap.clear()

    # -- release ---------------------------------------------------------------------------
    def peek(self) -> Waiter[T] | None:
        """The request `pop` would release now, left waiting (None if none waits): the
        shell checks a replica can take it before releasing it."""
        chosen = self._next()
        return None if chosen is None else chosen[0]

    def candidates(self) -> Iterator[Waiter[T]]:
        """The requests a release may take, best first: `peek`'s, then every other
        tenant's oldest by counter, all in the first band with any (bands stay strict).
        The shell releases the first one a replica can take (`pop(waiter)`), so a request
        its replicas' gate holds back does not hold up the other tenants' (work-conserving,
        as VTC serves whoever can be served). Lazy; stale once the queue changes."""
        chosen = self._next()
        if chosen is None:
            return
        first = chosen[0]
        yield first
        if self.fifo:
            return
        tenants = self._bands[first.band].tenants
        heads = sorted(
            (t.head() for name, t in tenants.items() if name != first.tenant),
            key=lambda w: (self.counters[w.tenant], w.seq),
        )
        first_tenant = tenants.get(first.tenant)
        if first_tenant is not None and first_tenant.head() is not first:
            yield first_tenant.head()  # the turn's tenant's oldest, past its same-key run
        yield from heads

    def pop(self, waiter: Waiter[T] | None = None) -> Waiter[T] | None:
        """Release the next request in fair order, or ``waiter`` (one of `candidates`),
        charged to its tenant; None if none waits."""
        chosen = self._next()
        if chosen is None:
            return None
        if waiter is not None and waiter is not chosen[0]:
            chosen = (waiter, False)  # another tenant's turn (or a new one of the same)
        waiter, continues = chosen
        b = self._bands[waiter.band]
        tenant = waiter.tenant
        charge = waiter.cost / self._weight(tenant)
        if continues:
            assert self._turn is not None
            self._turn.left -= charge
        else:
            b.floor = self.counters[tenant]
            key = waiter.locality
            self._turn = (
                None if key is None else _Turn(waiter.band, tenant, key, self.quantum - charge)
            )
        self._leave(waiter)
        self._charge(tenant, charge)
        return waiter

    def _next(self) -> tuple[Waiter[T], bool] | None:
        """(the next request, whether it continues the current turn)."""
        for name in BANDS:
            b = self._bands[name]
            if not b.tenants:
                continue
            if self.fifo:
                return self._oldest(b), False
            turn = self._turn
            if turn is not None and turn.band == name and turn.left > 0:
                t = b.tenants.get(turn.tenant)
                same = t.same_key(turn.key) if t is not None else None
                if same is not None:
                    return same, True
            self._live(b)
            return b.tenants[b.heap[0][2]].head(), False
        return None

    @staticmethod
    def _oldest(b: _Band) -> Waiter[T]:
        return min((t.head() for t in b.tenants.values()), key=lambda w: w.seq)

    def correct(self, tenant: str, charged: float, used: float) -> None:
        """A released request ended: its tenant is charged what it used (metered) instead
        of the estimate ``charged`` at release."""
        if tenant in self.counters:
            self._charge(tenant, (used - charged) / self._weight(tenant))

    def take_charged(self) -> dict[str, float]:
        """What this queue charged each tenant (weighted, as its counter moved) since the
        last call, corrections included: the cluster bus publishes it."""
        charged = self._charged
        if not charged:
            return {}
        self._charged = {}
        return charged

    def charge_elsewhere(self, tenant: str, amount: float) -> None:
        """Another gateway charged ``tenant`` ``amount`` (weighted, from its
        `take_charged`): the counters are global, so it moves the counter here too.

        A tenant waiting here is backlogged: its counter moves as if served here. One not
        waiting here was served elsewhere, so it is not idle for the fleet: it is first
        lifted as a tenant returning here would be (to the lowest level of the bands in
        use), then charged. Without the lift, the service it received elsewhere while this
        gateway's level rose past its old counter would be swallowed by the lift when it
        next arrives, and it would take a turn here it already had elsewhere. A correction
        downward (a released request that used less than its estimate) is applied as is.
        """
        if not (math.isfinite(amount) and amount):
            return
        waits = any(tenant in b.tenants for b in self._bands.values())
        if not waits and amount > 0:
            levels = [self._level(b) for b in self._bands.values() if b.tenants or b.floor]
            lifted = max(self.counters.get(tenant, 0.0), min(levels, default=0.0))
            self.counters[tenant] = lifted
        elif tenant not in self.counters:
            return  # nothing here to correct
        self._move(tenant, amount)

    def _charge(self, tenant: str, amount: float) -> None:
        """Charge a tenant for service given here (told to the others by the bus)."""
        charged = self._charged
        if charged is not None:
            charged[tenant] = charged.get(tenant, 0.0) + amount
        self._move(tenant, amount)

    def _move(self, tenant: str, amount: float) -> None:
        """Move a tenant's counter, and its place in every band it waits in. A move that
        would leave the counter inf or NaN is not made: the heap orders by counters, and
        a NaN one never equals itself (`_live` would drop every entry of the tenant)."""
        counter = self.counters[tenant] + amount
        if not math.isfinite(counter):
            return
        self.counters[tenant] = counter
        for b in self._bands.values():
            if tenant in b.tenants:
                heapq.heappush(b.heap, (counter, next(self._seq), tenant))

    def _live(self, b: _Band) -> None:
        """Drop stale entries off the top of ``b``'s heap; should none be left while
        tenants wait there (which `_move` prevents), rebuild it from them rather than let
        `_next` index an empty heap."""
        heap = b.heap
        while heap:
            counter, _, tenant = heap[0]
            if tenant in b.tenants and counter == self.counters[tenant]:
                return
            heapq.heappop(heap)
        for tenant in b.tenants:
            if not math.isfinite(self.counters.get(tenant, math.nan)):
                self.counters[tenant] = b.floor if math.isfinite(b.floor) else 0.0
            heapq.heappush(heap, (self.counters[tenant], next(self._seq), tenant))

    def _level(self, b: _Band) -> float:
        """Where a tenant returning from idle starts in ``b``: the smallest counter of
        those waiting there, or with none waiting the last one served there."""
        self._live(b)
        return b.heap[0][0] if b.heap else b.floor


SHORT: Final = 16  # a prompt within 1/SHORT of the prefill budget is not held by it
# With the budget derived from the replica (no max_prefill_tokens set): a replica whose
# largest engine step is smaller than MIN_STEP_TOKENS has not told its step size yet
# (or runs none), and gets FALLBACK_STEP_TOKENS (vLLM's --max-num-batched-tokens of an
# OpenAI server on an H100-class GPU: larger than most, so it holds less, not more).
MIN_STEP_TOKENS: Final = 256
FALLBACK_STEP_TOKENS: Final = 8192
# With the derived budget, a prompt of at most this many engine steps is never held: vLLM
# starts it beside the running prefills, and the gateway's estimate (a token per 4 bytes)
# may put a one-step prompt past one step.
SHORT_STEPS: Final = 2


def step_tokens(largest_step: int | None) -> int | None:
    """A replica's engine step size from the largest step it reports having run; None
    when that is too little to tell (no report, or below `MIN_STEP_TOKENS`)."""
    if largest_step is None or largest_step < MIN_STEP_TOKENS:
        return None
    return largest_step


class SaturationGate:
    """Whether a replica may take one more request, from what its probes showed.

    A replica runs up to some capacity and queues the rest (vLLM's
    ``num_requests_waiting``). A probe that shows a queue tells the capacity: what it runs
    (``num_requests_running``; without that metric, the requests in flight on it minus
    those waiting). From then on its queue is estimated at every moment as the requests in
    flight on it (this gateway's and, through the cluster bus, the others') minus that
    capacity: a request dispatched since the probe counts at once (as waiting, even while
    still on its way), one that ended frees its place at once, so the estimate does not
    lag the probes. The replica is saturated when
    that reaches ``max_waiting`` (with 0: when every place it runs is taken). A probe with no
    queue only raises the capacity (it ran all it had); a replica whose capacity is not
    known yet (no queue seen) or that reports no queue metric is never held back.

    A short queue is not enough: vLLM computes the prompts it runs oldest first, so a
    request it starts still waits for the prefills ahead of it. With ``max_prefill_tokens``
    the replica also takes no request that would bring the prompt tokens sent to it and not
    yet prefilled (estimated uncached, every gateway's) over that budget: long prompts go
    one budget at a time. A replica with none takes any prompt, so one longer than the
    budget still goes, alone; a short one (at most 1/`SHORT` of the budget) is never held
    by it, so, released first in fair order, it starts beside the long ones (as vLLM does
    when `--long-prefill-token-threshold` leaves it part of a step) instead of queueing
    behind them. 0: no budget.

    ``max_prefill_tokens`` None (the default): each replica's budget is its own engine
    step, as its probes report it (`stepped`; `FALLBACK_STEP_TOKENS` until they do), and a
    prompt of at most `SHORT_STEPS` steps is never held by it: a longer prompt waits
    while the replica has any prompt to prefill, so long prompts are prefilled one at a
    time per replica and a short one starts within the step under way.
    """

    def __init__(self, max_waiting: int, max_prefill_tokens: int | None = 0) -> None:
        if max_waiting < 0 or (max_prefill_tokens is not None and max_prefill_tokens < 0):
            raise ValueError("max_waiting and max_prefill_tokens must be >= 0")
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self._capacity: dict[ReplicaId, int] = {}
        self._step: dict[ReplicaId, int] = {}  # replica -> its engine step, as reported

    def stepped(self, replica: ReplicaId, largest_step: int | None) -> int | None:
        """A probe read the largest engine step the replica has run (None: not reported);
        returns the step size now taken for it, None when it falls back
        (`FALLBACK_STEP_TOKENS`). Without a derived budget it only records it."""
        step = step_tokens(largest_step)
        if step is None:
            self._step.pop(replica, None)
        else:
            self._step[replica] = step
        return step

    def prefill_budget(self, replica: ReplicaId) -> tuple[int, float]:
        """(the replica's prefill budget, the longest prompt it never holds); (0, 0): none."""
        budget = self.max_prefill_tokens
        if budget is None:
            step = self._step.get(replica, FALLBACK_STEP_TOKENS)
            return step, float(step * SHORT_STEPS)
        return budget, budget / SHORT

    def probed(
        self,
        replica: ReplicaId,
        inflight: int,
        waiting: float | None,
        running: float | None = None,
    ) -> None:
        """A probe saw ``waiting`` queued and ``running`` (None: not reported) with
        ``inflight`` requests in flight there."""
        if waiting is None:
            self._capacity.pop(replica, None)
            return
        ran = max(inflight - int(waiting), 0) if running is None else int(running)
        if waiting > 0:
            # At least 1: a request counts as waiting until the engine's next step starts
            # it (vLLM), so a probe between steps can see a queue with nothing running; a
            # capacity of 0 would then hold every request back, and with nothing sent
            # nothing would run for a later probe to correct it.
            self._capacity[replica] = max(ran, 1)
        elif replica in self._capacity:
            self._capacity[replica] = max(self._capacity[replica], ran)

    def waiting(self, replica: ReplicaId, inflight: int) -> int | None:
        """The replica's estimated queue now; None while its capacity is unknown."""
        capacity = self._capacity.get(replica)
        return None if capacity is None else max(inflight - capacity, 0)

    def saturated(
        self, replica: ReplicaId, inflight: int, prefill: float = 0.0, request: float = 0.0
    ) -> bool:
        """Whether one more request would queue more than ``max_waiting`` there, or
        (``prefill``: the replica's prompt tokens not yet prefilled, ``request``: this
        request's) bring its prefill backlog over ``max_prefill_tokens``."""
        if prefill > 0:
            budget, short = self.prefill_budget(replica)
            if budget and prefill + request > budget and request > short:
                return True
        capacity = self._capacity.get(replica)
        return capacity is not None and inflight - capacity >= self.max_waiting

    def forget(self, keep: Iterable[ReplicaId]) -> None:
        """Only the replicas in ``keep`` remain (a reload removed the others)."""
        kept = set(keep)
        for replica in [r for r in self._capacity if r not in kept]:
            del self._capacity[replica]
        for replica in [r for r in self._step if r not in kept]:
            del self._step[replica]
