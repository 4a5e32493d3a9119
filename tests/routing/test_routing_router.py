"""The Router as a pure state object: policies, hot keys, the cap, health, membership."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from saltgate.config import ConfigError, load_config
from saltgate.derivations.derive import ROUTE_CHAT, Prompt, RouteKey, derive_subkeys, route_window
from saltgate.routing import Member, Plan, Policy, ReplicaId, Router, RouterConfig

pytestmark = pytest.mark.unit

SECRET = derive_subkeys(b"m" * 32).route
OTHER_SECRET = derive_subkeys(b"n" * 32).route
MEMBERS = [Member(ReplicaId(f"http://127.0.0.1:{8100 + i}")) for i in range(4)]


def router(members: list[Member] = MEMBERS, secret: bytes = SECRET, **kw: Any) -> Router:
    return Router(RouterConfig(**kw), secret, members)


def chat(system: str, user: str = "hi") -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def long_system(seed: int) -> str:
    return f"system prompt {seed} " + "lorem ipsum dolor " * 300  # ~5.4 KB: over the floor


def key_of(r: Router, seed: int, salt: str = "sg1_salt") -> RouteKey:
    key = r.request_key(Prompt(chat(long_system(seed)), ROUTE_CHAT), r.namespace("m", salt))
    assert key is not None
    return key


def set_inflight(r: Router, replica_id: ReplicaId, n: int) -> None:
    state = r.state(replica_id)
    assert state is not None
    state.inflight = n


def test_short_prompts_have_no_key_and_go_least_loaded() -> None:
    r = router()
    assert r.request_key(Prompt(chat("short"), ROUTE_CHAT), r.namespace("m", "s")) is None
    assert r.request_key(
        Prompt({**chat("short"), "prompt_cache_key": "p"}, ROUTE_CHAT), r.namespace("m", "s")
    )
    for state in r.states[:3]:
        state.inflight = 2
    assert r.pick(r.plan(None, 0.0), 0.0) == MEMBERS[3].id


def test_two_routers_with_the_same_master_key_choose_alike_and_another_key_differs() -> None:
    a, b = router(), router(list(reversed(MEMBERS)))
    c = router(secret=OTHER_SECRET)
    differs = 0
    for seed in range(200):
        key = key_of(a, seed)
        assert key_of(b, seed) == key
        assert a.ranking(key, 0.0) == b.ranking(key, 0.0)
        assert a.pick(a.plan(key, 0.0), 0.0) == b.pick(b.plan(key, 0.0), 0.0)
        differs += a.ranking(key, 0.0)[0] != c.ranking(key_of(c, seed), 0.0)[0]
    assert differs > 100  # 3/4 expected with 4 replicas; 0 if the key ignored the secret


def test_the_salt_separates_tenants_keys() -> None:
    r = router()
    tops = Counter(
        r.ranking(key_of(r, 1, salt), 0.0)[0] for salt in (f"sg1_tenant{i}" for i in range(200))
    )
    assert len(tops) == 4 and min(tops.values()) > 25  # one shared prompt, spread by tenant


def test_a_cold_key_stays_on_its_top_replica_within_the_cap() -> None:
    r = router(max_inflight_delta=4)
    key = key_of(r, 7)
    first = r.ranking(key, 0.0)[0]
    set_inflight(r, first, 4)
    assert r.pick(r.plan(key, 0.0), 0.0) == first  # 4 <= 0 + 4: affinity wins
    set_inflight(r, first, 5)
    assert r.pick(r.plan(key, 0.0), 0.0) != first  # over the cap: least-loaded instead


def test_a_hot_key_spreads_over_its_top_r_and_the_cap_bounds_the_warm_set() -> None:
    r = router(per_replica_rate=2.0, max_inflight_delta=3, hot_half_life_s=1.0)
    key = key_of(r, 3)
    ranked = r.ranking(key, 0.0)
    plan = Plan(key)
    for i in range(50):  # 5 requests/s for 10 s -> R = ceil(5 / 2) = 3
        plan = r.plan(key, i / 5)
    assert 4.2 < plan.rate < 5.8
    now = 10.0
    assert r.pick(plan, now) == ranked[0]  # equal load: the top-ranked one
    set_inflight(r, ranked[0], 1)
    assert r.pick(plan, now) == ranked[1]
    set_inflight(r, ranked[1], 1)
    assert r.pick(plan, now) == ranked[2]
    for rid in ranked[:3]:
        set_inflight(r, rid, 3)
    assert r.pick(plan, now) == ranked[0]  # 3 <= 0 + 3 (the 4th replica idles): warm set
    set_inflight(r, ranked[0], 4)
    assert r.pick(plan, now) == ranked[1]
    for rid in ranked[:3]:
        set_inflight(r, rid, 4)
    assert r.pick(plan, now) == ranked[3]  # all of the warm set over the cap: least-loaded
    set_inflight(r, ranked[0], 3)
    assert r.pick(Plan(key), now) == ranked[0]  # a cold key (R = 1) keeps its top replica


def test_retries_walk_down_the_ranking() -> None:
    r = router()
    key = key_of(r, 11)
    ranked = r.ranking(key, 0.0)
    plan = r.plan(key, 0.0)
    tried: set[ReplicaId] = set()
    order = []
    while (rid := r.pick(plan, 0.0, tried)) is not None:
        order.append(rid)
        tried.add(rid)
    assert order == ranked


def test_a_broken_replica_is_skipped_and_only_its_keys_move() -> None:
    r = router(breaker_failures=2, breaker_open_s=5.0)
    sample = [key_of(r, s) for s in range(300)]
    before = {k: r.pick(r.plan(k, 0.0), 0.0) for k in sample}
    broken = MEMBERS[1].id
    r.started(broken, 0.0)
    r.failed(broken, 0.0)
    r.finished(broken)
    r.failed(broken, 0.1)
    after = {k: r.pick(r.plan(k, 1.0), 1.0) for k in sample}
    assert broken not in after.values()
    assert all(after[k] == before[k] for k in sample if before[k] != broken)
    # The cool-down ends: one trial request; its success brings every key back.
    trial = next(k for k in sample if before[k] == broken)
    assert r.pick(r.plan(trial, 6.0), 6.0) == broken
    r.started(broken, 6.0)
    r.responded(broken)
    r.finished(broken)
    assert {k: r.pick(r.plan(k, 6.0), 6.0) for k in sample} == before


def test_failed_probes_take_a_replica_out_and_one_good_probe_brings_it_back() -> None:
    r = router(probe_failures=2)
    key = key_of(r, 5)
    top = r.ranking(key, 0.0)[0]
    r.probed(top, False)
    assert r.ranking(key, 0.0)[0] == top
    r.probed(top, False)
    assert top not in r.ranking(key, 0.0)
    r.probed(top, True)
    assert r.ranking(key, 0.0)[0] == top


def test_overload_skips_a_replica_without_changing_the_ranking() -> None:
    r = router(overload_enter_waiting=8, overload_exit_waiting=2)
    key = key_of(r, 9)
    ranked = r.ranking(key, 0.0)
    r.observed_queue(ranked[0], 12)
    assert r.ranking(key, 0.0) == ranked  # still a member
    assert r.pick(r.plan(key, 0.0), 0.0) == ranked[1]
    r.observed_queue(ranked[0], 5)  # inside the hysteresis band: still skipped
    assert r.pick(r.plan(key, 0.0), 0.0) == ranked[1]
    r.observed_queue(ranked[0], 2)
    assert r.pick(r.plan(key, 0.0), 0.0) == ranked[0]
    for rid in ranked:
        r.observed_queue(rid, 20)
    assert r.pick(r.plan(key, 0.0), 0.0) == ranked[0]  # all overloaded: still served


def test_membership_changes_keep_state_and_removed_replicas_drain() -> None:
    r = router()
    gone = MEMBERS[0].id
    r.started(gone, 0.0)
    r.started(MEMBERS[1].id, 0.0)
    r.set_members(MEMBERS[1:])
    assert r.inflight(gone) == 1 and r.inflight(MEMBERS[1].id) == 1
    assert all(r.pick(r.plan(key_of(r, s), 0.0), 0.0) != gone for s in range(50))
    r.finished(gone)
    assert r.inflight(gone) == 0
    with pytest.raises(ValueError, match="twice"):
        r.set_members([MEMBERS[1], MEMBERS[1]])


def test_baselines() -> None:
    rr = router(policy=Policy.ROUND_ROBIN)
    assert rr.request_key(Prompt(chat(long_system(1)), ROUTE_CHAT), rr.namespace("m", "s")) is None
    picks = [rr.pick(rr.plan(None, 0.0), 0.0) for _ in range(8)]
    assert Counter(picks) == {m.id: 2 for m in MEMBERS}

    ll = router(policy=Policy.LEAST_LOADED)
    for i, state in enumerate(ll.states):
        state.inflight = 3 - i if i < 3 else 2
    assert ll.pick(ll.plan(None, 0.0), 0.0) == MEMBERS[2].id

    # consistent_hash: unkeyed (any gateway, any master key, computes it), no hot spreading.
    ch, ch_other = (
        router(policy=Policy.CONSISTENT_HASH),
        router(policy=Policy.CONSISTENT_HASH, secret=OTHER_SECRET),
    )
    body = chat(long_system(2))
    key = ch.request_key(Prompt(body, ROUTE_CHAT), ch.namespace("m", "s"))
    assert key is not None and key == ch_other.request_key(
        Prompt(body, ROUTE_CHAT), ch_other.namespace("m", "other")
    )
    assert key == hashlib.sha256(_window(body)).digest()
    ranked = ch.ranking(key, 0.0)
    for state in ch.states:
        state.inflight = 100 if state.id == ranked[0] else 0
    plan = ch.plan(key, 0.0)
    for i in range(100):
        plan = ch.plan(key, i / 100)
    assert ch.pick(plan, 1.0) == ranked[0]


def _window(body: dict[str, Any]) -> bytes:
    window = route_window(body, ROUTE_CHAT)
    assert window is not None
    return window


def test_router_section_of_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    base = '[[replicas]]\nurl = "http://127.0.0.1:8100"\n'
    path.write_text(base + "[router]\npolicy = 'consistent_hash'\nper_replica_rate = 3\n")
    config = load_config(path)
    assert config.router.policy == "consistent_hash"
    assert config.router.per_replica_rate == 3.0
    assert config.config_file == path
    path.write_text(base)
    assert load_config(path).router == RouterConfig()
    for text, needle in (
        ("[router]\npolicy = 'random'\n", "router.policy"),
        ("[router]\nbreaker_failures = 1.5\n", "router.breaker_failures: expected an integer"),
        ("[router]\nhot_half_life_s = 0\n", "router.hot_half_life_s: must be > 0"),
        ("[router]\noverload_exit_waiting = 9\n", "router.overload_exit_waiting"),
        ("[router]\nwindow = 3\n", "router.window: unknown key"),
        ('[[replicas]]\nurl = "http://127.0.0.1:8100"\n', "replicas[1].url"),
    ):
        path.write_text(base + text)
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(".", r"\.")):
            load_config(path)


def test_busy_counts_requests_in_flight_including_on_removed_replicas() -> None:
    r = router()
    assert not r.busy()
    r.started(MEMBERS[0].id, 0.0)
    r.started(MEMBERS[1].id, 0.0)
    r.set_members(MEMBERS[1:])  # replica 0 leaves with a request still in flight
    r.finished(MEMBERS[1].id)
    assert r.busy()
    r.finished(MEMBERS[0].id)
    assert not r.busy()
    r.finished(MEMBERS[0].id)  # a stray report changes nothing
    assert not r.busy()
