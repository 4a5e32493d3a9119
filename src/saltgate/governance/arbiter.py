"""One host's limits held in one place: the supervisor of `saltgate serve --workers N`
decides every worker's admissions with one `Governor`, so N workers enforce L, not N x L/N
(docs/limits.md, "Workers").

The decisions are the Governor's (limits.py), unchanged: this module is the wire between
the workers and it. The supervisor (serving/supervisor.py) carries the lines and reads the
clock; a worker (gateway/host_limits.py) writes its questions and reads the answers with
the functions below. One JSON array per line; the worker faces the network, so the
supervisor reads what it sends as data, checked (`ArbiterError`), never as code.

Worker to supervisor:

    ["a", id, subjects, demand]   admit; a subject is [scope, ident, rpm, input_tpm,
                                  output_tpm, concurrency, budget_micro_usd,
                                  budget_period_s] (null: no limit), the demand
                                  [input tokens, output tokens, cost in micro-USD]
    ["s", id, used]               settle the admission `id` (no answer); sent too for an
                                  admission whose answer came too late, used all 0
    ["b", id, subject, spent]     start a budget from the ledger: [[age_s, micro-USD], ...],
                                  unless this host's count already holds it

Supervisor to worker: `[id, 1, null, quotas]` (admitted), `[id, 0, denial, quotas]`
(refused: [kind, scope, limit, used, requested, retry_after_s or null]), `[id, seeded]`;
quotas are [[kind, limit, remaining, reset_s], ...].

Ids are the worker's own; the supervisor keeps each worker's admissions apart (a
channel per worker), and when a worker is gone it settles what the worker left at its
reservations: the leases come back, the windows keep what was reserved.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Final

import orjson

from saltgate.governance.kinds import LimitKind, Scope, Subject
from saltgate.governance.limits import (
    DEFAULT_LEASE_TTL_S,
    WINDOW_S,
    Demand,
    Denial,
    Governor,
    Limits,
    Quota,
    Ticket,
)

_LIMIT_FIELDS: Final = tuple(f.name for f in fields(Limits))
_SCOPES: Final = tuple(Scope)
# A line from a worker is at most this long (a budget's spend over a year in minute rollups
# is about 10 MB); the stream readers of both ends take this limit.
MAX_LINE_BYTES: Final = 32 * 1024 * 1024
ZERO: Final = Demand(0, 0, 0)


class ArbiterError(ValueError):
    """A worker's line the supervisor cannot read: it is dropped, with a log line."""


@dataclass(frozen=True, slots=True)
class Answer:
    """The supervisor's answer to one admission, as the worker reads it."""

    admitted: bool
    denial: Denial | None
    quotas: tuple[Quota, ...]


