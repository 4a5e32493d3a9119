"""The tenants' limits shared by every gateway of a cluster, in Redis (docs/limits.md).

One Lua script per admission, so Redis runs it atomically: it reads Redis's own clock
(TIME, never a gateway's), prunes each limit's log, checks every limit of the tenant and
of the key, and records the request in all of them or in none. The semantics are
saltgate.governance.limits' exactly (at most L in any 60 s window, half-open: an entry
made at t counts while t + 60 s > now), kept in Redis:

    sg:lim:<tenant|key>:<id>:<kind>      sorted set: ticket id -> its time (microseconds)
    ... :a                               hash: ticket id -> its amount
    ... :s                               the sum of the amounts in the window
    sg:lim:<tenant|key>:<id>:concurrency sorted set: ticket id -> its lease's expiry

Every key expires once its window (or the lease TTL) has passed, so a gateway killed
mid-request leaves nothing behind for longer than that.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from saltgate.gateway.cluster import CONNECT_TIMEOUT_S, bus_password
from saltgate.governance.kinds import WINDOWED, LimitKind, Scope, Subject
from saltgate.governance.limits import (
    WINDOW_S,
    Demand,
    Denial,
    Limits,
    Quota,
    Ticket,
    amounts,
    tightest,
)
from saltgate.routing.cluster import ClusterSettings

_US: Final = 1_000_000
# An admission waits at most this for Redis before the process falls back to its share.
TIMEOUT_S: Final = 0.5

# Numbers go to redis.call through %.0f: Lua's own conversion keeps 14 digits and a time
# in microseconds has 16.
ADMIT_SCRIPT: Final = """
local function s(x) return string.format('%.0f', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local totals, resets = {}, {}
local worst, worst_retry = 0, -2
for i = 1, n do
  local b = 3 + (i - 1) * 4
  local kind, limit = ARGV[b + 1], tonumber(ARGV[b + 2])
  local span, amount = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local key = KEYS[i]
  local retry = -2
  if kind == 'c' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', s(now))
    local used = redis.call('ZCARD', key)
    totals[i], resets[i] = used, now
    if used >= limit then
      retry = -1
      if limit > 0 then retry = tonumber(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2]) end
    end
  else
    local old = redis.call('ZRANGEBYSCORE', key, '-inf', s(now - span))
    local sum = tonumber(redis.call('GET', key .. ':s') or '0')
    if #old > 0 then
      for _, m in ipairs(old) do
        sum = sum - tonumber(redis.call('HGET', key .. ':a', m) or '0')
        redis.call('HDEL', key .. ':a', m)
      end
      redis.call('ZREMRANGEBYSCORE', key, '-inf', s(now - span))
      redis.call('SET', key .. ':s', s(sum))
    end
    totals[i] = sum
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    resets[i] = now
    if #last > 0 then resets[i] = tonumber(last[2]) + span end
    local need
    if kind == 'b' then need = sum - limit + 1 else need = sum + amount - limit end
    if kind == 'w' and amount > limit then
      retry = -1
    elseif kind == 'b' and limit == 0 then
      retry = -1
    elseif need > 0 then
      local entries = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
      local freed = 0
      for j = 1, #entries, 2 do
        freed = freed + tonumber(redis.call('HGET', key .. ':a', entries[j]) or '0')
        if freed >= need then retry = tonumber(entries[j + 1]) + span break end
      end
    end
  end
  if retry ~= -2 and (worst_retry ~= -1) and (retry == -1 or retry > worst_retry) then
    worst, worst_retry = i, retry
  end
