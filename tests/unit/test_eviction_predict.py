"""``predict`` eviction: learned dead-on-arrival prediction from the output length.

Hand-checked scenarios on a full-attention model with 4-token blocks (a 9-token prompt fills
2 cached blocks plus one partial scratch block) and a small hybrid model.
"""

from __future__ import annotations

import pytest

from hybridkv import CacheConfig, ConfigError, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridkv.errors import InvariantViolation
from hybridkv.eviction import (
    EvictionOptions,
    EvictionPolicy,
    ReusePredictor,
    output_signature,
    parse_eviction,
)
from hybridkv.sim.run import all_policies, parse_policies


def full_only(num_blocks: int, options: EvictionOptions,
              retention: str = "prepend") -> KVCacheManager:
    config = CacheConfig.from_layers([FullAttentionSpec(4, 1)], num_blocks)
    return KVCacheManager(config, retention, options)


def policy_of(manager: KVCacheManager) -> EvictionPolicy:
    policy = manager.pool.eviction
    assert policy is not None
    return policy


def predictor_of(manager: KVCacheManager) -> ReusePredictor:
    predictor = policy_of(manager).predictor
    assert predictor is not None
    return predictor


def run(manager: KVCacheManager, req_id: str, tokens: list[int], num_output: int,
        *, finish: bool = True) -> int:
    """Admit, prefill whole, decode ``num_output`` tokens, then finish (``remove_request``)
    or preempt (``free``); returns the hit tokens."""
    manager.add_request(req_id, tokens)
    hit = manager.find_longest_hit(req_id)
    assert manager.allocate_slots(req_id, len(tokens) - hit.num_tokens, hit) is not None
    for i in range(num_output):
        manager.append_token_ids(req_id, [900 + i])
        assert manager.allocate_slots(req_id, 1) is not None
    if finish:
        manager.remove_request(req_id)
    else:
        manager.free(req_id)
    manager.check_invariants()
    return hit.num_tokens


def force_dead(predictor: ReusePredictor, dead: int, live: int = 1) -> None:
    """Counters as if 32 entries of ``live`` were reused and 32 of ``dead`` expired."""
    predictor.num_reused = {live: 32}
    predictor.num_dead = {dead: 32}
    predictor.total_reused = predictor.total_dead = 32
    assert predictor.is_live(live) and not predictor.is_live(dead)


def test_output_signature_buckets() -> None:
    # ⌊log2 n⌋ + 1: the research buckets ≤32, 65–96, 129–512, >512 fall into 1–6, 7, 8–10, ≥10
    pairs = {0: 0, 1: 1, 2: 2, 3: 2, 4: 3, 31: 5, 32: 6, 63: 6, 64: 7, 96: 7, 127: 7,
             128: 8, 255: 8, 256: 9, 511: 9, 512: 10, 1023: 10, 1024: 11}
    assert {n: output_signature(n) for n in pairs} == pairs
    assert output_signature(-3) == 0


def test_predictor_threshold_is_relative_to_the_global_rate() -> None:
    p = ReusePredictor(horizon=10, threshold=0.5, min_samples=32)
    p.num_reused, p.num_dead = {6: 30, 9: 3, 7: 5}, {6: 10, 9: 47, 7: 27}
    p.total_reused, p.total_dead = 40, 160  # global rate 0.2: the bar is 0.1
    assert p.is_live(6)           # 30 / 40 = 0.75
    assert not p.is_live(9)       # 3 / 50 = 0.06 < 0.1
    assert p.is_live(7)           # 5 / 32 = 0.156 ≥ 0.1
    p.num_dead[7] = 46
    assert not p.is_live(7)       # 5 / 51 = 0.098 < 0.1
    p.num_reused[8], p.num_dead[8] = 0, 31
    assert p.is_live(8)           # 31 resolved < 32 samples: unknown, live


