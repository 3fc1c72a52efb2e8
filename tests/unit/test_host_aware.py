"""The hybrid-aware host tier's recency (``host_aware.LandingTier``)."""

from __future__ import annotations

from hybridkv.host_aware import LandingTier
from hybridkv.host_tier import HostGroup, HostShape, ReleasedBlocks
from hybridkv.ids import BlockHash, GroupId


def test_a_bridge_hit_refreshes_the_point_it_read() -> None:
    """Requests a and b leave bridge points (chains of 16 tokens, no window tail); a bridge
    hit on a's chain lands at 8 and reads the chain to 16, where a's point sits. Storing c
    then evicts the least recently used point: b's (the hit refreshed a key at 8, which is
    no point, so a's went although it had just served a hit)."""
    full, window = HostGroup(GroupId(0), 4, None), HostGroup(GroupId(1), 4, 1)
    tier = LandingTier(HostShape((full, window), 4, 4, 1, bridge_tokens=8), capacity_blocks=8)
    a, b, c = ([BlockHash(b"%s%d" % (name, i)) for i in range(4)] for name in (b"a", b"b", b"c"))
    for chain in (a, b):
        tier.store(ReleasedBlocks(chain, ([0, 1, 2, 3], []), 16))
    hit = tier.longest_hit([*a, BlockHash(b"x")], lambda g, h: False, gpu_hit_tokens=0,
                           max_tokens=19)
    assert hit is not None and (hit.num_tokens, hit.full_attention_tokens) == (8, 16)
    tier.promote(a, hit, 0)
    tier.store(ReleasedBlocks(c, ([0, 1, 2, 3], []), 16))
    assert tier.holds(GroupId(0), a[0]) and not tier.holds(GroupId(0), b[0])
    tier.check_invariants()
