"""Hybrid coordinator: fixed-point longest hit (§4.2/§4.3), partial-eviction matrices
(§6.1 items 2–5, 39), replay boundaries (§3.5.3), spec groups and EAGLE flags.

Partial evictions: upstream tests pop keys from the hash map directly. We call the pool's
private ``_evict(block)`` on the chosen block — exactly what ``BlockPool.allocate`` does to a
reused hashed block — because forcing the allocator to evict one specific block of one group
would need a contrived free-queue order that obscures what is being tested.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hybridkv import (
    CacheConfig,
    ChunkedLocalSpec,
    ConfigError,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
)
from hybridkv.coordinator import replay_boundaries
from hybridkv.managers import FullAttentionManager, SlidingWindowManager

BS = 16


def build(layers: Sequence[object], num_blocks: int, policy: str = "prepend",
          **options: object) -> KVCacheManager:
    config = CacheConfig.from_layers(layers, num_blocks, **options)  # type: ignore[arg-type]
    return KVCacheManager(config, policy)


def fill(manager: KVCacheManager, req_id: str, tokens: list[int]) -> tuple[tuple[int, ...], ...]:
    """Admit ``req_id`` and compute its whole prompt in one step; returns its block tables."""
    manager.add_request(req_id, tokens)
    hit = manager.find_longest_hit(req_id)
    assert manager.allocate_slots(req_id, len(tokens) - hit.num_tokens, hit) is not None
    return manager.get_block_ids(req_id)


def evict(manager: KVCacheManager, req_id: str, evictions: Sequence[tuple[int, int]]) -> None:
    """Drop the hash of block ``idx`` of group ``g`` of ``req_id`` (see module docstring)."""
    for group_id, idx in evictions:
        block = manager.coordinator.managers[group_id].tables[req_id][idx]
        assert block.block_hash is not None, (group_id, idx)
        manager.pool._evict(block)


def hit_lengths(hit_blocks: Sequence[Sequence[object]]) -> list[int]:
    return [len(t) for t in hit_blocks]


def hashed_indices(manager: KVCacheManager, group_id: int, req_id: str) -> set[int]:
    table = manager.coordinator.managers[group_id].tables[req_id]
    return {i for i, b in enumerate(table) if b.block_hash is not None}


# ------------------------------------------------------ test_prefill_hybrid_model
FULL = FullAttentionSpec(BS, 1)
SW = SlidingWindowSpec(BS, 1, 2 * BS)
SW_LARGE = SlidingWindowSpec(BS, 1, 4 * BS)
COMMON = [i // BS for i in range(3 * BS)]  # 3 distinct full blocks


@pytest.mark.parametrize("policy", ["dense", "reachable", "prepend", "pin:64"])
def test_prefill_hybrid_model_tables(policy: str) -> None:
    """§6.1 item 2: full + 2×SWA (w32, one spec group): req0 (48 + 7 tokens) gets 4 blocks per
    group, its 3 full blocks are hashed with their group id; req1 (48 + 5) hits
    ([1,2,3],[0,6,7],[0,10,11]) = 48 tokens and gets one new block per group."""
    manager = build([FULL, SW, SW], 40, policy)
    assert fill(manager, "0", [*COMMON, *range(100, 107)]) == (
        (1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12))
    for group_id in range(3):
        table = manager.coordinator.managers[group_id].tables["0"]
        assert [b.hash_group_id for b in table] == [group_id] * 3 + [None]
    # the hash of block i is the same prefix hash in every group (group id kept apart)
    hashes = {manager.coordinator.managers[g].tables["0"][1].block_hash for g in range(3)}
    assert len(hashes) == 1
    manager.add_request("1", [*COMMON, *range(200, 205)])
    hit = manager.find_longest_hit("1")
    assert hit.num_tokens == 48
    assert hit.block_ids == ((1, 2, 3), (0, 6, 7), (0, 10, 11))
    allocation = manager.allocate_slots("1", 5, hit)
    assert allocation is not None
    assert allocation.new_block_ids == ((13,), (14,), (15,))
    assert [manager.pool.blocks[i].ref_count for i in (1, 2, 3, 5, 6, 7)] == [2, 2, 2, 1, 2, 2]
    manager.check_invariants()


@pytest.mark.parametrize("policy", ["dense", "reachable", "prepend", "pin:64"])
@pytest.mark.parametrize(("evictions", "num_hit_blocks"), [
    ([(1, 0)], 3),  # SWA block 0 is outside the 2-block tail at 48
    ([(1, 0), (2, 0)], 3),
    ([(0, 0)], 0),  # full attention needs the whole prefix
    ([(0, 2), (1, 2), (2, 2)], 2),  # last block everywhere
    ([(0, 2)], 2),  # last FA block
    ([(1, 2)], 2),  # last block of either SWA group (the spec group needs both)
    ([(2, 2)], 2),
    ([(0, 2), (1, 0)], 0),  # FA says 32; SWA at 32 needs blocks 0–1, block 0 is gone
])
def test_prefill_hybrid_model_partial_eviction(policy: str, evictions: list[tuple[int, int]],
                                               num_hit_blocks: int) -> None:
    manager = build([FULL, SW, SW], 40, policy)
    fill(manager, "0", [*COMMON, *range(100, 107)])
    manager.free("0")
    for group_id, idx in evictions:  # the request is freed: evict from the freed blocks
        block_id = (1, 5, 9)[group_id] + idx
        manager.pool._evict(manager.pool.blocks[block_id])
    manager.add_request("1", [*COMMON, *range(200, 205)])
    hit = manager.find_longest_hit("1")
    assert hit.num_tokens == num_hit_blocks * BS
    assert hit_lengths(hit.blocks) == [num_hit_blocks] * 3  # every table = hit / bs
    manager.check_invariants()


EAGLE_SW = SlidingWindowSpec(BS, 1, 48)  # need 3 (+1 for the EAGLE drop)
EAGLE_COMMON = [i // BS for i in range(6 * BS)]


def eagle_manager() -> KVCacheManager:
    manager = build([FULL, EAGLE_SW, EAGLE_SW], 60, use_eagle=True, eagle_block_drop=True)
    assert fill(manager, "0", [*EAGLE_COMMON, *range(100, 107)]) == (
        tuple(range(1, 8)), tuple(range(8, 15)), tuple(range(15, 22)))
    manager.add_request("1", [*EAGLE_COMMON, *range(200, 207)])
    return manager


def test_prefill_hybrid_model_eagle_tables() -> None:
    """§6.1 item 3: 6 full blocks + 7; the drop makes req1 hit 5 blocks, SWA tables
    [null, null, b, b, b] (need 3), and req1 gets 2 new blocks per group."""
    manager = eagle_manager()
    hit = manager.find_longest_hit("1")
    assert hit.num_tokens == 80
    assert hit.block_ids == ((1, 2, 3, 4, 5), (0, 0, 10, 11, 12), (0, 0, 17, 18, 19))
    allocation = manager.allocate_slots("1", 103 - 80, hit)
    assert allocation is not None
    assert allocation.new_block_ids == ((22, 23), (24, 25), (26, 27))
    manager.check_invariants()


@pytest.mark.parametrize(("evictions", "num_hit_blocks"), [
    ([(1, 0), (2, 0)], 5),
    ([(0, 0)], 0),
    ([(0, 5), (1, 5), (2, 5)], 4),  # the peek block is gone everywhere
    ([(0, 5)], 4),
    ([(1, 4)], 3),  # second-last SWA block (either group)
    ([(2, 4)], 3),
    ([(0, 5), (1, 0), (2, 0)], 4),
])
def test_prefill_hybrid_model_eagle_partial_eviction(evictions: list[tuple[int, int]],
                                                     num_hit_blocks: int) -> None:
    manager = eagle_manager()
    evict(manager, "0", evictions)
    hit = manager.find_longest_hit("1")
    assert hit.num_tokens == num_hit_blocks * BS
    assert hit_lengths(hit.blocks) == [num_hit_blocks] * 3


@pytest.mark.parametrize("layers", [
    [FULL, SW], [FULL, SW_LARGE], [FULL, SW, SW_LARGE], [FULL, SW, SW, SW_LARGE],
    [SW], [SW, SW_LARGE], [FULL, FULL, SW],
], ids=lambda layers: "+".join(f"{s.kind}{getattr(s, 'sliding_window', '')}" for s in layers))
@pytest.mark.parametrize("policy", ["dense", "prepend", "latest"])
def test_prefill_hybrid_model_combinations(layers: list[object], policy: str) -> None:
    """§6.1 item 4 (non-Mamba ids): req0 = 48 + 7 tokens misses, req1 = 48 + 5 hits 48 in
    every group (w64 needs 4 blocks; the 3-block run from block 0 counts)."""
    manager = build(layers, 60, policy)
    manager.add_request("0", [*COMMON, *range(100, 107)])
    assert manager.find_longest_hit("0").num_tokens == 0
    manager.allocate_slots("0", 55, manager.find_longest_hit("0"))
    manager.add_request("1", [*COMMON, *range(200, 205)])
    hit = manager.find_longest_hit("1")
    assert hit.num_tokens == 48
    assert hit_lengths(hit.blocks) == [3] * len(manager.config.groups)


def test_prefill_hybrid_model_combinations_eagle() -> None:
    """§6.1 item 5: full + SWA(w32), EAGLE: 64 common + different 5 → 3 blocks (48)."""
    manager = build([FULL, SW], 30, use_eagle=True, eagle_block_drop=True)
    common = [i // BS for i in range(4 * BS)]
    fill(manager, "0", [*common, *range(100, 107)])
    manager.add_request("1", [*common, *range(200, 205)])
    hit = manager.find_longest_hit("1")
    assert hit.num_tokens == 48 and hit_lengths(hit.blocks) == [3, 3]


# ----------------------------------------------------- test_different_block_size
@pytest.mark.parametrize("policy", ["reachable", "prepend", "dense"])
def test_different_block_size(policy: str) -> None:
    """§6.1 item 39: FA bs32 + SWA bs16 w32 (A 32), 112 tokens → ([1,2,3,4], [5..11]);
    prompts of 113 and 97 tokens hit 96 ([3 FA, 6 SWA]); after SWA blocks 5 (and 6) lose
    their hashes SWA would prefer 80 but the alignment forces 64 ([2, 4])."""
    full32 = FullAttentionSpec(32, 1)
    swa16 = SlidingWindowSpec(16, 1, 32)
    manager = build([full32, swa16], 30, policy)
    tokens = [i // 16 for i in range(112)]
    assert fill(manager, "0", tokens) == ((1, 2, 3, 4), tuple(range(5, 12)))
    # reachable/prepend clamp caching to the last 32 boundary (96); dense does not
    expected_swa = set(range(7)) if policy == "dense" else set(range(6))
    assert hashed_indices(manager, 1, "0") == expected_swa
    for n in (113, 97):
        manager.add_request(f"q{n}", [*tokens, 999][:n])
        hit = manager.find_longest_hit(f"q{n}")
        assert (hit.num_tokens, hit_lengths(hit.blocks)) == (96, [3, 6])
    evict(manager, "0", [(1, i) for i in sorted(expected_swa & {5, 6}, reverse=True)])
    for n in (113, 97):
        hit = manager.find_longest_hit(f"q{n}")
        assert (hit.num_tokens, hit_lengths(hit.blocks)) == (64, [2, 4])
        assert hit.block_ids[1][:2] == (0, 0)


# --------------------------------------------------- §4.3 three-group fixed point
def spy_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Record ``(group kind + window, limit, answer)`` for every per-spec lookup."""
    calls: list[tuple[str, int, int]] = []
    for cls in (FullAttentionManager, SlidingWindowManager):
        original = cls.__dict__["find_longest_hit"].__func__

        def wrapper(klass: type, /, pool: object, group_ids: object, spec: object,
                    hashes: object, limit: int, *, _original: object = original,
                    **kwargs: object) -> object:
            tables, num_tokens = _original(klass, pool, group_ids, spec, hashes, limit,
                                           **kwargs)  # type: ignore[operator]
            name = f"w{spec.sliding_window}" if hasattr(spec, "sliding_window") else "full"
            calls.append((name, limit, num_tokens))
            return tables, num_tokens

        monkeypatch.setattr(cls, "find_longest_hit", classmethod(wrapper))
    return calls


