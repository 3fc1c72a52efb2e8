"""Group managers: per-type longest-hit searches on hand-made cache patterns (§3.2, §2.5,
§6.2), window release (§2.4), allocation predictions (§2.2) and admission caps (§1.6)."""

from __future__ import annotations

import random

import pytest

from hybridkv import (
    CacheConfig,
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
)
from hybridkv.block import Block
from hybridkv.ids import BlockHash, GroupId
from hybridkv.managers import (
    MANAGER_FOR_SPEC,
    ChunkedLocalManager,
    FullAttentionManager,
    SlidingWindowManager,
    coarse_hashes,
)
from hybridkv.pool import BlockPool

G0 = GroupId(0)


def cached_pattern(pattern: str | list[bool], num_groups: int = 1,
                   ) -> tuple[BlockPool, list[BlockHash], dict[int, Block]]:
    """A pool where hash ``i`` is cached (in every group) iff ``pattern[i]`` is true.

    Returns the pool, one fake hash per pattern entry and, for group 0, the block that caches
    each position. Blocks stay held (ref 1) like the blocks of a running request.
    """
    flags = [c == "T" for c in pattern] if isinstance(pattern, str) else list(pattern)
    pool = BlockPool(2 + len(flags) * num_groups, num_groups)
    hashes = [BlockHash(f"h{i}".encode()) for i in range(len(flags))]
    by_position: dict[int, Block] = {}
    for i, flag in enumerate(flags):
        if not flag:
            continue
        for group in range(num_groups):
            (block,) = pool.allocate(1)
            pool.cache_block(block, hashes[i], GroupId(group))
            if group == 0:
                by_position[i] = block
    return pool, hashes, by_position


def swa_hit(pattern: str, *, bs: int, window: int, align: int, max_tokens: int | None = None,
            eagle: bool = False) -> tuple[list[Block], int, dict[int, Block]]:
    pool, hashes, by_position = cached_pattern(pattern)
    spec = SlidingWindowSpec(bs, 1, window)
    tables, num_tokens = SlidingWindowManager.find_longest_hit(
        pool, [G0], spec, hashes, len(pattern) * bs if max_tokens is None else max_tokens,
        drop_eagle_block=eagle, alignment_tokens=align)
    assert len(tables[0]) * bs == num_tokens
    return tables[0], num_tokens, by_position


# ------------------------------------------------------------ sliding window
@pytest.mark.parametrize(("pattern", "num_blocks"), [
    ("F" * 10, 0), ("T", 1), ("TF", 1), ("TT", 2), ("TTF", 2), ("TTT", 3), ("TTTF", 3),
    ("TTFTFFTTFTTT", 12), ("TTFTFFTTFFF", 8), ("TTFTFFTTFFFT", 8),
])
def test_sliding_window_possible_cached_prefix(pattern: str, num_blocks: int) -> None:
    """§6.2 item 4 (bs 2, w 4 → need 2, A 2): the rightmost 2-block run; a run touching
    block 0 counts even when shorter (the prefix is shorter than the window)."""
    table, num_tokens, by_position = swa_hit(pattern, bs=2, window=4, align=2)
    assert num_tokens == 2 * num_blocks
    if num_blocks >= 2:
        assert all(b.is_null for b in table[:-2])
        assert table[-2:] == [by_position[num_blocks - 2], by_position[num_blocks - 1]]
    else:
        assert table == [by_position[i] for i in range(num_blocks)]


def test_sliding_window_runs_must_end_on_the_alignment() -> None:
    """§3.2: bs 8, w 8 (need 1), A 32, cached {3, 7}: max 64 → 64 ([null×7, b7]);
    max 63 → block 6 is missing, block 3 ends on 32 → 32. Block 5 alone (ends on 48) never
    counts."""
    pattern = "FFFTFFFT"
    table, num_tokens, by_position = swa_hit(pattern, bs=8, window=8, align=32)
    assert num_tokens == 64
    assert all(b.is_null for b in table[:7]) and table[7] is by_position[7]
    table, num_tokens, by_position = swa_hit(pattern, bs=8, window=8, align=32, max_tokens=63)
    assert num_tokens == 32 and table[3] is by_position[3]
    _, num_tokens, _ = swa_hit("FFFFFTFF", bs=8, window=8, align=32)
    assert num_tokens == 0


