"""Sibling groups: cache groups with an identical spec, processed in one pool call each.

Siblings always hold tables of the same length with nulls at the same positions (same
allocations, same hits, same releases), so one pool call can serve all of them. The calls
are arranged to leave the free queue exactly as one call per group, in group order, would:

- allocation: popping ``k * n`` blocks and dealing member ``i`` the slice ``[i*n, (i+1)*n)``
  equals ``k`` pops of ``n``;
- release: per-group calls prepend each group's scratch in turn (so the *last* group's
  scratch ends up first) and append cached blocks in group order; ``free_grouped`` does the
  same in one pass.

Used only when no eviction policy re-orders blocks; otherwise each group is called on its
own. The pinned tier (``pin:T``) is a queue of its own, linked in group order either way.

Worked example (gemma3-bench: 5 window groups of 16-token blocks): an 8,192-token chunk
allocates 5 × 512 blocks in one ``allocate(2560)`` instead of five ``allocate(512)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.block import Block
from hybridkv.ids import BlockHash, ReqId
from hybridkv.managers.base import (
    CacheUnit,
    GroupManager,
    live_blocks_tail_first,
    released_span,
)
from hybridkv.pool import BlockPool


class SiblingBatch(CacheUnit):
    """Members (in group order) of one spec group."""

    def __init__(self, members: Sequence[GroupManager], pool: BlockPool) -> None:
        self.members = list(members)
        self.lead = self.members[0]
        self.pool = pool
        self.block_size = members[0].block_size

    def allocate_into(self, req_id: ReqId, num_tokens: int, num_main_tokens: int,
                      out: list[list[Block]]) -> None:
        del num_main_tokens  # siblings of a lookahead-ignoring kind are never batched
        out.extend(self.allocate_new_blocks(req_id, num_tokens))

    def allocate_new_blocks(self, req_id: ReqId, num_tokens: int) -> list[list[Block]]:
        tables = [m.tables.setdefault(req_id, []) for m in self.members]
        for member in self.members:
            member.num_cached_blocks.setdefault(req_id, 0)
        num_new = -(-num_tokens // self.block_size) - len(tables[0])
        if num_new <= 0:
            return [[] for _ in self.members]
        taken = self.pool.allocate(num_new * len(self.members))
        dealt: list[list[Block]] = []
        for i, table in enumerate(tables):
            mine = taken[i * num_new : (i + 1) * num_new]
            table.extend(mine)
            dealt.append(mine)
        return dealt

    def cache_blocks(self, req_id: ReqId, hashes: Sequence[BlockHash], hash_block_size: int,
                     num_tokens: int, boundaries: Sequence[int],
                     bridge_end_tokens: int = 0) -> None:
        """One cache plan (window mask) for all members: their tables and counters agree."""
        first = self.members[0]
        plan = first.cache_plan(req_id, hashes, hash_block_size, num_tokens, boundaries,
                                bridge_end_tokens)
        num_cached = first.num_cached_blocks.get(req_id, 0)
        if plan is not None and plan[2] is not None and True not in plan[2]:
            # the mask keeps no block (``latest`` between boundaries: almost every call):
            # ``apply_cache_plan`` would only move each member's counter to the plan's end
            for member in self.members:
                member.num_cached_blocks[req_id] = plan[1]
            return
        for member in self.members:
            if plan is not None:
                member.apply_cache_plan(req_id, hashes, hash_block_size, plan)
            elif member is not first and req_id in member.num_cached_blocks:
                member.num_cached_blocks[req_id] = num_cached  # a skipped bridge, if any

    def remove_skipped_blocks(self, req_id: ReqId, num_computed_tokens: int) -> None:
        first = self.members[0]
        null = self.pool.null_block
        num_skipped = first.num_skipped_tokens(num_computed_tokens)
        span = released_span(first.tables.get(req_id), num_skipped, self.block_size, null)
        if span is None:
            return
        start, last = span
        released: list[list[Block]] = []
        nulls = [null] * (last + 1 - start)
        for member in self.members:
            member_table = member.tables[req_id]
            segment = member_table[start : last + 1]
            segment.reverse()  # newest first, as a per-group release
            member_table[start : last + 1] = nulls
            released.append(segment)
        self.pool.free_grouped(
            [part for segment in released
             for part in first.release_parts(segment, last, num_skipped)],
            first.retention.scratch_tier)

    def next_release_tokens(self, num_computed_tokens: int) -> int:
        return self.members[0].next_release_tokens(num_computed_tokens)

    def free(self, req_id: ReqId, session_id: str | None = None) -> None:
        """Release every member's blocks (batched only without an eviction policy, the one
        reader of ``session_id``)."""
        del session_id
        released: list[list[Block]] = []
        for member in self.members:
            table = member.tables.pop(req_id, None)
            member.num_cached_blocks.pop(req_id, None)
            if table:
                released.append(live_blocks_tail_first(table, self.pool.null_block))
        if released:
            retention = self.members[0].retention
            self.pool.free_grouped([(blocks, retention.cached_tier) for blocks in released],
                                   retention.scratch_tier)
