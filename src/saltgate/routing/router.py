"""The router: which replica serves a request, decided from events, without I/O.

The gateway feeds it what happens (a request started, got a response, failed or finished;
a probe passed; a replica reported its queue) and asks it where to send a request. The
clock is an argument, so every decision can be replayed in a test.

Policies (``RouterConfig.policy``):
- ``saltgate``: the secret route key ranks the healthy replicas by weighted rendezvous; a
  key's traffic goes to the least-loaded of its top R replicas, R growing with the key's
  rate, unless that replica is more than ``max_inflight_delta`` above the least-loaded
  one; overloaded replicas are skipped; keyless requests go to the least-loaded replica.
  A later turn follows the replica that served its deepest prefix (prefix affinity), and
  the prefill guard overrides any of these choices that would queue the prompt behind
  much more prefill than another replica (docs/routing.md).
- ``consistent_hash``, ``round_robin``, ``least_loaded``: baselines to measure it against
  (baselines.py).
Every policy skips replicas whose breaker is open, whose probes fail or whose isolation
canary failed (routing/canary.py), and a request naming a model goes only to replicas
that serve it (`set_models`): every rule above works within that set, so a key keeps its
rendezvous order among the replicas of its model.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from saltgate.derivations.derive import (
    DEFAULT_MIN_PROMPT_BYTES,
    DEFAULT_WINDOW_BYTES,
    NamespaceKeys,
    PrefixDigest,
    Prompt,
    RouteKey,
)
from saltgate.routing.affinity import PrefixAffinity
from saltgate.routing.baselines import baseline_key, baseline_pick
from saltgate.routing.canary import Verdict
from saltgate.routing.domain import POLICIES, Policy, ReplicaId
from saltgate.routing.health import Breaker, Overload, Probe, ReplicaHealth
from saltgate.routing.hotkeys import HotKeys, warm_set_size
from saltgate.routing.rendezvous import Member, rank
from saltgate.routing.state import ReplicaState

RANKING_CACHE: Final = 65_536  # route keys whose ranking is remembered; cleared when full
NAMESPACE_CACHE: Final = 65_536  # (model, salt) keyed states remembered; cleared when full


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The ``[router]`` section (docs/routing.md says how the defaults were chosen)."""

    policy: Policy = Policy.SALTGATE
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
    max_prefill_delta: float = 32_768.0
    max_prefill_delta_cached: float = 262_144.0

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
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
        known = {f.name: _type_name(f.type) for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in table.items():
            kind = known.get(name)
            if kind is None:
                raise ValueError(f"{name}: unknown key; expected some of {sorted(known)}")
            if kind == "Policy":
                if not (isinstance(value, str) and value in POLICIES):
                    raise ValueError(
                        f"{name}: expected one of {', '.join(POLICIES)}, got {value!r}"
                    )
                values[name] = Policy(value)
                continue
            if kind == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok:
                what = "an integer" if kind == "int" else "a number"
                raise ValueError(f"{name}: expected {what}, got {type(value).__name__}")
            values[name] = float(value) if kind == "float" else value
        return cls(**values)


def _type_name(annotation: object) -> str:
    """A dataclass field's type by name: a string under postponed annotations, but the
    class itself in the compiled build."""
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")


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
    "max_prefill_delta",
    "max_prefill_delta_cached",
    "window_bytes",
    "min_prompt_bytes",
    "max_inflight_delta",
    "overload_exit_waiting",
)


class Prefixes(NamedTuple):
    """A prompt's keyed prefix digests (shallow first) and its flattened size in bytes."""

    digests: tuple[PrefixDigest, ...] = ()
    prompt_bytes: int = 0


NO_PREFIXES: Final = Prefixes()
_NOTHING_HELD: Final = (0, 0)  # (likely, surely) bytes of a replica that owns no prefix


