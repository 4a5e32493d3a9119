"""Wire format: byte-exact against vLLM 0.32's payloads, older array form, junk handling."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest

from saltgate.kvevents.wire import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    make_frames,
    parse_frames,
    parse_replay_frames,
    replay_request,
)

SAMPLES: dict[str, Any] = json.loads(
    (Path(__file__).parent / "vectors" / "vllm_kv_event_samples.json").read_text(encoding="utf-8")
)


def payload_of(name: str) -> bytes:
    return base64.b64decode(SAMPLES[name]["payload_b64_of_whole_batch"])


@pytest.mark.parametrize("name", ["BlockStored", "BlockRemoved", "AllBlocksCleared"])
def test_samples_round_trip_byte_exact(name: str) -> None:
    payload = payload_of(name)
    batch = decode_batch(payload)
    assert encode_batch(batch) == payload
    assert batch.data_parallel_rank == 0
    assert batch.ts == SAMPLES[name]["batch"][0]
    assert type(batch.events[0]).__name__ == name


def test_sample_fields_decode_as_vllm_sent_them() -> None:
    stored = decode_batch(payload_of("BlockStored")).events[0]
    assert stored == BlockStored(
        block_hashes=(16228921110351060496, 14948828925085040249, 5334098404591695063),
        parent_block_hash=None,
        token_ids=(50,) * 96,
        block_size=32,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=(None, None, None),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    removed = decode_batch(payload_of("BlockRemoved"))
    assert removed.events[0] == BlockRemoved(block_hashes=(5334098404591695063,), group_idx=0)
    salted = removed.events[2]
    assert isinstance(salted, BlockStored)
    assert salted.extra_keys == (("tenantA",), None, None)
    cleared = decode_batch(payload_of("AllBlocksCleared"))
    assert cleared.events[0] == AllBlocksCleared()


def test_encoding_details_uint64_float64_and_omitted_defaults() -> None:
    batch = EventBatch(
        ts=1.5,
        events=(
            BlockStored(
                block_hashes=(2**64 - 1,), parent_block_hash=7, token_ids=(1,), block_size=1
            ),
            BlockRemoved(block_hashes=(3,)),
        ),
    )
    raw = encode_batch(batch)
    assert raw[1:2] == b"\xcb"  # ts is a float64
    assert b"\xcf" + b"\xff" * 8 in raw  # unsigned 64-bit hash
    obj = msgpack.unpackb(raw, raw=False)
    assert len(obj) == 2  # data_parallel_rank None is omitted
    assert list(obj[1][0]) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
        "lora_id", "medium", "lora_name",
    ]  # fmt: skip
    assert obj[1][1] == {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
    assert decode_batch(raw) == batch


def test_older_positional_form_is_accepted() -> None:
    h = 12345678901234567890
    # vLLM 0.9: [tag, hashes, parent, tokens, block_size, lora_id]; BlockRemoved [tag, hashes].
    old = msgpack.packb(
        [1.25, [["BlockStored", [h], None, [1, 2], 2, None], ["BlockRemoved", [h]],
                ["AllBlocksCleared"]]],
    )  # fmt: skip
    batch = decode_batch(old)
    assert batch.ts == 1.25 and batch.data_parallel_rank is None
    assert batch.events == (
        BlockStored(block_hashes=(h,), parent_block_hash=None, token_ids=(1, 2), block_size=2,
                    medium=None),
        BlockRemoved(block_hashes=(h,), medium=None),
        AllBlocksCleared(),
    )  # fmt: skip
    # A later array form with medium, lora_name, extra_keys, group_idx.
    newer = msgpack.packb(
        [2.0, [["BlockStored", [1, 2], 9, [5] * 4, 2, None, "GPU", None, [["s"], None], 0],
               ["BlockRemoved", [1], "GPU", 0]], 0]
    )  # fmt: skip
    b2 = decode_batch(newer)
    stored = b2.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == 9 and stored.extra_keys == (("s",), None)
    assert stored.group_idx == 0 and b2.data_parallel_rank == 0
    assert b2.events[1] == BlockRemoved(block_hashes=(1,), medium="GPU", group_idx=0)


def test_array_encoding_round_trips_and_trims_only_trailing_defaults() -> None:
    batch = decode_batch(payload_of("BlockRemoved"))
    arr = encode_batch(batch, form="array")
    assert decode_batch(arr) == batch
    obj = msgpack.unpackb(arr, raw=False)
    assert obj[1][0] == ["BlockRemoved", [5334098404591695063], "GPU", 0]
    plain = EventBatch(ts=0.0, events=(BlockRemoved(block_hashes=(1,)),))
    assert msgpack.unpackb(encode_batch(plain, form="array"))[1][0] == ["BlockRemoved", [1], "GPU"]


def test_bytes_and_signed_hashes_fold_to_unsigned_64() -> None:
    digest = bytes(range(32))
    raw = msgpack.packb(
        [0.0, [{"type": "BlockRemoved", "block_hashes": [digest, -1], "medium": "GPU"}]],
        use_bin_type=True,
    )
    (ev,) = decode_batch(raw).events
    assert ev == BlockRemoved(block_hashes=(int.from_bytes(digest[-8:], "big"), 2**64 - 1))


@pytest.mark.parametrize(
    "obj",
    [
        {"ts": 1},
        [1.0],
        [1.0, [], 0, 9],
        ["x", []],
        [1.0, {}],
        [1.0, [], "rank"],
        [1.0, [{"type": "Nope"}]],
        [1.0, [["Nope"]]],
        [1.0, [[]]],
        [1.0, [5]],
        [1.0, [["BlockStored", [1]]]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0}]],
        [1.0, [{"type": "BlockStored", "block_hashes": 1, "token_ids": [], "block_size": 1}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [-1], "block_size": 1}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [True], "token_ids": [], "block_size": 1}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1.5], "token_ids": [], "block_size": 1}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": 1,
                "extra_keys": "salt"}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [b""]}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 5}]],
        [1.0, [{"type": ["unhashable"]}]],
    ],
)  # fmt: skip
def test_malformed_structures_raise_wire_error(obj: object) -> None:
    with pytest.raises(WireError):
        decode_batch(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize(
    "raw", [b"", b"\xc1", b"\x93", b"\x92\xcb\x00", b"\xa2\xff\xfe", b"\x92\x00\x90\x00"]
)
def test_invalid_msgpack_raises_wire_error(raw: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(raw)


def test_fuzz_random_and_mutated_bytes_never_crash() -> None:
    rng = random.Random(1234)
    seeds = [payload_of(n) for n in ("BlockStored", "BlockRemoved", "AllBlocksCleared")]
    for i in range(3000):
        if i % 2:
            raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        else:
            buf = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 6)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            raw = bytes(buf[: rng.randint(1, len(buf))])
        try:
            batch = decode_batch(raw)
        except WireError:
            continue
        assert isinstance(batch, EventBatch)  # anything accepted re-encodes cleanly
        assert decode_batch(encode_batch(batch)) == batch


def test_frames_and_seq() -> None:
    frames = make_frames("kv@replica1", 3, b"payload")
    assert frames == [b"kv@replica1", b"\x00" * 7 + b"\x03", b"payload"]
    assert parse_frames(frames) == (b"kv@replica1", 3, b"payload")
    assert decode_seq(encode_seq(2**64 - 1)) == 2**64 - 1
    with pytest.raises(WireError):
        parse_frames([b"t", b"\x00"])
    with pytest.raises(WireError):
        parse_frames([b"t", b"\x00" * 7, b"p"])
    with pytest.raises(ValueError):
        encode_seq(-1)


def test_replay_helpers() -> None:
    assert replay_request(5) == b"\x00" * 7 + b"\x05"
    assert parse_replay_frames([b"", b"kv@r0", encode_seq(4), b"p"]) == (b"kv@r0", 4, b"p")
    assert parse_replay_frames([b"kv@r0", encode_seq(4), b"p"]) == (b"kv@r0", 4, b"p")  # REQ
    assert parse_replay_frames([b"", encode_seq(4), b"p"]) == (b"", 4, b"p")  # older vLLM
    assert parse_replay_frames([b"", b"", REPLAY_END_SEQ, b""]) is None
    assert parse_replay_frames([b"", REPLAY_END_SEQ, b""]) is None
    assert REPLAY_END_SEQ == b"\xff" * 8
    with pytest.raises(WireError):
        parse_replay_frames([b"x"])
