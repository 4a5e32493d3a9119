"""Routing state shared between gateways, without I/O: the bus's wire format, and two
routers exchanging batches the way two gateways do over Redis (gateway/cluster.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgpack
import pytest

from saltgate.derivations.derive import (
    CLUSTER_TAG_BYTES,
    ROUTE_COMPLETIONS,
    PrefixDigest,
    Prompt,
    RouteKey,
    cluster_keys,
)
from saltgate.governance.fairness import FairQueue
from saltgate.routing import Router, RouterConfig
from saltgate.routing.cluster import (
    HEARTBEAT_S,
    WIRE_VERSION,
    WIRE_VERSION_NO_SERVICE,
    Backlog,
    BadBatch,
    Batch,
    ClusterSettings,
    ClusterState,
    Placement,
    decode_batch,
    encode_batch,
)
from saltgate.routing.domain import ReplicaId
from saltgate.routing.rendezvous import Member

pytestmark = pytest.mark.unit

K_ROUTE = b"r" * 32
KEYS = cluster_keys(K_ROUTE)
MEMBERS = [Member(ReplicaId(f"http://r{i}"), 1.0) for i in range(4)]


def router() -> Router:
    r = Router(RouterConfig(), K_ROUTE, MEMBERS)
    for member in MEMBERS:
        r.set_models(member.id, ["m"])  # what the gateway's probes tell it
    return r


def pair() -> tuple[ClusterState, ClusterState]:
    return ClusterState(router(), KEYS, "a/1"), ClusterState(router(), KEYS, "b/2")


def deliver(src: ClusterState, dst: ClusterState, now: float) -> None:
    """What the bus does: src's next batch, applied at dst."""
    data = src.outgoing(now)
    assert data is not None
    assert dst.incoming(data, now) is not None


def route(r: Router, text: str, now: float) -> str:
    """Pick a replica for a completion prompt as the gateway does, and finish it."""
    plan = r.plan_request(ROUTE_COMPLETIONS, {"prompt": text}, "m", "salt", now, remember=True)
    chosen = r.pick(plan, now)
    assert chosen is not None
    return chosen


def conversation(seed: str) -> tuple[str, str]:
    """Two turns of a conversation that starts too short for a route key (< 4096 bytes),
    so only the prefix digests can send turn 2 where turn 1 went."""
    first = " ".join(f"{seed}{i}" for i in range(250))
    return first, first + " " + " ".join(f"more{seed}{i}" for i in range(100))


# -- the wire -------------------------------------------------------------------------------


def digest(fill: bytes) -> PrefixDigest:
    return PrefixDigest(fill * 32)


def sample_batch() -> Batch:
    return Batch(
        "gw-1/42",
        7,
        (
            Placement((digest(b"a"), digest(b"b")), ReplicaId("http://r1"), 5000, 600.0),
            Placement((digest(b"c"),), ReplicaId("http://r2"), 1500, 12.5),
        ),
        ((RouteKey(b"k" * 32), 3),),
        (Backlog(ReplicaId("http://r1"), 2, 4096.0), Backlog(ReplicaId("http://r3"), 0, 0.0)),
    )


def test_a_batch_survives_the_wire() -> None:
    batch = sample_batch()
    assert decode_batch(KEYS, encode_batch(KEYS, batch)) == batch


def test_service_survives_the_wire_and_without_it_the_batch_is_version_1() -> None:
    """With service the batch is version 2; without, it is written as version 1, byte for
    byte what a gateway of the older wire writes, and a version-1 batch from such a
    gateway is read (with no service)."""
    shared = dataclasses.replace(sample_batch(), service=(("tn_a", 812.5), ("tn_b", -3.0)))
    data = encode_batch(KEYS, shared)
    assert decode_batch(KEYS, data) == shared
    assert msgpack.unpackb(data[:-CLUSTER_TAG_BYTES])[0] == WIRE_VERSION == 2
    plain = sample_batch()
    payload = encode_batch(KEYS, plain)[:-CLUSTER_TAG_BYTES]
    doc = msgpack.unpackb(payload)
    assert doc[0] == WIRE_VERSION_NO_SERVICE == 1 and len(doc) == 7
    old = msgpack.packb(  # as a version-1 gateway encodes it
        [1, plain.sender, plain.seq, *doc[3:]]
    )
    assert old == payload
    assert decode_batch(KEYS, old + KEYS.tag(old)) == plain


