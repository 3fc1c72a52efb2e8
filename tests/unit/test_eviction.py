"""Eviction policies (scan, chain, session) on hand-built scenarios."""

from __future__ import annotations

import pytest

from hybridkv import CacheConfig, ConfigError, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridkv.block import DEAD_QUEUE, FREE_QUEUE, PROTECTED_QUEUE, SESSION_QUEUE
from hybridkv.eviction import EvictionOptions, parse_eviction


def full_only(num_blocks: int, policy: str) -> KVCacheManager:
    return KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], num_blocks), policy)


def hybrid(num_blocks: int, policy: str) -> KVCacheManager:
    layers = [FullAttentionSpec(8, 1), SlidingWindowSpec(4, 1, 5)]
    return KVCacheManager(CacheConfig.from_layers(layers, num_blocks), policy)


def run_prompt(manager: KVCacheManager, req_id: str, tokens: list[int],
               session_id: str | None = None) -> int:
    """Admit, prefill whole, finish; returns the hit tokens."""
    manager.add_request(req_id, tokens, session_id=session_id)
    hit = manager.find_longest_hit(req_id)
    assert manager.allocate_slots(req_id, len(tokens) - hit.num_tokens, hit) is not None
    manager.remove_request(req_id)
    manager.check_invariants()
    return hit.num_tokens


def queue_of(manager: KVCacheManager, block_id: int) -> int | None:
    return manager.pool.blocks[block_id].queue_id


def test_parse_eviction_names_and_errors() -> None:
    assert parse_eviction([]) == EvictionOptions()
    assert parse_eviction(["scan", "chain"]).name == "scan+chain"
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        parse_eviction(["fifo"])
    assert KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 10),
                          "latest+scan+chain").policy_name == "latest+scan+chain"


def test_lru_keeps_the_vllm_order() -> None:
    # Default eviction puts everything in the one free queue: no other queue is ever used.
    manager = full_only(20, "prepend")
    run_prompt(manager, "a", list(range(9)))
    run_prompt(manager, "b", list(range(9)))
    assert all(len(q) == 0 for i, q in enumerate(manager.pool.queues) if i != FREE_QUEUE)


def test_scan_protects_blocks_that_were_hit() -> None:
    manager = full_only(20, "prepend+scan")
    run_prompt(manager, "a", list(range(9)))           # blocks 1, 2 cached (8 tokens)
    assert {queue_of(manager, 1), queue_of(manager, 2)} == {FREE_QUEUE}
    assert run_prompt(manager, "b", list(range(9))) == 8  # hit both
    assert queue_of(manager, 1) == PROTECTED_QUEUE == queue_of(manager, 2)
    run_prompt(manager, "c", list(range(100, 109)))    # one-off: probation
    one_off = [b for b in manager.pool.blocks if b.block_hash is not None
               and b.queue_id == FREE_QUEUE]
    assert len(one_off) == 2
    one_off_hashes = [b.block_hash for b in one_off]
    protected_hashes = [manager.pool.blocks[i].block_hash for i in (1, 2)]
    # Allocation drains the free queue (probation) before the protected queue.
    manager.add_request("d", list(range(200, 200 + 4 * 17)))
    assert manager.allocate_slots("d", 4 * 17) is not None  # 17 blocks: all but protected
    lookup = manager.pool.get_cached_block
    assert all(lookup(h, 0) is not None for h in protected_hashes if h is not None)
    assert all(lookup(h, 0) is None for h in one_off_hashes if h is not None)


def test_scan_ages_protected_blocks_beyond_their_share() -> None:
    manager = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 11),
                             "prepend", EvictionOptions(scan=True, protected_fraction=0.2))
    # cap = int(0.2 * 10) = 2 protected blocks
    for i, base in enumerate((0, 100)):
        run_prompt(manager, f"a{i}", list(range(base, base + 9)))
        run_prompt(manager, f"b{i}", list(range(base, base + 9)))
    protected = list(manager.pool.queues[PROTECTED_QUEUE])
    assert len(protected) == 2
    demoted = [b for b in manager.pool.free_queue if b.block_hash is not None]
    assert len(demoted) == 2 and all(b.num_hits == 0 for b in demoted)


