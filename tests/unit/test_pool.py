"""BlockPool: allocation order, free tiers, hash index with duplicates, eviction, invariants."""

from __future__ import annotations

import pytest

from hybridkv.errors import CapacityError, InvariantViolation
from hybridkv.ids import BlockHash, GroupId
from hybridkv.pool import BlockPool, FreeTier

G0, G1 = GroupId(0), GroupId(1)


def h(name: str) -> BlockHash:
    return BlockHash(name.encode())


def holders_of(*tables: list[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for table in tables:
        for block_id in table:
            counts[block_id] = counts.get(block_id, 0) + 1
    return counts


def test_null_block_is_reserved_and_allocation_starts_at_1() -> None:
    pool = BlockPool(5, 1)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    taken = pool.allocate(3)
    assert [b.block_id for b in taken] == [1, 2, 3]
    assert all(b.ref_count == 1 for b in taken)
    assert pool.usage == pytest.approx(3 / 4)
    pool.check_invariants(holders_of([1, 2, 3]))


def test_allocate_beyond_free_raises_capacity_error_naming_counts() -> None:
    pool = BlockPool(3, 1)
    with pytest.raises(CapacityError, match=r"allocate\(3\) with 2 free blocks"):
        pool.allocate(3)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_free_tiers_head_tail_and_order() -> None:
    """Unhashed blocks freed to HEAD are reused first (newest first in the given order);
    TAIL blocks are appended after the untouched ones."""
    pool = BlockPool(8, 1)
    b1, b2, b3, b4 = pool.allocate(4)
    pool.cache_block(b1, h("a"), G0)
    pool.cache_block(b2, h("b"), G0)
    # free tail-first, as managers do: [b4, b3, b2, b1]
    pool.free_blocks([b4, b3, b2, b1], FreeTier.HEAD, FreeTier.TAIL)
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 2, 1]
    pool.check_invariants({})
    # the head is reused first; reusing a hashed block evicts its hash
    again = pool.allocate(6)
    assert [b.block_id for b in again] == [4, 3, 5, 6, 7, 2]
    assert b2.block_hash is None and pool.get_cached_block(h("b"), G0) is None
    assert pool.get_cached_block(h("a"), G0) is b1
    assert pool.num_evicted_blocks == [1]
    pool.check_invariants(holders_of([4, 3, 5, 6, 7, 2]))


def test_touch_unlinks_free_cached_block_and_counts_references() -> None:
    pool = BlockPool(4, 1)
    b1, b2 = pool.allocate(2)
    pool.cache_block(b1, h("a"), G0)
    pool.free_blocks([b1], FreeTier.TAIL, FreeTier.TAIL)
    assert pool.num_free_blocks == 2
    pool.touch([b1, pool.null_block])
    pool.touch([b1])
    assert b1.ref_count == 2 and pool.num_free_blocks == 1
    assert pool.null_block.ref_count == 0  # the null block is never counted
    pool.check_invariants(holders_of([1, 2], [1]))
    pool.free_blocks([b1, b2], FreeTier.TAIL, FreeTier.TAIL)
    assert b1.ref_count == 1 and b2.ref_count == 0
    pool.check_invariants(holders_of([1]))


def test_double_free_of_a_block_is_an_invariant_violation() -> None:
    pool = BlockPool(3, 1)
    (b1,) = pool.allocate(1)
    pool.free_blocks([b1], FreeTier.TAIL, FreeTier.TAIL)
    with pytest.raises(InvariantViolation, match="already 0"):
        pool.free_blocks([b1], FreeTier.TAIL, FreeTier.TAIL)


def test_cache_block_rejects_hashed_or_null_blocks() -> None:
    pool = BlockPool(3, 1)
    (b1,) = pool.allocate(1)
    pool.cache_block(b1, h("a"), G0)
    with pytest.raises(InvariantViolation, match="already hashed or null"):
        pool.cache_block(b1, h("b"), G0)
    with pytest.raises(InvariantViolation, match="already hashed or null"):
        pool.cache_block(pool.null_block, h("c"), G0)


def test_same_hash_in_two_groups_is_two_entries() -> None:
    pool = BlockPool(4, 2)
    b1, b2 = pool.allocate(2)
    pool.cache_block(b1, h("x"), G0)
    pool.cache_block(b2, h("x"), G1)
    assert pool.get_cached_block(h("x"), G0) is b1
    assert pool.get_cached_block(h("x"), G1) is b2
    assert pool.num_cached_blocks(G0) == pool.num_cached_blocks(G1) == 1


def test_duplicates_keep_tables_append_only_and_promote_on_eviction() -> None:
    """§1.5: no de-duplication. Two physical copies of one key: lookups return the first;
    evicting it promotes the copy; evicting the copy first leaves the primary."""
    pool = BlockPool(6, 1)
    b1, b2, b3 = pool.allocate(3)
    pool.cache_block(b1, h("k"), G0)
    pool.cache_block(b2, h("k"), G0)
    pool.cache_block(b3, h("k"), G0)
    assert pool.num_cached_blocks(G0) == 3
    assert pool.get_cached_block(h("k"), G0) is b1
    pool.check_invariants(holders_of([1, 2, 3]))
    pool._evict(b1)  # drop the primary: the oldest copy takes its place
    assert pool.get_cached_block(h("k"), G0) is b2
    pool._evict(b3)  # drop a non-primary copy
    assert pool.get_cached_block(h("k"), G0) is b2
    assert pool.num_cached_blocks(G0) == 1
    pool.check_invariants(holders_of([1, 2, 3]))
    pool._evict(b2)
    assert pool.get_cached_block(h("k"), G0) is None
    assert pool.num_evicted_blocks == [3]
    pool.check_invariants(holders_of([1, 2, 3]))


def test_pinned_tier_is_used_only_after_the_free_queue_is_empty() -> None:
    pool = BlockPool(6, 1)
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks[:2]):
        pool.cache_block(block, h(f"p{i}"), G0)
    pool.free_blocks(blocks[:2], FreeTier.PINNED, FreeTier.PINNED)
    pool.free_blocks(blocks[2:], FreeTier.TAIL, FreeTier.TAIL)
    assert pool.num_free_blocks == 5  # pinned blocks count as free: admission never stalls
    assert [b.block_id for b in pool.pinned_queue] == [1, 2]
    assert all(b.is_pinned for b in blocks[:2])
    pool.check_invariants({})
    first = pool.allocate(3)
    assert [b.block_id for b in first] == [3, 4, 5]  # normal queue first
    assert pool.get_cached_block(h("p0"), G0) is blocks[0]  # pinned hashes survive
    second = pool.allocate(1)
    assert [b.block_id for b in second] == [1]  # then the oldest pinned block
    assert not blocks[0].is_pinned and blocks[0].block_hash is None
    assert pool.get_cached_block(h("p1"), G0) is blocks[1]
    pool.check_invariants(holders_of([3, 4, 5, 1]))


