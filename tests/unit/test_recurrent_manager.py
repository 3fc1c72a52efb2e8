"""Recurrent-state groups: checkpoint tables (vLLM 0.33 "align"), hits, release, retention,
chunk alignment, page math and the qwen3.5-27b preset."""

from __future__ import annotations

import pytest

from hybridkv import (
    CacheConfig,
    ConfigError,
    FullAttentionSpec,
    KVCacheManager,
    RecurrentStateSpec,
)
from hybridkv.managers import MANAGER_FOR_SPEC, RecurrentStateManager
from hybridkv.managers.recurrent import align_recurrent_chunk
from hybridkv.models.shapes import load_model, parse_model
from hybridkv.recurrent import align_hybrid_block_size, gated_delta_net_state_bytes

BS = 4


def make(policy: str = "prepend", num_blocks: int = 64) -> KVCacheManager:
    layers = [FullAttentionSpec(BS, 8), RecurrentStateSpec(BS, 32)]
    return KVCacheManager(CacheConfig.from_layers(layers, num_blocks), policy)


def recurrent_table(m: KVCacheManager, req_id: str) -> list[int]:
    return list(m.get_block_ids(req_id)[1])


def test_spec_is_registered_and_validated() -> None:
    assert MANAGER_FOR_SPEC[RecurrentStateSpec] is RecurrentStateManager
    with pytest.raises(ConfigError):
        RecurrentStateSpec(block_size=4, state_bytes=0)
    assert RecurrentStateSpec(4, 100).num_skipped_tokens(0) == 0


def test_table_index_i_holds_the_state_after_i_plus_one_blocks() -> None:
    m = make()
    m.add_request("a", list(range(20)))
    m.new_step()
    m.allocate_slots("a", 12)  # one chunk [0, 12): only the state at 12 exists
    table = recurrent_table(m, "a")
    assert table[:2] == [0, 0] and table[2] != 0 and len(table) == 3
    block = m.coordinator.managers[1].tables["a"][2]
    assert block.block_hash == m._requests["a"].block_hashes[2]  # hash of 12 tokens
    # a later request sharing 14 tokens hits exactly that checkpoint
    m.add_request("b", list(range(14)) + [99] * 6)
    m.new_step()
    hit = m.find_longest_hit("b")
    assert hit.num_tokens == 12
    assert [b.block_id for b in hit.blocks[1]] == [0, 0, table[2]]


def test_hit_on_a_checkpoint_hashed_this_step_waits_for_the_next_step() -> None:
    m = make()
    m.add_request("a", list(range(20)))
    m.new_step()
    m.allocate_slots("a", 12)
    m.add_request("b", [*list(range(16)), 7])
    hit = m.find_longest_hit("b")
    assert hit.num_tokens == 12
    assert m.allocate_slots("b", 5, hit) is None  # state at 12 not written yet
    m.new_step()
    hit = m.find_longest_hit("b")
    assert m.allocate_slots("b", 5, hit) is not None


def test_states_no_longer_needed_are_released_and_stay_cached() -> None:
    m = make()
    m.add_request("a", list(range(30)))
    m.new_step()
    m.allocate_slots("a", 8)                          # state at 8 in index 1
    first = recurrent_table(m, "a")[1]
    m.new_step()
    m.allocate_slots("a", 8)                          # [8, 16): state at 16 in index 3
    assert recurrent_table(m, "a")[1] == first        # still the source of this step
    m.new_step()
    m.allocate_slots("a", 4)                          # [16, 20)
    table = recurrent_table(m, "a")
    assert table[1] == 0 and table[3] != 0 and table[4] != 0  # source and target
    m.new_step()
    m.allocate_slots("a", 1)                          # [20, 21): copied from 4 into 5
    table = recurrent_table(m, "a")
    assert table[3] == 0 and [b for b in table if b] == [table[4], table[5]]
    m.new_step()
    m.allocate_slots("a", 1)                          # [21, 22): index 5 updated in place
    table = recurrent_table(m, "a")
    assert [b for b in table if b] == [table[5]]
    pool = m.pool
    assert pool.blocks[first].ref_count == 0 and pool.blocks[first].block_hash is not None
    m.check_invariants()


