"""The reference model's shape, its layer patterns, and the matching cache layer specs.

One architecture: a Gemma-3-style decoder (q/k RMSNorm, ``(1 + w)`` RMSNorm, pre- and
post-feedforward norms, ``sqrt(hidden)`` embedding scale, gelu-tanh gated MLP,
``query_pre_attn_scalar``, a rope base per layer kind). Each layer is one of three kinds:

=====================  ======================================================================
``full_attention``     token ``p`` reads ``[0, p]``
``sliding_attention``  token ``p`` reads ``[p - (w - 1), p]`` (``w``: ``sliding_window``)
``chunked_attention``  token ``p`` reads ``[floor(p / c) * c, p]`` (``c``: ``attention_chunk_size``)
=====================  ======================================================================

>>> cfg = ModelConfig.tiny(layer_types=gemma3_pattern(6), sliding_window=5)
>>> [spec.kind for spec in layer_specs_for_model(cfg, block_size=4, dtype_bytes=8)]
... # doctest: +NORMALIZE_WHITESPACE
['sliding_window', 'sliding_window', 'sliding_window', 'sliding_window', 'sliding_window',
 'full_attention']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError
from hybridkv.recurrent import gated_delta_net_state_bytes
from hybridkv.specs import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    LayerSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    kv_bytes_per_token,
)

LayerKind = Literal["full_attention", "sliding_attention", "chunked_attention",
                    "linear_attention"]
LAYER_KINDS: Final = ("full_attention", "sliding_attention", "chunked_attention",
                      "linear_attention")
RECURRENT_KINDS: Final = ("linear_attention",)
"""Layer kinds with a recurrent state instead of KV (``engine.recurrent``: Gated DeltaNet)."""


def gemma3_pattern(num_layers: int, period: int = 6) -> tuple[LayerKind, ...]:
    """Gemma 3: every ``period``-th layer is global, the others slide (5 local : 1 global).

    >>> gemma3_pattern(7)[4:]
    ('sliding_attention', 'full_attention', 'sliding_attention')
    """
    return tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention"
                 for i in range(num_layers))


def alternating_pattern(num_layers: int) -> tuple[LayerKind, ...]:
    """gpt-oss: sliding and full layers alternate, starting with sliding."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                 for i in range(num_layers))


def qwen3_next_pattern(num_layers: int, interval: int = 4) -> tuple[LayerKind, ...]:
    """Qwen3-Next / Qwen3.5: every ``interval``-th layer is full attention, the others are
    Gated DeltaNet (``linear_attention``).

    >>> qwen3_next_pattern(5)  # doctest: +NORMALIZE_WHITESPACE
    ('linear_attention', 'linear_attention', 'linear_attention', 'full_attention',
     'linear_attention')
    """
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers))