def test_sliding_window_eagle_drop_needs_the_peek_block() -> None:
    """§3.2 EAGLE (need 1 + 1, drop), cached {3, 4, 7, 8}: max 72 → run 7, 8 accepted
    because the post-pop end (64) is aligned → 64; max 64 (no margin) → only 3, 4 → 32."""
    pattern = "FFFTTFFTT"
    table, num_tokens, by_position = swa_hit(pattern, bs=8, window=8, align=32, eagle=True)
    assert num_tokens == 64 and table[7] is by_position[7]
    table, num_tokens, by_position = swa_hit(pattern, bs=8, window=8, align=32, eagle=True,
                                             max_tokens=64)
    assert num_tokens == 32 and table[3] is by_position[3]


def test_sliding_window_leading_run_fallback_is_aligned() -> None:
    """§3.2: bs 4, w 13 (need 3), cached TTFF: no 3-run; the leading run of 2 → 8 tokens,
    also with A = 8. With A = 16 the 8-token leading run is trimmed to 0."""
    assert swa_hit("TTFF", bs=4, window=13, align=4)[1] == 8
    assert swa_hit("TTFF", bs=4, window=13, align=8)[1] == 8
    assert swa_hit("TTFF", bs=4, window=13, align=16)[1] == 0


def test_sliding_window_spec_group_needs_every_member() -> None:
    """Two groups sharing a spec: a position hits only if both groups cached it."""
    pool, hashes, _ = cached_pattern("TTTT", num_groups=2)
    second = pool.get_cached_block(hashes[3], GroupId(1))
    assert second is not None
    pool._evict(second)  # group 1 lost block 3; lookups then see a miss at position 3
    spec = SlidingWindowSpec(2, 1, 4)
    tables, num_tokens = SlidingWindowManager.find_longest_hit(
        pool, [G0, GroupId(1)], spec, hashes, 8, drop_eagle_block=False, alignment_tokens=2)
    assert num_tokens == 6
    assert [b.is_null for b in tables[1]] == [True, False, False]
    assert tables[0][1].hash_group_id == 0 and tables[1][1].hash_group_id == 1


# ------------------------------------------------------------- full attention
def test_full_attention_prefix_scan_and_eagle_drop() -> None:
    """bs 16, 3 cached blocks, max 55 → 48; with the EAGLE drop → 32; a miss in the middle
    stops the scan (chained hashes)."""
    pool, hashes, by_position = cached_pattern("TTTF")
    spec = FullAttentionSpec(16, 1)
    tables, num_tokens = FullAttentionManager.find_longest_hit(
        pool, [G0], spec, hashes, 55, drop_eagle_block=False, alignment_tokens=16)
    assert num_tokens == 48 and tables[0] == [by_position[i] for i in range(3)]
    tables, num_tokens = FullAttentionManager.find_longest_hit(
        pool, [G0], spec, hashes, 55, drop_eagle_block=True, alignment_tokens=16)
    assert num_tokens == 32 and len(tables[0]) == 2
    pool, hashes, _ = cached_pattern("TFTT")
    assert FullAttentionManager.find_longest_hit(
        pool, [G0], spec, hashes, 64, drop_eagle_block=False, alignment_tokens=16)[1] == 16


def test_full_attention_hit_is_aligned_down() -> None:
    """bs 16 with A 32 (a bs-32 sibling group): 3 blocks → 32; EAGLE drops min(A, bs) = 16
    then aligns: 48 - 16 = 32."""
    pool, hashes, _ = cached_pattern("TTT")
    spec = FullAttentionSpec(16, 1)
    hit = FullAttentionManager.find_longest_hit
    assert hit(pool, [G0], spec, hashes, 64, drop_eagle_block=False, alignment_tokens=32)[1] == 32
    assert hit(pool, [G0], spec, hashes, 64, drop_eagle_block=True, alignment_tokens=32)[1] == 32
    tables, num_tokens = hit(pool, [G0], spec, hashes[:2], 64, drop_eagle_block=True,
                             alignment_tokens=32)
    assert num_tokens == 0 and tables == [[]]


