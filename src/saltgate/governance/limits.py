"""Exact limits per tenant and per key: a sliding log per limit, one atomic admission.

A limit L means at most L in ANY window of `WINDOW_S` seconds (half-open: an entry made at
time t counts in every window (s - 60, s] with t <= s < t + 60). Fixed windows admit 2 x L
across a boundary and a bucket of capacity L admits 2 x L in its first minute; a log of
(time, amount) entries does neither and tells a denied caller exactly when enough of it
leaves the window. `Governor.admit` checks every limit of the tenant and of the key
together and either records a reservation in all of them or in none.

Tokens are reserved at admission (the prompt estimate as uncached input, the request's
output allowance as output, their price as spend) and corrected when the request ends
(`Governor.settle`): a request that ends early returns what it did not use. A concurrency
lease that is never settled (a lost request) expires after `lease_ttl_s`; its token entries
leave the window after a minute like any other and its reserved spend stays charged (an
upper bound of what it cost).
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Final

from saltgate.governance.kinds import WINDOWED, LimitKind, Scope, Subject

# The kinds as module constants: reading an enum member off its class costs ~70 ns in
# Python 3.11, and an admission reads them for every limit of every subject.
_REQUESTS, _INPUT_TOKENS, _OUTPUT_TOKENS, _CONCURRENCY, _BUDGET = LimitKind
_COUNTED: Final = (*WINDOWED, _BUDGET)  # the kinds kept as logs
_WINDOWED_FIELDS: Final = {
    _REQUESTS: "rpm",
    _INPUT_TOKENS: "input_tpm",
    _OUTPUT_TOKENS: "output_tpm",
}

WINDOW_S: Final = 60.0
# What a request without max_tokens / max_completion_tokens / max_output_tokens reserves
# for its output. OpenAI counts max_tokens when given; without it the reply is bounded only
# by the model's context, so the gateway reserves this much and corrects it at the end.
DEFAULT_OUTPUT_ALLOWANCE: Final = 1024
DEFAULT_LEASE_TTL_S: Final = 600.0


DURATION_RE: Final = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float | None:
    """ "90m", "24h", "30d" as seconds; None when the text is not such a duration."""
    m = DURATION_RE.fullmatch(text.strip())
    return None if m is None else float(m.group(1)) * _UNIT_S[m.group(2)]


@dataclass(frozen=True, slots=True)
class Limits:
    """One tenant's or key's limits; None means no limit of that kind.

    ``budget_micro_usd`` is spend per ``budget_period_s`` (a sliding period, like the
    minute of the others), priced as the ledger prices requests (prices.py). A tenant's
    fair-share weight is not a limit: it is the tenant's own setting (governance/weight.py).
    """

    rpm: int | None = None
    input_tpm: int | None = None
    output_tpm: int | None = None
    concurrency: int | None = None
    budget_micro_usd: int | None = None
    budget_period_s: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"limit {f.name} must be a non-negative integer, got {value!r}")
        if (self.budget_micro_usd is None) != (self.budget_period_s is None):
            raise ValueError("a budget needs both an amount and a period")
        if self.budget_period_s == 0:
            raise ValueError("a budget period must be at least 1 second")

    def to_json(self) -> str | None:
        """The stored form: a JSON object of the limits set; None (SQL NULL) for none."""
        if self.empty:
            return None
        return json.dumps(
            {
                f.name: getattr(self, f.name)
                for f in fields(self)
                if getattr(self, f.name) is not None
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, stored: str | None) -> Limits | None:
        """Limits from their stored form (None for SQL NULL). A ``weight`` there is
        ignored: it was stored there before schema version 12 (now tenants.weight), and a
        saltgate of that age still running beside a migrated store may write one."""
        if stored is None:
            return None
        given = json.loads(stored)
        given.pop("weight", None)
        return cls(**given)

    @property
    def empty(self) -> bool:
        """True when nothing is set (stored as SQL NULL)."""
        return all(getattr(self, f.name) is None for f in fields(self))

    def windowed(self, kind: LimitKind) -> int | None:
        """The per-minute limit of a windowed kind."""
        value: int | None = getattr(self, _WINDOWED_FIELDS[kind])
        return value

    def share(self, parts: int) -> Limits:
        """This limit split between `parts` processes that cannot share state: each enforces
        floor(L / parts), so together they never admit more than L (docs/limits.md)."""
        if parts <= 1:
            return self

        def part(value: int | None) -> int | None:
            return None if value is None else value // parts

        return Limits(
            rpm=part(self.rpm),
            input_tpm=part(self.input_tpm),
            output_tpm=part(self.output_tpm),
            concurrency=part(self.concurrency),
            budget_micro_usd=part(self.budget_micro_usd),
            budget_period_s=self.budget_period_s,
        )


# -- the one parser of limits as operators give them (JSON, forms, argv) -------------------

# Each limit's largest value: far above any real deployment's, small enough to be exact
# as a double (the cluster's shared limits count in Redis Lua, in doubles).
MAX_LIMIT: Final = {
    "rpm": 10**9,
    "input_tpm": 10**12,
    "output_tpm": 10**12,
    "concurrency": 10**6,
    "budget_micro_usd": 10**15,  # a billion dollars
    "budget_period_s": 366 * 86400,  # a year
}
MICRO_PER_USD: Final = 1_000_000
# The human forms the CLI and the console take: dollars, and a duration ("30d", or seconds).
BUDGET_USD: Final = "budget_usd"
BUDGET_PERIOD: Final = "budget_period"
LIMIT_NAMES: Final = (*MAX_LIMIT, BUDGET_USD, BUDGET_PERIOD)
_DOLLARS_RE: Final = re.compile(r"\d{1,10}(\.\d{1,6})?")


class LimitError(ValueError):
    """A limit given wrong; `field`: its name as given (None: the limits together)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def parse_limits(given: Mapping[str, object]) -> Limits | None:
    """Limits from their fields as any front end has them: JSON values (numbers), form
    fields and command-line options (text); a None or empty value sets nothing. Besides
    the stored names (`Limits`' fields) it takes ``budget_usd`` (dollars, at most 6
    decimals) and ``budget_period`` (a duration such as 30d, 24h, or seconds). Every value
    is bounded (MAX_LIMIT). None when nothing is set
    (clear the limits); LimitError naming the first wrong field."""
    return _build(_parsed_fields(given))