def test_a_batch_with_a_bad_tag_or_from_another_cluster_is_refused() -> None:
    data = encode_batch(KEYS, sample_batch())
    flipped = data[:5] + bytes([data[5] ^ 1]) + data[6:]
    with pytest.raises(BadBatch, match="tag"):
        decode_batch(KEYS, flipped)
    other = cluster_keys(b"o" * 32)
    assert other.stream != KEYS.stream
    with pytest.raises(BadBatch, match="tag"):
        decode_batch(other, data)
    with pytest.raises(BadBatch, match="too short"):
        decode_batch(KEYS, b"x")


@pytest.mark.parametrize(
    "doc",
    [
        [3, "s", 1, [], [], [], [], []],  # a future wire version
        [2, "s", 1, [], [], [], []],  # version 2 without its service
        [1, "s", 1, [], [], [], [], [["tn_a", 1.0]]],  # version 1 with a service
        [2, "s", 1, [], [], [], [], [["tn_a", "1"]]],  # an amount that is not a number
        [2, "s", 1, [], [], [], [], [["tn_a", True]]],
        [2, "s", 1, [], [], [], [], [["tn_a", float("nan")]]],
        [2, "s", 1, [], [], [], [], [["tn_a", float("inf")]]],
        [2, "s", 1, [], [], [], [], [["", 1.0]]],  # no tenant id
        [2, "s", 1, [], [], [], [], [["t" * 65, 1.0]]],  # not a tenant id's length
        [2, "s", 1, [], [], [], [], [[7, 1.0]]],
        [2, "s", 1, [], [], [], [], [["tn_a", 1.0, 2]]],
        [],
        [1, "s", 1, ["http://r"], [[0, 10, 1000, b"short"]], [], []],  # not a 32-byte digest
        [1, "s", 1, ["http://r"], [[5, 10, 1000, b"d" * 32]], [], []],  # no such replica
        [1, "s", 1, [], [], [[b"k" * 31, 1]], []],  # a route key of 31 bytes
        [1, "s", 1, ["http://r"], [], [], [[0, -1, 0]]],  # a negative count
        [1, "s", 1, [], [], []],  # a field missing
        {"not": "a list"},
    ],
)
def test_a_well_tagged_but_malformed_batch_is_refused(doc: Any) -> None:
    payload = msgpack.packb(doc)
    with pytest.raises(BadBatch):
        decode_batch(KEYS, payload + KEYS.tag(payload))


# -- two routers, one state ----------------------------------------------------------------


def test_a_conversation_follows_its_cache_across_gateways() -> None:
    a, b = pair()
    firsts = {}
    for k in range(8):
        first, _ = conversation(f"c{k}x")
        firsts[k] = route(a.router, first, 1.0)
    deliver(a, b, 1.1)
    for k in reversed(range(8)):  # reversed: b's own rotation cannot match a's by chance
        assert route(b.router, conversation(f"c{k}x")[1], 2.0) == firsts[k]


def test_without_the_bus_the_same_turns_scatter() -> None:
    """Positive control for the test above: its second turns depend on the shared state."""
    a, b = router(), router()
    firsts = {k: route(a, conversation(f"c{k}x")[0], 1.0) for k in range(8)}
    same = sum(route(b, conversation(f"c{k}x")[1], 2.0) == firsts[k] for k in reversed(range(8)))
    assert same <= 4