class Plan(NamedTuple):
    """One request's routing input, fixed when it arrives (retries reuse it). A tuple:
    one is built per request, and a frozen dataclass costs 3x as much to build.

    ``owners``: the replicas that recently served a prefix of this prompt, deepest first
    (in insertion order), each with two byte counts of this prompt it holds: likely (what
    routing weighs) and surely (the deepest shared digest), so that budgets count what may
    still need prefilling.
    """

    key: RouteKey | None
    rate: float = 0.0
    prefixes: tuple[PrefixDigest, ...] = ()
    prompt_bytes: int = 0
    owners: Mapping[ReplicaId, tuple[int, int]] = MappingProxyType({})  # (likely, surely)
    # Only replicas serving this model may take the request; None: any replica (a
    # request that names none, which the replica answers with its default model).
    model: str | None = None

    def uncached_bytes(self, replica_id: ReplicaId) -> int:
        """The prompt bytes ``replica_id`` would likely have to prefill (its cached prefix
        aside): what choosing between replicas weighs."""
        return max(0, self.prompt_bytes - self.owners.get(replica_id, _NOTHING_HELD)[0])

    def uncached_at_most(self, replica_id: ReplicaId) -> int:
        """The prompt bytes ``replica_id`` may have to prefill: only the prefix a shared
        digest proves is taken as cached. What a budget on prefill counts (the saturation
        gate's), so that an optimistic guess never lets it be exceeded."""
        return max(0, self.prompt_bytes - self.owners.get(replica_id, _NOTHING_HELD)[1])

    def __repr__(self) -> str:
        return (
            f"Plan(key={'<set>' if self.key else None}, rate={self.rate:.3f}, "
            f"prefixes={len(self.prefixes)}, prompt_bytes={self.prompt_bytes}, "
            f"model={self.model!r})"
        )


Placement = tuple[tuple[PrefixDigest, ...], ReplicaId, int, float]


class Shared(NamedTuple):
    """What this gateway tells the others (routing/cluster.py), taken at once: the
    placements made since the last take (digests, replica, prompt bytes, time), the route
    keys seen with counts, and its own (replica, in flight, prefill bytes)."""

    placements: list[Placement]
    keys: list[tuple[RouteKey, int]]
    backlog: list[tuple[ReplicaId, int, float]]


