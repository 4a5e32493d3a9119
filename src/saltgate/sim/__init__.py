"""The simulated vLLM replica: tokenizer, vLLM's block hashing and block pool (pure)."""

from saltgate.sim.blockpool import BlockPool, NotEnoughBlocks, RequestTooLarge
from saltgate.sim.hashing import (
    BlockHasher,
    block_hashes,
    event_hash,
    get_hasher,
    none_hash,
    salt_extra_keys,
)

__all__ = [
    "BlockHasher",
    "BlockPool",
    "NotEnoughBlocks",
    "RequestTooLarge",
    "block_hashes",
    "event_hash",
    "get_hasher",
    "none_hash",
    "salt_extra_keys",
]
