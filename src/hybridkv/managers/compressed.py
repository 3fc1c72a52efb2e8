"""DeepSeek-V4 group kinds: compressed attention (KV and indexer) and compressor state.

Both reuse an existing search, because vLLM 0.33 drives them through the same managers:

- ``CompressedAttentionManager`` (``CompressedAttentionSpec``, vLLM's
  ``MLAAttentionSpec(tokens_per_state=r)`` under its ``FullAttentionManager``): table index
  ``i`` covers tokens ``[i * bs, (i + 1) * bs)`` and holds the ``bs / r`` entries
  compressing them (entry ``j``: tokens ``[i * bs + j * r, i * bs + (j + 1) * r)``).
  A hit at ``p`` (a multiple of the alignment, hence of ``bs`` and ``r``) needs blocks
  ``[0, p / bs)``: every entry of the prefix, as full attention needs every token.
- ``CompressorStateManager`` (``CompressorStateSpec``, vLLM's ``SlidingWindowMLASpec`` of
  the compressor's ``state_cache``): residual rows of the last ``w`` tokens; a hit at ``p``
  needs the ``ceil((w - 1) / bs)`` blocks ending at ``p`` (C4: 2 blocks of 4 tokens,
  C128: 16 blocks of 8), released as they leave the window, like sliding window.

Retention applies to the window-like kinds (compressor state, sliding-window MLA) exactly
as to sliding window; the compressed kinds are full-attention-like: always hashed, never
released early (see ``docs/v4-groups.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from hybridkv.block import Block
from hybridkv.ids import BlockHash, GroupId, ReqId
from hybridkv.managers.base import GroupManager
from hybridkv.managers.full import FullAttentionManager
from hybridkv.managers.window import SlidingWindowManager
from hybridkv.pool import BlockPool
from hybridkv.specs import LayerSpec


class CompressedAttentionManager(FullAttentionManager):
    """Compressed KV / indexer keys: every block of the prefix, never released early.

    Worked example (bs 256, r 4 → 64 entries a block): a 1,000-token prompt fills blocks
    0–2 (768 tokens, 192 entries) and block 3 partly; a later hit at 768 takes blocks 0–2.
    """


class CompressorStateManager(SlidingWindowManager):
    """Compressor residual state: a window of ``w`` tokens in ``bs``-token blocks.

    Worked example (C128: bs 8, w 128 → 15.9 → 16 tail blocks): a hit at 512 needs blocks
    48–63 (tokens 384–511); blocks before 48 may have been released.
    """


class RingBufferManager(GroupManager):
    """DeepSeek-V4.1 compressor ring (vLLM 0.33 ``CircularBufferManager``): one block per
    request for its whole life, claimed at the first allocation, never hashed, never
    looked up (the coordinator leaves non-prefix-cacheable groups out of every search), so
    a hit needs nothing from it: after a hit at ``p`` (a multiple of every ratio) the open
    group starts empty at ``p``.

    Worked example: a request admitted with a 4,096-token hit and 10,000 new tokens holds
    exactly one ring block throughout; freeing it returns that block.
    """

    covers_computed_tokens: ClassVar[bool] = False
    batches_siblings: ClassVar[bool] = False

    def hit_tail_blocks(self, num_tokens: int) -> int | None:
        """Nothing: a hit needs no ring state (never cached, so never in events)."""
        del num_tokens
        return 0

    @classmethod
    def find_longest_hit(cls, pool: BlockPool, group_ids: Sequence[GroupId], spec: LayerSpec,
                         hashes: Sequence[BlockHash], max_num_tokens: int, *,
                         drop_eagle_block: bool, alignment_tokens: int,
                         ) -> tuple[list[list[Block]], int]:
        """Never limits a hit (and is never asked: the group is not prefix-cacheable)."""
        del pool, spec, hashes, drop_eagle_block, alignment_tokens
        return [[] for _ in group_ids], max_num_tokens

    def admission_cap_blocks(self, max_num_batched_tokens: int, max_model_len: int | None,
                             ) -> int | None:
        del max_num_batched_tokens, max_model_len
        return 1

    def num_blocks_to_allocate(self, req_id: ReqId, num_tokens: int, hit_blocks: Sequence[Block],
                               num_computed_tokens: int, admission_cap: int | None) -> int:
        del num_tokens, hit_blocks, num_computed_tokens, admission_cap
        return 0 if self.tables.get(req_id) else 1

    def num_blocks_to_grow(self, req_id: ReqId, num_tokens: int) -> int:
        del num_tokens
        return 0 if self.tables.get(req_id) else 1

    def add_hit_blocks(self, req_id: ReqId, hit_blocks: Sequence[Block], num_hit_tokens: int,
                       ) -> None:
        del hit_blocks, num_hit_tokens
        self.tables[req_id] = []
        self.num_cached_blocks[req_id] = 0

    def allocate_new_blocks(self, req_id: ReqId, num_tokens: int) -> list[Block]:
        del num_tokens
        table = self.tables.setdefault(req_id, [])
        self.num_cached_blocks.setdefault(req_id, 0)
        if table:
            return []
        new_blocks = self.pool.allocate(1)
        table.extend(new_blocks)
        return new_blocks

    def cache_plan(self, req_id: ReqId, hashes: Sequence[BlockHash], hash_block_size: int,
                   num_tokens: int, boundaries: Sequence[int], bridge_end_tokens: int = 0,
                   ) -> tuple[int, int, list[bool] | None] | None:
        del req_id, hashes, hash_block_size, num_tokens, boundaries, bridge_end_tokens
        return None
