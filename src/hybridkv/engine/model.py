"""A hybrid-attention decoder in plain PyTorch (Gemma-3 architecture, any layer pattern).

The model never sees the KV cache: each layer hands its queries, keys and values for the
step's tokens to an ``attend(layer_id, q, k, v)`` callback (the runner's), which stores the
keys/values in pages and returns the attention output. Tokens of several requests are
concatenated into one ``[num_tokens, ...]`` batch; positions are absolute per token.

Per layer (``x`` is the residual stream)::

    h = norm_in(x);  q, k, v = split(h @ W_qkv);  q, k = rope(q_norm(q)), rope(k_norm(k))
    x = x + norm_post_attn(attend(q, k, v) @ W_o)
    x = x + norm_post_ffn(down(gelu_tanh(gate(h')) * up(h'))),  h' = norm_pre_ffn(x)

The memory-bound pieces (norms, rotary, gated activation) come from ``engine.pointwise``:
eager by default, fused kernels after ``use_compiled_pointwise()`` (the CUDA fast path).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import torch
from torch import nn
from torch.nn import functional as nnf

from hybridkv.engine.gated_delta import GatedDeltaMixer, Projected
from hybridkv.engine.model_config import RECURRENT_KINDS, LayerKind, ModelConfig
from hybridkv.engine.pointwise import EAGER_OPS, PointwiseOps, compiled_ops
from hybridkv.engine.rope import rope_tables

AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer_id, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]``."""

MixFn = Callable[[int, Projected], torch.Tensor]
"""``mix(layer_id, projected) -> [T, Hv, dv]``: a ``linear_attention`` layer's stateful part
(the runner's: resumes each request from its checkpoint, writes the new ones)."""


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """The tensors of one decoder layer (fused ``qkv`` and ``gate_up`` projections)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    post_attn_norm: torch.Tensor
    pre_ffn_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    post_ffn_norm: torch.Tensor


class DecoderLayer(nn.Module):
    """Parameters of one layer; ``weights()`` exposes them as a ``LayerWeights``.

    A ``linear_attention`` layer has a ``GatedDeltaMixer`` (``mixer``) instead of the
    attention projections (those are then empty tensors)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 kind: LayerKind = "full_attention") -> None:
        super().__init__()
        hidden, hd = config.hidden_size, config.head_dim
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * hd
        self.mixer: GatedDeltaMixer | None = None
        if kind in RECURRENT_KINDS:
            self.mixer = GatedDeltaMixer(config, dtype=dtype, device=device)
            qkv_rows, hd = 0, 0

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device),
                                requires_grad=False)

        self.input_norm = param(hidden)
        self.qkv = param(qkv_rows, hidden)
        self.q_norm = param(hd)
        self.k_norm = param(hd)
        self.o_proj = param(hidden if hd else 0, config.num_heads * hd)
        self.post_attn_norm = param(hidden)
        self.pre_ffn_norm = param(hidden)
        self.gate_up = param(2 * config.intermediate_size, hidden)
        self.down = param(hidden, config.intermediate_size)
        self.post_ffn_norm = param(hidden)

    def weights(self) -> LayerWeights:
        return LayerWeights(self.input_norm, self.qkv, self.q_norm, self.k_norm, self.o_proj,
                            self.post_attn_norm, self.pre_ffn_norm, self.gate_up, self.down,
                            self.post_ffn_norm)