def test_the_later_of_two_placements_wins_on_both_gateways() -> None:
    a, b = pair()
    route(b.router, conversation("other")[0], 0.5)  # b's least-loaded rotation is one ahead
    first, second = conversation("race")
    at_a = route(a.router, first, 1.0)
    at_b = route(b.router, first, 1.0001)  # b placed it a moment later, not knowing
    assert at_a != at_b
    deliver(a, b, 1.01)
    deliver(b, a, 1.01)
    assert route(a.router, second, 2.0) == route(b.router, second, 2.0) == at_b


def test_placements_expire_as_they_would_on_the_gateway_that_made_them() -> None:
    a, b = pair()
    first, second = conversation("old")
    went = route(a.router, first, 0.0)
    data = a.outgoing(0.0)
    assert data is not None
    ttl = a.router.config.affinity_ttl_s
    b.incoming(data, 0.0, age_s=ttl + 1)  # read from the stream after its TTL
    assert b.router.remembered_prefixes() == 0
    b.incoming(data, 0.0, age_s=1.0)
    assert b.router.remembered_prefixes() > 0
    assert route(b.router, second, 1.0) == went


def test_another_gateways_backlog_counts_until_it_goes_silent() -> None:
    a, b = pair()
    rid = ReplicaId("http://r2")
    a.router.started(rid, 0.0, prefill=500_000.0)  # a long cold prompt, queued
    deliver(a, b, 0.0)
    r2 = b.router.state(rid)
    assert r2 is not None and r2.remote_prefill == 500_000.0 and r2.load == 1.0
    assert b.router.inflight(rid) == 0  # its own count stays its own
    assert b.peers == 1
    # b's prefill guard now keeps a big cold prompt off r2 whatever the ranking says.
    picks = {route(b.router, f"{i} " + "z" * 9000, 0.1) for i in range(12)}
    assert "http://r2" not in picks
    # a heartbeat keeps it; silence past backlog_ttl_s drops it.
    assert a.outgoing(0.1) is None  # nothing new, heartbeat not due
    deliver(a, b, HEARTBEAT_S + 0.01)
    assert b.expire(HEARTBEAT_S + 1.0) == 1
    assert b.expire(HEARTBEAT_S + 0.01 + b.backlog_ttl_s + 0.01) == 0
    assert r2.remote_prefill == 0.0 and r2.load == 0.0


def test_a_key_hot_across_gateways_is_hot_on_each() -> None:
    a, b = pair()
    text = "hot " * 2000  # long enough for a route key
    prompt = Prompt({"prompt": text}, ROUTE_COMPLETIONS)
    key = a.router.request_key(prompt, a.router.namespace("m", "salt"))
    assert key is not None
    for i in range(20):
        a.router.plan(key, 0.01 * i, a.router.prefixes(prompt, a.router.namespace("m", "salt")))
    deliver(a, b, 0.2)
    alone = router().plan(key, 0.2).rate
    shared = b.router.plan(key, 0.2).rate
    assert shared > 10 * alone


def test_own_batches_are_not_applied_and_bad_ones_are_counted() -> None:
    a, b = pair()
    route(a.router, conversation("own")[0], 0.0)
    data = a.outgoing(0.0)
    assert data is not None
    assert a.incoming(data, 0.0) is None and a.received == 0
    assert b.incoming(b"\x00" * 40, 0.0) is None and b.rejected == 1
    assert b.incoming(data, 0.0) is not None and b.received == 1


def fair_pair() -> tuple[ClusterState, ClusterState, FairQueue[None], FairQueue[None]]:
    a, b = pair()
    qa = FairQueue[None](quantum_tokens=0, keep_charged=True)
    qb = FairQueue[None](quantum_tokens=0, keep_charged=True)
    a.fair, b.fair = qa, qb
    return a, b, qa, qb