# ------------------------------------------------------------- chunked local
@pytest.mark.parametrize("tail_token", [0, 1])
@pytest.mark.parametrize(("pattern", "num_blocks"), [
    ([True], 1), ([True, False], 2), ([True, True], 2), ([True, True, False], 2),
    ([True, True, True], 3), ([True, True, True, False], 4),
    (["R"] * 8 + [True], 9), (["R"] * 8 + [False], 8),
    (["R"] * 8 + [True, True], 10), (["R"] * 8 + [True, False], 10),
    (["R"] * 8 + [False, True], 10), (["R"] * 8 + [False, False], 10),
])
def test_chunked_local_attention_possible_cached_prefix(pattern: list[object], num_blocks: int,
                                                        tail_token: int) -> None:
    """§6.2 item 3 (bs 2, chunk 4): only the current chunk's blocks matter; earlier entries
    are null placeholders ("R" = random, irrelevant because it is in a completed chunk)."""
    rng = random.Random(len(pattern) * 2 + tail_token)
    flags = [rng.random() < 0.5 if p == "R" else bool(p) for p in pattern]
    pool, hashes, by_position = cached_pattern(flags)
    spec = ChunkedLocalSpec(2, 1, 4)
    max_tokens = len(flags) * 2 + tail_token
    tables, num_tokens = ChunkedLocalManager.find_longest_hit(
        pool, [G0], spec, hashes, max_tokens, drop_eagle_block=False, alignment_tokens=2)
    assert num_tokens == 2 * num_blocks
    first = (max_tokens // 4) * 4 // 2
    assert all(b.is_null for b in tables[0][:first])
    assert tables[0][first:] == [by_position[i] for i in range(first, num_blocks)]


def test_chunked_local_examples_from_section_2_5() -> None:
    """chunk 8, bs 4: max 15 → [null, null] + block 2 if cached (12, else 8); max 16 → four
    nulls, 16 (everything is out of the window)."""
    spec = ChunkedLocalSpec(4, 1, 8)
    find = ChunkedLocalManager.find_longest_hit
    pool, hashes, by_position = cached_pattern("FFTF")
    tables, num_tokens = find(pool, [G0], spec, hashes, 15, drop_eagle_block=False,
                              alignment_tokens=4)
    assert num_tokens == 12 and tables[0][2] is by_position[2]
    pool, hashes, _ = cached_pattern("TTFF")
    assert find(pool, [G0], spec, hashes, 15, drop_eagle_block=False, alignment_tokens=4)[1] == 8
    tables, num_tokens = find(pool, [G0], spec, hashes, 16, drop_eagle_block=False,
                              alignment_tokens=4)
    assert num_tokens == 16 and all(b.is_null for b in tables[0])


# --------------------------------------------------------- window release (§2.4)
def make_manager(spec: object, num_blocks: int, policy: str = "prepend", **options: object,
                 ) -> KVCacheManager:
    config = CacheConfig.from_layers([spec], num_blocks, **options)  # type: ignore[list-item]
    return KVCacheManager(config, policy)


@pytest.mark.parametrize(("spec", "steps"), [
    # SWA w4 bs2: n → nulled table positions (n=4 skips 1 token, 5 → 2, 7 → 4, 11 → 8)
    (SlidingWindowSpec(2, 1, 4), [(4, 0), (5, 1), (6, 1), (7, 2), (11, 4)]),
    # chunked chunk 4 bs2: n=0 none; 4 → 2; 6 → still 2; 12 → 6
    (ChunkedLocalSpec(2, 1, 4), [(0, 0), (4, 2), (6, 2), (12, 6)]),
])
def test_remove_skipped_blocks(spec: object, steps: list[tuple[int, int]]) -> None:
    """§6.2 items 5–6 on a table of 11 blocks (ids 1..11 here, 1000..1010 upstream). Blocks
    are released newest-first within one call; with caching off nothing is hashed, so they
    go to the queue head in that order (1003 then 1002 upstream ⇒ ids 4, 3 here)."""
    manager = make_manager(spec, 20, enable_caching=False)
    manager.add_request("r", list(range(22)))
    manager.allocate_slots("r", 22)
    group = manager.coordinator.managers[0]
    previous = 0
    for computed, num_null in steps:
        group.remove_skipped_blocks("r", computed)
        table = manager.get_block_ids("r")[0]
        assert table == (0,) * num_null + tuple(range(num_null + 1, 12))
        released = list(range(num_null, previous, -1))  # newest first
        assert list(manager.pool.free_block_ids()[: len(released)]) == released
        assert manager.num_free_blocks == 8 + num_null
        previous = num_null
        manager.check_invariants()


def test_window_release_through_allocate_slots() -> None:
    """The same schedule through the API: each ``allocate_slots`` first releases what the
    already computed tokens no longer need (SWA w4, bs2 → table nulls = skipped(n) // 2)."""
    manager = make_manager(SlidingWindowSpec(2, 1, 4), 20)
    manager.add_request("r", list(range(16)))
    manager.allocate_slots("r", 4, manager.find_longest_hit("r"))
    for computed in range(4, 15):
        manager.allocate_slots("r", 1)
        skipped = max(0, computed - 4 + 1)
        table = manager.get_block_ids("r")[0]
        assert table[: skipped // 2] == (0,) * (skipped // 2)
        assert 0 not in table[skipped // 2 :]
        assert len(table) == -(-(computed + 1) // 2)
        manager.check_invariants()


# ------------------------------------------------- allocation prediction (§2.2)
def hit_blocks(num_null: int, num_evictable: int) -> list[Block]:
    null = Block(0, is_null=True)
    return [null] * num_null + [Block(i + 1) for i in range(num_evictable)]


@pytest.mark.parametrize(("window", "num_null", "num_evictable", "computed", "expected"), [
    (64, 0, 10, 20, 20),  # 10 new + 10 evictable hit blocks (§6.2 item 8)
    (64, 5, 5, 20, 15),  # nulls cost nothing
    (4, 0, 10, 20, 12),  # w4: 8 blocks are behind the window, only hit blocks 8, 9 are used
])
def test_num_blocks_to_allocate_counts_evictable_hits(window: int, num_null: int,
                                                      num_evictable: int, computed: int,
                                                      expected: int) -> None:
    manager = make_manager(SlidingWindowSpec(2, 1, window), 40)
    group = manager.coordinator.managers[0]
    assert group.num_blocks_to_allocate(
        "new", 40, hit_blocks(num_null, num_evictable), computed, None) == expected


def test_evictable_hit_block_is_predicted_but_not_double_allocated() -> None:
    """§6.2 item 9: one evictable hit block + 4 tokens → predicted 2 (1 new + 1 evictable),
    only 1 block allocated, table length 2, and both leave the free count."""
    manager = make_manager(FullAttentionSpec(2, 1), 6)
    manager.add_request("a", [1, 2, 9])
    manager.allocate_slots("a", 3, manager.find_longest_hit("a"))
    manager.free("a")
    manager.add_request("b", [1, 2, 5, 6])
    hit = manager.find_longest_hit("b")
    assert hit.num_tokens == 2 and hit.block_ids == ((1,),)
    group = manager.coordinator.managers[0]
    hit_blocks = [manager.pool.blocks[i] for i in hit.block_ids[0]]
    assert group.num_blocks_to_allocate("b", 4, hit_blocks, 2, None) == 2
    free_before = manager.num_free_blocks
    allocation = manager.allocate_slots("b", 2, hit)
    # a's unhashed partial block 2 went to the queue head, so it is the one reused
    assert allocation is not None and allocation.new_block_ids == ((2,),)
    assert manager.get_block_ids("b") == ((1, 2),)
    assert manager.num_free_blocks == free_before - 2
    manager.check_invariants()


# --------------------------------------------------------- admission caps (§1.6)
def test_admission_caps() -> None:
    full = FullAttentionSpec(16, 1)
    swa = SlidingWindowSpec(16, 1, 64)
    chunked = ChunkedLocalSpec(16, 1, 64)
    config = CacheConfig.from_layers([full, swa, chunked], 10, max_num_batched_tokens=128,
                                     max_model_len=1024)
    caps = [m.admission_cap_blocks(config.max_num_batched_tokens, config.max_model_len)
            for m in KVCacheManager(config).coordinator.managers]
    # full: unbounded; SWA: cdiv(63 + 128, 16) + 1 = 13; chunked: cdiv(64 + 128, 16) = 12
    assert caps == [None, 13, 12]
    short = CacheConfig.from_layers([full, swa, chunked], 10, max_num_batched_tokens=128,
                                    max_model_len=100)
    caps = [m.admission_cap_blocks(short.max_num_batched_tokens, short.max_model_len)
            for m in KVCacheManager(short).coordinator.managers]
    assert caps == [None, 7 + 1, 7]  # min(…, 100) tokens → cdiv(100, 16) = 7


def test_manager_map_and_coarse_hashes() -> None:
    assert MANAGER_FOR_SPEC[FullAttentionSpec] is FullAttentionManager
    assert MANAGER_FOR_SPEC[SlidingWindowSpec] is SlidingWindowManager
    assert MANAGER_FOR_SPEC[ChunkedLocalSpec] is ChunkedLocalManager
    fine = [BlockHash(bytes([i])) for i in range(7)]
    assert coarse_hashes(fine, 1) is fine
    assert coarse_hashes(fine, 2) == [fine[1], fine[3], fine[5]]
    assert coarse_hashes(fine, 4) == [fine[3]]
    assert coarse_hashes(fine, 8) == []