class HybridDecoder(nn.Module):
    """The decoder: embedding, layers, final norm, LM head (tied unless configured).

    Args:
        config: model shape.
        dtype / device: where the parameters live.
        seed: random initialisation seed (a ``torch.Generator`` on ``device``); ``None``
            leaves zeros for a loader to fill.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float64,
                 device: torch.device | str = "cpu", seed: int | None = 0) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.embed = nn.Parameter(torch.zeros(config.vocab_size, config.hidden_size,
                                              dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype=dtype, device=device, kind=kind)
                                    for kind in config.layer_types)
        self.final_norm = nn.Parameter(torch.zeros(config.hidden_size, dtype=dtype,
                                                   device=device), requires_grad=False)
        self.lm_head: nn.Parameter | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.zeros_like(self.embed), requires_grad=False)
        self._layer_weights: list[LayerWeights] | None = None
        self.ops: PointwiseOps = EAGER_OPS
        if seed is not None:
            self.randomize(seed)

    @torch.no_grad()
    def randomize(self, seed: int) -> None:
        """Seeded random weights: projections ~ N(0, 1/fan_in), norm weights ~ N(0, 0.1²)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for name, tensor in self.named_parameters():
            if tensor.numel() == 0:
                continue
            scale = 0.1 if tensor.dim() == 1 else tensor.shape[-1] ** -0.5
            if name in ("embed", "lm_head"):
                scale = self.config.hidden_size ** -0.5
            values = torch.randn(tensor.shape, generator=generator, device=self.device,
                                 dtype=torch.float32 if tensor.dtype != torch.float64
                                 else torch.float64)
            tensor.copy_(values * scale)
        for layer_id in self.recurrent_layer_ids:
            self.mixer(layer_id).init_gates(generator)
        self._layer_weights = None

    def _unseeded(self, dtype: torch.dtype, device: torch.device | str) -> Self:
        """A model of this one's structure with unset weights (``converted`` fills them)."""
        return type(self)(self.config, dtype=dtype, device=device, seed=None)

    @torch.no_grad()
    def converted(self, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> Self:
        """A copy of this model with its weights cast to ``dtype`` / moved to ``device``."""
        other = self._unseeded(dtype or self.dtype, device or self.device)
        for target, source in zip(other.parameters(), self.parameters(), strict=True):
            target.copy_(source)
        return other

    def use_compiled_pointwise(self) -> None:
        """Fuse norms, rotary and the gated activation with ``torch.compile`` (numerics:
        Gemma's float32 formulas, see ``engine.pointwise``)."""
        self.ops = compiled_ops()

    @property
    def recurrent_layer_ids(self) -> list[int]:
        """Layers with a recurrent state (``linear_attention``)."""
        return [i for i, kind in enumerate(self.config.layer_types) if kind in RECURRENT_KINDS]

    def mixer(self, layer_id: int) -> GatedDeltaMixer:
        """The Gated DeltaNet mixer of ``linear_attention`` layer ``layer_id``."""
        layer = self.layers[layer_id]
        assert isinstance(layer, DecoderLayer) and layer.mixer is not None, layer_id
        return layer.mixer

    def layer_weights(self) -> list[LayerWeights]:
        if self._layer_weights is None:
            self._layer_weights = [layer.weights() for layer in self.layers
                                   if isinstance(layer, DecoderLayer)]
        return self._layer_weights

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                logit_rows: torch.Tensor, mix: MixFn | None = None) -> torch.Tensor:
        """Run all layers over ``token_ids`` [T] at ``positions`` [T]; return the logits of
        rows ``logit_rows`` (``[R, vocab]``). ``mix`` runs the stateful part of
        ``linear_attention`` layers (required when the model has any)."""
        cfg = self.config
        scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=self.dtype, device=self.device)
        x = nnf.embedding(token_ids, self.embed) * scale
        ropes = {
            "full_attention": rope_tables(positions, head_dim=cfg.head_dim,
                                          theta=cfg.rope_theta,
                                          scaling_factor=cfg.rope_scaling_factor,
                                          dtype=self.dtype),
            "local": rope_tables(positions, head_dim=cfg.head_dim,
                                 theta=cfg.rope_local_theta, dtype=self.dtype),
        }
        for layer_id, (kind, weights) in enumerate(zip(cfg.layer_types, self.layer_weights(),
                                                       strict=True)):
            if kind in RECURRENT_KINDS:
                assert mix is not None, "a model with linear_attention layers needs mix"
                x = self._recurrent_layer(layer_id, x, weights, mix)
                continue
            cos, sin = ropes["full_attention" if kind == "full_attention" else "local"]
            x = self._layer(layer_id, x, weights, cos, sin, attend)
        h = self.ops.norm(x.index_select(0, logit_rows), self.final_norm, cfg.rms_norm_eps)
        head = self.lm_head if self.lm_head is not None else self.embed
        logits = nnf.linear(h, head)
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _recurrent_layer(self, layer_id: int, x: torch.Tensor, w: LayerWeights,
                         mix: MixFn) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        ops, mixer = self.ops, self.mixer(layer_id)
        projected = mixer.project(ops.norm(x, w.input_norm, eps))
        out = mixer.finish(mix(layer_id, projected), projected.z, eps)
        return self._mlp(ops.add_norm(x, out, w.post_attn_norm, eps), w)

    def _layer(self, layer_id: int, x: torch.Tensor, w: LayerWeights, cos: torch.Tensor,
               sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        q, k, v = self._qkv(self.ops.norm(x, w.input_norm, self.config.rms_norm_eps), w,
                            cos, sin)
        return self._attention_out(x, attend(layer_id, q, k, v), w)

    def _qkv(self, h: torch.Tensor, w: LayerWeights, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An attention layer's q ``[T, H, D]`` (normed, rotated), k ``[T, KVH, D]``
        (normed, rotated) and v ``[T, KVH, D]`` of its normed input ``h`` ``[T, hidden]``."""
        cfg, ops = self.config, self.ops
        eps, hd, num_tokens = cfg.rms_norm_eps, cfg.head_dim, h.shape[0]
        q, k, v = torch.split(nnf.linear(h, w.qkv),
                              [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd],
                              dim=-1)
        q = ops.norm_rope(q.reshape(num_tokens, cfg.num_heads, hd), w.q_norm, eps, cos, sin)
        k = ops.norm_rope(k.reshape(num_tokens, cfg.num_kv_heads, hd), w.k_norm, eps, cos, sin)
        return q, k, v.reshape(num_tokens, cfg.num_kv_heads, hd)

    def _attention_out(self, x: torch.Tensor, out: torch.Tensor,
                       w: LayerWeights) -> torch.Tensor:
        """The rest of an attention layer after attention gave ``out`` ``[T, H, D]``: output
        projection into the residual ``x`` (post-attention norm), then the MLP block."""
        cfg = self.config
        projected = nnf.linear(out.reshape(x.shape[0], cfg.num_heads * cfg.head_dim),
                               w.o_proj)
        return self._mlp(self.ops.add_norm(x, projected, w.post_attn_norm, cfg.rms_norm_eps),
                         w)

    def _mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """A layer's MLP block on the residual ``x``: gated-GELU MLP of the pre-FFN-normed
        ``x``, added back with the post-FFN norm."""
        ops, eps = self.ops, self.config.rms_norm_eps
        mlp = nnf.linear(ops.gated_gelu(nnf.linear(ops.norm(x, w.pre_ffn_norm, eps),
                                                   w.gate_up)), w.down)
        return ops.add_norm(x, mlp, w.post_ffn_norm, eps)