def test_service_charged_through_one_gateway_moves_the_counter_on_the_other() -> None:
    a, b, qa, qb = fair_pair()
    qa.push(None, "tn_noisy", 500, deadline=1e9, weight=2.0)
    assert qa.pop() is not None
    batch = b.incoming(a.outgoing(0.0) or b"", 0.0)
    assert batch is not None and batch.service == (("tn_noisy", 250.0),)  # weighted
    assert qb.counters == {"tn_noisy": 250.0}
    assert a.outgoing(0.1) is None, "nothing new: the service went out once"
    qa.correct("tn_noisy", 500, 900)  # it used more than its estimate
    assert b.incoming(a.outgoing(0.2) or b"", 0.2) is not None
    assert qb.counters["tn_noisy"] == pytest.approx(450.0) == qa.counters["tn_noisy"]
    # and back: what b serves reaches a; a's own batches are never applied to a
    qb.push(None, "tn_quiet", 40, deadline=1e9)
    assert qb.pop() is not None
    assert a.incoming(b.outgoing(0.3) or b"", 0.3) is not None
    assert qa.counters["tn_quiet"] == 40.0 and qa.counters["tn_noisy"] == 450.0


def test_without_a_fair_queue_linked_service_is_neither_sent_nor_applied() -> None:
    """The control: a receiver with no queue linked ignores service (a batch still
    applies its placements); a sender with none writes version-1 batches."""
    a, b, qa, qb = fair_pair()
    b.fair = None
    qa.push(None, "tn_noisy", 500, deadline=1e9)
    assert qa.pop() is not None
    batch = b.incoming(a.outgoing(0.0) or b"", 0.0)
    assert batch is not None and batch.service and qb.counters == {}
    a.fair = None
    qa.push(None, "tn_noisy", 500, deadline=1e9)
    assert qa.pop() is not None
    data = a.outgoing(1.0)  # a heartbeat
    assert data is not None and msgpack.unpackb(data[:-CLUSTER_TAG_BYTES])[0] == 1


def test_while_the_bus_is_down_placements_wait_bounded() -> None:
    a, _ = pair()
    for i in range(5):
        route(a.router, conversation(f"wait{i}")[0], 0.0)
    assert a.trim_pending() == 0
    batch = decode_batch(KEYS, a.outgoing(0.0) or b"")
    assert len(batch.placements) == 5


# -- [cluster] -------------------------------------------------------------------------------


def test_cluster_settings_parse_and_refuse_clearly(tmp_path: Path) -> None:
    s = ClusterSettings.from_table(
        {"url": "redis://bus@10.0.0.7:6379/0", "gateway_id": "node-a", "password_file": "pw"},
        tmp_path,
    )
    assert s.password_file == tmp_path / "pw" and s.publish_interval_s == 0.001
    assert ClusterSettings.from_table({"url": "rediss://h:6380"}, tmp_path).gateway_id is None
    bad: list[tuple[dict[str, Any], str]] = [
        ({"gateway_id": "a"}, "url: missing"),
        ({"url": "redis://x:1", "gateway_id": ""}, "gateway_id: expected a non-empty"),
        ({"url": "http://x:1", "gateway_id": "a"}, "url: expected redis://"),
        ({"url": "redis://u:hunter2x@x:1", "gateway_id": "a"}, "do not put the password"),
        ({"url": "redis://x:1", "gateway_id": "a b"}, "gateway_id: 1-64"),
        ({"url": "redis://x:1", "gateway_id": "a", "password": "hunter2x"}, "password: do"),
        ({"url": "redis://x:1", "gateway_id": "a", "colour": 1}, "colour: unknown key"),
        ({"url": "redis://x:1", "gateway_id": "a", "backlog_ttl_s": 0.1}, "backlog_ttl_s"),
        ({"url": "redis://x:1", "gateway_id": "a", "publish_interval_s": True}, "a number"),
    ]
    for table, message in bad:
        with pytest.raises(ValueError, match=message) as err:
            ClusterSettings.from_table(table, tmp_path)
        assert "hunter2x" not in str(err.value)
