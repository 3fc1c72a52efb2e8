"""A DeepSeek-V4-shaped decoder: every layer attends to a sliding window of raw tokens, and
compressed layers also to pooled entries of ``r``-token chunks (``engine.compressed``).

``CompressedModelConfig`` = a ``ModelConfig`` whose layers are all ``sliding_attention``
(the raw window, V4's SWA branch) plus one compress ratio per layer (0: window only, as
V4's first layers and MTP layers; 4: overlapping C4 / CSA; any other ``r >= 2``:
non-overlapping, as C128 / HCA). ``CompressedDecoder`` adds to each compressed layer a
compressor (``wkv``, ``wgate``: ``[halves * KVH * D, hidden]``, ``ape``: ``[r, halves * KVH * D]``,
``norm``: ``[D]``) and, on C4 layers when ``index_topk > 0``, a lightning indexer (query
``wq`` ``[IH * ID, hidden]``, head weights ``[IH, hidden]``, its own C4 compressor of one
``ID``-wide key), and hands their projections (``CompressedInputs``) to the attend
callback's ``compressed`` method; window-only layers run exactly as in ``HybridDecoder``.

``SequenceAttend`` is the reference: one request's whole sequence in one call, every entry
pooled from the full sequence by ``pool_sequence_reference``, no cache at all. The paged,
incremental engine (``engine.compressed_runner``) must reproduce its logits.

>>> cfg = CompressedModelConfig.tiny()
>>> cfg.compress_ratios, cfg.window, [cfg.rule(i).halves for i in cfg.compressed_layers]
((0, 4, 16, 4), 8, [2, 1, 2])
>>> [cfg.has_indexer(i) for i in range(4)], cfg.index_topk
([False, True, False, True], 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self, cast

import torch
from torch import nn
from torch.nn import functional as nnf

from hybridkv.engine.attention import AttentionRule, reference_attention
from hybridkv.engine.compressed import (
    CompressionRule,
    completed_entries,
    compressed_attention,
    indexer_selection,
    pool_sequence_reference,
    state_rows,
)
from hybridkv.engine.model import AttendFn, HybridDecoder, LayerWeights
from hybridkv.engine.model_config import LayerKind, ModelConfig
from hybridkv.engine.rope import apply_rope, rope_tables
from hybridkv.errors import ConfigError


def v4_ratios(num_layers: int, *, hca_ratio: int = 128, window_only_layers: int = 1,
              ) -> tuple[int, ...]:
    """V4-Flash's pattern scaled down: ``window_only_layers`` window-only layers (V4-Flash:
    2), then C4 and C-``hca_ratio`` layers alternating, starting with C4.

    >>> v4_ratios(6, hca_ratio=16)
    (0, 4, 16, 4, 16, 4)
    """
    return tuple(0 if i < window_only_layers else (4 if (i - window_only_layers) % 2 == 0
                                                   else hca_ratio)
                 for i in range(num_layers))


@dataclass(frozen=True, slots=True)
class CompressedModelConfig:
    """A V4-shaped model: the decoder's shape plus a compress ratio per layer.

    Attributes:
        base: shape of the decoder; every layer must be ``sliding_attention`` (the raw
            window every V4 layer has).
        compress_ratios: per layer, tokens per compressed entry (0: window only).
        index_heads / index_head_dim: the lightning indexer's query heads and key width
            (V4: 64 x 128).
        index_topk: entries an indexed (C4) layer's query reads (V4-Flash: 512); 0: no
            indexer, every completed entry is read.
    """

    base: ModelConfig
    compress_ratios: tuple[int, ...]
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    def __post_init__(self) -> None:
        if any(kind != "sliding_attention" for kind in self.base.layer_types):
            raise ConfigError("layer_types", self.base.layer_types,
                              "every layer of a V4-shaped model slides (its raw window)")
        if len(self.compress_ratios) != self.base.num_layers or any(
                not isinstance(r, int) or r < 0 or r == 1 for r in self.compress_ratios):
            raise ConfigError("compress_ratios", self.compress_ratios,
                              "one ratio per layer: 0 (window only) or tokens per entry >= 2")
        if self.base.layer_windows is not None:
            raise ConfigError("layer_windows", self.base.layer_windows,
                              "V4-shaped models use one window (sliding_window)")
        if self.index_topk < 0 or (self.index_topk and (
                self.index_heads <= 0 or self.index_head_dim <= 0 or self.index_head_dim % 2)):
            raise ConfigError("index_topk", self.index_topk,
                              "an indexer (index_topk > 0) needs index_heads > 0 and an even "
                              "index_head_dim > 0; index_topk >= 0")

    @classmethod
    def tiny(cls, *, compress_ratios: Sequence[int] = (0, 4, 16, 4), window: int = 8,
             index_topk: int = 3, **shape: Any) -> CompressedModelConfig:
        """A test-sized model (hidden 32, 4 heads, 1 KV head as V4's MQA, head_dim 8,
        vocab 97; indexer 4 heads x 8); ``shape`` overrides ``ModelConfig`` fields."""
        ratios = tuple(compress_ratios)
        base = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_heads=4,
                           num_kv_heads=1, head_dim=8,
                           layer_types=cast(tuple[LayerKind, ...],
                                            ("sliding_attention",) * len(ratios)),
                           sliding_window=window)
        return cls(dataclasses.replace(base, **shape), ratios, index_heads=4, index_head_dim=8,
                   index_topk=index_topk)

    @property
    def window(self) -> int:
        """Raw-window tokens of every layer (V4: 128)."""
        assert self.base.sliding_window is not None
        return self.base.sliding_window

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r)

    def rule(self, layer_id: int) -> CompressionRule:
        """Compression geometry of compressed layer ``layer_id``."""
        ratio = self.compress_ratios[layer_id]
        if not ratio:
            raise ConfigError("layer_id", layer_id, "is a window-only layer")
        return CompressionRule(ratio, self.window)

    def has_indexer(self, layer_id: int) -> bool:
        """C4 layers get a lightning indexer when ``index_topk > 0`` (V4: C4A only)."""
        ratio = self.compress_ratios[layer_id]
        return bool(self.index_topk) and bool(ratio) and CompressionRule(ratio, 1).halves == 2

    def state_width(self, layer_id: int, *, indexer: bool = False) -> int:
        """Channels of one projection (kv or score) of a compressor: ``halves * KVH * D``
        (the indexer's: ``halves * ID``, one key head)."""
        if indexer:
            return self.rule(layer_id).halves * self.index_head_dim
        return self.rule(layer_id).halves * self.base.num_kv_heads * self.base.head_dim


@dataclass(frozen=True, slots=True)
class CompressedInputs:
    """A compressed layer's projections of its input ``h`` for the attend callback.

    ``kv``/``score``: the compressor's ``[T, halves * KVH * D]``; on indexed layers
    ``index_q`` ``[T, IH, ID]`` (before rotary), ``index_weights`` ``[T, IH]`` and the
    indexer compressor's ``index_kv``/``index_score`` ``[T, 2 * ID]``.
    """

    kv: torch.Tensor
    score: torch.Tensor
    index_q: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None
    index_kv: torch.Tensor | None = None
    index_score: torch.Tensor | None = None

    def rows(self, rows: slice) -> CompressedInputs:
        """The inputs of tokens ``rows``."""
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return CompressedInputs(self.kv[rows], self.score[rows], cut(self.index_q),
                                cut(self.index_weights), cut(self.index_kv),
                                cut(self.index_score))


class CompressedAttendFn(Protocol):
    """What a ``CompressedDecoder`` calls per layer: ``attend(layer_id, q, k, v)`` for
    window-only layers, ``attend.compressed(layer_id, q, k, v, inputs)`` for compressed
    ones."""

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor: ...

    def compressed(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   inputs: CompressedInputs) -> torch.Tensor: ...


class Compressor(nn.Module):
    """Parameters of one layer's compressor."""

    def __init__(self, width: int, hidden: int, ratio: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device),
                                requires_grad=False)

        self.wkv = param(width, hidden)
        self.wgate = param(width, hidden)
        self.ape = param(ratio, width)
        self.norm = param(head_dim)


