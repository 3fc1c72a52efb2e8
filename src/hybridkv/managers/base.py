"""GroupManager: per-cache-group block tables, caching and release; two hooks per subclass.

Block table of a request, index ``i`` covering tokens ``[i * bs, (i + 1) * bs)``::

    | null … null | tail blocks still in the window | blocks being filled |
    [0, skipped)   [skipped, num_cached_blocks)       [num_cached_blocks, len(table))

Subclasses implement ``find_longest_hit`` (a classmethod: lookups never modify anything) and
``admission_cap_blocks``; what a layer releases early comes from its spec.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from typing import ClassVar

from hybridkv.block import Block
from hybridkv.eviction import ROOT_PARENT
from hybridkv.ids import BlockHash, GroupId, ReqId
from hybridkv.policies import RetentionPolicy
from hybridkv.pool import BlockPool, FreeTier
from hybridkv.specs import CacheGroup, LayerSpec


def coarse_hashes(hashes: Sequence[BlockHash], ratio: int) -> Sequence[BlockHash]:
    """View hashes of ``hb``-token blocks as hashes of ``ratio * hb``-token blocks.

    The last fine hash inside a coarse block already chains the whole prefix.

    >>> coarse_hashes([b"a", b"b", b"c", b"d", b"e"], 2)
    [b'b', b'd']
    """
    if ratio == 1:
        return hashes
    return hashes[ratio - 1 :: ratio][: len(hashes) // ratio]


def live_blocks_tail_first(table: list[Block], null_block: Block) -> list[Block]:
    """The table's blocks after its leading nulls (nulls only ever form a prefix: released
    window blocks, skipped hit positions), last block first — the order a request frees in.

    >>> null = Block(0, is_null=True); a, b = Block(1), Block(2)
    >>> [x.block_id for x in live_blocks_tail_first([null, null, a, b], null)]
    [2, 1]
    """
    lo, hi = 0, len(table)
    while lo < hi:  # binary search for the first live block
        mid = (lo + hi) // 2
        if table[mid] is null_block:
            lo = mid + 1
        else:
            hi = mid
    live = table[lo:]
    live.reverse()
    return live


def released_span(table: list[Block] | None, num_skipped_tokens: int, block_size: int,
                  null_block: Block) -> tuple[int, int] | None:
    """Table indices ``(first, last)`` (inclusive) of the blocks that just left the window:
    the run of non-null blocks ending at the last fully skipped block, or ``None``.

    Worked example (bs 2, w 4, table of 6 live blocks): 7 computed tokens skip 4 tokens →
    blocks 0–1 leave → ``(0, 1)``; once they are null, 11 tokens (8 skipped) → ``(2, 3)``.
    """
    if num_skipped_tokens <= 0 or not table:
        return None
    last = min(num_skipped_tokens // block_size, len(table)) - 1
    if last < 0 or table[last] is null_block:
        return None
    first = last
    while first > 0 and table[first - 1] is not null_block:
        first -= 1
    return first, last


def blocks_in_every_group(getters: Sequence[Callable[[BlockHash], Block | None]],
                          block_hash: BlockHash) -> list[Block] | None:
    """The cached block of each group for ``block_hash`` (one index getter per group, e.g.
    ``pool.group_index(g).get``), or ``None`` as soon as one group misses: the per-position
    probe of every hit search over a spec group's siblings."""
    found: list[Block] = []
    for get in getters:
        block = get(block_hash)
        if block is None:
            return None
        found.append(block)
    return found


