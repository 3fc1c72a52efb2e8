"""Offline optimum (Belady MIN) and the FA-only LRU reference, on hand-checked traces."""

from __future__ import annotations

from hybridkv.sim.bound import block_keys, lru_full_attention, offline_optimum
from hybridkv.traces.trace import Trace, TraceRequest


def trace() -> Trace:
    # Blocks of 4 tokens. r0 = ids (1, 2) + 1 fill token -> 2 full blocks; r1 = id 3 + 1.
    return Trace("t", (
        TraceRequest("r0", 9, 1, block_ids=(1, 2), trace_block_size=4),
        TraceRequest("r1", 5, 1, block_ids=(3,), trace_block_size=4),
        TraceRequest("r2", 9, 1, block_ids=(1, 2), trace_block_size=4),
        TraceRequest("r3", 5, 1, block_ids=(3,), trace_block_size=4),
    ))


def test_belady_keeps_the_block_used_soonest() -> None:
    # Capacity 2 blocks: after r1, MIN evicts block (3) (next used at r3, after r2's two),
    # so r2 hits 8 tokens and r3 misses. LRU evicts (1,2)'s tail instead: r2 hits 4.
    assert offline_optimum(trace(), 8, 4, 4).hit_tokens == 8
    assert lru_full_attention(trace(), 8, 4, 4).hit_tokens == 4
    # Capacity 3 holds everything: r2 hits 8, r3 hits 4 (capped at 5 - 1, floored to 4).
    assert offline_optimum(trace(), 12, 4, 4).hit_tokens == 12
    assert offline_optimum(trace(), 12, 4, 4).prompt_tokens == 28


def test_bound_dominates_lru_and_respects_alignment() -> None:
    for capacity in (0, 4, 8, 12, 16):
        best = offline_optimum(trace(), capacity, 4, 4).hit_tokens
        assert best >= lru_full_attention(trace(), capacity, 4, 4).hit_tokens
    # alignment 8: r2's 8-token hit survives, r3's 4-token hit floors to 0
    assert offline_optimum(trace(), 12, 4, 8).hit_tokens == 8


def test_block_keys_are_prefix_keys() -> None:
    a = TraceRequest("a", 16, 1, block_ids=(7, 8), trace_block_size=8)
    b = TraceRequest("b", 16, 1, block_ids=(7, 9), trace_block_size=8)
    ka, kb = block_keys(a, 0, 4), block_keys(b, 1, 4)
    assert len(ka) == 4 and ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]
    # token traces key the same content the same way as each other
    t1 = TraceRequest("t1", 8, 1, token_ids=tuple(range(8)))
    t2 = TraceRequest("t2", 9, 1, token_ids=(*range(4), 99, 5, 6, 7, 8))
    k1, k2 = block_keys(t1, 0, 4), block_keys(t2, 1, 4)
    assert k1[0] == k2[0] and k1[1] != k2[1]
    # fill tokens are unique to the request
    f1 = TraceRequest("f1", 12, 1, block_ids=(5,), trace_block_size=4)
    f2 = TraceRequest("f2", 12, 1, block_ids=(5,), trace_block_size=4)
    kf1, kf2 = block_keys(f1, 0, 4), block_keys(f2, 1, 4)
    assert kf1[0] == kf2[0] and kf1[1:] != kf2[1:]


def test_equal_next_use_evicts_the_deeper_block_across_requests() -> None:
    # Capacity 4 blocks. r0 caches (1,2,3,4); r1 rereads (1,2); r2 adds block (7), used
    # by r3; r4 reads (1,2,3,4) again. After r2 five blocks compete for four places: (7)
    # is needed soonest (r3); the other four are all next used by r4 — r0's (3,4) and r1's
    # (1,2) — and MIN drops the deepest, (4), so r4 hits (1,2,3) = 12 tokens. Dropping the
    # deepest block of the *latest* run instead, (2), would leave r4 a 4-token hit.
    trace = Trace("t", (
        TraceRequest("r0", 17, 1, block_ids=(1, 2, 3, 4), trace_block_size=4),
        TraceRequest("r1", 9, 1, block_ids=(1, 2), trace_block_size=4),
        TraceRequest("r2", 5, 1, block_ids=(7,), trace_block_size=4),
        TraceRequest("r3", 5, 1, block_ids=(7,), trace_block_size=4),
        TraceRequest("r4", 17, 1, block_ids=(1, 2, 3, 4), trace_block_size=4),
    ))
    assert offline_optimum(trace, 16, 4, 4).hit_tokens == 8 + 4 + 12
