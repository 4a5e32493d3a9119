"""The KV-event relay: its pure decisions, then the relay over real ZMQ sockets on 127.0.0.1.

The upstream here is a KvEventPublisher (vLLM's wire behaviour) or a raw PUB socket; the
simulator and the gateway feed it in test_relay_stack.py, real vLLM in tests/conformance.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import zmq
from tests.support.kv_relay import receive_until
from tests.support.waiting import eventually_blocking

from saltgate.cli import build_parser, main
from saltgate.cli.relay import _kv_relay_from_args
from saltgate.config import ConfigError, kv_relay_settings, parse_config
from saltgate.kvevents.publisher import KvEventPublisher
from saltgate.kvevents.relay import KvRelay, relay_server_keys
from saltgate.kvevents.sanitize import (
    keyed_block_hash,
    opaque_replica_id,
    sanitize_batch,
    sanitize_event,
)
from saltgate.kvevents.sequence import ReplayWindow, SeqCursor, SeqVerdict
from saltgate.kvevents.settings import CurveKeyPair, KvRelaySettings, KvUpstream, parse_client_key
from saltgate.kvevents.subscriber import RelaySubscriber
from saltgate.kvevents.wire import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    decode_batch,
    encode_batch,
    make_frames,
    parse_replay_frames,
    replay_request,
)

K_KV = bytes(range(32))
SALT = "sg1_secret-tenant-namespace-0123456789abcdefghijk"
TOKENS = tuple(range(1000, 1064))
STORED = BlockStored(
    block_hashes=(0x1111_2222_3333_4444, 0x5555_6666_7777_8888),
    parent_block_hash=None,
    token_ids=TOKENS,
    block_size=32,
    lora_id=7,
    lora_name="tenant-a-adapter",
    extra_keys=((("cache_salt", SALT),), None),
    group_idx=0,
    kv_cache_spec_kind="full_attention",
)
CHILD = BlockStored(
    block_hashes=(0x9999_AAAA_BBBB_CCCC,),
    parent_block_hash=0x5555_6666_7777_8888,
    token_ids=tuple(range(32)),
    block_size=32,
)
REMOVED = BlockRemoved(block_hashes=(0x5555_6666_7777_8888,), group_idx=0)


def client_keys() -> CurveKeyPair:
    public, secret = zmq.curve_keypair()
    return CurveKeyPair(public.decode(), secret.decode())


def dashed_client_key() -> str:
    """A consumer's public key beginning with '-', as about one random Z85 key in 82 does."""
    while not (public := client_keys().public).startswith("-"):
        pass
    return public


# ---------------------------------------------------------------------------- pure


def test_sanitize_drops_tokens_salt_and_lora_and_keys_every_hash() -> None:
    clean = sanitize_event(K_KV, STORED)
    assert isinstance(clean, BlockStored)
    assert clean.token_ids == ()
    assert clean.extra_keys is None
    assert clean.lora_id is None and clean.lora_name is None
    assert clean.block_hashes == tuple(keyed_block_hash(K_KV, h) for h in STORED.block_hashes)
    assert not set(clean.block_hashes) & set(STORED.block_hashes)
    assert (clean.block_size, clean.group_idx, clean.kv_cache_spec_kind) == (
        32,
        0,
        "full_attention",
    )
    payload = encode_batch(EventBatch(1.0, (clean,), 0))
    assert SALT.encode() not in payload and b"tenant-a" not in payload
    # Positive control: the same event unsanitised carries all of it.
    raw = encode_batch(EventBatch(1.0, (STORED,), 0))
    assert SALT.encode() in raw and b"tenant-a" in raw


def test_keyed_hashes_still_pair_stored_removed_and_parents() -> None:
    batch = sanitize_batch(K_KV, EventBatch(5.0, (STORED, CHILD, REMOVED, AllBlocksCleared()), 3))
    stored, child, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(child, BlockStored)
    assert isinstance(removed, BlockRemoved) and isinstance(cleared, AllBlocksCleared)
    assert removed.block_hashes == (stored.block_hashes[1],)
    assert child.parent_block_hash == stored.block_hashes[1]
    assert (batch.ts, batch.data_parallel_rank) == (5.0, 3)
    other_key = sanitize_event(bytes(32), REMOVED)
    assert isinstance(other_key, BlockRemoved)
    assert other_key.block_hashes != removed.block_hashes
    assert all(0 <= h < 2**64 for h in stored.block_hashes)


