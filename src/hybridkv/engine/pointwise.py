"""The memory-bound pieces of a decoder layer, eager or fused by ``torch.compile``.

A long prefill spends as much time in normalisation, rotary embedding and the gated
activation as in the matrix products when each runs as several elementwise kernels
(measured on an H200 at 32k tokens: 76 ms of pointwise kernels beside 59 ms of GEMMs).
``compiled_ops()`` fuses each piece into one kernel (automatic dynamic shapes: after a
second token count the token dimension becomes symbolic, the model dimensions stay fixed,
so loads stay vectorised).

Numerics: RMSNorm scales by ``1 + w`` (Gemma). The eager ops compute in the activation
dtype when it is float32/float64; for 16-bit activations they run one fused ``rms_norm`` in
that dtype with ``1 + w`` rounded to it (one rounding more than Gemma's float32 formula).
The compiled ops always compute in float32 (float64 for float64 inputs) and round once, as
Gemma's reference does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as nnf

from hybridkv.engine.rope import apply_rope


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * (1 + weight)`` over the last dimension (eager)."""
    shape = (x.shape[-1],)
    if x.dtype in (torch.float32, torch.float64):
        return nnf.rms_norm(x, shape, eps=eps) * (1.0 + weight.to(x.dtype))
    return nnf.rms_norm(x, shape, weight=(1.0 + weight.float()).to(x.dtype), eps=eps)


def _add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
              eps: float) -> torch.Tensor:
    return x + gemma_rms_norm(y, weight, eps)


def _norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    return apply_rope(gemma_rms_norm(x, weight, eps), cos, sin)


def _gated_gelu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nnf.gelu(gate, approximate="tanh") * up


def _wide(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _exact_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    wide = x.to(_wide(x))
    scaled = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return (scaled * (1.0 + weight.to(wide.dtype))).to(x.dtype)


def _exact_add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
    return x + _exact_norm(y, weight, eps)


def _exact_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    wide = x.to(_wide(x))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    normed = normed * (1.0 + weight.to(wide.dtype))
    return apply_rope(normed, cos.to(wide.dtype), sin.to(wide.dtype)).to(x.dtype)


def _exact_gated_gelu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.to(_wide(gate_up)).chunk(2, dim=-1)
    return (nnf.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


@dataclass(frozen=True, slots=True)
class PointwiseOps:
    """One implementation of each memory-bound piece.

    Attributes:
        norm: ``norm(x, w, eps)``.
        add_norm: ``x + norm(y, w, eps)`` (a residual branch joining the stream).
        norm_rope: ``rope(norm(x, w, eps), cos, sin)`` (q/k norm then rotary).
        gated_gelu: ``gelu_tanh(gate) * up`` of the fused ``[gate | up]`` projection.
    """

    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    norm_rope: Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor],
                        torch.Tensor]
    gated_gelu: Callable[[torch.Tensor], torch.Tensor]


EAGER_OPS = PointwiseOps(gemma_rms_norm, _add_norm, _norm_rope, _gated_gelu)


EXACT_OPS = PointwiseOps(_exact_norm, _exact_add_norm, _exact_norm_rope, _exact_gated_gelu)
"""Gemma's float32 formulas, unfused (what ``compiled_ops`` compiles)."""


def compiled_ops() -> PointwiseOps:
    """``EXACT_OPS``, each compiled into fused kernels."""
    def fuse(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        compiled: Callable[..., torch.Tensor] = torch.compile(fn)
        return compiled

    return PointwiseOps(fuse(EXACT_OPS.norm), fuse(EXACT_OPS.add_norm),
                        fuse(EXACT_OPS.norm_rope), fuse(EXACT_OPS.gated_gelu))
