"""Rotary position embedding in the "rotate half" layout (dims ``[0, d/2)`` pair with
``[d/2, d)``), as Gemma 3 checkpoints expect.

Angles are computed in float64 for a float64 model and in float32 otherwise (what Gemma 3's
reference implementation does), then cast to the activation dtype.
"""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, *, head_dim: int, theta: float,
                scaling_factor: float = 1.0,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[num_tokens, head_dim // 2]``, for absolute ``positions``.

    ``scaling_factor`` is linear rope scaling: positions are divided by it.
    """
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    exponents = torch.arange(0, head_dim, 2, device=positions.device,
                             dtype=torch.int64).to(angle_dtype) / head_dim
    inv_freq = 1.0 / (theta ** exponents) / scaling_factor
    angles = positions.to(angle_dtype)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` by per-token angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