def test_touch_of_a_pinned_block_unpins_it() -> None:
    pool = BlockPool(3, 1)
    (b1,) = pool.allocate(1)
    pool.cache_block(b1, h("a"), G0)
    pool.free_blocks([b1], FreeTier.PINNED, FreeTier.PINNED)
    pool.touch([b1])
    assert not b1.is_pinned and len(pool.pinned_queue) == 0 and b1.ref_count == 1
    pool.check_invariants(holders_of([1]))


def test_epoch_changes_on_every_mutation() -> None:
    pool = BlockPool(4, 1)
    start = pool.epoch
    (b1,) = pool.allocate(1)
    after_allocate = pool.epoch
    pool.touch([b1])
    after_touch = pool.epoch
    pool.free_blocks([b1, b1], FreeTier.TAIL, FreeTier.TAIL)
    assert start < after_allocate < after_touch < pool.epoch


@pytest.mark.parametrize(("corruption", "message"), [
    ("ref_count", "ref_count 2 but 1 holders"),
    ("free_membership", "free-queue membership 1"),
    ("pinned_flag", "queue_id 4 but linked in 1"),
    ("hash_group", "hash without group or group without hash"),
    ("unindexed_hash", r"hashed but not indexed: \[2\]"),
    ("null_hashed", "the null block was hashed"),
    ("stale_index", r"index entry points to Block\(2,"),
])
def test_check_invariants_detects_each_corruption(corruption: str, message: str) -> None:
    """Each planted corruption is caught by its own check (``message``)."""
    pool = BlockPool(5, 1)
    b1, b2 = pool.allocate(2)
    pool.cache_block(b1, h("a"), G0)
    holders = holders_of([1, 2])
    pool.check_invariants(holders)
    free_block = pool.blocks[3]
    if corruption == "ref_count":
        b1.ref_count = 2
    elif corruption == "free_membership":
        free_block.ref_count = 1
        holders[3] = 1
    elif corruption == "pinned_flag":
        free_block.is_pinned = True
    elif corruption == "hash_group":
        b1.hash_group_id = None
    elif corruption == "unindexed_hash":
        b2.block_hash = h("b")
        b2.hash_group_id = G0
    elif corruption == "null_hashed":
        pool.null_block.block_hash = h("n")
    elif corruption == "stale_index":
        pool._index[0][h("zzz")] = b2
    with pytest.raises(InvariantViolation, match=message):
        pool.check_invariants(holders)


def test_cache_blocks_run_with_a_recomputed_prefix() -> None:
    """A run whose first hashes are already cached (a recomputed prefix) and whose rest are
    new: the cached ones become duplicates, the new ones primaries, nothing is lost."""
    pool = BlockPool(10, 1)
    old = pool.allocate(2)
    pool.cache_blocks(old, [h("a"), h("b")], G0)
    run = pool.allocate(4)
    pool.cache_blocks(run, [h("a"), h("b"), h("c"), h("d")], G0)
    assert [pool.get_cached_block(h(x), G0) for x in "abcd"] == [*old, *run[2:]]
    assert pool.num_cached_blocks(G0) == 6
    pool.check_invariants(holders_of([b.block_id for b in old + run]))
    pool._evict(old[0])  # the recomputed copy takes over
    assert pool.get_cached_block(h("a"), G0) is run[0]
    pool.check_invariants(holders_of([b.block_id for b in old + run]))
