"""Replica health as small state machines fed events: no clocks, no sockets.

- Breaker (passive): consecutive failed exchanges open it; after ``open_s``, or at once
  when an active probe succeeds, it lets one trial request through (half-open); the trial's
  outcome closes or re-opens it.
- Probe (active): ``failures`` consecutive failed /health probes take a replica out; one
  good probe brings it back.
- Overload: the replica's own queue (vLLM's ``vllm:num_requests_waiting``) with
  hysteresis. An overloaded replica is skipped when picking but stays a member, so the
  ranking of every key is unchanged and its traffic returns when the queue drains.
- Isolation: the isolation canary's verdicts (routing/canary.py). FAILED takes the
  replica out at once, only PASSED brings it back; INCONCLUSIVE changes nothing.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from saltgate.routing.canary import Verdict

WAITING_METRIC = b"vllm:num_requests_waiting"
RUNNING_METRIC = b"vllm:num_requests_running"


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class Breaker:
    failure_threshold: int
    open_s: float
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    trial_started: float | None = None

    def allows(self, now: float) -> bool:
        """Whether a request may be sent now (pure: `started` records the trial)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now - self.opened_at >= self.open_s
        # Half-open: one trial at a time; a trial nobody reported on expires after open_s.
        return self.trial_started is None or now - self.trial_started >= self.open_s

    def started(self, now: float) -> None:
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.open_s:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN:
            self.trial_started = now

    def succeeded(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.trial_started = None

    def failed(self, now: float) -> None:
        self.failures += 1
        if self.state is not BreakerState.CLOSED or self.failures >= self.failure_threshold:
            self.state = BreakerState.OPEN
            self.opened_at = now
            self.trial_started = None

    def probe_succeeded(self) -> None:
        """An active probe answered: an open breaker may try one request right away."""
        if self.state is BreakerState.OPEN:
            self.state = BreakerState.HALF_OPEN
            self.trial_started = None


@dataclass(slots=True)
class Probe:
    failure_threshold: int
    failures: int = 0

    @property
    def up(self) -> bool:
        return self.failures < self.failure_threshold

    def observed(self, ok: bool) -> None:
        self.failures = 0 if ok else self.failures + 1

    def refused(self) -> None:
        """The replica refused the gateway's credentials: down at once, not after
        `failure_threshold` probes (waiting would only show tenants its 401s)."""
        self.failures = max(self.failures + 1, self.failure_threshold)


@dataclass(slots=True)
class Overload:
    enter_waiting: float
    exit_waiting: float
    overloaded: bool = False

    def observed(self, waiting: float | None) -> None:
        """Feed a queue length; None (no metrics) means nothing to hold against it."""
        if waiting is None:
            self.overloaded = False
        elif self.overloaded:
            self.overloaded = waiting > self.exit_waiting
        else:
            self.overloaded = waiting >= self.enter_waiting


@dataclass(slots=True)
class Isolation:
    """Fail closed: out from a canary FAILED until a canary PASSED."""

    failed: bool = False

    def observed(self, verdict: Verdict) -> None:
        if verdict is not Verdict.INCONCLUSIVE:
            self.failed = verdict is Verdict.FAILED


@dataclass(slots=True)
class ReplicaHealth:
    breaker: Breaker
    probe: Probe
    overload: Overload
    isolation: Isolation = field(default_factory=Isolation)

    def available(self, now: float) -> bool:
        """A member that may be picked: its probes pass, its last conclusive canary did
        not fail, and its breaker lets a request by."""
        return self.probe.up and not self.isolation.failed and self.breaker.allows(now)

    def probed(self, ok: bool) -> None:
        self.probe.observed(ok)
        if ok:
            self.breaker.probe_succeeded()


def parse_waiting(metrics: bytes) -> float | None:
    """Sum of ``vllm:num_requests_waiting`` samples in a Prometheus text page, or None."""
    return parse_gauge(metrics, WAITING_METRIC)


STEP_METRIC = b"vllm:iteration_tokens_total_bucket"


def parse_largest_step(metrics: bytes) -> int | None:
    """The most tokens one engine step has computed, as far as vLLM's
    ``vllm:iteration_tokens_total`` histogram tells: the smallest bucket bound that holds
    every step (every label set summed); the largest finite bound when some step was past
    it. None without the histogram or before any step."""
    buckets: dict[float, float] = {}
    for line in metrics.splitlines():
        if not line.startswith(STEP_METRIC) or b'le="' not in line:
            continue
        start = line.index(b'le="') + 4
        fields = line[line.rfind(b"}") + 1 :].split()
        try:
            bound = float(line[start : line.index(b'"', start)])
            count = float(fields[0]) if fields else math.nan
        except ValueError:
            continue
        if count >= 0 and not math.isnan(bound):
            buckets[bound] = buckets.get(bound, 0.0) + count
    total = buckets.pop(math.inf, None)
    if not total or not buckets:
        return None
    bounds = sorted(buckets)
    for bound in bounds:
        if buckets[bound] >= total:
            return int(bound)
    return int(bounds[-1])


def parse_gauge(metrics: bytes, name: bytes) -> float | None:
    """Sum of a gauge's samples (every label set) in a Prometheus text page, or None."""
    total: float | None = None
    for line in metrics.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest[:1] not in (b"{", b" "):
            continue  # another metric sharing the prefix
        if rest.startswith(b"{"):
            rest = rest[rest.rfind(b"}") + 1 :]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if value >= 0:  # NaN compares false: left out with negatives
            total = (total or 0.0) + value
    return total