@pytest.mark.parametrize(("evictions", "expected_calls", "num_hit"), [
    (
        [(1, 7), (2, 5)],
        [("full", 128, 128), ("w32", 128, 112), ("w64", 112, 80), ("w32", 80, 80),
         ("w64", 80, 80)],
        80,
    ),
    (
        [(1, 0), (1, 3), (1, 4), (1, 7), (2, 5)],
        [("full", 128, 128), ("w32", 128, 112), ("w64", 112, 80), ("w32", 80, 48),
         ("w64", 48, 48), ("w32", 48, 48), ("w64", 48, 48)],
        48,  # SWA-b's 48 comes from the leading-run rule (3 blocks from block 0)
    ),
])
@pytest.mark.usefixtures("pure_python")
def test_three_group_fixed_point(monkeypatch: pytest.MonkeyPatch,
                                 evictions: list[tuple[int, int]],
                                 expected_calls: list[tuple[str, int, int]],
                                 num_hit: int) -> None:
    """§4.3: bs 16; full, SWA w32 (need 2), SWA w64 (need 4); a 129-token prompt cached,
    then some SWA keys evicted. Full attention is looked up once and trimmed afterwards;
    the junction reports how far full attention matched (128)."""
    manager = build([FULL, SW, SW_LARGE], 60)
    tokens = [i // BS for i in range(129)]
    fill(manager, "0", tokens)
    evict(manager, "0", evictions)
    manager.add_request("1", tokens)
    calls = spy_calls(monkeypatch)
    hit = manager.find_longest_hit("1")
    assert calls == expected_calls
    assert hit.num_tokens == num_hit
    assert hit_lengths(hit.blocks) == [num_hit // BS] * 3
    assert hit.junction_tokens == 128


def test_no_junction_when_all_groups_agree() -> None:
    manager = build([FULL, SW, SW_LARGE], 60)
    tokens = [i // BS for i in range(129)]
    fill(manager, "0", tokens)
    manager.add_request("1", tokens)
    hit = manager.find_longest_hit("1")
    assert (hit.num_tokens, hit.junction_tokens) == (128, 0)


# ------------------------------------------------------------- replay boundaries
@pytest.mark.parametrize(("num_prompt", "eagle", "expected"), [
    (128, False, (127,)), (100, False, (99,)),
    (128, True, (64, 96)), (127, True, (64,)), (100, True, (64,)), (20, True, (0,)),
    (32, True, (0,)), (33, True, (0,)), (64, True, (0, 32)),
])
def test_replay_boundaries(num_prompt: int, eagle: bool, expected: tuple[int, ...]) -> None:
    """§3.5.3 with S = 32: no EAGLE → (num_prompt - 1,); EAGLE → the post-drop positions of a
    resend (floor((n-1)/S)·S - S) and an extension (floor(n/S)·S - S)."""
    assert replay_boundaries(num_prompt, 32, use_eagle=eagle) == expected


# ------------------------------------------------------- spec groups, EAGLE flags
def test_spec_groups_put_full_attention_first_and_bundle_identical_specs() -> None:
    swa = SlidingWindowSpec(8, 1, 8)
    manager = build([swa, FullAttentionSpec(32, 1), swa, SlidingWindowSpec(8, 1, 16)], 20)
    groups = manager.coordinator.spec_groups
    assert groups[0].manager_cls is FullAttentionManager
    # layers 0 and 2 share a spec: two one-layer groups (1, 2), looked up together
    assert [sg.group_ids for sg in groups] == [(0,), (1, 2), (3,)]
    manager = build([FULL, SW, SW], 20)
    assert [sg.group_ids for sg in manager.coordinator.spec_groups] == [(0,), (1, 2)]


@pytest.mark.parametrize(("eagle_group_ids", "flags"), [
    (None, [True, True, True]),
    ((2,), [False, True, True]),  # siblings sharing a spec share the flag
    ((0,), [True, False, False]),
])
def test_eagle_flags(eagle_group_ids: tuple[int, ...] | None, flags: list[bool]) -> None:
    manager = build([FullAttentionSpec(32, 1), SlidingWindowSpec(8, 1, 8),
                     SlidingWindowSpec(8, 1, 8)], 20, use_eagle=True, eagle_block_drop=True,
                    eagle_group_ids=eagle_group_ids)
    assert [m.use_eagle for m in manager.coordinator.managers] == flags
    no_eagle = build([FULL, SW], 20, eagle_group_ids=(1,))
    assert [m.use_eagle for m in no_eagle.coordinator.managers] == [False, False]


def test_grouped_swa_siblings_use_the_same_cache_mask() -> None:
    """§6.1 item 38: full bs32 + SWA + SWA(eagle) sharing one spec (bs8 w8), 72 tokens: both
    SWA groups cache the EAGLE tails {3, 4, 7, 8} (block 8 is the one past the aligned
    boundary 64); prompt + 1 token hits 64."""
    swa = SlidingWindowSpec(8, 1, 8)
    manager = build([FullAttentionSpec(32, 1), swa, swa], 40, use_eagle=True, eagle_block_drop=True,
                    eagle_group_ids=(2,))
    tokens = [i // 8 for i in range(72)]
    fill(manager, "0", tokens)
    assert hashed_indices(manager, 1, "0") == hashed_indices(manager, 2, "0") == {3, 4, 7, 8}
    manager.add_request("1", [*tokens, 999])
    assert manager.find_longest_hit("1").num_tokens == 64


# -------------------------------------------------------------- chunked validation
@pytest.mark.parametrize(("layers", "options", "field"), [
    ([FullAttentionSpec(32, 1), ChunkedLocalSpec(16, 1, 64)], {}, "block_size"),
    ([ChunkedLocalSpec(16, 1, 24)], {}, "attention_chunk_size"),
    ([FullAttentionSpec(16, 1), ChunkedLocalSpec(16, 1, 64)],
     {"use_eagle": True, "eagle_block_drop": True}, "use_eagle"),
])
def test_chunked_local_constraints(layers: list[object], options: dict[str, object],
                                   field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(layers, 20, "prepend", **options)
    assert info.value.field == field


def test_chunked_local_hybrid_hits_current_chunk_only() -> None:
    """full bs4 + chunked bs4 (chunk 8): a 17-token request after a 16-token one hits 16
    with the chunked table all null (16 is a chunk boundary); a 15-token prefix resend
    hits 12 with chunked [null, null, b2]."""
    manager = build([FullAttentionSpec(4, 1), ChunkedLocalSpec(4, 1, 8)], 30)
    tokens = list(range(16))
    fill(manager, "0", [*tokens, 100])
    manager.add_request("1", [*tokens, 200])
    hit = manager.find_longest_hit("1")
    assert hit.num_tokens == 16
    assert hit.block_ids[0] == (1, 2, 3, 4) and hit.block_ids[1] == (0, 0, 0, 0)
    manager.add_request("2", [*tokens[:13], 300, 301, 302])
    hit = manager.find_longest_hit("2")
    assert hit.num_tokens == 12
    assert hit.block_ids[1] == (0, 0, 8)