# What `--clear` and a JSON null name: a limit, or the budget (its amount and period together).
CLEARABLE: Final = ("rpm", "input_tpm", "output_tpm", "concurrency", "budget")
_CLEARED_FIELDS: Final = {"budget": ("budget_micro_usd", "budget_period_s")}
# The names a JSON null may carry, and the kind each clears.
_NULL_CLEARS: Final = {
    **{k: k for k in CLEARABLE if k != "budget"},
    **dict.fromkeys(("budget_micro_usd", "budget_period_s", BUDGET_USD, BUDGET_PERIOD), "budget"),
}


@dataclass(frozen=True, slots=True)
class LimitsEdit:
    """A change to limits already set: these set, those cleared, every other kept (an
    operator adding an rpm must not lose the budget set last month)."""

    given: Mapping[str, int]
    clear: frozenset[str]

    def apply(self, current: Limits | None) -> Limits | None:
        """The limits after the edit; LimitError if they do not hold together (a budget
        amount with no period, say)."""
        kept = {f.name: getattr(current, f.name) for f in fields(Limits)} if current else {}
        for kind in self.clear:
            for name in _CLEARED_FIELDS.get(kind, (kind,)):
                kept.pop(name, None)
        kept.update(self.given)
        return _build({k: v for k, v in kept.items() if v is not None})


