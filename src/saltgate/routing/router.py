"""The router: which replica serves a request, decided from events, without I/O.

The gateway feeds it what happens (a request started, got a response, failed or finished;
a probe passed; a replica reported its queue) and asks it where to send a request. The
clock is an argument, so every decision can be replayed in a test.

Policies (``RouterConfig.policy``):
- ``saltgate``: the secret route key ranks the healthy replicas by weighted rendezvous; a
  key's traffic goes to the least-loaded of its top R replicas, R growing with the key's
  rate, unless that replica is more than ``max_inflight_delta`` above the least-loaded
  one; overloaded replicas are skipped; keyless requests go to the least-loaded replica.
- ``consistent_hash``: a baseline: plain rendezvous over SHA-256 of the same window, no
  hot-key spreading, no load or overload awareness (keyless requests: least-loaded).
- ``round_robin``, ``least_loaded``: baselines that ignore the prompt.
Every policy skips replicas whose breaker is open or whose probes fail.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from saltgate.routing.affinity import PrefixAffinity
from saltgate.routing.health import Breaker, Overload, Probe, ReplicaHealth
from saltgate.routing.hotkeys import HotKeys, warm_set_size
from saltgate.routing.rendezvous import Member, rank
from saltgate.spec.derive import (
    DEFAULT_MIN_PROMPT_BYTES,
    DEFAULT_WINDOW_BYTES,
    prefix_digests,
    route_window,
)
from saltgate.spec.derive import route_key as keyed_route_key

RANKING_CACHE: Final = 65_536  # route keys whose ranking is remembered; cleared when full
POLICIES: Final = ("saltgate", "round_robin", "least_loaded", "consistent_hash")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The ``[router]`` section (docs/routing.md says how the defaults were chosen)."""

    policy: str = "saltgate"
    window_bytes: int = DEFAULT_WINDOW_BYTES
    min_prompt_bytes: int = DEFAULT_MIN_PROMPT_BYTES
    per_replica_rate: float = 4.0
    max_inflight_delta: float = 4.0
    hot_half_life_s: float = 2.0
    breaker_failures: int = 3
    breaker_open_s: float = 10.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    probe_failures: int = 2
    overload_enter_waiting: float = 8.0
    overload_exit_waiting: float = 2.0
    affinity_ttl_s: float = 600.0
    affinity_first_depth: int = DEFAULT_WINDOW_BYTES

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in (*_POSITIVE, *_NON_NEGATIVE):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name}: expected a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ValueError(f"{name}: must be finite")
            if name in _POSITIVE and value <= 0:
                raise ValueError(f"{name}: must be > 0")
            if value < 0:
                raise ValueError(f"{name}: must be >= 0")
        if self.overload_exit_waiting >= self.overload_enter_waiting:
            raise ValueError(
                "overload_exit_waiting: must be below overload_enter_waiting "
                "(the gap is the hysteresis)"
            )

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> RouterConfig:
        """Build from a parsed ``[router]`` table; unknown keys and bad values raise ValueError."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in table.items():
            kind = known.get(name)
            if kind is None:
                raise ValueError(f"{name}: unknown key; expected some of {sorted(known)}")
            if kind == "str":
                ok = isinstance(value, str)
            elif kind == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok:
                what = {"str": "a string", "int": "an integer"}.get(str(kind), "a number")
                raise ValueError(f"{name}: expected {what}, got {type(value).__name__}")
            values[name] = float(value) if kind == "float" else value
        return cls(**values)


_POSITIVE: Final = (
    "per_replica_rate",
    "hot_half_life_s",
    "breaker_failures",
    "breaker_open_s",
    "probe_interval_s",
    "probe_timeout_s",
    "probe_failures",
    "overload_enter_waiting",
    "affinity_first_depth",
)
_NON_NEGATIVE: Final = (
    "affinity_ttl_s",
    "window_bytes",
    "min_prompt_bytes",
    "max_inflight_delta",
    "overload_exit_waiting",
)


@dataclass(slots=True, eq=False)
class ReplicaState:
    """What the router knows about one replica."""

    member: Member
    health: ReplicaHealth
    inflight: int = 0

    @property
    def id(self) -> str:
        return self.member.id

    @property
    def load(self) -> float:
        """In-flight requests per unit of capacity weight."""
        return self.inflight / self.member.weight


@dataclass(frozen=True, slots=True)
class Plan:
    """One request's routing input, fixed when it arrives (retries reuse it)."""

    key: bytes | None
    rate: float = 0.0
    prefixes: tuple[bytes, ...] = ()

    def __repr__(self) -> str:
        return (
            f"Plan(key={'<set>' if self.key else None}, rate={self.rate:.3f}, "
            f"prefixes={len(self.prefixes)})"
        )


