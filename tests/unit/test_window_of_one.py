"""Regression: a sliding window of 1 token needs no window KV, so masking loses nothing.

Issue 12 part 5: with w = 1 every masking policy hashed no window block (the tail is empty)
while the hit search still demanded one cached block, so a 16-token resend hit 0 tokens
under ``reachable`` / ``prepend`` / ``latest`` / ``interval:N`` / ``pin:T`` and 14 under
``dense``; with ``+recompute`` the plan reported ``junction_tokens == num_tokens``.
"""

from __future__ import annotations

import pytest

from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, SlidingWindowSpec

POLICIES = ("dense", "reachable", "prepend", "latest", "interval:4", "pin:8")


def resend_hit(policy: str, window: int, num_windows: int = 1):  # type: ignore[no-untyped-def]
    layers = [FullAttentionSpec(2, 1)] + [SlidingWindowSpec(2, 1, window)] * num_windows
    manager = KVCacheManager(CacheConfig.from_layers(layers, 64), policy)
    tokens = list(range(16))
    manager.add_request("a", tokens)
    manager.allocate_slots("a", 16, manager.find_longest_hit("a"))
    manager.remove_request("a")
    manager.add_request("b", tokens)
    hit = manager.find_longest_hit("b")
    manager.check_invariants()
    return manager, hit


@pytest.mark.parametrize("policy", [p + m for p in POLICIES for m in ("", "+recompute")])
def test_window_of_one_resend_hits_like_dense(policy: str) -> None:
    manager, hit = resend_hit(policy, window=1)
    assert hit.num_tokens == 14  # the whole aligned resend, as under dense
    assert hit.junction_tokens == 0
    assert hit.full_attention_tokens == 14 and not hit.is_window_missing
    # the window table holds only null blocks: no window KV is read
    assert len(hit.blocks[1]) == 7 and all(b.is_null for b in hit.blocks[1])
    allocation = manager.allocate_slots("b", 2, hit)
    assert allocation is not None and allocation.num_hit_tokens == 14
    manager.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_window_of_one_keeps_no_window_block(policy: str) -> None:
    """At its next step a request's window-1 table has released every block before the
    one being filled (nothing earlier is ever read)."""
    layers = [FullAttentionSpec(2, 1), SlidingWindowSpec(2, 1, 1)]
    manager = KVCacheManager(CacheConfig.from_layers(layers, 64), policy)
    manager.add_request("a", list(range(16)))
    manager.allocate_slots("a", 16, manager.find_longest_hit("a"))
    manager.append_token_ids("a", [99])
    assert manager.allocate_slots("a", 1) is not None
    window_table = manager.get_block_ids("a")[1]
    assert len(window_table) == 9 and all(b == 0 for b in window_table[:-1])
    manager.check_invariants()


def test_window_of_two_still_needs_its_tail() -> None:
    """w = 2 needs one tail block: after that block is evicted the hit falls back."""
    manager, hit = resend_hit("latest", window=2)
    assert hit.num_tokens == 14 and not hit.blocks[1][-1].is_null
    tail = hit.blocks[1][-1]
    manager.pool._evict(manager.pool.blocks[tail.block_id])  # white box: as reallocation
    assert manager.find_longest_hit("b").num_tokens == 0  # latest kept only that tail
