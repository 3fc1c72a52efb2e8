"""The jumping window hit search equals the plain right-to-left scan it replaces."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.block import Block
from hybridkv.ids import BlockHash
from hybridkv.managers.window import _search_with_jumps


def plain_scan(cached: list[set[int]], num_blocks: int, need: int) -> tuple[int, int]:
    """(end, start) of the hit: rightmost ``need`` blocks cached in every group, else the
    run of cached blocks from block 0."""
    run = 0
    for i in range(num_blocks - 1, -1, -1):
        if all(i in group for group in cached):
            run += 1
            if run >= need:
                return i + run, i
        else:
            run = 0
    return run, 0


@given(num_blocks=st.integers(0, 40), need=st.integers(1, 6), num_groups=st.integers(1, 3),
       data=st.data())
def test_jumps_equal_plain_scan(num_blocks: int, need: int, num_groups: int,
                                data: st.DataObject) -> None:
    cached = [set(data.draw(st.lists(st.integers(0, num_blocks), max_size=num_blocks)))
              for _ in range(num_groups)]
    if data.draw(st.booleans()):  # dense stretches make long runs likely
        lo = data.draw(st.integers(0, num_blocks))
        for group in cached:
            group.update(range(lo, min(num_blocks, lo + data.draw(st.integers(0, 12)))))
    hashes = [BlockHash(bytes([i])) for i in range(num_blocks)]
    blocks = [{hashes[i]: Block(1000 * g + i) for i in group if i < num_blocks}
              for g, group in enumerate(cached)]
    null = Block(0)
    tables = _search_with_jumps([b.get for b in blocks], null, hashes, num_blocks, need)
    end, start = plain_scan(cached, num_blocks, need)
    assert all(len(t) == end for t in tables)
    for g, table in enumerate(tables):
        assert all(b is null for b in table[:start])
        assert [b.block_id for b in table[start:]] == [1000 * g + i for i in range(start, end)]
