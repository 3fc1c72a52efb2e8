"""Block-LRU host tiers: full-attention blocks and states kept and dropped independently.

``lru``: one LRU list of blocks over one budget (what vLLM 0.33's CPU offloading manager
does with its ``lru`` policy: every computed block is offered, a block is one chunk, the
least recently used chunk goes first; within a request the tail goes before the head).

``lru-split:S``: the HiCache-style split — full-attention KV and state (window tails,
recurrent checkpoints, compressor state) in two LRU pools, the state pool a fixed share
``S`` of the bytes (SGLang sizes its host Mamba pool by a ratio; #39851 reports half the
host memory going to states). Neither pool knows the other: a chain can outlive every
landing state (dead KV) and a checkpoint its chain.

Worked example (one full and one recurrent group, blocks of 4, 4 blocks of room, half to
state): a 12-token request with checkpoints at 8 and 12 offers 3 KV blocks and 2 states;
the KV pool (2 blocks) keeps the two most recent — the head ``h0`` and ``h1`` (tails go
first) — so the kept checkpoint at 12 has no chain.

>>> from hybridkv.host_tier import HostGroup, HostShape, ReleasedBlocks
>>> from hybridkv.ids import BlockHash, GroupId
>>> shape = HostShape((HostGroup(GroupId(0), 4, None), HostGroup(GroupId(1), 4, 1)), 4, 4, 1)
>>> tier = BlockLRUTier(shape, capacity_blocks=4, state_share=0.5)
>>> h = [BlockHash(bytes([i])) for i in range(3)]
>>> tier.store(ReleasedBlocks(h, ([0, 1, 2], [1, 2]), 12))
>>> [tier.holds(GroupId(0), x) for x in h], tier.occupancy_blocks()
([True, True, False], (2, 2))
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hybridkv.errors import InvariantViolation
from hybridkv.host_tier import HostHit, HostKey, HostShape, HostTier, ReleasedBlocks
from hybridkv.ids import BlockHash, GroupId


class BlockLRUTier(HostTier):
    """LRU over blocks, one pool (``state_share`` ``None``) or a KV and a state pool.

    Invariants (``check_invariants``): each pool holds at most its capacity; KV keys are
    full-attention groups', state keys the others'; the capacities sum to
    ``capacity_blocks``."""

    def __init__(self, shape: HostShape, capacity_blocks: int,
                 state_share: float | None = None) -> None:
        super().__init__(shape, capacity_blocks)
        self.state_share = state_share
        self.name = "lru" if state_share is None else f"lru-split:{state_share:g}"
        self._full_ids = frozenset(g.group_id for g in shape.full_groups)
        self._kv: OrderedDict[HostKey, None] = OrderedDict()
        self._state: OrderedDict[HostKey, None] = self._kv
        self._capacity = {id(self._kv): capacity_blocks}
        if state_share is not None:
            state_blocks = round(capacity_blocks * state_share)
            self._state = OrderedDict()
            self._capacity = {id(self._kv): capacity_blocks - state_blocks,
                              id(self._state): state_blocks}

    def _pool(self, key: HostKey) -> OrderedDict[HostKey, None]:
        return self._kv if key[0] in self._full_ids else self._state

    def holds(self, group_id: GroupId, block_hash: BlockHash) -> bool:
        key = (group_id, block_hash)
        return key in self._pool(key)

    @property
    def used_blocks(self) -> int:
        return len(self._kv) + (len(self._state) if self._state is not self._kv else 0)

    def occupancy_blocks(self) -> tuple[int, int]:
        kv = sum(1 for k in self._kv if k[0] in self._full_ids)
        return kv, self.used_blocks - kv

    def store(self, released: ReleasedBlocks) -> None:
        """Offer every cached block; the request's blocks end most recent, its tail least
        (vLLM's order). A pool that cannot make room without dropping this request's own
        blocks keeps the head-most of its new blocks that fit."""
        by_end: list[tuple[int, HostKey]] = []
        for group, indexes in zip(self.shape.groups, released.cached, strict=True):
            for i in indexes:
                key = (group.group_id, self.shape.block_hash(released.hashes, group, i))
                by_end.append(((i + 1) * group.block_size, key))
        by_end.sort(key=lambda item: -item[0])
        offered = {key for _, key in by_end}
        new: list[HostKey] = []
        for _, key in by_end:  # held ones to the end first: victims are others
            pool = self._pool(key)
            if key in pool:
                pool.move_to_end(key)
            else:
                new.append(key)
        for key in reversed(new):  # head first: a full pool keeps the head-most blocks
            pool = self._pool(key)
            if not self._make_room(pool, offered):
                self.counters.refused_blocks += 1
                continue
            pool[key] = None
            self.note_stored(key)
        for _, key in by_end:  # the request's order: tail least recent, head most
            pool = self._pool(key)
            if key in pool:
                pool.move_to_end(key)

    def _make_room(self, pool: OrderedDict[HostKey, None], protected: set[HostKey]) -> bool:
        capacity = self._capacity[id(pool)]
        if capacity <= 0:
            return False
        while len(pool) >= capacity:
            victim = next((k for k in pool if k not in protected), None)
            if victim is None:
                return False
            del pool[victim]
            self.counters.evicted_blocks += 1
        return True

    def touch(self, hashes: Sequence[BlockHash], hit: HostHit) -> None:
        del hashes
        for key in reversed(hit.loaded):
            pool = self._pool(key)
            if key in pool:
                pool.move_to_end(key)

    def check_invariants(self) -> None:
        for pool in {id(self._kv): self._kv, id(self._state): self._state}.values():
            if len(pool) > self._capacity[id(pool)]:
                raise InvariantViolation(f"host pool holds {len(pool)} blocks, capacity "
                                         f"{self._capacity[id(pool)]}")
        if self._state is not self._kv and (
                any(k[0] not in self._full_ids for k in self._kv)
                or any(k[0] in self._full_ids for k in self._state)):
            raise InvariantViolation("a host block sits in the other kind's pool")
        if self.used_blocks > self.capacity_blocks:
            raise InvariantViolation("host holds more blocks than its capacity")