@pytest.mark.parametrize("eviction", ["predict", "scan+predict"])
def test_predicted_dead_blocks_go_after_scratch_before_older_lru_blocks(eviction: str) -> None:
    manager = full_only(20, parse_eviction(eviction.split("+")))
    force_dead(predictor_of(manager), dead=2)        # 2–3 output tokens: dead
    # "old": blocks 1, 2, 3; 1 output token (sig 1, live): 3 is scratch (stack), 2, 1 cached
    # at the LRU (probation) tail, tail first
    run(manager, "old", list(range(9)), num_output=1)
    assert manager.pool.free_block_ids() == [3, *range(4, 20), 2, 1]
    # "doomed": blocks 3, 4, 5; 2 output tokens (sig 2, dead): 5 is scratch (stack), its
    # never-hit cached blocks 4, 3 go to the front of the linked list, tail first
    run(manager, "doomed", list(range(100, 109)), num_output=2)
    assert manager.pool.free_block_ids() == [5, 4, 3, *range(6, 20), 2, 1]
    assert policy_of(manager).num_predicted_dead == 2
    # the next allocation reuses the scratch block, then evicts doomed's chain end
    manager.add_request("next", list(range(200, 208)))
    assert [b.block_id for b in manager.pool.allocate(2)] == [5, 4]
    lookup = manager.pool.get_cached_block
    cached = [b.block_hash for b in manager.pool.blocks if b.block_hash is not None]
    assert len(cached) == 3 and all(lookup(h, 0) is not None for h in cached)
    assert manager.pool.blocks[4].block_hash is None  # evicted: no longer predicted dead
    assert 4 not in policy_of(manager)._predicted


def test_lru_order_without_predict_for_comparison() -> None:
    manager = full_only(20, EvictionOptions())
    run(manager, "old", list(range(9)), num_output=1)
    run(manager, "doomed", list(range(100, 109)), num_output=2)
    assert manager.pool.free_block_ids() == [5, *range(6, 20), 2, 1, 4, 3]


def test_learning_flips_a_signature_after_enough_expiries() -> None:
    # horizon int(0.1 × 40) = 4 released full-attention blocks; 2 samples decide
    manager = full_only(41, EvictionOptions(predict=True, predict_horizon=0.1,
                                            predict_min_samples=2))
    predictor = predictor_of(manager)
    assert predictor.horizon == 4
    run(manager, "a", list(range(9)), num_output=1)             # logs 2 × sig 1 at clock 0
    assert run(manager, "a2", list(range(9)), num_output=1) == 8  # hits them: 2 reused
    assert (predictor.clock, predictor.num_reused) == (4, {1: 2})
    run(manager, "u0", list(range(100, 109)), num_output=2)     # 2 × sig 2 at clock 4
    run(manager, "u1", list(range(200, 209)), num_output=2)     # 2 × sig 2 at clock 6
    assert predictor.is_live(2) and predictor.clock == 8          # age 4: not expired yet
    run(manager, "u2", list(range(300, 309)), num_output=2)     # clock 10: u0's age 6 > 4
    assert predictor.num_dead == {2: 2} and predictor.total_reused == 2
    assert not predictor.is_live(2) and predictor.is_live(1)     # 0/2 < 0.5 × 2/4
    assert policy_of(manager).num_predicted_dead == 0
    run(manager, "u3", list(range(400, 409)), num_output=2)     # sig 2: predicted dead
    policy = policy_of(manager)
    assert policy.num_predicted_dead == 2
    front = [b for b in manager.pool.free_queue if b.block_hash is not None][:2]
    assert {b.block_id for b in front} == policy._predicted
    assert len(predictor.history) <= predictor.horizon          # bounded


def test_a_hit_before_expiry_counts_even_while_the_hitter_still_holds_the_block() -> None:
    manager = full_only(41, EvictionOptions(predict=True, predict_horizon=0.1,
                                            predict_min_samples=2))
    predictor = predictor_of(manager)
    run(manager, "a", list(range(9)), num_output=1)             # 2 × sig 1 at clock 0
    manager.add_request("hold", list(range(9)))                 # hits them and keeps them
    hit = manager.find_longest_hit("hold")
    assert manager.allocate_slots("hold", 1, hit) is not None and hit.num_tokens == 8
    for i in range(3):                                          # clock 2 → 8: a's entries expire
        run(manager, f"u{i}", list(range(100 * (i + 1), 100 * (i + 1) + 9)), num_output=2)
    assert predictor.num_reused == {1: 2} and predictor.num_dead == {2: 2}