def test_a_chunk_crossing_a_boundary_does_not_hash_a_state_written_mid_block() -> None:
    m = make()
    m.add_request("a", list(range(30)))
    m.new_step()
    m.allocate_slots("a", 6)            # state at 6 in index 1 (not a checkpoint)
    m.new_step()
    m.allocate_slots("a", 6)            # [6, 12): index 1 still holds the state at 6
    blocks = m.coordinator.managers[1].tables["a"]
    assert blocks[1].block_hash is None
    assert blocks[2].block_hash is not None  # the state at 12
    m.add_request("b", [*list(range(10)), 5, 5])
    m.new_step()
    assert m.find_longest_hit("b").num_tokens == 0  # no checkpoint at 8


@pytest.mark.parametrize(("policy", "expected"), [
    ("prepend", [8, 16, 24]), ("latest", [24]), ("interval:16", [16, 24])])
def test_retention_policies_choose_which_checkpoints_are_hashed(
        policy: str, expected: list[int]) -> None:
    m = make(policy)
    m.add_request("a", list(range(26)))
    for _ in range(3):
        m.new_step()
        m.allocate_slots("a", 8)       # chunk ends 8, 16, 24 (24: replay boundary of 26)
    hashed = [(i + 1) * BS for i, b in enumerate(m.coordinator.managers[1].tables["a"])
              if b.block_hash is not None]
    released = [(b.block_id, b.block_hash) for b in m.pool.blocks
                if b.ref_count == 0 and b.block_hash is not None and b.hash_group_id == 1]
    ends = sorted(hashed + [
        (m._requests["a"].block_hashes.index(h) + 1) * BS for _, h in released])
    assert ends == expected


def test_chunk_alignment_matches_vllm_split() -> None:
    kw = dict(num_tokens=2000, num_prompt_tokens=2000, block_size=784, max_chunk_tokens=8192)
    assert align_recurrent_chunk(0, 2000, junction_tokens=0, **kw) == 1568
    assert align_recurrent_chunk(0, 2000, junction_tokens=900, **kw) == 784  # junction floor
    assert align_recurrent_chunk(1000, 1000, junction_tokens=0, **kw) == 568  # next boundary
    assert align_recurrent_chunk(0, 1000, junction_tokens=0, **kw) == 784  # floored
    assert align_recurrent_chunk(1999, 1, junction_tokens=0, **kw) == 1  # decode untouched
    # a model without recurrent groups is never clipped
    m = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 16))
    m.add_request("a", list(range(10)))
    assert m.align_prefill_chunk("a", 7) == 7


def test_block_size_unification_and_qwen35_preset() -> None:
    state = gated_delta_net_state_bytes(num_k_heads=16, num_v_heads=48, head_k_dim=128,
                                        head_v_dim=128, conv_kernel=4, conv_dtype_bytes=2,
                                        ssm_dtype_bytes=4)
    assert align_hybrid_block_size(attn_bytes_per_token=4096, state_bytes=state) == 784
    # the given attention block is a lower bound and sets the kernel alignment
    assert align_hybrid_block_size(attn_bytes_per_token=4096, state_bytes=state,
                                   min_block_size=64) == 832
    shape = load_model("qwen3.5-27b")
    config = shape.cache_config(10)
    assert [(g.spec.kind, g.spec.block_size, len(g.layer_ids)) for g in config.groups] == \
        [("full_attention", 784, 16)] + [("recurrent_state", 784, 16)] * 3
    assert config.bytes_per_block == 16 * 784 * 4096