class CacheUnit:
    """What the coordinator drives at each step: one group's manager, or one batch of
    sibling groups with an identical spec (``hybridkv.siblings.SiblingBatch``).

    ``lead``: the manager whose answers stand for the unit (a batch's first member).

    A plain base (not an ``ABC``): under mypyc the subclasses of a compiled ABC share its
    ``isinstance`` cache, so a batch and a manager must not have an ABC root in common."""

    lead: GroupManager

    def allocate_into(self, req_id: ReqId, num_tokens: int, num_main_tokens: int,
                      out: list[list[Block]]) -> None:
        """Grow the unit's tables to ``num_tokens`` slots (``num_main_tokens`` where
        lookahead slots are not allocated); append each group's new blocks to ``out``."""
        raise NotImplementedError

    def cache_blocks(self, req_id: ReqId, hashes: Sequence[BlockHash], hash_block_size: int,
                     num_tokens: int, boundaries: Sequence[int],
                     bridge_end_tokens: int = 0) -> None:
        """Hash the newly full blocks the retention policy keeps."""
        raise NotImplementedError

    def remove_skipped_blocks(self, req_id: ReqId, num_computed_tokens: int) -> None:
        """Release the blocks no later token reads."""
        raise NotImplementedError

    def next_release_tokens(self, num_computed_tokens: int) -> int:
        """Computed tokens from which another block can leave."""
        raise NotImplementedError

    def free(self, req_id: ReqId, session_id: str | None = None) -> None:
        """Release the request's blocks (``session_id``: a finished request's session, for
        the eviction policy)."""
        raise NotImplementedError


