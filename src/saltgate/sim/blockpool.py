"""A sans-IO model of vLLM v1's KV block pool with prefix caching.

It reproduces what a client can observe of vLLM (vllm/v1/core/block_pool.py,
kv_cache_manager.py): which prompt tokens hit the cache, which blocks get evicted and when,
the KV events, and the prefix-cache metrics. No tensors, no clock: the caller (the
simulator's engine) drives it and decides what time things take.

Rules mirrored from vLLM:

- ``num_blocks`` counts vLLM's reserved null block (block 0, never handed out), so
  ``capacity = num_blocks - 1`` blocks hold tokens; ``usage`` is
  ``1 - num_free_blocks / capacity`` (free includes cached blocks no request holds), as
  ``vllm:kv_cache_usage_perc`` is computed by current vLLM.
- Only full blocks are cached, keyed by their chained hash (:mod:`saltgate.sim.hashing`);
  the cache salt enters block 0 only, so different salts never share a block.
- A lookup returns the longest cached prefix of the prompt's block hashes, at most
  ``(num_prompt_tokens - 1) // block_size`` blocks: a fully cached prompt still recomputes
  its last block, because the model needs at least one token to produce logits.
- Blocks whose ref count drops to 0 stay cached in a free queue and are evicted in LRU
  order when a new block is needed; eviction drops the hash and emits BlockRemoved.
- A finished request frees its blocks in reverse order onto the free queue's tail, so its
  tail blocks (the least shareable) are evicted before its head blocks.
- A hit touches the block: it leaves the free queue (if there) and its ref count rises.

Deliberate simplifications:

- If a full block's hash is already cached by another block (two identical prompts
  prefilled concurrently) the duplicate is not stored and no event is emitted for it; vLLM
  keeps both copies and emits BlockStored/BlockRemoved for each, which consumers must
  de-duplicate anyway.
- Blocks are stored when the caller reports the prefill done (``prompt_computed``), not at
  scheduling time as in vLLM; the engine serialises prefills, so a request arriving during
  another's prefill sees the cache as vLLM would once that step ends.
- Prefix-cache counters are updated only when ``begin`` succeeds (vLLM's scheduler may
  count a request again each step it waits for blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from saltgate.kvevents.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from saltgate.sim.hashing import BlockHasher, event_hash, get_hasher

__all__ = ["BlockPool", "NotEnoughBlocks", "RequestTooLarge"]

_SPEC_KIND = "full_attention"
_GROUP_IDX = 0


class NotEnoughBlocks(Exception):
    """Not enough free blocks right now; nothing changed, retry after a request finishes."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"need {needed} free KV blocks, {free} are free")
        self.needed = needed
        self.free = free


class RequestTooLarge(ValueError):
    """The prompt needs more blocks than the pool has at all: waiting will not help."""


@dataclass(slots=True, eq=False)
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(slots=True, eq=False)
class _Request:
    token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None
    blocks: list[_Block]
    hashes: list[bytes]
    num_cached_tokens: int
    # Blocks [0, num_settled) are either stored, hit, or skipped as duplicates.
    num_settled: int
    prompt_done: bool = False


