"""KvEventPublisher over real ZMQ sockets on 127.0.0.1: both directions, and replay."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from saltgate.kvevents.publisher import KvEventPublisher, should_bind
from saltgate.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    parse_frames,
    parse_replay_frames,
    replay_request,
)

STORED = BlockStored(block_hashes=(1, 2**64 - 1), parent_block_hash=None, token_ids=(7,) * 8,
                     block_size=4, extra_keys=(("tenantA",), None), group_idx=0,
                     kv_cache_spec_kind="full_attention")  # fmt: skip


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def sync_subscriber(pub: KvEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish probes until the subscriber sees one (ZMQ's slow joiner); returns its seq."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        if sub.poll(50):
            _, seq, _ = parse_frames(sub.recv_multipart())
            while sub.poll(100):  # drain probes still in flight
                _, seq, _ = parse_frames(sub.recv_multipart())
            return seq
    raise AssertionError("subscriber never received a message")


def test_bind_rule_matches_vllm() -> None:
    assert should_bind("tcp://*:5557")
    assert should_bind("tcp://127.0.0.1:*")
    assert should_bind("tcp://[::]:5557")
    assert should_bind("ipc:///tmp/kv")
    assert should_bind("inproc://kv")
    assert not should_bind("tcp://127.0.0.1:5557")
    assert not should_bind("tcp://gateway.internal:5557")


def test_publisher_binds_and_subscriber_connects(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KvEventPublisher("tcp://127.0.0.1:*", "kv@r0", context=ctx) as pub:
        endpoint = pub.bound_endpoint
        assert endpoint is not None and endpoint.startswith("tcp://127.0.0.1:")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@r0")
        sub.connect(endpoint)
        last = sync_subscriber(pub, sub)
        seq = pub.publish([STORED, BlockRemoved(block_hashes=(1,), group_idx=0)], ts=12.5)
        assert seq == last + 1 == pub.next_seq - 1
        assert sub.poll(2000)
        topic, got_seq, payload = parse_frames(sub.recv_multipart())
        assert (topic, got_seq) == (b"kv@r0", seq)
        batch = decode_batch(payload)
        assert batch.ts == 12.5 and batch.data_parallel_rank == 0
        assert batch.events == (STORED, BlockRemoved(block_hashes=(1,), group_idx=0))
        sub.close(linger=0)


def test_subscriber_binds_and_publisher_connects(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with KvEventPublisher(f"tcp://127.0.0.1:{port}", "kv@r1", context=ctx) as pub:
        assert pub.bound_endpoint is None  # it connected
        first = sync_subscriber(pub, sub)
        assert first >= 0
        seqs = [pub.publish([STORED]) for _ in range(3)]
        assert seqs == [first + 1, first + 2, first + 3]
        got = []
        for _ in range(3):
            assert sub.poll(2000)
            topic, seq, payload = parse_frames(sub.recv_multipart())
            assert topic == b"kv@r1" and decode_batch(payload).events == (STORED,)
            got.append(seq)
        assert got == seqs
    sub.close(linger=0)


def test_sequence_starts_at_zero(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KvEventPublisher("inproc://kv-seq", "t", context=ctx) as pub:
        assert pub.next_seq == 0
        assert [pub.publish([]) for _ in range(3)] == [0, 1, 2]


def read_replay(sock: zmq.Socket[bytes]) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    while True:
        assert sock.poll(3000), "replay answer timed out"
        reply = parse_replay_frames(sock.recv_multipart())
        if reply is None:
            return out
        topic, seq, payload = reply
        assert topic == b"kv"  # vLLM 0.32 names the topic in every replay answer
        out.append((seq, payload))


def test_replay_over_router(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KvEventPublisher(
        "tcp://127.0.0.1:*", "kv", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3,
        context=ctx,
    ) as pub:  # fmt: skip
        replay_ep = pub.bound_replay_endpoint
        assert replay_ep is not None
        payload_by_seq = {}
        for i in range(5):
            ev = BlockRemoved(block_hashes=(i,))
            seq = pub.publish([ev], ts=float(i))
            payload_by_seq[seq] = ev
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_ep)
        # Junk first: the service must ignore it and keep answering.
        dealer.send_multipart([b"", b"short"])
        dealer.send_multipart([b"", replay_request(0)])
        got = read_replay(dealer)
        assert [s for s, _ in got] == [2, 3, 4]  # only the last buffer_steps batches
        for s, payload in got:
            assert decode_batch(payload).events == (payload_by_seq[s],)
        dealer.send_multipart([b"", replay_request(4)])
        assert [s for s, _ in read_replay(dealer)] == [4]
        dealer.send_multipart([b"", replay_request(99)])
        assert read_replay(dealer) == []
        # vLLM's own test client is a REQ socket: it reads the first reply.
        req = ctx.socket(zmq.REQ)
        req.connect(replay_ep)
        req.send(replay_request(3))
        assert req.poll(3000)
        first = parse_replay_frames(req.recv_multipart())
        assert first is not None and first[1] == 3
        dealer.close(linger=0)
        req.close(linger=0)


def test_close_is_idempotent_and_blocks_publish(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = KvEventPublisher("inproc://kv-close", "t", replay_endpoint="inproc://kv-close-r",
                           context=ctx)  # fmt: skip
    start = time.monotonic()
    pub.close()
    pub.close()
    assert time.monotonic() - start < 2
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([])


def test_bad_endpoint_leaves_no_socket(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(zmq.ZMQError):
        KvEventPublisher("inproc://kv-ok", "t", replay_endpoint="bogus://x", context=ctx)
    # The PUB socket was closed, so its endpoint is released (asynchronously, by ZMQ).
    deadline = time.monotonic() + 5
    while True:
        try:
            pub = KvEventPublisher("inproc://kv-ok", "t", context=ctx)
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the failed publisher kept its PUB socket"
            time.sleep(0.02)
    assert pub.publish([]) == 0
    pub.close()
