"""``ckpt:branch``: sub-block hits for recurrent hybrids (branch points, snapshots,
copy-on-write), and that the vLLM-equivalent policies are untouched by it."""

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
from hybridkv.branch import BlockCopy
from hybridkv.sim.replay import replay
from hybridkv.traces.workloads import make_workload

BS = 8
SYSTEM = list(range(100, 112))  # a 12-token shared prefix: inside the second block
# A snapshot is taken where a prompt leaves the seen ones only once an earlier prompt left
# there too: the tests run a second prompt "a2" that leaves "a" after SYSTEM first.


def make(policy: str = "latest+ckpt:branch:2", num_blocks: int = 64) -> KVCacheManager:
    layers = [FullAttentionSpec(BS, 8), RecurrentStateSpec(BS, 32), RecurrentStateSpec(BS, 32)]
    return KVCacheManager(CacheConfig.from_layers(layers, num_blocks), policy)


def run_prompt(m: KVCacheManager, req_id: str, tokens: list[int]) -> int:
    """Admit and prefill ``tokens`` in aligned chunks, one step each; return the hit."""
    m.add_request(req_id, tokens)
    m.new_step()
    hit = m.find_longest_hit(req_id)
    computed = hit.num_tokens
    first = True
    while computed < len(tokens):
        n = m.align_prefill_chunk(req_id, len(tokens) - computed, hit if first else None)
        assert n > 0
        assert m.allocate_slots(req_id, n, hit if first else None) is not None
        first = False
        computed += n
        m.check_invariants()
        m.new_step()
    return hit.num_tokens


def test_prompts_shorter_than_a_block_hit_at_the_branch_point() -> None:
    m = make()
    assert m.config.hash_block_size == 2 and m.config.alignment_tokens == BS
    assert run_prompt(m, "a", [*SYSTEM, 1, 2, 3]) == 0
    run_prompt(m, "a2", [*SYSTEM, 6, 6, 6])  # leaves a at 12: a branch point
    # b shares 12 tokens with a (seen): its first chunk stops at the branch point
    m.add_request("b", [*SYSTEM, 4, 5])
    m.new_step()
    hit = m.find_longest_hit("b")
    # (a's chunk ended at its block-floored replay boundary 8: a checkpoint there)
    assert hit.num_tokens == 8 and hit.junction_tokens == 12
    assert m.align_prefill_chunk("b", 6, hit) == 4
    assert m.allocate_slots("b", 4, hit) is not None
    copies = m.take_block_copies()
    fa_src = m.coordinator.managers[0].tables["b"][1]
    assert [(c.group_id, c.num_tokens, c.after_forward) for c in copies] == \
        [(0, 12, True), (1, 12, True), (2, 12, True)]
    assert copies[0].src_block_id == fa_src.block_id  # the block holding [8, 12)
    snapshots = [c.dst_block_id for c in copies]
    m.new_step()
    assert m.allocate_slots("b", 2) is not None
    m.new_step()
    # c hits 12 tokens: full attention [copy of the snapshot], recurrent [null, copy]
    m.add_request("c", [*SYSTEM, 7, 7, 7])
    hit = m.find_longest_hit("c")
    assert hit.num_tokens == 12
    assert [t[-1].block_id for t in hit.blocks] == snapshots
    assert [len(t) for t in hit.blocks] == [2, 2, 2]
    free_before = m.num_free_blocks
    assert m.allocate_slots("c", 3, hit) is not None
    copies = m.take_block_copies()
    assert [(c.src_block_id, c.num_tokens, c.after_forward) for c in copies] == \
        [(s, 12, False) for s in snapshots]
    tables = m.get_block_ids("c")
    assert [c.dst_block_id for c in copies] == [t[1] for t in tables]
    assert all(t[1] not in snapshots for t in tables)  # private copies, never shared
    assert free_before - m.num_free_blocks == 3 + 3  # snapshots and their copies (b holds
    # the full-attention block 0; the copies cover tokens [12, 15))
    m.check_invariants()
    assert m.coordinator.branch is not None and m.coordinator.branch.num_partial_hits == 1


