"""KV-cache events in vLLM 0.33's wire format (``vllm.distributed.kv_events``).

The structs mirror vLLM's field for field, in vLLM's order, with the same msgspec options,
so the bytes are what vLLM's ``ZmqEventPublisher`` sends and vLLM's own classes decode them:

- the batch (``KVEventBatch``) is an *array*: ``[ts, events, data_parallel_rank]``;
- each event is a *map* tagged ``{"type": "BlockStored", ...}`` (``tag=True``), fields with
  a default are left out while they equal it (``omit_defaults``);
- block hashes are vLLM's default external form: the low 64 bits of the hash read
  big-endian (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).

Residency (hybridkv's extension): ``landing_hashes`` on ``BlockStored`` / ``BlockRemoved``
of a non-full group lists the hit points ``p`` that this store made landable / this removal
made unlandable in that group, each named by the chained hash of the prefix ``[0, p)``. It
is the last field and a map key vLLM does not know, so vLLM's decoder (and any decoder that
ignores unknown map keys) skips it: checked against vLLM 0.33 by
``bench/events_vllm_compat.py``.

>>> batch = KVEventBatch(ts=1.5, events=[AllBlocksCleared()], data_parallel_rank=0)
>>> encode_batch(batch)
b'\\x93\\xcb?\\xf8\\x00\\x00\\x00\\x00\\x00\\x00\\x91\\x81\\xa4type\\xb0AllBlocksCleared\\x00'
>>> decode_batch(encode_batch(batch)) == batch
True
>>> external_hash(bytes(range(32)))  # the last 8 bytes, big-endian
1736447835066146335
"""

from __future__ import annotations

from typing import Any

import msgspec

from hybridkv.ids import BlockHash

ExternalBlockHash = int | bytes
"""A block hash as published: vLLM's ``ExternalBlockHash`` (``bytes | int``)."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

_LOW_64_BITS = (1 << 64) - 1


def external_hash(block_hash: BlockHash) -> int:
    """vLLM's ``maybe_convert_block_hash`` with int hashes: low 64 bits, big-endian."""
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch``)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event maps (vLLM's ``KVCacheEvent``)."""


class BlockStored(KVCacheEvent):
    """Blocks of one group became hittable (vLLM's fields, then hybridkv's extension)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    landing_hashes: list[int] | None = None
    """hybridkv: hit points of this (non-full) group that became landable."""
    landing_tail_blocks: int | None = None
    """hybridkv, capped-rule groups: a hit at the end of the group's block ``i`` needs
    blocks ``[i - t + 1, i]`` resident (fewer near the start); the consumer derives where
    hits land (``landing.LandingRuns``)."""
    landing_alignment_tokens: int | None = None
    """hybridkv, with ``landing_tail_blocks``: hits land only at multiples of this."""
    first_block_index: int | None = None
    """hybridkv, with ``landing_tail_blocks``: table position of ``block_hashes[0]``."""


class BlockRemoved(KVCacheEvent):
    """A cached copy of a block left the prefix cache (one hash per event, as vLLM)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    landing_hashes: list[int] | None = None
    """hybridkv: hit points of this (non-full) group that are no longer landable."""


class AllBlocksCleared(KVCacheEvent):
    """Every cached block was dropped (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """What one publish sends: a timestamp and the events of one scheduler step."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload vLLM's publisher sends for ``batch``."""
    payload: bytes = _ENCODER.encode(batch)  # typed local: see ``decode_batch``
    return payload


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload (ours or vLLM's) into a ``KVEventBatch``.

    Raises:
        msgspec.DecodeError / msgspec.ValidationError: not a valid batch.
    """
    # Through a typed local: without msgspec installed (pip's isolated build environment,
    # ``python -m hybridkv.native_build --check``) the decoder's result is ``Any``.
    batch: KVEventBatch = _DECODER.decode(payload)
    return batch