def test_opaque_replica_id_is_stable_and_reveals_no_address() -> None:
    rid = opaque_replica_id(K_KV, "tcp://10.0.0.5:5557")
    assert rid == opaque_replica_id(K_KV, "tcp://10.0.0.5:5557")
    assert rid != opaque_replica_id(K_KV, "tcp://10.0.0.6:5557")
    assert rid != opaque_replica_id(bytes(32), "tcp://10.0.0.5:5557")
    assert "10.0.0.5" not in rid and "5557" not in rid
    assert rid.startswith("replica-") and len(rid) == len("replica-") + 16


def test_seq_cursor_classifies_next_gap_duplicate_and_restart() -> None:
    cursor = SeqCursor()
    assert cursor.live(0) is SeqVerdict.NEXT
    cursor.advance(0)
    assert cursor.live(3) is SeqVerdict.GAP
    for seq in (1, 2, 3):  # the replay fills the gap, including the live one
        assert cursor.replayed(seq) is SeqVerdict.NEXT
        cursor.advance(seq)
    assert cursor.replayed(2) is SeqVerdict.DUPLICATE
    assert cursor.live(4) is SeqVerdict.NEXT  # replay got ahead of live: not a restart
    cursor.advance(4)
    assert cursor.live(2) is SeqVerdict.GAP  # live went back: the publisher restarted
    assert (cursor.next_seq, cursor.restarts) == (0, 1)
    ahead = SeqCursor()
    ahead.advance(9)  # replay delivered 0..9 before any live message arrived
    assert ahead.live(7) is SeqVerdict.DUPLICATE and ahead.restarts == 0


def test_admitting_messages_fills_gaps_first_and_counts_what_stays_missing() -> None:
    """The one decision the relay (upstream) and a consumer (downstream) share."""
    cursor = SeqCursor()
    fills: list[int] = []
    assert cursor.admit_live(0, lambda: fills.append(0)) == 0 and fills == []
    cursor.advance(0)
    assert cursor.admit_replayed(0) is None  # replay repeats what live delivered

    # A gap whose replay delivers everything up to and including the live message:
    def replay_all() -> None:
        fills.append(cursor.next_seq)
        for seq in (1, 2, 3):
            assert cursor.admit_replayed(seq) == 0
            cursor.advance(seq)

    assert cursor.admit_live(3, replay_all) is None and fills == [1]
    # A gap the replay cannot fill (nothing answered): 4 and 5 are lost, 6 is taken.
    assert cursor.admit_live(6, lambda: fills.append(cursor.next_seq)) == 2
    assert fills == [1, 4]
    cursor.advance(6)
    # A replay answer that starts past the expected seq: its window no longer reached back.
    assert cursor.admit_replayed(10) == 3
    assert cursor.admit_replayed(5) is None
    ahead = SeqCursor()  # replay delivered 0..2 before the first live message arrived
    for seq in range(3):
        assert ahead.admit_replayed(seq) == 0
        ahead.advance(seq)
    assert ahead.admit_live(1, lambda: fills.append(-1)) is None and fills[-1] != -1


def test_replay_window_keeps_the_last_n_in_order() -> None:
    window = ReplayWindow(3)
    for i in range(5):
        assert window.append(b"t", bytes([i])) == i
    assert [e.seq for e in window.since(0)] == [2, 3, 4]
    assert [e.payload for e in window.since(4)] == [b"\x04"]
    assert window.since(5) == []
    with pytest.raises(ValueError, match="replay_window"):
        ReplayWindow(0)