def test_a_prompt_that_fills_the_block_leaves_a_three_block_snapshot() -> None:
    """b's prompt runs past the end of block 1 (tokens [8, 16)): the branch point at 12
    costs one block per recurrent group and an alias of b's block 1; c's hit copies the
    KV of [8, 12) out of that block once it is cached (not in the step hashing it)."""
    m = make()
    run_prompt(m, "a", [*SYSTEM, 1, 2, 3])
    run_prompt(m, "a2", [*SYSTEM, 6, 6, 6])  # leaves a at 12: a branch point
    m.add_request("b", [*SYSTEM, *[4] * 8])  # 20 tokens
    m.new_step()
    hit = m.find_longest_hit("b")
    assert (hit.num_tokens, hit.junction_tokens) == (8, 12)
    free_before = m.num_free_blocks
    assert m.allocate_slots("b", m.align_prefill_chunk("b", 12, hit), hit) is not None
    copies = m.take_block_copies()
    assert [(c.group_id, c.num_tokens, c.after_forward) for c in copies] == \
        [(1, 12, True), (2, 12, True)]  # no full-attention snapshot block
    assert free_before - m.num_free_blocks == 2 + 2 + 1  # b's blocks, 2 snapshots
    branch = m.coordinator.branch
    assert branch is not None and len(branch.aliases) == 1
    m.new_step()
    assert m.allocate_slots("b", 8) is not None  # [12, 20): block 1 full, hashed now
    b_block1 = m.coordinator.managers[0].tables["b"][1]
    assert b_block1.block_hash is not None
    m.add_request("c", [*SYSTEM, 7, 7, 7])
    hit = m.find_longest_hit("c")
    assert hit.num_tokens == 12 and hit.blocks[0][-1].block_id == b_block1.block_id
    assert m.allocate_slots("c", 3, hit) is None  # b's block 1 was hashed this step
    m.new_step()
    hit = m.find_longest_hit("c")
    assert m.allocate_slots("c", 3, hit) is not None
    copies = m.take_block_copies()
    assert [(c.group_id, c.num_tokens, c.after_forward) for c in copies] == \
        [(0, 12, False), (1, 12, False), (2, 12, False)]
    assert copies[0].src_block_id == b_block1.block_id
    assert m.get_block_ids("c")[0][1] != b_block1.block_id  # a private copy
    m.check_invariants()


def test_a_snapshot_of_this_step_defers_the_admission() -> None:
    m = make()
    run_prompt(m, "a", [*SYSTEM, 1, 2, 3])
    run_prompt(m, "a2", [*SYSTEM, 6, 6, 6])  # leaves a at 12: a branch point
    m.add_request("b", [*SYSTEM, 4, 5])
    m.new_step()
    hit = m.find_longest_hit("b")
    assert m.allocate_slots("b", m.align_prefill_chunk("b", 14, hit), hit) is not None
    m.add_request("c", [*SYSTEM, 6, 6, 6])
    hit = m.find_longest_hit("c")  # b's snapshot exists only after this step's forward
    assert hit.num_tokens == 12
    assert m.allocate_slots("c", 3, hit) is None
    m.new_step()
    hit = m.find_longest_hit("c")
    assert m.allocate_slots("c", 3, hit) is not None


def test_the_replay_boundary_stays_block_floored() -> None:
    """Only branch points get snapshots: a resend hits vLLM's block-floored checkpoint."""
    for policy in ("latest+ckpt:branch:2", "latest"):
        m = make(policy)
        prompt = [*SYSTEM, 1, 2]  # 14 tokens: replay boundary 13 → block floor 8
        run_prompt(m, "a", prompt)
        m.add_request("b", [*prompt[:13], 9])
        assert m.find_longest_hit("b").num_tokens == 8


def test_vllm_equivalent_policies_ignore_the_branch_machinery() -> None:
    m = make("latest")
    assert m.coordinator.branch is None and m.config.hash_block_size == BS
    assert run_prompt(m, "a", [*SYSTEM, 1, 2, 3]) == 0
    assert run_prompt(m, "b", [*SYSTEM, 4, 5]) == 8  # a's chunk ended at 8 (replay
    assert run_prompt(m, "c", [*SYSTEM, 7, 7, 7]) == 8  # boundary): floored to the block
    assert m.take_block_copies() == []


@pytest.mark.parametrize(("layers", "policy", "field"), [
    ([FullAttentionSpec(BS, 8), SlidingWindowSpec(BS, 8, 4)], "latest+ckpt:branch",
     "policy"),
    ([FullAttentionSpec(BS, 8), RecurrentStateSpec(BS, 8)], "latest+ckpt:branch:3",
     "policy"),
    ([FullAttentionSpec(BS, 8), RecurrentStateSpec(BS, 8)], "latest+ckpt:branch:x",
     "policy"),
])
def test_unsuitable_models_and_units_are_refused(layers: list[object], policy: str,
                                                 field: str) -> None:
    config = CacheConfig.from_layers(layers, 16)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as err:
        KVCacheManager(config, policy)
    assert err.value.field == field