class _Sharing:
    """What the router keeps for the cluster bus between two takes."""

    __slots__ = ("keys", "placements")

    def __init__(self) -> None:
        self.placements: list[Placement] = []
        self.keys: dict[RouteKey, int] = {}


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
            if config.policy is Policy.SALTGATE and config.affinity_ttl_s > 0
            else None
        )
        self._states: dict[ReplicaId, ReplicaState] = {}
        self._rankings: dict[RouteKey, list[ReplicaId]] = {}
        self._namespaces: dict[tuple[str, str], NamespaceKeys] = {}
        self._retired: dict[ReplicaId, ReplicaState] = {}
        self._served: frozenset[str] = frozenset()  # every member's models, healthy or not
        # Where each model's rotation stands: one shared turn would stall when models
        # with different replica sets alternate (a 1-replica model resets it each time).
        self._turns: dict[str | None, int] = {}
        self._inflight_total = 0
        # Kept for the other gateways when a cluster bus runs (routing/cluster.py), until
        # the bus takes it (`take_shared`). None: this gateway routes alone.
        self._sharing: _Sharing | None = None
        self.set_members(members)

    def __repr__(self) -> str:
        return f"Router(policy={self.config.policy!r}, replicas={len(self._states)})"

    # -- membership ------------------------------------------------------------------------
    def set_members(self, members: Iterable[Member]) -> None:
        """Replace the replica set; replicas that stay keep their load and health."""
        states: dict[ReplicaId, ReplicaState] = {}
        for member in members:
            if member.id in states:
                raise ValueError(f"replica listed twice: {member.id}")
            state = self._states.get(member.id) or self._retired.pop(member.id, None)
            if state is None:
                state = ReplicaState(member, self._new_health())
            state.set_member(member)
            states[member.id] = state
        for rid, state in self._states.items():
            if rid not in states and state.inflight > 0:
                self._retired[rid] = state  # keeps counting until its requests finish
        self._states = states
        self._rankings.clear()  # members changed: every ranking may change
        self._served = _union(states.values())

    def set_models(self, replica_id: ReplicaId, models: Iterable[str] | None) -> None:
        """The model names the replica serves now (its probe's or its pinned list; None:
        not known yet). The ranking does not change: only which replicas a model's
        requests may use."""
        state = self._states.get(replica_id)
        if state is not None:
            state.models = None if models is None else frozenset(models)
            self._served = _union(self._states.values())

    def serves(self, model: str) -> bool:
        """Whether ``model`` may exist here: some member serves it, healthy or not, or
        some member's models are not known yet (a replica never reached: what it serves
        cannot be ruled out). A model that fails this does not exist (404); one that
        passes with no replica able to take it waits for one (503)."""
        return model in self._served or any(s.models is None for s in self._states.values())

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

    def state(self, replica_id: ReplicaId) -> ReplicaState | None:
        return self._states.get(replica_id)

    def busy(self) -> bool:
        """Whether any request is in flight on any replica."""
        return self._inflight_total > 0

    def remembered_prefixes(self) -> int:
        """Prefix digests in the affinity table (this gateway's and those learnt)."""
        return len(self._affinity) if self._affinity is not None else 0

    def inflight(self, replica_id: ReplicaId) -> int:
        state = self._states.get(replica_id) or self._retired.get(replica_id)
        return state.inflight if state is not None else 0

    # -- keys ------------------------------------------------------------------------------
    def plan_request(
        self,
        route: str,
        body: Mapping[str, Any],
        model: str,
        salt: str | None,
        now: float,
        *,
        remember: bool,
    ) -> Plan:
        """A request's routing input, from its body in its (model, salt) namespace: route
        key and prefix digests under the policy, for the replicas serving ``model`` (any
        replica when it is empty); ``remember``: see `namespace`."""
        prompt = Prompt(body, route)
        keys = self.namespace(model, salt, remember=remember)
        return self.plan(
            self.request_key(prompt, keys), now, self.prefixes(prompt, keys), model or None
        )

    def namespace(self, model: str, salt: str | None, *, remember: bool = True) -> NamespaceKeys:
        """The keyed states of a (model, salt) namespace; with ``remember``, kept for the
        next request (False for salts from a user's secret, which outlive no request)."""
        key = (model, salt or "")
        keys = self._namespaces.get(key)
        if keys is None:
            keys = NamespaceKeys(self._route_secret, model, salt or "")
            if remember:
                if len(self._namespaces) >= NAMESPACE_CACHE:
                    self._namespaces.clear()
                self._namespaces[key] = keys
        return keys

    def request_key(self, prompt: Prompt, keys: NamespaceKeys) -> RouteKey | None:
        """The request's routing key under the policy, or None (no affinity)."""
        c = self.config
        if c.policy in (Policy.ROUND_ROBIN, Policy.LEAST_LOADED):
            return None
        window = prompt.window(c.window_bytes, c.min_prompt_bytes)
        if window is None:
            return None
        if c.policy is not Policy.SALTGATE:
            return baseline_key(c.policy, window)
        return keys.route_key(window)

    def prefixes(self, prompt: Prompt, keys: NamespaceKeys) -> Prefixes:
        """The request's keyed prefix digests and prompt size (policy saltgate; else none)."""
        if self.config.policy is not Policy.SALTGATE:
            return NO_PREFIXES
        if self._affinity is None and self.config.max_prefill_delta <= 0:
            return NO_PREFIXES  # neither the affinity table nor the guard would read it
        flat = prompt.flat()
        if self._affinity is None:
            return Prefixes((), len(flat))
        digests = keys.prefix_digests(flat, self.config.affinity_first_depth)
        return Prefixes(tuple(digests), len(flat))

    def ranking(self, key: RouteKey, now: float, model: str | None = None) -> list[ReplicaId]:
        """Available replicas (serving ``model``, if given) by rendezvous rank for ``key``
        (the retry order)."""
        return [s.id for s in self._ranked(key, self._usable(now, (), model))]

    def usable(self, model: str | None, now: float) -> list[ReplicaState]:
        """The replicas a request for ``model`` (None: any) may go to now."""
        return list(self._usable(now, (), model).values())

    def _usable(
        self, now: float, exclude: Collection[ReplicaId], model: str | None
    ) -> dict[ReplicaId, ReplicaState]:
        """The replicas a request may go to now (not excluded, serve its model, probes
        pass, breaker lets it by), in configuration order: computed once per decision."""
        return {
            rid: state
            for rid, state in self._states.items()
            if rid not in exclude
            and (model is None or (state.models is not None and model in state.models))
            and state.health.available(now)
        }

    def _ranked(self, key: RouteKey, usable: dict[ReplicaId, ReplicaState]) -> list[ReplicaState]:
        order = self._rankings.get(key)
        if order is None:
            # The ranking depends only on the key and the members, so it is remembered
            # (a busy key is ranked once, not per request); health is applied after.
            order = [m.id for m in rank(key, (s.member for s in self._states.values()))]
            if len(self._rankings) >= RANKING_CACHE:
                self._rankings.clear()
            self._rankings[key] = order
        return [usable[rid] for rid in order if rid in usable]

    # -- decisions -------------------------------------------------------------------------
    def plan(
        self,
        key: RouteKey | None,
        now: float,
        prefixes: Prefixes = NO_PREFIXES,
        model: str | None = None,
    ) -> Plan:
        """Fix a request's routing input; counts it toward its key's rate (saltgate).
        ``model``: only replicas serving it may take the request (None: any)."""
        if self.config.policy is not Policy.SALTGATE:
            return Plan(key, model=model)
        rate = 0.0
        if key is not None:
            rate = self._hot.observe(key, now)
            sharing = self._sharing
            if sharing is not None:
                sharing.keys[key] = sharing.keys.get(key, 0) + 1
        owners: dict[ReplicaId, tuple[int, int]] = {}
        if prefixes.digests and self._affinity is not None:
            first = self.config.affinity_first_depth
            found = self._affinity.owners(prefixes.digests, now)
            # A shared digest at depth d proves d bytes in common; the next depth did not
            # match, so fewer than 2d. Within that, what the replica holds is at most the
            # earlier prompt: the whole of it when this is its conversation's next turn.
            for rid, index, length in found:
                depth = first << index
                owners[rid] = (_shared_estimate(depth, length, prefixes.prompt_bytes), depth)
        return Plan(key, rate, prefixes.digests, prefixes.prompt_bytes, owners, model)

    def pick(
        self,
        plan: Plan,
        now: float,
        exclude: Collection[ReplicaId] = (),
        given: Sequence[ReplicaState] | None = None,
    ) -> ReplicaId | None:
        """The replica for a request not yet tried on ``exclude``, among those serving its
        model; None if none is left. ``given``: what `usable` gave for the request's model
        a moment ago (the fair queue's gate looked at them), not worked out again.

        Under ``saltgate`` the choice is remembered for the request's prefixes, so the next
        turn of the conversation follows it (`affinity.PrefixAffinity`).
        """
        usable = (
            self._usable(now, exclude, plan.model)
            if given is None
            else {state.id: state for state in given if state.id not in exclude}
        )
        if not usable:
            return None
        policy = self.config.policy
        if policy is not Policy.SALTGATE:
            states = usable.values()
            return baseline_pick(
                policy,
                plan.key,
                lambda: self._rotation(states, plan.model),
                lambda key: self._ranked(key, usable),
            ).id
        fresh = [s for s in usable.values() if not s.health.overload.overloaded]
        chosen = self._choose(plan, usable, fresh or list(usable.values()))
        if fresh:  # the choice is one of them (overloaded replicas only serve when all are)
            chosen = self._prefill_guard(chosen, plan, fresh)
        if plan.prefixes and self._affinity is not None:
            self._affinity.record(plan.prefixes, chosen.id, now, plan.prompt_bytes)
            if self._sharing is not None:
                self._sharing.placements.append((plan.prefixes, chosen.id, plan.prompt_bytes, now))
        return chosen.id

    def _choose(
        self, plan: Plan, usable: dict[ReplicaId, ReplicaState], eligible: list[ReplicaState]
    ) -> ReplicaState:
        """Policy saltgate before the prefill guard. ``eligible``: the usable replicas that
        are not overloaded (all usable ones if every replica is)."""
        owner = self._follow_prefix(plan.owners, eligible) if plan.owners else None
        if owner is not None and (
            plan.key is None or plan.rate <= self.config.per_replica_rate  # not hot: R = 1
        ):
            return owner
        if plan.key is None:
            return min(self._rotation(eligible, plan.model), key=_load)
        ranked = self._ranked(plan.key, usable)
        if len(ranked) > len(eligible):
            ranked = [s for s in ranked if s in eligible]
        return self._warm_pick(ranked, eligible, plan.rate, owner)

    def _follow_prefix(
        self, owners: Mapping[ReplicaId, tuple[int, int]], eligible: list[ReplicaState]
    ) -> ReplicaState | None:
        """The replica that served the deepest shared prefix, if within the load cap."""
        ceiling = min(map(_load, eligible)) + self.config.max_inflight_delta
        for owner in owners:
            for state in eligible:
                if state.id == owner:
                    if state.load <= ceiling:
                        return state
                    break
        return None

    def _warm_pick(
        self,
        ranked: list[ReplicaState],
        eligible: list[ReplicaState],
        rate: float,
        owner: ReplicaState | None = None,
    ) -> ReplicaState:
        """The key's warm set decides; a hot key's prefix owner competes with it on load.

        (A key that is not hot never gets here with an owner: it follows the owner, whose
        cache holds the conversation.) Competing on load lets one busy prefix spread.
        """
        size = warm_set_size(rate, self.config.per_replica_rate, len(ranked))
        warm = ranked[:size]
        if owner is not None and owner not in warm:
            warm = [owner, *warm]
        # min() keeps the first of equals: ties go to the owner, then the higher-ranked.
        best = min(warm, key=_load)
        least = min(eligible, key=_load)
        if best.load <= least.load + self.config.max_inflight_delta:
            return best
        return least

    def _prefill_guard(
        self, chosen: ReplicaState, plan: Plan, candidates: list[ReplicaState]
    ) -> ReplicaState:
        """Keep ``chosen`` unless another replica would start this prompt much sooner.

        A request's time to first token is the prefill queued before it plus its own
        uncached part, so each replica costs its prefill backlog plus the bytes of this
        prompt it does not hold. The choice stands within ``max_prefill_delta`` bytes of the
        cheapest (``max_prefill_delta_cached`` when it holds part of the prompt); beyond
        that the cheapest takes it. A conversation with a cached prefix therefore stays
        home through a larger backlog than a fresh prompt does: its cached part lowers
        its cost there, and moving it would also cost its later turns' hits.
        """
        c = self.config
        if c.max_prefill_delta <= 0:
            return chosen
        uncached = plan.uncached_bytes(chosen.id)
        delta = c.max_prefill_delta_cached if uncached < plan.prompt_bytes else c.max_prefill_delta
        cost = chosen.prefill + chosen.remote_prefill + uncached
        best, best_cost = chosen, cost
        for state in candidates:
            other = state.prefill + state.remote_prefill + plan.uncached_bytes(state.id)
            if other < best_cost:
                best, best_cost = state, other
        return chosen if cost <= best_cost + delta else best

    def _rotation(self, states: Collection[ReplicaState], model: str | None) -> list[ReplicaState]:
        """``states`` (not empty), starting one further along at every call for ``model``."""
        listed = list(states)
        turns = self._turns
        if model not in turns and len(turns) >= NAMESPACE_CACHE:
            turns.clear()  # bounded whatever model names a caller sends
        turn = turns[model] = (turns.get(model, 0) + 1) % len(listed)
        return listed[turn:] + listed[:turn]

    # -- events ----------------------------------------------------------------------------
    def started(
        self,
        replica_id: ReplicaId,
        now: float,
        prefill: float = 0.0,
        at_most: float | None = None,
    ) -> None:
        """A request went to the replica; ``prefill``: its uncached prompt bytes there
        (`Plan.uncached_bytes`), ``at_most`` their bound (`Plan.uncached_at_most`; None:
        the same), counted until `prefilled` or `finished`."""
        state = self._states.get(replica_id)
        if state is not None:
            state.inflight += 1
            self._inflight_total += 1
            _add_prefill(state, prefill, at_most)
            state.health.breaker.started(now)

    def prefilled(
        self, replica_id: ReplicaId, prefill: float, at_most: float | None = None
    ) -> None:
        """The request's first output arrived: its prompt no longer waits for prefill."""
        state = self._states.get(replica_id) or self._retired.get(replica_id)
        if state is not None:
            _add_prefill(state, -prefill, None if at_most is None else -at_most)

    def responded(self, replica_id: ReplicaId) -> None:
        """The replica answered (any status): the exchange worked."""
        state = self._states.get(replica_id)
        if state is not None:
            state.health.breaker.succeeded()

    def failed(self, replica_id: ReplicaId, now: float) -> None:
        """The exchange broke (connect, timeout, reset), before or during the response."""
        state = self._states.get(replica_id)
        if state is not None:
            state.health.breaker.failed(now)

    def finished(
        self, replica_id: ReplicaId, prefill: float = 0.0, at_most: float | None = None
    ) -> None:
        """The request no longer occupies the replica (every `started` gets one);
        ``prefill``, ``at_most``: what of its `started` prefill `prefilled` has not taken
        back."""
        state = self._states.get(replica_id)
        if state is None:
            state = self._retired.get(replica_id)
            if state is not None and state.inflight <= 1:
                del self._retired[replica_id]
        if state is not None and state.inflight > 0:
            state.inflight -= 1
            self._inflight_total -= 1
            _add_prefill(state, -prefill, None if at_most is None else -at_most)

    def probed(self, replica_id: ReplicaId, ok: bool) -> None:
        state = self._states.get(replica_id)
        if state is not None:
            state.health.probed(ok)

    def credentials_refused(self, replica_id: ReplicaId) -> None:
        """The replica answered the gateway's API key with 401 or 403: down at once, until
        a probe passes."""
        state = self._states.get(replica_id)
        if state is not None:
            state.health.probe.refused()

    def canary(self, replica_id: ReplicaId, verdict: Verdict) -> None:
        """An isolation canary's verdict on the replica (routing/canary.py)."""
        state = self._states.get(replica_id)
        if state is not None:
            state.health.isolation.observed(verdict)

    # -- the cluster bus (routing/cluster.py) --------------------------------------------------
    def start_sharing(self) -> None:
        """Keep what the other gateways should learn, from now on, for `take_shared`."""
        if self._sharing is None:
            self._sharing = _Sharing()

    def take_shared(self, max_placements: int) -> Shared:
        """What the other gateways should learn since the last take: at most
        ``max_placements`` placements (the oldest; the rest wait), every route key counted,
        and this gateway's own backlog now."""
        sharing = self._sharing
        assert sharing is not None, "start_sharing first"
        pending = sharing.placements
        placements = pending[:max_placements]
        del pending[:max_placements]
        keys = list(sharing.keys.items())
        sharing.keys.clear()
        # What may still be prefilled (the bound): the others' gates budget on it.
        backlog = [(s.id, s.inflight, s.prefill_at_most) for s in self._states.values()]
        return Shared(placements, keys, backlog)

    def drop_shared(self, keep: int) -> int:
        """Keep at most ``keep`` placements not yet taken (the oldest go first); returns
        how many were dropped."""
        pending = self._sharing.placements if self._sharing is not None else []
        excess = len(pending) - keep
        if excess > 0:
            del pending[:excess]
        return max(0, excess)

    @property
    def shared_pending(self) -> int:
        """Placements made and not yet taken by the bus."""
        return len(self._sharing.placements) if self._sharing is not None else 0

    def learn_placement(
        self,
        digests: tuple[PrefixDigest, ...],
        replica_id: ReplicaId,
        prompt_bytes: int,
        now: float,
        ttl_s: float,
    ) -> None:
        """Another gateway sent a prompt with these prefixes to ``replica_id``, still valid
        for ``ttl_s``; a placement this router made or learnt since then is kept."""
        if self._affinity is not None and replica_id in self._states:
            ttl = min(ttl_s, self.config.affinity_ttl_s)
            at = now - (self.config.affinity_ttl_s - ttl)
            self._affinity.learn(digests, replica_id, at, prompt_bytes)

    def observe_remote_key(self, key: RouteKey, count: int, now: float) -> None:
        """Another gateway saw ``count`` requests of route key ``key``: one key's rate is
        the cluster's, so it spreads as it would through one gateway."""
        if self.config.policy is Policy.SALTGATE:
            self._hot.add(key, now, count)

    def set_remote_load(self, loads: Mapping[ReplicaId, tuple[int, float]]) -> None:
        """The other gateways' (in flight, prefill bytes) per replica; replicas not named
        carry none of theirs."""
        for rid, state in self._states.items():
            inflight, prefill = loads.get(rid, (0, 0.0))
            state.set_remote(inflight, prefill)

    def observed_queue(self, replica_id: ReplicaId, waiting: float | None) -> None:
        """The replica's reported queue length (None: it reports none)."""
        state = self._states.get(replica_id)
        if state is not None:
            state.health.overload.observed(waiting)


def _union(states: Iterable[ReplicaState]) -> frozenset[str]:
    return frozenset[str]().union(*(s.models for s in states if s.models is not None))


def _add_prefill(state: ReplicaState, likely: float, at_most: float | None) -> None:
    """Change a replica's prefill backlog, both counts (never below zero)."""
    state.prefill = max(0.0, state.prefill + likely)
    state.prefill_at_most = max(
        0.0, state.prefill_at_most + (likely if at_most is None else at_most)
    )


def _shared_estimate(depth: int, earlier_prompt: int, prompt: int) -> int:
    """Bytes of this prompt a replica holds, given its deepest shared digest at ``depth``
    (so fewer than 2 * depth shared) and the length of the prompt it served."""
    return max(depth, min(2 * depth, earlier_prompt, prompt))


_load: Final = operator.attrgetter("load")
