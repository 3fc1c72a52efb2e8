"""KVCacheManager end to end: the worked numbers of vllm-kv-cache.md (§3.5.5 retention table,
pure SWA, tail-only mask, lcm clamp, EAGLE caching, §3.7 free-queue orders, admission cap,
pin:T) and the request lifecycle (decode, reuse, refusal, stats).

Policy names vs vLLM 0.33 ``prefix_cache_retention_interval`` R: R=None → ``prepend`` (the
``reachable`` mask + prepend free order), R=0 → ``latest``, R=N → ``interval:N``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hybridkv import (
    CacheConfig,
    ExtraKeys,
    FullAttentionSpec,
    KVCacheManager,
    MultiModalFeature,
    SlidingWindowSpec,
)
from hybridkv.pool import FreeTier

FULL32 = FullAttentionSpec(32, 1)
SWA8 = SlidingWindowSpec(8, 1, 8)  # need 1 tail block; with FULL32: S = A = 32


def build(layers: Sequence[object], num_blocks: int, policy: str = "prepend",
          **options: object) -> KVCacheManager:
    config = CacheConfig.from_layers(layers, num_blocks, **options)  # type: ignore[arg-type]
    return KVCacheManager(config, policy)


def prefill(manager: KVCacheManager, req_id: str, tokens: Sequence[int],
            extra_keys: ExtraKeys | None = None) -> int:
    """Admit and compute the whole prompt in one step; returns the hit length."""
    manager.add_request(req_id, tokens, extra_keys=extra_keys)
    hit = manager.find_longest_hit(req_id)
    assert manager.allocate_slots(req_id, len(tokens) - hit.num_tokens, hit) is not None
    manager.check_invariants()
    return hit.num_tokens


def hashed(manager: KVCacheManager, group_id: int, req_id: str) -> set[int]:
    table = manager.coordinator.managers[group_id].tables[req_id]
    return {i for i, b in enumerate(table) if b.block_hash is not None}


def distinct_blocks(num_tokens: int, bs: int = 8) -> list[int]:
    """Token i = i // bs: every block of ``bs`` tokens is distinct (the doc's prompts)."""
    return [i // bs for i in range(num_tokens)]


# ------------------------------------------------------ tail-only mask and clamp
@pytest.mark.parametrize(("policy", "expected"), [
    ("reachable", {3, 7}), ("prepend", {3, 7}), ("pin:64", {3, 7}),
    ("interval:64", {3, 7}),  # per 8 → block 7, plus the replay tail 63 → 32 → block 3
    ("latest", {3}),  # only the replay tail
    ("dense", set(range(8))),  # hash everything (pre-#42258)
])
def test_swa_tail_window_only(policy: str, expected: set[int]) -> None:
    """§6.1 item 40: full bs32 + SWA bs8 w8, 64 tokens → SWA hashes {3, 7} of blocks 0..7."""
    manager = build([FULL32, SWA8], 40, policy)
    prefill(manager, "r", distinct_blocks(64))
    assert hashed(manager, 1, "r") == expected
    assert hashed(manager, 0, "r") == {0, 1}


@pytest.mark.parametrize(("policy", "expected"), [
    ("reachable", set(range(6))), ("prepend", set(range(6))),  # need 2 ≥ per 2 → all
    ("latest", {4, 5}),  # 111 → 96 → end block 6 → tail 4, 5
    ("interval:64", {2, 3, 4, 5}),  # i % 4 ≥ 2 within the clamp, plus the replay tail
    ("dense", set(range(7))),  # dense does not clamp to the lcm
])
def test_cache_blocks_clamped_to_lcm(policy: str, expected: set[int]) -> None:
    """§6.1 item 41: full bs32 + SWA bs16 w32, 112 tokens: SWA 0–5 cached, 6 (past the last
    32 boundary) not; full attention caches its 3 full blocks."""
    manager = build([FULL32, SlidingWindowSpec(16, 1, 32)], 40, policy)
    prefill(manager, "r", distinct_blocks(112))
    assert hashed(manager, 1, "r") == expected
    assert hashed(manager, 0, "r") == {0, 1, 2}


def test_clamped_blocks_are_cached_by_later_steps() -> None:
    """Caching continues where it stopped: after 112 tokens SWA block 6 is not hashed; once a
    decode step reaches 128 it is (the request's own later steps)."""
    manager = build([FULL32, SlidingWindowSpec(16, 1, 32)], 40, "prepend")
    tokens = distinct_blocks(112)
    prefill(manager, "r", tokens)
    assert 6 not in hashed(manager, 1, "r")
    manager.append_token_ids("r", list(range(500, 516)))
    assert manager.allocate_slots("r", 16) is not None
    # skipped(112) = 81 tokens: blocks 0-4 left the window; 5, 6 and the new 7 are hashed
    assert manager.get_block_ids("r")[1][:5] == (0,) * 5
    assert hashed(manager, 1, "r") == {5, 6, 7}
    assert hashed(manager, 0, "r") == {0, 1, 2, 3}


# ------------------------------------------------ §3.5.5 retention table
RETENTION_ROWS = [
    # prompt, eagle, policy, SWA hashed, resend (hit, [full, swa], junction), ext (…)
    (128, False, "prepend", {3, 7, 11, 15}, (96, 0), (128, 0)),
    (128, False, "latest", {11}, (96, 0), (96, 128)),
    (128, False, "interval:64", {7, 11, 15}, (96, 0), (128, 0)),
    (128, True, "prepend", {3, 4, 7, 8, 11, 12, 15}, (96, 0), (96, 128)),
    (128, True, "latest", {7, 8, 11, 12}, (96, 0), (96, 128)),
    (128, True, "interval:64", {7, 8, 11, 12, 15}, (96, 0), (96, 128)),
    (127, False, "prepend", {3, 7, 11}, (96, 0), (96, 0)),
    (127, False, "latest", {11}, (96, 0), (96, 0)),
    (127, False, "interval:64", {7, 11}, (96, 0), (96, 0)),
    (127, True, "prepend", {3, 4, 7, 8, 11, 12}, (96, 0), (96, 0)),
    (127, True, "latest", {7, 8}, (64, 96), (64, 96)),
    (100, True, "prepend", {3, 4, 7, 8, 11}, (64, 96), (64, 96)),
]


@pytest.mark.parametrize(("prompt", "eagle", "policy", "swa_hashed", "resend", "ext"),
                         RETENTION_ROWS)
def test_retention_table(prompt: int, eagle: bool, policy: str, swa_hashed: set[int],
                         resend: tuple[int, int], ext: tuple[int, int]) -> None:
    """§3.5.5: full bs32 + SWA bs8 w8, token i = i // 8, request freed after prefill, then an
    identical resend and an extension by 40 tokens. EAGLE means only the SWA group is an
    EAGLE group (``eagle_group_ids=(1,)``). Table lengths are [hit / 32, hit / 8]."""
    options = {"use_eagle": True, "eagle_block_drop": True, "eagle_group_ids": (1,)} \
        if eagle else {}
    manager = build([FULL32, SWA8], 100, policy, **options)
    tokens = distinct_blocks(prompt)
    prefill(manager, "r", tokens)
    assert hashed(manager, 1, "r") == swa_hashed
    manager.free("r")
    manager.check_invariants()
    for req_id, request_tokens, (num_hit, junction) in (
        ("resend", tokens, resend),
        ("ext", [*tokens, *range(1000, 1040)], ext),
    ):
        manager.add_request(req_id, request_tokens)
        hit = manager.find_longest_hit(req_id)
        assert (hit.num_tokens, hit.junction_tokens) == (num_hit, junction), req_id
        assert [len(t) for t in hit.block_ids] == [num_hit // 32, num_hit // 8]
        assert all(b != 0 for b in hit.block_ids[0])
        if num_hit:  # the SWA tail (1 block) is real, everything before it is null
            assert hit.block_ids[1][-1] != 0 and set(hit.block_ids[1][:-1]) == {0}


def test_latest_only_reuses_the_replay_boundary() -> None:
    """§6.1 item 47 (R=0): after free the retained block 11 has ref 0 and is hittable; a
    96-token request (cap 95 → full attention 64, SWA block 7 not retained) hits 0."""
    manager = build([FULL32, SWA8], 100, "latest")
    tokens = distinct_blocks(128)
    prefill(manager, "r", tokens)
    retained = manager.coordinator.managers[1].tables["r"][11]
    manager.free("r")
    assert retained.ref_count == 0 and retained.block_hash is not None
    manager.add_request("short", tokens[:96])
    hit = manager.find_longest_hit("short")
    assert (hit.num_tokens, hit.junction_tokens) == (0, 64)
    manager.add_request("resend", tokens)
    hit = manager.find_longest_hit("resend")
    assert hit.num_tokens == 96 and hit.block_ids[1][11] == retained.block_id


def test_extension_sibling_pins_its_junction_for_later_requests() -> None:
    """§3.5.5 observation (a): under R=0 the extension of a block-aligned 128-token prompt
    hits 96 with junction 128; its own caching then keeps the SWA tail at 128, so a third
    request sharing 128+ tokens hits 128."""
    manager = build([FULL32, SWA8], 100, "latest")
    tokens = distinct_blocks(128)
    prefill(manager, "r", tokens)
    manager.free("r")
    ext = [*tokens, *range(1000, 1040)]
    assert prefill(manager, "ext", ext) == 96
    assert 15 in hashed(manager, 1, "ext")  # junction 128 → tail block 15
    manager.free("ext")
    manager.add_request("third", [*tokens, *range(2000, 2040)])
    assert manager.find_longest_hit("third").num_tokens == 128


# ------------------------------------------------------------------ pure SWA
@pytest.mark.parametrize(("policy", "expected"), [
    ("interval:64", {3, 7, 11, 14, 15}),
    ("latest", {14}),
    ("dense", set(range(16))),
    ("prepend", set(range(16))),
    ("reachable", set(range(16))),
])
def test_pure_swa_retention(policy: str, expected: set[int]) -> None:
    """§3.5.5 / §6.1 items 58–60: one SWA group bs16 w16 (A 16, need 1), 256 tokens,
    boundary 255 → 240 → block 14; resend hits 240 in every mode."""
    manager = build([SlidingWindowSpec(16, 1, 16)], 40, policy)
    tokens = distinct_blocks(256, 16)
    prefill(manager, "r", tokens)
    assert hashed(manager, 0, "r") == expected
    manager.free("r")
    manager.add_request("resend", tokens)
    hit = manager.find_longest_hit("resend")
    assert hit.num_tokens == 240
    assert hit.block_ids[0][:14] == (0,) * 14 and hit.block_ids[0][14] != 0


# ---------------------------------------------------------- EAGLE end to end
def test_eagle_full_attention_only() -> None:
    """§6.1 items 33–34, full attention bs16 with EAGLE drop.

    Like vLLM's unitary coordinator, a single group adds no EAGLE margin (the peek past the
    cap is a hybrid-coordinator feature, §4.2), so a resend of a cached 48-token prompt hits
    16 (cap 47 → 2 blocks → drop one). A 37-token prompt hits 16 too (2 matched − drop)."""
    manager = build([FullAttentionSpec(16, 1)], 20, use_eagle=True, eagle_block_drop=True)
    tokens = distinct_blocks(48, 16)
    prefill(manager, "a", tokens)
    manager.add_request("b", tokens)
    assert manager.find_longest_hit("b").num_tokens == 16
    manager.add_request("c", tokens[:37])
    prefill(manager, "c2", [*tokens[:32], 7, 7, 7, 7, 7])
    assert manager.find_longest_hit("c").num_tokens == 16


def test_eagle_pure_sliding_window() -> None:
    """§6.1 item 35: pure SWA w16 (need 1 + 1), 37 tokens: resend hits 16; once block 0's
    key is evicted: 0 (block 1 alone is no 2-block run and the leading run is empty)."""
    manager = build([SlidingWindowSpec(16, 1, 16)], 20, use_eagle=True, eagle_block_drop=True)
    tokens = distinct_blocks(37, 16)
    prefill(manager, "a", tokens)
    manager.add_request("b", tokens)
    assert manager.find_longest_hit("b").num_tokens == 16
    manager.pool._evict(manager.coordinator.managers[0].tables["a"][0])
    assert manager.find_longest_hit("b").num_tokens == 0


def test_eagle_swa_caches_post_boundary_block() -> None:
    """§6.1 items 36–37: full bs32 + SWA bs8 w8 (SWA is the EAGLE group). A 128-token prompt
    resend hits a positive multiple of 32; a 40-token prompt caches SWA blocks 3 and 4 (the
    block after the boundary) and prompt + 1 token hits 32."""
    manager = build([FULL32, SWA8], 60, use_eagle=True, eagle_block_drop=True, eagle_group_ids=(1,))
    tokens = distinct_blocks(128)
    prefill(manager, "a", tokens)
    manager.add_request("b", tokens)
    num_hit = manager.find_longest_hit("b").num_tokens
    assert num_hit > 0 and num_hit % 32 == 0
    manager = build([FULL32, SWA8], 60, use_eagle=True, eagle_block_drop=True, eagle_group_ids=(1,))
    tokens = distinct_blocks(40)
    prefill(manager, "a", tokens)
    assert hashed(manager, 1, "a") == {3, 4}
    manager.add_request("b", [*tokens, 999])
    assert manager.find_longest_hit("b").num_tokens == 32


# ------------------------------------------------------ §3.7 free-queue orders
def test_prefill_free_queue_order() -> None:
    """§6.1 item 1 (pool 11, bs16, one full group): req0 (3 full + 7) → [1,2,3,4]; req1
    (3 common + 5) hits [1,2,3] and gets [5]; after freeing both the queue is
    [5,4,6,7,8,9,10,3,2,1]; req2 hits [1,2,3] and reuses the prepended partial block 5;
    req3 (160 tokens of 99) misses and takes the blocks in eviction order."""
    manager = build([FullAttentionSpec(16, 1)], 11)
    common = distinct_blocks(48, 16)
    manager.add_request("0", [*common, *range(100, 107)])
    allocation = manager.allocate_slots("0", 55, manager.find_longest_hit("0"))
    assert allocation is not None and allocation.new_block_ids == ((1, 2, 3, 4),)
    table = manager.coordinator.managers[0].tables["0"]
    assert [b.block_hash is not None for b in table] == [True, True, True, False]
    manager.add_request("1", [*common, *range(200, 205)])
    hit = manager.find_longest_hit("1")
    assert hit.block_ids == ((1, 2, 3),) and hit.num_tokens == 48
    allocation = manager.allocate_slots("1", 5, hit)
    assert allocation is not None and allocation.new_block_ids == ((5,),)
    assert [b.ref_count for b in table[:3]] == [2, 2, 2]
    assert manager.num_free_blocks == 5
    manager.free("0")
    manager.free("1")
    assert manager.pool.free_block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    manager.add_request("2", [*common, *range(300, 305)])
    hit = manager.find_longest_hit("2")
    assert hit.block_ids == ((1, 2, 3),)
    allocation = manager.allocate_slots("2", 5, hit)
    assert allocation is not None and allocation.new_block_ids == ((5,),)
    assert manager.num_free_blocks == 6
    manager.free("2")
    manager.add_request("3", [99] * 160)
    hit = manager.find_longest_hit("3")
    assert hit.num_tokens == 0
    allocation = manager.allocate_slots("3", 160, hit)
    assert allocation is not None
    assert allocation.new_block_ids == ((5, 4, 6, 7, 8, 9, 10, 3, 2, 1),)
    assert manager.num_free_blocks == 0 and manager.pool.free_block_ids() == []
    manager.check_invariants()


@pytest.mark.parametrize(("policy", "order"), [
    ("dense", [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]),  # everything to the tail
    ("reachable", [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]),
    ("latest", [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]),
    ("interval:64", [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]),
    ("pin:64", [5, 4, 6, 7, 8, 9, 10]),  # hashed blocks 3, 2, 1 sit in the pinned tier
])
def test_prefill_free_queue_order_by_policy(policy: str, order: list[int]) -> None:
    manager = build([FullAttentionSpec(16, 1)], 11, policy)
    common = distinct_blocks(48, 16)
    prefill(manager, "0", [*common, *range(100, 107)])
    prefill(manager, "1", [*common, *range(200, 205)])
    manager.free("0")
    manager.free("1")
    assert manager.pool.free_block_ids() == order
    pinned = [b.block_id for b in manager.pool.pinned_queue]
    assert pinned == ([3, 2, 1] if policy.startswith("pin") else [])


def test_evict_free_queue_order() -> None:
    """§6.1 item 11: req0 87 tokens → 6 blocks, req1 48 → 3 blocks, 1 free; free(req0) →
    [6,10,5,4,3,2,1]; free(req1) → [6,10,5,4,3,2,1,9,8,7]; req2 (first 2 blocks + 3) hits
    [1,2] and gets [6]; 7 free."""
    manager = build([FullAttentionSpec(16, 1)], 11)
    tokens0 = distinct_blocks(87, 16)
    prefill(manager, "0", tokens0)
    prefill(manager, "1", [*range(1000, 1048)])
    assert manager.num_free_blocks == 1
    manager.free("0")
    assert manager.pool.free_block_ids() == [6, 10, 5, 4, 3, 2, 1]
    manager.free("1")
    assert manager.pool.free_block_ids() == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    manager.add_request("2", [*tokens0[:32], 7, 7, 7])
    hit = manager.find_longest_hit("2")
    assert hit.block_ids == ((1, 2),) and hit.num_tokens == 32
    allocation = manager.allocate_slots("2", 3, hit)
    assert allocation is not None and allocation.new_block_ids == ((6,),)
    assert manager.num_free_blocks == 7


def test_swa_free_split_keeps_cached_tail_behind_scratch() -> None:
    """§3.7 / §6.1 item 57 (R=None → prepend): full bs32 + SWA bs8 w8, 64 tokens: after free
    the queue is SWA scratch (newest first), untouched blocks, then hashed blocks (full 2, 1
    then SWA 10, 6); the hashed tails still hit."""
    manager = build([FULL32, SWA8], 20)
    tokens = list(range(64))
    prefill(manager, "r", tokens)
    assert manager.get_block_ids("r") == ((1, 2), (3, 4, 5, 6, 7, 8, 9, 10))
    manager.free("r")
    assert manager.pool.free_block_ids() == [9, 8, 7, 5, 4, 3, *range(11, 20), 2, 1, 10, 6]
    manager.add_request("again", [*tokens, 5])
    assert manager.find_longest_hit("again").num_tokens == 64


@pytest.mark.parametrize(("policy", "queue", "num_hit"), [
    ("prepend", [9, 8, 7, 5, 4, 3, 2, 1, 10, 6], 64),  # tails {3, 7} = ids 6, 10 survive
    ("latest", [10, 9, 8, 7, 5, 4, 3, 2, 1, 6], 32),  # only the replay tail (id 6) is kept
    ("reachable", None, 0),  # scratch is not put first: the old prefix is evicted
    ("dense", None, 0),
])
def test_scratch_first_protects_cached_tails(policy: str, queue: list[int] | None,
                                             num_hit: int) -> None:
    """Pool of exactly one 64-token request (full bs32 + SWA bs8 w8). After it is freed, a
    new request runs 40 tokens in steps of 8 (working set: 2 full + 2 SWA blocks, window
    blocks released as it goes). With scratch blocks first in the queue (prepend, latest)
    the new request lives off them and the old request's cached blocks still hit; with
    everything appended the new request's first allocations evict the old prefix."""
    manager = build([FULL32, SWA8], 11, policy)
    old = distinct_blocks(64)
    prefill(manager, "old", old)
    manager.free("old")
    if queue is not None:
        assert manager.pool.free_block_ids() == queue
    manager.add_request("new", list(range(500, 540)))
    assert manager.allocate_slots("new", 8, manager.find_longest_hit("new")) is not None
    for _ in range(4):
        assert manager.allocate_slots("new", 8) is not None
        manager.check_invariants()
    manager.add_request("again", [*old, 5])
    assert manager.find_longest_hit("again").num_tokens == num_hit


# -------------------------------------------------------------- admission cap
def test_admission_cap_admits_long_prompt() -> None:
    """§6.1 item 51: FA + SWA(w64), bs16, 128 in flight, max_len 1024, pool 78: a 512-token
    prompt passes ``reserve_full_prompt`` (SWA counts cdiv(191, 16) + 1 = 13 blocks;
    32 + 13 = 45 ≤ 77)."""
    manager = build([FullAttentionSpec(16, 1), SlidingWindowSpec(16, 1, 64)], 78,
                    max_num_batched_tokens=128, max_model_len=1024)
    manager.add_request("r", list(range(512)))
    allocation = manager.allocate_slots("r", 128, manager.find_longest_hit("r"),
                                        reserve_full_prompt=True)
    assert allocation is not None and [len(x) for x in allocation.new_block_ids] == [8, 8]


@pytest.mark.parametrize(("num_blocks", "admitted"), [(46, True), (45, False)])
def test_admission_cap_boundary(num_blocks: int, admitted: bool) -> None:
    """The gate needs 45 free blocks (32 full + 13 capped SWA); without the cap it would need
    64, so a pool of 46 (45 free) admitting proves the cap is applied."""
    manager = build([FullAttentionSpec(16, 1), SlidingWindowSpec(16, 1, 64)], num_blocks,
                    max_num_batched_tokens=128, max_model_len=1024)
    manager.add_request("r", list(range(512)))
    allocation = manager.allocate_slots("r", 128, manager.find_longest_hit("r"),
                                        reserve_full_prompt=True)
    assert (allocation is not None) is admitted
    assert manager.is_running("r") is admitted
    if not admitted:
        assert manager.num_free_blocks == num_blocks - 1
        assert manager.get_block_ids("r") == ((), ())
        # without the gate the first chunk alone fits
        assert manager.allocate_slots("r", 128, manager.find_longest_hit("r")) is not None


def test_full_attention_still_gates_oversized_prompt() -> None:
    """§6.1 item 52: pool 5, 256-token prompt → None."""
    manager = build([FullAttentionSpec(16, 1), SlidingWindowSpec(16, 1, 64)], 5,
                    max_num_batched_tokens=128, max_model_len=1024)
    manager.add_request("r", list(range(256)))
    assert manager.allocate_slots("r", 16, manager.find_longest_hit("r"),
                                  reserve_full_prompt=True) is None


# ----------------------------------------------------------------------- pin:T
def test_pinned_blocks_are_used_only_after_the_free_queue_is_empty() -> None:
    manager = build([FullAttentionSpec(4, 1)], 9, "pin:64")
    prefill(manager, "a", list(range(10)))  # blocks 1, 2 hashed, 3 partial
    manager.free("a")
    assert [b.block_id for b in manager.pool.pinned_queue] == [2, 1]
    assert manager.pool.free_block_ids() == [3, 4, 5, 6, 7, 8]
    assert manager.num_free_blocks == 8
    prefill(manager, "b", list(range(100, 124)))  # 6 blocks: the whole free queue
    assert manager.get_block_ids("b") == ((3, 4, 5, 6, 7, 8),)
    manager.add_request("again", list(range(10)))
    assert manager.find_longest_hit("again").num_tokens == 8  # pinned blocks still hit
    manager.add_request("c", list(range(200, 205)))
    allocation = manager.allocate_slots("c", 5, manager.find_longest_hit("c"))
    assert allocation is not None and allocation.new_block_ids == ((2, 1),)  # oldest first
    assert manager.find_longest_hit("again").num_tokens == 0
    manager.check_invariants()


def test_pool_full_of_pinned_blocks_still_admits() -> None:
    manager = build([FullAttentionSpec(4, 1)], 5, "pin:64")
    prefill(manager, "a", list(range(16)))  # 4 full blocks, all hashed
    manager.free("a")
    assert len(manager.pool.pinned_queue) == 4 and len(manager.pool.free_queue) == 0
    manager.add_request("b", list(range(100, 116)))
    allocation = manager.allocate_slots("b", 16, manager.find_longest_hit("b"),
                                        reserve_full_prompt=True)
    assert allocation is not None and allocation.new_block_ids == ((4, 3, 2, 1),)
    manager.check_invariants()


def test_pin_window_drops_pin_only_the_last_t_tokens() -> None:
    """A hashed SWA block leaving the window is pinned if it ends within the last T skipped
    tokens, else it goes to the queue tail; unhashed ones go to the head."""
    manager = build([SlidingWindowSpec(4, 1, 4)], 40, "pin:8")
    manager.add_request("r", list(range(40)))
    manager.allocate_slots("r", 32, manager.find_longest_hit("r"))
    table = list(manager.coordinator.managers[0].tables["r"])
    assert all(b.block_hash is not None for b in table)  # bs = A = 4, need 1 → all hashed
    manager.allocate_slots("r", 4)  # skipped(32) = 29 → blocks 0..6 released
    # ends 4..28; pinned iff end > 29 - 8 = 21 → blocks 5 (end 24) and 6 (end 28)
    assert [b.block_id for b in manager.pool.pinned_queue] == [table[6].block_id,
                                                               table[5].block_id]
    tail = manager.pool.free_block_ids()[-5:]
    assert tail == [table[i].block_id for i in (4, 3, 2, 1, 0)]
    assert manager.retention.drop_tier(table[6], 28, 29) is FreeTier.PINNED
    manager.check_invariants()


# ----------------------------------------------------------- request lifecycle
def test_decode_hashes_blocks_as_they_fill() -> None:
    """§6.1 item 10: a 55-token prompt → [1,2,3,4]; 4 decode tokens need no new block and
    the last block stays unhashed; 19 more → one new block, the old last block is hashed."""
    manager = build([FullAttentionSpec(16, 1)], 11)
    prefill(manager, "r", list(range(55)))
    table = manager.coordinator.managers[0].tables["r"]
    for token in range(4):
        manager.append_token_ids("r", [1000 + token])
        allocation = manager.allocate_slots("r", 1)
        assert allocation is not None and allocation.new_block_ids == ((),)
    assert table[3].block_hash is None
    new_ids: list[int] = []
    for token in range(19):
        manager.append_token_ids("r", [2000 + token])
        allocation = manager.allocate_slots("r", 1)
        assert allocation is not None
        new_ids.extend(allocation.new_block_ids[0])
    assert new_ids == [5]
    assert table[3].block_hash is not None and table[4].block_hash is None
    manager.check_invariants()


def test_lookahead_slots_are_allocated_but_never_cached() -> None:
    manager = build([FullAttentionSpec(4, 1)], 10)
    manager.add_request("r", list(range(8)))
    allocation = manager.allocate_slots("r", 8, manager.find_longest_hit("r"),
                                        num_lookahead_tokens=5)
    assert allocation is not None and len(allocation.new_block_ids[0]) == 4  # 13 slots
    assert hashed(manager, 0, "r") == {0, 1}


def test_reused_block_loses_its_hash() -> None:
    """§6.1 item 12: pool of 2 (1 usable): a cached full block reused by a 15-token request
    has its hash cleared (and counts as one eviction)."""
    manager = build([FullAttentionSpec(16, 1)], 2)
    prefill(manager, "a", list(range(16)))
    manager.free("a")
    block = manager.pool.blocks[1]
    assert block.block_hash is not None
    prefill(manager, "b", list(range(100, 115)))
    assert block.block_hash is None
    assert manager.stats.evicted_blocks_by_group == [1]


def test_computed_blocks_are_not_evicted_by_their_own_admission() -> None:
    """§6.1 item 13: pool 3: req0 → [1], req1 → [2], both freed; req2 (req0's block + more)
    hits block 1 and its new block is 2 (the other cached block), not the hit."""
    manager = build([FullAttentionSpec(16, 1)], 3)
    first = list(range(16))
    prefill(manager, "0", first)
    prefill(manager, "1", list(range(100, 116)))
    manager.free("0")
    manager.free("1")
    manager.add_request("2", [*first, *range(200, 216)])
    hit = manager.find_longest_hit("2")
    assert hit.block_ids == ((1,),)
    allocation = manager.allocate_slots("2", 16, hit)
    assert allocation is not None and allocation.new_block_ids == ((2,),)


def test_caching_disabled() -> None:
    """§6.1 item 14: bs4, caching off: 10 tokens → 3 blocks, 16 tokens → 4 blocks without a
    hit, then a 4-token request cannot allocate."""
    manager = build([FullAttentionSpec(4, 1)], 8, "dense", enable_caching=False)
    assert manager.retention.name == "prepend"  # freed blocks are all scratch
    assert prefill(manager, "a", list(range(10))) == 0
    assert manager.get_block_ids("a") == ((1, 2, 3),)
    assert prefill(manager, "b", list(range(16))) == 0
    assert manager.get_block_ids("b") == ((4, 5, 6, 7),)
    assert all(b.block_hash is None for b in manager.pool.blocks)
    manager.add_request("c", list(range(4)))
    assert manager.allocate_slots("c", 4, manager.find_longest_hit("c")) is None


def test_refused_admission_leaves_hit_blocks_untouched() -> None:
    """§6.1 item 19: a request with 6 hit blocks (3 held by another request, 3 cached free)
    that does not fit returns None and changes no reference count."""
    manager = build([FullAttentionSpec(16, 1)], 11)
    tokens = distinct_blocks(96, 16)
    prefill(manager, "a", [*tokens, 1])
    manager.free("a")
    prefill(manager, "b", [*tokens[:48], 2])
    manager.add_request("c", [*tokens, *range(500, 600)])
    hit = manager.find_longest_hit("c")
    assert hit.num_tokens == 96
    before = [manager.pool.blocks[i].ref_count for i in hit.block_ids[0]]
    assert before == [1, 1, 1, 0, 0, 0]
    free_before = manager.num_free_blocks
    assert manager.allocate_slots("c", 100, hit) is None
    assert [manager.pool.blocks[i].ref_count for i in hit.block_ids[0]] == before
    assert manager.num_free_blocks == free_before and not manager.is_running("c")
    manager.check_invariants()


def test_multimodal_and_salted_requests_hit_only_their_own_blocks() -> None:
    """§6.1 items 17–18: same image → hits; a different image identifier changes every block
    from the image on; the cache salt is in block 0, so another salt (or none) misses."""
    manager = build([FullAttentionSpec(16, 1)], 40)
    tokens = list(range(60))
    image = ExtraKeys(mm_features=(MultiModalFeature("aaa", 20, 10),))
    prefill(manager, "a", tokens, image)
    manager.add_request("same", tokens, extra_keys=image)
    assert manager.find_longest_hit("same").num_tokens == 48
    manager.add_request("other", tokens, extra_keys=ExtraKeys(
        mm_features=(MultiModalFeature("bbb", 20, 10),)))
    assert manager.find_longest_hit("other").num_tokens == 16  # block 0 has no image
    salted = ExtraKeys(cache_salt="salt1")
    prefill(manager, "s", tokens, salted)
    manager.add_request("s2", tokens, extra_keys=salted)
    assert manager.find_longest_hit("s2").num_tokens == 48
    manager.add_request("s3", tokens, extra_keys=ExtraKeys(cache_salt="salt2"))
    assert manager.find_longest_hit("s3").num_tokens == 0
    manager.add_request("plain", tokens)
    # "a" has the image in block 1 only, so its block 0 serves a plain request
    assert manager.find_longest_hit("plain").num_tokens == 16
    # generated tokens are hashed with the request's extra keys
    manager.append_token_ids("s", list(range(60, 70)))
    assert manager.allocate_slots("s", 10) is not None
    manager.add_request("s4", [*tokens, *range(60, 70), 5], extra_keys=salted)
    assert manager.find_longest_hit("s4").num_tokens == 64


def test_stats_count_first_admissions_and_preemptions_apart() -> None:
    manager = build([FullAttentionSpec(16, 1)], 20)
    tokens = distinct_blocks(40, 16)
    prefill(manager, "a", tokens)
    prefill(manager, "b", tokens)
    manager.free("b")  # preemption: re-admitted later, counted separately
    hit = manager.find_longest_hit("b")
    assert manager.allocate_slots("b", 40 - hit.num_tokens, hit) is not None
    stats = manager.stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 32)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (
        1, 40, 32)
    assert stats.hit_rate == pytest.approx(32 / 80)
    assert stats.hit_blocks_by_group == [4]
    assert manager.stats.evicted_blocks_by_group is manager.pool.num_evicted_blocks


def test_lookups_do_not_modify_the_cache() -> None:
    manager = build([FULL32, SWA8], 40)
    prefill(manager, "a", distinct_blocks(64))
    manager.free("a")
    manager.add_request("b", distinct_blocks(100))
    epoch, order = manager.pool.epoch, manager.pool.free_block_ids()
    refs = [b.ref_count for b in manager.pool.blocks]
    manager.find_longest_hit("b")
    manager.find_longest_hit("b", 40)
    assert manager.pool.epoch == epoch and manager.pool.free_block_ids() == order
    assert [b.ref_count for b in manager.pool.blocks] == refs


def test_find_longest_hit_respects_a_smaller_limit_and_short_prompts() -> None:
    manager = build([FullAttentionSpec(16, 1)], 20)
    tokens = distinct_blocks(64, 16)
    prefill(manager, "a", tokens)
    manager.add_request("b", tokens)
    assert manager.find_longest_hit("b").num_tokens == 48  # cap: the last token recomputes
    assert manager.find_longest_hit("b", 40).num_tokens == 32
    assert manager.find_longest_hit("b", 1000).num_tokens == 48
    manager.add_request("one", [5])
    hit = manager.find_longest_hit("one")
    assert hit.num_tokens == 0 and hit.blocks == ((),)


def test_remove_request_frees_a_running_request() -> None:
    manager = build([FULL32, SWA8], 40)
    prefill(manager, "a", list(range(50)))
    manager.remove_request("a")
    assert manager.request_ids == []
    assert manager.num_free_blocks == 39 and manager.usage == 0.0
    manager.check_invariants()


def test_queries() -> None:
    manager = build([FULL32, SWA8], 40)
    manager.add_request("a", [1, 2, 3])
    assert manager.num_tokens("a") == 3 and list(manager.token_ids("a")) == [1, 2, 3]
    assert manager.num_computed_tokens("a") == 0 and not manager.is_running("a")
    manager.allocate_slots("a", 2, manager.find_longest_hit("a"))
    assert manager.num_computed_tokens("a") == 2 and manager.is_running("a")
    assert manager.usage == pytest.approx(2 / 39)
    manager.new_step()
    assert manager.manager_seconds > 0


@pytest.mark.parametrize("eagle", [False, True])
def test_dsv4_like_masks_through_the_manager(eagle: bool) -> None:
    """§3.4 DSV4 rows end to end: full bs256 + SWA bs64 w128 + C4 bs4 w8 + C128 bs8 w128
    (A = 256), 1024 tokens under ``reachable``: SWA keeps i%4 ≥ 2, C4 i%64 ≥ 62 (with EAGLE
    also the block after each boundary), C128 i%32 ≥ 16 (need 16 + 1 ≥ per 32 stays sparse
    with EAGLE: (i-1)%32 ≥ 15). A resend hits 768 without EAGLE."""
    layers = [FullAttentionSpec(256, 1), SlidingWindowSpec(64, 1, 128),
              SlidingWindowSpec(4, 1, 8), SlidingWindowSpec(8, 1, 128)]
    manager = build(layers, 420, "reachable", use_eagle=eagle, eagle_block_drop=eagle)
    tokens = list(range(1024))
    prefill(manager, "r", tokens)
    shift = 1 if eagle else 0
    expected = {
        1: {i for i in range(16) if i >= shift and (i - shift) % 4 >= 2 - shift},
        2: {i for i in range(256) if i >= shift and (i - shift) % 64 >= 62 - shift},
        3: {i for i in range(128) if i >= shift and (i - shift) % 32 >= 16 - shift},
    }
    if not eagle:
        assert expected[2] == {62, 63, 126, 127, 190, 191, 254, 255}
    else:
        assert expected[2] == {62, 63, 64, 126, 127, 128, 190, 191, 192, 254, 255}
    for group_id, kept in expected.items():
        assert hashed(manager, group_id, "r") == kept, group_id
    assert hashed(manager, 0, "r") == {0, 1, 2, 3}
    if not eagle:
        manager.free("r")
        manager.add_request("resend", tokens)
        hit = manager.find_longest_hit("resend")
        assert hit.num_tokens == 768
        assert [len(t) for t in hit.block_ids] == [3, 12, 192, 96]