class GroupManager(CacheUnit, metaclass=ABCMeta):
    """Block tables of one cache group.

    Invariants:
        - ``num_cached_blocks[req] <= len(tables[req])`` and only grows while the request runs;
        - every non-null block in a table holds one reference from that table.
    """

    is_full_attention: ClassVar[bool] = False
    covers_computed_tokens: ClassVar[bool] = True
    """A table of ``n`` blocks covers ``n * block_size`` token slots (not V4.1's ring)."""
    batches_siblings: ClassVar[bool] = True
    """Sibling groups of this kind may be processed by one ``SiblingBatch``."""
    eagle_margin: ClassVar[bool] = True
    """Under the EAGLE drop the coordinator lets the lookup peek one block past the cap
    (vLLM gives Mamba groups no margin: their finder never drops)."""
    ignores_lookahead: ClassVar[bool] = False
    """Lookahead (speculative) slots are not allocated in this group: drafters have no
    recurrent layers (vLLM 0.33 align mode)."""
    has_step_state: ClassVar[bool] = False
    """The manager keeps per-step state that ``new_step`` clears."""
    writes_checkpoints: ClassVar[bool] = False
    """Blocks hold state checkpoints written at chunk ends (recurrent groups: the
    coordinator ends prefill chunks where a checkpoint must be written)."""

    def __init__(self, group: CacheGroup, pool: BlockPool, retention: RetentionPolicy,
                 *, alignment_tokens: int, use_eagle: bool) -> None:
        self.group = group
        self.group_id: GroupId = group.group_id
        self.spec: LayerSpec = group.spec
        self.block_size = group.spec.block_size
        self.pool = pool
        self.retention = retention
        self.alignment_tokens = alignment_tokens
        self.use_eagle = use_eagle
        self.tables: dict[ReqId, list[Block]] = {}
        self.num_cached_blocks: dict[ReqId, int] = {}
        self.chain_block_size: int | None = None
        """Set for ``chain`` eviction: block size of the full-attention group blocks depend on."""
        self.is_chain_reference = False
        self.lead = self

    # ------------------------------------------------------------------ hooks
    @classmethod
    @abstractmethod
    def find_longest_hit(cls, pool: BlockPool, group_ids: Sequence[GroupId], spec: LayerSpec,
                         hashes: Sequence[BlockHash], max_num_tokens: int, *,
                         drop_eagle_block: bool, alignment_tokens: int,
                         ) -> tuple[list[list[Block]], int]:
        """Longest hit of ``≤ max_num_tokens`` tokens for the groups sharing ``spec``.

        ``hashes`` are at this spec's block size. Returns one table per group id and the hit
        length in tokens. Does not modify the pool.
        """

    def admission_cap_blocks(self, max_num_batched_tokens: int, max_model_len: int | None,
                             ) -> int | None:
        """Most blocks a request can hold at once in this group, ``None`` if unbounded."""
        del max_num_batched_tokens, max_model_len
        return None

    def hit_tail_blocks(self, num_tokens: int) -> int | None:
        """Blocks ending at ``num_tokens`` (an aligned hit point) that a hit there needs
        cached in this group; ``None``: every block from 0 (a full-attention kind). KV
        events report where such groups can still land a hit (``hybridkv.events``)."""
        del num_tokens
        return None

    def max_hit_tail_blocks(self) -> int:
        """The largest ``hit_tail_blocks`` of any point (0 for full-attention kinds)."""
        return 0

    def next_release_tokens(self, num_computed_tokens: int) -> int:
        """Smallest computed-token count above ``num_computed_tokens`` at which another
        block leaves this group's window (releases can only happen from there on)."""
        del num_computed_tokens
        return 1 << 62  # full attention never releases early

    def num_blocks_to_grow(self, req_id: ReqId, num_tokens: int) -> int:
        """Blocks the running request's table needs to cover ``num_tokens`` slots."""
        return max(0, -(-num_tokens // self.block_size) - len(self.tables[req_id]))

    def new_step(self) -> None:
        """A scheduler step starts (only managers with ``has_step_state`` are called)."""

    def note_computed(self, req_id: ReqId, num_computed_tokens: int) -> None:
        """A step of the request ended at ``num_computed_tokens`` (``has_step_state``
        managers only; called before its blocks are cached)."""
        del req_id, num_computed_tokens

    def bridge_tail_blocks(self) -> int:
        """Blocks before a bridge end whose KV is exact enough to hash (window tail)."""
        return 0

    def bound_item_blocks(self, num_table_blocks: int, num_item_tokens: int) -> int:
        """Of a running request's ``num_table_blocks`` held blocks, how many the offline
        ``bound`` models as cache items (``hybridkv.sim.bound``): the chained full-attention
        KV of its first ``num_item_tokens`` tokens, in whole alignment units. Every other
        held block is charged against the bound's capacity, so a group kind whose held
        state is not full-attention prompt KV keeps this default of 0."""
        del num_table_blocks, num_item_tokens
        return 0

    def cache_mask(self, start: int, end: int, boundaries: Sequence[int]) -> list[bool] | None:
        """Which blocks of ``[start, end)`` to hash (``None``: all)."""
        del start, end, boundaries
        return None

    # ------------------------------------------------------------ bookkeeping
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return self.spec.num_skipped_tokens(num_computed_tokens)

    def num_blocks_to_allocate(self, req_id: ReqId, num_tokens: int, hit_blocks: Sequence[Block],
                               num_computed_tokens: int, admission_cap: int | None) -> int:
        """Free blocks needed to hold ``num_tokens`` slots (hit blocks sitting in a free
        tier count, since touching them takes them out). Does not modify."""
        num_required = -(-num_tokens // self.block_size)
        if admission_cap is not None:
            num_required = min(num_required, admission_cap)
        table = self.tables.get(req_id)
        if table is not None and req_id in self.num_cached_blocks:
            return max(num_required - len(table), 0)
        num_held = 0 if table is None else len(table)
        num_skipped_blocks = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        num_local = len(hit_blocks) + num_held
        num_new = max(num_required - max(num_skipped_blocks, num_local), 0)
        first_used = max(0, num_skipped_blocks - num_held)
        num_evictable = sum(
            1 for b in hit_blocks[first_used:] if b.ref_count == 0 and not b.is_null
        )
        return num_new + num_evictable

    def add_hit_blocks(self, req_id: ReqId, hit_blocks: Sequence[Block], num_hit_tokens: int,
                       ) -> None:
        """Start a table from a prefix hit: touch what is still in the window."""
        num_skipped = self.num_skipped_tokens(num_hit_tokens) // self.block_size
        kept = hit_blocks[num_skipped:]  # none for a group outside caching (bounded-replay)
        self.pool.touch(kept)
        table = [self.pool.null_block] * num_skipped
        table.extend(kept)
        self.tables[req_id] = table
        self.num_cached_blocks[req_id] = len(table)

    def allocate_new_blocks(self, req_id: ReqId, num_tokens: int) -> list[Block]:
        """Append blocks so the table covers ``num_tokens`` slots; returns the new blocks."""
        table = self.tables.setdefault(req_id, [])
        self.num_cached_blocks.setdefault(req_id, 0)
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.pool.allocate(num_new)
        table.extend(new_blocks)
        return new_blocks

    def allocate_into(self, req_id: ReqId, num_tokens: int, num_main_tokens: int,
                      out: list[list[Block]]) -> None:
        out.append(self.allocate_new_blocks(
            req_id, num_main_tokens if self.ignores_lookahead else num_tokens))

    def set_checkpoint_policy(self, checkpoints: str) -> None:
        """The policy's checkpoint mode (``ckpt:chunk|block|branch``); only groups that
        write checkpoints use it."""

    def add_copied_block(self, req_id: ReqId, block: Block, num_hit_tokens: int) -> None:
        """``ckpt:branch`` copy-on-write hit inside a block: ``block`` (fresh, a copy of the
        snapshot at ``num_hit_tokens``) ends the request's hit table."""
        del num_hit_tokens
        self.tables[req_id].append(block)

    def snapshot_source(self, req_id: ReqId, num_tokens: int) -> Block:
        """``ckpt:branch``: the block a snapshot at ``num_tokens`` (inside a block) copies:
        the block holding that position."""
        return self.tables[req_id][num_tokens // self.block_size]

    def cache_blocks(self, req_id: ReqId, hashes: Sequence[BlockHash], hash_block_size: int,
                     num_tokens: int, boundaries: Sequence[int],
                     bridge_end_tokens: int = 0) -> None:
        """Hash the full blocks covering the first ``num_tokens`` computed tokens.

        ``hashes`` are the request's hashes at ``hash_block_size`` granularity. A cold
        window-recompute bridge ending at ``bridge_end_tokens`` leaves inexact window KV
        before the tail ending there: those blocks are never hashed (a hit at an earlier
        boundary would read them; hits at or after the bridge end read only exact KV).
        """
        plan = self.cache_plan(req_id, hashes, hash_block_size, num_tokens, boundaries,
                               bridge_end_tokens)
        if plan is not None:
            self.apply_cache_plan(req_id, hashes, hash_block_size, plan)

    def cache_plan(self, req_id: ReqId, hashes: Sequence[BlockHash], hash_block_size: int,
                   num_tokens: int, boundaries: Sequence[int], bridge_end_tokens: int = 0,
                   ) -> tuple[int, int, list[bool] | None] | None:
        """``(first, end, mask)``: table indices ``[first, end)`` to hash where ``mask``
        allows (``None``: all), or ``None`` when no block became full. Skipping a cold
        bridge's inexact blocks is recorded here. Sibling groups share one plan."""
        num_cached = self.num_cached_blocks.get(req_id, 0)
        bs = self.block_size
        num_full = min(num_tokens, len(hashes) * hash_block_size) // bs
        if num_cached >= num_full:
            return None
        if bridge_end_tokens and not self.is_full_attention:
            first_exact = bridge_end_tokens // bs - self.bridge_tail_blocks()
            if num_cached < first_exact:
                num_cached = min(first_exact, num_full)
                self.num_cached_blocks[req_id] = num_cached
                if num_cached >= num_full:
                    return None
        return num_cached, num_full, self.cache_mask(num_cached, num_full, boundaries)

    def apply_cache_plan(self, req_id: ReqId, hashes: Sequence[BlockHash],
                         hash_block_size: int, plan: tuple[int, int, list[bool] | None],
                         ) -> None:
        num_cached, num_full, mask = plan
        table = self.tables[req_id]
        ratio = self.block_size // hash_block_size
        pool, group_id = self.pool, self.group_id
        chain_bs = self.chain_block_size
        indices: Iterable[int] = range(num_cached, num_full) if mask is None else \
            compress(range(num_cached, num_full), mask)
        if chain_bs is None:
            if mask is None and ratio == 1:
                pool.cache_blocks(table[num_cached:num_full], hashes[num_cached:num_full],
                                  group_id)
            else:
                picked = list(indices)
                if picked:
                    pool.cache_blocks([table[i] for i in picked],
                                      [hashes[(i + 1) * ratio - 1] for i in picked], group_id)
            self.num_cached_blocks[req_id] = num_full
            return
        for i in indices:
            block = table[i]
            if block.is_null or block.block_hash is not None:
                continue
            parent = self._parent_hash(i, hashes, hash_block_size, chain_bs)
            pool.cache_block(block, hashes[(i + 1) * ratio - 1], group_id, parent)
        self.num_cached_blocks[req_id] = num_full

    def _parent_hash(self, block_idx: int, hashes: Sequence[BlockHash], hash_block_size: int,
                     chain_block_size: int) -> BlockHash | None:
        """The full-attention hash block ``block_idx`` depends on (``chain`` eviction):
        the previous full-attention block for the reference group itself (the root for
        block 0), else the full-attention block holding this block's last token. ``None``
        when that block is not full yet: no aligned hit can use this block then."""
        if self.is_chain_reference:
            if block_idx == 0:
                return ROOT_PARENT
            fa_idx = block_idx - 1
        else:
            fa_idx = ((block_idx + 1) * self.block_size - 1) // chain_block_size
        end = (fa_idx + 1) * (chain_block_size // hash_block_size)
        return hashes[end - 1] if end <= len(hashes) else None

    def remove_skipped_blocks(self, req_id: ReqId, num_computed_tokens: int) -> None:
        """Release blocks that left the window; their table slots become the null block.

        Released blocks are passed newest first, so within a tier the newest is reused first.
        """
        num_skipped = self.num_skipped_tokens(num_computed_tokens)
        span = released_span(self.tables.get(req_id), num_skipped, self.block_size,
                             self.pool.null_block)
        if span is None:
            return
        table = self.tables[req_id]
        first, last = span
        released = table[first : last + 1]
        released.reverse()  # newest first
        table[first : last + 1] = [self.pool.null_block] * len(released)
        for blocks, cached_tier in self.release_parts(released, last, num_skipped):
            self.pool.free_blocks(blocks, self.retention.scratch_tier, cached_tier)

    def release_parts(self, released: list[Block], last: int, num_skipped_tokens: int,
                      ) -> list[tuple[list[Block], FreeTier]]:
        """Split blocks leaving the window (table indices ``last, last - 1, …``, newest
        first) into (blocks, tier for their cached ones): the tail, except that ``pin:T``
        pins those ending less than T tokens before the window's new start. Block
        ``last - j`` ends at ``(last - j + 1) * bs`` tokens; ends decrease along the list, so
        the pinned blocks form its prefix.

        Worked example (bs 16, ``pin:32``, window start moved to 96 tokens, blocks ending at
        96, 80, 64): 96 and 80 end after 96 - 32 = 64 → pinned, 64 → tail.
        """
        policy = self.retention
        if policy.pin_drop_tokens is None:
            return [(released, FreeTier.TAIL)]
        num_pinned = 0
        while num_pinned < len(released) and policy.is_pinned_on_drop(
                (last - num_pinned + 1) * self.block_size, num_skipped_tokens):
            num_pinned += 1
        return [(released[:num_pinned], FreeTier.PINNED), (released[num_pinned:], FreeTier.TAIL)]

    def free(self, req_id: ReqId, session_id: str | None = None) -> None:
        """Release the request's blocks, tail first (the chain end is evicted first).

        ``session_id`` is set when a finished request of a conversation is released."""
        table = self.tables.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        if table:
            policy = self.retention
            self.pool.free_blocks(live_blocks_tail_first(table, self.pool.null_block),
                                  policy.scratch_tier, policy.cached_tier, session_id)

    def block_ids(self, req_id: ReqId) -> list[int]:
        return [b.block_id for b in self.tables.get(req_id, ())]
