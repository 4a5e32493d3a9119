"""The KV-event relay seen from outside: a replica's raw stream, a consumer's view, and
the leak check that compares them (used by tests/kvevents and tests/conformance)."""

from __future__ import annotations

import re
import time

import zmq

from saltgate.kvevents.sanitize import keyed_block_hash
from saltgate.kvevents.settings import CurveKeyPair
from saltgate.kvevents.subscriber import RelayedBatch, RelaySubscriber
from saltgate.kvevents.wire import (
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    parse_replay_frames,
    replay_request,
)


def raw_stream(replay_endpoint: str, start_seq: int = 0) -> list[tuple[int, bytes]]:
    """(seq, payload) a replica published from ``start_seq`` on, from its replay socket."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", replay_request(start_seq)])
        replies: list[tuple[int, bytes]] = []
        while dealer.poll(5000):
            reply = parse_replay_frames(dealer.recv_multipart())
            if reply is None:
                return replies
            replies.append(reply[1:])
        raise AssertionError("the replica's replay socket did not finish answering")
    finally:
        ctx.destroy(linger=0)


def first_seq_since(replay_endpoint: str, start_seq: int) -> int | None:
    """The seq of the first batch a replica's replay answers from ``start_seq`` on, or None
    when it answers with the end marker alone (it has published nothing since). Reads
    one message, so it never depends on the rest of the replay arriving."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", replay_request(start_seq)])
        if not dealer.poll(5000):
            raise AssertionError("the replica's replay socket did not answer")
        reply = parse_replay_frames(dealer.recv_multipart())
        return None if reply is None else reply[1]
    finally:
        ctx.destroy(linger=0)


def receive_until(
    consumer: RelaySubscriber, count: int, timeout_s: float = 10.0
) -> list[RelayedBatch]:
    """Catch up, then read until ``count`` messages have arrived (or the timeout passed).

    Catching up again after each read also recovers what was published between the
    first catch-up and the subscription taking effect, which no live message reveals.
    """
    got = consumer.catch_up()
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got.extend(consumer.receive(0.1))
        got.extend(consumer.catch_up())
    return got


def collect(
    publish: str, replay: str, server_key: str, keys: CurveKeyPair, count: int
) -> list[RelayedBatch]:
    """What a fresh consumer with ``keys`` reads from the relay, up to ``count`` messages."""
    with RelaySubscriber(publish, replay, server_key, keys) as consumer:
        return receive_until(consumer, count)


def assert_nothing_leaks(
    raw: list[bytes], relayed: list[RelayedBatch], k_kv: bytes, *, evictions: bool = True
) -> None:
    """The positive control (raw holds salts, tokens, hashes) and the property itself."""
    raw_events = [e for payload in raw for e in decode_batch(payload).events]
    stored = [e for e in raw_events if isinstance(e, BlockStored)]
    salts = set(re.findall(rb"sg1_[A-Za-z0-9_-]+", b"".join(raw)))
    raw_hashes = {h for e in raw_events for h in _hashes(e)}
    assert salts, "positive control: the raw stream carries the salts"
    assert any(e.token_ids for e in stored), "positive control: the raw stream has token ids"
    if evictions:
        assert any(isinstance(e, BlockRemoved) for e in raw_events), "evictions were expected"
    assert len(relayed) == len(raw)

    out_hashes = {h for r in relayed for e in r.batch.events for h in _hashes(e)}
    for event in (e for r in relayed for e in r.batch.events):
        if isinstance(event, BlockStored):
            assert event.token_ids == () and event.extra_keys is None
            assert event.lora_name is None and event.lora_id is None
    assert not out_hashes & raw_hashes
    assert out_hashes == {keyed_block_hash(k_kv, h) for h in raw_hashes}
    published = b"".join(encode_batch(r.batch) for r in relayed)  # what went on the wire
    assert not [salt for salt in salts if salt in published]
    assert b"sg1_" not in published


def _hashes(event: object) -> list[int]:
    out: list[int] = []
    if isinstance(event, BlockStored):
        out.extend(event.block_hashes)
        if event.parent_block_hash is not None:
            out.append(event.parent_block_hash)
    elif isinstance(event, BlockRemoved):
        out.extend(event.block_hashes)
    return out
