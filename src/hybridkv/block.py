"""Block (one page of one cache group) and FreeBlockQueue (intrusive doubly linked list).

The free queue *is* the eviction order: the head is reused (and, if it still carries a hash,
evicted) first. Every operation is O(1) per block and allocates no Python objects, because the
links live on the blocks themselves (``prev_free`` / ``next_free``).

>>> blocks = [Block(i) for i in range(6)]
>>> queue = FreeBlockQueue(blocks[:1])
>>> queue.prepend_n([blocks[4], blocks[5]]); [b.block_id for b in queue]
[4, 5, 0]
>>> queue.prepend_n([blocks[1], blocks[2]]); [b.block_id for b in queue]
[1, 2, 4, 5, 0]
>>> queue.remove(blocks[4]); [b.block_id for b in queue.popleft_n(2)], len(queue)
([1, 2], 2)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from hybridkv.errors import InvariantViolation
from hybridkv.ids import BlockHash, GroupId

DEAD_QUEUE, FREE_QUEUE, PROTECTED_QUEUE, SESSION_QUEUE, PINNED_QUEUE = range(5)
"""Free queues of a pool, in allocation (eviction) order."""


@dataclass(slots=True, eq=False)
class Block:
    """One physical block of the pool.

    Invariants (checked by ``BlockPool.check_invariants``):
        - ``ref_count`` equals the number of request block tables holding the block;
        - ``ref_count == 0`` and not null ⇔ the block is linked in exactly one free tier;
        - ``block_hash is None`` ⇔ ``hash_group_id is None``;
        - the null block is never hashed, never linked and its ``ref_count`` stays 0.
    """

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    hash_group_id: GroupId | None = None
    is_null: bool = False
    queue_id: int | None = None
    """Which free queue of the pool links the block (``None`` while held)."""
    num_hits: int = 0
    """Prefix hits on the block since it was cached (eviction policies read it)."""
    parent_hash: BlockHash | None = None
    """Full-attention hash the block's usefulness depends on (``chain`` eviction only)."""
    is_dead: bool = False
    """No hit can use the block any more (its full-attention prefix was evicted)."""
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)

    @property
    def is_pinned(self) -> bool:
        return self.queue_id == PINNED_QUEUE

    @is_pinned.setter
    def is_pinned(self, value: bool) -> None:
        self.queue_id = PINNED_QUEUE if value else (
            None if self.queue_id == PINNED_QUEUE else self.queue_id)

    def __repr__(self) -> str:
        hashed = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"Block({self.block_id}, ref={self.ref_count}{hashed})"


