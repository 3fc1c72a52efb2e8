"""``flops`` eviction (Marconi-style, checkpoint-aware) on hand-built scenarios."""

from __future__ import annotations

import pytest

from hybridkv import (
    CacheConfig,
    ConfigError,
    FullAttentionSpec,
    KVCacheManager,
    RecurrentStateSpec,
    SlidingWindowSpec,
)
from hybridkv.block import DEAD_QUEUE, FREE_QUEUE
from hybridkv.eviction import parse_eviction
from hybridkv.pool import FreeTier

BS = 4


def make(policy: str = "latest+flops", num_blocks: int = 64) -> KVCacheManager:
    layers = [FullAttentionSpec(BS, 1), RecurrentStateSpec(BS, 1), RecurrentStateSpec(BS, 1)]
    return KVCacheManager(CacheConfig.from_layers(layers, num_blocks), policy)


def run(m: KVCacheManager, req_id: str, tokens: list[int], num_output: int = 0) -> int:
    """Admit, prefill in the aligned chunks the manager plans (one step each), decode
    ``num_output`` tokens, finish; returns the hit."""
    m.add_request(req_id, tokens)
    m.new_step()
    hit = m.find_longest_hit(req_id)
    computed, first = hit.num_tokens, True
    while computed < len(tokens):
        n = m.align_prefill_chunk(req_id, len(tokens) - computed, hit if first else None)
        assert m.allocate_slots(req_id, n, hit if first else None) is not None
        first, computed = False, computed + n
        m.new_step()
    for i in range(num_output):
        m.append_token_ids(req_id, [900 + i])
        assert m.allocate_slots(req_id, 1) is not None
        m.new_step()
    m.remove_request(req_id)
    m.check_invariants()
    return hit.num_tokens


def cached(m: KVCacheManager, group: int) -> dict[int, int | None]:
    """Table position (by block end) → queue of each cached block of ``group``."""
    return {b.block_id: b.queue_id for b in m.pool.blocks
            if b.block_hash is not None and b.hash_group_id == group}


def test_blocks_past_the_last_checkpoint_are_worthless_at_release() -> None:
    """13 prompt tokens + 8 decoded: full-attention blocks [12, 16) and [16, 20) fill
    during decode but no state exists past 12 (the replay boundary): no hit can use them.
    LRU keeps them; ``flops`` files them dead, the rest stays in the LRU queue."""
    prompt = list(range(13))
    for policy, dead in (("latest", 0), ("latest+flops", 2)):
        m = make(policy)
        run(m, "a", prompt, num_output=8)
        fa = cached(m, 0)
        assert len(fa) == 5
        assert sum(q == DEAD_QUEUE for q in fa.values()) == dead
        assert all(q == FREE_QUEUE for q in cached(m, 1).values())
        assert run(m, "b", [*prompt[:13], 7, 7]) == 12  # the hit is untouched
        m.check_invariants()


def test_a_release_is_linked_segment_by_segment_from_the_end() -> None:
    """b extends a (hit 12, a's checkpoint released at b's first step) and leaves its own
    at 20. ``flops`` links: states at 20, block [16, 20), then a's states at 12 (moved
    back from their old place) right before blocks [8, 12) … [0, 4). LRU leaves a's
    states oldest, so they are evicted before b's tail and the chain [0, 12) is lost."""
    a = list(range(13))
    b = [*a, *range(50, 58)]  # 21 tokens: replay boundary 20
    orders = {}
    for policy in ("latest", "latest+flops"):
        m = make(policy)
        run(m, "a", a)
        assert run(m, "b", b) == 12
        pool = m.pool
        ends: dict[int, str] = {}
        for block in pool.blocks:
            if block.block_hash is None:
                continue
            group = "fa" if block.hash_group_id == 0 else "r"
            ends[block.block_id] = group
        hashed_order = [bid for bid in pool.free_queue_order() if bid in ends]
        orders[policy] = [ends[bid] for bid in hashed_order]
    # LRU: a's two states (released at b's first step) come first
    assert orders["latest"][:2] == ["r", "r"] and orders["latest"][2] == "fa"
    assert orders["latest+flops"] == ["r", "r", "fa", "fa", "r", "r", "fa", "fa", "fa"]


def test_losing_a_state_frees_its_whole_segment_at_once() -> None:
    """Evicting one recurrent group's copy of the only checkpoint (12) makes the other
    group's copy and every full-attention block of its chain worthless while free: they
    move to the dead queue at once."""
    m = make("latest+flops")
    run(m, "a", list(range(13)))
    pool = m.pool
    state = next(b for b in pool.blocks if b.hash_group_id == 1)
    assert m.coordinator.branch is None
    pool.move(state, FreeTier.DEAD)  # reused next
    taken = pool.allocate(1)
    assert taken == [state] and state.block_hash is None
    assert all(q == DEAD_QUEUE for q in cached(m, 0).values())
    assert all(q == DEAD_QUEUE for q in cached(m, 2).values())
    pool.free_blocks(taken, FreeTier.HEAD, FreeTier.HEAD)
    m.check_invariants()


def test_flops_is_refused_where_hit_points_are_not_modelled() -> None:
    assert parse_eviction(["flops"]).name == "flops"
    layers = [FullAttentionSpec(BS, 1), SlidingWindowSpec(BS, 1, 8)]
    with pytest.raises(ConfigError, match="drop \\+flops"):
        KVCacheManager(CacheConfig.from_layers(layers, 16), "latest+flops")
    full = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(BS, 1)], 16),
                          "latest+flops")
    assert full.policy_name == "latest+flops"


def test_a_segment_left_behind_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: worthless blocks are not moved to the dead queue when their point dies.
    ``check_invariants`` must object (a worthless block in a live queue)."""
    from hybridkv.errors import InvariantViolation
    from hybridkv.hitpoints import HitPoints

    monkeypatch.setattr(HitPoints, "_move_dead", lambda self, blocks: None)
    m = make("latest+flops")
    run(m, "a", list(range(13)))
    pool = m.pool
    state = next(b for b in pool.blocks if b.hash_group_id == 1)
    pool.move(state, FreeTier.DEAD)
    taken = pool.allocate(1)
    pool.free_blocks(taken, FreeTier.HEAD, FreeTier.HEAD)
    with pytest.raises(InvariantViolation, match="worthless"):
        m.check_invariants()
