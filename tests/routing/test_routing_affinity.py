"""Prefix affinity: keyed prefix digests, the owner table, and how the router follows them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from saltgate.derivations.derive import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    NamespaceKeys,
    PrefixDigest,
    Prompt,
)
from saltgate.routing import Plan, ReplicaId, Router, RouterConfig
from saltgate.routing.affinity import PrefixAffinity
from saltgate.routing.rendezvous import Member

pytestmark = pytest.mark.unit

KEY = b"k" * 32
MEMBERS = [Member(ReplicaId(f"http://r{i}"), 1.0) for i in range(4)]


def prefix_digests(
    body: Mapping[str, Any], route: str, *, salt: str = "salt", key: bytes = KEY
) -> list[PrefixDigest]:
    """The router's digests of a prompt: shallow first depth (256) so short turns get some."""
    return NamespaceKeys(key, "m", salt).prefix_digests(Prompt(body, route).flat(), 256)


def turns(n: int) -> list[dict[str, object]]:
    """A conversation's request bodies, each turn extending the last one."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "You help. " * 30}]
    bodies: list[dict[str, object]] = []
    for i in range(n):
        messages.append({"role": "user", "content": f"question {i} " * 40})
        bodies.append({"model": "m", "messages": list(messages)})
        messages.append({"role": "assistant", "content": f"answer {i} " * 60})
    return bodies


def test_a_later_turn_shares_the_earlier_turns_digests() -> None:
    first, second, third = (prefix_digests(body, ROUTE_CHAT) for body in turns(3))
    assert len(first) < len(second) < len(third)
    assert second[: len(first)] == first and third[: len(second)] == second
    other_salt = prefix_digests(turns(1)[0], ROUTE_CHAT, salt="other")
    other_key = prefix_digests(turns(1)[0], ROUTE_CHAT, key=b"x" * 32)
    assert not set(first) & set(other_salt)  # tenants never share a digest
    assert not set(first) & set(other_key)  # another cluster secret, other digests


def test_growing_completion_prompts_keep_their_prefix_digests() -> None:
    short = {"prompt": "word " * 300}
    longer = {"prompt": "word " * 300 + "more " * 300}
    ids_short = {"prompt": list(range(600))}
    ids_long = {"prompt": list(range(1200))}
    for a, b in ((short, longer), (ids_short, ids_long)):
        da = prefix_digests(a, ROUTE_COMPLETIONS)
        db = prefix_digests(b, ROUTE_COMPLETIONS)
        assert da and db[: len(da)] == da and len(db) > len(da)
    assert prefix_digests({"prompt": "tiny"}, ROUTE_COMPLETIONS) == []


def test_the_table_answers_deepest_first_and_forgets() -> None:
    table = PrefixAffinity(ttl_s=10, max_entries=3)
    a, b, c, d, e, f, g = (PrefixDigest(bytes([x])) for x in b"abcdefg")
    r0, r1, r2, r3 = (ReplicaId(f"r{i}") for i in range(4))
    table.record([a, b], r0, now=0)
    table.record([a, b, c], r1, now=1)
    assert table.owners([a, b, c], now=2) == [(r1, 2, 0)]
    table.record([a], r2, now=3)
    assert table.owners([a, b, c], now=4) == [(r1, 2, 0), (r2, 0, 0)]
    assert table.owners([a], now=20) == []  # expired
    table.record([d, e, f, g], r3, now=21)
    assert len(table) == 3  # bounded


def test_a_conversation_that_starts_short_follows_its_first_replica() -> None:
    config = RouterConfig(min_prompt_bytes=100_000, affinity_first_depth=256)  # no window key
    router = Router(config, KEY, MEMBERS)
    homes = []
    for body in turns(4):
        plan = router.plan(
            router.request_key(Prompt(body, ROUTE_CHAT), router.namespace("m", "s")),
            0.0,
            router.prefixes(Prompt(body, ROUTE_CHAT), router.namespace("m", "s")),
        )
        assert plan.key is None
        chosen = router.pick(plan, 0.0)
        assert chosen is not None
        homes.append(chosen)
        router.started(chosen, 0.0)  # keep it loaded: least-loaded alone would move on
    assert len(set(homes)) == 1
    control = Router(RouterConfig(min_prompt_bytes=100_000, affinity_ttl_s=0), KEY, MEMBERS)
    spread = set()
    for _ in range(4):
        chosen = control.pick(control.plan(None, 0.0), 0.0)
        assert chosen is not None
        control.started(chosen, 0.0)
        spread.add(chosen)
    assert len(spread) > 1  # without affinity the turns scatter


def test_the_load_cap_overrides_the_owner() -> None:
    config = RouterConfig(min_prompt_bytes=100_000, affinity_first_depth=256, max_inflight_delta=2)
    router = Router(config, KEY, MEMBERS)
    body = turns(1)[0]
    prefixes = router.prefixes(Prompt(body, ROUTE_CHAT), router.namespace("m", "s"))
    home = router.pick(router.plan(None, 0.0, prefixes), 0.0)
    assert home is not None
    for _ in range(3):
        router.started(home, 0.0)
    assert router.pick(router.plan(None, 0.0, prefixes), 0.0) != home


def second_turn_at_home(
    fresh_delta: float = 32_768.0, cached_delta: float = 262_144.0
) -> tuple[Router, ReplicaId, Plan, int]:
    """A router (no window keys, shallow digests, these guard deltas) that has routed a
    conversation's first turn: it, that turn's replica, the second turn's plan, and the
    bytes of the second turn that replica holds."""
    config = RouterConfig(
        min_prompt_bytes=100_000,
        affinity_first_depth=256,
        max_prefill_delta=fresh_delta,
        max_prefill_delta_cached=cached_delta,
    )
    router = Router(config, KEY, MEMBERS)
    first, second = turns(2)
    home = router.pick(
        router.plan(
            None, 0.0, router.prefixes(Prompt(first, ROUTE_CHAT), router.namespace("m", "s"))
        ),
        0.0,
    )
    assert home is not None
    plan = router.plan(
        None, 1.0, router.prefixes(Prompt(second, ROUTE_CHAT), router.namespace("m", "s"))
    )
    return router, home, plan, plan.prompt_bytes - plan.uncached_bytes(home)


def test_the_plan_knows_what_each_owner_holds() -> None:
    router, home, plan, _ = second_turn_at_home()
    first, second = turns(2)
    assert (
        plan.prompt_bytes
        == router.prefixes(Prompt(second, ROUTE_CHAT), router.namespace("m", "s")).prompt_bytes
        > 0
    )
    (owner, (depth, proven)), *_ = plan.owners.items()
    assert (
        owner == home
        and 256
        <= depth
        <= router.prefixes(Prompt(first, ROUTE_CHAT), router.namespace("m", "s"))[1]
    )
    assert plan.uncached_bytes(home) == plan.prompt_bytes - depth
    assert 0 < proven <= depth and plan.uncached_at_most(home) == plan.prompt_bytes - proven
    assert plan.uncached_bytes(ReplicaId("elsewhere")) == plan.prompt_bytes


def test_what_a_shared_digest_proves_bounds_the_uncached_part_from_above() -> None:
    """A document shared between two prompts ends between two digest depths (4 and 8 kB
    here): routing's guess takes up to the next depth as cached, while what may need
    prefilling counts only the depth a digest proves. The truth lies between the two."""
    router = Router(RouterConfig(min_prompt_bytes=100_000), KEY, MEMBERS[:1])
    document = " ".join(f"d{i}" for i in range(1200))
    home = MEMBERS[0].id
    plans = []
    for tag in ("a", "b"):
        body = {"prompt": f"{document} {tag} " + "x " * 1700}
        keys = router.namespace("m", "s")
        plans.append(router.plan(None, 0.0, router.prefixes(Prompt(body, ROUTE_COMPLETIONS), keys)))
        assert router.pick(plans[-1], 0.0) == home  # remembered for the next prompt
    first, second = plans
    assert first.uncached_bytes(home) == first.uncached_at_most(home) == first.prompt_bytes
    truly_uncached = second.prompt_bytes - len(document) - 1  # the document and its space
    assert second.uncached_bytes(home) < truly_uncached <= second.uncached_at_most(home)
    assert second.prompt_bytes - second.uncached_at_most(home) == 4096  # the deepest digest


def test_the_backlog_keeps_the_likely_count_for_routing_and_the_bound_for_budgets() -> None:
    """Routing weighs a replica's likely backlog; the saturation gate and the other
    gateways (the cluster bus) get the bound. Both drain to zero as prompts prefill."""
    router = Router(RouterConfig(), KEY, MEMBERS[:1])
    router.start_sharing()
    home = MEMBERS[0].id
    router.started(home, 0.0, prefill=1_000, at_most=5_000)
    router.started(home, 0.0, prefill=2_000)  # nothing cached: the bound is the same
    state = router.state(home)
    assert state is not None and (state.prefill, state.prefill_at_most) == (3_000, 7_000)
    assert router.take_shared(0).backlog == [(home, 2, 7_000)]
    router.prefilled(home, 1_000, 5_000)
    assert (state.prefill, state.prefill_at_most) == (2_000, 2_000)
    router.finished(home, 2_000)
    assert (state.prefill, state.prefill_at_most) == (0, 0) and state.inflight == 1


def test_a_prefill_backlog_moves_a_fresh_prompt_but_a_cached_conversation_stays() -> None:
    router, home, plan, saved = second_turn_at_home(fresh_delta=1, cached_delta=1)
    # A backlog smaller than what the home replica has cached: the conversation stays.
    router.started(home, 1.0, prefill=saved - 10)
    assert router.pick(plan, 1.0) == home
    # A backlog beyond it: another replica starts the prompt sooner.
    router.started(home, 1.0, prefill=20)
    moved = router.pick(plan, 1.0)
    assert moved is not None and moved != home
    # The backlog drains as prompts are prefilled (and never below zero).
    router.prefilled(home, saved + 10)
    state = router.state(home)
    assert state is not None and state.prefill == 0.0


@pytest.mark.parametrize("delta", [0.0, 1024.0], ids=["guard-off", "guard-on"])
def test_a_keys_top_replica_with_a_long_prefill_queue_is_passed_over(delta: float) -> None:
    router = Router(RouterConfig(max_prefill_delta=delta), KEY, MEMBERS)
    body = {"model": "m", "messages": [{"role": "system", "content": "lorem ipsum " * 500}]}
    key = router.request_key(Prompt(body, ROUTE_CHAT), router.namespace("m", "s"))
    assert key is not None
    top = router.ranking(key, 0.0)[0]
    router.started(top, 0.0, prefill=1e6)
    plan = router.plan(
        key, 0.0, router.prefixes(Prompt(body, ROUTE_CHAT), router.namespace("m", "s"))
    )
    chosen = router.pick(plan, 0.0)
    assert (chosen == top) is (delta == 0.0)


def test_a_conversation_stays_home_through_a_longer_queue_than_a_fresh_prompt() -> None:
    """Two guard deltas: a replica holding part of the prompt keeps it through up to
    max_prefill_delta_cached of extra cost; elsewhere max_prefill_delta applies."""
    router, home, plan, saved = second_turn_at_home(fresh_delta=100, cached_delta=10_000)
    router.started(home, 1.0, prefill=saved + 5_000)  # 5,000 above another replica's cost
    assert router.pick(plan, 1.0) == home
    fresh = router.plan(
        None, 1.0, router.prefixes(Prompt(turns(1)[0], ROUTE_CHAT), router.namespace("m", "o"))
    )
    assert router.pick(fresh, 1.0) != home  # another tenant's prompt: nothing cached there