def parse_limits_edit(given: Mapping[str, object], clear: Iterable[str] = ()) -> LimitsEdit:
    """An edit from the fields to set (as parse_limits takes them; a None or empty value
    sets nothing) and the kinds to clear (CLEARABLE); LimitError naming the wrong one."""
    cleared = frozenset(clear)
    unknown = sorted(cleared - set(CLEARABLE))
    if unknown:
        raise LimitError(f"cannot clear {unknown[0]!r}: use {', '.join(CLEARABLE)}", unknown[0])
    parsed = _parsed_fields(given)
    both = sorted(k for k in cleared for f in _CLEARED_FIELDS.get(k, (k,)) if f in parsed)
    if both:
        raise LimitError(f"{both[0]} is both set and cleared", both[0])
    return LimitsEdit(parsed, cleared)


def json_limits_edit(body: Mapping[str, object]) -> LimitsEdit:
    """An edit from a JSON merge patch: a value sets its limit, a null clears its kind
    (``{"rpm": 60, "budget_usd": null}``), an absent name is kept."""
    nulls = [name for name, value in body.items() if value is None]
    unknown = sorted(n for n in nulls if n not in _NULL_CLEARS)
    if unknown:
        raise LimitError(f"unknown limit {unknown[0]!r}: use {', '.join(LIMIT_NAMES)}", unknown[0])
    given = {name: value for name, value in body.items() if value is not None}
    return parse_limits_edit(given, {_NULL_CLEARS[n] for n in nulls})


def _build(fields_: Mapping[str, int]) -> Limits | None:
    """Limits from parsed fields, checked together; None when nothing is set."""
    try:
        limits = Limits(**fields_)
    except ValueError as exc:  # what only the fields together say (a budget needs both)
        raise LimitError(str(exc)) from None
    return None if limits.empty else limits


def _parsed_fields(given: Mapping[str, object]) -> dict[str, int]:
    """Each given field parsed and bounded, under its stored name; nothing checked across
    fields yet (an edit may give the amount of a budget whose period is already set)."""
    unknown = sorted(set(given) - set(LIMIT_NAMES))
    if unknown:
        raise LimitError(f"unknown limit {unknown[0]!r}: use {', '.join(LIMIT_NAMES)}", unknown[0])
    values = {k: v for k, v in given.items() if v is not None and v != ""}
    fields_: dict[str, int] = {}
    for alias, stored, parse in (
        (BUDGET_USD, "budget_micro_usd", _dollars),
        (BUDGET_PERIOD, "budget_period_s", _period),
    ):
        if alias in values:
            if stored in values:
                raise LimitError(f"give {alias} or {stored}, not both", alias)
            fields_[stored] = parse(values.pop(alias))
    for name, value in values.items():
        fields_[name] = _count(name, value)
    for name, most in MAX_LIMIT.items():
        value = fields_.get(name)
        if value is not None and not 0 <= value <= most:
            raise LimitError(f"limit {name} must be from 0 to {most}, got {value}", name)
    if fields_.get("budget_period_s") == 0:
        raise LimitError("a budget period must be at least 1 second", "budget_period_s")
    return fields_


def _count(name: str, value: object) -> int:
    if isinstance(value, str) and value.strip().isdecimal() and len(value.strip()) < 20:
        return int(value.strip())
    if type(value) is int:
        return value
    raise LimitError(f"limit {name} must be a whole number, got {shown_value(value)}", name)


def _dollars(value: object) -> int:
    text = value.strip() if isinstance(value, str) else repr(value)
    if isinstance(value, bool) or not _DOLLARS_RE.fullmatch(text):
        raise LimitError(
            f"budget_usd must be dollars with at most 6 decimals, got {shown_value(value)}",
            BUDGET_USD,
        )
    whole, _, fraction = text.partition(".")
    return int(whole) * MICRO_PER_USD + int(fraction.ljust(6, "0") or 0)


def _period(value: object) -> int:
    seconds = None
    if isinstance(value, str):
        seconds = float(value) if value.strip().isdecimal() else parse_duration(value)
    elif type(value) is int:
        seconds = float(value)
    if seconds is None or seconds < 1 or seconds != int(seconds):
        raise LimitError(
            f"budget_period must be a duration such as 30d, 7d or 24h, got {shown_value(value)}",
            BUDGET_PERIOD,
        )
    return int(seconds)