class BlockPool:
    """vLLM's KV block pool with prefix caching, as a plain object. Not thread-safe."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        algo: str = "sha256",
        hash_seed: str | None = None,
        *,
        enable_caching: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (one is vLLM's null block), got {num_blocks}"
            )
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        """False is vLLM's --no-enable-prefix-caching: nothing is found, nothing stored."""
        self.hasher: BlockHasher = get_hasher(algo, hash_seed)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Block 0 is the null block: never free, never allocated.
        self._free: OrderedDict[int, _Block] = OrderedDict(
            (b.block_id, b) for b in self._blocks[1:]
        )
        self._cached: dict[bytes, _Block] = {}
        self._requests: dict[str, _Request] = {}
        self._events: list[KVEvent] = []
        self.queries_tokens = 0
        """Prompt tokens looked up (vllm:prefix_cache_queries)."""
        self.hits_tokens = 0
        """Prompt tokens found cached (vllm:prefix_cache_hits)."""

    # ------------------------------------------------------------------ metrics

    @property
    def algo(self) -> str:
        return self.hasher.algo

    @property
    def capacity(self) -> int:
        """Blocks that can hold tokens (num_blocks minus the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, including cached blocks no request references."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def usage(self) -> float:
        """Fraction of blocks requests hold, as vllm:kv_cache_usage_perc (1 - free/capacity)."""
        return 1.0 - len(self._free) / self.capacity

    # ------------------------------------------------------------------ lookup

    def _hits(self, hashes: Sequence[bytes], num_tokens: int) -> list[_Block]:
        limit = (num_tokens - 1) // self.block_size if self.enable_caching else 0
        hits: list[_Block] = []
        for h in hashes[:limit]:
            blk = self._cached.get(h)
            if blk is None:
                break
            hits.append(blk)
        return hits

    def peek_cached_tokens(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> int:
        """How many prompt tokens ``begin`` would find cached now; changes nothing."""
        hashes = self.hasher.block_hashes(prompt_token_ids, self.block_size, cache_salt)
        return len(self._hits(hashes, len(prompt_token_ids))) * self.block_size

    # ------------------------------------------------------------------ allocation

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _allocate(self, n: int) -> list[_Block]:
        """Pop n blocks off the free queue's head, evicting their cached hashes."""
        out: list[_Block] = []
        for _ in range(n):
            _, blk = self._free.popitem(last=False)
            if blk.block_hash is not None:
                del self._cached[blk.block_hash]
                self._events.append(
                    BlockRemoved(
                        block_hashes=(event_hash(blk.block_hash),),
                        medium=MEDIUM_GPU,
                        group_idx=_GROUP_IDX,
                    )
                )
                blk.block_hash = None
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def begin(
        self, request_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> int:
        """Look up the prompt's cached prefix and allocate blocks for the whole prompt.

        Returns the number of cached prompt tokens (a multiple of block_size). Raises
        NotEnoughBlocks, leaving every state unchanged, when the free queue is too short;
        RequestTooLarge when even an empty pool could not hold the prompt.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        num_tokens = len(prompt_token_ids)
        if num_tokens == 0:
            raise ValueError("the prompt must contain at least one token")
        total = self._blocks_for(num_tokens)
        if total > self.capacity:
            raise RequestTooLarge(
                f"the prompt needs {total} KV blocks of {self.block_size} tokens but the "
                f"pool has {self.capacity}"
            )
        hashes = self.hasher.block_hashes(prompt_token_ids, self.block_size, cache_salt)
        hits = self._hits(hashes, num_tokens)
        # Hit blocks sitting in the free queue leave it, so they count against it too.
        needed = total - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)
        if needed > len(self._free):
            raise NotEnoughBlocks(needed, len(self._free))
        for blk in hits:  # touch first, so allocation cannot evict a hit
            if blk.ref_cnt == 0:
                del self._free[blk.block_id]
            blk.ref_cnt += 1
        blocks = hits + self._allocate(total - len(hits))
        num_cached = len(hits) * self.block_size
        self._requests[request_id] = _Request(
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=num_tokens,
            cache_salt=cache_salt,
            blocks=blocks,
            hashes=hashes,
            num_cached_tokens=num_cached,
            num_settled=len(hits),
        )
        self.queries_tokens += num_tokens
        self.hits_tokens += num_cached
        return num_cached

    def _req(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no running request {request_id!r}")
        return req

    def cached_tokens(self, request_id: str) -> int:
        """The cached prompt tokens ``begin`` reported for a running request."""
        return self._req(request_id).num_cached_tokens

    # ------------------------------------------------------------------ storing

    def _store_settled(self, req: _Request, upto: int) -> None:
        """Store full blocks [num_settled, upto) and emit one BlockStored per stored run."""
        if not self.enable_caching:
            req.num_settled = max(req.num_settled, upto)
            return
        bs = self.block_size
        run: list[int] = []  # indices of blocks stored in the current contiguous run

        def flush() -> None:
            if not run:
                return
            first, last = run[0], run[-1]
            self._events.append(
                BlockStored(
                    block_hashes=tuple(event_hash(req.hashes[i]) for i in run),
                    parent_block_hash=event_hash(req.hashes[first - 1]) if first else None,
                    token_ids=tuple(req.token_ids[first * bs : (last + 1) * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    extra_keys=tuple(
                        (req.cache_salt,) if i == 0 and req.cache_salt is not None else None
                        for i in run
                    ),
                    group_idx=_GROUP_IDX,
                    kv_cache_spec_kind=_SPEC_KIND,
                )
            )
            run.clear()

        for i in range(req.num_settled, upto):
            h = req.hashes[i]
            blk = req.blocks[i]
            if h in self._cached:  # another block already holds this prefix
                flush()
                continue
            blk.block_hash = h
            self._cached[h] = blk
            run.append(i)
        flush()
        req.num_settled = max(req.num_settled, upto)

    def prompt_computed(self, request_id: str) -> None:
        """The prefill finished: cache the prompt's newly computed full blocks."""
        req = self._req(request_id)
        if req.prompt_done:
            return
        req.prompt_done = True
        self._store_settled(req, len(req.hashes))

    def append_output(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Add generated tokens to the request's KV cache, growing it block by block.

        Blocks that become full are hashed (continuing the prompt's chain) and stored. vLLM
        never computes KV for a request's final sampled token, so passing that token too
        only differs from vLLM when it exactly completes a block. Raises NotEnoughBlocks,
        leaving state unchanged, when a new block is needed and none is free (vLLM would
        preempt the request; the caller may finish it and begin it again).
        """
        req = self._req(request_id)
        if not req.prompt_done:
            raise RuntimeError(f"call prompt_computed({request_id!r}) before append_output")
        if not token_ids:
            return
        new_len = len(req.token_ids) + len(token_ids)
        extra = self._blocks_for(new_len) - len(req.blocks)
        if extra > len(self._free):
            raise NotEnoughBlocks(extra, len(self._free))
        if extra > 0:
            req.blocks.extend(self._allocate(extra))
        req.token_ids.extend(token_ids)
        self.hasher.extend(req.hashes, req.token_ids, self.block_size, req.cache_salt)
        self._store_settled(req, len(req.hashes))

    # ------------------------------------------------------------------ freeing

    def finish(self, request_id: str) -> None:
        """Release the request's blocks: tail first onto the free queue's tail (LRU)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"no running request {request_id!r}")
        for blk in reversed(req.blocks):
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = blk

    def reset(self) -> bool:
        """Drop every cached block (vLLM's /reset_prefix_cache); only when nothing runs."""
        if len(self._free) != self.capacity:
            return False
        for blk in self._cached.values():
            blk.block_hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events