class Indexer(nn.Module):
    """Parameters of one layer's lightning indexer (query, head weights, compressor)."""

    def __init__(self, shape: CompressedModelConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        hidden, heads, dim = shape.base.hidden_size, shape.index_heads, shape.index_head_dim
        self.wq = nn.Parameter(torch.zeros(heads * dim, hidden, dtype=dtype, device=device),
                               requires_grad=False)
        self.wweights = nn.Parameter(torch.zeros(heads, hidden, dtype=dtype, device=device),
                                     requires_grad=False)
        self.compressor = Compressor(2 * dim, hidden, 4, dim, dtype=dtype, device=device)


class CompressedDecoder(HybridDecoder):
    """``HybridDecoder`` with compressors on the compressed layers.

    Args:
        shape: the V4-shaped config (``self.config`` is its ``base``).
        dtype / device / seed: as ``HybridDecoder`` (seeded init covers the compressors).
    """

    def __init__(self, shape: CompressedModelConfig, *, dtype: torch.dtype = torch.float64,
                 device: torch.device | str = "cpu", seed: int | None = 0) -> None:
        super().__init__(shape.base, dtype=dtype, device=device, seed=None)
        self.shape = shape
        self.compressors = nn.ModuleDict({
            str(i): Compressor(shape.state_width(i), shape.base.hidden_size,
                               shape.compress_ratios[i], shape.base.head_dim, dtype=dtype,
                               device=self.device)
            for i in shape.compressed_layers})
        self.indexers = nn.ModuleDict({
            str(i): Indexer(shape, dtype=dtype, device=self.device)
            for i in shape.compressed_layers if shape.has_indexer(i)})
        if seed is not None:
            self.randomize(seed)

    def compressor(self, layer_id: int, *, indexer: bool = False) -> Compressor:
        """Layer ``layer_id``'s compressor (``indexer``: its indexer's)."""
        if indexer:
            return self.indexer(layer_id).compressor
        return cast(Compressor, self.compressors[str(layer_id)])

    def indexer(self, layer_id: int) -> Indexer:
        return cast(Indexer, self.indexers[str(layer_id)])

    def _unseeded(self, dtype: torch.dtype, device: torch.device | str) -> Self:
        return type(self)(self.shape, dtype=dtype, device=device, seed=None)

    def entry_keys(self, layer_id: int, pooled: torch.Tensor, first: int, *,
                   indexer: bool = False) -> torch.Tensor:
        """Norm and rotary of pooled entries ``first, first + 1, …`` (``[J, heads, dim]``):
        entry ``j`` sits at its chunk's first position ``j * r`` (as V4's compressor)."""
        ratio = self.shape.compress_ratios[layer_id]
        positions = torch.arange(first, first + pooled.shape[0], device=pooled.device) * ratio
        cos, sin = rope_tables(positions, head_dim=pooled.shape[-1],
                               theta=self.config.rope_local_theta, dtype=self.dtype)
        return self.ops.norm_rope(pooled, self.compressor(layer_id, indexer=indexer).norm,
                                  self.config.rms_norm_eps, cos, sin)

    def index_queries(self, q_index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary of indexer queries ``[T, IH, ID]`` at their tokens' positions."""
        cos, sin = rope_tables(positions, head_dim=q_index.shape[-1],
                               theta=self.config.rope_local_theta, dtype=self.dtype)
        return apply_rope(q_index, cos, sin)

    def select_entries(self, layer_id: int, inputs: CompressedInputs, index_keys: torch.Tensor,
                       allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``allowed`` narrowed to the indexer's top-k on indexed layers (else as is);
        ``index_keys`` ``[E, 1, ID]``, ``positions`` of the queries."""
        if not self.shape.has_indexer(layer_id):
            return allowed
        assert inputs.index_q is not None and inputs.index_weights is not None
        return indexer_selection(self.index_queries(inputs.index_q, positions),
                                 inputs.index_weights, index_keys[:, 0], allowed,
                                 topk=self.shape.index_topk)

    def _layer(self, layer_id: int, x: torch.Tensor, w: LayerWeights, cos: torch.Tensor,
               sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        if not self.shape.compress_ratios[layer_id]:
            return super()._layer(layer_id, x, w, cos, sin, attend)
        compressed = getattr(attend, "compressed", None)
        if compressed is None:
            raise ConfigError("attend", attend, "compressed layers need an attend callback "
                              "with a .compressed(layer_id, q, k, v, kv, score) method")
        # The base layer's body, with the compressor's projections of the same input h.
        h = self.ops.norm(x, w.input_norm, self.config.rms_norm_eps)
        q, k, v = self._qkv(h, w, cos, sin)
        comp = self.compressor(layer_id)
        inputs = CompressedInputs(nnf.linear(h, comp.wkv), nnf.linear(h, comp.wgate))
        if self.shape.has_indexer(layer_id):
            index = self.indexer(layer_id)
            inputs = dataclasses.replace(
                inputs, index_q=nnf.linear(h, index.wq).reshape(
                    x.shape[0], self.shape.index_heads, self.shape.index_head_dim),
                index_weights=nnf.linear(h, index.wweights),
                index_kv=nnf.linear(h, index.compressor.wkv),
                index_score=nnf.linear(h, index.compressor.wgate))
        return self._attention_out(x, compressed(layer_id, q, k, v, inputs), w)


class SequenceAttend:
    """Reference attend for one request's whole sequence (positions ``0 .. T-1``) in one
    call: no cache, every entry pooled from the full sequence, explicit masks."""

    def __init__(self, model: CompressedDecoder) -> None:
        self.model = model

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        rule = AttentionRule("sliding_attention", window=self.model.shape.window)
        return reference_attention(q, k, v, q_start=0, kv_start=0, rule=rule,
                                   scale=self.model.config.attention_scale)

    def compressed(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   inputs: CompressedInputs) -> torch.Tensor:
        model, shape = self.model, self.model.shape
        rule = shape.rule(layer_id)
        positions = torch.arange(q.shape[0], device=q.device)

        def entries_of(kv: torch.Tensor, score: torch.Tensor, *, indexer: bool,
                       heads: int) -> torch.Tensor:
            ape = model.compressor(layer_id, indexer=indexer).ape
            rows = state_rows(kv, score, ape, positions, rule)
            pooled = pool_sequence_reference(rows, rule, kv_heads=heads)
            return model.entry_keys(layer_id, pooled, 0, indexer=indexer)

        entries = entries_of(inputs.kv, inputs.score, indexer=False,
                             heads=shape.base.num_kv_heads)
        allowed = completed_entries(0, q.shape[0], entries.shape[0], rule, q.device)
        if shape.has_indexer(layer_id):
            assert inputs.index_kv is not None and inputs.index_score is not None
            keys = entries_of(inputs.index_kv, inputs.index_score, indexer=True, heads=1)
            allowed = model.select_entries(layer_id, inputs, keys, allowed, positions)
        return compressed_attention(q, k, v, entries, allowed, q_start=0, rule=rule,
                                    scale=model.config.attention_scale)


def sequence_logits(model: CompressedDecoder, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[T, vocab]`` of every position of one sequence, by ``SequenceAttend``."""
    from hybridkv.engine.runner import vocab_ids

    ids = vocab_ids(token_ids, model.config.vocab_size, model.device)
    positions = torch.arange(len(token_ids), device=model.device)
    return cast(torch.Tensor, model(ids, positions, SequenceAttend(model), positions))