end
if worst > 0 then
  local out = {0, now, worst, worst_retry}
  for i = 1, n do out[#out + 1] = totals[i]; out[#out + 1] = resets[i] end
  return out
end
local out = {1, now, 0, 0}
for i = 1, n do
  local b = 3 + (i - 1) * 4
  local kind, span, amount = ARGV[b + 1], tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local key = KEYS[i]
  local ms = math.floor(span / 1000) + 1000
  if kind == 'c' then
    redis.call('ZADD', key, s(now + ttl), id)
    redis.call('PEXPIRE', key, s(math.floor(ttl / 1000) + 1000))
    out[#out + 1] = totals[i] + 1; out[#out + 1] = now
  else
    redis.call('ZADD', key, s(now), id)
    redis.call('HSET', key .. ':a', id, s(amount))
    redis.call('SET', key .. ':s', s(totals[i] + amount))
    redis.call('PEXPIRE', key, s(ms))
    redis.call('PEXPIRE', key .. ':a', s(ms))
    redis.call('PEXPIRE', key .. ':s', s(ms))
    out[#out + 1] = totals[i] + amount; out[#out + 1] = now + span
  end
end
return out
"""

SETTLE_SCRIPT: Final = """
local function s(x) return string.format('%.0f', x) end
local id = ARGV[1]
for i = 1, #KEYS do
  local key, kind, amount = KEYS[i], ARGV[2 * i], tonumber(ARGV[2 * i + 1])
  if kind == 'c' then
    redis.call('ZREM', key, id)
  else
    local old = redis.call('HGET', key .. ':a', id)
    if old then
      redis.call('HSET', key .. ':a', id, s(amount))
      redis.call('INCRBY', key .. ':s', s(amount - tonumber(old)))
    end
  end
end
return 1
"""

# A budget's log started from the ledger's spend (gateway/admission.py), once for the
# fleet: only while Redis holds nothing for it, so the first gateway to see the subject
# seeds it and every other finds it there (the check and the writes are one script).
# ARGV: the span (us), then (age in us, amount) pairs, ages from Redis's own clock.
SEED_SCRIPT: Final = """
local function s(x) return string.format('%.0f', x) end
local key = KEYS[1]
if redis.call('EXISTS', key) == 1 or redis.call('EXISTS', key .. ':s') == 1 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local span = tonumber(ARGV[1])
local sum = 0
for i = 2, #ARGV, 2 do
  local at, amount = now - tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  if at > now - span and amount > 0 then
    local id = 'ledger:' .. ARGV[i]
    redis.call('ZADD', key, s(at), id)
    redis.call('HSET', key .. ':a', id, s(amount))
    sum = sum + amount
  end
end
if sum == 0 then return 1 end
local ms = math.floor(span / 1000) + 1000
redis.call('SET', key .. ':s', s(sum))
redis.call('PEXPIRE', key, s(ms))
redis.call('PEXPIRE', key .. ':a', s(ms))
redis.call('PEXPIRE', key .. ':s', s(ms))
return 1
"""


@dataclass(frozen=True, slots=True)
class _Spec:
    """One limit of one subject as the script checks it."""

    key: str
    kind: LimitKind
    code: str  # the kind's script_code: w (window), b (budget), c (concurrency)
    scope: Scope
    limit: int
    span_us: int
    amount: int


@dataclass(frozen=True, slots=True)
class SharedTicket:
    """An admission recorded in Redis, settled there when the request ends; `local` is
    the same admission recorded in this process's governor (gateway/admission.py), so a
    fallback to the local share counts it, settled there too."""

    id: str
    specs: tuple[_Spec, ...]
    local: Ticket | None = None


def _specs(
    limited: Sequence[tuple[Subject, Limits]], demand: Demand, window_s: float
) -> list[_Spec]:
    counted = amounts(demand)
    window_us = int(window_s * _US)
    specs = []
    for (scope, ident), limits in limited:
        prefix = f"sg:lim:{scope}:{ident}:"
        for kind in WINDOWED:
            limit = limits.windowed(kind)
            if limit is not None:
                specs.append(
                    _Spec(
                        prefix + kind,
                        kind,
                        kind.script_code,
                        scope,
                        limit,
                        window_us,
                        counted[kind],
                    )
                )
        if limits.concurrency is not None:
            specs.append(
                _Spec(
                    prefix + LimitKind.CONCURRENCY,
                    LimitKind.CONCURRENCY,
                    LimitKind.CONCURRENCY.script_code,
                    scope,
                    limits.concurrency,
                    0,
                    1,
                )
            )
        if limits.budget_micro_usd is not None and limits.budget_period_s is not None:
            span = limits.budget_period_s * _US
            specs.append(
                _Spec(
                    prefix + LimitKind.BUDGET,
                    LimitKind.BUDGET,
                    LimitKind.BUDGET.script_code,
                    scope,
                    limits.budget_micro_usd,
                    span,
                    counted[LimitKind.BUDGET],
                )
            )
    return specs


class SharedLimits:
    """The admission and settlement scripts on one Redis connection."""

    what: Final = "Redis"  # what the log lines call it (gateway/admission.py)

    def __init__(self, client: Redis, *, lease_ttl_s: float, window_s: float = WINDOW_S) -> None:
        self.client = client
        self._window_s = window_s
        self._admit = client.register_script(ADMIT_SCRIPT)
        self._settle = client.register_script(SETTLE_SCRIPT)
        self._seed = client.register_script(SEED_SCRIPT)
        self._ttl_us = int(lease_ttl_s * _US)

    async def admit(
        self, limited: Sequence[tuple[Subject, Limits]], demand: Demand
    ) -> tuple[SharedTicket | None, Denial | None, tuple[Quota, ...]]:
        """Admit into every limit or none; RedisError when Redis cannot answer."""
        ticket = self.ticket(limited, demand)
        specs = ticket.specs
        keys, args = self.admit_call(ticket)
        out = [int(v) for v in await self._admit(keys=keys, args=args)]
        admitted, now_us, worst, retry_us = out[:4]
        now = now_us / _US
        ordered = tightest(
            Quota(spec.kind, spec.limit, spec.limit - total, (reset_us - now_us) / _US)
            for spec, total, reset_us in zip(specs, out[4::2], out[5::2], strict=True)
            if spec.code == "w"
        )
        if admitted:
            return ticket, None, ordered
        spec = specs[worst - 1]
        used = out[4 + 2 * (worst - 1)]
        requested = 1 if spec.code == "c" else spec.amount
        retry_at = None if retry_us == -1 else retry_us / _US
        return (
            None,
            Denial(spec.kind, spec.scope, spec.limit, used, requested, retry_at, now),
            ordered,
        )

    async def seed_budget(
        self, subject: Subject, limits: Limits, spent: Sequence[tuple[float, int]]
    ) -> bool:
        """Start the subject's budget log (of `limits`' period) in Redis from (age in
        seconds, amount) pairs, unless Redis holds it already; True if this call seeded it.
        RedisError when Redis cannot answer."""
        scope, ident = subject
        assert limits.budget_period_s is not None
        args: list[str | int] = [limits.budget_period_s * _US]
        for age, amount in spent:
            args += [max(int(age * _US), 0), amount]
        keys = [f"sg:lim:{scope}:{ident}:{LimitKind.BUDGET}"]
        return bool(await self._seed(keys=keys, args=args))

    async def settle(self, ticket: SharedTicket, used: Demand) -> None:
        """Correct the reservations to what was used and free the lease."""
        keys, args = settle_call(ticket, used)
        await self._settle(keys=keys, args=args)

    async def aclose(self) -> None:
        await self.client.aclose()

    def ticket(self, limited: Sequence[tuple[Subject, Limits]], demand: Demand) -> SharedTicket:
        """A fresh ticket for this demand under these limits (not yet admitted)."""
        return SharedTicket(secrets.token_hex(8), tuple(_specs(limited, demand, self._window_s)))

    def admit_call(self, ticket: SharedTicket) -> tuple[list[str], list[str | int]]:
        """The KEYS and ARGV of ADMIT_SCRIPT for a ticket (saltgate-bench limits sends
        them itself, many at once)."""
        args: list[str | int] = [ticket.id, self._ttl_us, len(ticket.specs)]
        for s in ticket.specs:
            args += [s.code, s.limit, s.span_us, s.amount]
        return [s.key for s in ticket.specs], args


def settle_call(ticket: SharedTicket, used: Demand) -> tuple[list[str], list[str | int]]:
    """The KEYS and ARGV of SETTLE_SCRIPT: the ticket's reservations corrected to `used`."""
    counted = amounts(used)
    args: list[str | int] = [ticket.id]
    for s in ticket.specs:
        args += [s.code, 0 if s.code == "c" else counted[s.kind]]
    return [s.key for s in ticket.specs], args


def connect_shared_limits(settings: ClusterSettings, *, lease_ttl_s: float) -> SharedLimits:
    """The engine on its own connection to [cluster]'s Redis (connected on first use)."""
    client: Redis = Redis.from_url(
        settings.url,
        password=bus_password(settings),
        socket_connect_timeout=min(CONNECT_TIMEOUT_S, TIMEOUT_S),
        socket_timeout=TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
        client_name="saltgate-limits",
    )
    return SharedLimits(client, lease_ttl_s=lease_ttl_s)