class FreeBlockQueue:
    """Free blocks in eviction order: a head stack, then an intrusive doubly linked list.

    ``prepend_n`` pushes onto a Python list used as a stack (its top is the queue head), so
    scratch blocks that are released and reallocated step after step — the window blocks of a
    long prefill — cost list slicing, not pointer surgery. ``append_n`` links at the tail of
    the list with head/tail sentinels; ``remove`` unlinks from the middle in O(1). Only
    unhashed blocks are ever prepended, and those are never touched by a hit, so removing a
    stacked block (O(n)) does not happen on any hot path.

    A queue stamps its ``queue_id`` on every block it links (``Block.queue_id``); whoever
    takes a block out clears it.

    Invariants:
        - walking ``next_free`` from the head sentinel reaches the tail sentinel after
          ``len(self) - len(stack)`` blocks, and ``prev_free`` links mirror ``next_free``;
        - stacked blocks carry no links; no block is both stacked and linked;
        - sentinels never leave the list and are never returned.
    """

    def __init__(self, blocks: Iterable[Block] = (), queue_id: int | None = None) -> None:
        self.queue_id = queue_id
        self._head = Block(-1)
        self._tail = Block(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._stack: list[Block] = []  # reversed: the queue head is the last element
        self.num_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_blocks

    def __iter__(self) -> Iterator[Block]:
        yield from reversed(self._stack)
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def peek_head(self) -> Block | None:
        """The block ``popleft`` would return, or ``None`` when empty. Does not modify."""
        if self._stack:
            return self._stack[-1]
        first = self._head.next_free
        return None if first is self._tail else first

    def popleft(self) -> Block:
        """Unlink and return the head block (the next eviction victim)."""
        if self.num_blocks == 0:
            raise InvariantViolation("popleft() on an empty FreeBlockQueue")
        return self.popleft_n(1)[0]

    def popleft_n(self, num_blocks: int) -> list[Block]:
        """Unlink and return the first ``num_blocks`` blocks, head first."""
        if num_blocks > self.num_blocks:
            raise InvariantViolation(
                f"popleft_n({num_blocks}) with only {self.num_blocks} free blocks"
            )
        stack = self._stack
        from_stack = min(num_blocks, len(stack))
        if from_stack:
            taken = stack[len(stack) - from_stack :]
            taken.reverse()
            del stack[len(stack) - from_stack :]
        else:
            taken = []
        remaining = num_blocks - from_stack
        if remaining:
            node = self._head.next_free
            for _ in range(remaining):  # the count bounds the walk: never reaches the tail
                taken.append(node)  # type: ignore[arg-type]
                nxt = node.next_free  # type: ignore[union-attr]
                node.prev_free = node.next_free = None  # type: ignore[union-attr]
                node = nxt
            self._head.next_free = node
            assert node is not None
            node.prev_free = self._head
        self.num_blocks -= num_blocks
        return taken

    def remove(self, block: Block) -> None:
        """Unlink ``block`` from anywhere in the queue (a cache hit "touches" it)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            try:
                self._stack.remove(block)
            except ValueError:
                raise InvariantViolation(
                    f"remove() of {block!r}, which is not in this queue") from None
            self.num_blocks -= 1
            return
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def append_n(self, blocks: Iterable[Block]) -> None:
        """Link ``blocks`` at the tail in the given order (evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        self._splice(last, self._tail, blocks if isinstance(blocks, list) else list(blocks))

    def push_front_n(self, blocks: Iterable[Block]) -> None:
        """Link ``blocks`` at the front of the linked list, behind the head stack, in the
        given order: reused after every stacked block and before every block linked earlier
        (``predict`` eviction files predicted-dead cached blocks here).

        >>> b = [Block(i) for i in range(5)]
        >>> q = FreeBlockQueue(b[:2]); q.prepend_n([b[2]]); q.push_front_n([b[3], b[4]])
        >>> [x.block_id for x in q]
        [2, 3, 4, 0, 1]
        """
        first = self._head.next_free
        assert first is not None
        self._splice(self._head, first, blocks if isinstance(blocks, list) else list(blocks))

    def _splice(self, before: Block, after: Block, blocks: list[Block]) -> None:
        """Link ``blocks``, in order, between the adjacent nodes ``before`` and ``after``."""
        last = before
        count = 0
        queue_id = self.queue_id
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            block.queue_id = queue_id
            last = block
            count += 1
        last.next_free = after
        after.prev_free = last
        self.num_blocks += count

    def prepend_n(self, blocks: Iterable[Block]) -> None:
        """Put ``blocks`` in front of the head, keeping their order (reused first)."""
        self.prepend_owned(list(blocks))

    def prepend_owned(self, blocks: list[Block]) -> None:
        """``prepend_n(blocks)`` for a list the caller gives up: it is reversed in place
        and pushed as it is (no copy)."""
        blocks.reverse()
        queue_id = self.queue_id
        for block in blocks:
            block.queue_id = queue_id
        self._stack.extend(blocks)
        self.num_blocks += len(blocks)

    def check_links(self) -> list[Block]:
        """Verify the stack, the links and the count; return the blocks in queue order."""
        stacked = list(reversed(self._stack))
        for block in stacked:
            if block.prev_free is not None or block.next_free is not None:
                raise InvariantViolation(f"stacked {block!r} also carries links")
        seen: list[Block] = []
        node = self._head
        while True:
            nxt = node.next_free
            if nxt is None or nxt.prev_free is not node:
                raise InvariantViolation(f"broken free-queue link after {node!r}")
            if nxt is self._tail:
                break
            seen.append(nxt)
            if len(seen) > self.num_blocks:
                raise InvariantViolation("free queue longer than its count (cycle?)")
            node = nxt
        ordered = stacked + seen
        if len(ordered) != self.num_blocks or len({id(b) for b in ordered}) != len(ordered):
            raise InvariantViolation(f"free queue holds {len(ordered)} blocks (with duplicates?)"
                                     f", count says {self.num_blocks}")
        return ordered