def test_server_keys_derive_from_k_kv_and_hide_the_secret() -> None:
    keys = relay_server_keys(K_KV)
    assert keys == relay_server_keys(K_KV)
    assert keys.public != relay_server_keys(bytes(32)).public
    assert zmq.curve_public(keys.secret.encode()).decode() == keys.public
    assert keys.secret not in repr(keys)


def test_settings_from_table_validate_every_key(tmp_path: Path) -> None:
    good = client_keys().public
    (tmp_path / "clients.txt").write_text(f"# consumers\n{good}\n\n")
    table = {
        "publish_endpoint": "tcp://127.0.0.1:5600",
        "replay_endpoint": "tcp://127.0.0.1:5601",
        "client_keys_file": "clients.txt",
        "replay_window": 50,
    }
    settings = kv_relay_settings(table, tmp_path)
    assert settings.client_keys == (good,) and settings.replay_window == 50
    for bad, message in (
        ({**table, "client_keys_file": "missing.txt"}, "client_keys_file: cannot read"),
        ({**table, "client_keys": ["short"]}, r"client_keys\[0\]: a CURVE public key"),
        ({**table, "publish_endpoint": 5600}, "publish_endpoint: expected a ZMQ endpoint"),
        ({**table, "replay_window": 0}, "replay_window"),
        ({**table, "color": "red"}, "unknown keys"),
        ({k: v for k, v in table.items() if k != "client_keys_file"}, "at least one"),
    ):
        with pytest.raises(ValueError, match=message):
            kv_relay_settings(bad, tmp_path)
    assert parse_client_key(f"  {good}\n") == good


# ---------------------------------------------------------------------------- over ZMQ


class Harness:
    """An upstream publisher (with replay), a started relay, and an allowed consumer key."""

    def __init__(self, window: int = 1000) -> None:
        self.upstream = KvEventPublisher(
            "tcp://127.0.0.1:*", "kv@replica0", replay_endpoint="tcp://127.0.0.1:*"
        )
        endpoint, replay = self.upstream.bound_endpoint, self.upstream.bound_replay_endpoint
        assert endpoint is not None and replay is not None
        self.allowed = client_keys()
        self.spec = KvUpstream(endpoint, replay)
        self.relay = KvRelay(
            [self.spec],
            K_KV,
            KvRelaySettings(
                "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", (self.allowed.public,), window
            ),
        )
        self.relay.start()
        assert self.relay.wait_ready(10)
        self.topic = self.relay.replica_ids[endpoint]

    def consumer(self, keys: CurveKeyPair | None = None, start_seq: int = 0) -> RelaySubscriber:
        return RelaySubscriber(
            self.relay.publish_endpoint,
            self.relay.replay_endpoint,
            self.relay.server_keys.public,
            keys or self.allowed,
            start_seq=start_seq,
        )

    def close(self) -> None:
        self.relay.close()
        self.upstream.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def test_relay_republishes_sanitised_events_to_an_allowed_consumer(harness: Harness) -> None:
    seqs = [harness.upstream.publish([STORED]), harness.upstream.publish([CHILD, REMOVED])]
    eventually_blocking(lambda: harness.relay.stats.published == 2)
    with harness.consumer() as consumer:
        got = receive_until(consumer, 2)
    assert [g.seq for g in got] == [0, 1] and seqs == [0, 1]
    assert {g.replica_id for g in got} == {harness.topic}
    assert got[0].batch == sanitize_batch(K_KV, EventBatch(got[0].batch.ts, (STORED,), 0))
    assert got[1].batch.events == tuple(sanitize_event(K_KV, e) for e in (CHILD, REMOVED))


REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


@dataclass
class Stranger:
    """A client socket not on the allow-list, and a monitor of its own handshakes (attached
    before it connects, so no refusal goes unseen)."""

    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    socket_name: str  # the relay's socket it knocks at: "publish" or "replay"
    reason: str  # why the relay refuses it: "protocol" (no CURVE) or "key"
    saw_refusal: bool = False

    def refused(self, relay: KvRelay) -> bool:
        """Refused, not merely not connected yet. Whichever side first reads the other's
        whole greeting sees a mechanism mismatch and drops the link before its own greeting
        is out, so a plain client's refusal shows on one side only; a key is refused by the
        relay's ZAP handler, which the relay always records."""
        if self.monitor.poll(0):
            self.monitor.recv_multipart()
            self.saw_refusal = True
        seen_by_relay = relay.stats.refused.get((self.socket_name, self.reason), 0) > 0
        return seen_by_relay or (self.reason == "protocol" and self.saw_refusal)


