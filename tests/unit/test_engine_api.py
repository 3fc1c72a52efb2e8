"""Engine-facing API of ``KVCacheManager`` (issue 12 part 6): ``reset_prefix_cache``,
``evict_prefix``, ``probe_prefix``, ``snapshot`` and immutable views in ``PrefixHit``."""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv import (
    BlockView,
    CacheConfig,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
    StaleHitError,
)
from hybridkv.block import Block

HYBRID = [FullAttentionSpec(8, 1), SlidingWindowSpec(4, 1, 6), SlidingWindowSpec(4, 1, 6)]
POLICIES = ("dense", "prepend", "latest", "interval:16", "pin:8",
            "latest+scan+chain+session+predict", "prepend+scan+chain")


def make(policy: str = "dense", num_blocks: int = 80, **options: object) -> KVCacheManager:
    return KVCacheManager(CacheConfig.from_layers(HYBRID, num_blocks, **options), policy)


def run(manager: KVCacheManager, req_id: str, tokens: list[int], *, finish: bool = True,
        ) -> int:
    manager.add_request(req_id, tokens, session_id="s")
    hit = manager.find_longest_hit(req_id)
    assert manager.allocate_slots(req_id, len(tokens) - hit.num_tokens, hit) is not None
    manager.append_token_ids(req_id, [999])
    assert manager.allocate_slots(req_id, 1) is not None
    if finish:
        manager.remove_request(req_id)
    manager.check_invariants()
    return hit.num_tokens


PROMPT = list(range(40))


# ------------------------------------------------------------------ PrefixHit
def test_prefix_hit_exposes_frozen_views_only() -> None:
    manager = make()
    run(manager, "a", PROMPT)
    manager.add_request("b", PROMPT)
    hit = manager.find_longest_hit("b")
    assert hit.num_tokens == 32
    views = [v for table in hit.blocks for v in table]
    assert views and all(isinstance(v, BlockView) for v in views)
    with pytest.raises(dataclasses.FrozenInstanceError):
        views[0].block_id = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        hit.num_tokens = 0  # type: ignore[misc]
    public = [getattr(hit, f.name) for f in dataclasses.fields(hit) if not f.name.startswith("_")]
    public += [hit.blocks, hit.block_ids]
    assert not any(isinstance(x, Block) for x in _flatten(public))
    assert hit.block_ids == tuple(tuple(v.block_id for v in t) for t in hit.blocks)
    # a view is a value: it does not follow later changes of the block
    first = next(v for v in views if not v.is_null)
    assert first.block_hash is not None
    manager.evict_prefix(PROMPT)
    assert manager.pool.blocks[first.block_id].block_hash is None
    assert first.block_hash is not None
    with pytest.raises(StaleHitError):
        manager.allocate_slots("b", 8, hit)


def _flatten(values: list[object]) -> list[object]:
    out: list[object] = []
    for value in values:
        if isinstance(value, tuple):
            out.extend(_flatten(list(value)))
        else:
            out.append(value)
    return out


def test_allocation_exposes_ids_not_blocks() -> None:
    manager = make()
    manager.add_request("a", PROMPT)
    allocation = manager.allocate_slots("a", 40)
    assert allocation is not None
    assert [len(ids) for ids in allocation.new_block_ids] == [5, 10, 10]
    public = [getattr(allocation, name) for name in dir(allocation)
              if not name.startswith("_")]
    assert allocation.num_computed_tokens == 0 and allocation.num_new_tokens == 40
    assert not any(isinstance(x, Block) for x in _flatten(public))
    assert "Block(" not in repr(allocation)
    with pytest.raises(AttributeError):  # read-only
        allocation.num_new_tokens = 1  # type: ignore[misc]


# --------------------------------------------------------- reset_prefix_cache
@pytest.mark.parametrize("policy", POLICIES)
def test_reset_prefix_cache_only_when_idle(policy: str) -> None:
    manager = make(policy)
    run(manager, "a", PROMPT)
    run(manager, "b", [*PROMPT[:24], *range(500, 520)])
    run(manager, "c", PROMPT, finish=False)  # holds blocks
    before = manager.snapshot()
    assert before.cached_blocks
    assert manager.reset_prefix_cache() is False
    assert manager.snapshot() == before  # refused: nothing changed
    manager.remove_request("c")
    manager.add_request("d", PROMPT)
    stale = manager.find_longest_hit("d")
    assert stale.num_tokens == 32
    evicted_before = list(manager.pool.num_evicted_blocks)
    assert manager.reset_prefix_cache() is True
    manager.check_invariants()
    after = manager.snapshot()
    assert after.cached_blocks == () and all(g.cached_blocks == 0 for g in after.groups)
    assert after.num_free_blocks == manager.pool.num_blocks - 1
    assert sorted(after.free_queue) == list(range(1, manager.pool.num_blocks))
    assert manager.pool.num_evicted_blocks == evicted_before  # not counted as evictions
    with pytest.raises(StaleHitError):
        manager.allocate_slots("d", 8, stale)
    assert manager.find_longest_hit("d").num_tokens == 0  # waiting requests simply miss
    assert run(manager, "d2", PROMPT) == 0
    assert run(manager, "e", PROMPT) == 32  # caching works again afterwards


def test_reset_prefix_cache_on_an_empty_cache() -> None:
    manager = make()
    assert manager.reset_prefix_cache() is True
    manager.check_invariants()


