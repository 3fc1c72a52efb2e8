"""Block-sparse local attention with ``flex_attention`` (the CUDA fast path for long chunks).

Sliding and chunked layers read a narrow band of keys, so a dense kernel wastes most of its
work on a long chunk. ``FlexAttention`` hands such chunks to a compiled ``flex_attention``
with a ``BlockMask`` built directly from the band (no dense mask is ever materialised);
full-attention layers, short chunks and decode tokens go to ``sdpa_attention``.

Padded layout of one call (``B`` = block of the mask, ``E`` = ``round_up(max keys before
the first query, B)``, a constant of the rule)::

    queries  [0, Q) real, [Q, Qp) zero padding           Qp = max(min_tokens, 2^ceil(log2 Q))
    keys     [0, front) padding | [front, front + K) gathered keys | padding up to Qp + E
             key index i holds position q_start - E + i, so "key <= query" is i <= row + E

Shapes come in power-of-two buckets, so the compiled kernel is reused across chunks of
similar length (one compilation per bucket and rule); offsets that change per call reach
the mask through captured tensors, which does not trigger recompilation. Padded query
blocks get no key blocks at all (the kernel skips them).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from hybridkv.engine.attention import AttentionRule, sdpa_attention

DEFAULT_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         SDPBackend.MATH)
LONG_FULL_BACKENDS = (SDPBackend.CUDNN_ATTENTION, *DEFAULT_SDPA_BACKENDS)

RECOMPILE_LIMIT = 64
"""Compiled variants allowed (one per shape bucket and rule); past it dynamo would fall
back to the unfused kernel, which materialises the whole score matrix, so we raise
instead (where this torch has the switch)."""


MASK_CACHE_ENTRIES = 64
"""Block masks kept (more than the chunks of one step: ``max_running`` is 16 by default)."""


def _compile_limits() -> contextlib.AbstractContextManager[object]:
    config = torch._dynamo.config
    options: dict[str, object] = {}
    if hasattr(config, "recompile_limit"):
        options["recompile_limit"] = RECOMPILE_LIMIT
    else:  # torch < 2.6
        options["cache_size_limit"] = RECOMPILE_LIMIT
    if hasattr(config, "fail_on_recompile_limit_hit"):
        options["fail_on_recompile_limit_hit"] = True
    return config.patch(options)  # type: ignore[no-any-return]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class _Layout:
    num_q: int
    num_kv: int
    q_start: int
    padded_q: int
    padded_kv: int
    front: int
    extra: int


class FlexAttention:
    """``flex_attention`` for long sliding/chunked chunks, ``sdpa_attention`` otherwise.

    Args:
        min_tokens: chunks shorter than this use ``sdpa_attention``.
        block: the mask's block size (tokens, both axes).
        compile: compile the kernel (``False`` runs flex's unfused reference path, for
            tests of the mask construction on CPU).
        sdpa_backends: SDPA kernels for short chunks and decode (any layer kind). cuDNN is
            left out by default: stalls of ~1 s per new short shape were seen on an H200
            with it allowed.
        long_full_backends: SDPA kernels for full-attention chunks of ``min_tokens`` or more;
            cuDNN first (2.4x PyTorch's flash kernel at head_dim 256 on an H200, and no
            stalls were seen for long shapes).
    """

    def __init__(self, *, min_tokens: int = 1024, block: int = 128, compile: bool = True,
                 sdpa_backends: Sequence[SDPBackend] = DEFAULT_SDPA_BACKENDS,
                 long_full_backends: Sequence[SDPBackend] = LONG_FULL_BACKENDS) -> None:
        self.min_tokens = min_tokens
        self.block = block
        self.compiled = compile
        self.sdpa_backends = list(sdpa_backends)
        self.long_full_backends = list(long_full_backends)
        kernel = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
        self._kernel = cast(Callable[..., torch.Tensor], kernel)
        self._masks: OrderedDict[tuple[object, ...], BlockMask] = OrderedDict()
        """Recent block masks by layout and rule, least recently used first: a step's
        chunks alternate inside every layer, so each chunk's mask is built once per step
        (by the first local layer) instead of once per layer and chunk."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int,
                 kv_start: int, rule: AttentionRule, scale: float) -> torch.Tensor:
        if rule.kind == "full_attention" or q.shape[0] < self.min_tokens:
            long_full = rule.kind == "full_attention" and q.shape[0] >= self.min_tokens
            with sdpa_kernel(self.long_full_backends if long_full else self.sdpa_backends):
                return sdpa_attention(q, k, v, q_start=q_start, kv_start=kv_start, rule=rule,
                                      scale=scale)
        layout = self._layout(q.shape[0], k.shape[0], q_start, kv_start, rule)
        num_heads, num_kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
        query = q.new_zeros((1, num_heads, layout.padded_q, dim))
        query[0, :, : layout.num_q] = q.transpose(0, 1)
        keys = k.new_zeros((1, num_kv_heads, layout.padded_kv, dim))
        values = v.new_zeros((1, num_kv_heads, layout.padded_kv, dim))
        real = slice(layout.front, layout.front + layout.num_kv)
        keys[0, :, real] = k.transpose(0, 1)
        values[0, :, real] = v.transpose(0, 1)
        mask = self._block_mask(layout, rule, q.device)
        with warnings.catch_warnings(), _compile_limits():
            if not self.compiled:
                warnings.filterwarnings("ignore", message=".*flex_attention called without")
            out = self._kernel(query, keys, values, block_mask=mask, scale=scale,
                               enable_gqa=num_heads != num_kv_heads)
        return out[0, :, : layout.num_q].transpose(0, 1)

    def _layout(self, num_q: int, num_kv: int, q_start: int, kv_start: int,
                rule: AttentionRule) -> _Layout:
        size = rule.window if rule.kind == "sliding_attention" else rule.chunk
        assert size is not None
        bound = size - 1  # keys before the first query, at most
        extra = _round_up(max(bound, 1), self.block)
        padded_q = max(self.min_tokens, 1 << (num_q - 1).bit_length())
        padded_q = _round_up(padded_q, self.block)
        front = extra - (q_start - kv_start)
        return _Layout(num_q, num_kv, q_start, padded_q, padded_q + extra, front, extra)

    def _block_mask(self, layout: _Layout, rule: AttentionRule,
                    device: torch.device) -> BlockMask:
        key = (layout, rule, device)
        mask = self._masks.get(key)
        if mask is not None:
            self._masks.move_to_end(key)
            return mask
        mask = _band_block_mask(layout, rule, self.block, device)
        self._masks[key] = mask
        if len(self._masks) > MASK_CACHE_ENTRIES:
            self._masks.popitem(last=False)
        return mask


