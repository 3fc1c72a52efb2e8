"""The Gated DeltaNet token mixer of ``linear_attention`` layers (Qwen3-Next / Qwen3.5 shape).

The decoder layer keeps its sandwich norms and MLP; the mixer replaces attention::

    qkv, z = split(h @ W_qkvz);   b, a = split(h @ W_ba)
    beta = sigmoid(b);            g = -exp(A_log) * softplus(a + dt_bias)     (log decay)
    [the runner, per request chunk, from the checkpoint at the chunk's start:]
    qkv = silu(causal_conv(qkv));   q, k = l2norm(q) / sqrt(dk), l2norm(k);   v
    o = gated_delta(q, k, v, g, beta)           (key heads repeated to the value heads)
    out = (norm(o) * silu(z)) @ W_out

``project`` is the part before the state (pure per token, batched over the step's
requests), ``mix_from`` the stateful part (one request's chunk, from a ``RecurrentState``,
returning the checkpoints at the asked stops), ``finish`` the output gate and projection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as nnf

from hybridkv.engine.model_config import ModelConfig
from hybridkv.engine.pointwise import gemma_rms_norm
from hybridkv.engine.recurrent import (
    RecurrentState,
    causal_conv,
    gated_delta_chunked,
    gated_delta_reference,
)

Recurrence = Callable[..., tuple[torch.Tensor, list[torch.Tensor]]]
"""``(q, k, v, g, beta, state, *, stops) -> (outputs, states)``: ``gated_delta_reference``,
``gated_delta_chunked`` or a ``functools.partial`` of it (``Chunking``)."""

RECURRENCES: dict[str, Recurrence] = {"reference": gated_delta_reference,
                                      "chunked": gated_delta_chunked}


@dataclass(frozen=True, slots=True)
class Projected:
    """The per-token inputs of the stateful part, for a batch of tokens."""

    qkv: torch.Tensor    # [T, conv_dim], before the conv
    z: torch.Tensor      # [T, Hv, dv], output gate
    g: torch.Tensor      # [T, Hv], log decay (<= 0)
    beta: torch.Tensor   # [T, Hv], write strength in (0, 1)


class GatedDeltaMixer(nn.Module):
    """Parameters of one ``linear_attention`` layer's mixer."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device),
                                requires_grad=False)

        self.in_proj_qkvz = param(2 * hk * dk + 2 * hv * dv, config.hidden_size)
        self.in_proj_ba = param(2 * hv, config.hidden_size)
        self.conv_weight = param(config.linear_conv_dim, config.linear_conv_kernel_dim)
        self.dt_bias = param(hv)
        self.a_log = param(hv)
        self.norm = param(dv)
        self.out_proj = param(config.hidden_size, hv * dv)

    @torch.no_grad()
    def init_gates(self, generator: torch.Generator) -> None:
        """Decay rates of a trained model's range: ``-g = exp(A_log) * softplus(dt)`` about
        0.02 per token (memory of ~50 tokens; a random ``N(0, 1)`` would forget within a
        few, hiding a wrong checkpoint)."""
        dt = -4.0 + 0.5 * torch.randn(self.dt_bias.shape, generator=generator,
                                      device=self.dt_bias.device, dtype=torch.float64)
        self.dt_bias.copy_(dt)
        self.a_log.copy_(0.3 * torch.randn(self.a_log.shape, generator=generator,
                                           device=self.a_log.device, dtype=torch.float64))

    def project(self, h: torch.Tensor) -> Projected:
        """``h`` ``[T, hidden]`` (normed) → the stateful part's inputs."""
        cfg = self.config
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        qkv, z = torch.split(nnf.linear(h, self.in_proj_qkvz),
                             [cfg.linear_conv_dim, hv * dv], dim=-1)
        b, a = torch.split(nnf.linear(h, self.in_proj_ba), [hv, hv], dim=-1)
        wide = torch.float64 if h.dtype == torch.float64 else torch.float32
        g = -torch.exp(self.a_log.to(wide)) * nnf.softplus(a.to(wide) + self.dt_bias.to(wide))
        return Projected(qkv, z.reshape(-1, hv, dv), g, torch.sigmoid(b.to(wide)))

    def mix_from(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: RecurrentState, *, stops: Sequence[int],
                 recurrence: Recurrence) -> tuple[torch.Tensor, list[RecurrentState]]:
        """One request's tokens, resumed from ``state``: outputs ``[T, Hv, dv]`` and the
        checkpoint after each of ``stops`` (token counts within these tokens)."""
        cfg = self.config
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        num_tokens = qkv.shape[0]
        conv_out, conv_states = causal_conv(qkv, state.conv, self.conv_weight, stops=stops)
        q, k, v = torch.split(nnf.silu(conv_out), [hk * dk, hk * dk, hv * dv], dim=-1)
        q = nnf.normalize(q.reshape(num_tokens, hk, dk), dim=-1) * dk ** -0.5
        k = nnf.normalize(k.reshape(num_tokens, hk, dk), dim=-1)
        repeat = hv // hk
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        out, ssm_states = recurrence(q, k, v.reshape(num_tokens, hv, dv), g, beta,
                                     state.ssm, stops=stops)
        return out, [RecurrentState(c, s) for c, s in zip(conv_states, ssm_states, strict=True)]

    def finish(self, out: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
        """Gated norm per head, then the output projection: ``[T, hidden]``."""
        gated = gemma_rms_norm(out.to(z.dtype), self.norm, eps) * nnf.silu(z)
        return nnf.linear(gated.reshape(out.shape[0], -1), self.out_proj)

    def zero_state(self, *, state_dtype: torch.dtype) -> RecurrentState:
        """The state before the first token."""
        cfg = self.config
        device = self.conv_weight.device
        conv = torch.zeros(cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim,
                           dtype=self.conv_weight.dtype, device=device)
        ssm = torch.zeros(cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, dtype=state_dtype, device=device)
        return RecurrentState(conv, ssm)
