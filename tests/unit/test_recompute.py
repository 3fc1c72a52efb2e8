"""Window-recompute plans (``+recompute``): what the lookup returns and what gets cached."""

from __future__ import annotations

from hybridkv import (
    CacheConfig,
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
)

# 2 full-attention layers (bs 8) + 2 window layers (bs 4, w 5 -> 1 tail block).
# Bridge = 2 window layers x (5 - 1) = 8 tokens (already a multiple of the alignment 8).
LAYERS = [FullAttentionSpec(8, 1)] * 2 + [SlidingWindowSpec(4, 1, 5)] * 2


def manager(policy: str, num_blocks: int = 80) -> KVCacheManager:
    return KVCacheManager(CacheConfig.from_layers(LAYERS, num_blocks), policy)


def fill(m: KVCacheManager, req_id: str, tokens: list[int]) -> None:
    m.add_request(req_id, tokens)
    hit = m.find_longest_hit(req_id)
    assert m.allocate_slots(req_id, len(tokens) - hit.num_tokens, hit) is not None
    m.remove_request(req_id)


A = list(range(41))  # latest retains the window tail at 40 - 1 -> 32 (block 7)


def diverging_at(position: int, length: int = 41) -> list[int]:
    return A[:position] + [1000 + i for i in range(length - position)]


def test_bridge_length_is_window_layers_times_w_minus_1() -> None:
    assert manager("latest+recompute").coordinator.bridge_tokens == 8


def test_cold_bridge_plan() -> None:
    m = manager("latest+recompute")
    fill(m, "a", A)
    m.add_request("b", diverging_at(27))  # full attention matches 3 blocks = 24 tokens
    hit = m.find_longest_hit("b")
    # no retained tail at 24 (latest kept only 32): ordinary hit 0 -> bridge [16, 24)
    assert (hit.num_tokens, hit.full_attention_tokens, hit.is_window_missing) == (16, 24, True)
    assert hit.num_bridge_tokens == 8
    assert len(hit.blocks[0]) == 3 and all(b.block_hash is not None for b in hit.blocks[0])
    assert [b.block_id for b in hit.blocks[1]] == [0, 0, 0, 0]
    # without +recompute the same lookup finds nothing
    plain = manager("latest")
    fill(plain, "a", A)
    plain.add_request("b", diverging_at(27))
    assert plain.find_longest_hit("b").num_tokens == 0


def test_cold_bridge_caches_only_the_exact_tail_and_the_next_request_hits_there() -> None:
    m = manager("latest+recompute")
    fill(m, "a", A)
    b_tokens = diverging_at(27)
    m.add_request("b", b_tokens)
    hit = m.find_longest_hit("b")
    allocation = m.allocate_slots("b", len(b_tokens) - hit.num_tokens, hit)
    assert allocation is not None and allocation.num_computed_tokens == 16
    plan = m.prefill_plan("b")
    assert (plan.full_attention_cached_tokens, plan.window_floor_tokens) == (24, 16)
    window_table = m.coordinator.managers[1].tables["b"]
    # block 4 = tokens [16, 20) is bridge KV with an incomplete window: never hashed;
    # block 5 = [20, 24) is the tail at the junction 24: exact, retained by `latest`
    assert window_table[4].block_hash is None and window_table[5].block_hash is not None
    assert m.stats.hits == 16 and m.stats.bridge_tokens == 8
    m.remove_request("b")
    m.check_invariants()
    # a third request sharing the first 24 tokens gets an ordinary hit at 24
    m.add_request("c", diverging_at(26))
    hit_c = m.find_longest_hit("c")
    assert (hit_c.num_tokens, hit_c.full_attention_tokens) == (24, 24)
    assert not hit_c.is_window_missing


def test_bridge_from_zero_and_from_a_retained_tail() -> None:
    m = manager("latest+recompute")
    fill(m, "a", A)
    m.add_request("short", diverging_at(10))  # full attention matches 8 tokens <= bridge
    hit = m.find_longest_hit("short")
    assert (hit.num_tokens, hit.full_attention_tokens, hit.is_window_missing) == (0, 8, False)
    # interval:16 retains tails at 16 and 32; a match to 24 bridges [16, 24) warm
    m2 = manager("interval:16+recompute")
    fill(m2, "a", A)
    m2.add_request("b", diverging_at(27))
    warm = m2.find_longest_hit("b")
    assert (warm.num_tokens, warm.full_attention_tokens, warm.is_window_missing) == (16, 24,
                                                                                   False)
    assert warm.blocks[1][3].block_hash is not None  # the retained tail block [12, 16)


def test_recompute_is_off_for_chunked_local_models() -> None:
    layers = [FullAttentionSpec(4, 1), ChunkedLocalSpec(4, 1, 8)]
    m = KVCacheManager(CacheConfig.from_layers(layers, 60), "latest+recompute")
    assert m.coordinator.bridge_tokens is None
    fill(m, "a", list(range(33)))
    m.add_request("b", list(range(17)) + [999] * 8)
    hit = m.find_longest_hit("b")
    assert hit.full_attention_tokens == hit.num_tokens


def test_policy_name_and_plain_hits_unchanged() -> None:
    m = manager("interval:16+scan+recompute")
    assert m.policy_name == "interval:16+scan+recompute"
    fill(m, "a", A)
    m.add_request("same", A)
    hit = m.find_longest_hit("same")
    assert hit.num_tokens == hit.full_attention_tokens == 40
