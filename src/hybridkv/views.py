"""Read-only views of cache state for engines: hit blocks, cached blocks, queues, usage.

Everything here but ``GroupTables`` is a frozen value copied out of the manager: holding one
never pins or changes a block, and it does not follow later changes (take a new snapshot).
``GroupTables`` is a live, read-only window on one group's block tables (no copy per call).

>>> from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager
>>> manager = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 8), "dense")
>>> manager.add_request("a", list(range(9)))
>>> _ = manager.allocate_slots("a", 9)
>>> manager.remove_request("a")
>>> snap = manager.snapshot()
>>> [(b.block_id, b.group_id, b.ref_count) for b in snap.cached_blocks]
[(1, 0, 0), (2, 0, 0)]
>>> snap.free_queue  # allocation order: the never-used blocks, then the freed ones (LRU)
(4, 5, 6, 7, 3, 2, 1)
>>> snap.groups[0]
GroupUsage(group_id=0, kind='full_attention', held_blocks=0, cached_blocks=2, cached_free_blocks=2)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from hybridkv.block import Block
from hybridkv.ids import BlockHash, ReqId
from hybridkv.managers.base import GroupManager
from hybridkv.pool import BlockPool
from hybridkv.specs import CacheGroup


@dataclass(frozen=True, slots=True)
class BlockView:
    """One block of a hit table, frozen at lookup time.

    ``is_null``: the table position needs no KV (block 0); ``block_hash`` /
    ``hash_group_id``: the prefix hash it was cached under and its group (``None`` when
    unhashed); ``ref_count``: requests holding it while the hit is valid (0: free, so it
    can be evicted before the admission takes it).
    """

    block_id: int
    is_null: bool
    block_hash: BlockHash | None
    hash_group_id: int | None
    ref_count: int

    @classmethod
    def of(cls, block: Block) -> BlockView:
        return cls(block.block_id, block.is_null, block.block_hash, block.hash_group_id,
                   block.ref_count)


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """A block whose KV is indexed under a prefix hash (hittable).

    ``ref_count``: running requests holding it (0: free, evictable); ``queue``: the free
    queue it waits in (``None`` while held): ``dead``, ``free``, ``protected``,
    ``session`` or ``pinned``.
    """

    block_id: int
    group_id: int
    block_hash: BlockHash
    ref_count: int
    queue: str | None


@dataclass(frozen=True, slots=True)
class GroupUsage:
    """One cache group's share of the pool: blocks in its running requests' tables
    (``held_blocks``), blocks indexed under its hashes (``cached_blocks``) and those of
    them no request holds (``cached_free_blocks``, reclaimable)."""

    group_id: int
    kind: str
    held_blocks: int
    cached_blocks: int
    cached_free_blocks: int


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """The whole cache at one instant (``KVCacheManager.snapshot``).

    ``free_queue``: free block ids in the order allocation takes them (every tier, head
    first); ``cached_blocks``: every hashed block, by block id; ``groups``: per-group usage;
    ``epoch``: the pool epoch (a ``PrefixHit`` from the same epoch is still valid).
    """

    epoch: int
    num_blocks: int
    num_free_blocks: int
    free_queue: tuple[int, ...]
    cached_blocks: tuple[CachedBlock, ...]
    groups: tuple[GroupUsage, ...]


def take_snapshot(pool: BlockPool, groups: Sequence[CacheGroup],
                  managers: Sequence[GroupManager]) -> CacheSnapshot:
    """``KVCacheManager.snapshot``: the pool's cached blocks and free-queue order, and per
    group its held, cached and cached-free blocks (``managers``: one per group, in group
    order). O(pool)."""
    queue_names = ("dead", "free", "protected", "session", "pinned")
    cached: list[CachedBlock] = []
    cached_by_group = [0] * len(groups)
    cached_free_by_group = [0] * len(groups)
    for block in pool.blocks:
        if block.block_hash is None or block.hash_group_id is None:
            continue
        group_id = block.hash_group_id
        queue = None if block.queue_id is None else queue_names[block.queue_id]
        cached.append(CachedBlock(block.block_id, group_id, block.block_hash,
                                  block.ref_count, queue))
        cached_by_group[group_id] += 1
        if block.ref_count == 0:
            cached_free_by_group[group_id] += 1
    usage = tuple(
        GroupUsage(group.group_id, group.spec.kind,
                   len({b.block_id for table in manager.tables.values()
                        for b in table if not b.is_null}),
                   cached_by_group[group.group_id], cached_free_by_group[group.group_id])
        for group, manager in zip(groups, managers, strict=True))
    return CacheSnapshot(pool.epoch, pool.num_blocks, pool.num_free_blocks,
                         tuple(pool.free_queue_order()), tuple(cached), usage)


class GroupTables(Mapping[ReqId, tuple[int, ...]]):
    """Live, read-only view of one group's block tables: request id → its table's block
    ids (0 = null), for every request holding blocks in the group; ``num_cached_blocks``
    says how many leading entries of a table have been cached (hashed or skipped).
    Reading never changes the manager; the view follows it (it is not a snapshot).

    >>> from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager
    >>> m = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 8), "latest")
    >>> m.add_request("a", list(range(9)))
    >>> tables = m.group_tables(0)
    >>> _ = m.allocate_slots("a", 9)
    >>> dict(tables), tables.num_cached_blocks("a")
    ({'a': (1, 2, 3)}, 2)
    >>> m.free("a"); len(tables)
    0
    """

    __slots__ = ("_num_cached", "_tables")

    def __init__(self, tables: Mapping[ReqId, list[Block]],
                 num_cached: Mapping[ReqId, int]) -> None:
        self._tables = tables
        self._num_cached = num_cached

    def __getitem__(self, req_id: ReqId) -> tuple[int, ...]:
        return tuple(b.block_id for b in self._tables[req_id])

    def __iter__(self) -> Iterator[ReqId]:
        return iter(list(self._tables))

    def __len__(self) -> int:
        return len(self._tables)

    def num_cached_blocks(self, req_id: ReqId) -> int:
        """Leading entries of the request's table already cached (0 if it holds none)."""
        return self._num_cached.get(req_id, 0)
