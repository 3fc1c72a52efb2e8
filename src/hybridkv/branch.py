"""Sub-block hits for recurrent hybrids (checkpoint policy ``ckpt:branch``).

A recurrent hybrid's unified block is large (Qwen3.5-27B: 784 tokens), so block-aligned
hits miss every prompt shorter than a block and floor every shared prefix to a block. With
``ckpt:branch`` requests are hashed every ``u`` tokens (``prefix_match_unit``, 16 by
default) and a hit may end at any multiple of ``u``:

- **Branch points** (Marconi's admission rule). ``SeenPrefixes`` remembers the ``u``-token
  prefix hashes of admitted prompts (metadata only, LRU-bounded). A request whose prompt
  shares a seen prefix up to ``J`` (its *branch point*) ends a prefill chunk exactly at
  ``J``. (The replay boundary stays vLLM's block-floored one: a second snapshot at the
  ``u``-floored prompt end cost more pool than resends won back, docs/benchmarks.md.)
- **Branch snapshots.** When a step ends at such a point ``p`` inside a block
  (``p % bs != 0``), one fresh block per recurrent group is hashed under the ``u``-hash of
  ``[0, p)`` and receives the state after ``p`` tokens. Full attention needs no block of
  its own when the producer's prompt fills its block ``k = p // bs``: that block, cached
  under its own full-block hash ``H_k``, holds the KV of ``[k * bs, p)`` for good (KV slots
  are never rewritten), so the snapshot records the *alias* ``p → H_k`` and a hit copies
  from whichever block the index holds under ``H_k`` (every block with that hash shares
  the prefix ``[0, p)``). Three blocks on qwen3.5-27b, as vLLM's block-floored junction
  checkpoint. Only a prompt ending inside block ``k`` gets a full-attention snapshot
  block (a copy of the KV of ``[k * bs, p)`` from the request's block, same slots). The
  copies run after the step's forward pass (``BlockCopy.after_forward``); the producer
  holds the snapshots until its next step and lookups skip them until the next scheduler
  step — and skip an alias whose block was hashed in the current step (its KV may be
  written only by this step's forward pass). Block-aligned branch points need no
  snapshot: the step leaves the ordinary checkpoint there, and the retention masks keep
  it as a junction.
- **Copy-on-write hits.** A hit at ``p`` inside block ``k = p // bs`` hands out the
  full-attention blocks ``[0, k)``, then each group's snapshot. The hitting request must
  write tokens ``[p, (k + 1) * bs)`` into block ``k`` of its own, so at admission every
  group gets a fresh block at index ``k`` filled from the snapshot before the forward pass
  (``after_forward=False``): ``p - k * bs`` tokens of full-attention KV, one recurrent
  state. The snapshots are held until the request's next step. Cost: one extra block per
  group at admission and the copy traffic, counted in ``copied_tokens``.

Worked example (bs 784, ``u`` 16; a 400-token system prompt S, then users' questions):
request 1 (S + 120 tokens) misses; request 2 (S + 90) shares 400 tokens with it (seen),
misses, stops its first chunk at 400 and leaves snapshots there (its prompt ends inside
block 0: a full-attention snapshot block too, 4 blocks); request 3 (S + 200) hits
400 tokens: full-attention table ``[copy of snapshot]`` (400 tokens of KV copied),
recurrent tables ``[copy of the state after 400]``. With a 2,000-token S' shared up to
1,900 instead, the producer's block 2 (``[1568, 2352)``) becomes full and cached as
``H_2``: the snapshot at 1,900 is 3 recurrent blocks plus the alias ``1900 → H_2``, and a
hit copies the KV of ``[1568, 1900)`` out of that block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.block import Block
from hybridkv.ids import BlockHash, GroupId, ReqId
from hybridkv.pool import BlockPool, FreeTier


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One copy an engine runs for ``ckpt:branch``: ``src``'s content for position
    ``num_tokens`` into ``dst`` (full attention: the KV slots of ``[num_tokens // bs * bs,
    num_tokens)``; recurrent: the state after ``num_tokens`` tokens). ``after_forward``:
    the step's own result is copied out once its forward pass ran (a snapshot); otherwise
    the copy precedes the forward pass (a copy-on-write hit)."""

    group_id: GroupId
    src_block_id: int
    dst_block_id: int
    num_tokens: int
    after_forward: bool


