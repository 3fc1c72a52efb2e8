"""Paged recurrent-state checkpoints, addressed only through the manager's block tables.

A recurrent (``linear_attention``) cache group keeps one checkpoint per block (vLLM 0.33's
``align`` mode): the block at table index ``i`` holds the layer's state after the last
token written into it — after token ``(i + 1) * bs`` once the block is full, after the
chunk's last token while it is partial. So the state *at token count* ``n > 0`` (the state
that resumes the layer at token ``n``) lives at ``table[(n - 1) // bs]``; ``n = 0`` is the
zero state and needs no block.

>>> [checkpoint_index(n, block_size=4) for n in (1, 4, 5, 8, 9)]
[0, 0, 1, 1, 2]
>>> checkpoint_stops(start=6, end=17, block_size=4)     # block ends 8, 12, 16, chunk end 17
[8, 12, 16, 17]

Layout: ``conv[slot, block, K - 1, conv_dim]`` and ``ssm[slot, block, Hv, dk, dv]``, where
``slot`` is the layer's index in its cache group and ``block`` a block id of the pool that
every group shares (a block id names one page whichever group holds it; the engine keeps
the checkpoint bytes beside the KV pages rather than inside them). Block 0 is the null
block: ``block_for`` refuses (``InvariantViolation``, naming request, layers and token
count) a checkpoint whose entry is 0, past the table, or outside the pool — so a table that
dropped a needed checkpoint is caught before any read. With ``poison=True`` fresh pages
hold NaN: reading a checkpoint nobody wrote turns the logits into NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.config import CacheConfig
from hybridkv.engine.model_config import RECURRENT_KINDS, ModelConfig
from hybridkv.engine.recurrent import RecurrentState
from hybridkv.errors import InvariantViolation


def checkpoint_index(num_tokens: int, *, block_size: int) -> int:
    """Table index of the block holding the state at token count ``num_tokens`` (> 0)."""
    assert num_tokens > 0, num_tokens
    return (num_tokens - 1) // block_size


def checkpoint_stops(*, start: int, end: int, block_size: int) -> list[int]:
    """Token counts in ``(start, end]`` whose checkpoint a chunk ``[start, end)`` writes:
    every block end, then ``end`` itself (vLLM ``align``: block multiples and the end of
    each scheduled chunk)."""
    first = (start // block_size + 1) * block_size
    stops = list(range(first, end, block_size))
    return [*stops, end]


def recurrent_group_ids(config: CacheConfig, model: ModelConfig) -> list[int]:
    """Cache groups whose layers are recurrent."""
    return [g.group_id for g in config.groups
            if model.layer_types[g.layer_ids[0]] in RECURRENT_KINDS]


class PagedStateCache:
    """Checkpoint pages of every recurrent layer of a model.

    Args:
        config: the cache configuration (groups, ``num_blocks``).
        model: the model's shape (recurrent layers, state shape).
        conv_dtype / state_dtype: storage of conv inputs and SSM state (float32 or float64
            SSM state, as ``mamba_ssm_dtype``).
        poison: fill pages with NaN.
    """

    def __init__(self, config: CacheConfig, model: ModelConfig, *, conv_dtype: torch.dtype,
                 state_dtype: torch.dtype, device: torch.device | str,
                 poison: bool = False) -> None:
        self.config = config
        self.group_ids = recurrent_group_ids(config, model)
        self.location: dict[int, tuple[int, int]] = {}
        for group_id in self.group_ids:
            for slot, layer_id in enumerate(config.groups[group_id].layer_ids):
                self.location[layer_id] = (group_id, slot)
        slots = max((len(config.groups[g].layer_ids) for g in self.group_ids), default=0)
        blocks = config.num_blocks if slots else 0
        self.conv = torch.empty((slots, blocks, model.linear_conv_kernel_dim - 1,
                                 model.linear_conv_dim), dtype=conv_dtype, device=device)
        self.ssm = torch.empty((slots, blocks, model.linear_num_value_heads,
                                model.linear_key_head_dim, model.linear_value_head_dim),
                               dtype=state_dtype, device=device)
        if poison:
            self.conv.fill_(float("nan"))
            self.ssm.fill_(float("nan"))

    def group_of(self, layer_id: int) -> int:
        return self.location[layer_id][0]

    def block_for(self, *, req_id: str, group_id: int, table: Sequence[int],
                  num_tokens: int) -> int:
        """Block id holding group ``group_id``'s checkpoint at token count ``num_tokens``.

        Raises:
            InvariantViolation: the entry is past the table, the null block, or outside
                the pool.
        """
        group = self.config.groups[group_id]
        index = checkpoint_index(num_tokens, block_size=group.spec.block_size)
        where = (f"request {req_id!r}, layers {group.layer_ids} (group {group_id}): the "
                 f"checkpoint at token {num_tokens} (table index {index})")
        if index >= len(table):
            raise InvariantViolation(f"{where} is past the block table ({len(table)} entries)")
        block_id = table[index]
        if block_id == 0:
            raise InvariantViolation(f"{where} is needed but maps to the null block 0")
        if not 0 < block_id < self.config.num_blocks:
            raise InvariantViolation(f"{where}: block id {block_id} is outside "
                                     f"[1, {self.config.num_blocks})")
        return block_id

    def read(self, layer_id: int, block_id: int) -> RecurrentState:
        slot = self.location[layer_id][1]
        return RecurrentState(self.conv[slot, block_id].clone(), self.ssm[slot, block_id].clone())

    def write(self, layer_id: int, block_id: int, state: RecurrentState) -> None:
        slot = self.location[layer_id][1]
        self.conv[slot, block_id].copy_(state.conv)
        self.ssm[slot, block_id].copy_(state.ssm)

    def copy_block(self, *, group_id: int, src_block_id: int, dst_block_id: int) -> None:
        """``ckpt:branch`` (``BlockCopy``): the checkpoint every layer of group ``group_id``
        keeps in block ``src_block_id`` into ``dst_block_id`` (a snapshot of the state
        after a branch point, or a hitting request's private copy of one).

        Raises:
            InvariantViolation: a block id outside ``[1, num_blocks)``.
        """
        for block_id in (src_block_id, dst_block_id):
            if not 0 < block_id < self.config.num_blocks:
                raise InvariantViolation(f"group {group_id}: checkpoint copy names block id "
                                         f"{block_id}, outside [1, {self.config.num_blocks})")
        layers = len(self.config.groups[group_id].layer_ids)
        self.conv[:layers, dst_block_id] = self.conv[:layers, src_block_id]
        self.ssm[:layers, dst_block_id] = self.ssm[:layers, src_block_id]