def stranger(
    ctx: zmq.Context[zmq.Socket[bytes]], relay: KvRelay, kind: int, curve: bool
) -> Stranger:
    """A plain client, or a CURVE client with a key of its own, asking for events."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        keys = client_keys()
        sock.curve_serverkey = relay.server_keys.public.encode()
        sock.curve_publickey = keys.public.encode()
        sock.curve_secretkey = keys.secret.encode()
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sock.get_monitor_socket(REFUSED)
    if kind == zmq.SUB:
        sock.connect(relay.publish_endpoint)
    else:
        sock.connect(relay.replay_endpoint)
        # Asks for every event; a link the relay has already dropped takes no message.
        with contextlib.suppress(zmq.Again):
            sock.send_multipart([b"", replay_request(0)], zmq.NOBLOCK)
    name = "publish" if kind == zmq.SUB else "replay"
    return Stranger(sock, monitor, name, "key" if curve else "protocol")


def test_unauthenticated_subscribers_get_nothing(harness: Harness) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    relay = harness.relay
    try:
        strangers = [
            stranger(ctx, relay, kind, curve)
            # plain TCP, and CURVE with a key that is not on the allow-list
            for curve in (False, True)
            for kind in (zmq.SUB, zmq.DEALER)
        ]
        eventually_blocking(
            lambda: all([s.refused(relay) for s in strangers]),
            what="the relay refused each stranger",
        )
        allowed = harness.consumer()
        allowed.catch_up()
        for _ in range(5):
            harness.upstream.publish([STORED])
        eventually_blocking(lambda: relay.stats.published == 5)
        got = receive_until(allowed, 5)
        assert len(got) == 5  # the same relay does deliver to an allowed key
        for s in strangers:
            assert not s.sock.poll(300)
        allowed.close()
    finally:
        ctx.destroy(linger=0)


def test_a_consumer_that_reconnects_misses_nothing(harness: Harness) -> None:
    first = harness.consumer()
    first.catch_up()
    for _ in range(3):
        harness.upstream.publish([STORED])
    got = receive_until(first, 3)
    first.close()
    for _ in range(4):  # published while nobody listens
        harness.upstream.publish([REMOVED])
    eventually_blocking(lambda: harness.relay.stats.published == 7)
    with harness.consumer(start_seq=got[-1].seq + 1) as second:
        rest = receive_until(second, 4)
        harness.upstream.publish([AllBlocksCleared()])
        rest.extend(receive_until(second, 5 - len(rest)))
    seqs = [g.seq for g in got + rest]
    assert seqs == list(range(8))
    assert isinstance(rest[-1].batch.events[0], AllBlocksCleared)


def test_a_consumer_behind_the_replay_window_counts_what_it_lost() -> None:
    harness = Harness(window=3)
    try:
        for _ in range(5):
            harness.upstream.publish([STORED])
        eventually_blocking(lambda: harness.relay.stats.published == 5)
        with harness.consumer() as late:  # wants seq 0; the window holds 2, 3, 4
            got = late.catch_up()
            assert [g.seq for g in got] == [2, 3, 4]
            assert late.missed == 2
    finally:
        harness.close()


def test_a_late_relay_and_an_upstream_gap_are_filled_from_replay() -> None:
    upstream = KvEventPublisher("tcp://127.0.0.1:*", "kv", replay_endpoint="tcp://127.0.0.1:*")
    allowed = client_keys()
    try:
        for _ in range(3):  # before the relay exists
            upstream.publish([STORED])
        endpoint, replay = upstream.bound_endpoint, upstream.bound_replay_endpoint
        assert endpoint is not None and replay is not None
        settings = KvRelaySettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", (allowed.public,))
        with KvRelay([KvUpstream(endpoint, replay)], K_KV, settings) as relay:
            assert relay.wait_ready(10)
            eventually_blocking(lambda: relay.stats.published == 3)
            assert relay.stats.replayed_upstream == 3
            for _ in range(2):
                upstream.publish([REMOVED])
            eventually_blocking(lambda: relay.stats.published == 5)
            assert relay.stats.missed_upstream == 0
    finally:
        upstream.close()


def curve_forwarder(keys: CurveKeyPair) -> tuple[KvEventPublisher, zmq.Context[zmq.Socket[bytes]]]:
    """A publisher whose sockets are CURVE servers holding ``keys``: what an operator puts
    beside vLLM (whose own publisher has no CURVE) to carry its events off the host."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.setsockopt(zmq.CURVE_SERVER, 1)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())
    publisher = KvEventPublisher(
        "tcp://127.0.0.1:*", "kv", replay_endpoint="tcp://127.0.0.1:*", context=ctx
    )
    return publisher, ctx