def test_model_file_errors_name_the_field() -> None:
    base = 'block_size = 16\ndtype_bytes = 2\nnum_kv_heads = 1\nhead_dim = 8\n'
    with pytest.raises(ConfigError, match="mixer"):
        parse_model(base + '[[layers]]\nkind = "recurrent_state"\n')
    with pytest.raises(ConfigError, match="only recurrent_state"):
        parse_model(base + '[[layers]]\nkind = "full_attention"\nstate_size = 4\n')
    with pytest.raises(ConfigError, match="not both"):
        parse_model(base + '[[layers]]\nkind = "recurrent_state"\nstate_bytes = 5\n'
                    'mixer = "mamba"\nintermediate_size = 4\nstate_size = 4\n'
                    'conv_kernel = 4\n')
    shape = parse_model(base + '[[layers]]\nkind = "full_attention"\n[[layers]]\n'
                        'kind = "recurrent_state"\nstate_bytes = 1000\n')
    assert {s.block_size for s in shape.layers} == {32}  # 16 * ceil(1000 / (16 * 32))
    kept = parse_model(base + 'unify_block_size = false\n[[layers]]\n'
                       'kind = "full_attention"\n[[layers]]\nkind = "recurrent_state"\n'
                       'state_bytes = 1000\n')
    assert {s.block_size for s in kept.layers} == {16}


@pytest.mark.parametrize(("name", "block_size", "groups", "bytes_per_block"), [
    # unified block = 16 * ceil(checkpoint / (16 * attention bytes per token)), see the files
    ("qwen3.5-27b", 784, [("full_attention", 16)] + [("recurrent_state", 16)] * 3,
     16 * 784 * 4096),
    ("qwen3-next-80b", 544, [("full_attention", 12)] + [("recurrent_state", 12)] * 3,
     12 * 544 * 2048),
    ("nemotron-h-56b", 2080,
     [("full_attention", 10)] + [("recurrent_state", 10)] * 5 + [("recurrent_state", 4)],
     10 * 2080 * 4096),
    ("nemotron-3-nano", 2096,
     [("full_attention", 6)] + [("recurrent_state", 6)] * 3 + [("recurrent_state", 5)],
     6 * 2096 * 1024),
    ("jamba-v0.1", 80, [("full_attention", 4)] + [("recurrent_state", 4)] * 7, 4 * 80 * 4096),
])
def test_recurrent_presets(name: str, block_size: int, groups: list[tuple[str, int]],
                           bytes_per_block: int) -> None:
    config = load_model(name).cache_config(10)
    assert {g.spec.block_size for g in config.groups} == {block_size}
    assert [(g.spec.kind, len(g.layer_ids)) for g in config.groups] == groups
    assert config.bytes_per_block == bytes_per_block
    states = {g.spec.page_bytes for g in config.groups if isinstance(g.spec, RecurrentStateSpec)}
    assert max(states) <= bytes_per_block // len(config.groups[0].layer_ids)


def test_block_checkpoints_keep_a_state_at_every_block_end_and_hit_there() -> None:
    layers = [FullAttentionSpec(BS, 8), RecurrentStateSpec(BS, 32)]
    m = KVCacheManager(CacheConfig.from_layers(layers, 64), "prepend+ckpt:block")
    assert m.policy_name == "prepend+ckpt:block"
    m.add_request("a", list(range(30)))
    assert m.align_prefill_chunk("a", 30) == 30  # chunks are not clipped
    m.new_step()
    m.allocate_slots("a", 14)           # one chunk: states at 4, 8, 12 and 14
    blocks = m.coordinator.managers[1].tables["a"]
    assert [b.block_hash is not None for b in blocks] == [True, True, True, False]
    m.add_request("b", list(range(10)) + [7] * 5)
    m.new_step()
    hit = m.find_longest_hit("b")
    assert hit.num_tokens == 8 and hit.blocks[1][-1].block_id == blocks[1].block_id
    m.new_step()
    m.allocate_slots("a", 2)            # [14, 16): the block of 12..16 gets the state at 16
    assert blocks[3].block_hash is not None
    m.check_invariants()
    with pytest.raises(ConfigError, match="checkpoint policy"):
        KVCacheManager(CacheConfig.from_layers(layers, 64), "prepend+ckpt:sometimes")
