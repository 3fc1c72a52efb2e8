"""The parts of vLLM's manager internals that vLLM's Scheduler, EngineCore and tests read,
answered from hybridkv: vLLM ``KVCacheBlock`` objects per block id, a read-only block pool
and coordinator with per-group "single-type managers".

Only reads are served. ``free_blocks`` (deferred frees) and the coordinator's connector
helpers raise ``UnsupportedFeature``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hybridkv.cache import KVCacheManager
from hybridkv.ids import GroupId
from hybridkv.vllm.config import UnsupportedFeature, UnsupportedInternal


class VllmBlocks:
    """One vLLM ``KVCacheBlock`` per pool block id, all made up front as vLLM's own pool
    does (block 0: the null block, one shared object as vLLM's), so a table of ids maps
    to blocks with one C-level ``map``. ``ref_cnt`` is refreshed from hybridkv when read
    through ``BlockPoolShim.blocks``; the Scheduler itself reads only ``block_id``.

    >>> # blocks.of_ids(((0, 5), (7,))) -> KVCacheBlocks(([null, #5], [#7]))
    """

    def __init__(self, core: KVCacheManager) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        self._core = core
        self._wrap = KVCacheBlocks
        self._by_id: list[Any] = [KVCacheBlock(block_id=0, is_null=True)]
        self._by_id.extend(KVCacheBlock(block_id=i) for i in range(1, core.pool.num_blocks))
        self.block = self._by_id.__getitem__
        """Block id → its vLLM block object."""
        self._empty = KVCacheBlocks(tuple(() for _ in core.config.groups))

    def of_ids(self, tables: Sequence[Sequence[int]]) -> Any:
        """vLLM ``KVCacheBlocks`` for per-group id lists (the shared empty one if none)."""
        if not any(tables):
            return self._empty
        block = self.block
        return self._wrap(tuple(list(map(block, ids)) for ids in tables))

    def all_blocks(self) -> list[Any]:
        """Every pool block, ``ref_cnt`` copied from hybridkv's pool now."""
        out = []
        for core_block, block in zip(self._core.pool.blocks, self._by_id, strict=True):
            block.ref_cnt = core_block.ref_count
            out.append(block)
        return out


class _FreeQueueShim:
    def __init__(self, core: KVCacheManager) -> None:
        self._core = core

    @property
    def num_free_blocks(self) -> int:
        return self._core.pool.num_free_blocks


class _Refusing:
    """Any attribute not modelled: ``UnsupportedInternal`` naming it (one line)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnsupportedInternal(type(self).__name__.removesuffix("Shim"), name)


class BlockPoolShim(_Refusing):
    """What is read of vLLM's ``BlockPool``: free count, size, usage, blocks."""

    def __init__(self, core: KVCacheManager, blocks: VllmBlocks) -> None:
        self._core = core
        self._blocks = blocks
        self.num_gpu_blocks = core.pool.num_blocks
        self.enable_caching = core.config.enable_caching
        self.free_block_queue = _FreeQueueShim(core)
        self.null_block = blocks.block(0)

    def get_num_free_blocks(self) -> int:
        return self._core.pool.num_free_blocks

    def get_usage(self) -> float:
        return self._core.usage

    @property
    def blocks(self) -> list[Any]:
        return self._blocks.all_blocks()

    def free_blocks(self, ordered_blocks: Any) -> None:
        if list(ordered_blocks):
            raise UnsupportedFeature("deferred or copy-on-write block frees (block_pool)")


class _TablesShim(Mapping[str, list[Any]]):
    """``req_to_blocks`` of one group: request id → its table as vLLM block objects."""

    def __init__(self, core: KVCacheManager, group_id: int, blocks: VllmBlocks) -> None:
        self._view = core.group_tables(GroupId(group_id))
        self._blocks = blocks

    def __getitem__(self, req_id: str) -> list[Any]:
        return list(map(self._blocks.block, self._view[req_id]))

    def __iter__(self) -> Iterator[str]:
        return iter(self._view)

    def __len__(self) -> int:
        return len(self._view)


class _NumCachedShim(Mapping[str, int]):
    def __init__(self, core: KVCacheManager, group_id: int) -> None:
        self._view = core.group_tables(GroupId(group_id))

    def __getitem__(self, req_id: str) -> int:
        if req_id not in self._view:
            raise KeyError(req_id)
        return self._view.num_cached_blocks(req_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._view)

    def __len__(self) -> int:
        return len(self._view)


class SingleTypeManagerShim(_Refusing):
    """One group as vLLM's ``SingleTypeKVCacheManager`` is read: ``block_size``,
    ``kv_cache_spec``, ``kv_cache_group_id``, ``req_to_blocks``, ``num_cached_block``."""

    retains_longer_hit = False
    records_new_block_ids = False

    def __init__(self, core: KVCacheManager, group_id: int, spec: Any,
                 blocks: VllmBlocks) -> None:
        self.kv_cache_group_id = group_id
        self.kv_cache_spec = spec
        self.block_size = int(spec.block_size)
        self.req_to_blocks = _TablesShim(core, group_id, blocks)
        self.num_cached_block = _NumCachedShim(core, group_id)

    def take_new_block_ids(self) -> list[int]:
        return []


class CoordinatorShim(_Refusing):
    """What is read of vLLM's coordinator: the per-group managers and two flags."""

    enable_partial_hash_hits = False
    num_reprefillable_tokens = 0

    def __init__(self, core: KVCacheManager, kv_cache_config: Any, blocks: VllmBlocks) -> None:
        self.single_type_managers = [
            SingleTypeManagerShim(core, i, group.kv_cache_spec, blocks)
            for i, group in enumerate(kv_cache_config.kv_cache_groups)]
        self.eagle_group_ids = tuple(
            i for i, g in enumerate(kv_cache_config.kv_cache_groups)
            if getattr(g, "is_eagle_group", False))
        self.block_pool = None

    def get_num_blocks_to_allocate(self, *args: Any, **kwargs: Any) -> int:
        raise UnsupportedFeature("KV connectors (async-load reservations)")
