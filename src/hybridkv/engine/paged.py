"""Paged KV storage: one page pool shared by every cache group, addressed only through the
block tables of ``KVCacheManager.get_block_ids``.

Layout: ``kv[slot, 0 or 1, page * page_tokens + offset, kv_head, dim]`` where ``slot`` is
the layer's index inside its cache group (``config.groups[g].layer_ids``), ``page`` a block
id and ``page_tokens`` the largest group block size. All groups draw block ids from one
pool, so block ``b`` is the same memory whichever group holds it, as in vLLM (a group with
smaller blocks leaves the tail of each page unused: the padding ``CacheConfig`` counts).

Token ``p`` of a request in group ``g`` (block size ``bs``) lives at page
``table[p // bs]``, offset ``p % bs``. Block 0 is the null block: a table entry of 0 means
"KV not kept". ``slots`` refuses, with ``InvariantViolation``, to address a position whose
entry is 0 or missing — so a block table that drops KV a layer still needs is caught
before any read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch

from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError, InvariantViolation


class PagedKVCache:
    """Key/value pages for every layer of a model.

    Args:
        config: the cache configuration (groups, ``num_blocks``).
        num_kv_heads / head_dim / dtype / device: per-token KV shape and storage.
        poison: fill the pool with NaN (float dtypes), so reading a slot nobody wrote
            turns the logits into NaN instead of plausible numbers.
    """

    def __init__(self, config: CacheConfig, *, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, poison: bool = False) -> None:
        self.config = config
        self.page_tokens = max(g.spec.block_size for g in config.groups)
        self.num_slots = config.num_blocks * self.page_tokens
        self.kv = torch.empty((config.layers_per_group, 2, self.num_slots, num_kv_heads,
                               head_dim), dtype=dtype, device=device)
        if poison:
            self.kv.fill_(float("nan"))
        self.location: dict[int, tuple[int, int]] = {}
        for group in config.groups:
            for slot, layer_id in enumerate(group.layer_ids):
                self.location[layer_id] = (group.group_id, slot)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def group_of(self, layer_id: int) -> int:
        try:
            return self.location[layer_id][0]
        except KeyError:
            raise ConfigError("layer_id", layer_id,
                              "no cache group holds this layer; build the CacheConfig from "
                              "the model's layers") from None

    def slots(self, *, req_id: str, group_id: int, table: Sequence[int], start: int,
              end: int) -> torch.Tensor:
        """Flat slot indices of positions ``[start, end)`` in group ``group_id``'s pages.

        Raises:
            InvariantViolation: a position maps past the table or to the null block 0
                (named by request, layers and position), or to a block id out of range.
        """
        group = self.config.groups[group_id]
        bs = group.spec.block_size
        first, last = start // bs, (end - 1) // bs
        if last >= len(table):
            raise InvariantViolation(
                f"request {req_id!r}, layers {group.layer_ids} (group {group_id}): position "
                f"{end - 1} needs table index {last} but the block table has "
                f"{len(table)} entries")
        blocks = table[first : last + 1]
        if min(blocks) <= 0 or max(blocks) >= self.config.num_blocks:
            self._raise_bad_block(req_id, group_id, blocks, first, start)
        pages = torch.tensor(blocks, dtype=torch.int64).to(self.device)
        offsets = torch.arange(bs, device=self.device)
        flat = (pages[:, None] * self.page_tokens + offsets[None, :]).reshape(-1)
        return flat[start - first * bs : end - first * bs]

    def _raise_bad_block(self, req_id: str, group_id: int, blocks: Sequence[int], first: int,
                         start: int) -> NoReturn:
        group = self.config.groups[group_id]
        bs = group.spec.block_size
        for index, block_id in enumerate(blocks, start=first):
            if block_id == 0:
                position = max(start, index * bs)
                raise InvariantViolation(
                    f"request {req_id!r}, layer {group.layer_ids[0]} (group {group_id}, "
                    f"layers {group.layer_ids}): position {position} is needed but maps to "
                    f"the null block 0 (table index {index})")
            if not 0 < block_id < self.config.num_blocks:
                raise InvariantViolation(
                    f"request {req_id!r}, group {group_id}: block id {block_id} at table "
                    f"index {index} is outside [1, {self.config.num_blocks})")
        raise InvariantViolation(f"request {req_id!r}, group {group_id}: bad table {blocks}")

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store keys/values ``[N, KVH, D]`` of one layer at ``slots``."""
        slot = self.location[layer_id][1]
        self.kv[slot, 0].index_copy_(0, slots, k)
        self.kv[slot, 1].index_copy_(0, slots, v)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[N, KVH, D]`` of one layer at ``slots``."""
        slot = self.location[layer_id][1]
        return self.kv[slot, 0].index_select(0, slots), self.kv[slot, 1].index_select(0, slots)

    def copy_block(self, *, group_id: int, src_block_id: int, dst_block_id: int,
                   num_tokens: int) -> None:
        """``ckpt:branch`` (``BlockCopy``): the KV of the first ``num_tokens`` slots of page
        ``src_block_id`` into the same slots of ``dst_block_id``, for every layer of group
        ``group_id`` (e.g. a snapshot at token 400 of 784-token blocks: slots ``[0, 400)``
        of the page holding tokens ``[0, 784)``).

        Raises:
            InvariantViolation: a block id outside ``[1, num_blocks)`` or ``num_tokens``
                outside ``[0, block_size)``.
        """
        group = self.config.groups[group_id]
        bs = group.spec.block_size
        for block_id in (src_block_id, dst_block_id):
            if not 0 < block_id < self.config.num_blocks:
                raise InvariantViolation(f"group {group_id}: block copy names block id "
                                         f"{block_id}, outside [1, {self.config.num_blocks})")
        if not 0 <= num_tokens < bs:
            raise InvariantViolation(f"group {group_id}: a block copy of {num_tokens} slots "
                                     f"does not fit inside a block of {bs}")
        src = src_block_id * self.page_tokens
        dst = dst_block_id * self.page_tokens
        layers = len(group.layer_ids)
        self.kv[:layers, :, dst : dst + num_tokens] = self.kv[:layers, :, src : src + num_tokens]