def test_a_curve_upstream_is_followed_only_with_its_pinned_server_key() -> None:
    """kv_events_curve_server_key_file: the relay subscribes as a CURVE client to the key
    it pins. The forwarder holding it delivers (live and replayed); an impostor on the
    same kind of endpoint, with another key, completes no handshake and delivers nothing."""
    genuine_keys, impostor_keys, allowed = client_keys(), client_keys(), client_keys()
    genuine, genuine_ctx = curve_forwarder(genuine_keys)
    impostor, impostor_ctx = curve_forwarder(impostor_keys)
    monitor = impostor._pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    settings = KvRelaySettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", (allowed.public,))
    pinned = genuine_keys.public
    try:
        genuine.publish([STORED])  # before the relay: it comes by the (CURVE) replay link
        specs = [
            KvUpstream(p.bound_endpoint or "", p.bound_replay_endpoint, curve_server_key=pinned)
            for p in (genuine, impostor)
        ]
        with KvRelay(specs, K_KV, settings) as relay:
            assert relay.wait_ready(10)
            eventually_blocking(lambda: relay.stats.replayed_upstream == 1)
            assert monitor.poll(10_000), "the impostor saw no handshake to refuse"
            genuine.publish([REMOVED])
            eventually_blocking(lambda: relay.stats.published == 2)
            impostor.publish([STORED])
            impostor.publish([CHILD])
            genuine.publish([REMOVED])  # after the impostor's, on its own link
            eventually_blocking(lambda: relay.stats.published == 3)
            assert relay.stats.received == 2  # the genuine live batches: none of the impostor's
    finally:
        monitor.close(linger=0)
        for publisher, ctx in ((genuine, genuine_ctx), (impostor, impostor_ctx)):
            publisher.close()
            ctx.term()


def test_upstreams_change_while_the_relay_runs(harness: Harness) -> None:
    """A replica added by a reload is followed (what it sent before is fetched too), one
    removed is dropped, and the one that stays keeps its place in the stream."""
    second = KvEventPublisher("tcp://127.0.0.1:*", "kv", replay_endpoint="tcp://127.0.0.1:*")
    try:
        endpoint, replay = second.bound_endpoint, second.bound_replay_endpoint
        assert endpoint is not None and replay is not None
        second_spec = KvUpstream(endpoint, replay)
        harness.upstream.publish([STORED])
        second.publish([CHILD])  # before the relay follows it
        eventually_blocking(lambda: harness.relay.stats.published == 1)
        harness.relay.set_upstreams([harness.spec, second_spec])
        eventually_blocking(lambda: harness.relay.stats.published == 2)  # fetched from its replay
        second.publish([REMOVED])
        harness.upstream.publish([REMOVED])
        eventually_blocking(lambda: harness.relay.stats.published == 4)
        harness.relay.set_upstreams([second_spec])
        # Applied (the dropped replica's socket closed) once the relay names only the other.
        eventually_blocking(lambda: set(harness.relay.replica_ids) == {endpoint})
        harness.upstream.publish([STORED])  # no longer followed
        second.publish([AllBlocksCleared()])
        eventually_blocking(lambda: harness.relay.stats.published == 5)
        with harness.consumer() as consumer:
            got = receive_until(consumer, 5)
        second_topic = opaque_replica_id(K_KV, endpoint)
        topics = [g.replica_id for g in got]
        assert topics.count(harness.topic) == 2 and topics.count(second_topic) == 3
        assert isinstance(got[-1].batch.events[0], AllBlocksCleared)
    finally:
        second.close()