def test_eagle_lookahead_hashes_at_the_hit_unit() -> None:
    """EAGLE as vLLM 0.33 sets it up by default: each 2-token unit hash also covers the
    token after the unit (the drafter KV of the unit's last slot was computed from it).
    a and b diverge at token 12, so the unit ``[10, 12)`` is hashed with different next
    tokens: the branch point is 10, one unit lower than without EAGLE (12)."""
    layers = [FullAttentionSpec(BS, 8), RecurrentStateSpec(BS, 32), RecurrentStateSpec(BS, 32)]
    m = KVCacheManager(CacheConfig.from_layers(layers, 64, use_eagle=True),
                       "latest+ckpt:branch:2")
    assert m.config.hash_lookahead_tokens == 1 and m.hasher.lookahead_tokens == 1
    assert run_prompt(m, "a", [*SYSTEM, 1, 2, 3]) == 0
    run_prompt(m, "a2", [*SYSTEM, 6, 6, 6])  # leaves a at 12: a branch point
    m.add_request("b", [*SYSTEM, 4, 5])
    m.new_step()
    hit = m.find_longest_hit("b")
    assert (hit.num_tokens, hit.junction_tokens) == (8, 10)
    assert m.align_prefill_chunk("b", 6, hit) == 2
    assert m.allocate_slots("b", 2, hit) is not None
    assert [(c.group_id, c.num_tokens, c.after_forward) for c in m.take_block_copies()] \
        == [(0, 10, True), (1, 10, True), (2, 10, True)]
    m.new_step()
    assert m.allocate_slots("b", 4) is not None
    m.new_step()
    m.add_request("c", [*SYSTEM, 7, 7, 7])         # shares [0, 12): hits the snapshot
    assert m.find_longest_hit("c").num_tokens == 10
    m.add_request("d", [*SYSTEM[:11], 9, 9, 9])    # shares [0, 11): token 10 matches
    assert m.find_longest_hit("d").num_tokens == 10
    m.add_request("e", [*SYSTEM[:10], 9, 9, 9])    # diverges at 10: the drafter KV of
    assert m.find_longest_hit("e").num_tokens == 8  # slot 9 saw another token


def test_eagle_drop_mode_is_refused() -> None:
    config = CacheConfig.from_layers([FullAttentionSpec(BS, 8), RecurrentStateSpec(BS, 8)],
                                     16, use_eagle=True, eagle_block_drop=True)
    with pytest.raises(ConfigError, match="lookahead block hashes only"):
        KVCacheManager(config, "latest+ckpt:branch")


def test_prefix_match_unit_must_divide_the_blocks() -> None:
    with pytest.raises(ConfigError):
        CacheConfig.from_layers([FullAttentionSpec(BS, 8)], 16, prefix_match_unit=3)


def test_short_prompts_workload_hits_only_with_branch() -> None:
    trace = make_workload("short-prompts", num_prompts=24, system_tokens=40,
                          min_user_tokens=4, max_user_tokens=30)
    layers = [FullAttentionSpec(96, 8)] + [RecurrentStateSpec(96, 32)] * 3
    config = CacheConfig.from_layers(layers, 200)
    plain = replay(trace, config, "latest")
    branch = replay(trace, config, "latest+ckpt:branch")
    assert plain.hit_rate == 0.0
    assert branch.hit_rate > 0.4


def test_block_copy_is_a_value() -> None:
    copy = BlockCopy(0, 1, 2, 12, True)  # type: ignore[arg-type]
    assert copy == BlockCopy(0, 1, 2, 12, True)  # type: ignore[arg-type]


def test_a_one_off_divergence_takes_no_snapshot() -> None:
    """b leaves a at 12, where no prompt left before: no snapshot (an agentic turn that
    drops the previous prompt's last tokens would pay 3 blocks a turn for nothing); c
    leaves there too: now it is a branch point, c's first chunk stops there and a
    snapshot is taken."""
    m = make()
    run_prompt(m, "a", [*SYSTEM, 1, 2, 3])
    m.add_request("b", [*SYSTEM, 4, 5])
    hit = m.find_longest_hit("b")
    assert (hit.num_tokens, hit.junction_tokens) == (8, 0)
    assert m.allocate_slots("b", m.align_prefill_chunk("b", 6, hit), hit) is not None
    assert m.take_block_copies() == []
    m.new_step()
    m.add_request("c", [*SYSTEM, 7, 7, 7])
    hit = m.find_longest_hit("c")
    assert (hit.num_tokens, hit.junction_tokens) == (8, 12)
    assert m.allocate_slots("c", m.align_prefill_chunk("c", 7, hit), hit) is not None
    assert [c.num_tokens for c in m.take_block_copies()] == [12, 12, 12]