def limits_label(limits: Limits | None) -> str:
    """Limits as every front end shows them: "rpm=60 input_tpm=10000 budget=$5/30d"
    ("none" when there are none)."""
    if limits is None:
        return "none"
    parts = [
        f"{name}={value}"
        for name, value in (
            ("rpm", limits.rpm),
            ("input_tpm", limits.input_tpm),
            ("output_tpm", limits.output_tpm),
            ("concurrency", limits.concurrency),
        )
        if value is not None
    ]
    if limits.budget_micro_usd is not None and limits.budget_period_s is not None:
        parts.append(
            f"budget=${dollars_label(limits.budget_micro_usd)}/"
            f"{period_label(limits.budget_period_s)}"
        )
    return " ".join(parts) or "none"


def enforcement(*, workers: int, gateways: int, cluster: bool) -> str:
    """How `saltgate serve` holds every limit L, in words, and where it cannot hold it
    exactly: what `serve`, `serve --check` and `set-limits` say (docs/limits.md).
    `gateways`: [limits] share; `cluster`: [cluster] set (its Redis counts)."""
    processes = gateways * workers
    fallback = f"floor(L / {processes}) on its own counts meanwhile"
    if cluster:
        return (
            "limits exact for the fleet, counted in [cluster]'s Redis; a process Redis does "
            f"not answer within 0.5 s enforces {fallback}"
        )
    if gateways > 1:
        said = (
            f"limits not exact between gateways (no [cluster]): each of the {gateways} "
            f"gateways ([limits] share) enforces floor(L / {gateways}), so together at most "
            f"L, and a limit below {gateways} admits nothing"
        )
    else:
        said = "limits exact on this host"
    if workers > 1:
        said += (
            f"; its {workers} workers count in one place, the supervisor; a worker it "
            f"does not answer within 0.5 s enforces {fallback}"
        )
    return said


def enforced_note(limits: Limits | None, *, gateways: int, cluster: bool) -> str:
    """What gateways configured so ([limits] share, [cluster]) enforce of these limits,
    in words (`set-limits` prints it): exact, or each gateway's part, naming a part of 0."""
    if limits is None or limits.empty:
        return "enforced: nothing limited"
    lost = " (if a worker cannot reach its supervisor, floor(L / (share x workers)) meanwhile)"
    if cluster or gateways <= 1:
        where = "the fleet, through [cluster]'s Redis" if cluster else "each host"
        return f"enforced: exactly, for {where}, the workers of `serve --workers N` together{lost}"
    part = limits.share(gateways)
    nothing = [
        f.name for f in fields(Limits) if f.name != "budget_period_s" and getattr(part, f.name) == 0
    ]
    said = (
        f"enforced: not exactly: without [cluster], each of the {gateways} gateways "
        f"([limits] share) enforces {limits_label(part)}"
    )
    if nothing:
        said += f"; {', '.join(nothing)} = 0 admits nothing there: raise it or set [cluster]"
    return said + lost


def dollars_label(micro_usd: int) -> str:
    """Micro-dollars as exact dollars: 12500000 -> "12.5" (what budget_usd takes back)."""
    whole, fraction = divmod(micro_usd, MICRO_PER_USD)
    return f"{whole}" + (f".{fraction:06d}".rstrip("0") if fraction else "")


def period_label(seconds: int) -> str:
    """A period in its largest whole unit: 2592000 -> "30d" (what budget_period takes back)."""
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def shown_value(value: object) -> str:
    """A wrong value as an error echoes it: short, and printable."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request reserves: uncached input (the prompt estimate), its output
    allowance and the price of both."""

    input_tokens: int
    output_tokens: int
    cost_micro_usd: int = 0


BYTES_PER_TOKEN: Final = 4  # OpenAI's rule of thumb: a token per 4 characters


def prompt_estimate(body_bytes: int) -> int:
    """A request's prompt tokens before any replica counted them: OpenAI's estimate, a
    token per 4 characters of the body (what limits reserve and the fair queue charges)."""
    return body_bytes // BYTES_PER_TOKEN + 1


