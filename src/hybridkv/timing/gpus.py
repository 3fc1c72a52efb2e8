"""Accelerators a step-time model can run on: datasheet peaks, one row per ``--gpu`` name.

Every figure is the vendor datasheet's *dense* rate (no 2:4 sparsity), per GPU, in SI units:

- **H100 SXM** and **H200** (NVIDIA H100 / H200 Tensor Core GPU datasheets, SXM form
  factor): bf16 989 TFLOP/s, fp8 1,979 TFLOP/s (the sheets print 1,979 / 3,958 "with
  sparsity"); HBM3 3.35 TB/s (H100, 80 GB), HBM3e 4.8 TB/s (H200, 141 GB); NVLink 900 GB/s
  per GPU; host link PCIe Gen5 x16, 128 GB/s both directions = 64 GB/s one way.
- **B200** (NVIDIA HGX B200 datasheet, per GPU): bf16 2.25 PFLOP/s and fp8 4.5 PFLOP/s dense
  (4.5 / 9 with sparsity); HBM3e 7.7 TB/s, 180 GB; NVLink 5 1.8 TB/s; PCIe Gen5 (64 GB/s).
- **A100 80 GB** (NVIDIA A100 datasheet, SXM): bf16 312 TFLOP/s (624 sparse), no fp8 (fp8
  runs at the bf16 rate here); HBM2e 2,039 GB/s; NVLink 600 GB/s; PCIe Gen4 (32 GB/s).
- **L40S** (NVIDIA L40S datasheet): bf16 362 TFLOP/s, fp8 733 TFLOP/s (733 / 1,466 sparse);
  GDDR6 864 GB/s, 48 GB; no NVLink (peers over PCIe Gen4 x16, 32 GB/s one way).
- **MI300X** (AMD Instinct MI300X data sheet): bf16 1,307 TFLOP/s, fp8 2,615 TFLOP/s dense;
  HBM3 5.3 TB/s, 192 GB; Infinity Fabric 7 links x 128 GB/s = 896 GB/s to peers; PCIe
  Gen5 x16 (64 GB/s one way).

Datasheet peaks are ceilings: a measured step runs at a fraction of them, which the fitted
efficiencies (``timing.params``) supply. A GPU other than the one the efficiencies were
measured on reuses them over its own peaks and is labelled *scaled* in every report.

>>> gpu_named("h200").hbm_bytes_per_s / 1e12
4.8
>>> gpu_named("H100 SXM").key, gpu_named("a100-80gb").fp8_dense_flops / 1e12   # no fp8
('h100', 312.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from hybridkv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator's datasheet peaks (dense, per GPU).

    Attributes:
        key: the ``--gpu`` name.
        name: the product name.
        bf16_dense_flops / fp8_dense_flops: tensor-core FLOP/s without sparsity.
        hbm_bytes_per_s / hbm_bytes: device memory bandwidth and capacity.
        peer_bytes_per_s: GPU-to-GPU bandwidth per GPU, one direction (tensor-parallel
            all-reduce).
        host_bytes_per_s: host link, one direction (offload and host copies).
        source: the datasheet the figures come from.
    """

    key: str
    name: str
    bf16_dense_flops: float
    fp8_dense_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    peer_bytes_per_s: float
    host_bytes_per_s: float
    source: str

    def peak_flops(self, dtype_bytes: int) -> float:
        """Dense tensor-core rate for operands of ``dtype_bytes`` (1: fp8, else bf16).

        >>> gpu_named("h100").peak_flops(1) / 1e12, gpu_named("h100").peak_flops(2) / 1e12
        (1979.0, 989.0)
        """
        return self.fp8_dense_flops if dtype_bytes == 1 else self.bf16_dense_flops


_T, _G = 1e12, 1e9
GPUS: Final[dict[str, GPU]] = {g.key: g for g in (
    GPU("h100", "NVIDIA H100 SXM", 989 * _T, 1979 * _T, 3350 * _G, 80 * _G, 450 * _G,
        64 * _G, "NVIDIA H100 Tensor Core GPU datasheet (SXM)"),
    GPU("h200", "NVIDIA H200", 989 * _T, 1979 * _T, 4800 * _G, 141 * _G, 450 * _G, 64 * _G,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    GPU("b200", "NVIDIA B200", 2250 * _T, 4500 * _T, 7700 * _G, 180 * _G, 900 * _G, 64 * _G,
        "NVIDIA HGX B200 datasheet (per GPU)"),
    GPU("a100", "NVIDIA A100 80GB SXM", 312 * _T, 312 * _T, 2039 * _G, 80 * _G, 300 * _G,
        32 * _G, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)"),
    GPU("l40s", "NVIDIA L40S", 362 * _T, 733 * _T, 864 * _G, 48 * _G, 32 * _G, 32 * _G,
        "NVIDIA L40S datasheet"),
    GPU("mi300x", "AMD Instinct MI300X", 1307 * _T, 2615 * _T, 5300 * _G, 192 * _G, 448 * _G,
        64 * _G, "AMD Instinct MI300X accelerator data sheet"),
)}
"""``--gpu`` name → datasheet row. NVLink's 900 / 600 / 1,800 GB/s are both directions
together; ``peer_bytes_per_s`` is one direction (half), as a ring all-reduce sends and
receives at once. MI300X: 7 x 128 GB/s links both ways → 448 GB/s one way."""

ALIASES: Final[dict[str, str]] = {
    "h100-sxm": "h100", "h100sxm": "h100", "h200-sxm": "h200", "a100-80gb": "a100",
    "a100-80": "a100", "a10080gb": "a100", "mi300": "mi300x",
}


def gpu_named(text: str) -> GPU:
    """The row for a ``--gpu`` value (case, spaces and ``_`` ignored; a few aliases).

    >>> gpu_named(" B200 ").name
    'NVIDIA B200'
    >>> gpu_named("v100")
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: gpu='v100' is invalid: choose one of h100, h200, b200, \
a100, l40s, mi300x
    """
    key = text.strip().lower().replace(" ", "-").replace("_", "-")
    key = ALIASES.get(key, ALIASES.get(key.replace("-", ""), key))
    if key not in GPUS:
        raise ConfigError("gpu", text, f"choose one of {', '.join(GPUS)}")
    return GPUS[key]
