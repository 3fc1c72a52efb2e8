"""KV-cache events in vLLM 0.33's wire format, with per-group residency (issue 17).

Needs the ``events`` extra (``msgspec``; the publisher also ``pyzmq``). Module map:
``schema`` (the structs and their msgpack encoding), ``log`` (the manager-side recorder:
raw pool records → events, residency), ``replica`` (a consumer rebuilding the resident set
and landable points from a stream), ``publisher`` (ZMQ PUB + replay ROUTER).
"""

from hybridkv.events.schema import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    external_hash,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "external_hash",
]
