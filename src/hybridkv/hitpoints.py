"""Which cached blocks a hybrid prefix hit can still use (``flops`` eviction, Marconi-style).

On a full-attention + recurrent-state model a hit at ``p`` needs the full-attention KV of
``[0, p)`` *and* the recurrent state after exactly ``p`` tokens in every recurrent group.
So a cached block is worth something only as part of a *usable hit point*:

- a **hit point** ``x`` is a hash cached in the recurrent groups (an aligned checkpoint, or a
  ``ckpt:branch`` snapshot); its **end** ``e(x)`` is the full-attention hash it depends on
  (the block ending at ``p``; a snapshot's own full-attention block or its alias). It is
  *complete* when every recurrent group holds a copy, *usable* when complete and the
  full-attention chain ``e(x) → parent → … → root`` is cached in full;
- a full-attention block with hash ``k`` is **anchored** when a usable hit point's chain
  passes through ``k``. An unanchored block serves no hit: a request sharing it can only
  hit at a hit point before it and recomputes it (into a copy of its own);
- a recurrent block is worth something only while its hit point is usable.

``HitPoints`` keeps this incrementally from the pool's caching and eviction callbacks, in
O(1) amortised per event (anchoring propagates up only until it meets an already anchored
ancestor; a chain break visits each block of the broken subtree once). ``worthless``
answers for a freed block: the eviction policy files those ahead of everything else.
Pure full-attention models: every block end is a hit point (nothing is ever worthless).

Worked example (block 4 tokens, one recurrent group): a 13-token prompt caches the
full-attention blocks ``a1 a2 a3`` (chain ``root → a1 → a2 → a3``); they are worth nothing
until its replay-boundary checkpoint ``a3`` (the state after 12 tokens) is cached too; then
hit point ``a3`` is usable and anchors all three. Evicting that state un-anchors them at
once (nothing else passes through them: a prompt sharing 6 tokens cannot hit there and
recomputes them), where LRU would keep them until their own turn.

>>> from hybridkv.pool import BlockPool
>>> from hybridkv.ids import BlockHash, GroupId
>>> pool = BlockPool(8, 2)
>>> hp = HitPoints(pool, GroupId(0), [GroupId(1)])
>>> a1, a2, a3 = (BlockHash(h) for h in (b"a1", b"a2", b"a3"))
>>> blocks = pool.allocate(4)
>>> for block, key, parent in zip(blocks, (a1, a2, a3), (ROOT, a1, a2)):
...     pool.cache_block(block, key, GroupId(0)); hp.on_cached(block, parent)
>>> [hp.is_anchored(k) for k in (a1, a2, a3)]
[False, False, False]
>>> pool.cache_block(blocks[3], a3, GroupId(1)); hp.on_cached(blocks[3], a3)
>>> [hp.is_anchored(k) for k in (a1, a2, a3)], hp.is_usable(a3)
([True, True, True], True)
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.block import DEAD_QUEUE, Block
from hybridkv.errors import InvariantViolation
from hybridkv.ids import BlockHash, GroupId
from hybridkv.pool import BlockPool, FreeTier

ROOT = BlockHash(b"")
"""Parent of a first full-attention block (the same value as ``eviction.ROOT_PARENT``)."""


class HitPoints:
    """Usable hit points and anchored full-attention blocks of one pool (see the module).

    Invariants (``check_invariants``): the incremental state equals a recomputation from
    the pool's hash index (points counted usable ⇔ complete, not dead, chain intact;
    anchored ⇔ a counted point's chain passes through), and no cached block linked in a
    live free queue (anything but the dead queue) is worthless.
    """

    def __init__(self, pool: BlockPool, chain_group_id: GroupId,
                 point_group_ids: Sequence[GroupId]) -> None:
        self.pool = pool
        self.chain_group_id = chain_group_id
        self.point_group_ids = tuple(point_group_ids)
        self._point_groups = frozenset(point_group_ids)
        self.parent: dict[BlockHash, BlockHash | None] = {}
        """Cached full-attention hash → the hash before it (``ROOT`` for a first block,
        ``None`` when unknown: never part of a usable chain)."""
        self.children: dict[BlockHash, set[BlockHash]] = {}
        self.broken: set[BlockHash] = set()
        """Cached full-attention hashes whose chain to the root is cut (an ancestor is not
        cached); repaired when the missing ancestor is cached again."""
        self.points_here: dict[BlockHash, int] = {}
        """Full-attention hash → usable hit points ending there."""
        self.anchored_children: dict[BlockHash, int] = {}
        self.point_end: dict[BlockHash, BlockHash | None] = {}
        """Hit point → its full-attention end (first recurrent copy cached decides)."""
        self.points_at: dict[BlockHash, set[BlockHash]] = {}
        self.num_groups_present: dict[BlockHash, int] = {}
        self.counted: set[BlockHash] = set()
        """Usable hit points."""
        self.num_worthless_filed = 0
        """Blocks moved to the dead queue because they became worthless while free."""

    # ----------------------------------------------------------------- queries
    def is_anchored(self, key: BlockHash) -> bool:
        if not self._point_groups:  # pure full attention: every block end is a hit point
            return key in self.parent and key not in self.broken
        return self.points_here.get(key, 0) > 0 or self.anchored_children.get(key, 0) > 0

    def is_usable(self, key: BlockHash) -> bool:
        return key in self.counted

    def worthless(self, block: Block) -> bool:
        """No hit can use this cached block now (filed before every other block)."""
        key = block.block_hash
        group_id = block.hash_group_id
        if key is None:
            return True
        if group_id == self.chain_group_id:
            return key in self.broken or not self.is_anchored(key)
        if group_id in self._point_groups:
            return key not in self.counted
        return False

    # ----------------------------------------------------------------- caching
    def on_cached(self, block: Block, parent_hash: BlockHash | None) -> None:
        key, group_id = block.block_hash, block.hash_group_id
        assert key is not None and group_id is not None
        if group_id == self.chain_group_id:
            if key in self.parent:
                return  # another copy
            self.parent[key] = parent_hash
            if parent_hash is not None and parent_hash != ROOT:
                self.children.setdefault(parent_hash, set()).add(key)
            if parent_hash is None or (parent_hash != ROOT and (
                    parent_hash not in self.parent or parent_hash in self.broken)):
                self.broken.add(key)
                return
            self._repair(key)
        elif group_id in self._point_groups:
            if len(self.pool.cached_copies(key, group_id)) > 1:
                return  # another copy in this group
            if key not in self.num_groups_present:
                self.point_end[key] = parent_hash
                if parent_hash is not None:
                    self.points_at.setdefault(parent_hash, set()).add(key)
            self.num_groups_present[key] = self.num_groups_present.get(key, 0) + 1
            self._try_count(key)

    def _repair(self, key: BlockHash) -> None:
        """``key``'s chain to the root is intact: so are those of its cached descendants
        (cut before, when ``key`` was evicted); their complete points count again."""
        stack = [key]
        while stack:
            node = stack.pop()
            self.broken.discard(node)
            for point in list(self.points_at.get(node, ())):
                self._try_count(point)
            stack.extend(c for c in self.children.get(node, ()) if c in self.broken)

    def _try_count(self, point: BlockHash) -> None:
        if point in self.counted or \
                self.num_groups_present.get(point, 0) < len(self.point_group_ids):
            return
        end = self.point_end.get(point)
        if end is None or end not in self.parent or end in self.broken:
            return  # waits for its full-attention end (a producer still computing it)
        self.counted.add(point)
        here = self.points_here.get(end, 0)
        self.points_here[end] = here + 1
        if here == 0 and self.anchored_children.get(end, 0) == 0:
            self._propagate_anchored(end)

    def _propagate_anchored(self, key: BlockHash) -> None:
        """``key`` just became anchored: so do its ancestors, up to one that already was."""
        parent = self.parent.get(key)
        while parent is not None and parent != ROOT:
            before = self.anchored_children.get(parent, 0)
            self.anchored_children[parent] = before + 1
            if before or self.points_here.get(parent, 0):
                return
            parent = self.parent.get(parent)

    def _uncount(self, point: BlockHash, worthless: list[BlockHash]) -> None:
        """A usable point stops being usable; ancestors that lose their last anchor are
        appended to ``worthless``."""
        self.counted.discard(point)
        end = self.point_end.get(point)
        assert end is not None
        here = self.points_here[end] - 1
        if here:
            self.points_here[end] = here
            return
        del self.points_here[end]
        if self.anchored_children.get(end, 0):
            return
        worthless.append(end)
        self._propagate_unanchored(self.parent.get(end), worthless)

    def _propagate_unanchored(self, parent: BlockHash | None,
                              worthless: list[BlockHash]) -> None:
        """A child of ``parent`` stopped being anchored: so do ancestors left without."""
        while parent is not None and parent != ROOT and parent in self.anchored_children:
            left = self.anchored_children[parent] - 1
            if left:
                self.anchored_children[parent] = left
                return
            del self.anchored_children[parent]
            if self.points_here.get(parent, 0):
                return
            worthless.append(parent)
            parent = self.parent.get(parent)

    # ---------------------------------------------------------------- eviction
    def on_evicted(self, key: BlockHash, group_id: GroupId, still_cached: bool) -> None:
        """``key`` lost a copy in ``group_id``; on its last copy, whatever depended on it
        becomes worthless and its free blocks move to the dead queue."""
        if still_cached:
            return
        worthless_fa: list[BlockHash] = []
        worthless_points: list[BlockHash] = []
        if group_id == self.chain_group_id:
            self._cut(key, worthless_fa, worthless_points)
        elif group_id in self._point_groups:
            present = self.num_groups_present.get(key, 0) - 1
            if key in self.counted:
                self._uncount(key, worthless_fa)
            worthless_points.append(key)
            if present > 0:
                self.num_groups_present[key] = present
            else:
                self._forget_point(key)
        self._file_dead(worthless_fa, worthless_points)

    def _cut(self, key: BlockHash, worthless_fa: list[BlockHash],
             worthless_points: list[BlockHash]) -> None:
        """The last copy of full-attention ``key`` is gone: its cached descendants' chains
        are cut (worthless until ``key`` is cached again), its ancestors lose its
        anchoring. Child links stay, so that a recomputed ``key`` repairs the subtree."""
        was_anchored = key not in self.broken and self.is_anchored(key)
        parent = self.parent.pop(key, None)
        if parent is not None and parent != ROOT:
            siblings = self.children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self.children[parent]
        stack = [key]
        while stack:
            node = stack.pop()
            for point in self.points_at.get(node, ()):
                if point in self.counted:
                    self.counted.discard(point)
                    worthless_points.append(point)
            self.points_here.pop(node, None)
            self.anchored_children.pop(node, None)
            for child in self.children.get(node, ()):
                if child in self.parent and child not in self.broken:
                    self.broken.add(child)
                    worthless_fa.append(child)
                    stack.append(child)
        self.broken.discard(key)
        if not self.children.get(key):
            self.children.pop(key, None)
        if was_anchored:
            self._propagate_unanchored(parent, worthless_fa)

    def _forget_point(self, key: BlockHash) -> None:
        self.num_groups_present.pop(key, None)
        end = self.point_end.pop(key, None)
        if end is not None:
            at = self.points_at.get(end)
            if at is not None:
                at.discard(key)
                if not at:
                    del self.points_at[end]

    def _file_dead(self, worthless_fa: Sequence[BlockHash],
                   worthless_points: Sequence[BlockHash]) -> None:
        pool = self.pool
        for key in worthless_fa:
            self._move_dead(pool.cached_copies(key, self.chain_group_id))
        for key in worthless_points:
            for group_id in self.point_group_ids:
                self._move_dead(pool.cached_copies(key, group_id))

    def _move_dead(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block.ref_count == 0 and block.queue_id is not None \
                    and block.queue_id != DEAD_QUEUE:
                self.pool.move(block, FreeTier.DEAD)
                self.num_worthless_filed += 1

    # -------------------------------------------------------------- placement
    def anchoring_points(self, key: BlockHash) -> Sequence[BlockHash]:
        """Usable hit points ending at full-attention ``key``."""
        return [p for p in self.points_at.get(key, ()) if p in self.counted]

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Recompute usable points and anchoring from the pool's index and compare."""
        pool = self.pool
        fa_index = pool.group_index(self.chain_group_id)
        if set(fa_index) != set(self.parent):
            raise InvariantViolation("flops: tracked full-attention hashes differ from the "
                                     "pool's index")
        usable: set[BlockHash] = set()
        for point in self.num_groups_present:
            complete = all(pool.get_cached_block(point, g) is not None
                           for g in self.point_group_ids)
            if complete and self._chain_intact(
                    self.point_end.get(point)):
                usable.add(point)
        if usable != self.counted:
            raise InvariantViolation(f"flops: usable points {len(usable)} but "
                                     f"{len(self.counted)} counted")
        anchored: set[BlockHash] = set()
        for point in usable:
            node = self.point_end.get(point)
            while node is not None and node != ROOT and node not in anchored:
                anchored.add(node)
                node = self.parent.get(node)
        if self.point_group_ids:
            tracked = {k for k in self.parent if self.is_anchored(k)}
            if tracked != anchored:
                raise InvariantViolation(f"flops: {len(tracked)} anchored, recomputed "
                                         f"{len(anchored)}")
        for queue_id, queue in enumerate(pool.queues):
            if queue_id == DEAD_QUEUE:
                continue
            for block in queue:
                if block.block_hash is not None and self.worthless(block):
                    raise InvariantViolation(f"flops: worthless {block!r} in live queue "
                                             f"{queue_id}")

    def _chain_intact(self, key: BlockHash | None) -> bool:
        while key is not None and key != ROOT:
            if key not in self.parent or key in self.broken:
                return False
            key = self.parent[key]
        return key == ROOT
