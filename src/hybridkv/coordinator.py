"""Hybrid coordinator: the fixed-point longest-hit search across groups, lcm alignment.

Groups with an identical spec form a *spec group*: one lookup probes all of them and a block
position hits only if every member hits. Full attention goes first (its answer bounds every
other group, and its answer for a shorter length is a prefix of its first answer).

Worked example (bs 16; full, SWA w32 → 2 tail blocks, SWA w64 → 4; a 129-token prompt was
cached, then SWA-a lost block 7 and SWA-b block 5). Calls, as (group, limit → answer):
``(full, 128 → 128)``, ``(a, 128 → 112)``, ``(b, 112 → 80)``, ``(a, 80 → 80)``, ``(b, 80 → 80)``
→ hit 80; full attention matched 128, so the shared-prefix junction is 128.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.block import Block
from hybridkv.branch import BranchSnapshots
from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError
from hybridkv.eviction import ROOT_PARENT
from hybridkv.ids import BlockHash, GroupId, ReqId
from hybridkv.managers import MANAGER_FOR_SPEC, GroupManager, coarse_hashes
from hybridkv.managers.base import CacheUnit
from hybridkv.managers.chunked import ChunkedLocalManager
from hybridkv.managers.recurrent import align_recurrent_chunk
from hybridkv.policies import (
    BLOCK_CHECKPOINTS,
    CHUNK_CHECKPOINTS,
    RetentionPolicy,
    branch_unit_tokens,
)
from hybridkv.pool import BlockPool
from hybridkv.siblings import SiblingBatch
from hybridkv.specs import LayerSpec


@dataclass(frozen=True, slots=True)
class SpecGroup:
    """Cache groups sharing one spec, looked up together."""

    spec: LayerSpec
    group_ids: tuple[GroupId, ...]
    manager_cls: type[GroupManager]


def replay_boundaries(num_prompt_tokens: int, alignment_tokens: int, use_eagle: bool,
                      ) -> tuple[int, ...]:
    """Positions an identical resend (or an extension) of the prompt can hit at.

    Without EAGLE a resend is capped at ``num_prompt_tokens - 1`` (masks floor it to ``A``).
    With the EAGLE drop the hit lands one aligned unit lower:

    >>> replay_boundaries(128, 32, use_eagle=False)
    (127,)
    >>> replay_boundaries(128, 32, use_eagle=True), replay_boundaries(127, 32, use_eagle=True)
    ((64, 96), (64,))
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    a = alignment_tokens
    resend = ((num_prompt_tokens - 1) // a) * a
    extension = (num_prompt_tokens // a) * a
    return tuple(sorted({max(resend - a, 0), max(extension - a, 0)}))


class HybridCoordinator:
    """Owns one ``GroupManager`` per cache group over one shared ``BlockPool``."""

    def __init__(self, config: CacheConfig, pool: BlockPool, retention: RetentionPolicy,
                 chain_group_id: GroupId | None = None, *,
                 checkpoints: str = CHUNK_CHECKPOINTS) -> None:
        self.config = config
        self.pool = pool
        self.retention = retention
        self.alignment_tokens = config.alignment_tokens
        self.hash_block_size = config.hash_block_size
        self.use_eagle = config.drops_eagle_block  # lookahead hashes need no drop
        self.managers: list[GroupManager] = []
        eagle_ids = _eagle_group_ids(config)
        for group in config.groups:
            manager_cls = MANAGER_FOR_SPEC[type(group.spec)]
            if manager_cls is ChunkedLocalManager:
                _validate_chunked(group.spec, self.alignment_tokens, self.use_eagle)
            self.managers.append(manager_cls(
                group, pool, retention, alignment_tokens=self.alignment_tokens,
                use_eagle=False,
            ))
        self._covering = [m for m in self.managers if m.covers_computed_tokens] or \
            self.managers[:1]
        """Managers whose table length bounds the covered slots (not V4.1's ring)."""
        self.replayed_group_ids, self.replay_tokens = _replayed_windows(config, retention)
        """``bounded-replay``: attention-window groups left out of prefix caching, and the
        window the hit's end replays (0: none)."""
        self.spec_groups = self._make_spec_groups()
        self._is_hybrid = len(self.managers) > 1
        for sg in self.spec_groups:  # siblings sharing a spec share the EAGLE flag
            sg_eagle = any(g in eagle_ids for g in sg.group_ids)
            for gid in sg.group_ids:
                self.managers[gid].use_eagle = sg_eagle
        has_window = any(not m.is_full_attention for m in self.managers)
        retention.validate(self.alignment_tokens, has_window)
        self._units = self._make_units()
        self._units_are_batches = len(self._units) < len(self.managers)
        self._releasing_units = [u for u in self._units if not u.lead.is_full_attention]
        self._last_full_attention: tuple[int, list[list[Block]]] = (0, [])
        self._next_release: dict[ReqId, int] = {}
        """Per running request: computed tokens before which no window block can leave."""
        self._covered_tokens: dict[ReqId, int] = {}
        """Slots every group's table covers after the request's last allocation (tables
        only grow by allocation while the request runs; dropped on free)."""
        self._bridge_tokens = _bridge_tokens(config)
        if chain_group_id is not None:  # chain eviction: record each block's parent hash
            chain_block_size = config.groups[chain_group_id].spec.block_size
            for manager in self.managers:
                manager.chain_block_size = chain_block_size
                manager.is_chain_reference = manager.group_id == chain_group_id
        self._step_managers = [m for m in self.managers if m.has_step_state]
        for manager in self.managers:
            manager.set_checkpoint_policy(checkpoints)
        self._recurrent_block_size = None if checkpoints == BLOCK_CHECKPOINTS else next(
            (m.block_size for m in self.managers if m.writes_checkpoints), None)
        self._caps = [
            m.admission_cap_blocks(config.max_num_batched_tokens, config.max_model_len)
            for m in self.managers
        ]
        self.branch = _make_branch(config, pool, checkpoints)
        """``ckpt:branch``: sub-block hits (snapshots, copy-on-write, seen prefixes)."""

    def _make_units(self) -> list[CacheUnit]:
        """Consecutive sibling groups batched (without an eviction policy, which may relink
        blocks as they are freed), else one unit per group, in group order."""
        batchable = self.pool.eviction is None
        units: list[CacheUnit] = []
        run: list[GroupManager] = []
        for manager in [*self.managers, None]:
            if manager is not None and run and manager.spec == run[0].spec and batchable \
                    and manager.use_eagle == run[0].use_eagle and manager.batches_siblings:
                run.append(manager)
                continue
            if len(run) > 1:
                units.append(SiblingBatch(run, self.pool))
            else:
                units.extend(run)
            run = [] if manager is None else [manager]
        return units

    def _make_spec_groups(self) -> list[SpecGroup]:
        by_spec: dict[LayerSpec, list[GroupId]] = {}
        for manager in self.managers:
            if not manager.spec.prefix_cacheable or \
                    manager.group_id in self.replayed_group_ids:
                continue  # V4.1 ring buffers, bounded-replay windows: never looked up
            by_spec.setdefault(manager.spec, []).append(manager.group_id)
        groups = [SpecGroup(spec, tuple(ids), MANAGER_FOR_SPEC[type(spec)])
                  for spec, ids in by_spec.items()]
        groups.sort(key=lambda sg: not sg.manager_cls.is_full_attention)
        return groups

    # ------------------------------------------------------------------ lookup
    def find_longest_hit(self, hashes: Sequence[BlockHash], max_num_tokens: int,
                         ) -> tuple[list[list[Block]], int, int]:
        """Longest hit every group can serve. Does not modify anything.

        Returns per-group hit tables, the hit length, and the tokens by which the longest
        single-group answer exceeded it (``> 0`` marks a shared-prefix junction).
        """
        hb = self.hash_block_size
        align = self.alignment_tokens
        num_groups = len(self.managers)
        tables: list[list[Block]] = [[] for _ in range(num_groups)]
        answers: dict[int, int] = {}
        views = [coarse_hashes(hashes, sg.spec.block_size // hb) for sg in self.spec_groups]
        simple = len(self.spec_groups) == 2 and self.spec_groups[0].manager_cls.is_full_attention
        hit = max_num_tokens
        longest = 0
        verified: set[int] = set()
        while True:
            cur = hit
            for idx, sg in enumerate(self.spec_groups):
                if sg.manager_cls.is_full_attention and idx in answers:
                    cur = min(cur, answers[idx])
                    continue
                drop = self.managers[sg.group_ids[0]].use_eagle and idx not in verified
                # the EAGLE margin (peek one block past the cap) is a hybrid-coordinator
                # feature in vLLM; a single group drops without peeking
                limit = min(cur + sg.spec.block_size, len(hashes) * hb) \
                    if drop and self._is_hybrid and sg.manager_cls.eagle_margin else cur
                found, num_tokens = sg.manager_cls.find_longest_hit(
                    self.pool, sg.group_ids, sg.spec, views[idx], limit,
                    drop_eagle_block=drop, alignment_tokens=align,
                )
                if drop:
                    verified.add(idx)
                elif num_tokens < cur:
                    verified.clear()
                cur = num_tokens
                answers[idx] = num_tokens
                for gid, table in zip(sg.group_ids, found, strict=True):
                    tables[gid] = table
                longest = max(longest, cur)
            if cur >= hit:
                break
            hit = cur
            if simple:
                break
        self._last_full_attention = self._full_attention_answer(tables, answers)
        for sg in self.spec_groups:
            if sg.manager_cls.is_full_attention:
                keep = -(-hit // sg.spec.block_size)
                for gid in sg.group_ids:
                    del tables[gid][keep:]
        if self.branch is not None:
            return self._branch_hit(hashes, tables, hit, longest, max_num_tokens)
        return tables, hit, longest - hit

    def _branch_hit(self, hashes: Sequence[BlockHash], tables: list[list[Block]], hit: int,
                    longest: int, max_num_tokens: int) -> tuple[list[list[Block]], int, int]:
        """``ckpt:branch``: a deeper hit inside a block on a snapshot, and the branch point
        (the deepest seen prefix) as the junction when it lies past the hit."""
        branch = self.branch
        assert branch is not None
        full_tokens, full_tables = self._last_full_attention
        full_ids = [m.group_id for m in self.managers if m.is_full_attention]
        found = branch.find_partial_hit(hashes, hit, full_tokens, full_tables, full_ids,
                                        max_num_tokens)
        if found is not None:
            tables, hit = found
        u = branch.unit_tokens
        point = branch.branch_point(hashes, hit // u, min(max_num_tokens // u, len(hashes)))
        junction = max(longest, point * u)
        return tables, hit, max(junction - hit, 0)

    def is_partial_hit(self, num_hit_tokens: int) -> bool:
        """A ``ckpt:branch`` hit inside a block (served by copy-on-write)."""
        return self.branch is not None and num_hit_tokens % self.alignment_tokens != 0

    def _full_attention_answer(self, tables: list[list[Block]], answers: dict[int, int],
                               ) -> tuple[int, list[list[Block]]]:
        """The full-attention groups' own (first-pass) hit and their untrimmed tables."""
        full = [idx for idx, sg in enumerate(self.spec_groups)
                if sg.manager_cls.is_full_attention]
        if not full:
            return 0, []
        length = min(answers[idx] for idx in full)
        return length, [list(t) for t in tables]

    @property
    def bridge_tokens(self) -> int | None:
        """Tokens a window-recompute bridge needs: ``sum over window layers of (w - 1)``,
        rounded up to the alignment (``None`` when the model cannot bridge: no full
        attention, or chunked-local layers whose errors do not stay inside a window).

        dsv4-bench: 43 window layers × (128 - 1) = 5,461 → 5,632 tokens (22 × 256).
        """
        return self._bridge_tokens

    def plan_recompute(self, tables: list[list[Block]], num_hit_tokens: int,
                       ) -> tuple[list[list[Block]], int, int, bool]:
        """Turn an ordinary hit into a window-recompute plan (call right after
        ``find_longest_hit``). Does not modify anything.

        Returns per-group tables, the reuse point ``s``, the full-attention end ``F`` and
        whether window KV before ``s`` is missing (a bridge that starts cold). With
        ``F == s`` it is the ordinary hit.
        """
        fa_tokens, fa_tables = self._last_full_attention
        bridge = self._bridge_tokens
        if bridge is None or fa_tokens <= num_hit_tokens:
            return tables, num_hit_tokens, num_hit_tokens, False
        align = self.alignment_tokens
        cold_start = max(0, ((fa_tokens - bridge) // align) * align)
        start = max(num_hit_tokens, cold_start)
        window_missing = start > num_hit_tokens
        planned: list[list[Block]] = []
        for manager, table in zip(self.managers, tables, strict=True):
            if manager.is_full_attention:
                planned.append(fa_tables[manager.group_id][: fa_tokens // manager.block_size])
            elif window_missing:
                planned.append([self.pool.null_block] * (start // manager.block_size))
            else:
                planned.append(table)
        return planned, start, fa_tokens, window_missing

    # -------------------------------------------------------------- allocation
    def num_blocks_to_allocate(self, req_id: ReqId, num_tokens: int,
                               hit_tables: Sequence[Sequence[Block]], num_computed_tokens: int,
                               *, apply_admission_cap: bool,
                               num_main_tokens: int | None = None) -> int:
        """``num_main_tokens``: the slots without lookahead (speculative) tokens, which
        groups that ignore lookahead (recurrent state) use instead of ``num_tokens``."""
        total = 0
        for manager, hit_blocks, cap in zip(self.managers, hit_tables, self._caps, strict=True):
            tokens = num_main_tokens if manager.ignores_lookahead and num_main_tokens \
                is not None else num_tokens
            total += manager.num_blocks_to_allocate(
                req_id, tokens, hit_blocks, num_computed_tokens,
                cap if apply_admission_cap else None,
            )
        if self.is_partial_hit(num_computed_tokens) and hit_tables[0] \
                and req_id not in self.managers[0].tables:
            assert self.branch is not None
            if self.branch.is_fresh([t[-1] for t in hit_tables]):
                return self.pool.num_blocks + 1  # written by this step: admit next step
            total += len(self.managers)  # copy-on-write: a fresh block per group
        return total

    def new_step(self) -> None:
        """A scheduler step starts: managers with per-step state reset it."""
        for manager in self._step_managers:
            manager.new_step()
        if self.branch is not None:
            self.branch.new_step()

    def note_admission(self, hashes: Sequence[BlockHash]) -> None:
        """A request's first admission: ``ckpt:branch`` remembers its prefixes."""
        if self.branch is not None:
            self.branch.note_prompt(hashes)

    def align_prefill_chunk(self, num_computed_tokens: int, num_new_tokens: int,
                            num_tokens: int, num_prompt_tokens: int, junction_tokens: int,
                            max_chunk_tokens: int) -> int:
        """Clip a prefill chunk so that it ends where a recurrent checkpoint must be
        written (``managers.recurrent.align_recurrent_chunk``); unchanged without
        recurrent groups."""
        if self._recurrent_block_size is None:
            return num_new_tokens
        return align_recurrent_chunk(
            num_computed_tokens, num_new_tokens, num_tokens=num_tokens,
            num_prompt_tokens=num_prompt_tokens, junction_tokens=junction_tokens,
            block_size=self._recurrent_block_size,
            max_chunk_tokens=max_chunk_tokens,
            hit_unit_tokens=0 if self.branch is None else self.branch.unit_tokens)

    def covered_tokens(self, req_id: ReqId) -> int:
        """Slots every group's table covered after the request's last allocation (0 when
        none is remembered)."""
        return self._covered_tokens.get(req_id, 0)

    def num_blocks_to_grow(self, req_id: ReqId, num_tokens: int,
                           num_main_tokens: int | None = None) -> int:
        """Blocks a running request's tables need to cover ``num_tokens`` slots (0 at once
        while the last allocation's tables already cover them: most decode steps)."""
        if num_tokens <= self._covered_tokens.get(req_id, 0):
            return 0
        total = 0
        for manager in self.managers:
            tokens = num_main_tokens if manager.ignores_lookahead and num_main_tokens \
                is not None else num_tokens
            total += manager.num_blocks_to_grow(req_id, tokens)
        return total

    def add_hit_blocks(self, req_id: ReqId, hit_tables: Sequence[Sequence[Block]],
                       num_hit_tokens: int) -> None:
        """Touch every group's hit blocks before any group allocates (no double hand-out).
        A ``ckpt:branch`` hit inside a block gets a fresh copy of each snapshot."""
        if self.is_partial_hit(num_hit_tokens) and hit_tables[0]:
            assert self.branch is not None
            fresh = self.branch.copy_on_write(req_id, [t[-1] for t in hit_tables],
                                              num_hit_tokens)
            for manager, hit_blocks, block in zip(self.managers, hit_tables, fresh,
                                                  strict=True):
                manager.add_hit_blocks(req_id, hit_blocks[:-1], num_hit_tokens)
                manager.add_copied_block(req_id, block, num_hit_tokens)
            return
        for manager, hit_blocks in zip(self.managers, hit_tables, strict=True):
            manager.add_hit_blocks(req_id, hit_blocks, num_hit_tokens)

    def allocate_new_blocks(self, req_id: ReqId, num_tokens: int,
                            num_main_tokens: int | None = None) -> list[list[Block]]:
        """Grow every group's table to cover ``num_tokens`` slots (``num_main_tokens`` for
        groups that ignore lookahead); records the slots all tables cover (e.g. bs 16 and
        64 tables of 3 and 1 blocks cover min(48, 64) = 48)."""
        main = num_tokens if num_main_tokens is None else num_main_tokens
        if not self._units_are_batches:
            new_blocks = [m.allocate_new_blocks(
                req_id, main if m.ignores_lookahead else num_tokens) for m in self.managers]
        else:
            new_blocks = []
            for unit in self._units:
                unit.allocate_into(req_id, num_tokens, main, new_blocks)
        self._covered_tokens[req_id] = min(len(m.tables[req_id]) * m.block_size
                                           for m in self._covering)
        return new_blocks

    def remove_skipped_blocks(self, req_id: ReqId, num_computed_tokens: int) -> None:
        """Release what left every group's window. Decode steps mostly release nothing:
        below the request's next release threshold the groups are not even asked."""
        if self.branch is not None:
            self.branch.release(req_id)  # its last step's copies ran
        if num_computed_tokens < self._next_release.get(req_id, 0):
            return
        threshold = 1 << 62
        for unit in self._releasing_units:
            unit.remove_skipped_blocks(req_id, num_computed_tokens)
            threshold = min(threshold, unit.next_release_tokens(num_computed_tokens))
        self._next_release[req_id] = threshold

    def cache_blocks(self, req_id: ReqId, hashes: Sequence[BlockHash], num_tokens: int,
                     num_prompt_tokens: int, junction_tokens: int,
                     bridge_end_tokens: int = 0) -> None:
        """Hash newly full blocks of every group, as the retention policy allows."""
        align = self.alignment_tokens
        replay: tuple[int, ...] = ()
        if self.retention.uses_boundaries:
            replay = replay_boundaries(num_prompt_tokens, align, self.use_eagle)
        aligned = (num_tokens // align) * align
        for step_manager in self._step_managers:
            step_manager.note_computed(req_id, num_tokens)
        branch = self.branch
        if branch is not None:  # full-attention blocks hashed now are not alias sources yet
            first_new = [m.num_cached_blocks.get(req_id, 0) if m.is_full_attention else 0
                         for m in self.managers]
        for unit in self._units:
            manager = unit.lead
            if manager.group_id in self.replayed_group_ids:
                continue  # bounded-replay: rebuilt after each hit, never hashed
            cacheable = num_tokens
            if self.retention.clamps_to_alignment:
                cacheable = aligned
                if manager.use_eagle and aligned > 0:
                    cacheable = min(num_tokens, aligned + manager.block_size)
            boundaries = replay
            if junction_tokens and self.retention.uses_boundaries:
                boundaries = (*replay, junction_tokens)
                if manager.use_eagle:
                    boundaries = (*boundaries, junction_tokens - manager.block_size)
            unit.cache_blocks(req_id, hashes, self.hash_block_size, cacheable, boundaries,
                              bridge_end_tokens)
        if branch is not None:
            for manager, first in zip(self.managers, first_new, strict=True):
                if manager.is_full_attention:
                    branch.note_full_hashed(
                        manager.tables[req_id][first:manager.num_cached_blocks.get(req_id, 0)])
            self._snapshot_branch_point(req_id, hashes, num_tokens, num_prompt_tokens,
                                        junction_tokens)

    def _snapshot_branch_point(self, req_id: ReqId, hashes: Sequence[BlockHash],
                               num_tokens: int, num_prompt_tokens: int,
                               junction_tokens: int) -> None:
        """``ckpt:branch``: a prefill step ending inside a block at the junction (branch
        point) leaves a snapshot there: recurrent states, and full-attention KV as an alias
        of the request's block ``k`` when its prompt fills that block."""
        branch = self.branch
        assert branch is not None
        u, bs = branch.unit_tokens, branch.block_size
        p = num_tokens
        if p % bs == 0 or p % u or p >= num_prompt_tokens or p > len(hashes) * u:
            return
        if p != junction_tokens:
            return
        sources = [m.snapshot_source(req_id, p) for m in self.managers]
        k, ratio = p // bs, bs // u
        full_end = (k + 1) * ratio  # units up to the end of block k
        full_hash = hashes[full_end - 1] \
            if (k + 1) * bs <= num_prompt_tokens and full_end <= len(hashes) else None
        parent = hashes[k * ratio - 1] if k else ROOT_PARENT
        branch.take_snapshot(req_id, hashes[p // u - 1], p, sources, full_hash, parent)

    def free(self, req_id: ReqId, session_id: str | None = None,
             num_output_tokens: int | None = None) -> None:
        """Release every group's blocks. ``session_id`` / ``num_output_tokens`` describe a
        finished request (``None`` on preemption); an eviction policy sees the whole release
        between ``start_release`` and ``end_release``."""
        self._next_release.pop(req_id, None)
        self._covered_tokens.pop(req_id, None)
        if self.branch is not None:
            self.branch.release(req_id, final=True)
        eviction = self.pool.eviction
        if eviction is not None:  # never batched (see _make_units)
            eviction.start_release(self.pool, session_id, num_output_tokens)
            try:
                for manager in self.managers:
                    manager.free(req_id, session_id)
            finally:
                eviction.end_release(self.pool)
            return
        if self._units_are_batches:
            for unit in self._units:
                unit.free(req_id, session_id)
            return
        for manager in self.managers:
            manager.free(req_id, session_id)

    def holders(self) -> dict[int, int]:
        """Block id → number of block tables holding it (null excluded)."""
        counts: dict[int, int] = {}
        for manager in self.managers:
            for table in manager.tables.values():
                for block in table:
                    if not block.is_null:
                        counts[block.block_id] = counts.get(block.block_id, 0) + 1
        if self.branch is not None:
            self.branch.holders(counts)
        return counts


def _bridge_tokens(config: CacheConfig) -> int | None:
    """Bridge length so that every window block of the tail ending at ``F`` is exact.

    A cold bridge from ``s`` leaves window layer ``k`` (in layer order) exact from
    ``s + sum_{j<k} (w_j - 1)`` on; its tail blocks start at ``F - need_k * bs_k``. So
    ``B = max_k (sum_{j<k} (w_j - 1) + need_k * bs_k)``, rounded up to the alignment —
    ``L * (w - 1)`` plus at most one block for equal windows (dsv4-bench: 42 × 127 + 2 × 64
    = 5,462 → 5,632, the same as 43 × 127 rounded). Only ``[F - (w - 1), F)`` is read by a
    hit at ``F``, but the first tail block may also serve a hit at an earlier boundary whose
    older blocks another request cached exactly, so the whole block must be exact.
    """
    kinds = {g.spec.kind for g in config.groups}
    reads_prefix = any(g.spec.is_full_attention for g in config.groups)
    if not reads_prefix or "chunked_local" in kinds \
            or "recurrent_state" in kinds:  # a recurrent state cannot be rebuilt from a window
        return None
    windows = sorted((layer_id, window, g.spec.num_tail_blocks * g.spec.block_size)
                     for g in config.groups for layer_id in g.layer_ids
                     if (window := g.spec.window_tokens) is not None)
    span = spread = 0
    for _, window, tail_tokens in windows:
        span = max(span, spread + tail_tokens)
        spread += window - 1
    align = config.alignment_tokens
    return -(-span // align) * align


def _replayed_windows(config: CacheConfig, retention: RetentionPolicy,
                      ) -> tuple[frozenset[GroupId], int]:
    """Groups ``bounded-replay`` keeps out of prefix caching (sliding-window attention,
    not window-like state) and the replayed window: their largest window.

    deepseek-v4-flash: the two ``sliding_window_mla`` groups, window 128."""
    if not retention.replays_attention_windows:
        return frozenset(), 0
    windows = {g.group_id: window for g in config.groups
               if g.spec.is_attention_window and (window := g.spec.window_tokens) is not None}
    if not windows:
        raise ConfigError("policy", retention.name,
                          "needs sliding-window attention groups to replay; this model has none")
    if len(windows) == len(config.groups):
        raise ConfigError("policy", retention.name,
                          "needs a group that reads the whole prefix (full or compressed "
                          "attention) to hit from; this model has only windows")
    return frozenset(windows), max(windows.values())


def _make_branch(config: CacheConfig, pool: BlockPool, checkpoints: str,
                 ) -> BranchSnapshots | None:
    """The ``ckpt:branch`` machinery, after checking the model suits it: full attention and
    recurrent groups of one block size, EAGLE only with lookahead hashes (each ``u``-hash
    also covers the ``L`` tokens after its unit, so a snapshot at ``p`` serves only
    prompts that continue with the producer's tokens ``[p, p + L)``: the drafter KV of slot
    ``p - 1`` was computed from them), hashes at the policy's unit."""
    kinds = {g.spec.kind for g in config.groups}
    block_size = config.groups[0].spec.block_size
    unit = branch_unit_tokens(checkpoints, block_size)
    if unit is None:
        return None
    if "recurrent_state" not in kinds or kinds - {"recurrent_state", "full_attention"} \
            or any(g.spec.block_size != block_size for g in config.groups):
        raise ConfigError("policy", checkpoints,
                          "sub-block hits need a model of full-attention and recurrent "
                          "groups with one unified block size; use ckpt:chunk or ckpt:block")
    if config.drops_eagle_block:  # lookahead hashes (vLLM 0.33's default) are served
        raise ConfigError("policy", checkpoints,
                          "serves EAGLE/MTP with lookahead block hashes only; drop "
                          "eagle_block_drop (the older drop mode) or use ckpt:chunk")
    if config.hash_block_size != unit:
        raise ConfigError("prefix_match_unit", config.prefix_match_unit,
                          f"{checkpoints} hashes every {unit} tokens; set prefix_match_unit="
                          f"{unit} (KVCacheManager does it for a policy name)")
    capacity = min(max(4 * config.num_blocks * block_size // unit, 1 << 16), 1 << 22)
    return BranchSnapshots(pool, unit, block_size, [g.group_id for g in config.groups],
                           capacity, [g.group_id for g in config.groups
                                      if g.spec.is_full_attention])


def _eagle_group_ids(config: CacheConfig) -> set[int]:
    """Groups that drop EAGLE's block (none under lookahead hashes, vLLM 0.33's default)."""
    if not config.drops_eagle_block:
        return set()
    if config.eagle_group_ids is None:
        return set(range(len(config.groups)))
    return set(config.eagle_group_ids)


def _validate_chunked(spec: LayerSpec, alignment_tokens: int, use_eagle: bool) -> None:
    if spec.block_size != alignment_tokens:
        raise ConfigError(
            "block_size", spec.block_size,
            f"a chunked-local group needs block_size equal to the hit alignment "
            f"{alignment_tokens}; give every group the same block size",
        )
    chunk = getattr(spec, "attention_chunk_size", 0)
    if chunk % spec.block_size:
        raise ConfigError("attention_chunk_size", chunk,
                          f"must be a multiple of block_size={spec.block_size}")
    if use_eagle:
        raise ConfigError("use_eagle", True,
                          "EAGLE drop mode is not supported with chunked-local groups")
