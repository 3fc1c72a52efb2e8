"""Attention rules per layer kind and two attention paths over gathered keys/values.

A chunk of queries at positions ``[q_start, q_start + Q)`` attends to keys gathered from
the paged cache at positions ``[kv_start, kv_start + K)``, where ``AttentionRule.key_range``
chose exactly the positions some query of the chunk reads::

    full_attention     [0, end)
    sliding_attention  [max(0, q_start - (w - 1)), end)
    chunked_attention  [floor(q_start / c) * c, end)

Both paths share the signature ``(q [Q, H, D], k [K, KVH, D], v [K, KVH, D], *, q_start,
kv_start, rule, scale) -> [Q, H, D]``:

- ``reference_attention``: an explicit boolean mask, scores, softmax, weighted sum; meant
  for float64 on the CPU (the exactness check of ``hybridkv verify``).
- ``sdpa_attention``: PyTorch's ``scaled_dot_product_attention`` (fused kernels on CUDA);
  no mask for one query (every gathered key is needed), ``is_causal`` or a lower-right
  causal bias for full layers, a boolean mask otherwise. ``engine.flex`` adds block-sparse
  kernels for long local chunks on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as nnf
from torch.nn.attention.bias import causal_lower_right

from hybridkv.engine.model_config import LayerKind, ModelConfig
from hybridkv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AttentionRule:
    """Which keys a query reads, for one layer kind.

    >>> rule = AttentionRule("sliding_attention", window=4)
    >>> rule.first_key(10), rule.key_range(10, 13)
    (7, (7, 13))
    >>> AttentionRule("chunked_attention", chunk=8).key_range(10, 13)
    (8, 13)
    """

    kind: LayerKind
    window: int | None = None
    chunk: int | None = None

    @classmethod
    def for_layer(cls, config: ModelConfig, layer_id: int) -> AttentionRule:
        kind = config.layer_types[layer_id]
        if kind == "sliding_attention":
            return cls(kind, window=config.window_of(layer_id))
        if kind == "chunked_attention":
            return cls(kind, chunk=config.attention_chunk_size)
        return cls(kind)

    def first_key(self, position: int) -> int:
        """First key position the query at ``position`` reads."""
        if self.kind == "sliding_attention":
            assert self.window is not None
            return max(0, position - self.window + 1)
        if self.kind == "chunked_attention":
            assert self.chunk is not None
            return position // self.chunk * self.chunk
        return 0

    def key_range(self, start: int, end: int) -> tuple[int, int]:
        """Half-open key positions read by queries ``[start, end)``."""
        return self.first_key(start), end

    def allowed(self, q_positions: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
        """Boolean ``[Q, K]``: may query ``i`` read key ``j``."""
        qp, kp = q_positions[:, None], kv_positions[None, :]
        mask = kp <= qp
        if self.kind == "sliding_attention":
            assert self.window is not None
            mask &= kp > qp - self.window
        elif self.kind == "chunked_attention":
            assert self.chunk is not None
            mask &= torch.div(kp, self.chunk, rounding_mode="floor") == \
                torch.div(qp, self.chunk, rounding_mode="floor")
        return mask


AttentionFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, *, q_start, kv_start, rule, scale) -> out``."""


def _positions(start: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + count, device=device)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ConfigError("kv_shape", (tuple(q.shape), tuple(k.shape), tuple(v.shape)),
                          "q is [Q, H, D], k and v [K, KVH, D] with KVH dividing H")
    return q.shape[1] // k.shape[1]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int,
                        kv_start: int, rule: AttentionRule, scale: float) -> torch.Tensor:
    """Explicit-mask attention, computed in the inputs' dtype."""
    group = _check_shapes(q, k, v)
    allowed = rule.allowed(_positions(q_start, q.shape[0], q.device),
                           _positions(kv_start, k.shape[0], q.device))
    keys = k.repeat_interleave(group, dim=1)
    values = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int,
                   kv_start: int, rule: AttentionRule, scale: float) -> torch.Tensor:
    """Fused-kernel attention (``scaled_dot_product_attention``) with the same semantics."""
    group = _check_shapes(q, k, v)
    num_q, num_kv = q.shape[0], k.shape[0]
    query = q.transpose(0, 1).unsqueeze(0)
    keys = k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
    values = v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
    if num_q == 1:
        out = nnf.scaled_dot_product_attention(query, keys, values, scale=scale)
    elif rule.kind == "full_attention" and kv_start == 0 and num_kv == q_start + num_q:
        if num_q == num_kv:
            out = nnf.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                 scale=scale)
        else:
            out = nnf.scaled_dot_product_attention(
                query, keys, values, attn_mask=causal_lower_right(num_q, num_kv), scale=scale)
    else:
        allowed = rule.allowed(_positions(q_start, num_q, q.device),
                               _positions(kv_start, num_kv, q.device))
        out = nnf.scaled_dot_product_attention(query, keys, values, attn_mask=allowed,
                                             scale=scale)
    return out[0].transpose(0, 1)
