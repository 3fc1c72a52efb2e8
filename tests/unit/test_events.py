"""KV events: vLLM 0.33's wire format, the manager hook, residency (issue 17 part 1)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from hybridkv.cache import KVCacheManager
from hybridkv.config import CacheConfig
from hybridkv.errors import InvariantViolation
from hybridkv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    external_hash,
)
from hybridkv.events.replica import ResidentReplica
from hybridkv.hashing import ExtraKeys
from hybridkv.specs import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)

GOLDEN = Path(__file__).parent / "data" / "kv_events_golden.hex"


def _manager(*specs: object, num_blocks: int = 16, retention: str = "prepend",
             events: bool = True) -> KVCacheManager:
    config = CacheConfig.from_layers(list(specs), num_blocks=num_blocks)  # type: ignore[arg-type]
    return KVCacheManager(config, retention, enable_kv_cache_events=events)


def _admit(manager: KVCacheManager, req_id: str, tokens: list[int], **kw: object) -> int:
    manager.add_request(req_id, tokens, **kw)  # type: ignore[arg-type]
    hit = manager.find_longest_hit(req_id)
    assert manager.allocate_slots(req_id, len(tokens) - hit.num_tokens, hit) is not None
    return hit.num_tokens


def _golden_stream() -> bytes:
    """A fixed scenario: stores in three groups (full; a window, whose events announce the
    capped tail rule; chunked local, whose events list landings), an eviction, a reset."""
    manager = _manager(FullAttentionSpec(4, 1), SlidingWindowSpec(4, 1, 8),
                       ChunkedLocalSpec(4, 1, 8), num_blocks=15)
    batches = []
    _admit(manager, "a", list(range(13)), session_id="s1",
           extra_keys=ExtraKeys(lora_name="ad", cache_salt="salt"))
    batches.append(KVEventBatch(ts=1.0, events=manager.take_events(), data_parallel_rank=0))
    manager.remove_request("a")
    _admit(manager, "b", list(range(100, 113)))
    batches.append(KVEventBatch(ts=2.0, events=manager.take_events(), data_parallel_rank=0))
    manager.remove_request("b")
    assert manager.reset_prefix_cache()
    batches.append(KVEventBatch(ts=3.0, events=manager.take_events(), data_parallel_rank=0))
    return b"".join(len(p).to_bytes(4, "big") + p for p in map(encode_batch, batches))


def _split(stream: bytes) -> list[bytes]:
    payloads, at = [], 0
    while at < len(stream):
        size = int.from_bytes(stream[at : at + 4], "big")
        payloads.append(stream[at + 4 : at + 4 + size])
        at += 4 + size
    return payloads


def test_golden_bytes_are_stable() -> None:
    """Our encoder reproduces the stored sample byte for byte (regenerate it only for a
    deliberate format change: ``python tests/unit/test_events.py``)."""
    assert _golden_stream().hex() == GOLDEN.read_text().strip()


def test_golden_sample_decodes_to_the_scenario() -> None:
    batches = [decode_batch(p) for p in _split(bytes.fromhex(GOLDEN.read_text().strip()))]
    assert [b.ts for b in batches] == [1.0, 2.0, 3.0]
    first = batches[0].events
    assert [type(e) for e in first] == [BlockStored, BlockStored, BlockStored]
    full, window, chunked = first
    assert (window.landing_tail_blocks, window.landing_alignment_tokens,
            window.first_block_index, window.landing_hashes) == (2, 4, 0, None)
    assert chunked.kv_cache_spec_kind == "chunked_local_attention"
    assert chunked.landing_hashes and chunked.landing_tail_blocks is None
    assert full.group_idx == 0 and full.kv_cache_spec_kind == "full_attention"
    assert window.group_idx == 1 and window.kv_cache_spec_kind == "sliding_window"
    assert window.kv_cache_spec_sliding_window == 8 and full.kv_cache_spec_sliding_window is None
    assert full.token_ids == list(range(12)) and full.block_size == 4
    assert full.parent_block_hash is None and full.session_id == "s1"
    assert full.lora_name == "ad" and full.extra_keys == [("ad", "salt"), ("ad",), ("ad",)]
    assert any(isinstance(e, BlockRemoved) for e in batches[1].events)
    assert batches[2].events == [AllBlocksCleared()]


def test_wire_layout_is_vllms() -> None:
    """Batch = 3-element array; events = maps tagged by class name; defaults omitted."""
    event = BlockRemoved(block_hashes=[5], medium="GPU", group_idx=2)
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=0.5, events=[event],
                                                           data_parallel_rank=0)))
    assert raw == [0.5, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU",
                          "group_idx": 2}], 0]


def test_round_trip_and_unknown_fields_ignored() -> None:
    stored = BlockStored(block_hashes=[1, 2], parent_block_hash=9, token_ids=[1] * 8,
                         block_size=4, lora_id=None, medium="GPU", lora_name=None,
                         group_idx=1, landing_hashes=[2])
    batch = KVEventBatch(ts=3.25, events=[stored, AllBlocksCleared()], data_parallel_rank=1)
    assert decode_batch(encode_batch(batch)) == batch
    raw = msgspec.msgpack.decode(encode_batch(batch))
    raw[1][0]["future_field"] = 1  # a newer producer: unknown keys are skipped
    raw.append("trailing")  # and trailing array elements
    assert decode_batch(msgspec.msgpack.encode(raw)).events[0] == stored
    raw[1][0]["type"] = "NotAnEvent"
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode(raw))


def test_external_hash_is_vllms_int_form() -> None:
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest[-8:], "big")


def test_events_off_records_nothing() -> None:
    manager = _manager(FullAttentionSpec(4, 1), events=False)
    _admit(manager, "a", list(range(13)))
    assert manager.pool.event_records is None and manager.take_events() == []


def test_stored_runs_parents_and_decode_growth() -> None:
    manager = _manager(FullAttentionSpec(4, 1))
    _admit(manager, "a", list(range(10)))
    (first,) = manager.take_events()
    assert isinstance(first, BlockStored) and len(first.block_hashes) == 2
    for token in (10, 11):
        manager.append_token_ids("a", [token])
        assert manager.allocate_slots("a", 1) is not None
    (grown,) = manager.take_events()
    assert isinstance(grown, BlockStored)
    assert grown.parent_block_hash == first.block_hashes[-1]
    assert grown.token_ids == [8, 9, 10, 11]


def test_duplicates_are_stored_and_removed_per_copy() -> None:
    manager = _manager(FullAttentionSpec(4, 1), num_blocks=8)
    _admit(manager, "a", list(range(9)))
    manager.add_request("b", list(range(9)))  # admitted before a's blocks are looked up
    assert manager.allocate_slots("b", 9) is not None  # computes the same blocks: copies
    replica = ResidentReplica()
    replica.apply_all(manager.take_events())
    assert sorted(replica.resident[0].values()) == [2, 2]
    manager.remove_request("a")
    manager.remove_request("b")
    _admit(manager, "c", list(range(50, 78)))  # 7 blocks: every cached copy is evicted
    events = manager.take_events()
    assert sum(isinstance(e, BlockRemoved) for e in events) == 4
    replica.apply_all(events)
    assert set(replica.resident[0].values()) == {1}


def test_replica_catches_a_gap() -> None:
    replica = ResidentReplica()
    with pytest.raises(InvariantViolation, match="never stored"):
        replica.apply(BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0))


def test_window_landings_follow_the_tail() -> None:
    """bs 4, window 8 (2 tail blocks): the window's events announce the capped rule instead
    of listing landings, and a replica derives them: blocks 0-2 land 4, 8, 12; losing
    blocks 0 and 1 loses all three (12 needs block 1)."""
    manager = _manager(FullAttentionSpec(4, 1), SlidingWindowSpec(4, 1, 8), num_blocks=9)
    _admit(manager, "a", list(range(13)))
    chain = [external_hash(h) for h in manager.hasher.hash_blocks(list(range(13)))]
    events = manager.take_events()
    window = next(e for e in events if isinstance(e, BlockStored) and e.group_idx == 1)
    assert (window.landing_tail_blocks, window.landing_alignment_tokens,
            window.first_block_index, window.landing_hashes) == (2, 4, 0, None)
    replica = ResidentReplica()
    replica.apply_all(events)
    assert replica.landable[1] == set(chain[:3])
    manager.remove_request("a")
    manager.evict_prefix(list(range(8)))  # drops blocks 0 and 1 of both groups
    removed = manager.take_events()
    assert all(isinstance(e, BlockRemoved) and e.landing_hashes is None for e in removed)
    replica.apply_all(removed)
    assert replica.landable[1] == set() and set(replica.resident[1]) == {chain[2]}


def test_recurrent_landing_is_its_checkpoint() -> None:
    manager = _manager(FullAttentionSpec(4, 1), RecurrentStateSpec(4, 8), num_blocks=12)
    manager.add_request("a", list(range(13)))
    chunk = manager.align_prefill_chunk("a", 13, manager.find_longest_hit("a"))
    assert chunk == 12  # a prefill chunk ends on the last block boundary before the end
    assert manager.allocate_slots("a", chunk, manager.find_longest_hit("a")) is not None
    events = manager.take_events()
    recurrent = [e for e in events if isinstance(e, BlockStored) and e.group_idx == 1]
    assert recurrent and recurrent[0].kv_cache_spec_kind == "mamba"
    replica = ResidentReplica()
    replica.apply_all(events)
    for event in recurrent:
        assert event.landing_tail_blocks == 1  # one checkpoint = one landing
        assert set(event.block_hashes) <= replica.landable[1]


def test_reset_is_one_all_blocks_cleared() -> None:
    manager = _manager(FullAttentionSpec(4, 1))
    _admit(manager, "a", list(range(9)))
    manager.remove_request("a")
    manager.take_events()
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]


if __name__ == "__main__":  # regenerate the golden sample after a deliberate change
    GOLDEN.write_text(_golden_stream().hex() + "\n")