def test_chain_moves_dependents_to_the_dead_queue() -> None:
    # Hybrid: full bs8, window bs4 w5 (2 tail blocks), alignment 8.
    manager = hybrid(60, "prepend+chain")
    tokens = list(range(33))                          # 4 full blocks (32 tokens) cached
    run_prompt(manager, "a", tokens)
    full_blocks = [b for b in manager.pool.blocks if b.hash_group_id == 0]
    window_blocks = [b for b in manager.pool.blocks if b.hash_group_id == 1]
    assert len(full_blocks) == 4 and window_blocks
    # Evict the first full-attention block by hand (as an allocation would): every other
    # cached block of the chain depends on it.
    first = next(b for b in full_blocks if b.parent_hash == b"")
    manager.pool.free_queue.remove(first)
    first.queue_id = None
    manager.pool._evict(first)
    first.queue_id = FREE_QUEUE
    manager.pool.free_queue.append_n([first])
    survivors = [b for b in manager.pool.blocks if b.block_hash is not None]
    assert survivors and all(b.is_dead and b.queue_id == DEAD_QUEUE for b in survivors)
    manager.check_invariants()
    # The dead blocks are reused before any other free block.
    manager.add_request("b", list(range(500, 500 + 8 * len(survivors))))
    head = manager.pool.allocate(len(survivors))
    assert {b.block_id for b in head} == {b.block_id for b in survivors}


def test_chain_freed_block_without_a_cached_parent_is_dead() -> None:
    # Dense retention hashes window blocks past the last full-attention boundary; no hit
    # can use them (no full block behind them), so chain eviction files them as dead.
    manager = hybrid(60, "dense+chain")
    run_prompt(manager, "a", list(range(13)))  # 12 tokens: 1 full block, 3 window blocks
    dead = [b for b in manager.pool.blocks if b.queue_id == DEAD_QUEUE]
    assert [b.hash_group_id for b in dead] == [1]  # window block 2 ends at 12 > 8
    assert run_prompt(manager, "b", list(range(13))) == 8


def test_session_protects_the_latest_prompt_of_a_conversation() -> None:
    manager = full_only(30, "prepend+session")
    run_prompt(manager, "t0", list(range(9)), session_id="s")
    first = {b.block_id for b in manager.pool.queues[SESSION_QUEUE]}
    assert len(first) == 2
    run_prompt(manager, "one-off", list(range(300, 309)))   # no session: free queue
    assert len(manager.pool.queues[SESSION_QUEUE]) == 2
    # the next turn extends the conversation (t0 filled 2 blocks): it hits them, then its
    # own 4 blocks replace the old set
    assert run_prompt(manager, "t1", list(range(17)), session_id="s") == 8
    assert len(manager.pool.queues[SESSION_QUEUE]) == 4
    # preemption does not protect
    manager.add_request("p", list(range(400, 409)), session_id="q")
    assert manager.allocate_slots("p", 9) is not None
    manager.free("p")
    assert len(manager.pool.queues[SESSION_QUEUE]) == 4


def test_session_queue_is_capped_least_recent_conversation_first() -> None:
    manager = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 21),
                             "prepend", EvictionOptions(session=True, session_fraction=0.2))
    # cap = 4 blocks; each conversation leaves 2 blocks
    for s in range(3):
        run_prompt(manager, f"r{s}", list(range(100 * s, 100 * s + 9)), session_id=f"s{s}")
    session_ids = {b.block_id for b in manager.pool.queues[SESSION_QUEUE]}
    assert len(session_ids) == 4
    oldest = [b for b in manager.pool.blocks
              if b.block_hash is not None and b.queue_id == FREE_QUEUE]
    assert len(oldest) == 2  # conversation s0 was demoted


@pytest.mark.parametrize("policy", ["latest+scan+chain+session", "interval:8+chain",
                                    "prepend+scan", "pin:8+scan+chain"])
def test_combinations_keep_invariants_under_pressure(policy: str) -> None:
    manager = hybrid(24, policy)
    for i in range(12):
        base = (i % 3) * 1000
        tokens = list(range(base, base + 17 + 4 * (i % 4)))
        run_prompt(manager, f"r{i}", tokens, session_id=f"s{i % 2}")
    assert manager.num_free_blocks == 23


def test_session_protects_every_group_of_a_finished_request() -> None:
    # Regression: each group's release used to supersede the previous group's protection,
    # so only the last group's blocks stayed in the session queue.
    manager = hybrid(60, "prepend+session")
    run_prompt(manager, "t0", list(range(33)), session_id="s")
    in_session = [b for b in manager.pool.blocks if b.queue_id == SESSION_QUEUE]
    assert {b.hash_group_id for b in in_session} == {0, 1}
    hashed = [b for b in manager.pool.blocks if b.block_hash is not None]
    assert len(in_session) == len(hashed)
    # the next turn of the same conversation supersedes all of them at once
    run_prompt(manager, "t1", list(range(33)) + [7] * 16, session_id="s")
    owners = {b.block_id for b in manager.pool.blocks if b.queue_id == SESSION_QUEUE}
    assert owners and all(manager.pool.blocks[i].block_hash is not None for i in owners)
    assert {manager.pool.blocks[i].hash_group_id for i in owners} == {0, 1}