def _band_block_mask(layout: _Layout, rule: AttentionRule, block: int,
                     device: torch.device) -> BlockMask:
    """Per query block, the key blocks every real row reads in full (no element mask) and
    the partial ones (element mask applied). A key block is full when it is inside the
    gathered keys, at or before the first row's own key, and at or after the last row's
    first key (first keys only grow with the position)."""
    num_q_blocks, num_kv_blocks = layout.padded_q // block, layout.padded_kv // block
    kv_end = layout.front + layout.num_kv
    kv_base = layout.q_start - layout.extra  # position held by key index 0

    def first_key_index(row: int) -> int:
        return max(layout.front, rule.first_key(layout.q_start + row) - kv_base)

    partial: list[list[int]] = [[] for _ in range(num_q_blocks)]
    full: list[list[int]] = [[] for _ in range(num_q_blocks)]
    for qb in range((layout.num_q + block - 1) // block):
        first_row = qb * block
        last_row = min(first_row + block, layout.num_q) - 1
        full_from, full_to = first_key_index(last_row), first_row + layout.extra
        for kb in range(first_key_index(first_row) // block,
                        (last_row + layout.extra) // block + 1):
            k0, k1 = kb * block, kb * block + block - 1
            whole = k0 >= full_from and k1 <= full_to and k1 < kv_end
            (full if whole else partial)[qb].append(kb)
    return BlockMask.from_kv_blocks(
        *_pack(partial, num_kv_blocks, device), *_pack(full, num_kv_blocks, device),
        BLOCK_SIZE=block, mask_mod=_band_mask_mod(layout, rule, device),
        seq_lengths=(layout.padded_q, layout.padded_kv))


def _pack(rows: list[list[int]], width: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    indices = torch.zeros((len(rows), width), dtype=torch.int32)
    for i, r in enumerate(rows):
        if r:
            indices[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return counts[None, None].to(device), indices[None, None].to(device)


def _band_mask_mod(layout: _Layout, rule: AttentionRule,
                   device: torch.device) -> Callable[..., torch.Tensor]:
    front = torch.tensor(layout.front, device=device)
    kv_end = torch.tensor(layout.front + layout.num_kv, device=device)
    q_start = torch.tensor(layout.q_start, device=device)
    kv_base = torch.tensor(layout.q_start - layout.extra, device=device)
    extra = layout.extra
    if rule.kind == "sliding_attention":
        assert rule.window is not None
        window = rule.window

        def sliding(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor,
                    ki: torch.Tensor) -> torch.Tensor:
            del b, h
            return ((ki >= front) & (ki < kv_end) & (ki <= qi + extra)
                    & (ki > qi + extra - window))

        return sliding
    assert rule.chunk is not None
    chunk = rule.chunk

    def chunked(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor,
                ki: torch.Tensor) -> torch.Tensor:
        del b, h
        same_chunk = (ki + kv_base) // chunk == (qi + q_start) // chunk
        return (ki >= front) & (ki < kv_end) & (ki <= qi + extra) & same_chunk

    return chunked
