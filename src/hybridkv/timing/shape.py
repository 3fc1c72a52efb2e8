"""What one decoder step computes and moves, per layer kind: the model side of the cost model.

A model preset (``sim/presets/*.toml``) gives each layer's *cache* spec: which tokens a
query reads and how many bytes a token's KV or a checkpoint takes. Compute also needs the
matrix sizes (hidden size, heads, MLP, vocabulary, experts): ``ModelDims``, bundled for the
presets in ``dims.toml`` beside this module. ``ComputeShape`` joins both into:

- ``gemm_flops(tokens, sampled)`` / ``weight_bytes(tokens)``: the projections and MLP of
  every decoder layer, the LM head for the sampled rows, and the weights a step reads;
- ``AttentionLayer.pairs(start, end)``: (query, key) pairs of a chunk of queries
  ``[start, end)`` for its kind (full ``p + 1`` keys, window ``min(p + 1, w)``, chunked
  ``p mod c + 1``, compressed ``min(p + 1, w) + entries``); ``span`` the keys it gathers;
- recurrent layers: the scan's FLOPs per token and the checkpoint bytes per chunk.

>>> dims = ModelDims(hidden_size=1152, num_heads=4, num_kv_heads=1, head_dim=256,
...                  intermediate_size=6912, vocab_size=262_144, num_layers=26)
>>> dims.attention_proj_params, dims.mlp_params_per_token
(2949120, 23887872)
>>> AttentionLayer("window", 512, window=512).pairs(0, 1024)   # 512*513/2 + 512*512
393472
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Final, Literal

from hybridkv.errors import ConfigError
from hybridkv.specs import (
    ChunkedLocalSpec,
    CompressedAttentionSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    LayerSpec,
    RecurrentStateSpec,
    RingBufferSpec,
    SlidingWindowSpec,
)

AttentionKind = Literal["full", "window", "chunked", "compressed", "indexer"]

SCAN_FLOPS_PER_STATE_ELEMENT: Final = 8
"""Gated DeltaNet / Mamba-2 per token and state element: decay (1), ``kᵀS`` (2), the
rank-1 update (2 + 1) and the read-out ``qᵀS`` (2)."""


@dataclass(frozen=True, slots=True)
class ModelDims:
    """Matrix sizes of a decoder (Hugging Face ``config.json`` names).

    ``num_layers`` counts decoder layers (projections + MLP each); ``num_experts = 0`` is a
    dense MLP, else ``experts_per_token`` routed experts of ``moe_intermediate_size`` plus
    ``shared_experts`` always-on ones. ``linear_*``: a Gated DeltaNet layer's heads.
    ``dtype_bytes``: weights and activations (2 = bf16, 1 = fp8).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    dtype_bytes: int = 2
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                     "num_layers", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be a positive integer")

    @property
    def attention_proj_params(self) -> int:
        """Q, K, V and output projection weights of one attention layer."""
        q = self.num_heads * self.head_dim
        return self.hidden_size * (q + 2 * self.num_kv_heads * self.head_dim) + q * \
            self.hidden_size

    @property
    def linear_proj_params(self) -> int:
        """A Gated DeltaNet layer's projections: q, k, v, gate z, a, b in; output out."""
        keys = self.linear_num_key_heads * self.linear_key_head_dim
        values = self.linear_num_value_heads * self.linear_value_head_dim
        inner = 2 * keys + 2 * values + 2 * self.linear_num_value_heads
        return self.hidden_size * inner + values * self.hidden_size

    @property
    def mlp_params_per_token(self) -> int:
        """MLP weights one token multiplies (gated: gate, up, down)."""
        if not self.num_experts:
            return 3 * self.hidden_size * self.intermediate_size
        active = self.experts_per_token + self.shared_experts
        return 3 * self.hidden_size * self.moe_intermediate_size * active + \
            self.hidden_size * self.num_experts

    def mlp_weight_params(self, num_tokens: int) -> float:
        """MLP weights a step of ``num_tokens`` tokens reads: dense all; MoE the shared
        experts, the router and the routed experts some token picks (uniform routing:
        ``E · (1 − (1 − k/E)^n)`` of them).

        >>> moe = ModelDims(2880, 64, 8, 64, 0, 201_088, 36, num_experts=128,
        ...                 experts_per_token=4, moe_intermediate_size=2880)
        >>> round(moe.mlp_weight_params(1) / (3 * 2880 * 2880)), \
round(moe.mlp_weight_params(4096) / (3 * 2880 * 2880))
        (4, 128)
        """
        if not self.num_experts:
            return 3.0 * self.hidden_size * self.intermediate_size
        touched = self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts)
                                      ** max(0, num_tokens))
        expert = 3.0 * self.hidden_size * self.moe_intermediate_size
        return expert * (touched + self.shared_experts) + self.hidden_size * self.num_experts

    @property
    def scan_state_elements(self) -> int:
        """Elements of one recurrent layer's state (value heads · dk · dv)."""
        return self.linear_num_value_heads * self.linear_key_head_dim * \
            self.linear_value_head_dim


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """One attention cache layer: its kind, KV bytes per token and reach.

    ``window``: keys a query sees (window, and the raw window of a compressed layer);
    ``chunk``: chunked-local size; ``ratio`` / ``topk``: tokens per compressed entry and
    the indexer's top-k (0: every entry).
    """

    kind: AttentionKind
    kv_bytes_per_token: float
    window: int = 0
    chunk: int = 0
    ratio: int = 1
    topk: int = 0

    def pairs(self, start: int, end: int) -> int:
        """(query, key) pairs of queries ``[start, end)``.

        >>> AttentionLayer("full", 1).pairs(4, 6), AttentionLayer("chunked", 1, chunk=4) \
.pairs(2, 6)
        (11, 10)
        >>> AttentionLayer("compressed", 1, window=2, ratio=4).pairs(0, 8)  # 15 raw + 6 entries
        21
        """
        if self.kind == "full":
            return _triangle(end) - _triangle(start)
        if self.kind == "window":
            return _window_pairs(start, end, self.window)
        if self.kind == "chunked":
            total, low = 0, start
            while low < end:
                high = min(end, (low // self.chunk + 1) * self.chunk)
                base = low // self.chunk * self.chunk
                total += _triangle(high - base) - _triangle(low - base)
                low = high
            return total
        entries = _entry_pairs(end, self.ratio, self.topk) - _entry_pairs(start, self.ratio,
                                                                          self.topk)
        if self.kind == "indexer":
            return _entry_pairs(end, self.ratio, 0) - _entry_pairs(start, self.ratio, 0)
        return _window_pairs(start, end, self.window) + entries

    def span(self, start: int, end: int) -> int:
        """Keys (or entries) a chunk ``[start, end)`` gathers: the bytes it reads are
        ``span · kv_bytes_per_token`` (entries: ``ratio`` tokens' worth each).

        >>> AttentionLayer("window", 1, window=512).span(1000, 1100)
        611
        """
        if self.kind == "full":
            return end
        if self.kind == "window":
            return end - max(0, start - self.window + 1)
        if self.kind == "chunked":
            return end - start // self.chunk * self.chunk
        raw = end - max(0, start - self.window + 1) if self.kind == "compressed" else 0
        return raw + end // self.ratio


def _triangle(n: int) -> int:
    return n * (n + 1) // 2


def _window_pairs(start: int, end: int, window: int) -> int:
    """Σ over p in [start, end) of min(p + 1, window)."""
    ramp_end = min(end, window - 1)
    ramp = _triangle(ramp_end) - _triangle(start) if start < ramp_end else 0
    return ramp + window * max(0, end - max(start, window - 1))


def _entry_pairs(n: int, ratio: int, topk: int) -> int:
    """Σ over p in [0, n) of the entries query p reads: ``(p + 1) // ratio``, capped at
    ``topk`` when it is positive."""
    def floor_sum(m: int) -> int:  # Σ_{q=1}^{m} q // ratio
        full = m // ratio
        return ratio * full * (full - 1) // 2 + full * (m - full * ratio + 1)
    if topk <= 0 or n < topk * ratio:
        return floor_sum(n)
    return floor_sum(topk * ratio - 1) + topk * (n - topk * ratio + 1)


@dataclass(frozen=True, slots=True)
class ComputeShape:
    """A model's step work: ``dims`` (matrices) and its cache layers' kinds.

    ``attention``: one entry per attention cache layer; ``recurrent_state_bytes``: one per
    recurrent layer (its checkpoint); ``state_bytes_per_chunk``: other per-request state a
    chunk reads and writes (DeepSeek-V4 compressor states, ring buffers).
    """

    dims: ModelDims
    attention: tuple[AttentionLayer, ...]
    recurrent_state_bytes: tuple[int, ...] = ()
    state_bytes_per_chunk: int = 0
    name: str = ""
    groups: tuple[tuple[AttentionLayer, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        counts: dict[AttentionLayer, int] = {}
        for layer in self.attention:
            counts[layer] = counts.get(layer, 0) + 1
        object.__setattr__(self, "groups", tuple(counts.items()))
        if len(self.recurrent_state_bytes) > self.dims.num_layers:
            raise ConfigError("num_layers", self.dims.num_layers,
                              f"the model has {len(self.recurrent_state_bytes)} recurrent "
                              "layers; num_layers counts every decoder layer")

    @property
    def num_recurrent(self) -> int:
        return len(self.recurrent_state_bytes)

    @property
    def num_attention_decoder_layers(self) -> int:
        return self.dims.num_layers - self.num_recurrent

    def gemm_flops(self, num_tokens: int, num_sampled: int) -> float:
        """Matrix FLOPs of a step: 2 per multiply-add over every weight a token meets,
        plus the LM head for each sampled row.

        >>> shape_of_engine_gemma1b().gemm_flops(1, 1) / 1e9   # 2 x (26 x 26.84 M + 302 M)
        1.99950336
        """
        d = self.dims
        per_token = (self.num_attention_decoder_layers * d.attention_proj_params
                     + self.num_recurrent * d.linear_proj_params
                     + d.num_layers * d.mlp_params_per_token)
        return 2.0 * (per_token * num_tokens + d.hidden_size * d.vocab_size * num_sampled)

    def weight_bytes(self, num_tokens: int) -> float:
        """Weights a step reads once (MoE: the experts its tokens touch; the LM head)."""
        d = self.dims
        params = (self.num_attention_decoder_layers * d.attention_proj_params
                  + self.num_recurrent * d.linear_proj_params
                  + d.num_layers * d.mlp_weight_params(num_tokens)
                  + d.hidden_size * d.vocab_size)
        return params * d.dtype_bytes

    def activation_bytes(self, num_tokens: int) -> float:
        """Pointwise traffic (norms, residuals, rotary, the MLP's gate): ``8 · hidden +
        2 · intermediate`` elements per token and layer, a proxy the fit scales."""
        d = self.dims
        width = 8 * d.hidden_size + 2 * max(d.intermediate_size, d.moe_intermediate_size *
                                            (d.experts_per_token + d.shared_experts))
        return float(num_tokens * d.num_layers * width * d.dtype_bytes)


DIMS_FILE: Final = "dims.toml"


def bundled_dims() -> dict[str, ModelDims]:
    """Preset name → ``ModelDims`` from the package's ``dims.toml``.

    >>> bundled_dims()["gemma3-1b"].head_dim
    256
    """
    text = resources.files("hybridkv.timing").joinpath(DIMS_FILE).read_text()
    known = {f.name for f in fields(ModelDims)}
    out = {}
    for name, table in tomllib.loads(text).items():
        unknown = set(table) - known
        if unknown:
            raise ConfigError(f"{DIMS_FILE}[{name}]", sorted(unknown), "unknown keys")
        out[name] = ModelDims(**table)
    return out


def attention_layer(spec: LayerSpec) -> AttentionLayer | None:
    """The attention kind of one cache layer (``None``: recurrent or pure state).

    >>> attention_layer(SlidingWindowSpec(16, 8192, 1024))
    AttentionLayer(kind='window', kv_bytes_per_token=8192, window=1024, chunk=0, ratio=1, \
topk=0)
    """
    if isinstance(spec, RecurrentStateSpec | CompressorStateSpec | RingBufferSpec):
        return None
    if isinstance(spec, CompressedAttentionSpec):
        kind: AttentionKind = "indexer" if spec.role == "indexer" else "compressed"
        return AttentionLayer(kind, spec.entry_bytes / spec.tokens_per_state,
                              ratio=spec.tokens_per_state)
    if isinstance(spec, SlidingWindowSpec):
        return AttentionLayer("window", spec.kv_bytes_per_token, window=spec.sliding_window)
    if isinstance(spec, ChunkedLocalSpec):
        return AttentionLayer("chunked", spec.kv_bytes_per_token,
                              chunk=spec.attention_chunk_size)
    if isinstance(spec, FullAttentionSpec):
        return AttentionLayer("full", spec.kv_bytes_per_token)
    raise ConfigError("layer", type(spec).__name__, "no cost rule for this layer kind")


def compute_shape(layers: tuple[LayerSpec, ...] | list[LayerSpec], dims: ModelDims,
                  name: str = "") -> ComputeShape:
    """Join a preset's cache layers with its matrix sizes.

    >>> layers = [RecurrentStateSpec(784, 3_207_168)] * 3 + [FullAttentionSpec(16, 4096)]
    >>> shape = compute_shape(layers * 16, bundled_dims()["qwen3.5-27b"])   # Qwen3.5-27B
    >>> len(shape.attention), shape.num_recurrent, shape.recurrent_state_bytes[0]
    (16, 48, 3207168)
    """
    attention, recurrent, state = [], [], 0
    for spec in layers:
        layer = attention_layer(spec)
        if layer is not None:
            attention.append(layer)
        elif isinstance(spec, RecurrentStateSpec):
            recurrent.append(spec.state_bytes)
        else:
            state += spec.page_bytes
    return ComputeShape(dims, tuple(attention), tuple(recurrent), state, name)


def shape_of_engine_gemma1b() -> ComputeShape:
    """The reference engine's Gemma-3-1B shape (22 window-512 + 4 full layers, 1 KV head
    of 256, bf16): the calibration model (doctests use it)."""
    dims = bundled_dims()["gemma3-1b"]
    kv = 2 * dims.num_kv_heads * dims.head_dim * dims.dtype_bytes
    layers = [AttentionLayer("full", kv) if (i + 1) % 6 == 0 else
              AttentionLayer("window", kv, window=512) for i in range(26)]
    return ComputeShape(dims, tuple(layers), name="gemma3-1b")
