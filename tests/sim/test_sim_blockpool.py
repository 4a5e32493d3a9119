"""BlockPool: vLLM's hit rules, LRU eviction with its events, decode blocks, reset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from saltgate.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
)
from saltgate.sim import BlockPool, NotEnoughBlocks, RequestTooLarge, block_hashes, event_hash

pytestmark = pytest.mark.unit

BS = 4


def ints(tokens: list[int], salt: str | None = None, bs: int = BS) -> list[int]:
    return [event_hash(h) for h in block_hashes(tokens, bs, salt)]


def run(pool: BlockPool, rid: str, prompt: list[int], salt: str | None = None) -> int:
    cached = pool.begin(rid, prompt, salt)
    pool.prompt_computed(rid)
    return cached


def test_capacity_excludes_the_null_block() -> None:
    pool = BlockPool(num_blocks=5, block_size=BS)
    assert pool.capacity == 4
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    pool.begin("a", list(range(5)))  # 2 blocks
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(0.5)


def test_cold_then_warm_never_the_whole_prompt() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(12))  # exactly 3 full blocks
    assert run(pool, "a", prompt) == 0
    pool.finish("a")
    # A fully cached prompt recomputes its last block: (12 - 1) // 4 = 2 blocks.
    assert run(pool, "b", prompt) == 8
    pool.finish("b")
    # One more token: all 3 blocks hit.
    assert run(pool, "c", [*prompt, 99]) == 12
    pool.finish("c")
    # Partial last block never hits; a divergent second block stops the hit there.
    assert run(pool, "d", [0, 1, 2, 3, 9, 9, 9, 9, 9]) == 4
    assert pool.queries_tokens == 12 + 12 + 13 + 9
    assert pool.hits_tokens == 0 + 8 + 12 + 4


def test_peek_changes_nothing() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    run(pool, "a", list(range(9)))
    pool.take_events()
    before = (pool.num_free_blocks, pool.queries_tokens, pool.hits_tokens)
    assert pool.peek_cached_tokens(list(range(9)), None) == 8
    assert (pool.num_free_blocks, pool.queries_tokens, pool.hits_tokens) == before
    assert pool.take_events() == []


def test_running_requests_share_hit_blocks() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    run(pool, "a", list(range(9)))
    free = pool.num_free_blocks
    assert pool.begin("b", list(range(9))) == 8
    assert pool.num_free_blocks == free - 1  # only the partial block is new
    assert pool.cached_tokens("b") == 8


@pytest.mark.parametrize(
    ("first", "second", "hit"),
    [("tenantA", "tenantA", 8), ("tenantA", "tenantB", 0), ("tenantA", None, 0), (None, "t", 0)],
)
def test_salt_isolation(first: str | None, second: str | None, hit: int) -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(9))
    run(pool, "a", prompt, first)
    pool.finish("a")
    assert run(pool, "b", prompt, second) == hit


def test_block_stored_events_carry_chain_tokens_and_salt() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(10))
    pool.begin("a", prompt, "tenantA")
    assert pool.take_events() == []  # nothing is stored before the prefill is done
    pool.prompt_computed("a")
    pool.prompt_computed("a")  # idempotent
    h = ints(prompt, "tenantA")
    assert pool.take_events() == [
        BlockStored(
            block_hashes=tuple(h),
            parent_block_hash=None,
            token_ids=tuple(range(8)),
            block_size=BS,
            extra_keys=(("tenantA",), None),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    pool.finish("a")
    # A longer prompt stores only its new blocks, chained to the cached parent.
    longer = [*prompt, 10, 11, 12, 13, 14]
    assert run(pool, "b", longer, "tenantA") == 8
    h2 = ints(longer, "tenantA")
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (h2[2],)
    assert ev.parent_block_hash == h2[1]
    assert ev.token_ids == (8, 9, 10, 11)
    assert ev.extra_keys == (None,)


@pytest.mark.parametrize("case_index", [0, 1])
def test_events_match_what_live_vllm_published(case_index: int) -> None:
    vectors = json.loads(
        (Path(__file__).parent / "vectors" / "vllm_hash_vectors.json").read_text(encoding="utf-8")
    )
    case: dict[str, Any] = vectors["live_server_crosscheck_block_size_32"]["cases"][case_index]
    pool = BlockPool(num_blocks=8, block_size=32)
    run(pool, "r", case["token_ids"], case["cache_salt"])
    payload = encode_batch(EventBatch(ts=0.0, events=tuple(pool.take_events())))
    decoded = msgpack.unpackb(payload, raw=False)
    assert decoded[1] == [case["observed_BlockStored_event"]]


def test_eviction_is_lru_tail_first_with_events() -> None:
    pool = BlockPool(num_blocks=5, block_size=BS)  # 4 usable blocks
    a = list(range(100, 108))
    run(pool, "a", a)
    pool.finish("a")  # free queue: [3, 4, a1, a0]
    ha = ints(a)
    pool.take_events()
    run(pool, "b", list(range(200, 208)))  # takes the 2 never-used blocks: no eviction
    assert [e for e in pool.take_events() if isinstance(e, BlockRemoved)] == []
    pool.begin("c", list(range(300, 308)))  # must evict A: its tail block first
    assert pool.take_events() == [
        BlockRemoved(block_hashes=(ha[1],), group_idx=0),
        BlockRemoved(block_hashes=(ha[0],), group_idx=0),
    ]
    assert pool.num_cached_blocks == 2  # B's blocks
    assert pool.peek_cached_tokens([*a, 1], None) == 0


def test_hit_refreshes_lru_position() -> None:
    pool = BlockPool(num_blocks=5, block_size=BS)
    a, b = list(range(100, 105)), list(range(200, 205))
    run(pool, "a", a[:4])
    pool.finish("a")
    run(pool, "b", b[:4])
    pool.finish("b")
    assert run(pool, "a2", a) == 4  # touch A's block: now B's is least recently used
    pool.finish("a2")
    pool.take_events()
    pool.begin("c", list(range(300, 312)))  # needs 3 blocks: 2 plain + B's cached one
    removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == ints(b[:4])
    assert pool.peek_cached_tokens(a, None) == 4


def test_hits_in_the_free_queue_are_touched_before_allocation() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)  # 3 usable
    prompt = list(range(9))  # 2 full blocks + 1 partial
    run(pool, "a", prompt)
    pool.finish("a")
    pool.take_events()
    assert pool.num_free_blocks == 3
    assert pool.begin("b", [*prompt[:8], 77]) == 8  # reuses both hits, takes the partial one
    assert pool.take_events() == []  # nothing was evicted
    assert pool.num_free_blocks == 0


def test_not_enough_blocks_leaves_state_unchanged() -> None:
    pool = BlockPool(num_blocks=5, block_size=BS)
    run(pool, "a", list(range(8)))
    run(pool, "b", list(range(50, 54)))
    pool.finish("b")
    pool.take_events()
    snapshot = (
        pool.num_free_blocks,
        pool.num_cached_blocks,
        pool.queries_tokens,
        pool.hits_tokens,
        pool.num_requests,
        pool.usage,
    )
    with pytest.raises(NotEnoughBlocks) as info:
        pool.begin("c", list(range(500, 512)))  # 3 blocks, 2 free
    assert (info.value.needed, info.value.free) == (3, 2)
    assert snapshot == (
        pool.num_free_blocks,
        pool.num_cached_blocks,
        pool.queries_tokens,
        pool.hits_tokens,
        pool.num_requests,
        pool.usage,
    )
    assert pool.take_events() == []
    assert pool.peek_cached_tokens([*range(50, 54), 0], None) == 4  # B's block survived
    pool.finish("a")
    assert pool.begin("c", list(range(500, 512))) == 0  # the retry succeeds


def test_request_too_large_and_bad_calls() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    with pytest.raises(RequestTooLarge):
        pool.begin("x", list(range(9)))
    with pytest.raises(ValueError, match="at least one token"):
        pool.begin("x", [])
    pool.begin("x", [1])
    with pytest.raises(ValueError, match="already running"):
        pool.begin("x", [1])
    with pytest.raises(RuntimeError, match="prompt_computed"):
        pool.append_output("x", [2])
    with pytest.raises(KeyError):
        pool.finish("nope")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1, block_size=BS)
    with pytest.raises(ValueError, match="unknown"):
        BlockPool(num_blocks=8, block_size=BS, algo="md5")


def test_decode_blocks_are_hashed_and_stored() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(6))
    run(pool, "a", prompt, "s")
    pool.take_events()
    out = [40, 41, 42, 43, 44]
    for t in out:
        pool.append_output("a", [t])
    full = prompt + out  # 11 tokens: blocks 0 and 1 full
    h = ints(full, "s")
    assert pool.take_events() == [
        BlockStored(
            block_hashes=(h[1],),
            parent_block_hash=h[0],
            token_ids=(4, 5, 40, 41),
            block_size=BS,
            extra_keys=(None,),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    assert pool.num_free_blocks == 16 - 1 - 3
    pool.finish("a")
    # A follow-up turn that starts with prompt + output hits the decode block too.
    assert run(pool, "b", [*full, 7, 7], "s") == 8


def test_salt_reaches_block_0_even_when_decode_fills_it() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    run(pool, "a", [1, 2], "tenantA")
    assert pool.take_events() == []
    pool.append_output("a", [3, 4, 5])
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == tuple(ints([1, 2, 3, 4], "tenantA"))
    assert ev.extra_keys == (("tenantA",),)


def test_append_output_without_blocks_leaves_state_unchanged() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)  # 2 usable
    run(pool, "a", [1, 2, 3, 4, 5])  # 2 blocks
    pool.take_events()
    pool.append_output("a", [6, 7, 8])  # fills block 1: no new block needed
    assert len(pool.take_events()) == 1
    with pytest.raises(NotEnoughBlocks):
        pool.append_output("a", [9])
    assert pool.take_events() == []
    pool.finish("a")
    assert pool.peek_cached_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9], None) == 8


def test_duplicate_hash_is_not_stored_twice() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(9))
    assert pool.begin("a", prompt) == 0
    assert pool.begin("b", prompt) == 0  # concurrent: A's blocks are not stored yet
    pool.prompt_computed("a")
    pool.prompt_computed("b")
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert len(stored) == 1
    assert pool.num_cached_blocks == 2
    pool.finish("a")
    pool.finish("b")
    assert pool.num_free_blocks == 15
    assert run(pool, "c", prompt) == 8


def test_reset_only_when_idle() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS)
    run(pool, "a", list(range(9)))
    pool.take_events()
    assert pool.reset() is False
    assert pool.take_events() == []
    pool.finish("a")
    assert pool.reset() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_cached_blocks == 0
    assert run(pool, "b", list(range(9))) == 0
    # Freed-but-cleared blocks are reused without BlockRemoved events.
    assert not any(isinstance(e, BlockRemoved) for e in pool.take_events())


def test_cbor_pool_uses_cbor_hashes() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS, algo="sha256_cbor")
    run(pool, "a", list(range(5)))
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (event_hash(block_hashes(list(range(4)), BS, algo="sha256_cbor")[0]),)
    assert pool.algo == "sha256_cbor"