def test_preempted_requests_are_never_predicted_dead_nor_logged() -> None:
    manager = full_only(20, EvictionOptions(predict=True))
    predictor = predictor_of(manager)
    force_dead(predictor, dead=2)
    run(manager, "p", list(range(9)), num_output=2, finish=False)  # preemption: no signal
    assert policy_of(manager).num_predicted_dead == 0 and not predictor.history
    assert predictor.clock == 2                                   # still block accesses
    assert manager.pool.free_block_ids()[-2:] == [2, 1]           # LRU tail
    # re-admitted, it hits its own blocks (not candidates any more) and finishes
    assert run(manager, "p2", [*range(9), 900, 901], num_output=0) == 8
    assert policy_of(manager).num_predicted_dead == 0


def test_window_blocks_follow_the_full_attention_prediction() -> None:
    # full bs 8 + window bs 4, window 5; `dense` hashes every full block of both groups.
    # 25 prompt + 2 output tokens = 27: full blocks 0–2 (tokens 0–23) cached; window blocks
    # 0–4 left the window during decode (released then, without a signature: live, LRU),
    # block 5 (20–23) is cached and still held at the finish, block 6 (24–26) is scratch.
    layers = [FullAttentionSpec(8, 1), SlidingWindowSpec(4, 1, 5)]
    manager = KVCacheManager(CacheConfig.from_layers(layers, 60), "dense",
                             EvictionOptions(predict=True))
    force_dead(predictor_of(manager), dead=2)
    manager.add_request("doomed", list(range(25)))
    assert manager.allocate_slots("doomed", 25) is not None
    for i in range(2):
        manager.append_token_ids("doomed", [900 + i])
        assert manager.allocate_slots("doomed", 1) is not None
    full, window = (m.tables["doomed"] for m in manager.coordinator.managers)
    assert [b.block_hash is not None for b in full] == [True, True, True, False]
    assert [b.is_null for b in window] == [True] * 5 + [False, False]
    expected = {b.block_id for b in (*full[:3], window[5])}
    manager.remove_request("doomed")
    manager.check_invariants()
    policy = policy_of(manager)
    assert policy._predicted == expected and policy.num_predicted_dead == 4
    linked = [b for b in manager.pool.free_queue if b.block_hash is not None]
    assert len(linked) == 9 and {b.block_id for b in linked[:4]} == expected


def test_check_invariants_catches_an_lru_block_ahead_of_a_predicted_dead_one() -> None:
    manager = full_only(20, EvictionOptions(predict=True))
    force_dead(predictor_of(manager), dead=2)
    run(manager, "old", list(range(9)), num_output=1)
    run(manager, "doomed", list(range(100, 109)), num_output=2)
    queue = manager.pool.free_queue
    lru = manager.pool.blocks[1]                      # cached, at the LRU tail
    queue.remove(lru)
    queue.push_front_n([lru])                         # jump the predicted-dead blocks
    with pytest.raises(InvariantViolation, match="predicted-dead"):
        manager.check_invariants()


def test_unknown_eviction_names_fail_clearly() -> None:
    with pytest.raises(ConfigError, match=r"unknown eviction policy; choose from .*predict"):
        parse_eviction(["predikt"])
    with pytest.raises(ConfigError, match="predikt"):
        parse_policies("latest+predikt+recompute")
    config = CacheConfig.from_layers([FullAttentionSpec(4, 1)], 10)
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        KVCacheManager(config, "latest+scan+predictt")
    assert KVCacheManager(config, "latest+scan+predict+recompute").policy_name == \
        "latest+scan+predict+recompute"
    assert parse_eviction(["predict", "scan", "chain"]).name == "scan+chain+predict"


def test_without_a_full_attention_group_predict_never_predicts() -> None:
    config = CacheConfig.from_layers([SlidingWindowSpec(4, 1, 5)], 20)
    manager = KVCacheManager(config, "dense", EvictionOptions(predict=True))
    assert policy_of(manager).predictor is None
    run(manager, "a", list(range(9)), num_output=2)
    assert policy_of(manager).num_predicted_dead == 0


def test_all_policies_reports_a_few_predict_variants() -> None:
    names = all_policies(has_sessions=False)
    predict = [n for n in names if "predict" in n]
    assert predict == ["prepend+scan+predict", "latest+predict+recompute",
                       "interval:32768+predict+recompute", "latest+scan+predict+recompute"]
    assert len(names) == 20
    assert predictor_of(full_only(20, EvictionOptions(predict=True))).horizon == 9