def output_allowance(max_tokens: int | None) -> int:
    """The output a request reserves: its own max_tokens (or max_completion_tokens /
    max_output_tokens) as OpenAI counts it, else DEFAULT_OUTPUT_ALLOWANCE."""
    return DEFAULT_OUTPUT_ALLOWANCE if max_tokens is None else max_tokens


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a request was refused: what the 429 says.

    ``retry_at`` is exact: the time at which enough entries leave the window (or the first
    concurrency lease expires) for this request to fit every limit if nothing else
    arrives; the denial names the limit that frees last. None means waiting does not help:
    a request larger than the limit itself (or a limit of 0).
    """

    kind: LimitKind
    scope: Scope
    limit: int
    used: int
    requested: int
    retry_at: float | None
    now: float

    @property
    def retry_after_s(self) -> float | None:
        return None if self.retry_at is None else self.retry_at - self.now

    @property
    def too_large(self) -> bool:
        return self.requested > self.limit


@dataclass(frozen=True, slots=True)
class Quota:
    """One limit's state after a decision, for the x-ratelimit / anthropic-ratelimit
    headers: remaining counts reservations, so it drops at once; ``reset_s`` is when the
    window is empty again if nothing else arrives."""

    kind: LimitKind
    limit: int
    remaining: int
    reset_s: float


class _Entry:
    """One reservation in one log; `amount` is corrected at settlement."""

    __slots__ = ("amount", "at", "live")

    def __init__(self, at: float, amount: int) -> None:
        self.at = at
        self.amount = amount
        self.live = True


class _Log:
    """A sliding log: entries of the last `span` seconds and their running sum."""

    __slots__ = ("entries", "span", "total")

    def __init__(self, span: float) -> None:
        self.span = span
        self.entries: deque[_Entry] = deque()
        self.total = 0

    def prune(self, now: float) -> None:
        entries = self.entries
        # `at + span <= now`, the same sum as the retry time, so a retry made at exactly
        # that time sees the entry gone (now - span could round the other way).
        while entries and entries[0].at + self.span <= now:
            old = entries.popleft()
            old.live = False
            self.total -= old.amount

    def add(self, now: float, amount: int) -> _Entry:
        entry = _Entry(now, amount)
        self.entries.append(entry)
        self.total += amount
        return entry

    def correct(self, entry: _Entry, amount: int) -> None:
        if entry.live:
            self.total += amount - entry.amount
        entry.amount = amount

    def fits_at(self, now: float, limit: int, requested: int) -> float | None:
        """When `requested` more fits under `limit`, walking the entries out of the window
        in order (None: never, the request alone is larger than the limit)."""
        if requested > limit:
            return None
        excess = self.total + requested - limit
        if excess <= 0:
            return now
        freed = 0
        for entry in self.entries:
            freed += entry.amount
            if freed >= excess:
                return entry.at + self.span
        return None  # unreachable: freeing every entry leaves requested <= limit

    def reset_at(self, now: float) -> float:
        return self.entries[-1].at + self.span if self.entries else now


@dataclass(slots=True)
class _Subject:
    """The state of one tenant or key under its limits."""

    limits: Limits
    window: float
    logs: dict[LimitKind, _Log] = field(default_factory=dict)
    leases: dict[int, float] = field(default_factory=dict)  # ticket id -> expiry

    def log(self, kind: LimitKind) -> _Log:
        log = self.logs.get(kind)
        if log is None:
            span = self.window if kind != _BUDGET else float(self.limits.budget_period_s or 0)
            log = self.logs[kind] = _Log(span)
        return log


@dataclass(slots=True)
class Ticket:
    """An admitted request's reservations, handed back to `Governor.settle` when it ends."""

    id: int
    subjects: tuple[Subject, ...]
    entries: dict[tuple[Subject, LimitKind], _Entry]
    settled: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """An admission: the ticket, or the first limit that refused; the quotas either way."""

    ticket: Ticket | None
    denial: Denial | None
    quotas: tuple[Quota, ...]

    @property
    def admitted(self) -> bool:
        return self.ticket is not None