class Router:
    """Replica choice for one gateway; rankings agree across gateways with the same key."""

    def __init__(
        self, config: RouterConfig, route_secret: bytes, members: Iterable[Member] = ()
    ) -> None:
        self.config = config
        self._route_secret = route_secret
        self._hot = HotKeys(config.hot_half_life_s)
        self._affinity = (
            PrefixAffinity(config.affinity_ttl_s)
            if config.policy == "saltgate" and config.affinity_ttl_s > 0
            else None
        )
        self._states: dict[str, ReplicaState] = {}
        self._rankings: dict[bytes, list[str]] = {}
        self._retired: dict[str, ReplicaState] = {}
        self._turn = 0
        self.set_members(members)

    def __repr__(self) -> str:
        return f"Router(policy={self.config.policy!r}, replicas={len(self._states)})"

    # -- membership ------------------------------------------------------------------------
    def set_members(self, members: Iterable[Member]) -> None:
        """Replace the replica set; replicas that stay keep their load and health."""
        states: dict[str, ReplicaState] = {}
        for member in members:
            if member.id in states:
                raise ValueError(f"replica listed twice: {member.id}")
            state = self._states.get(member.id) or self._retired.pop(member.id, None)
            if state is None:
                state = ReplicaState(member, self._new_health())
            state.member = member
            states[member.id] = state
        for rid, state in self._states.items():
            if rid not in states and state.inflight > 0:
                self._retired[rid] = state  # keeps counting until its requests finish
        self._states = states
        self._rankings.clear()  # members changed: every ranking may change

    def _new_health(self) -> ReplicaHealth:
        c = self.config
        return ReplicaHealth(
            Breaker(c.breaker_failures, c.breaker_open_s),
            Probe(c.probe_failures),
            Overload(c.overload_enter_waiting, c.overload_exit_waiting),
        )

    @property
    def states(self) -> tuple[ReplicaState, ...]:
        """The members in configuration order."""
        return tuple(self._states.values())

    def state(self, replica_id: str) -> ReplicaState | None:
        return self._states.get(replica_id)

    def inflight(self, replica_id: str) -> int:
        state = self._states.get(replica_id) or self._retired.get(replica_id)
        return state.inflight if state is not None else 0

    # -- keys ------------------------------------------------------------------------------
    def request_key(
        self, route: str, body: Mapping[str, Any], model: str, salt: str | None
    ) -> bytes | None:
        """The request's routing key under the policy, or None (no affinity)."""
        c = self.config
        if c.policy in ("round_robin", "least_loaded"):
            return None
        window = route_window(body, route, c.window_bytes, c.min_prompt_bytes)
        if window is None:
            return None
        if c.policy == "consistent_hash":
            return hashlib.sha256(window).digest()
        return keyed_route_key(self._route_secret, model, salt or "", window)

    def prefixes(
        self, route: str, body: Mapping[str, Any], model: str, salt: str | None
    ) -> tuple[bytes, ...]:
        """The request's keyed prefix digests, when prefix affinity is on (else empty)."""
        if self._affinity is None:
            return ()
        return tuple(
            prefix_digests(
                self._route_secret,
                model,
                salt or "",
                body,
                route,
                first_depth=self.config.affinity_first_depth,
            )
        )

    def ranking(self, key: bytes, now: float) -> list[str]:
        """Available replicas by rendezvous rank for ``key`` (the retry order)."""
        return [s.id for s in self._ranked(key, now, frozenset())]

    def _ranked(self, key: bytes, now: float, exclude: Collection[str]) -> list[ReplicaState]:
        order = self._rankings.get(key)
        if order is None:
            # The ranking depends only on the key and the members, so it is remembered
            # (a busy key is ranked once, not per request); health is applied after.
            order = [m.id for m in rank(key, (s.member for s in self._states.values()))]
            if len(self._rankings) >= RANKING_CACHE:
                self._rankings.clear()
            self._rankings[key] = order
        states = self._states
        return [
            state
            for rid in order
            if rid not in exclude and (state := states[rid]).health.available(now)
        ]

    # -- decisions -------------------------------------------------------------------------
    def plan(self, key: bytes | None, now: float, prefixes: tuple[bytes, ...] = ()) -> Plan:
        """Fix a request's routing input; counts it toward its key's rate (saltgate)."""
        if self.config.policy != "saltgate":
            return Plan(key)
        rate = self._hot.observe(key, now) if key is not None else 0.0
        return Plan(key, rate, prefixes)

    def pick(self, plan: Plan, now: float, exclude: Collection[str] = ()) -> str | None:
        """The replica for a request not yet tried on ``exclude``; None if none is left.

        Under ``saltgate`` the choice is remembered for the request's prefixes, so the next
        turn of the conversation follows it (`affinity.PrefixAffinity`).
        """
        chosen = self._choose(plan, now, exclude)
        if chosen is not None and plan.prefixes and self._affinity is not None:
            self._affinity.record(plan.prefixes, chosen, now)
        return chosen

    def _choose(self, plan: Plan, now: float, exclude: Collection[str]) -> str | None:
        policy = self.config.policy
        if policy == "round_robin":
            return self._round_robin(now, exclude)
        owner = None
        if plan.prefixes and self._affinity is not None:
            owner = self._follow_prefix(plan.prefixes, now, exclude)
        if owner is not None and (
            plan.key is None or plan.rate <= self.config.per_replica_rate  # not hot: R = 1
        ):
            return owner.id
        if plan.key is None or policy == "least_loaded":
            return self._least_loaded(now, exclude, skip_overloaded=policy == "saltgate")
        ranked = self._ranked(plan.key, now, exclude)
        if not ranked:
            return None
        if policy == "consistent_hash":
            return ranked[0].id
        return self._warm_pick(ranked, plan.rate, owner).id

    def _follow_prefix(
        self, prefixes: tuple[bytes, ...], now: float, exclude: Collection[str]
    ) -> ReplicaState | None:
        """The replica that served the deepest shared prefix, if within the load cap."""
        assert self._affinity is not None
        owners = self._affinity.owners(prefixes, now)
        if not owners:
            return None
        usable = {
            state.id: state
            for state in self._states.values()
            if state.id not in exclude
            and state.health.available(now)
            and not state.health.overload.overloaded
        }
        if not usable:
            return None
        ceiling = min(state.load for state in usable.values()) + self.config.max_inflight_delta
        for owner in owners:
            state = usable.get(owner)
            if state is not None and state.load <= ceiling:
                return state
        return None

    def _warm_pick(
        self, ranked: list[ReplicaState], rate: float, owner: ReplicaState | None = None
    ) -> ReplicaState:
        """The key's warm set decides; a hot key's prefix owner competes with it on load.

        (A key that is not hot never gets here with an owner: it follows the owner, whose
        cache holds the conversation.) Competing on load lets one busy prefix spread.
        """
        eligible = [s for s in ranked if not s.health.overload.overloaded] or ranked
        size = warm_set_size(rate, self.config.per_replica_rate, len(eligible))
        warm = eligible[:size]
        if owner is not None and owner not in warm:
            warm = [owner, *warm]
        # min() keeps the first of equals: ties go to the owner, then the higher-ranked.
        best = min(warm, key=_load)
        least = min(eligible, key=_load)
        if best.load <= least.load + self.config.max_inflight_delta:
            return best
        return least

    def _rotation(self, now: float, exclude: Collection[str]) -> list[ReplicaState]:
        """Available replicas, starting one further along at every call."""
        states = [s for s in self._states.values() if s.id not in exclude]
        states = [s for s in states if s.health.available(now)]
        if not states:
            return []
        self._turn = (self._turn + 1) % len(states)
        return states[self._turn :] + states[: self._turn]

    def _round_robin(self, now: float, exclude: Collection[str]) -> str | None:
        states = self._rotation(now, exclude)
        return states[0].id if states else None

    def _least_loaded(
        self, now: float, exclude: Collection[str], *, skip_overloaded: bool
    ) -> str | None:
        states = self._rotation(now, exclude)
        if skip_overloaded:
            states = [s for s in states if not s.health.overload.overloaded] or states
        return min(states, key=_load).id if states else None

    # -- events ----------------------------------------------------------------------------
    def started(self, replica_id: str, now: float) -> None:
        state = self._states.get(replica_id)
        if state is not None:
            state.inflight += 1
            state.health.breaker.started(now)

    def responded(self, replica_id: str) -> None:
        """The replica answered (any status): the exchange worked."""
        state = self._states.get(replica_id)
        if state is not None:
            state.health.breaker.succeeded()

    def failed(self, replica_id: str, now: float) -> None:
        """The exchange broke (connect, timeout, reset), before or during the response."""
        state = self._states.get(replica_id)
        if state is not None:
            state.health.breaker.failed(now)

    def finished(self, replica_id: str) -> None:
        """The request no longer occupies the replica (every `started` gets one)."""
        state = self._states.get(replica_id)
        if state is None:
            state = self._retired.get(replica_id)
            if state is not None and state.inflight <= 1:
                del self._retired[replica_id]
        if state is not None and state.inflight > 0:
            state.inflight -= 1

    def probed(self, replica_id: str, ok: bool) -> None:
        state = self._states.get(replica_id)
        if state is not None:
            state.health.probed(ok)

    def observed_queue(self, replica_id: str, waiting: float | None) -> None:
        """The replica's reported queue length (None: it reports none)."""
        state = self._states.get(replica_id)
        if state is not None:
            state.health.overload.observed(waiting)


def _load(state: ReplicaState) -> float:
    return state.load
