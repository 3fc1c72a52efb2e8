"""The hybrid-aware host tier: kept in *landing units*, never dead content (``aware``).

A hit lands at an aligned point ``p`` only with the full-attention chain ``[0, p)`` and the
state that lets it land there (window tails, recurrent checkpoint, compressor state:
``HostShape.landing_keys``). So the tier keeps **landing points**, each with its tails,
and the full-attention **segments** (one alignment unit ``[q - A, q)`` of every
full-attention group) that the points' chains pass through:

- a segment is on the host exactly while a point at or after it on its chain is (its
  count = points ending at it + children segments on the host);
- a tail block is on the host exactly while a point needing it is (reference count);
- space is one budget of blocks: what a point needs, KV or state, is what it takes (no
  fixed KV : state ratio);
- eviction: the least recently stored or hit point goes, with its tails and every segment
  no other point anchors — so a chain never stays behind without a landing state (the
  host "dead memory" of SGLang #39436), and a state never without its chain.

A released request offers the points where its own blocks let a hit land (those its GPU
retention policy kept the tails of; every aligned point on a pure full-attention model),
shallowest first, so its deepest point is the most recent.

When even an empty host cannot take all of a request's points, its deepest go first: it
keeps the longest prefix of its landing units that fits.

Worked example (one full group, one recurrent group, blocks = alignment = 4 tokens): a
12-token request released with checkpoints at 8 and 12 offers 3 segments + 2 checkpoints
(5 blocks); with room for 4 it keeps the point at 8 (2 segments + its checkpoint).

>>> from hybridkv.host_tier import HostGroup, HostShape, ReleasedBlocks
>>> from hybridkv.ids import BlockHash, GroupId
>>> shape = HostShape((HostGroup(GroupId(0), 4, None), HostGroup(GroupId(1), 4, 1)), 4, 4, 1)
>>> tier = LandingTier(shape, capacity_blocks=4)
>>> h = [BlockHash(bytes([i])) for i in range(3)]
>>> tier.store(ReleasedBlocks(h, ([0, 1, 2], [1, 2]), 12))
>>> tier.used_blocks, tier.holds(GroupId(1), h[1]), tier.holds(GroupId(1), h[2])
(3, True, False)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hybridkv.errors import InvariantViolation
from hybridkv.host_tier import HostHit, HostKey, HostShape, HostTier, ReleasedBlocks
from hybridkv.ids import BlockHash, GroupId


def landing_points(shape: HostShape, released: ReleasedBlocks) -> list[tuple[int, bool]]:
    """Aligned points of ``released`` where its own cached blocks let a hit land, ascending,
    each with whether it lands with tails (else: a bridge point at the chain's end, when
    the shape has bridges).

    >>> from hybridkv.host_tier import HostGroup
    >>> from hybridkv.ids import BlockHash, GroupId
    >>> s = HostShape((HostGroup(GroupId(0), 4, None), HostGroup(GroupId(1), 4, 1)), 4, 4, 1)
    >>> landing_points(s, ReleasedBlocks([BlockHash(b"x")] * 3, ([0, 1, 2], [1]), 12))
    [(8, True)]
    """
    a = shape.alignment_tokens
    reach = released.num_tokens
    for group, indexes in zip(shape.groups, released.cached, strict=True):
        if group.is_full:
            run = 0
            while run < len(indexes) and indexes[run] == run:
                run += 1
            reach = min(reach, run * group.block_size)
    reach = min(reach, len(released.hashes) * shape.hash_block_size)
    tails = [(g, set(ix)) for g, ix in zip(shape.groups, released.cached, strict=True)
             if not g.is_full]
    if not tails:
        return [(p, True) for p in range(a, reach // a * a + 1, a)]
    first_group, first_cached = tails[0]
    candidates = sorted({(i + 1) * first_group.block_size for i in first_cached})
    points: list[tuple[int, bool]] = []
    for point in candidates:
        if point % a or point > reach:
            continue
        if all(i in cached for group, cached in tails
               for i in range(point // group.block_size - group.tail_at(point),
                              point // group.block_size)):
            points.append((point, True))
    end = reach // a * a
    if shape.bridge_start(reach) and (not points or points[-1][0] < end):
        points.append((end, False))
    return points


class LandingTier(HostTier):
    """Hybrid-aware host tier (module doc).

    Invariants (``check_invariants``): each segment's count = points ending at it + its
    children on the host, and is > 0; each point's whole chain of segments is on the host;
    each tail's reference count = the points needing it, > 0; the full-attention keys held
    are exactly the segments' blocks; ``used_blocks`` = segments × blocks per segment +
    tails ≤ ``capacity_blocks``. Together: every block on the host serves a hit on its own
    (no dead content)."""

    name = "aware"

    def __init__(self, shape: HostShape, capacity_blocks: int) -> None:
        super().__init__(shape, capacity_blocks)
        a = shape.alignment_tokens
        self._segment_blocks = sum(a // g.block_size for g in shape.full_groups)
        self._count: dict[BlockHash, int] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._segment_keys: dict[BlockHash, tuple[HostKey, ...]] = {}
        self._points_here: dict[BlockHash, int] = {}
        self._full_keys: set[HostKey] = set()
        self._tails: dict[HostKey, int] = {}
        self._points: OrderedDict[BlockHash, tuple[HostKey, ...]] = OrderedDict()
        """Landing hash → its tail keys, least recently stored or hit first."""

    # ----------------------------------------------------------------- queries
    def holds(self, group_id: GroupId, block_hash: BlockHash) -> bool:
        key = (group_id, block_hash)
        return key in self._full_keys or key in self._tails

    @property
    def used_blocks(self) -> int:
        return len(self._segment_keys) * self._segment_blocks + len(self._tails)

    def occupancy_blocks(self) -> tuple[int, int]:
        return len(self._segment_keys) * self._segment_blocks, len(self._tails)

    @property
    def num_points(self) -> int:
        return len(self._points)

    # ---------------------------------------------------------------- mutations
    def store(self, released: ReleasedBlocks) -> None:
        offered = sum(len(ix) for ix in released.cached)
        new: list[BlockHash] = []
        for point, with_tails in landing_points(self.shape, released):
            key = self._add_point(released.hashes, point, with_tails)
            if key is not None:
                new.append(key)
        protected = set(new)
        while self.used_blocks > self.capacity_blocks and len(self._points) > len(protected):
            victim = next(k for k in self._points if k not in protected)
            self._remove_point(victim)
        while self.used_blocks > self.capacity_blocks and new:
            self._remove_point(new.pop(), evicted=False)  # its own deepest first
        kept = sum(self.holds(g.group_id, self.shape.block_hash(released.hashes, g, i))
                   for g, ix in zip(self.shape.groups, released.cached, strict=True)
                   for i in ix)
        self.counters.refused_blocks += offered - kept

    def touch(self, hashes: Sequence[BlockHash], hit: HostHit) -> None:
        """The point the hit landed on goes last in the LRU order: at ``num_tokens``, or
        for a bridge hit at the chain's end it was read to (``full_attention_tokens``,
        where its bridge point sits)."""
        point = hit.full_attention_tokens or hit.num_tokens
        key = hashes[point // self.shape.hash_block_size - 1]
        if key in self._points:
            self._points.move_to_end(key)

    def _add_point(self, hashes: Sequence[BlockHash], point: int, with_tails: bool,
                   ) -> BlockHash | None:
        """Anchor the point at ``point`` (``with_tails`` false: a bridge point, landed by
        the chain alone); return its key if it is new (else refresh it)."""
        hb, a = self.shape.hash_block_size, self.shape.alignment_tokens
        key = hashes[point // hb - 1]
        if key in self._points:
            self._points.move_to_end(key)
            return None
        self._points_here[key] = self._points_here.get(key, 0) + 1
        if self._segment_blocks:
            q = point
            while q > 0:  # anchor the chain up to the first segment already held
                seg = hashes[q // hb - 1]
                count = self._count.get(seg, 0)
                self._count[seg] = count + 1
                if count:
                    break
                self._add_segment(hashes, q, seg)
                q -= a
        tails = tuple(self.shape.landing_keys(hashes, point)) if with_tails else ()
        for tail in tails:
            refs = self._tails.get(tail, 0)
            self._tails[tail] = refs + 1
            if not refs:
                self.note_stored(tail)
        self._points[key] = tails
        return key

    def _add_segment(self, hashes: Sequence[BlockHash], q: int, seg: BlockHash) -> None:
        a, hb = self.shape.alignment_tokens, self.shape.hash_block_size
        self._parent[seg] = hashes[(q - a) // hb - 1] if q > a else None
        keys = tuple((g.group_id, self.shape.block_hash(hashes, g, i))
                     for g in self.shape.full_groups
                     for i in range((q - a) // g.block_size, q // g.block_size))
        self._segment_keys[seg] = keys
        for block in keys:
            self._full_keys.add(block)
            self.note_stored(block)

    def _remove_point(self, key: BlockHash, *, evicted: bool = True) -> None:
        tails = self._points.pop(key)
        freed = 0
        for tail in tails:
            refs = self._tails[tail] - 1
            if refs:
                self._tails[tail] = refs
            else:
                del self._tails[tail]
                freed += 1
        here = self._points_here[key] - 1
        if here:
            self._points_here[key] = here
        else:
            del self._points_here[key]
        seg: BlockHash | None = key if self._segment_blocks else None
        while seg is not None:  # un-anchor the chain while nothing else holds it
            count = self._count[seg] - 1
            if count:
                self._count[seg] = count
                break
            del self._count[seg]
            for block in self._segment_keys.pop(seg):
                self._full_keys.discard(block)
            freed += self._segment_blocks
            seg = self._parent.pop(seg)
        if evicted:
            self.counters.evicted_blocks += freed

    # --------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        expected: dict[BlockHash, int] = dict(self._points_here)
        for parent in self._parent.values():
            if parent is not None:
                expected[parent] = expected.get(parent, 0) + 1
        if self._segment_blocks:
            if expected != self._count or set(self._count) != set(self._segment_keys):
                raise InvariantViolation("host segment counts differ from a recount")
            for key in self._points:
                seg: BlockHash | None = key
                while seg is not None:
                    if seg not in self._segment_keys:
                        raise InvariantViolation(f"host point {key!r} lost its chain")
                    seg = self._parent[seg]
        refs: dict[HostKey, int] = {}
        for tails in self._points.values():
            for tail in tails:
                refs[tail] = refs.get(tail, 0) + 1
        if refs != self._tails:
            raise InvariantViolation("host tail references differ from the points")
        if self._full_keys != {k for keys in self._segment_keys.values() for k in keys}:
            raise InvariantViolation("host full-attention keys differ from the segments")
        if self.used_blocks > self.capacity_blocks:
            raise InvariantViolation(f"host holds {self.used_blocks} blocks, capacity "
                                     f"{self.capacity_blocks}")