# --------------------------------------------------------------- evict_prefix
@pytest.mark.parametrize("policy", POLICIES)
def test_evict_prefix_drops_that_prefix_in_every_group(policy: str) -> None:
    manager = make(policy)
    other = list(range(300, 340))
    run(manager, "a", PROMPT)
    run(manager, "o", other)
    hashed_before = {c.block_id for c in manager.snapshot().cached_blocks}
    dropped = manager.evict_prefix(PROMPT[:16])
    manager.check_invariants()
    after = manager.snapshot()
    lost = hashed_before - {c.block_id for c in after.cached_blocks}
    assert dropped == len(lost) > 0
    # every group lost exactly the blocks inside [0, 16) of this prefix
    for group in manager.config.groups:
        bs = group.spec.block_size
        view = manager.hasher.hash_blocks(PROMPT)[bs // 4 - 1 :: bs // 4]
        for idx, block_hash in enumerate(view):
            copies = manager.pool.cached_copies(block_hash, group.group_id)
            if (idx + 1) * bs <= 16:
                assert copies == []
    # the dropped blocks are reused first: the head of the free queue, behind only the
    # dead queue (``chain`` kills the dropped blocks' dependents)
    dead = {c.block_id for c in after.cached_blocks if c.queue == "dead"}
    assert set(after.free_queue[: len(dead)]) == dead
    assert set(after.free_queue[len(dead) : len(dead) + len(lost)]) == lost
    assert manager.probe_prefix(PROMPT) == 0
    assert manager.probe_prefix(other) == 32  # another prefix keeps its blocks
    assert manager.evict_prefix(PROMPT[:16]) == 0  # nothing left to drop


def test_evict_prefix_drops_held_and_duplicate_copies() -> None:
    manager = make("dense")
    # two requests compute the same prefix concurrently: two copies of each block
    manager.add_request("a", PROMPT)
    manager.add_request("b", PROMPT)
    hit_a, hit_b = manager.find_longest_hit("a"), manager.find_longest_hit("b")
    assert manager.allocate_slots("a", 40, hit_a) is not None
    assert manager.allocate_slots("b", 40, hit_b) is not None
    full_hash = manager.hasher.hash_blocks(PROMPT)[1]
    assert len(manager.pool.cached_copies(full_hash, 0)) == 2
    table_a = manager.get_block_ids("a")
    dropped = manager.evict_prefix(PROMPT[:8])
    assert dropped == 2 * (1 + 2 + 2)  # both copies: 1 full block, 2 + 2 window blocks
    assert manager.pool.cached_copies(full_hash, 0) == []
    # held blocks keep serving their requests
    assert manager.get_block_ids("a") == table_a
    assert manager.is_running("a") and manager.pool.blocks[table_a[0][0]].ref_count == 1
    manager.check_invariants()
    manager.remove_request("a")
    manager.remove_request("b")
    manager.check_invariants()
    assert manager.probe_prefix(PROMPT) == 0


def test_evict_prefix_respects_extra_keys() -> None:
    from hybridkv import ExtraKeys
    manager = make("dense")
    salted = ExtraKeys(cache_salt="tenant-1")
    manager.add_request("a", PROMPT, extra_keys=salted)
    assert manager.allocate_slots("a", 40) is not None
    manager.remove_request("a")
    assert manager.evict_prefix(PROMPT) == 0  # unsalted: another prefix
    assert manager.probe_prefix(PROMPT, salted) == 32
    assert manager.evict_prefix(PROMPT, salted) > 0
    assert manager.probe_prefix(PROMPT, salted) == 0


# ------------------------------------------------------- probe and snapshot
@pytest.mark.parametrize("options", [{}, {"use_eagle": True},
                                     {"use_eagle": True, "eagle_block_drop": True}])
def test_probe_prefix_equals_a_lookup_and_changes_nothing(options: dict[str, object]) -> None:
    manager = make("latest", **options)
    run(manager, "a", PROMPT)
    run(manager, "b", [*PROMPT[:20], *range(700, 730)])
    for tokens in (PROMPT, PROMPT[:33], [*PROMPT[:20], *range(700, 730)], [1, 2], [5]):
        before = manager.snapshot()
        probed = manager.probe_prefix(tokens)
        assert manager.snapshot() == before
        manager.add_request("q", tokens)
        assert probed == manager.find_longest_hit("q").num_tokens
        manager.remove_request("q")


def test_snapshot_free_queue_is_the_allocation_order() -> None:
    manager = make("prepend+scan")
    run(manager, "a", PROMPT)
    run(manager, "b", PROMPT)
    run(manager, "c", [*PROMPT[:8], *range(900, 917)])
    snap = manager.snapshot()
    assert len(snap.free_queue) == snap.num_free_blocks == len(set(snap.free_queue))
    assert {c.queue for c in snap.cached_blocks} <= {"free", "protected", "dead"}
    manager.add_request("d", list(range(2000, 2040)))
    allocation = manager.allocate_slots("d", 40)
    assert allocation is not None
    taken = [i for ids in allocation.new_block_ids for i in ids]
    assert sorted(taken) == sorted(snap.free_queue[: len(taken)])


def test_snapshot_group_usage() -> None:
    manager = make("dense")
    run(manager, "a", PROMPT)
    manager.add_request("b", PROMPT)
    hit = manager.find_longest_hit("b")
    assert manager.allocate_slots("b", 8, hit) is not None
    snap = manager.snapshot()
    held = [len({i for i in ids if i}) for ids in manager.get_block_ids("b")]
    assert [g.held_blocks for g in snap.groups] == held
    assert [g.kind for g in snap.groups] == ["full_attention", "sliding_window",
                                            "sliding_window"]
    for group in snap.groups:
        mine = [c for c in snap.cached_blocks if c.group_id == group.group_id]
        assert group.cached_blocks == len(mine)
        assert group.cached_free_blocks == sum(1 for c in mine if c.ref_count == 0)
        assert all((c.queue is None) == (c.ref_count > 0) for c in mine)
    assert snap.epoch == manager.pool.epoch and snap.num_blocks == 80
