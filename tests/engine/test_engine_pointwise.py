"""The Gemma-exact pointwise ops (what the CUDA path compiles) agree with the eager ops."""

from __future__ import annotations

import pytest

from hybridkv.engine.pointwise import EAGER_OPS, EXACT_OPS

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return {"x": randn(5, 3, 16), "y": randn(5, 3, 16), "w": randn(16) * 0.1,
            "cos": randn(5, 8).cos(), "sin": randn(5, 8).sin(), "gate_up": randn(5, 24)}


def _apply(ops: object, t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [ops.norm(t["x"], t["w"], 1e-6),  # type: ignore[attr-defined]
            ops.add_norm(t["x"], t["y"], t["w"], 1e-6),  # type: ignore[attr-defined]
            ops.norm_rope(t["x"], t["w"], 1e-6, t["cos"], t["sin"]),  # type: ignore[attr-defined]
            ops.gated_gelu(t["gate_up"])]  # type: ignore[attr-defined]


def test_exact_ops_equal_eager_ops_in_float64() -> None:
    t = _inputs(torch.float64)
    for exact, eager in zip(_apply(EXACT_OPS, t), _apply(EAGER_OPS, t), strict=True):
        torch.testing.assert_close(exact, eager, rtol=0, atol=1e-12)


def test_exact_ops_round_once_in_bfloat16() -> None:
    """bf16 in, float32 inside, rounded out: within a bf16 ulp or two of float64 (the
    residual sum rounds once more, as Gemma's reference does)."""
    t16 = _inputs(torch.bfloat16)
    reference = _apply(EXACT_OPS, {k: v.to(torch.bfloat16).double() for k, v in t16.items()})
    for got, ref in zip(_apply(EXACT_OPS, t16), reference, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), ref, rtol=2**-8,
                                   atol=2**-8 * float(ref.abs().max()))