def test_both_vllm_encodings_are_accepted_and_junk_is_dropped() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    allowed = client_keys()
    try:
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
        settings = KvRelaySettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", (allowed.public,))
        with KvRelay([KvUpstream(endpoint)], K_KV, settings) as relay:
            # No replay endpoint upstream: publish probes until the SUB has joined.
            seq = 0
            while relay.stats.received == 0:
                pub.send_multipart(make_frames("kv", seq, encode_batch(EventBatch(0.0, ()))))
                seq += 1
                time.sleep(0.05)
                assert seq < 200, "relay never joined"
            # Every probe has landed: those sent before the SUB joined count as missed.
            eventually_blocking(lambda: relay.stats.published + relay.stats.missed_upstream == seq)
            before = relay.stats.published
            pub.send_multipart(make_frames("kv", seq, encode_batch(EventBatch(1.0, (STORED,)))))
            old = EventBatch(2.0, (STORED, REMOVED))
            pub.send_multipart(make_frames("kv", seq + 1, encode_batch(old, form="array")))
            pub.send_multipart(make_frames("kv", seq + 2, b"\xc1 not msgpack"))
            pub.send_multipart([b"kv", b"short"])
            eventually_blocking(
                lambda: relay.stats.malformed == 2 and relay.stats.published == before + 2
            )
            with RelaySubscriber(
                relay.publish_endpoint, relay.replay_endpoint, relay.server_keys.public, allowed
            ) as consumer:
                got = consumer.catch_up()
            assert [g.batch.events for g in got[-2:]] == [
                (sanitize_event(K_KV, STORED),),
                tuple(sanitize_event(K_KV, e) for e in (STORED, REMOVED)),
            ]
    finally:
        ctx.destroy(linger=0)


