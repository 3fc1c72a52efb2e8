"""Sibling batching changes nothing: a coordinator that serves sibling window groups in one
pool call per operation leaves every hit, every allocation and every free-queue order
exactly as one call per group would (every retention, ``pin:T`` included)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridkv.managers import GroupManager
from hybridkv.siblings import SiblingBatch

FULL = FullAttentionSpec(8, 1)
SWA = SlidingWindowSpec(8, 1, 16)  # two sibling groups of this spec (two layers each)
POLICIES = ("dense", "reachable", "prepend", "latest", "interval:32", "pin:16", "pin:48")


def unbatched(manager: KVCacheManager) -> KVCacheManager:
    """Serve every group on its own (the reference the batches must equal)."""
    coordinator = manager.coordinator
    coordinator._units = list(coordinator.managers)
    coordinator._units_are_batches = False
    coordinator._releasing_units = [m for m in coordinator.managers
                                    if not m.is_full_attention]
    return manager


def snapshot(manager: KVCacheManager) -> tuple[object, ...]:
    pool = manager.pool
    return (tuple(tuple(b.block_id for b in queue) for queue in pool.queues),
            tuple(sorted((b.block_id, b.block_hash, b.hash_group_id)
                         for b in pool.blocks if b.block_hash is not None)))


requests = st.lists(
    st.tuples(st.integers(0, 3),                      # shared-prefix family
              st.integers(9, 90),                     # prompt length
              st.integers(1, 12),                     # decode steps
              st.integers(1, 40)),                    # prefill chunk size
    min_size=1, max_size=10)


@settings(max_examples=60, deadline=None)
@given(shapes=requests, policy=st.sampled_from(POLICIES), num_blocks=st.integers(40, 90))
def test_sibling_batches_equal_per_group_calls(
        shapes: list[tuple[int, int, int, int]], policy: str, num_blocks: int) -> None:
    def build() -> KVCacheManager:
        config = CacheConfig.from_layers([FULL, SWA, SWA, FULL, SWA, SWA], num_blocks,
                                         max_num_batched_tokens=64)
        return KVCacheManager(config, policy)

    batched, reference = build(), unbatched(build())
    units = batched.coordinator._units
    assert any(isinstance(u, SiblingBatch) for u in units)
    assert all(isinstance(u, GroupManager) for u in reference.coordinator._units)
    next_token = 10_000
    for index, (family, length, num_decode, chunk) in enumerate(shapes):
        prompt = [family * 1000 + i for i in range(length)]
        req_id = f"r{index}"
        outcomes = []
        for manager in (batched, reference):
            manager.add_request(req_id, prompt)
            hit = manager.find_longest_hit(req_id)
            done, first = hit.num_tokens, True
            allocated = True
            while done < length and allocated:
                step = min(chunk, length - done)
                result = manager.allocate_slots(req_id, step, hit if first else None)
                allocated = result is not None
                first = False
                done += step if allocated else 0
            for offset in range(num_decode if allocated else 0):
                manager.append_token_ids(req_id, [next_token + offset])
                if manager.allocate_slots(req_id, 1) is None:
                    break
            block_ids = manager.get_block_ids(req_id)
            if index % 3 != 2:  # keep every third request running
                manager.remove_request(req_id)
            manager.check_invariants()
            outcomes.append((hit.num_tokens, allocated, block_ids, snapshot(manager)))
        next_token += num_decode
        assert outcomes[0] == outcomes[1]
