"""BlockPool: the fixed set of blocks, its free queues and the hash index.

A block is held by requests (``ref_count > 0``) or linked in exactly one free queue. Freed
blocks keep their hash and stay hittable until they are reallocated; reallocating a hashed
block evicts it. Allocation takes blocks from the free queues in this order::

    dead  →  free (scratch at the head, then LRU)  →  protected  →  session  →  pinned

``dead``, ``protected`` and ``session`` are filled only by eviction policies (``chain``,
``scan``, ``session``); ``pinned`` only by the ``pin:T`` retention policy. ``predict`` links
predicted-dead cached blocks at the front of the free queue's linked list, behind the
scratch head stack (``FreeBlockQueue.push_front_n``). With the default
``lru`` eviction every freed block goes to the one free queue, exactly as in vLLM. Since
allocation falls through every queue, no tier can ever stall allocation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from itertools import islice

from hybridkv.block import (
    DEAD_QUEUE,
    FREE_QUEUE,
    PINNED_QUEUE,
    PROTECTED_QUEUE,
    SESSION_QUEUE,
    Block,
    FreeBlockQueue,
)
from hybridkv.errors import CapacityError, InvariantViolation
from hybridkv.ids import BlockHash, GroupId


class FreeTier(IntEnum):
    """Where a block whose ``ref_count`` dropped to 0 goes."""

    HEAD = 0  # head of the free queue: scratch that can never produce a hit
    TAIL = 1  # tail of the free queue: LRU (or probation under ``scan``)
    PINNED = 2  # pinned tier: reused only when every other queue is empty
    DEAD = 3  # reused before everything: cached, but no hit can use it any more
    PROTECTED = 4  # ``scan``: hit at least once since cached
    SESSION = 5  # ``session``: latest prompt of a live conversation


_QUEUE_OF_TIER = (FREE_QUEUE, FREE_QUEUE, PINNED_QUEUE, DEAD_QUEUE, PROTECTED_QUEUE,
                  SESSION_QUEUE)


def _drop_references(blocks: list[Block], split: bool,
                     ) -> tuple[list[Block], list[Block]]:
    """Drop one reference on each non-null block; return those reaching 0 as (unhashed
    scratch, hashed), each in the given order — or, with ``split`` false, all of them in
    the given order as the first list (both classes go to the same tier).

    ``blocks`` is a list and the appends are direct method calls: compiled, the loop is
    an indexed C loop with native list appends (an ``Iterable`` parameter or a bound
    ``append`` held in a variable makes every step a generic Python call)."""
    scratch: list[Block] = []
    cached: list[Block] = scratch if not split else []
    for block in blocks:
        if block.is_null:
            continue
        ref_count = block.ref_count - 1
        if ref_count == 0:
            block.ref_count = 0
            if block.block_hash is None:
                scratch.append(block)
            else:
                cached.append(block)
        elif ref_count > 0:
            block.ref_count = ref_count
        else:
            raise InvariantViolation(f"free of {block!r} whose ref_count is already 0")
    return scratch, (cached if split else [])


class EvictionHook(ABC):
    """What the pool calls on its eviction policy (``hybridkv.eviction.EvictionPolicy``
    implements it): declared here so that the pool imports no eviction code."""

    @abstractmethod
    def on_cached(self, block: Block, parent_hash: BlockHash | None) -> None:
        """``block`` was given its hash (``parent_hash``: the previous block's)."""

    @abstractmethod
    def on_evicted(self, pool: BlockPool, block: Block, block_hash: BlockHash,
                   group_id: GroupId, *, still_cached: bool) -> None:
        """``block`` lost ``block_hash`` (``still_cached``: another copy keeps it indexed)."""

    @abstractmethod
    def place(self, pool: BlockPool, blocks: list[Block], default_tier: FreeTier,
              session_id: str | None) -> None:
        """Link freed hashed blocks (ref 0), in order, into their queues."""

    @abstractmethod
    def start_release(self, pool: BlockPool, session_id: str | None,
                      num_output_tokens: int | None = None) -> None:
        """A request is about to release its groups' blocks (the coordinator calls it;
        ``end_release`` follows)."""

    @abstractmethod
    def end_release(self, pool: BlockPool) -> None:
        """The release that ``start_release`` opened is over."""

    @abstractmethod
    def check_invariants(self, pool: BlockPool) -> None:
        """Verify the policy's invariants (from the pool's ``check_invariants``)."""


class BlockPool:
    """A pool of ``num_blocks`` blocks; block 0 is the reserved null block.

    Invariants (``check_invariants``):
        - every non-null block is in exactly one of {held, one free queue}, and its
          ``queue_id`` names that queue (``None`` while held);
        - a block is in a free queue ⇔ ``ref_count == 0``;
        - ``ref_count`` equals the number of holders the managers report;
        - every hash-index entry ``(group, hash) → block`` points to a block carrying exactly
          that hash and group, and every hashed block is indexed;
        - the null block is unhashed, unlinked and has ``ref_count == 0``.
    """

    def __init__(self, num_blocks: int, num_groups: int,
                 eviction: EvictionHook | None = None) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.queues = [FreeBlockQueue(queue_id=queue_id) for queue_id in range(5)]
        self.free_queue = self.queues[FREE_QUEUE]
        self.pinned_queue = self.queues[PINNED_QUEUE]
        self.free_queue.append_n(self.blocks[1:])
        # One primary block per (group, hash); extra physical copies with the same hash (two
        # requests computed the same prefix concurrently) wait in ``_duplicates`` so that
        # block tables stay append-only (no dedup).
        self._index: list[dict[BlockHash, Block]] = [{} for _ in range(num_groups)]
        self._duplicates: list[dict[BlockHash, list[Block]]] = [{} for _ in range(num_groups)]
        self.num_evicted_blocks = [0] * num_groups
        self.eviction = eviction
        self.epoch = 0
        """Bumped by every mutation that can invalidate a lookup result."""
        self.event_records: list[tuple[int, int, BlockHash]] | None = None
        """KV events on: every hash-index change is appended as ``(0, group, hash)``
        (cached) or ``(1, group, hash)`` (a cached copy lost its hash); ``hybridkv.events``
        turns them into vLLM-format events. ``None`` (off) costs one check per call."""

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: every free queue (cached-but-free blocks included)."""
        return sum(queue.num_blocks for queue in self.queues)

    @property
    def usage(self) -> float:
        """Fraction of non-null blocks held by requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash, group_id: GroupId) -> Block | None:
        """The cached block of ``group_id`` for ``block_hash``. Does not modify."""
        return self._index[group_id].get(block_hash)

    def group_index(self, group_id: GroupId) -> Mapping[BlockHash, Block]:
        """Read-only view of one group's hash → block index (hit searches probe it)."""
        return self._index[group_id]

    def num_cached_blocks(self, group_id: GroupId) -> int:
        return len(self._index[group_id]) + sum(
            len(v) for v in self._duplicates[group_id].values()
        )

    def index_mark(self, group_id: GroupId) -> int:
        """Hashes indexed in the group so far, counted so that it grows by exactly one per
        hash indexed: hashes indexed now plus those evicted (``drop_cached`` lowers it, as
        the dropped hashes leave without an eviction). Two marks ``m0 <= m1`` of the group
        ⇒ the hashes indexed between them that are still indexed are among
        ``newest_hashes(group_id, m1 - m0)``.

        >>> pool = BlockPool(4, 1)
        >>> a, b = pool.allocate(2)
        >>> pool.cache_block(a, BlockHash(b"x"), GroupId(0))
        >>> mark = pool.index_mark(GroupId(0))
        >>> pool.cache_block(b, BlockHash(b"y"), GroupId(0))
        >>> pool.index_mark(GroupId(0)) - mark, pool.newest_hashes(GroupId(0), 1)
        (1, [b'y'])
        """
        return len(self._index[group_id]) + self.num_evicted_blocks[group_id]

    def newest_hashes(self, group_id: GroupId, count: int) -> list[BlockHash]:
        """The ``count`` hashes indexed in the group most recently that are still indexed,
        newest first (fewer when fewer are indexed). The index is a dict, which keeps
        insertion order: the last ``count`` keys, read backwards."""
        return list(islice(reversed(self._index[group_id]), count))

    # ---------------------------------------------------------------- mutations
    def allocate(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` fresh blocks (ref 1), evicting hashes of reused ones.

        Raises:
            CapacityError: fewer blocks are free (callers check ``num_free_blocks`` first).
        """
        if num_blocks > self.num_free_blocks:
            raise CapacityError(
                f"allocate({num_blocks}) with {self.num_free_blocks} free blocks; "
                "check num_free_blocks (or use allocate_slots, which returns None)"
            )
        if num_blocks <= 0:
            return []
        self.epoch += 1
        taken: list[Block] = []
        for queue in self.queues:
            missing = num_blocks - len(taken)
            if missing == 0:
                break
            if queue.num_blocks:
                taken.extend(queue.popleft_n(min(missing, queue.num_blocks)))
        if self.eviction is None and self.event_records is None:
            # Fast path (no eviction policy, so nothing gets relinked; events off: ``_evict``
            # records them): one pass; a hashed
            # block whose hash has no duplicate copy is the primary entry of that hash.
            indexes, duplicates = self._index, self._duplicates
            evicted = self.num_evicted_blocks
            for block in taken:
                block.queue_id = None
                block.ref_count = 1
                block_hash = block.block_hash
                if block_hash is not None:
                    group_id: GroupId = block.hash_group_id  # type: ignore[assignment]
                    extra = duplicates[group_id]
                    if extra and block_hash in extra:  # (empty almost always)
                        self._evict(block)
                        continue
                    del indexes[group_id][block_hash]
                    block.block_hash = block.hash_group_id = None
                    block.num_hits = 0
                    evicted[group_id] += 1
            return taken
        hashed: list[Block] = []
        for block in taken:  # all unlinked first: evictions below may relink other blocks
            block.queue_id = None
            block.ref_count = 1
            if block.block_hash is not None:
                hashed.append(block)
        for block in hashed:
            self._evict(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on hit blocks, unlinking free ones from their queue."""
        self.epoch += 1
        queues = self.queues
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_count == 0:
                queue_id = block.queue_id
                assert queue_id is not None
                prev, nxt = block.prev_free, block.next_free
                if prev is not None and nxt is not None:  # ``remove`` inlined (hot path)
                    prev.next_free = nxt
                    nxt.prev_free = prev
                    block.prev_free = block.next_free = None
                    queues[queue_id].num_blocks -= 1
                else:
                    queues[queue_id].remove(block)
                block.queue_id = None
            block.ref_count += 1
            block.num_hits += 1

    def free_blocks(self, blocks: Iterable[Block], scratch_tier: FreeTier,
                    cached_tier: FreeTier, session_id: str | None = None) -> None:
        """Drop one reference on each block; blocks reaching 0 go to ``cached_tier`` if
        they carry a hash (unless the eviction policy places them), else ``scratch_tier``.

        Within each tier the given order is kept: callers pass a request's blocks tail first,
        so the end of a prefix chain is evicted before its beginning. ``session_id`` marks
        the release of a finished request of that session (session-aware eviction).
        """
        self.epoch += 1
        split = scratch_tier is not cached_tier or self.eviction is not None
        scratch, cached = _drop_references(
            blocks if isinstance(blocks, list) else list(blocks), split)
        if scratch:
            if scratch_tier is FreeTier.HEAD:  # a fresh list: pushed without a copy
                self.queues[_QUEUE_OF_TIER[FreeTier.HEAD]].prepend_owned(scratch)
            else:
                self.link(scratch, scratch_tier)
        if not cached:
            return
        if self.eviction is None:
            self.link(cached, cached_tier)
        else:
            self.eviction.place(self, cached, cached_tier, session_id)

    def free_grouped(self, parts: Sequence[tuple[Sequence[Block], FreeTier]],
                     scratch_tier: FreeTier) -> None:
        """``free_blocks(blocks, scratch_tier, cached_tier)`` of each part in turn, in one
        pass (no eviction policy): head insertions of later parts land in front of earlier
        ones, tail insertions after."""
        assert self.eviction is None
        self.epoch += 1
        head_lists: list[list[Block]] = []
        tail: list[Block] = []
        for blocks, cached_tier in parts:
            split = scratch_tier is not cached_tier
            scratch, cached = _drop_references(
                blocks if isinstance(blocks, list) else list(blocks), split)
            for released, tier in ((scratch, scratch_tier), (cached, cached_tier)):
                if tier is FreeTier.HEAD:
                    head_lists.append(released)
                elif tier is FreeTier.TAIL:
                    tail.extend(released)
                elif released:  # pinned: its own queue, linked in list order
                    self.link(released, tier)
        if head_lists:  # prepend_n of each part's list in turn: the last one ends first
            head_queue = self.queues[_QUEUE_OF_TIER[FreeTier.HEAD]]
            for released in head_lists:
                head_queue.prepend_owned(released)
        if tail:
            self.link(tail, FreeTier.TAIL)

    def link(self, blocks: list[Block], tier: FreeTier) -> None:
        """Link free (unlinked, ``ref_count == 0``) blocks into ``tier``, keeping order."""
        queue_id = _QUEUE_OF_TIER[tier]  # the queue stamps its id on the blocks
        if tier is FreeTier.HEAD:
            self.queues[queue_id].prepend_n(blocks)
        else:
            self.queues[queue_id].append_n(blocks)

    def move(self, block: Block, tier: FreeTier) -> None:
        """Relink a free block into ``tier`` (eviction policies demote/promote with it)."""
        assert block.queue_id is not None and block.ref_count == 0
        self.queues[block.queue_id].remove(block)
        self.link([block], tier)

    def cache_block(self, block: Block, block_hash: BlockHash, group_id: GroupId,
                    parent_hash: BlockHash | None = None) -> None:
        """Give a held, unhashed block its prefix hash so later lookups can hit it."""
        if block.block_hash is not None or block.is_null:
            raise InvariantViolation(f"cache_block({block!r}): block already hashed or null")
        block.block_hash = block_hash
        block.hash_group_id = group_id
        if self.event_records is not None:
            self.event_records.append((0, group_id, block_hash))
        index = self._index[group_id]
        if block_hash in index:
            self._duplicates[group_id].setdefault(block_hash, []).append(block)
        else:
            index[block_hash] = block
        if self.eviction is not None:
            self.eviction.on_cached(block, parent_hash)

    def cache_blocks(self, blocks: Sequence[Block], hashes: Sequence[BlockHash],
                     group_id: GroupId) -> None:
        """``cache_block`` of each ``(blocks[i], hashes[i])`` pair, without parent hashes (no
        ``chain`` eviction), in one pass; skips null and already-hashed blocks."""
        index = self._index[group_id]
        policy = self.eviction
        if self.event_records is not None:
            self.event_records.extend(
                (0, group_id, h) for b, h in zip(blocks, hashes, strict=True)
                if b.block_hash is None and not b.is_null)
        duplicates = self._duplicates[group_id]
        if len(blocks) != len(hashes):
            raise ValueError(f"cache_blocks: {len(blocks)} blocks but {len(hashes)} hashes")
        # lists, walked by index: compiled, a native loop (``zip(..., strict=True)`` is a
        # generic iterator building a tuple per pair)
        block_list = blocks if isinstance(blocks, list) else list(blocks)
        hash_list = hashes if isinstance(hashes, list) else list(hashes)
        for i in range(len(block_list)):
            block = block_list[i]
            block_hash = hash_list[i]
            if block.block_hash is not None or block.is_null:
                continue
            block.block_hash = block_hash
            block.hash_group_id = group_id
            # one probe: index it unless taken (called on the dict itself, not through a
            # bound method, so that mypyc emits its native dict call)
            if index.setdefault(block_hash, block) is not block:
                extra = duplicates.get(block_hash)
                if extra is None:
                    duplicates[block_hash] = [block]
                else:
                    extra.append(block)
            if policy is not None:
                policy.on_cached(block, None)

    def _evict(self, block: Block) -> None:
        """Remove ``block``'s hash from the index (its KV is about to be overwritten)."""
        block_hash, group_id = block.block_hash, block.hash_group_id
        assert block_hash is not None and group_id is not None
        index = self._index[group_id]
        extra = self._duplicates[group_id].get(block_hash)
        if index.get(block_hash) is block:
            if extra:
                index[block_hash] = extra.pop(0)
            else:
                del index[block_hash]
        elif extra is not None:
            extra.remove(block)
        else:
            raise InvariantViolation(f"{block!r} carries a hash that is not indexed")
        if extra is not None and not extra:
            del self._duplicates[group_id][block_hash]
        block.block_hash = None
        block.hash_group_id = None
        block.num_hits = 0
        self.num_evicted_blocks[group_id] += 1
        if self.event_records is not None:
            self.event_records.append((1, group_id, block_hash))
        if self.eviction is not None:
            self.eviction.on_evicted(self, block, block_hash, group_id,
                                     still_cached=block_hash in index)
        block.parent_hash = None
        block.is_dead = False

    # --------------------------------------------------------------- invariants
    def check_invariants(self, holders: Mapping[int, int]) -> None:
        """Verify the class invariants; ``holders`` maps block id → number of holders."""
        linked: dict[int, int] = {}
        for queue_id, queue in enumerate(self.queues):
            for block in queue.check_links():
                if block.block_id in linked:
                    raise InvariantViolation(f"{block!r} linked in two free queues")
                linked[block.block_id] = queue_id
        null = self.null_block
        if null.ref_count or null.block_hash is not None or null.block_id in linked:
            raise InvariantViolation("the null block was hashed, linked or referenced")
        for block in self.blocks[1:]:
            expected = holders.get(block.block_id, 0)
            if block.ref_count != expected:
                raise InvariantViolation(
                    f"{block!r}: ref_count {block.ref_count} but {expected} holders"
                )
            linked_in = linked.get(block.block_id)
            if (linked_in is not None) != (block.ref_count == 0):
                raise InvariantViolation(f"{block!r}: free-queue membership {linked_in}")
            if block.queue_id != linked_in:
                raise InvariantViolation(f"{block!r}: queue_id {block.queue_id} but linked in "
                                         f"{linked_in}")
            if (block.block_hash is None) != (block.hash_group_id is None):
                raise InvariantViolation(f"{block!r}: hash without group or group without hash")
        self._check_index()
        if self.eviction is not None:
            self.eviction.check_invariants(self)

    def _check_index(self) -> None:
        indexed: set[int] = set()
        for group_id, index in enumerate(self._index):
            for block_hash, block in index.items():
                copies = [block, *self._duplicates[group_id].get(block_hash, [])]
                for copy in copies:
                    if copy.block_hash != block_hash or copy.hash_group_id != group_id:
                        raise InvariantViolation(f"index entry points to {copy!r}")
                    if copy.block_id in indexed:
                        raise InvariantViolation(f"{copy!r} indexed twice")
                    indexed.add(copy.block_id)
            for block_hash in self._duplicates[group_id]:
                if block_hash not in index:
                    raise InvariantViolation("duplicate list without a primary entry")
        hashed = {b.block_id for b in self.blocks if b.block_hash is not None}
        if hashed != indexed:
            raise InvariantViolation(f"hashed but not indexed: {sorted(hashed - indexed)[:8]}")

    def cached_copies(self, block_hash: BlockHash, group_id: GroupId) -> list[Block]:
        """Every block of ``group_id`` cached under ``block_hash`` (primary first, then
        duplicate copies). Does not modify."""
        primary = self._index[group_id].get(block_hash)
        if primary is None:
            return []
        return [primary, *self._duplicates[group_id].get(block_hash, ())]

    def drop_cached(self, blocks: Iterable[Block]) -> int:
        """Remove the hashes of ``blocks`` on the caller's request (not counted as
        evictions); returns how many were hashed. A held block keeps its KV for the requests
        holding it (it just cannot be hit any more, and frees as scratch); a free one moves
        to the head of the free queue, reused first."""
        num_dropped = 0
        for block in blocks:
            group_id = block.hash_group_id
            if block.block_hash is None or group_id is None:
                continue
            self._evict(block)
            self.num_evicted_blocks[group_id] -= 1
            if block.ref_count == 0:
                self.move(block, FreeTier.HEAD)
            num_dropped += 1
        if num_dropped:
            self.epoch += 1
        return num_dropped

    def free_queue_order(self) -> list[int]:
        """Free block ids in the order ``allocate`` takes them: every queue (dead, free,
        protected, session, pinned), head first. Does not modify."""
        return [block.block_id for queue in self.queues for block in queue]

    def free_block_ids(self) -> Sequence[int]:
        """Free-queue order, head first (for tests and debugging). Does not modify."""
        return [b.block_id for b in self.free_queue]