def test_raw_upstream_frames_carry_what_the_relay_removes(harness: Harness) -> None:
    """Positive control at the byte level: the upstream replay holds salt, tokens, hashes."""
    harness.upstream.publish([STORED])
    eventually_blocking(lambda: harness.relay.stats.published == 1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        assert harness.upstream.bound_replay_endpoint is not None
        dealer.connect(harness.upstream.bound_replay_endpoint)
        dealer.send_multipart([b"", replay_request(0)])
        assert dealer.poll(5000)
        reply = parse_replay_frames(dealer.recv_multipart())
        assert reply is not None
        raw = reply[2]
    finally:
        ctx.destroy(linger=0)
    with harness.consumer() as consumer:
        relayed = consumer.catch_up()
    assert len(relayed) == 1
    clean = encode_batch(relayed[0].batch)
    raw_obj = msgpack.unpackb(raw)
    assert SALT.encode() in raw and raw_obj[1][0]["token_ids"] == list(TOKENS)
    assert SALT.encode() not in clean
    assert "token_ids" in msgpack.unpackb(clean)[1][0]
    assert msgpack.unpackb(clean)[1][0]["token_ids"] == []
    for h in STORED.block_hashes:
        assert msgpack.packb(h) in raw and msgpack.packb(h) not in clean
    assert decode_batch(raw).events[0].block_hashes == STORED.block_hashes  # type: ignore[union-attr]


def test_replay_answers_of_vllm_032_and_of_older_publishers_both_parse() -> None:
    seq = (5).to_bytes(8, "big")
    assert parse_replay_frames([b"", b"kv@r0", seq, b"p"]) == (b"kv@r0", 5, b"p")  # vLLM 0.32
    assert parse_replay_frames([b"", seq, b"p"]) == (b"", 5, b"p")  # older / the simulator
    assert parse_replay_frames([b"", b"", REPLAY_END_SEQ, b""]) is None
    assert parse_replay_frames([b"", REPLAY_END_SEQ, b""]) is None
    with pytest.raises(WireError):
        parse_replay_frames([b"", b"a", b"b", b"c", b"d"])
    with pytest.raises(WireError):
        parse_replay_frames([b"", b"t", b"short", b"p"])


def test_gateway_config_reads_replica_event_endpoints_and_the_kv_relay_section(
    tmp_path: Path,
) -> None:
    key = client_keys().public
    doc = {
        "replicas": [
            {
                "url": "http://127.0.0.1:8100",
                "kv_events_endpoint": "tcp://127.0.0.1:5557",
                "kv_events_replay_endpoint": "tcp://127.0.0.1:5558",
            },
            {"url": "http://127.0.0.1:8101"},
        ],
        "kv_relay": {
            "publish_endpoint": "tcp://127.0.0.1:5600",
            "replay_endpoint": "tcp://127.0.0.1:5601",
            "client_keys": [key],
        },
    }
    config = parse_config(doc, tmp_path)
    assert config.kv_relay == KvRelaySettings(
        "tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601", (key,)
    )
    assert [r.kv_upstream for r in config.replicas] == [
        KvUpstream("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        None,
    ]
    assert parse_config({"replicas": doc["replicas"]}, tmp_path).kv_relay is None
    no_endpoints = {**doc, "replicas": [{"url": "http://127.0.0.1:8100"}]}
    bad_key = {**doc, "kv_relay": {**doc["kv_relay"], "client_keys": ["nope"]}}  # type: ignore[dict-item]
    replay_only = {"replicas": [{"url": "http://h:1", "kv_events_replay_endpoint": "tcp://h:2"}]}
    for bad, message in (
        (no_endpoints, "no \\[\\[replicas\\]\\] has a kv_events_endpoint"),
        (bad_key, r"kv_relay.client_keys\[0\]: a CURVE public key"),
        (replay_only, r"replicas\[0\].kv_events_endpoint: missing"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_config(bad, tmp_path)


def test_the_standalone_relay_refuses_plaintext_upstreams_off_loopback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`saltgate kv-relay --upstream` has no key to pin: off loopback it needs
    --allow-plaintext-upstream (or --config with kv_events_curve_server_key_file)."""
    key = tmp_path / "master.key"
    key.write_text("ab" * 32 + "\n")
    key.chmod(0o600)
    dashed = dashed_client_key()
    common = ["kv-relay", "--master-key-file", str(key), f"--client-key={dashed}"]
    common += ["--publish", "tcp://127.0.0.1:*", "--replay", "tcp://127.0.0.1:*"]
    assert main([*common, "--upstream", "tcp://10.0.0.5:5557,tcp://127.0.0.1:5558"]) == 2
    assert "--upstream tcp://10.0.0.5:5557: off loopback without CURVE" in capsys.readouterr().err
    args = build_parser().parse_args([*common, "--upstream", "tcp://10.0.0.5:5557"])
    args.allow_plaintext_upstream = True
    _, upstreams, _ = _kv_relay_from_args(args)
    assert [u.endpoint for u in upstreams] == ["tcp://10.0.0.5:5557"]
    args = build_parser().parse_args([*common, "--upstream", "tcp://127.0.0.1:5557"])
    assert [u.endpoint for u in _kv_relay_from_args(args)[1]] == ["tcp://127.0.0.1:5557"]
    assert args.client_key == [dashed]


def test_a_client_key_beginning_with_a_dash_needs_the_equals_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """About one Z85 key in 82 begins with '-': as a word of its own argparse takes it for an
    option, which is why the help and docs/kv-relay.md write --client-key=KEY."""
    dashed = dashed_client_key()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["kv-relay", "--client-key", dashed])
    assert "--client-key: expected one argument" in capsys.readouterr().err
    args = build_parser().parse_args(["kv-relay", f"--client-key={dashed}"])
    assert args.client_key == [dashed]