class Arbiter:
    """The host's one count: every worker's admissions, through one Governor.

    ``share``: `[limits] share`, the gateways (hosts) that serve the same tenants without
    [cluster]: this host holds floor(L / share) of each limit, its workers together.
    """

    def __init__(
        self,
        *,
        share: int = 1,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        window_s: float = WINDOW_S,
    ) -> None:
        self.governor = Governor(lease_ttl_s=lease_ttl_s, window_s=window_s)
        self.share = share
        self._held: dict[int, dict[int, tuple[Ticket, Demand]]] = {}  # channel -> admissions
        self._seeded: dict[Subject, int] = {}  # subject -> the budget period started

    def answer(self, channel: int, line: bytes, now: float) -> bytes | None:
        """The answer line to a worker's line (None for a settlement); ArbiterError when
        the line is not one of the messages above."""
        try:
            message = orjson.loads(line)
            op, ident = message[0], message[1]
            if type(ident) is not int:
                raise ArbiterError("an id must be an integer")
            if op == "a" and len(message) == 4:
                return self._admit(channel, ident, message[2], message[3], now)
            if op == "s" and len(message) == 3:
                self._settle(channel, ident, _demand(message[2]), now)
                return None
            if op == "b" and len(message) == 4:
                return self._seed(ident, message[2], message[3], now)
        except (orjson.JSONDecodeError, IndexError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ArbiterError):
                raise
            raise ArbiterError(f"unreadable: {type(exc).__name__}: {exc}") from None
        raise ArbiterError(f"unknown message {str(op)[:20]!r}")

    def forget(self, channel: int, now: float) -> int:
        """The worker of `channel` is gone: its admissions end as reserved (leases back,
        windows unchanged). How many it left."""
        held = self._held.pop(channel, {})
        for ticket, demand in held.values():
            self.governor.settle(ticket, demand, now)
        return len(held)

    def holding(self, channel: int) -> int:
        """Admissions of a worker not settled yet."""
        return len(self._held.get(channel, ()))

    def _install(self, given: object) -> Subject:
        if not isinstance(given, list) or len(given) != 2 + len(_LIMIT_FIELDS):
            raise ArbiterError("a subject is [scope, id, *limits]")
        scope, ident = given[0], given[1]
        if scope not in _SCOPES or type(ident) is not str:
            raise ArbiterError("a subject's scope is tenant or key, its id a string")
        subject = Subject(Scope(scope), ident)
        limits = _limits(tuple(given[2:]), self.share)
        if subject in self._seeded and not self.governor.governs((subject,)):
            del self._seeded[subject]  # its limits were cleared: a budget set anew starts again
        self.governor.set_limits(subject, limits)
        return subject

    def _admit(
        self, channel: int, ident: int, subjects: object, demand: object, now: float
    ) -> bytes:
        if not isinstance(subjects, list) or len(subjects) > len(_SCOPES):
            raise ArbiterError("at most a tenant and a key")
        names = [self._install(s) for s in subjects]
        wanted = _demand(demand)
        decision = self.governor.admit(names, wanted, now)
        quotas = [[q.kind, q.limit, q.remaining, q.reset_s] for q in decision.quotas]
        if decision.ticket is not None:
            self._held.setdefault(channel, {})[ident] = (decision.ticket, wanted)
            return orjson.dumps([ident, 1, None, quotas])
        d = decision.denial
        assert d is not None
        denial = [d.kind, d.scope, d.limit, d.used, d.requested, d.retry_after_s]
        return orjson.dumps([ident, 0, denial, quotas])

    def _settle(self, channel: int, ident: int, used: Demand, now: float) -> None:
        held = self._held.get(channel)
        admitted = None if held is None else held.pop(ident, None)
        if admitted is not None:  # unknown: refused, or settled already
            self.governor.settle(admitted[0], used, now)

    def _seed(self, ident: int, subject: object, spent: object, now: float) -> bytes:
        name = self._install(subject)
        limits = self.governor.limits_of(name)
        period = None if limits is None else limits.budget_period_s
        if period is None or self._seeded.get(name) == period:
            return orjson.dumps([ident, 0])
        if not isinstance(spent, list):
            raise ArbiterError("spend is [[age_s, amount], ...]")
        # This host holds budget / share: it starts with its share of what was spent
        # (rounded up), so the hosts together admit at most what is left.
        share = [(now - _number(age), -(-_count(amount) // self.share)) for age, amount in spent]
        self.governor.seed_budget(name, share, now)
        self._seeded[name] = period
        return orjson.dumps([ident, 1])


@functools.lru_cache(maxsize=4096)
def _limits(values: tuple[object, ...], share: int) -> Limits:
    """A subject's limits from the wire, this host's share of them; cached per distinct
    limits (every admission names them)."""
    if any(v is not None and type(v) is not int for v in values):
        raise ArbiterError("a limit is an integer or null")
    given = dict(zip(_LIMIT_FIELDS, values, strict=True))
    return Limits(**given).share(share)  # type: ignore[arg-type]  # checked above


def _demand(given: object) -> Demand:
    if not isinstance(given, list) or len(given) != 3:
        raise ArbiterError("a demand is [input, output, cost]")
    return Demand(_count(given[0]), _count(given[1]), _count(given[2]))


def _count(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ArbiterError("an amount is a non-negative integer")
    return value


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ArbiterError("an age is a non-negative number of seconds")
    return float(value)


# -- the worker's side ---------------------------------------------------------------------


def _subject(subject: Subject, limits: Limits) -> list[object]:
    return [*subject, *(getattr(limits, name) for name in _LIMIT_FIELDS)]


def admit_line(ident: int, limited: Sequence[tuple[Subject, Limits]], demand: Demand) -> bytes:
    """A worker's question: may this demand be admitted under these subjects' limits?"""
    subjects = [_subject(s, limits) for s, limits in limited]
    wanted = [demand.input_tokens, demand.output_tokens, demand.cost_micro_usd]
    return orjson.dumps(["a", ident, subjects, wanted]) + b"\n"


def settle_line(ident: int, used: Demand) -> bytes:
    """A worker's settlement of its admission `ident` (ZERO: an answer that came too late)."""
    return (
        orjson.dumps(["s", ident, [used.input_tokens, used.output_tokens, used.cost_micro_usd]])
        + b"\n"
    )


def seed_line(
    ident: int, subject: Subject, limits: Limits, spent: Sequence[tuple[float, int]]
) -> bytes:
    """A worker's request to start a budget from the ledger's (age in seconds, amount)."""
    return orjson.dumps(["b", ident, _subject(subject, limits), [list(p) for p in spent]]) + b"\n"


def answer_id(line: bytes) -> tuple[int, list[object]]:
    """The id an answer line is for, and the answer; ValueError if it is not one."""
    answer = orjson.loads(line)
    if not isinstance(answer, list) or not answer or type(answer[0]) is not int:
        raise ValueError("an answer starts with its id")
    return answer[0], answer


def read_admission(answer: list[object], now: float) -> Answer:
    """An admission's answer, its times on the worker's clock `now`."""
    _, admitted, denial, quotas = answer
    assert isinstance(quotas, list)
    read = tuple(
        Quota(LimitKind(k), limit, remaining, reset) for k, limit, remaining, reset in quotas
    )
    if admitted:
        return Answer(True, None, read)
    assert isinstance(denial, list)
    kind, scope, limit, used, requested, retry = denial
    retry_at = None if retry is None else now + retry
    denied = Denial(LimitKind(kind), Scope(scope), limit, used, requested, retry_at, now)
    return Answer(False, denied, read)