class SeenPrefixes:
    """``u``-token prefix hashes of admitted prompts (LRU, at most ``capacity``): where a
    new prompt leaves a known prefix (its branch point). Metadata only; no KV.

    >>> seen = SeenPrefixes(capacity=4)
    >>> seen.add([b"a", b"ab", b"abc"])
    >>> seen.deepest([b"a", b"ab", b"ax", b"axy"], 0, 4)   # shares two units
    2
    >>> seen.add([b"z1", b"z2"]); b"a" in seen   # capacity 4: the oldest entry left
    False
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, hashes: Sequence[BlockHash]) -> None:
        entries = self._hashes
        move = entries.move_to_end
        for block_hash in hashes:
            if block_hash in entries:
                move(block_hash)
            else:
                entries[block_hash] = None
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def deepest(self, hashes: Sequence[BlockHash], lo: int, hi: int) -> int:
        """Units shared with a seen prompt: the largest ``j`` in ``[lo, hi]`` with
        ``hashes[j - 1]`` seen (``lo`` when none past it). Chained hashes make the seen
        units a prefix (up to LRU trimming), so a binary search suffices."""
        entries = self._hashes
        if hi > lo and hashes[hi - 1] in entries:
            return hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in entries:
                lo = mid
            else:
                hi = mid - 1
        return lo


class BranchSnapshots:
    """Snapshot blocks and copy-on-write sources of ``ckpt:branch`` (see the module doc).

    Invariants (``check_invariants``): every held block is non-null with ``ref_count >= 1``
    (the pool's reference counts include these holds: ``HybridCoordinator.holders``); a
    snapshot waiting for its aliased block is held; the alias map holds at most
    ``alias_capacity`` entries.
    """

    min_divergences = 2
    """Prompts that must leave the seen ones at a point before a snapshot is taken there
    (the first marks it a branch point, the second snapshots it); 1 snapshots at every
    first divergence (the first version; the property tests run both)."""

    def __init__(self, pool: BlockPool, unit_tokens: int, block_size: int,
                 group_ids: Sequence[GroupId], seen_capacity: int,
                 full_group_ids: Sequence[GroupId] = ()) -> None:
        self.pool = pool
        self.unit_tokens = unit_tokens
        self.block_size = block_size
        self.group_ids = tuple(group_ids)
        self.full_group_ids = frozenset(full_group_ids)
        """Full-attention groups: their part of a snapshot may be an alias."""
        self.seen = SeenPrefixes(seen_capacity)
        self.branch_points = SeenPrefixes(seen_capacity)
        """``u``-hashes of the points where an admitted prompt left every seen one: a
        snapshot is taken at such a point only when a later prompt leaves there too."""
        self.aliases: OrderedDict[BlockHash, BlockHash] = OrderedDict()
        """Snapshot ``u``-hash of ``[0, p)`` → the full-block hash ``H_k`` whose cached
        full-attention block holds the KV of ``[k * bs, p)`` (LRU, ``alias_capacity``)."""
        self.alias_capacity = max(pool.num_blocks, 1)
        self.waiting_alias: dict[int, BlockHash] = {}
        """Snapshot block id → the full-block hash its alias needs: the producer keeps
        holding it until that block is cached (so an eviction policy never sees a snapshot
        whose full-attention part does not exist yet)."""
        self.fresh_full: set[int] = set()
        """Full-attention blocks hashed in the current step (their KV may be written only
        by this step's forward pass: not yet a copy source)."""
        self.held: dict[ReqId, list[Block]] = {}
        """Per request: snapshots it produced or copied from in its last step."""
        self.fresh: set[int] = set()
        """Block ids of snapshots taken in the current step (hits wait for the next)."""
        self.copies: list[BlockCopy] = []
        """Copies of the current step, in order (engines drain them with ``take_copies``)."""
        self.num_snapshots = 0
        self.num_partial_hits = 0
        self.copied_tokens = 0
        """Full-attention tokens of KV copied (snapshots and copy-on-write hits)."""

    def note_prompt(self, hashes: Sequence[BlockHash]) -> None:
        """A first admission: the unit where the prompt leaves every seen prompt becomes
        a branch point (a resend of a whole seen prompt is none); then its prefixes are
        seen.

        >>> b = BranchSnapshots.__new__(BranchSnapshots)
        >>> b.seen, b.branch_points = SeenPrefixes(8), SeenPrefixes(8)
        >>> b.note_prompt([b"s", b"s1"]); b.note_prompt([b"s", b"s2"])
        >>> b"s" in b.branch_points, b"s1" in b.branch_points
        (True, False)
        """
        j = self.seen.deepest(hashes, 0, len(hashes))
        if 0 < j < len(hashes):
            self.branch_points.add([hashes[j - 1]])
        self.seen.add(hashes)

    def branch_point(self, hashes: Sequence[BlockHash], lo: int, hi: int) -> int:
        """The junction a lookup reports, in units: the deepest seen unit in ``(lo, hi]``
        if an earlier prompt already left the seen prompts there (``lo`` otherwise)."""
        j = self.seen.deepest(hashes, lo, hi)
        if j > lo and (self.min_divergences <= 1 or hashes[j - 1] in self.branch_points):
            return j
        return lo

    # ----------------------------------------------------------------- lookup
    def find_partial_hit(self, hashes: Sequence[BlockHash], hit_tokens: int,
                         full_tokens: int, full_tables: Sequence[Sequence[Block]],
                         full_group_ids: Sequence[GroupId], max_num_tokens: int,
                         ) -> tuple[list[list[Block]], int] | None:
        """The deepest ``p`` in ``(hit_tokens, max_num_tokens]``, a multiple of ``u`` inside
        a block, whose snapshot every group has (not taken this step) and whose
        full-attention blocks ``[0, p // bs)`` are cached (``full_tokens``: the
        full-attention match, ``full_tables`` its tables by group id). Returns per-group
        tables (group order) and ``p``, or ``None``. A snapshot taken this step is
        returned too: its admission waits for the next step (``is_fresh``), as vLLM
        defers hits on checkpoints cached in the current step."""
        u, bs = self.unit_tokens, self.block_size
        hi = min(max_num_tokens, full_tokens + bs - u, len(hashes) * u) // u
        lo = hit_tokens // u
        ratio = bs // u
        getters = [self.pool.group_index(g).get for g in self.group_ids]
        full_ids = set(full_group_ids)
        null = self.pool.null_block
        aliases = self.aliases
        for j in range(hi, lo, -1):
            if j % ratio == 0:
                continue
            block_hash = hashes[j - 1]
            alias = aliases.get(block_hash)
            found: list[Block] = []
            for gid, get in zip(self.group_ids, getters, strict=True):
                block = get(block_hash)
                if block is None and alias is not None and gid in self.full_group_ids:
                    block = get(alias)
                if block is None:
                    break
                found.append(block)
            else:
                k = j // ratio
                tables: list[list[Block]] = []
                for gid, block in zip(self.group_ids, found, strict=True):
                    table = list(full_tables[gid][:k]) if gid in full_ids else [null] * k
                    table.append(block)
                    tables.append(table)
                return tables, j * u
        return None

    def is_fresh(self, snapshots: Sequence[Block]) -> bool:
        """A snapshot among these was taken this step (its content exists only after the
        step's forward pass)."""
        return any(block.block_id in self.fresh or block.block_id in self.fresh_full
                   for block in snapshots)

    def full_source(self, block_hash: BlockHash, group_id: GroupId) -> Block | None:
        """The block a hit at the snapshot ``block_hash`` copies full-attention KV from:
        the group's own snapshot block, else the cached block of the alias's full-block
        hash (``None``: neither is cached)."""
        index = self.pool.group_index(group_id)
        block = index.get(block_hash)
        alias = self.aliases.get(block_hash)
        if block is None and alias is not None:
            block = index.get(alias)
        return block

    def note_full_hashed(self, blocks: Sequence[Block]) -> None:
        """Full-attention blocks hashed in this step: no alias copies from them before the
        next step."""
        self.fresh_full.update(block.block_id for block in blocks)

    # ---------------------------------------------------------------- updates
    def take_snapshot(self, req_id: ReqId, block_hash: BlockHash, num_tokens: int,
                      sources: Sequence[Block], full_hash: BlockHash | None = None,
                      parent_hash: BlockHash | None = None) -> bool:
        """Snapshot the step ending at ``num_tokens`` (inside a block) into one fresh block
        per group, hashed under ``block_hash``; ``sources``: per group, the request's block
        holding that position's content. ``full_hash``: the full-block hash the request's
        block ``k`` will be cached under (its prompt fills the block): full-attention
        groups then get the alias instead of a block. ``parent_hash``: the full-attention
        hash the snapshot's full-attention block extends (chain-aware eviction: recurrent
        states depend on that block, or on the aliased one). Skipped (``False``) when every
        group already has it or the pool cannot spare the blocks (at least as many must
        stay free)."""
        pool = self.pool
        pairs = [(g, s) for g, s in zip(self.group_ids, sources, strict=True)
                 if full_hash is None or g not in self.full_group_ids]
        if full_hash is not None:
            self._alias(block_hash, full_hash)
        if all(pool.group_index(g).get(block_hash) is not None for g, _ in pairs):
            return False
        num = len(pairs)
        if pool.num_free_blocks < 2 * num:
            return False
        blocks = pool.allocate(num)
        partial = num_tokens % self.block_size
        copied = False
        for (gid, src), block in zip(pairs, blocks, strict=True):
            if gid in self.full_group_ids:  # the snapshot extends the chain at k * bs
                pool.cache_block(block, block_hash, gid, parent_hash)
            elif full_hash is None:  # a state needs the full-attention snapshot
                pool.cache_block(block, block_hash, gid, block_hash)
            else:  # a state needs the aliased full-attention block
                pool.cache_block(block, block_hash, gid, full_hash)
                self.waiting_alias[block.block_id] = full_hash
            self.fresh.add(block.block_id)
            self.copies.append(BlockCopy(gid, src.block_id, block.block_id, num_tokens, True))
            copied = copied or gid in self.full_group_ids
        self.held.setdefault(req_id, []).extend(blocks)
        self.num_snapshots += 1
        if copied:
            self.copied_tokens += partial
        return True

    def _alias(self, block_hash: BlockHash, full_hash: BlockHash) -> None:
        aliases = self.aliases
        aliases[block_hash] = full_hash
        aliases.move_to_end(block_hash)
        while len(aliases) > self.alias_capacity:
            aliases.popitem(last=False)

    def copy_on_write(self, req_id: ReqId, snapshots: Sequence[Block], num_tokens: int,
                      ) -> list[Block]:
        """A hit at ``num_tokens`` on ``snapshots`` (one per group, group order): hold them
        until the request's next step and return one fresh block per group, which the
        engine fills from them before the forward pass. The caller counted the blocks."""
        pool = self.pool
        pool.touch(snapshots)
        self.held.setdefault(req_id, []).extend(snapshots)
        fresh = pool.allocate(len(snapshots))
        for gid, src, dst in zip(self.group_ids, snapshots, fresh, strict=True):
            self.copies.append(BlockCopy(gid, src.block_id, dst.block_id, num_tokens, False))
        self.num_partial_hits += 1
        self.copied_tokens += num_tokens % self.block_size
        return fresh

    def release(self, req_id: ReqId, final: bool = False) -> None:
        """The request's step ran (or, ``final``, it left): its snapshots and copy sources
        go back to the cache (most recently used end of the free queue) — except, while
        it runs, snapshots whose aliased full-attention block is not cached yet."""
        blocks = self.held.pop(req_id, None)
        if not blocks:
            return
        waiting = self.waiting_alias
        if waiting:
            kept = [] if final else [b for b in blocks if b.block_id in waiting
                                     and not self._is_cached(waiting[b.block_id])]
            if kept:
                self.held[req_id] = kept
                blocks = [b for b in blocks if b not in kept]
            for block in blocks:
                waiting.pop(block.block_id, None)
        if blocks:
            self.pool.free_blocks(blocks, FreeTier.HEAD, FreeTier.TAIL)

    def _is_cached(self, full_hash: BlockHash) -> bool:
        return all(self.pool.group_index(g).get(full_hash) is not None
                   for g in self.full_group_ids)

    def new_step(self) -> None:
        self.fresh.clear()
        self.fresh_full.clear()
        self.copies.clear()

    def take_copies(self) -> list[BlockCopy]:
        copies, self.copies = self.copies, []
        return copies

    def holders(self, counts: dict[int, int]) -> None:
        for blocks in self.held.values():
            for block in blocks:
                counts[block.block_id] = counts.get(block.block_id, 0) + 1

    def check_invariants(self) -> None:
        from hybridkv.errors import InvariantViolation
        for req_id, blocks in self.held.items():
            for block in blocks:
                if block.is_null or block.ref_count < 1:
                    raise InvariantViolation(f"ckpt:branch: {req_id!r} holds {block!r}")
        held_ids = {b.block_id for blocks in self.held.values() for b in blocks}
        if not held_ids.issuperset(self.waiting_alias):
            raise InvariantViolation("ckpt:branch: a snapshot waiting for its alias is not "
                                     "held")
        if len(self.aliases) > self.alias_capacity:
            raise InvariantViolation(f"ckpt:branch: {len(self.aliases)} aliases, capacity "
                                     f"{self.alias_capacity}")
