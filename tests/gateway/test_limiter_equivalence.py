"""The two limiters agree: the same random demand fed to the in-process limiter
(governance/limits.py) and to the fleet's Redis script (gateway/shared_limits.py) gets the
same decision every time: admitted or not, the limit that refused with its usage and retry
time, and the quotas the rate headers show.

Redis's script reads its clock with TIME; here it reads a hash the test sets instead (the
only change to the script), so both limiters see the same instants. Times are multiples
of 1/64 s, exact in binary floating point and in microseconds, so the window's edge
(an entry made at t counts while t + 60 s > now) falls on the same side in both.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from redis.asyncio import Redis

from saltgate.gateway.shared_limits import ADMIT_SCRIPT, SharedLimits, SharedTicket
from saltgate.governance.kinds import Scope, Subject
from saltgate.governance.limits import Demand, Denial, Governor, Limits, Quota, Ticket
from saltgate_devkit.services import RedisServer

CLOCK = "sg:test:clock"
TICK_S = 1 / 64
LEASE_TTL_S = 8.0
SUBJECTS = (Subject(Scope.TENANT, "tn_1"), Subject(Scope.KEY, "key_1"))
SEQUENCES = 40
STEPS = 80

TEST_CLOCK = "redis.call('HMGET', '" + CLOCK + "', 's', 'us')"


def with_test_clock(script: str) -> str:
    assert script.count("redis.call('TIME')") == 1
    return script.replace("redis.call('TIME')", TEST_CLOCK)


def random_limits(rng: random.Random) -> Limits:
    """Small limits, so that sequences of a few dozen requests hit every edge."""
    chosen: dict[str, int] = {}
    while not chosen:
        if rng.random() < 0.5:
            chosen["rpm"] = rng.randint(0, 6)
        if rng.random() < 0.4:
            chosen["input_tpm"] = rng.randint(0, 400)
        if rng.random() < 0.4:
            chosen["output_tpm"] = rng.randint(0, 400)
        if rng.random() < 0.4:
            chosen["concurrency"] = rng.randint(0, 3)
        if rng.random() < 0.4:
            chosen["budget_micro_usd"] = rng.randint(0, 30) * 100
            chosen["budget_period_s"] = rng.choice((30, 90, 120))
    return Limits(**chosen)


def random_demand(rng: random.Random) -> Demand:
    """Prices in steps of 100 micro-dollars, so spend often lands exactly on a budget."""
    return Demand(rng.randint(0, 150), rng.randint(0, 150), rng.randint(0, 8) * 100)


def used_of(rng: random.Random, demand: Demand) -> Demand:
    """What a request ends up using: at most what it reserved."""
    return Demand(
        rng.randint(0, demand.input_tokens),
        rng.randint(0, demand.output_tokens),
        rng.randint(0, demand.cost_micro_usd // 100) * 100,
    )


def advance(rng: random.Random) -> int:
    """Ticks to move the clock: often none, sometimes past a lease, a window or a period."""
    return rng.choice((0, 0, 1, 64, 64 * 3, 64 * 9, 64 * 30, 64 * 60, 64 * 61, 64 * 125))


@dataclass
class Outcome:
    admitted: bool
    denial: tuple[object, ...] | None
    quotas: tuple[tuple[object, ...], ...]


def outcome(admitted: bool, denial: Denial | None, quotas: Sequence[Quota]) -> Outcome:
    """A decision in comparable form (times to the microsecond, as Redis keeps them)."""

    def us(seconds: float | None) -> int | None:
        return None if seconds is None else round(seconds * 1_000_000)

    refused = None
    if denial is not None:
        refused = (
            denial.kind,
            denial.scope,
            denial.limit,
            denial.used,
            denial.requested,
            us(denial.retry_at),
        )
    shown = tuple((q.kind, q.limit, q.remaining, us(q.reset_s)) for q in quotas)
    return Outcome(admitted, refused, shown)


@dataclass
class Pair:
    """The two limiters, one clock."""

    governor: Governor
    shared: SharedLimits
    redis: Redis
    ticks: int = 64 * 1000
    held: list[tuple[Ticket, SharedTicket, Demand]] = field(default_factory=list)

    @property
    def now(self) -> float:
        return self.ticks * TICK_S

    async def set_clock(self) -> None:
        micros = self.ticks * 1_000_000 // 64
        await self.redis.hset(CLOCK, mapping={"s": micros // 1_000_000, "us": micros % 1_000_000})


async def run_sequence(pair: Pair, seed: int) -> list[str]:
    """Feed one random sequence to both; every step whose decisions differ, described."""
    rng = random.Random(seed)
    limits = {subject: random_limits(rng) for subject in SUBJECTS}
    for subject, given in limits.items():
        pair.governor.set_limits(subject, given)
    differences = []
    for step in range(STEPS):
        pair.ticks += advance(rng)
        await pair.set_clock()
        action = rng.random()
        if action < 0.1:  # an operator edits a limit; both keep what was admitted
            subject = rng.choice(SUBJECTS)
            limits[subject] = random_limits(rng)
            pair.governor.set_limits(subject, limits[subject])
        elif action < 0.35 and pair.held:  # a request ends
            ticket, held, demand = pair.held.pop(rng.randrange(len(pair.held)))
            used = used_of(rng, demand)
            pair.governor.settle(ticket, used, pair.now)
            await pair.shared.settle(held, used)
        else:
            subjects = SUBJECTS if rng.random() < 0.6 else SUBJECTS[:1]
            demand = random_demand(rng)
            local = pair.governor.admit(subjects, demand, pair.now)
            limited = [(s, limits[s]) for s in subjects]
            shared, denial, quotas = await pair.shared.admit(limited, demand)
            mine = outcome(local.admitted, local.denial, local.quotas)
            fleet = outcome(shared is not None, denial, quotas)
            if mine != fleet:
                differences.append(f"seed {seed} step {step}: {mine} != {fleet}")
            if local.ticket is not None and shared is not None:
                pair.held.append((local.ticket, shared, demand))
    return differences


async def compare(server: RedisServer, admit_script: str) -> list[str]:
    password = server.password_file.read_text().strip()
    differences: list[str] = []
    for seed in range(SEQUENCES):
        redis = Redis.from_url(server.url(), password=password)
        try:
            await redis.flushdb()
            shared = SharedLimits(redis, lease_ttl_s=LEASE_TTL_S)
            shared._admit = redis.register_script(admit_script)
            pair = Pair(Governor(lease_ttl_s=LEASE_TTL_S), shared, redis)
            differences += await run_sequence(pair, seed)
        finally:
            await redis.aclose()
    return differences


def test_the_python_limiter_and_the_redis_script_decide_alike(
    redis_server: RedisServer,
) -> None:
    differences = asyncio.run(compare(redis_server, with_test_clock(ADMIT_SCRIPT)))
    assert differences == [], "\n".join(differences[:5])


@pytest.mark.parametrize(
    ("original", "mutated"),
    [
        ("if used >= limit then", "if used > limit then"),  # one lease too many
        ("need = sum - limit + 1", "need = sum - limit"),  # a budget one micro-dollar late
        ("s(now - span)", "s(now - span - 1)"),  # an entry kept 1 us too long
    ],
    ids=["concurrency", "budget", "window-edge"],
)
def test_the_comparison_catches_a_script_that_differs(
    redis_server: RedisServer, original: str, mutated: str
) -> None:
    """The control: the same sequences find a one-character change to the script."""
    script = with_test_clock(ADMIT_SCRIPT)
    assert original in script
    differences = asyncio.run(compare(redis_server, script.replace(original, mutated)))
    assert differences, f"no sequence told {mutated!r} from {original!r}"