def llama4_pattern(num_layers: int, period: int = 4) -> tuple[LayerKind, ...]:
    """Llama 4: every ``period``-th layer is global, the others are chunked-local."""
    return tuple("full_attention" if (i + 1) % period == 0 else "chunked_attention"
                 for i in range(num_layers))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and hyper-parameters of the reference decoder.

    Attributes:
        layer_types: one kind per layer (see the module table).
        sliding_window: ``w`` of sliding layers (tokens, the token itself included).
        layer_windows: optional per-layer windows, one entry per layer (entries of
            non-sliding layers are ignored); overrides ``sliding_window``. Gemma 3 has one
            window; several sizes exercise the cache's per-group windows.
        attention_chunk_size: ``c`` of chunked layers.
        rope_theta: rope base of full-attention layers.
        rope_local_theta: rope base of sliding and chunked layers.
        rope_scaling_factor: linear rope scaling of full-attention layers (1 = none).
        query_pre_attn_scalar: attention scale is ``query_pre_attn_scalar ** -0.5``
            (``None``: ``head_dim``).
        final_logit_softcapping: ``cap * tanh(logits / cap)`` when set.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        linear_num_key_heads / linear_num_value_heads / linear_key_head_dim /
            linear_value_head_dim / linear_conv_kernel_dim: the Gated DeltaNet shape of
            ``linear_attention`` layers (Qwen3-Next names; value heads a multiple of key
            heads; conv taps ``K >= 2``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[LayerKind, ...]
    sliding_window: int | None = None
    layer_windows: tuple[int, ...] | None = None
    attention_chunk_size: int | None = None
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    rope_scaling_factor: float = 1.0
    query_pre_attn_scalar: float | None = None
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 8
    linear_value_head_dim: int = 8
    linear_conv_kernel_dim: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, value, "must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", self.num_kv_heads,
                              f"must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ConfigError("head_dim", self.head_dim, "must be even (rotary halves)")
        if not self.layer_types:
            raise ConfigError("layer_types", self.layer_types, "a model needs >= 1 layer")
        for kind in self.layer_types:
            if kind not in LAYER_KINDS:
                raise ConfigError("layer_types", kind, f"choose from {', '.join(LAYER_KINDS)}")
        if self.layer_windows is not None and (
                len(self.layer_windows) != len(self.layer_types)
                or not all(_positive(w) for w in self.layer_windows)):
            raise ConfigError("layer_windows", self.layer_windows,
                              "one positive window (tokens) per layer")
        if "sliding_attention" in self.layer_types and not (
                _positive(self.sliding_window) or self.layer_windows is not None):
            raise ConfigError("sliding_window", self.sliding_window,
                              "sliding layers need a positive window (tokens)")
        self._check_linear_shape()
        if "chunked_attention" in self.layer_types and not _positive(self.attention_chunk_size):
            raise ConfigError("attention_chunk_size", self.attention_chunk_size,
                              "chunked layers need a positive chunk size (tokens)")

    def _check_linear_shape(self) -> None:
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim"):
            if not _positive(getattr(self, name)):
                raise ConfigError(name, getattr(self, name), "must be a positive integer")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads", self.linear_num_value_heads,
                              f"must be a multiple of linear_num_key_heads="
                              f"{self.linear_num_key_heads}")
        if not _positive(self.linear_conv_kernel_dim) or self.linear_conv_kernel_dim < 2:
            raise ConfigError("linear_conv_kernel_dim", self.linear_conv_kernel_dim,
                              "must be an integer >= 2 (taps)")

    @classmethod
    def tiny(cls, *, layer_types: Sequence[LayerKind] | None = None,
             sliding_window: int | None = 6, attention_chunk_size: int | None = None,
             layer_windows: tuple[int, ...] | None = None, **shape: int) -> ModelConfig:
        """A test-sized model: 4 layers (3 sliding : 1 full), hidden 32, 4 heads, 2 KV heads,
        head_dim 8, vocab 97; ``shape`` overrides any of those sizes."""
        kinds = tuple(layer_types) if layer_types is not None else gemma3_pattern(4, period=4)
        base = cls(vocab_size=97, hidden_size=32, intermediate_size=64, num_heads=4,
                   num_kv_heads=2, head_dim=8, layer_types=kinds, sliding_window=sliding_window,
                   layer_windows=layer_windows, attention_chunk_size=attention_chunk_size)
        return dataclasses.replace(base, **cast(dict[str, Any], shape))

    @classmethod
    def gemma3_1b_shape(cls) -> ModelConfig:
        """Gemma-3-1B's shape (26 layers, 5:1 local/global, window 512, 1 KV head)."""
        return cls(vocab_size=262_144, hidden_size=1152, intermediate_size=6912, num_heads=4,
                   num_kv_heads=1, head_dim=256, layer_types=gemma3_pattern(26),
                   sliding_window=512, query_pre_attn_scalar=256)

    @classmethod
    def qwen35_shape(cls, num_layers: int = 64) -> ModelConfig:
        """Qwen3.5-27B's per-layer shape (hidden 5120, 24 Q / 4 KV heads x 256, Gated DeltaNet
        16 key / 48 value heads x 128, conv 4; every 4th layer full attention); ``num_layers``
        cuts the depth (the model has 64). Full-attention layers keep this engine's
        Gemma-style block (no output gate)."""
        return cls(vocab_size=248_320, hidden_size=5120, intermediate_size=17_408,
                   num_heads=24, num_kv_heads=4, head_dim=256,
                   layer_types=qwen3_next_pattern(num_layers), rope_theta=10_000_000.0,
                   linear_num_key_heads=16, linear_num_value_heads=48,
                   linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_conv_kernel_dim=4)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a ``linear_attention`` layer's conv: ``q | k | v``.

        >>> ModelConfig.tiny(layer_types=qwen3_next_pattern(4)).linear_conv_dim
        64
        """
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def recurrent_state_bytes(self, conv_dtype_bytes: int, ssm_dtype_bytes: int = 4) -> int:
        """Bytes of one ``linear_attention`` layer's checkpoint: conv inputs
        ``(K - 1) * conv_dim`` plus state ``value_heads * dk * dv``
        (``hybridkv.recurrent.gated_delta_net_state_bytes``).

        >>> ModelConfig.qwen35_shape().recurrent_state_bytes(2)   # bf16 conv, fp32 state
        3207168
        """
        return gated_delta_net_state_bytes(
            num_k_heads=self.linear_num_key_heads, num_v_heads=self.linear_num_value_heads,
            head_k_dim=self.linear_key_head_dim, head_v_dim=self.linear_value_head_dim,
            conv_kernel=self.linear_conv_kernel_dim, conv_dtype_bytes=conv_dtype_bytes,
            ssm_dtype_bytes=ssm_dtype_bytes)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def window_of(self, layer_id: int) -> int:
        """Sliding window of layer ``layer_id`` (a sliding layer).

        >>> cfg = ModelConfig.tiny(sliding_window=6, layer_windows=(5, 9, 5, 1))
        >>> cfg.window_of(1), ModelConfig.tiny(sliding_window=6).window_of(1)
        (9, 6)
        """
        window = self.sliding_window if self.layer_windows is None \
            else self.layer_windows[layer_id]
        if self.layer_types[layer_id] != "sliding_attention" or window is None:
            raise ConfigError("layer_id", layer_id, "is not a sliding layer")
        return window

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)


def _positive(value: int | None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def layer_specs_for_model(config: ModelConfig, *, block_size: int, dtype_bytes: int,
                          full_block_size: int | None = None) -> list[LayerSpec]:
    """Per layer, the cache spec matching the layer's attention.

    ``full_block_size`` gives full-attention layers their own block size (default
    ``block_size``); KV bytes per token are ``2 * num_kv_heads * head_dim * dtype_bytes``.
    """
    per_token = kv_bytes_per_token(config.num_kv_heads, config.head_dim, dtype_bytes)
    specs: list[LayerSpec] = []
    for layer_id, kind in enumerate(config.layer_types):
        if kind == "full_attention":
            specs.append(FullAttentionSpec(full_block_size or block_size, per_token))
        elif kind == "sliding_attention":
            specs.append(SlidingWindowSpec(block_size, per_token, config.window_of(layer_id)))
        elif kind in RECURRENT_KINDS:
            specs.append(recurrent_layer_spec(config, block_size=block_size,
                                              state_dtype_bytes=dtype_bytes))
        else:
            assert config.attention_chunk_size is not None
            specs.append(ChunkedLocalSpec(block_size, per_token, config.attention_chunk_size))
    return specs


def recurrent_layer_spec(config: ModelConfig, *, block_size: int,
                         state_dtype_bytes: int) -> LayerSpec:
    """The cache spec of a ``linear_attention`` layer: one checkpoint per block of
    ``block_size`` tokens (vLLM's ``align`` mode), ``config.recurrent_state_bytes`` each
    (conv state in the model's dtype, SSM state in float32, or float64 for a float64
    model: ``state_dtype_bytes`` is the model's).

    >>> cfg = ModelConfig.tiny(layer_types=qwen3_next_pattern(4))
    >>> recurrent_layer_spec(cfg, block_size=8, state_dtype_bytes=8)
    RecurrentStateSpec(block_size=8, state_bytes=3584)
    """
    return RecurrentStateSpec(block_size, config.recurrent_state_bytes(
        state_dtype_bytes, ssm_dtype_bytes=max(4, state_dtype_bytes)))


def cache_config_for_model(config: ModelConfig, *, num_blocks: int, block_size: int,
                           dtype_bytes: int, full_block_size: int | None = None,
                           **options: object) -> CacheConfig:
    """A ``CacheConfig`` whose groups match the model's layers (``options`` as in
    ``CacheConfig``: ``enable_caching``, ``use_eagle``, ``max_num_batched_tokens`` …)."""
    specs = layer_specs_for_model(config, block_size=block_size, dtype_bytes=dtype_bytes,
                                  full_block_size=full_block_size)
    return CacheConfig.from_layers(specs, num_blocks, **options)
