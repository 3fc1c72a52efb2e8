"""Chunked-local attention (Llama 4): a token reads only its own chunk of ``c`` tokens."""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.block import Block
from hybridkv.ids import BlockHash, GroupId
from hybridkv.managers.base import GroupManager, blocks_in_every_group
from hybridkv.pool import BlockPool
from hybridkv.specs import ChunkedLocalSpec, LayerSpec


class ChunkedLocalManager(GroupManager):
    """Blocks of completed chunks are released; a hit needs only the current chunk's blocks."""

    @property
    def chunk_tokens(self) -> int:
        """The spec's ``attention_chunk_size``."""
        assert isinstance(self.spec, ChunkedLocalSpec)  # the registry pairs them
        return self.spec.attention_chunk_size

    def admission_cap_blocks(self, max_num_batched_tokens: int, max_model_len: int | None,
                             ) -> int | None:
        span = self.chunk_tokens + max_num_batched_tokens
        if max_model_len is not None:
            span = min(span, max_model_len)
        return -(-span // self.block_size)

    def hit_tail_blocks(self, num_tokens: int) -> int | None:
        """The blocks of the current chunk before ``p`` (none at a chunk boundary)."""
        return (num_tokens % self.chunk_tokens) // self.block_size

    def max_hit_tail_blocks(self) -> int:
        return max(0, self.chunk_tokens // self.block_size - 1)

    def next_release_tokens(self, num_computed_tokens: int) -> int:
        """The next chunk boundary (a chunk's blocks leave when the next chunk starts)."""
        chunk = self.chunk_tokens
        return (num_computed_tokens // chunk + 1) * chunk

    @classmethod
    def find_longest_hit(cls, pool: BlockPool, group_ids: Sequence[GroupId], spec: LayerSpec,
                         hashes: Sequence[BlockHash], max_num_tokens: int, *,
                         drop_eagle_block: bool, alignment_tokens: int,
                         ) -> tuple[list[list[Block]], int]:
        """Worked example (chunk 8, bs 4): max 15 → blocks 0–1 are past chunks (null), then
        block 2 if cached → hit 12 (8 when block 2 is not cached); max 16 → 4 nulls, hit 16."""
        assert isinstance(spec, ChunkedLocalSpec)
        del drop_eagle_block, alignment_tokens  # validated at construction: bs == A, no EAGLE
        bs = spec.block_size
        chunk = spec.attention_chunk_size
        first_block = ((max_num_tokens // chunk) * chunk) // bs
        num_blocks = min(max_num_tokens // bs, len(hashes))
        null = pool.null_block
        tables: list[list[Block]] = [[null] * first_block for _ in group_ids]
        getters = [pool.group_index(g).get for g in group_ids]
        for i in range(first_block, num_blocks):
            hits = blocks_in_every_group(getters, hashes[i])
            if hits is None:
                break
            for table, block in zip(tables, hits, strict=True):
                table.append(block)
        return tables, len(tables[0]) * bs
