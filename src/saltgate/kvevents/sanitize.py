"""What the relay republishes of a vLLM KV event: enough to route on, nothing to learn from.

vLLM's events carry the cache salt in clear text (``extra_keys``), the prompt's token ids
and LoRA identity, and block hashes anyone can recompute from a guessed prompt. A
sanitised event keeps the block structure (sizes, groups, medium) and replaces every
hash by a keyed one: stored and removed events still pair up, and the same prefix on two
replicas still matches, but only holders of the master key can link a hash to a prompt.
The keyed hashes and replica ids are spec v1 (docs/spec.md, "KV relay"): every relay of a
cluster computes the same ones. Pure: no sockets, no files.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import replace

from saltgate.derivations.encoding import lp
from saltgate.derivations.labels import KV_BLOCK_DOMAIN, KV_REPLICA_DOMAIN
from saltgate.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent


def keyed_block_hash(k_kv: bytes, block_hash: int) -> int:
    """The hash consumers see for vLLM's ``block_hash``: HMAC-SHA256 under K_kv of
    KV_BLOCK_DOMAIN || u64be(hash), its first 8 bytes as an unsigned integer."""
    mac = hmac.new(k_kv, KV_BLOCK_DOMAIN + block_hash.to_bytes(8, "big"), hashlib.sha256)
    return int.from_bytes(mac.digest()[:8], "big")


def opaque_replica_id(k_kv: bytes, name: str) -> str:
    """A stable name for a replica that reveals neither its address nor its order:
    "replica-" and 16 hex digits of HMAC-SHA256(K_kv, KV_REPLICA_DOMAIN || lp(name))."""
    mac = hmac.new(k_kv, KV_REPLICA_DOMAIN + lp(name.encode("utf-8")), hashlib.sha256)
    return "replica-" + mac.hexdigest()[:16]


def sanitize_event(k_kv: bytes, event: KVEvent) -> KVEvent:
    """Keep what a cache-aware consumer needs; drop tokens, salt and LoRA identity."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=tuple(keyed_block_hash(k_kv, h) for h in event.block_hashes),
            parent_block_hash=None if parent is None else keyed_block_hash(k_kv, parent),
            token_ids=(),
            block_size=event.block_size,
            medium=event.medium,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
        )
    if isinstance(event, BlockRemoved):
        return replace(
            event, block_hashes=tuple(keyed_block_hash(k_kv, h) for h in event.block_hashes)
        )
    return AllBlocksCleared()


def sanitize_batch(k_kv: bytes, batch: EventBatch) -> EventBatch:
    """One upstream batch, sanitised event by event (timestamp and DP rank are kept)."""
    return replace(batch, events=tuple(sanitize_event(k_kv, e) for e in batch.events))
