"""Routing by model in the pure router: a request goes only to replicas serving its model,
and the rendezvous order, hot-key spreading and the prefill guard work within that set."""

from __future__ import annotations

import pytest

from saltgate.derivations.derive import ROUTE_CHAT, Prompt, RouteKey, derive_subkeys
from saltgate.routing import Member, Policy, Prefixes, ReplicaId, Router, RouterConfig

pytestmark = pytest.mark.unit

SECRET = derive_subkeys(b"m" * 32).route
MEMBERS = [Member(ReplicaId(f"http://127.0.0.1:{8100 + i}")) for i in range(6)]
# Replicas 0, 2, 4 serve "alpha"; 1, 3 "beta"; 5 both (e.g. one model under two names).
SERVES = {0: ["alpha"], 1: ["beta"], 2: ["alpha"], 3: ["beta"], 4: ["alpha"], 5: ["alpha", "beta"]}
ALPHA = {MEMBERS[i].id for i, names in SERVES.items() if "alpha" in names}
BETA = {MEMBERS[i].id for i, names in SERVES.items() if "beta" in names}


def fleet(**kw: object) -> Router:
    r = Router(RouterConfig(**kw), SECRET, MEMBERS)  # type: ignore[arg-type]
    for i, names in SERVES.items():
        r.set_models(MEMBERS[i].id, names)
    return r


def request_key(r: Router, seed: int, model: str) -> RouteKey | None:
    body = {"messages": [{"role": "system", "content": f"sys {seed} " + "lorem " * 900}]}
    return r.request_key(Prompt(body, ROUTE_CHAT), r.namespace(model, "sg1_salt"))


def key(r: Router, seed: int, model: str) -> RouteKey:
    found = request_key(r, seed, model)
    assert found is not None
    return found


def test_a_key_goes_to_its_first_ranked_replica_among_those_of_its_model() -> None:
    """Affinity is kept within the set: the choice is the full ranking's first replica that
    serves the model, so removing the other model's replicas moves none of these keys."""
    r = fleet()
    picked: set[ReplicaId] = set()
    for seed in range(200):
        for model, eligible in (("alpha", ALPHA), ("beta", BETA)):
            k = key(r, seed, model)
            first = next(rid for rid in r.ranking(k, 0.0) if rid in eligible)
            chosen = r.pick(r.plan(k, 0.0, model=model), 0.0)
            assert chosen == first
            assert r.ranking(k, 0.0, model) == [i for i in r.ranking(k, 0.0) if i in eligible]
            picked.add(chosen)
    assert picked == ALPHA | BETA  # every replica takes keys of the models it serves


@pytest.mark.parametrize("policy", list(Policy))
def test_every_policy_stays_within_the_model(policy: Policy) -> None:
    r = fleet(policy=policy)
    for seed in range(60):
        plan = r.plan(request_key(r, seed, "beta") if seed % 2 else None, 0.0, model="beta")
        chosen = r.pick(plan, 0.0)
        assert chosen in BETA
        r.started(chosen, 0.0)  # load piles up: least-loaded choices move around


def test_a_hot_key_spreads_over_its_models_replicas_only() -> None:
    r = fleet(per_replica_rate=1.0, max_inflight_delta=0.0)
    k = key(r, 7, "beta")
    chosen = set()
    for i in range(50):
        rid = r.pick(r.plan(k, i * 0.01, model="beta"), i * 0.01)
        assert rid is not None
        r.started(rid, i * 0.01)
        chosen.add(rid)
    assert chosen == BETA  # spread to all three of beta's replicas, none of alpha's


def test_the_prefill_guard_compares_only_replicas_of_the_model() -> None:
    """A backlog on the key's replica sends the prompt to the cheapest replica of its model,
    never to an idle replica that does not serve it."""
    r = fleet(max_prefill_delta=1000.0)
    k = key(r, 3, "beta")
    home, second, third = r.ranking(k, 0.0, "beta")
    r.started(home, 0.0, prefill=50_000.0)
    r.started(second, 0.0, prefill=30_000.0)
    r.started(third, 0.0, prefill=40_000.0)  # alpha's replicas have no backlog at all
    plan = r.plan(k, 0.0, Prefixes((), 2000), model="beta")
    assert r.pick(plan, 0.0) == second


def test_known_models_and_a_model_whose_replicas_are_all_down() -> None:
    r = fleet(probe_failures=1)
    assert r.serves("alpha") and r.serves("beta") and not r.serves("gamma")
    for rid in BETA:
        r.probed(rid, False)
    assert r.serves("beta")  # still known: its requests wait (503), they are not 404
    assert r.pick(r.plan(key(r, 1, "beta"), 0.0, model="beta"), 0.0) is None
    assert r.pick(r.plan(key(r, 1, "alpha"), 0.0, model="alpha"), 0.0) in ALPHA


def test_a_replica_that_changes_model_is_followed() -> None:
    r = fleet()
    moved = MEMBERS[1].id
    r.set_models(moved, ["gamma"])
    assert r.serves("gamma")
    for seed in range(40):
        assert r.pick(r.plan(key(r, seed, "gamma"), 0.0, model="gamma"), 0.0) == moved
        assert r.pick(r.plan(key(r, seed, "beta"), 0.0, model="beta"), 0.0) in BETA - {moved}
    r.set_models(MEMBERS[3].id, [])
    r.set_models(MEMBERS[5].id, ["alpha"])
    assert not r.serves("beta")  # nobody serves it any longer: unknown (404)
    r.set_members(MEMBERS[:1])
    assert not r.serves("gamma")  # its replica left the configuration


@pytest.mark.parametrize("policy", [Policy.SALTGATE, Policy.ROUND_ROBIN])
def test_keyless_requests_of_alternating_models_each_rotate_over_their_replicas(
    policy: Policy,
) -> None:
    """Ties in load go round each model's own replicas, whichever models come in between
    (one rotation shared by all would be reset by a model served once)."""
    r = fleet(policy=policy)
    r.set_models(MEMBERS[1].id, ["beta", "solo"])
    seen: set[ReplicaId | None] = set()
    for _ in range(12):
        seen.add(r.pick(r.plan(None, 0.0, model="alpha"), 0.0))
        assert r.pick(r.plan(None, 0.0, model="solo"), 0.0) == MEMBERS[1].id
    assert seen == ALPHA


def test_a_model_is_ruled_out_only_once_every_replica_has_said_what_it_serves() -> None:
    """Before a replica has answered a probe its models are unknown: any name may be one
    of them, so a request waits for a replica (503) instead of hearing the model does not
    exist (404); and no request goes to the unknown replica meanwhile."""
    r = Router(RouterConfig(), SECRET, MEMBERS[:2])
    r.set_models(MEMBERS[0].id, ["alpha"])
    assert r.serves("alpha") and r.serves("gamma")  # replica 1 might serve gamma
    assert r.pick(r.plan(key(r, 1, "gamma"), 0.0, model="gamma"), 0.0) is None
    assert r.pick(r.plan(key(r, 1, "alpha"), 0.0, model="alpha"), 0.0) == MEMBERS[0].id
    r.set_models(MEMBERS[1].id, ["beta"])
    assert r.serves("beta") and not r.serves("gamma")
