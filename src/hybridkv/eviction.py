"""Eviction policies: the order in which cached free blocks are reused, orthogonal to
retention (which decides *what* is hashed). Combined with a retention policy by name, e.g.
``latest+scan``, ``interval:32768+scan+chain``; see ``make_policies``.

``lru``
    One LRU queue, scratch first (vLLM's order; the default and the reference).
``scan``
    Segmented LRU: a cached block that was never hit since it was cached waits in the
    probation queue (the free queue, evicted first); a block hit at least once goes to the
    protected queue, evicted only after probation is empty. Aging: the protected queue holds
    at most ``protected_fraction`` of the pool; overflow demotes its oldest blocks to the
    probation tail with their hit counts reset, so old favourites must earn protection again.
``chain``
    Dead blocks first: a cached block no hit can use any more — its full-attention parent
    (the previous full-attention block, or for other groups the full-attention block holding
    its last token) was evicted — moves to the dead queue, reused before anything else.
    Evicting a full-attention block kills its dependents transitively (each block dies once).
``session``
    The hashed blocks a finished request of a conversation leaves behind (its latest prompt
    boundary) go to the session queue, evicted after every non-session block. A newer request
    of the same conversation supersedes them (they are demoted); the queue holds at most
    ``session_fraction`` of the pool, the least recently active conversation demoted first.
``predict``
    Learned dead-on-arrival prediction (SHiP-like). The signature of a finished request is
    ``output_signature(num_output_tokens)`` = ⌊log2 n⌋ + 1 (0 → 0, 1 → 1, 32–63 → 6,
    128–255 → 8). When it releases its blocks, those never hit since cached (``num_hits ==
    0``) are *candidates*; if the signature is predicted dead they go to the front of the
    free queue's linked list — reused after the unhashed scratch of the head stack, before
    every LRU (or ``scan`` probation) block; the newest release goes first. Window blocks of
    the release follow the same prediction (a window tail is useless without its
    full-attention prefix). Learning (``ReusePredictor``): each candidate full-attention
    block is logged by hash with the signature and the clock (full-attention blocks
    released so far ≈ block accesses); another access to the hash — a hit, or a recompute
    after its eviction, so the predictor's own evictions cannot hide reuse — before the
    entry is ``predict_horizon`` × pool blocks old counts the signature reused, expiry
    without one counts it dead. A signature is live while it has fewer than
    ``predict_min_samples`` resolved entries or its reuse rate is at least
    ``predict_threshold`` × the global rate: e.g. 40 reused of 200 globally (0.2),
    signature 9 with 3 of 50 (0.06 < 0.5 × 0.2) is dead, signature 6 with 30 of 40 is live.
    The history holds about ``predict_horizon`` × pool entries (memory stays flat).
    Preemptions (``free``) carry no signature: never predicted dead, never logged (their
    blocks still count as accesses). Chain-dead blocks still go first; ``pin:T``'s pinned
    tier still wins; ``predict`` goes before ``session`` protection and ``scan``'s queues.
    Without a full-attention group it never predicts.
``flops``
    Checkpoint-aware eviction for full-attention + recurrent-state models (Marconi: a
    cached state is worth the recompute FLOPs a hit through it saves, per byte it holds).
    A block is worth nothing when no hit can use it (``hybridkv.hitpoints``): a recurrent
    state whose hit point is incomplete (a group lost its copy) or whose full-attention
    chain is cut, a full-attention block that no usable hit point's chain passes through
    (nothing after it can be hit: a request sharing it hits before it and recomputes it),
    and a second copy of a block another live copy serves. Those go to the dead queue —
    at release, and the moment they become worthless while free (an eviction un-anchors
    a whole segment at once, where LRU would keep it block by block). A release is linked
    *segment by segment*, deepest first: each hit point's states right before the
    full-attention blocks it is the deepest anchor of, and states of this chain released
    earlier (the hit checkpoint, freed at the request's first step) are moved back beside
    their segment — so LRU evicts a chain from its end one whole segment at a time, and a
    shallower checkpoint outlives the deeper segments instead of dying before them. A
    segment ``(p_prev, p]`` then costs its ``(p - p_prev) / bs`` full-attention blocks plus
    one block per recurrent group and saves ``p - p_prev`` tokens of recompute (the hit
    falls back to ``p_prev``): the value per byte Marconi ranks by, realised here as
    evicting whole segments from the chain's end. Combines with every retention and
    checkpoint policy (``latest+ckpt:branch+flops``) and with ``scan``/``predict``
    (worthless blocks go first; the rest keeps their order).

Every operation is O(1) per block (amortised for the demotions, each of which moves a block
that entered the queue once, and for the prediction history, whose entries each expire once).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridkv.block import DEAD_QUEUE, FREE_QUEUE, PROTECTED_QUEUE, SESSION_QUEUE, Block
from hybridkv.errors import ConfigError, InvariantViolation
from hybridkv.hitpoints import HitPoints
from hybridkv.ids import BlockHash, GroupId
from hybridkv.native import mypyc_attr
from hybridkv.pool import BlockPool, EvictionHook, FreeTier
from hybridkv.specs import LayerSpec

EVICTION_NAMES = ("lru", "scan", "chain", "session", "predict", "flops")
ROOT_PARENT = BlockHash(b"")
"""``parent_hash`` of a first full-attention block: its usefulness depends on nothing."""


def output_signature(num_output_tokens: int) -> int:
    """``predict``'s signature of a finished request: ⌊log2 n⌋ + 1, 0 for no output.

    >>> [output_signature(n) for n in (0, 1, 2, 3, 31, 32, 64, 127, 128, 512)]
    [0, 1, 2, 2, 5, 6, 7, 7, 8, 10]
    """
    return max(num_output_tokens, 0).bit_length()


@mypyc_attr(allow_interpreted_subclasses=True)  # tests subclass it
class ReusePredictor:
    """Per-signature reuse rates learned from a bounded history of logged blocks.

    ``access`` logs a full-attention block hash with a signature at the current ``clock``;
    the entry resolves *reused* when a later ``access`` of the hash (a hit, or a recompute
    after its eviction) comes before it is ``horizon`` clock ticks old, else *dead* when
    ``expire`` finds it older. Worked example (horizon 4, threshold 0.5, min_samples 2):
    sig 1 logs h1, h2 and sig 9 logs h3, h4 at clock 0; h1, h2 are accessed again; at clock
    5 (age 5 > 4) h3, h4 expire dead: sig 1 has 2/2 reused, sig 9 0/2, global 2/4; sig 9 is
    dead (0 < 0.5 × 0.5), sig 1 live, sig 6 live (no samples).

    >>> p = ReusePredictor(horizon=4, threshold=0.5, min_samples=2)
    >>> for h, sig in ((b"h1", 1), (b"h2", 1), (b"h3", 9), (b"h4", 9)):
    ...     p.access(BlockHash(h), sig)
    >>> p.access(BlockHash(b"h1"), None); p.access(BlockHash(b"h2"), 6)
    >>> p.clock = 5; p.expire({})
    >>> p.is_live(1), p.is_live(9), p.is_live(6), len(p.history)
    (True, False, True, 0)

    Invariants (``check``): history entries are in non-decreasing log time, none in the
    future; an entry counts once (reused, or dead at expiry); when the clock advances at
    least one tick per logged entry (as ``EvictionPolicy`` drives it: one per released
    full-attention block), ``len(history) <= horizon`` after ``expire`` — memory is flat.
    """

    def __init__(self, horizon: int, threshold: float, min_samples: int) -> None:
        self.horizon = horizon
        self.threshold = threshold
        self.min_samples = min_samples
        self.clock = 0
        """Full-attention blocks released so far (the history's time unit)."""
        self.history: OrderedDict[BlockHash, list[int]] = OrderedDict()
        """hash → [signature, log time, reused (0/1)], oldest first."""
        self.num_reused: dict[int, int] = {}
        self.num_dead: dict[int, int] = {}
        self.total_reused = 0
        self.total_dead = 0

    def is_live(self, signature: int) -> bool:
        """Predicted to be hit again: too few samples, or a reuse rate at least
        ``threshold`` × the global rate."""
        reused = self.num_reused.get(signature, 0)
        resolved = reused + self.num_dead.get(signature, 0)
        if resolved < self.min_samples:
            return True
        total = self.total_reused + self.total_dead
        return reused * total >= self.threshold * self.total_reused * resolved

    def access(self, block_hash: BlockHash, signature: int | None) -> None:
        """A released block was accessed by its request: a watched hash counts one reuse
        for its entry's signature (once per entry) — whether the request hit it or had to
        recompute it, so eviction decisions do not bias the learning; an unwatched one is
        logged when ``signature`` is given (a finished request's never-hit block)."""
        entry = self.history.get(block_hash)
        if entry is None:
            if signature is not None:
                self.history[block_hash] = [signature, self.clock, 0]
        elif not entry[2]:
            entry[2] = 1
            self._count_reused(entry[0])

    def expire(self, index: Mapping[BlockHash, Block]) -> None:
        """Resolve entries older than the horizon; one still cached and hit since (its
        hitter has not released it yet: ``num_hits > 0`` in ``index``) counts reused."""
        history = self.history
        oldest = self.clock - self.horizon
        while history:
            block_hash, entry = next(iter(history.items()))
            if entry[1] >= oldest:
                break
            del history[block_hash]
            if entry[2]:
                continue
            block = index.get(block_hash)
            if block is not None and block.num_hits > 0:
                self._count_reused(entry[0])
            else:
                self.num_dead[entry[0]] = self.num_dead.get(entry[0], 0) + 1
                self.total_dead += 1

    def _count_reused(self, signature: int) -> None:
        self.num_reused[signature] = self.num_reused.get(signature, 0) + 1
        self.total_reused += 1

    def check(self) -> None:
        """Verify the invariants (after ``expire``)."""
        if len(self.history) > self.horizon:
            raise InvariantViolation(f"predict history holds {len(self.history)} entries, "
                                     f"horizon {self.horizon}")
        last = 0
        for _, log_time, _ in self.history.values():
            if not last <= log_time <= self.clock:
                raise InvariantViolation(f"predict history out of order at time {log_time}")
            last = log_time
        if sum(self.num_reused.values()) != self.total_reused or \
                sum(self.num_dead.values()) != self.total_dead:
            raise InvariantViolation("predict per-signature counts do not add up")


@dataclass(frozen=True, slots=True)
class EvictionOptions:
    """Which eviction components are on, and their sizes."""

    scan: bool = False
    chain: bool = False
    session: bool = False
    predict: bool = False
    flops: bool = False
    protected_fraction: float = 0.8
    session_fraction: float = 0.5
    predict_horizon: float = 0.5
    """``predict``: history horizon, in pool blocks' worth of released full-attention
    blocks (18,481 blocks → 9,240)."""
    predict_threshold: float = 0.5
    """``predict``: a signature is dead below this fraction of the global reuse rate."""
    predict_min_samples: int = 32
    """``predict``: resolved entries a signature needs before it can be predicted dead."""

    @property
    def name(self) -> str:
        parts = [n for n, on in (("scan", self.scan), ("chain", self.chain),
                                  ("session", self.session), ("predict", self.predict),
                                  ("flops", self.flops)) if on]
        return "+".join(parts) or "lru"


class EvictionPolicy(EvictionHook):
    """Places freed cached blocks into the pool's queues; hooks into caching and eviction.

    Invariants (``check_invariants``, called by the pool's): a block carries ``is_dead``
    only while hashed; every block in the session queue is recorded in ``_session_blocks``
    under its owner; (``predict``) every block in ``_predicted`` is hashed, and walking the
    free queue's linked list no other hashed block precedes a predicted-dead one (they are
    evicted before every LRU block; unhashed blocks may sit anywhere).
    """

    def __init__(self, options: EvictionOptions, num_blocks: int,
                 chain_group_id: GroupId | None,
                 group_specs: Sequence[LayerSpec] = ()) -> None:
        self.options = options
        self.name = options.name
        self.chain_group_id = chain_group_id if options.chain else None
        self._protected_cap = max(1, int(options.protected_fraction * (num_blocks - 1)))
        self._session_cap = max(1, int(options.session_fraction * (num_blocks - 1)))
        # chain: full-attention parent hash -> its cached dependents (by block id)
        self._dependents: dict[BlockHash, dict[int, Block]] = {}
        # session: conversation -> blocks it protects, least recently active first
        self._session_blocks: OrderedDict[str, list[Block]] = OrderedDict()
        self._session_owner: dict[int, str] = {}
        # predict: the learner, its key group, and the release in progress
        self.predict_group_id = chain_group_id if options.predict else None
        self.predictor = None if self.predict_group_id is None else ReusePredictor(
            max(1, int(options.predict_horizon * (num_blocks - 1))),
            options.predict_threshold, options.predict_min_samples)
        self._release_signature: int | None = None
        self._release_is_dead = False
        self._predicted: set[int] = set()
        """Ids of blocks filed predicted-dead, until reallocated or released again."""
        self.num_predicted_dead = 0
        """Blocks filed predicted-dead so far (a counter for reports and tests)."""
        self.hitpoints: HitPoints | None = None
        """``flops``: usable hit points and anchored blocks (set by ``bind``)."""
        self._point_group_ids: list[GroupId] = []
        if options.flops:
            unsupported = sorted({s.kind for s in group_specs if s.flops_role is None})
            if unsupported or chain_group_id is None:
                raise ConfigError(
                    "policy", "flops",
                    "values hit points of full-attention + recurrent-state models; this "
                    f"model has {', '.join(unsupported) or 'no full-attention'} groups: "
                    "drop +flops")
            self._point_group_ids = [GroupId(g) for g, spec in enumerate(group_specs)
                                     if spec.flops_role == "points"]
        self._flops_group_id = chain_group_id
        self._releasing = False
        self._release_buffer: list[Block] = []
        self._release_tier = FreeTier.TAIL
        self._release_session: str | None = None
        self.num_worthless = 0
        """Blocks filed worthless at release (``flops``; a counter for reports and tests)."""

    def bind(self, pool: BlockPool) -> None:
        """Attach to the pool this policy serves (``flops`` tracks its hash index)."""
        if self.options.flops and self._flops_group_id is not None:
            self.hitpoints = HitPoints(pool, self._flops_group_id, self._point_group_ids)

    # ---------------------------------------------------------------- caching
    def on_cached(self, block: Block, parent_hash: BlockHash | None) -> None:
        if self.hitpoints is not None:
            self.hitpoints.on_cached(block, parent_hash)
        if self.chain_group_id is None:
            return
        block.parent_hash = parent_hash
        if parent_hash is not None and parent_hash != ROOT_PARENT:
            self._dependents.setdefault(parent_hash, {})[block.block_id] = block

    def on_evicted(self, pool: BlockPool, block: Block, block_hash: BlockHash,
                   group_id: GroupId, *, still_cached: bool) -> None:
        """``block`` lost ``block_hash``; with ``chain``, its dependents may die."""
        if self.hitpoints is not None:
            self.hitpoints.on_evicted(block_hash, group_id, still_cached)
        if self.predictor is not None:
            self._predicted.discard(block.block_id)
        if self.chain_group_id is None:
            return
        parent = block.parent_hash
        if parent is not None and parent != ROOT_PARENT:
            siblings = self._dependents.get(parent)
            if siblings is not None:
                siblings.pop(block.block_id, None)
                if not siblings:
                    del self._dependents[parent]
        if group_id != self.chain_group_id or still_cached:
            return
        stack = [block_hash]
        while stack:
            for dependent in self._dependents.pop(stack.pop(), {}).values():
                if dependent.block_hash is None or dependent.is_dead:
                    continue
                dependent.is_dead = True
                if dependent.queue_id is not None and dependent.queue_id != DEAD_QUEUE:
                    pool.move(dependent, FreeTier.DEAD)
                if dependent.hash_group_id == self.chain_group_id:
                    stack.append(dependent.block_hash)  # its own dependents die with it

    # ---------------------------------------------------------------- freeing
    def place(self, pool: BlockPool, blocks: list[Block], default_tier: FreeTier,
              session_id: str | None) -> None:
        """Link freed hashed blocks (ref 0), in order, into their queues."""
        if self.predictor is not None:
            self._learn(blocks)
        if default_tier is FreeTier.PINNED:  # the pin:T retention tier wins
            if self.hitpoints is not None:
                worthless = [b for b in blocks if self.hitpoints.worthless(b)]
                if worthless:
                    pool.link(worthless, FreeTier.DEAD)
                    blocks = [b for b in blocks if not self.hitpoints.worthless(b)]
            pool.link(blocks, default_tier)
            return
        if self._releasing and self.hitpoints is not None:
            self._release_buffer.extend(blocks)  # linked segment by segment at the end
            self._release_tier = default_tier
            self._release_session = session_id
            return
        self._place(pool, blocks, default_tier, session_id)

    def _place(self, pool: BlockPool, blocks: list[Block], default_tier: FreeTier,
               session_id: str | None) -> None:
        dead: list[Block] = []
        live: list[Block] = []
        hitpoints = self.hitpoints
        for block in blocks:
            if self._is_dead(pool, block) or (
                    hitpoints is not None and self._is_worthless(pool, block, hitpoints)):
                dead.append(block)
            else:
                live.append(block)
        if dead:
            pool.link(dead, FreeTier.DEAD)
        if self._release_is_dead and live:
            live = self._file_predicted_dead(pool, live)
        if not live:
            return
        if self.options.session and session_id is not None:
            self._protect_session(pool, session_id, live)
            return
        self._link_by_hits(pool, live, default_tier)

    def _link_by_hits(self, pool: BlockPool, blocks: Sequence[Block],
                      default_tier: FreeTier) -> None:
        if not self.options.scan:
            pool.link(list(blocks), default_tier)
            return
        probation = [b for b in blocks if b.num_hits == 0]
        protected = [b for b in blocks if b.num_hits > 0]
        if probation:
            pool.link(probation, FreeTier.TAIL)
        if protected:
            pool.link(protected, FreeTier.PROTECTED)
            queue = pool.queues[PROTECTED_QUEUE]
            while queue.num_blocks > self._protected_cap:
                oldest = queue.popleft()
                oldest.queue_id = None
                oldest.num_hits = 0  # aging: earn protection again
                pool.link([oldest], FreeTier.TAIL)

    def _is_worthless(self, pool: BlockPool, block: Block, hitpoints: HitPoints) -> bool:
        """``flops``: no hit can use the block, or another live copy serves its hits (a
        held copy wins; a free copy in a live queue gives way to this fresher one)."""
        if hitpoints.worthless(block):
            self.num_worthless += 1
            return True
        key, group_id = block.block_hash, block.hash_group_id
        assert key is not None and group_id is not None
        copies = pool.cached_copies(key, group_id)
        if len(copies) > 1:
            others = [c for c in copies if c is not block]
            if any(c.ref_count for c in others):
                self.num_worthless += 1
                return True
            for other in others:
                if other.queue_id is not None and other.queue_id != DEAD_QUEUE:
                    pool.move(other, FreeTier.DEAD)
                    self.num_worthless += 1
        return False

    def _segment_order(self, pool: BlockPool, blocks: list[Block],
                       hitpoints: HitPoints) -> list[Block]:
        """A whole release, segment by segment from the chain's end: each usable hit
        point's states right before the full-attention block it ends at (the chain's
        blocks come tail first); free states of this chain's points released earlier are
        unlinked and joined to their segment; other blocks keep their order after."""
        fa = self._flops_group_id
        point_groups = self._point_group_ids
        fa_blocks = [b for b in blocks if b.hash_group_id == fa]
        by_end: dict[BlockHash | None, list[Block]] = {}
        rest: list[Block] = []
        released = {b.block_id for b in blocks}
        for block in blocks:
            if block.hash_group_id == fa:
                continue
            key = block.block_hash
            if key is not None and block.hash_group_id in point_groups \
                    and key in hitpoints.counted:
                by_end.setdefault(hitpoints.point_end.get(key), []).append(block)
            else:
                rest.append(block)
        free_queue = pool.queues[FREE_QUEUE]
        for block in fa_blocks:
            key = block.block_hash
            assert key is not None
            for point in hitpoints.anchoring_points(key):
                for group_id in point_groups:
                    for copy in pool.cached_copies(point, group_id):
                        if copy.ref_count == 0 and copy.queue_id == FREE_QUEUE \
                                and copy.block_id not in released:
                            free_queue.remove(copy)
                            copy.queue_id = None
                            released.add(copy.block_id)
                            by_end.setdefault(key, []).append(copy)
        ordered: list[Block] = []
        for block in fa_blocks:
            ordered.extend(by_end.pop(block.block_hash, ()))
            ordered.append(block)
        for leftover in by_end.values():
            ordered.extend(leftover)
        ordered.extend(rest)
        return ordered

    def _is_dead(self, pool: BlockPool, block: Block) -> bool:
        if self.chain_group_id is None:
            return False
        if block.is_dead:
            return True
        parent = block.parent_hash
        if parent == ROOT_PARENT:
            return False
        if parent is None or pool.get_cached_block(parent, self.chain_group_id) is None:
            block.is_dead = True
            return True
        return False

    # ---------------------------------------------------------------- predict
    def _learn(self, blocks: Sequence[Block]) -> None:
        """Feed one ``place`` call to the predictor: every released full-attention block is
        an access (a watched hash counts reused; a finished request's never-hit block is
        logged); the clock advances by the full-attention blocks released."""
        predictor = self.predictor
        assert predictor is not None
        group_id = self.predict_group_id
        signature = self._release_signature
        released = 0
        for block in blocks:
            if block.hash_group_id != group_id:
                continue
            released += 1
            block_hash = block.block_hash
            assert block_hash is not None
            predictor.access(block_hash, None if block.num_hits else signature)
        predictor.clock += released
        if self._predicted:  # released again (after a hit): no longer predicted dead
            self._predicted.difference_update(b.block_id for b in blocks)

    def _file_predicted_dead(self, pool: BlockPool, blocks: list[Block]) -> list[Block]:
        """Link never-hit blocks of a predicted-dead release at the front of the free
        queue's linked list (behind the scratch stack); return the others."""
        doomed = [b for b in blocks if b.num_hits == 0]
        if not doomed:
            return blocks
        self._predicted.update(block.block_id for block in doomed)
        pool.queues[FREE_QUEUE].push_front_n(doomed)  # stamps FREE_QUEUE on them
        self.num_predicted_dead += len(doomed)
        return [b for b in blocks if b.num_hits > 0]

    def start_release(self, pool: BlockPool, session_id: str | None,
                      num_output_tokens: int | None = None) -> None:
        """A request is about to release its groups' blocks; ``end_release`` follows.

        ``session_id`` is set for a finished request of a conversation: the session's
        previous protected set is superseded (demoted) once, and the blocks of every group
        released next form the new set. ``num_output_tokens`` is set for a finished request
        (``None`` on preemption): ``predict`` decides once for the whole release."""
        if self.hitpoints is not None:
            self._releasing = True
        if self.predictor is not None and num_output_tokens is not None:
            signature = output_signature(num_output_tokens)
            self._release_signature = signature
            self._release_is_dead = not self.predictor.is_live(signature)
        if not self.options.session or session_id is None:
            return
        previous = self._session_blocks.pop(session_id, None)
        if previous is not None:
            self._demote(pool, session_id, previous)
        self._session_blocks[session_id] = []

    def end_release(self, pool: BlockPool) -> None:
        """The release is over: link its blocks (``flops``: segment by segment), forget its
        prediction, resolve expired history entries."""
        if self._releasing:
            self._releasing = False
            buffered, self._release_buffer = self._release_buffer, []
            if buffered and self.hitpoints is not None:
                self._place(pool, self._segment_order(pool, buffered, self.hitpoints),
                            self._release_tier, self._release_session)
        self._release_signature = None
        self._release_is_dead = False
        if self.predictor is not None and self.predict_group_id is not None:
            self.predictor.expire(pool.group_index(self.predict_group_id))

    def _protect_session(self, pool: BlockPool, session_id: str, blocks: list[Block]) -> None:
        for block in blocks:
            self._session_owner[block.block_id] = session_id
        pool.link(blocks, FreeTier.SESSION)
        current = self._session_blocks.get(session_id)
        if current is None:  # released without start_release: a set of its own
            self._session_blocks[session_id] = list(blocks)
        else:
            current.extend(blocks)
        queue = pool.queues[SESSION_QUEUE]
        while queue.num_blocks > self._session_cap and len(self._session_blocks) > 1:
            oldest_session, oldest_blocks = next(iter(self._session_blocks.items()))
            if oldest_session == session_id:
                break
            del self._session_blocks[oldest_session]
            self._demote(pool, oldest_session, oldest_blocks)

    def _demote(self, pool: BlockPool, session_id: str, blocks: list[Block]) -> None:
        demoted: list[Block] = []
        for block in blocks:
            if self._session_owner.get(block.block_id) != session_id:
                continue
            del self._session_owner[block.block_id]
            if block.queue_id == SESSION_QUEUE:
                pool.queues[SESSION_QUEUE].remove(block)
                block.queue_id = None
                demoted.append(block)
        if demoted:
            self._link_by_hits(pool, demoted, FreeTier.TAIL)


    # ------------------------------------------------------------- invariants
    def check_invariants(self, pool: BlockPool) -> None:
        """Verify the class invariants (the pool's ``check_invariants`` calls this)."""
        if self.hitpoints is not None:
            self.hitpoints.check_invariants()
        self._check_dead_and_session(pool)
        if self.predictor is not None:
            self.predictor.check()
        self._check_predicted(pool)

    def _check_dead_and_session(self, pool: BlockPool) -> None:
        for block in pool.blocks:
            if block.is_dead and block.block_hash is None:
                raise InvariantViolation(f"{block!r} is marked dead but not hashed")
        for block in pool.queues[SESSION_QUEUE]:
            owner = self._session_owner.get(block.block_id)
            if owner is None or all(b is not block for b in self._session_blocks.get(owner, ())):
                raise InvariantViolation(f"{block!r} is in the session queue without an owner")

    def _check_predicted(self, pool: BlockPool) -> None:
        predicted = self._predicted
        for block_id in predicted:
            if pool.blocks[block_id].block_hash is None:
                raise InvariantViolation(f"{pool.blocks[block_id]!r} predicted dead, unhashed")
        if not predicted:
            return
        seen_lru = None
        for block in pool.free_queue:
            if block.block_id in predicted:
                if seen_lru is not None:
                    raise InvariantViolation(f"predicted-dead {block!r} queued behind the "
                                             f"cached LRU block {seen_lru!r}")
            elif block.block_hash is not None:
                seen_lru = block


def parse_eviction(parts: Sequence[str]) -> EvictionOptions:
    """Eviction options from name parts (``["scan", "chain"]``); ``lru`` alone is the default."""
    flags = {"scan": False, "chain": False, "session": False, "predict": False,
             "flops": False}
    for part in parts:
        if part == "lru":
            continue
        if part not in flags:
            raise ConfigError("policy", part,
                              f"unknown eviction policy; choose from {', '.join(EVICTION_NAMES)}")
        flags[part] = True
    return EvictionOptions(**flags)