def _lateness(denial: Denial) -> float:
    """Order denials by when they free: never (None) is the latest of all."""
    return float("inf") if denial.retry_at is None else denial.retry_at


def amounts(demand: Demand) -> dict[LimitKind, int]:
    """What a request counts in each kind of limit (a lease counts 1 while it is held)."""
    return {
        _REQUESTS: 1,
        _INPUT_TOKENS: demand.input_tokens,
        _OUTPUT_TOKENS: demand.output_tokens,
        _BUDGET: demand.cost_micro_usd,
    }


class Governor:
    """The limits of every tenant and key in one process, and their logs.

    Subjects are ("tenant", id) and ("key", id); a key's limits narrow its tenant's because
    a request must fit both. `set_limits` replaces a subject's limits and keeps its log (a
    lowered limit applies to what was already admitted).
    """

    def __init__(
        self, *, lease_ttl_s: float = DEFAULT_LEASE_TTL_S, window_s: float = WINDOW_S
    ) -> None:
        self.lease_ttl_s = lease_ttl_s
        self.window_s = window_s
        self._subjects: dict[Subject, _Subject] = {}
        self._last_id = 0

    def set_limits(self, subject: Subject, limits: Limits | None) -> None:
        """Install (or with None / empty limits, remove) a subject's limits."""
        if limits is None or limits.empty:
            self._subjects.pop(subject, None)
            return
        current = self._subjects.get(subject)
        if current is None:
            self._subjects[subject] = _Subject(limits, self.window_s)
        elif current.limits != limits:
            current.limits = limits
            if _BUDGET in current.logs:
                current.logs[_BUDGET].span = float(limits.budget_period_s or 0)

    def seed_budget(self, subject: Subject, spent: Iterable[tuple[float, int]], now: float) -> None:
        """Start a subject's budget log from spend recorded elsewhere (the ledger): each
        (time, amount) counts until time + the budget's period, like an admission made
        then. Replaces what the log held: its admissions are in that record once they end
        (those still in flight count no more; their settlement leaves the new log alone)."""
        state = self._subjects.get(subject)
        if state is None or state.limits.budget_period_s is None:
            return
        old = state.logs.pop(_BUDGET, None)
        for entry in old.entries if old is not None else ():
            entry.live = False
        log = state.log(_BUDGET)
        for at, amount in sorted(spent):
            if amount > 0:
                log.add(at, amount)
        log.prune(now)

    def limits_of(self, subject: Subject) -> Limits | None:
        """The limits a subject is held to here (None: none)."""
        state = self._subjects.get(subject)
        return None if state is None else state.limits

    def governs(self, subjects: Iterable[Subject]) -> bool:
        """Whether any of these subjects has limits (if not, the caller skips admission)."""
        return any(s in self._subjects for s in subjects)

    def admit(self, subjects: Sequence[Subject], demand: Demand, now: float) -> Decision:
        """Check every limit of every subject; admit into all of them or none."""
        present = [(s, self._subjects[s]) for s in subjects if s in self._subjects]
        denials = [d for name, subject in present for d in self._check(name, subject, demand, now)]
        if denials:
            return Decision(None, max(denials, key=_lateness), self._quotas(present, now))
        return Decision(self._record(present, demand, now), None, self._quotas(present, now))

    def record(self, subjects: Sequence[Subject], demand: Demand, now: float) -> Ticket:
        """Count an admission decided elsewhere (the fleet's Redis) without checking it,
        so that a later `admit` here (falling back to this process's share) counts what
        this process already admitted in the window; settle the ticket like any other."""
        present = [(s, self._subjects[s]) for s in subjects if s in self._subjects]
        return self._record(present, demand, now)

    def _record(
        self, present: Sequence[tuple[Subject, _Subject]], demand: Demand, now: float
    ) -> Ticket:
        """Add the demand to every log and take a lease in every subject (no check)."""
        self._last_id += 1
        ticket = Ticket(self._last_id, tuple(name for name, _ in present), {})
        counted = amounts(demand)
        for name, subject in present:
            limits = subject.limits
            for kind in _COUNTED:
                limit = limits.budget_micro_usd if kind == _BUDGET else limits.windowed(kind)
                if limit is not None:
                    log = subject.log(kind)
                    # `record` alone never checks: prune here so its logs stay a window long.
                    log.prune(now)
                    ticket.entries[(name, kind)] = log.add(now, counted[kind])
            if limits.concurrency is not None:
                subject.leases[ticket.id] = now + self.lease_ttl_s
        return ticket

    def _check(self, name: Subject, subject: _Subject, demand: Demand, now: float) -> list[Denial]:
        """Every limit of one subject this request does not fit."""
        limits = subject.limits
        counted = amounts(demand)
        denials: list[Denial] = []
        for kind in WINDOWED:
            limit = limits.windowed(kind)
            if limit is None:
                continue
            log = subject.log(kind)
            log.prune(now)
            at = log.fits_at(now, limit, counted[kind])
            if at != now:
                denials.append(Denial(kind, name.scope, limit, log.total, counted[kind], at, now))
        if limits.concurrency is not None:
            leases = subject.leases
            for ticket_id in [t for t, expiry in leases.items() if expiry <= now]:
                del leases[ticket_id]
            if len(leases) >= limits.concurrency:
                # The earliest expiry frees one lease; a settled request frees one sooner.
                at = None if limits.concurrency == 0 else min(leases.values())
                denials.append(
                    Denial(
                        _CONCURRENCY,
                        name.scope,
                        limits.concurrency,
                        len(leases),
                        1,
                        at,
                        now,
                    )
                )
        budget = limits.budget_micro_usd
        if budget is not None:
            log = subject.log(_BUDGET)
            log.prune(now)
            # Admitted while anything is left: spend then ends at most one reservation
            # past the budget, and a request is never refused for its upper-bound price.
            if log.total >= budget:
                at = log.fits_at(now, budget, 1) if budget > 0 else None
                denials.append(
                    Denial(
                        _BUDGET,
                        name.scope,
                        budget,
                        log.total,
                        counted[_BUDGET],
                        at,
                        now,
                    )
                )
        return denials

    def settle(self, ticket: Ticket, used: Demand, now: float) -> None:
        """Correct a request's reservations to what it used and release its lease.
        Idempotent: every ending path may call it, only the first counts."""
        if ticket.settled:
            return
        ticket.settled = True
        counted = amounts(used)
        for (name, kind), entry in ticket.entries.items():
            subject = self._subjects.get(name)
            if subject is not None and kind in subject.logs:
                subject.logs[kind].correct(entry, counted[kind])
        for name in ticket.subjects:
            subject = self._subjects.get(name)
            if subject is not None:
                subject.leases.pop(ticket.id, None)

    def quotas(self, subjects: Sequence[Subject], now: float) -> tuple[Quota, ...]:
        """The current quotas of the subjects (for headers on any answer)."""
        present = [(s, self._subjects[s]) for s in subjects if s in self._subjects]
        return self._quotas(present, now)

    def _quotas(self, present: Sequence[tuple[Subject, _Subject]], now: float) -> tuple[Quota, ...]:
        quotas = []
        for _, subject in present:
            for kind in WINDOWED:
                limit = subject.limits.windowed(kind)
                if limit is None:
                    continue
                log = subject.log(kind)
                log.prune(now)
                quotas.append(Quota(kind, limit, limit - log.total, log.reset_at(now) - now))
        return tightest(quotas)


def tightest(quotas: Iterable[Quota]) -> tuple[Quota, ...]:
    """Per windowed kind, the quota of the subject with least remaining (never below 0)."""
    best: dict[LimitKind, Quota] = {}
    for quota in quotas:
        if quota.kind not in best or quota.remaining < best[quota.kind].remaining:
            best[quota.kind] = quota
    return tuple(
        Quota(q.kind, q.limit, max(q.remaining, 0), q.reset_s)
        for q in (best[k] for k in WINDOWED if k in best)
    )
