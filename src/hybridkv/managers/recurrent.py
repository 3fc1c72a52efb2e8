"""Recurrent state (Mamba, Gated DeltaNet, KDA): one checkpoint per block, vLLM 0.33 "align".

Block table of a running request (``bs`` = block size; table index ``i`` stands for the
state after ``(i + 1) * bs`` tokens)::

    | null … | checkpoint | null … | previous state | null … | running state |
      no state kept          kept for the cache        copied from    written this step
                             (hashed, or freed)        (freed next step)

- A step that computes tokens ``[s, e)`` appends one block at index ``ceil(e / bs) - 1``
  (nulls in between): the engine reads the state at ``s`` from the request's previous
  state block (the hit block on admission) and writes the state at ``e`` into the new one.
  Chunk ends are block aligned except the prompt's last chunk
  (``KVCacheManager.align_prefill_chunk``), so a chunk end ``e = k * bs`` leaves the exact
  state after ``k`` blocks at index ``k - 1``: a checkpoint.
- Once full (``e`` a block multiple) the block is hashed with the prefix hash of its
  ``(i + 1) * bs`` tokens, as the retention policy allows (``window_mask`` with one tail
  block: ``prepend`` keeps all, ``latest`` the replay boundary and the junction,
  ``interval:N`` one per N tokens).
- Blocks whose state is no longer needed by the request (every block below index
  ``(computed - 1) // bs``, and the previous state block once the running one moved on) are
  released: hashed ones stay in the cache as free evictable blocks.
- A hit is the rightmost position whose checkpoint is cached in every sibling group:
  ``[null] * i + [checkpoint]``, ``(i + 1) * bs`` tokens.
- A checkpoint hashed in the current step is written only by this step's forward pass:
  a hit on it defers the admission to the next step (vLLM's ``cached_blocks_this_step``).

Invariant (``check_invariants``): every non-null block of a table sits at an index in
``[retired, len)`` or is the previous-state block; a table holds at most two non-null blocks
once the request has run a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from hybridkv.block import Block
from hybridkv.errors import InvariantViolation
from hybridkv.ids import BlockHash, GroupId, ReqId
from hybridkv.managers.base import GroupManager, blocks_in_every_group
from hybridkv.policies import BLOCK_CHECKPOINTS, RetentionPolicy
from hybridkv.pool import BlockPool, FreeTier
from hybridkv.specs import CacheGroup, LayerSpec, RecurrentStateSpec


class RecurrentStateManager(GroupManager):
    """Checkpoint tables of one recurrent cache group (vLLM ``MambaManager``, align mode)."""

    batches_siblings: ClassVar[bool] = False
    eagle_margin: ClassVar[bool] = False
    has_step_state: ClassVar[bool] = True
    ignores_lookahead: ClassVar[bool] = True
    writes_checkpoints: ClassVar[bool] = True

    def __init__(self, group: CacheGroup, pool: BlockPool, retention: RetentionPolicy,
                 *, alignment_tokens: int, use_eagle: bool) -> None:
        super().__init__(group, pool, retention, alignment_tokens=alignment_tokens,
                         use_eagle=use_eagle)
        self._retired: dict[ReqId, int] = {}
        """Table indices below this were released by ``remove_skipped_blocks``."""
        self._previous_state: dict[ReqId, int] = {}
        """Index of the block the running state was copied from at the last allocation."""
        self._has_run: set[ReqId] = set()
        """Requests that got their first state block (an allocation call happened)."""
        self._hashed_this_step: set[BlockHash] = set()
        self.every_block = False
        """``ckpt:block``: every block end a step passes receives its state."""
        self._state_tokens: dict[ReqId, dict[int, int]] = {}
        """Per request: table index → tokens of the state last written into that block
        (the last block receives the state at each step's end, ``note_computed``)."""

    @classmethod
    def find_longest_hit(cls, pool: BlockPool, group_ids: Sequence[GroupId], spec: LayerSpec,
                         hashes: Sequence[BlockHash], max_num_tokens: int, *,
                         drop_eagle_block: bool, alignment_tokens: int,
                         ) -> tuple[list[list[Block]], int]:
        """The rightmost cached checkpoint ending on an aligned boundary, at most
        ``max_num_tokens`` tokens; never dropped for EAGLE (drafters have no recurrent
        layers).

        Worked example (bs 4, checkpoints cached after blocks 1 and 4): max 23 tokens →
        block 4, hit 20 tokens, table ``[null, null, null, null, c4]``; max 19 → block 1,
        hit 8 tokens.
        """
        del drop_eagle_block
        bs = spec.block_size
        null = pool.null_block
        num_blocks = min(max_num_tokens // bs, len(hashes))
        getters = [pool.group_index(g).get for g in group_ids]
        if len(getters) == 1:
            get = getters[0]
            for i in range(num_blocks - 1, -1, -1):
                block = get(hashes[i])
                if block is None or (bs != alignment_tokens
                                     and ((i + 1) * bs) % alignment_tokens):
                    continue
                table = [null] * i
                table.append(block)
                return [table], (i + 1) * bs
            return [[]], 0
        for i in range(num_blocks - 1, -1, -1):
            found = blocks_in_every_group(getters, hashes[i])
            if found is None or (bs != alignment_tokens and ((i + 1) * bs) % alignment_tokens):
                continue
            return [[null] * i + [block] for block in found], (i + 1) * bs
        return [[] for _ in group_ids], 0

    def hit_tail_blocks(self, num_tokens: int) -> int | None:
        """One block: the checkpoint of the state after exactly ``p`` tokens."""
        del num_tokens
        return 1

    def max_hit_tail_blocks(self) -> int:
        return 1

    # -------------------------------------------------------------- allocation
    def num_blocks_to_allocate(self, req_id: ReqId, num_tokens: int, hit_blocks: Sequence[Block],
                               num_computed_tokens: int, admission_cap: int | None) -> int:
        """At most one new state block per step, plus the hit checkpoint if it sits in a
        free queue. A hit on a checkpoint hashed this step cannot be served before the
        step's forward pass writes it: more blocks than the pool has."""
        del num_computed_tokens
        if hit_blocks and hit_blocks[-1].block_hash in self._hashed_this_step:
            return self.pool.num_blocks + 1
        table = self.tables.get(req_id)
        num_new = -(-num_tokens // self.block_size) - len(hit_blocks) - \
            (0 if table is None else len(table))
        num_evictable = sum(1 for b in hit_blocks if b.ref_count == 0 and not b.is_null)
        if self.every_block:
            num_new = max(num_new, 0)
            if admission_cap is not None:
                num_new = min(num_new, admission_cap)
            return num_new + num_evictable
        return min(num_new, 1) + num_evictable

    def admission_cap_blocks(self, max_num_batched_tokens: int, max_model_len: int | None,
                             ) -> int | None:
        """``ckpt:block``: a step holds the states of the block ends it passes (at most
        ``ceil(in_flight / bs) + 1``) plus its source; ``ckpt:chunk``: one new block."""
        del max_model_len
        return -(-max_num_batched_tokens // self.block_size) + 2

    def num_blocks_to_grow(self, req_id: ReqId, num_tokens: int) -> int:
        needed = super().num_blocks_to_grow(req_id, num_tokens)
        return needed if self.every_block else min(1, needed)

    def allocate_new_blocks(self, req_id: ReqId, num_tokens: int) -> list[Block]:
        """Append the block that receives the state after ``num_tokens`` tokens (index
        ``ceil(num_tokens / bs) - 1``), nulls in between; remember the block the state
        comes from."""
        table = self.tables.setdefault(req_id, [])
        self.num_cached_blocks.setdefault(req_id, 0)
        num_required = -(-num_tokens // self.block_size)
        num_held = len(table)
        if num_required <= num_held:
            self._has_run.add(req_id)
            return []
        if num_held:  # the running state (or the hit checkpoint) is copied from here
            self._previous_state[req_id] = num_held - 1
        if self.every_block:  # one block (and state) per block end, as full attention
            new_blocks = self.pool.allocate(num_required - num_held)
            table.extend(new_blocks)
            self._has_run.add(req_id)
            return new_blocks
        if num_held < num_required - 1:
            table.extend([self.pool.null_block] * (num_required - 1 - num_held))
        new_blocks = self.pool.allocate(1)
        table.extend(new_blocks)
        self._has_run.add(req_id)
        return new_blocks

    def remove_skipped_blocks(self, req_id: ReqId, num_computed_tokens: int) -> None:
        """Release states the request no longer needs: every block below index
        ``(computed - 1) // bs`` (newest first), then the previous-state block once the
        running state has moved past it.

        Worked example (bs 4, table ``[null, c1, null, r3]``, previous state 1, 16 computed
        tokens): blocks below index 15 // 4 = 3 go → ``c1`` released; ``r3`` stays.
        """
        table = self.tables.get(req_id)
        if not table:
            return
        null = self.pool.null_block
        bs = self.block_size
        num_skipped_blocks = min(self.num_skipped_tokens(num_computed_tokens) // bs, len(table))
        retired = self._retired.get(req_id, 0)
        scratch_tier = self.retention.scratch_tier
        if retired < num_skipped_blocks:
            released: list[Block] = []
            for i in range(num_skipped_blocks - 1, retired - 1, -1):
                block = table[i]
                if block is not null:
                    released.append(block)
                    table[i] = null
            if released:
                self.pool.free_blocks(released, scratch_tier, FreeTier.TAIL)
                written = self._state_tokens.get(req_id)
                if written:
                    for i in [i for i in written if i < num_skipped_blocks]:
                        del written[i]
            self._retired[req_id] = num_skipped_blocks
        previous = self._previous_state.get(req_id)
        if previous is not None and previous < -(-num_computed_tokens // bs) - 1 \
                and table[previous] is not null:
            block = table[previous]
            table[previous] = null
            self.pool.free_blocks([block], scratch_tier, FreeTier.TAIL)

    def next_release_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens + 1  # states move every step: always ask

    # ---------------------------------------------------------------- caching
    def cache_mask(self, start: int, end: int, boundaries: Sequence[int]) -> list[bool] | None:
        """The retention policy's mask for a window of one tail block: a hit at ``p``
        needs only the checkpoint ending at ``p`` (no EAGLE shift)."""
        return self.retention.window_mask(
            start, end, block_size=self.block_size, alignment_tokens=self.alignment_tokens,
            num_tail_blocks=1, shift=0, boundaries=boundaries,
        )

    def note_computed(self, req_id: ReqId, num_computed_tokens: int) -> None:
        """A step ended at ``num_computed_tokens``: the table's last block now holds the
        state after that many tokens (a hit block holds the state at its end)."""
        table = self.tables.get(req_id)
        if not table:
            return
        written = self._state_tokens.setdefault(req_id, {})
        last = len(table) - 1
        if self.every_block:  # block ends passed since the last note got their states
            i = last - 1
            while i >= 0 and not table[i].is_null \
                    and written.get(i, 0) < (i + 1) * self.block_size:
                written[i] = (i + 1) * self.block_size
                i -= 1
        written[last] = num_computed_tokens

    def add_hit_blocks(self, req_id: ReqId, hit_blocks: Sequence[Block], num_hit_tokens: int,
                       ) -> None:
        """Start the table from the hit checkpoint: the state after its own end (the
        hit point)."""
        super().add_hit_blocks(req_id, hit_blocks, num_hit_tokens)
        if hit_blocks and not hit_blocks[-1].is_null:
            self._state_tokens[req_id] = {len(hit_blocks) - 1: num_hit_tokens}

    def set_checkpoint_policy(self, checkpoints: str) -> None:
        self.every_block = checkpoints == BLOCK_CHECKPOINTS

    def snapshot_source(self, req_id: ReqId, num_tokens: int) -> Block:
        """The running state: the table's last block."""
        del num_tokens
        return self.tables[req_id][-1]

    def add_copied_block(self, req_id: ReqId, block: Block, num_hit_tokens: int) -> None:
        """``ckpt:branch`` copy-on-write hit inside a block: ``block`` (fresh, appended at
        index ``num_hit_tokens // bs``) receives the state after ``num_hit_tokens`` tokens
        from the snapshot before the step runs; it is the step's source state."""
        table = self.tables[req_id]
        table.append(block)
        self._state_tokens[req_id] = {len(table) - 1: num_hit_tokens}

    def cache_plan(self, req_id: ReqId, hashes: Sequence[BlockHash], hash_block_size: int,
                   num_tokens: int, boundaries: Sequence[int], bridge_end_tokens: int = 0,
                   ) -> tuple[int, int, list[bool] | None] | None:
        """The retention mask, restricted to blocks whose state is exactly the state at
        their end: a block the last step wrote in the middle (a chunk that crossed a
        block boundary without stopping there) is never hashed."""
        plan = super().cache_plan(req_id, hashes, hash_block_size, num_tokens, boundaries,
                                  bridge_end_tokens)
        if plan is None:
            return None
        first, end, mask = plan
        written = self._state_tokens.get(req_id, {})
        bs = self.block_size
        exact = [written.get(i) == (i + 1) * bs for i in range(first, end)]
        if mask is not None:
            exact = [a and b for a, b in zip(exact, mask, strict=True)]
        return first, end, exact

    def apply_cache_plan(self, req_id: ReqId, hashes: Sequence[BlockHash],
                         hash_block_size: int, plan: tuple[int, int, list[bool] | None],
                         ) -> None:
        super().apply_cache_plan(req_id, hashes, hash_block_size, plan)
        first, end, _ = plan
        table = self.tables[req_id]
        for block in table[first:end]:
            if block.block_hash is not None and not block.is_null:
                self._hashed_this_step.add(block.block_hash)

    def new_step(self) -> None:
        self._hashed_this_step.clear()

    # ----------------------------------------------------------------- release
    def free(self, req_id: ReqId, session_id: str | None = None) -> None:
        """Release the request's blocks, newest first (tables have interior nulls)."""
        table = self.tables.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        self._retired.pop(req_id, None)
        self._previous_state.pop(req_id, None)
        self._has_run.discard(req_id)
        self._state_tokens.pop(req_id, None)
        if table:
            null = self.pool.null_block
            live = [b for b in reversed(table) if b is not null]
            policy = self.retention
            self.pool.free_blocks(live, policy.scratch_tier, policy.cached_tier, session_id)

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` when a table holds a live block the request no
        longer needs (below the retired index, other than its previous state)."""
        null = self.pool.null_block
        for req_id, table in self.tables.items():
            retired = self._retired.get(req_id, 0)
            previous = self._previous_state.get(req_id)
            for i, block in enumerate(table[:retired]):
                if block is not null and i != previous:
                    raise InvariantViolation(
                        f"recurrent group {self.group_id}: {req_id!r} holds block "
                        f"{block.block_id} at retired index {i}")

    @property
    def recurrent_spec(self) -> RecurrentStateSpec:
        assert isinstance(self.spec, RecurrentStateSpec)
        return self.spec


def align_recurrent_chunk(num_computed_tokens: int, num_new_tokens: int, *, num_tokens: int,
                          num_prompt_tokens: int, junction_tokens: int, block_size: int,
                          max_chunk_tokens: int, hit_unit_tokens: int = 0) -> int:
    """Clip a prefill chunk so it ends where a checkpoint must be written (vLLM 0.33
    ``Scheduler._mamba_block_aligned_split``, without fine-grained hash hits).

    A recurrent state exists only at chunk ends, so a prefill chunk that does not reach
    the prefill end is floored to a block boundary, and it stops early at: the next block
    boundary (a chunk starting mid-block), the last block boundary before the request's
    last token (the replay boundary a resend hits), and the shared-prefix junction
    (block-floored). Returns the clipped token count (0: nothing aligned fits).

    ``hit_unit_tokens`` (``ckpt:branch``): the junction is floored to this unit instead of
    the block, so the chunk ends exactly at a branch point (the replay boundary stays
    block-floored: a snapshot at the unit-floored prompt end measured worse, see
    docs/benchmarks.md).

    Worked examples (bs 784, 8,192-token chunks, a 2,000-token prompt): from 0 the chunk
    stops at 1,568 (last boundary before token 1,999); from 1,568 it runs to 2,000.
    With 500 tokens of budget left at 0 nothing aligned fits: 0. With a 16-token unit and
    a junction at 400 the chunk stops at 400, then at 784 (next block), then at 1,568.

    >>> kw = dict(num_tokens=2000, num_prompt_tokens=2000, junction_tokens=0,
    ...           block_size=784, max_chunk_tokens=8192)
    >>> align_recurrent_chunk(0, 2000, **kw), align_recurrent_chunk(1568, 432, **kw)
    (1568, 432)
    >>> align_recurrent_chunk(0, 500, **kw)
    0
    >>> kw.update(junction_tokens=400, hit_unit_tokens=16)
    >>> [align_recurrent_chunk(s, 2000 - s, **kw) for s in (0, 400, 784, 1568)]
    [400, 384, 784, 432]
    """
    start = num_computed_tokens
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return num_new_tokens
    bs = block_size
    unit = hit_unit_tokens or bs
    last_cache_position = max((num_tokens - 1) // bs * bs, 0)
    end = start + num_new_tokens
    if end < prefill_end:
        aligned_end = end // bs * bs
        if aligned_end > start or bs <= max_chunk_tokens:
            end = aligned_end
    stops = (
        (start // bs + 1) * bs if start % bs else 0,
        last_cache_position,
        (start + (junction_tokens - start) // bs * bs if unit == bs
         else junction_tokens // unit * unit) if start < junction_tokens < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)
