"""BlockPool: the fixed set of blocks, its free tiers and the hash index.

Blocks are in exactly one place at a time: held by requests (``ref_count > 0``), in the
normal free queue, or in the pinned free tier (``pin:T`` retention only). Freed blocks keep
their hash and stay hittable until they are reallocated; reallocating a hashed block evicts it.
Allocation takes from the free queue head and falls back to the oldest pinned blocks, so a
pinned tier can never stall allocation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum

from hybridkv.block import Block, FreeBlockQueue
from hybridkv.errors import CapacityError, InvariantViolation
from hybridkv.ids import BlockHash, GroupId


class FreeTier(IntEnum):
    """Where a block whose ``ref_count`` dropped to 0 goes."""

    HEAD = 0  # reused first: scratch that can never produce a hit
    TAIL = 1  # LRU: cached blocks, evicted after everything in front of them
    PINNED = 2  # pinned tier: reused only when the free queue is empty


class BlockPool:
    """A pool of ``num_blocks`` blocks; block 0 is the reserved null block.

    Invariants (``check_invariants``):
        - every non-null block is in exactly one of {held, free queue, pinned tier};
        - a block is in a free tier ⇔ ``ref_count == 0``; pinned tier ⇔ ``is_pinned``;
        - ``ref_count`` equals the number of holders the managers report;
        - every hash-index entry ``(group, hash) → block`` points to a block carrying exactly
          that hash and group, and every hashed block is indexed;
        - the null block is unhashed, unlinked and has ``ref_count == 0``.
    """

    def __init__(self, num_blocks: int, num_groups: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.pinned_queue = FreeBlockQueue()
        # One primary block per (group, hash); extra physical copies with the same hash (two
        # requests computed the same prefix concurrently) wait in ``_duplicates`` so that
        # block tables stay append-only (no dedup).
        self._index: list[dict[BlockHash, Block]] = [{} for _ in range(num_groups)]
        self._duplicates: list[dict[BlockHash, list[Block]]] = [{} for _ in range(num_groups)]
        self.num_evicted_blocks = [0] * num_groups
        self.epoch = 0
        """Bumped by every mutation that can invalidate a lookup result."""

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free queue plus pinned tier (cached-but-free included)."""
        return self.free_queue.num_blocks + self.pinned_queue.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of non-null blocks held by requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash, group_id: GroupId) -> Block | None:
        """The cached block of ``group_id`` for ``block_hash``. Does not modify."""
        return self._index[group_id].get(block_hash)

    def num_cached_blocks(self, group_id: GroupId) -> int:
        return len(self._index[group_id]) + sum(
            len(v) for v in self._duplicates[group_id].values()
        )

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
        from_queue = min(num_blocks, self.free_queue.num_blocks)
        taken = self.free_queue.popleft_n(from_queue)
        if from_queue < num_blocks:
            demoted = self.pinned_queue.popleft_n(num_blocks - from_queue)
            for block in demoted:
                block.is_pinned = False
            taken.extend(demoted)
        for block in taken:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on hit blocks, unlinking free ones from their tier."""
        self.epoch += 1
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_count == 0:
                if block.is_pinned:
                    self.pinned_queue.remove(block)
                    block.is_pinned = False
                else:
                    self.free_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[Block], scratch_tier: FreeTier,
                    cached_tier: FreeTier) -> None:
        """Drop one reference on each block; blocks reaching 0 go to ``cached_tier`` if
        they carry a hash, else to ``scratch_tier``.

        Within each tier the given order is kept: callers pass a request's blocks tail first,
        so the end of a prefix chain is evicted before its beginning.
        """
        self.epoch += 1
        scratch: list[Block] = []
        cached: list[Block] = []
        for block in blocks:
            if block.is_null:
                continue
            ref_count = block.ref_count - 1
            if ref_count < 0:
                raise InvariantViolation(f"free of {block!r} whose ref_count is already 0")
            block.ref_count = ref_count
            if ref_count == 0:
                (scratch if block.block_hash is None else cached).append(block)
        if scratch_tier is cached_tier:
            scratch.extend(cached)
            cached = []
        for tier, released in ((scratch_tier, scratch), (cached_tier, cached)):
            if not released:
                continue
            if tier is FreeTier.HEAD:
                self.free_queue.prepend_n(released)
            elif tier is FreeTier.TAIL:
                self.free_queue.append_n(released)
            else:
                for block in released:
                    block.is_pinned = True
                self.pinned_queue.append_n(released)

    def cache_block(self, block: Block, block_hash: BlockHash, group_id: GroupId) -> None:
        """Give a held, unhashed block its prefix hash so later lookups can hit it."""
        if block.block_hash is not None or block.is_null:
            raise InvariantViolation(f"cache_block({block!r}): block already hashed or null")
        block.block_hash = block_hash
        block.hash_group_id = group_id
        index = self._index[group_id]
        if block_hash in index:
            self._duplicates[group_id].setdefault(block_hash, []).append(block)
        else:
            index[block_hash] = block

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
        self.num_evicted_blocks[group_id] += 1

    # --------------------------------------------------------------- invariants
    def check_invariants(self, holders: Mapping[int, int]) -> None:
        """Verify the class invariants; ``holders`` maps block id → number of holders."""
        queued = {b.block_id for b in self.free_queue.check_links()}
        pinned = {b.block_id for b in self.pinned_queue.check_links()}
        null = self.null_block
        if null.ref_count or null.block_hash is not None or null.block_id in queued | pinned:
            raise InvariantViolation("the null block was hashed, linked or referenced")
        if queued & pinned:
            raise InvariantViolation(f"blocks in both free tiers: {sorted(queued & pinned)}")
        for block in self.blocks[1:]:
            expected = holders.get(block.block_id, 0)
            if block.ref_count != expected:
                raise InvariantViolation(
                    f"{block!r}: ref_count {block.ref_count} but {expected} holders"
                )
            is_free = block.block_id in queued or block.block_id in pinned
            if is_free != (block.ref_count == 0):
                raise InvariantViolation(f"{block!r}: free-tier membership {is_free}")
            if block.is_pinned != (block.block_id in pinned):
                raise InvariantViolation(f"{block!r}: is_pinned disagrees with the tier")
            if (block.block_hash is None) != (block.hash_group_id is None):
                raise InvariantViolation(f"{block!r}: hash without group or group without hash")
        self._check_index()

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

    def free_block_ids(self) -> Sequence[int]:
        """Free-queue order, head first (for tests and debugging). Does not modify."""
        return [b.block_id for b in self.free_queue]
