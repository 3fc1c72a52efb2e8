"""Sliding window: a hit at ``p`` needs only the ``ceil((w - 1) / bs)`` blocks ending at ``p``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.block import Block
from hybridkv.ids import BlockHash, GroupId
from hybridkv.managers.base import GroupManager, blocks_in_every_group
from hybridkv.pool import BlockPool
from hybridkv.specs import LayerSpec, SlidingWindowSpec


class SlidingWindowManager(GroupManager):
    """Right-to-left search for the rightmost run of contiguous cached blocks ending on an
    aligned boundary; blocks that slide out of the window are released immediately."""

    @property
    def window_spec(self) -> SlidingWindowSpec:
        assert isinstance(self.spec, SlidingWindowSpec)
        return self.spec

    def num_tail_blocks(self) -> int:
        """Tail blocks a hit needs, plus EAGLE's peek block."""
        return self.window_spec.num_tail_blocks + (1 if self.use_eagle else 0)

    def next_release_tokens(self, num_computed_tokens: int) -> int:
        """Block ``k`` (0-based) leaves once ``n - w + 1 >= (k + 1) * bs``.

        >>> from hybridkv.specs import SlidingWindowSpec
        >>> # bs 2, w 4: 5 tokens skip 2 (block 0 out); block 1 leaves at 4 + 3 = 7 tokens
        >>> SlidingWindowManager.release_threshold(SlidingWindowSpec(2, 1, 4), 5)
        7
        """
        return self.release_threshold(self.window_spec, num_computed_tokens)

    @staticmethod
    def release_threshold(spec: SlidingWindowSpec, num_computed_tokens: int) -> int:
        num_out = spec.num_skipped_tokens(num_computed_tokens) // spec.block_size
        return (num_out + 1) * spec.block_size + spec.sliding_window - 1

    def hit_tail_blocks(self, num_tokens: int) -> int | None:
        """The ``need`` blocks ending at ``p``, or the run from block 0 when shorter.

        >>> from hybridkv.specs import SlidingWindowSpec
        >>> spec = SlidingWindowSpec(block_size=4, kv_bytes_per_token=1, sliding_window=8)
        >>> SlidingWindowManager.tail_for(spec, 4), SlidingWindowManager.tail_for(spec, 12)
        (1, 2)
        """
        return self.tail_for(self.window_spec, num_tokens)

    @staticmethod
    def tail_for(spec: SlidingWindowSpec, num_tokens: int) -> int:
        return min(spec.num_tail_blocks, num_tokens // spec.block_size)

    def max_hit_tail_blocks(self) -> int:
        return self.window_spec.num_tail_blocks

    def bridge_tail_blocks(self) -> int:
        # EAGLE's tail at F is [F/bs - need, F/bs + 1): it starts at the same block
        return self.window_spec.num_tail_blocks

    def admission_cap_blocks(self, max_num_batched_tokens: int, max_model_len: int | None,
                             ) -> int | None:
        """``ceil(min(w - 1 + in_flight, max_len) / bs) + 1`` (the window may straddle)."""
        span = self.window_spec.sliding_window - 1 + max_num_batched_tokens
        if max_model_len is not None:
            span = min(span, max_model_len)
        return -(-span // self.block_size) + 1

    def cache_mask(self, start: int, end: int, boundaries: Sequence[int]) -> list[bool] | None:
        return self.retention.window_mask(
            start, end, block_size=self.block_size, alignment_tokens=self.alignment_tokens,
            num_tail_blocks=self.num_tail_blocks(), shift=1 if self.use_eagle else 0,
            boundaries=boundaries,
        )

    @classmethod
    def find_longest_hit(cls, pool: BlockPool, group_ids: Sequence[GroupId], spec: LayerSpec,
                         hashes: Sequence[BlockHash], max_num_tokens: int, *,
                         drop_eagle_block: bool, alignment_tokens: int,
                         ) -> tuple[list[list[Block]], int]:
        """Worked example (bs 8, w 8 → 1 tail block, ``A`` 32, cached blocks {3, 7}):
        max 64 tokens → hit 64 (``[null × 7, b7]``); max 63 → block 6 is not cached and
        block 3 ends on 32 → hit 32. A run that reaches block 0 is a hit even when shorter
        than the window (the prefix itself is shorter than the window).

        A window of 1 token needs no tail (``need`` 0): every aligned length up to the
        limit is a hit with an all-null table, whatever is cached (bs 4, ``A`` 8, max 14 →
        hit 8, two null blocks). vLLM 0.33 still demands one cached block there, so its
        masking policies (which hash no window block at all for w = 1) never hit."""
        assert isinstance(spec, SlidingWindowSpec)
        bs = spec.block_size
        need = spec.num_tail_blocks + (1 if drop_eagle_block else 0)
        num_blocks = min(max_num_tokens // bs, len(hashes))
        null = pool.null_block
        if need == 0:  # w = 1: a position reads only its own KV, so any prefix is a hit
            empty = [[null] * num_blocks for _ in group_ids]
            _trim_to_alignment(empty, bs, alignment_tokens)
            return empty, len(empty[0]) * bs
        getters = [pool.group_index(g).get for g in group_ids]
        if bs == alignment_tokens and not drop_eagle_block:
            found_tables = _search_with_jumps(getters, null, hashes, num_blocks, need)
            return found_tables, len(found_tables[0]) * bs
        tables: list[list[Block]] = [[null] * num_blocks for _ in group_ids]
        run = 0
        found_run = False
        for i in range(num_blocks - 1, -1, -1):
            hits = blocks_in_every_group(getters, hashes[i])
            if hits is None:
                run = 0
                continue
            if run == 0 and bs != alignment_tokens:
                num_end_blocks = i if drop_eagle_block else i + 1
                if (num_end_blocks * bs) % alignment_tokens:
                    continue
            for table, block in zip(tables, hits, strict=True):
                table[i] = block
            run += 1
            if run >= need:
                del_from = i + run
                for table in tables:
                    del table[del_from:]
                found_run = True
                break
        _close_scan(tables, None if found_run else run, drop_eagle_block, bs, alignment_tokens)
        return tables, len(tables[0]) * bs


def _close_scan(tables: list[list[Block]], run_from_start: int | None, drop_eagle_block: bool,
                block_size: int, alignment_tokens: int) -> None:
    """Finish a right-to-left scan: without a full tail (``run_from_start`` set) keep the
    cached run from block 0, aligned; then apply the EAGLE drop (one block, re-aligned)."""
    if run_from_start is not None:
        for table in tables:
            del table[run_from_start:]
        _trim_to_alignment(tables, block_size, alignment_tokens)
    if drop_eagle_block and tables[0]:
        for table in tables:
            table.pop()
        _trim_to_alignment(tables, block_size, alignment_tokens)


def _search_with_jumps(getters: Sequence[Callable[[BlockHash], Block | None]], null: Block,
                       hashes: Sequence[BlockHash], num_blocks: int, need: int,
                       ) -> list[list[Block]]:
    """The right-to-left search when every block end is aligned and nothing is dropped:
    the rightmost ``need`` consecutive blocks cached in every group, else the cached run
    starting at block 0. A candidate window ``[end - need, end)`` is probed at its left
    block first: when that one is missing, no window containing it can hit, so the search
    jumps ``need`` blocks at once (latest retention leaves long uncached stretches).

    Worked example (need 4, cached {0, 1, 8, 9, 10, 11, 12}, 20 blocks): window [16, 20):
    16 missing → end 16; [12, 16): 12 cached, 15 missing → end 15; [11, 15): 14 missing →
    end 14; [10, 14): 13 missing → end 13; [9, 13): all cached → hit 13 blocks.
    """
    end = num_blocks
    while end >= need:
        first = blocks_in_every_group(getters, hashes[end - need])
        if first is None:
            end -= need
            continue
        window = [first]  # probed right to left below, then put back in order
        for k in range(end - 1, end - need, -1):
            found = blocks_in_every_group(getters, hashes[k])
            if found is None:
                end = k
                break
            window.append(found)
        else:
            window[1:] = window[:0:-1]
            return [[null] * (end - need) + [found[g] for found in window]
                    for g in range(len(getters))]
    run: list[list[Block]] = []
    while len(run) < min(need, num_blocks):
        found = blocks_in_every_group(getters, hashes[len(run)])
        if found is None:
            break
        run.append(found)
    return [[found[g] for found in run] for g in range(len(getters))]


def _trim_to_alignment(tables: list[list[Block]], block_size: int, alignment_tokens: int) -> None:
    while tables[0] and (len(tables[0]) * block_size) % alignment_tokens:
        for table in tables:
            table.pop()
