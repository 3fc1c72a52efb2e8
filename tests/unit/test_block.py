"""FreeBlockQueue: intrusive list operations and their ordering contract (vllm-kv-cache.md §1.3)."""

from __future__ import annotations

import pytest

from hybridkv.block import Block, FreeBlockQueue
from hybridkv.errors import InvariantViolation


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue.check_links()]


def test_initial_order_is_the_given_order() -> None:
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert len(queue) == 5
    assert queue.peek_head() is blocks[0]


def test_prepend_n_keeps_order_and_counts() -> None:
    """§6.3 test_free_kv_cache_block_queue_prepend_n: [b0] → prepend [b4,b5] → prepend [b1,b2]
    gives b1,b2,b4,b5,b0 with counts 1 → 3 → 5."""
    blocks = [Block(i) for i in range(6)]
    queue = FreeBlockQueue([blocks[0]])
    assert len(queue) == 1
    queue.prepend_n([blocks[4], blocks[5]])
    assert ids(queue) == [4, 5, 0]
    assert len(queue) == 3
    queue.prepend_n([blocks[1], blocks[2]])
    assert ids(queue) == [1, 2, 4, 5, 0]
    assert len(queue) == 5
    # the structural check agrees with iteration, and popping follows the same order
    assert [b.block_id for b in queue.check_links()] == [1, 2, 4, 5, 0]
    assert [b.block_id for b in queue.popleft_n(3)] == [1, 2, 4]
    queue.remove(blocks[0])  # from the linked part
    queue.remove(blocks[5])  # from the prepended part
    assert len(queue) == 0 and queue.peek_head() is None and queue.check_links() == []


def test_prepend_and_append_on_empty_queue() -> None:
    blocks = [Block(i) for i in range(4)]
    queue = FreeBlockQueue()
    assert queue.peek_head() is None
    queue.prepend_n([blocks[2], blocks[3]])
    queue.append_n([blocks[0]])
    queue.prepend_n([])
    queue.append_n([])
    assert ids(queue) == [2, 3, 0]


def test_popleft_popleft_n_and_remove() -> None:
    blocks = [Block(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[3])  # a cache hit touches a block in the middle
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    taken = queue.popleft_n(2)
    assert [b.block_id for b in taken] == [1, 2]
    assert all(b.prev_free is None and b.next_free is None for b in taken)
    assert ids(queue) == [4, 5]
    assert queue.popleft_n(0) == []
    assert [b.block_id for b in queue.popleft_n(2)] == [4, 5]
    assert ids(queue) == [] and len(queue) == 0


def test_misuse_raises_invariant_violation() -> None:
    blocks = [Block(i) for i in range(3)]
    queue = FreeBlockQueue(blocks[:1])
    with pytest.raises(InvariantViolation, match="empty FreeBlockQueue"):
        FreeBlockQueue().popleft()
    with pytest.raises(InvariantViolation, match=r"popleft_n\(2\) with only 1"):
        queue.popleft_n(2)
    with pytest.raises(InvariantViolation, match="not in this queue"):
        queue.remove(blocks[2])


def test_check_links_detects_a_corrupted_list() -> None:
    blocks = [Block(i) for i in range(3)]
    queue = FreeBlockQueue(blocks)
    blocks[1].prev_free = blocks[2]  # break the mirror link
    with pytest.raises(InvariantViolation, match="broken free-queue link"):
        queue.check_links()
    queue = FreeBlockQueue([Block(i) for i in range(3)])
    queue.num_blocks = 2  # count disagrees with the walk
    with pytest.raises(InvariantViolation, match="longer than its count"):
        queue.check_links()
    queue.num_blocks = 4
    with pytest.raises(InvariantViolation, match="count says 4"):
        queue.check_links()


def test_block_repr_shows_hash_prefix() -> None:
    block = Block(7, ref_count=2)
    assert repr(block) == "Block(7, ref=2)"
    block.block_hash = b"\xab\xcd\xef\x01\x02"  # type: ignore[assignment]
    assert repr(block) == "Block(7, ref=2, hash=abcdef01)"
