"""vLLM's KV-cache events: the wire format (pure) and a ZMQ publisher (I/O)."""

from saltgate.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    WireError,
    decode_batch,
    encode_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "WireError",
    "decode_batch",
    "encode_batch",
]
