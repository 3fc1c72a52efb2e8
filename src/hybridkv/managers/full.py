"""Full attention: a hit needs every block of the prefix; nothing is released early."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from hybridkv.block import Block
from hybridkv.ids import BlockHash, GroupId
from hybridkv.managers.base import GroupManager, blocks_in_every_group
from hybridkv.pool import BlockPool
from hybridkv.specs import LayerSpec


class FullAttentionManager(GroupManager):
    """Longest hit scanning left to right; chained hashes make everything after a miss miss."""

    is_full_attention: ClassVar[bool] = True

    def bound_item_blocks(self, num_table_blocks: int, num_item_tokens: int) -> int:
        """The table's blocks inside the first ``num_item_tokens`` tokens' whole units.

        >>> from hybridkv.config import CacheConfig
        >>> from hybridkv.specs import FullAttentionSpec, SlidingWindowSpec
        >>> config = CacheConfig.from_layers(
        ...     [FullAttentionSpec(16, 1), SlidingWindowSpec(32, 1, 64)], num_blocks=8)
        >>> from hybridkv.cache import KVCacheManager
        >>> full = KVCacheManager(config).coordinator.managers[0]
        >>> full.bound_item_blocks(7, 100)  # A 32: 3 units = 6 blocks; the 7th is partial
        6
        """
        unit = self.alignment_tokens
        return min(num_table_blocks, (num_item_tokens // unit) * (unit // self.block_size))

    @classmethod
    def find_longest_hit(cls, pool: BlockPool, group_ids: Sequence[GroupId], spec: LayerSpec,
                         hashes: Sequence[BlockHash], max_num_tokens: int, *,
                         drop_eagle_block: bool, alignment_tokens: int,
                         ) -> tuple[list[list[Block]], int]:
        """Worked example: bs 16, 3 cached blocks, ``max_num_tokens`` 55 → 48 tokens;
        with the EAGLE drop → 32 (the last matched block is recomputed)."""
        bs = spec.block_size
        tables: list[list[Block]] = [[] for _ in group_ids]
        max_blocks = min(max_num_tokens // bs, len(hashes))
        getters = [pool.group_index(g).get for g in group_ids]
        if len(getters) == 1:  # one dict probe per block, no per-block lists
            get, append = getters[0], tables[0].append
            for i in range(max_blocks):
                found_block = get(hashes[i])
                if found_block is None:
                    break
                append(found_block)
        else:
            for i in range(max_blocks):
                found = blocks_in_every_group(getters, hashes[i])
                if found is None:
                    break
                for table, block in zip(tables, found, strict=True):
                    table.append(block)
        num_hit_tokens = len(tables[0]) * bs
        if drop_eagle_block and num_hit_tokens > 0:
            num_hit_tokens -= min(alignment_tokens, bs)
        num_hit_tokens -= num_hit_tokens % alignment_tokens
        keep = -(-num_hit_tokens // bs)
        return [table[:keep] for table in tables], num_hit_tokens
