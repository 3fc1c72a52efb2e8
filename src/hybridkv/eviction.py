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

Every operation is O(1) per block (amortised for the demotions, each of which moves a block
that entered the queue once).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.block import DEAD_QUEUE, PROTECTED_QUEUE, SESSION_QUEUE, Block
from hybridkv.errors import ConfigError
from hybridkv.ids import BlockHash, GroupId
from hybridkv.pool import BlockPool, FreeTier

EVICTION_NAMES = ("lru", "scan", "chain", "session")
ROOT_PARENT = BlockHash(b"")
"""``parent_hash`` of a first full-attention block: its usefulness depends on nothing."""


@dataclass(frozen=True, slots=True)
class EvictionOptions:
    """Which eviction components are on, and their sizes."""

    scan: bool = False
    chain: bool = False
    session: bool = False
    protected_fraction: float = 0.8
    session_fraction: float = 0.5

    @property
    def name(self) -> str:
        parts = [n for n, on in (("scan", self.scan), ("chain", self.chain),
                                  ("session", self.session)) if on]
        return "+".join(parts) or "lru"


class EvictionPolicy:
    """Places freed cached blocks into the pool's queues; hooks into caching and eviction.

    Invariants (checked through the pool's): a block carries ``is_dead`` only while hashed;
    every block in the session queue is recorded in ``_session_blocks`` under its owner.
    """

    def __init__(self, options: EvictionOptions, num_blocks: int,
                 chain_group_id: GroupId | None) -> None:
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

    # ---------------------------------------------------------------- caching
    def on_cached(self, block: Block, parent_hash: BlockHash | None) -> None:
        if self.chain_group_id is None:
            return
        block.parent_hash = parent_hash
        if parent_hash is not None and parent_hash != ROOT_PARENT:
            self._dependents.setdefault(parent_hash, {})[block.block_id] = block

    def on_evicted(self, pool: BlockPool, block: Block, block_hash: BlockHash,
                   group_id: GroupId, *, still_cached: bool) -> None:
        """``block`` lost ``block_hash``; with ``chain``, its dependents may die."""
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
        if default_tier is FreeTier.PINNED:  # the pin:T retention tier wins
            pool.link(blocks, default_tier)
            return
        dead: list[Block] = []
        live: list[Block] = []
        for block in blocks:
            (dead if self._is_dead(pool, block) else live).append(block)
        if dead:
            pool.link(dead, FreeTier.DEAD)
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

    def start_release(self, pool: BlockPool, session_id: str) -> None:
        """A finished request of ``session_id`` is about to release its groups' blocks:
        the session's previous protected set is superseded (demoted) once, and the blocks
        of every group released next form the new set."""
        if not self.options.session:
            return
        previous = self._session_blocks.pop(session_id, None)
        if previous is not None:
            self._demote(pool, session_id, previous)
        self._session_blocks[session_id] = []

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


def parse_eviction(parts: Sequence[str]) -> EvictionOptions:
    """Eviction options from name parts (``["scan", "chain"]``); ``lru`` alone is the default."""
    flags = {"scan": False, "chain": False, "session": False}
    for part in parts:
        if part == "lru":
            continue
        if part not in flags:
            raise ConfigError("policy", part,
                              f"unknown eviction policy; choose from {', '.join(EVICTION_NAMES)}")
        flags[part] = True
    return EvictionOptions(**flags)
