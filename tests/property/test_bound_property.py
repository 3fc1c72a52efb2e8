"""The run-based offline optimum equals a textbook per-block Belady MIN on random traces."""

from __future__ import annotations

import heapq

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.sim.bound import block_keys, offline_optimum
from hybridkv.traces.trace import Trace, TraceRequest

_NEVER = 1 << 62


def naive_min(trace: Trace, capacity_tokens: int, block_size: int, alignment: int) -> int:
    """One heap entry per block access: evict the farthest next use, deeper first."""
    keyed = [list(block_keys(r, i, block_size)) for i, r in enumerate(trace.requests)]
    capacity = capacity_tokens // block_size
    cached: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []
    hits = 0
    for i, (request, keys) in enumerate(zip(trace.requests, keyed, strict=True)):
        num_hit = 0
        for key in keys:
            if key not in cached:
                break
            num_hit += 1
        cap = (request.input_length - 1) // alignment * alignment
        hits += min(num_hit * block_size // alignment * alignment, cap)
        for depth, key in enumerate(keys):
            use = next((j for j in range(i + 1, len(keyed)) if key in keyed[j]), _NEVER)
            if use == _NEVER:
                cached.pop(key, None)
                continue
            cached[key] = use
            heapq.heappush(heap, (-use, -depth, key))
        while len(cached) > capacity:
            neg_use, _, key = heapq.heappop(heap)
            if cached.get(key) == -neg_use:
                del cached[key]
    return hits


chains = st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=6), min_size=1, max_size=14)


@given(chains=chains, capacity_blocks=st.integers(0, 12), block_size=st.sampled_from((2, 4)),
       extra=st.lists(st.integers(0, 5), min_size=14, max_size=14),
       aligned=st.booleans())
def test_run_based_min_equals_per_block_min(chains: list[list[int]], capacity_blocks: int,
                                            block_size: int, extra: list[int],
                                            aligned: bool) -> None:
    # Trace blocks of 4 tokens (ids drawn from a tiny alphabet, so prefixes are shared
    # often); each request has a few fill tokens past its blocks.
    requests = tuple(
        TraceRequest(f"r{i}", 4 * len(ids) + extra[i] + 1, 1, block_ids=tuple(ids),
                     trace_block_size=4)
        for i, ids in enumerate(chains)
    )
    trace = Trace("t", requests)
    alignment = 4 if aligned else block_size
    fast = offline_optimum(trace, capacity_blocks * block_size, block_size, alignment)
    assert fast.hit_tokens == naive_min(trace, capacity_blocks * block_size, block_size,
                                        alignment)
    assert fast.prompt_tokens == sum(r.input_length for r in requests)
