"""Recurrent-state page math: checkpoint bytes of a mixer, and block-size unification.

A recurrent layer's checkpoint is its conv state plus its SSM state. The formulas follow the
state shapes vLLM 0.33 allocates (``MambaStateShapeCalculator``, tensor parallel 1):

- Gated DeltaNet: conv ``(2 * k_heads * k_dim + v_heads * v_dim) x (conv_kernel - 1)``,
  SSM ``v_heads x v_dim x k_dim``;
- Mamba-2: conv ``(intermediate + 2 * n_groups * state) x (conv_kernel - 1)``,
  SSM ``heads x head_dim x state``;
- Mamba (1): conv ``intermediate x (conv_kernel - 1)``, SSM ``intermediate x state``.

Block-size unification (vLLM's ``Platform._align_hybrid_block_size``): the attention block
is raised to the smallest multiple of the kernel alignment whose page (one layer) holds one
checkpoint; every group then uses that block size, so one checkpoint fills one block.

Worked example (Qwen3.5-27B: 4 KV heads x 256 x bf16 = 4,096 B/token; GDN 16 k-heads,
48 v-heads, dims 128, conv 4, bf16 conv, fp32 SSM):

>>> state = gated_delta_net_state_bytes(num_k_heads=16, num_v_heads=48, head_k_dim=128,
...                                     head_v_dim=128, conv_kernel=4, conv_dtype_bytes=2,
...                                     ssm_dtype_bytes=4)
>>> state                      # 10,240 x 3 x 2 + 48 x 128 x 128 x 4
3207168
>>> align_hybrid_block_size(attn_bytes_per_token=4096, state_bytes=state)   # 16 x 49
784
"""

from __future__ import annotations

from hybridkv.errors import ConfigError

KERNEL_BLOCK_ALIGNMENT = 16
"""Smallest kernel block of vLLM's default attention backends (FlashAttention: multiples of
16) and vLLM's default ``--block-size``."""


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, value, "must be a positive integer")
    return value


def gated_delta_net_state_bytes(*, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                                head_v_dim: int, conv_kernel: int, conv_dtype_bytes: int,
                                ssm_dtype_bytes: int) -> int:
    """Bytes of one Gated DeltaNet layer's checkpoint (conv + SSM state)."""
    for name, value in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                        ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim),
                        ("conv_kernel", conv_kernel), ("conv_dtype_bytes", conv_dtype_bytes),
                        ("ssm_dtype_bytes", ssm_dtype_bytes)):
        _positive(name, value)
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    conv = conv_dim * (conv_kernel - 1) * conv_dtype_bytes
    ssm = num_v_heads * head_v_dim * head_k_dim * ssm_dtype_bytes
    return conv + ssm


def mamba2_state_bytes(*, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                       conv_kernel: int, conv_dtype_bytes: int, ssm_dtype_bytes: int,
                       intermediate_size: int | None = None) -> int:
    """Bytes of one Mamba-2 layer's checkpoint; ``intermediate_size`` defaults to
    ``num_heads * head_dim``.

    >>> mamba2_state_bytes(num_heads=64, head_dim=64, n_groups=8, state_size=128,
    ...                    conv_kernel=4, conv_dtype_bytes=2, ssm_dtype_bytes=4)
    2134016
    """
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim),
                        ("n_groups", n_groups), ("state_size", state_size),
                        ("conv_kernel", conv_kernel), ("conv_dtype_bytes", conv_dtype_bytes),
                        ("ssm_dtype_bytes", ssm_dtype_bytes)):
        _positive(name, value)
    inner = num_heads * head_dim if intermediate_size is None else \
        _positive("intermediate_size", intermediate_size)
    conv = (inner + 2 * n_groups * state_size) * (conv_kernel - 1) * conv_dtype_bytes
    ssm = num_heads * head_dim * state_size * ssm_dtype_bytes
    return conv + ssm


def mamba1_state_bytes(*, intermediate_size: int, state_size: int, conv_kernel: int,
                       conv_dtype_bytes: int, ssm_dtype_bytes: int) -> int:
    """Bytes of one Mamba (1) layer's checkpoint.

    >>> mamba1_state_bytes(intermediate_size=8192, state_size=16, conv_kernel=4,
    ...                    conv_dtype_bytes=2, ssm_dtype_bytes=2)   # Jamba-v0.1
    311296
    """
    for name, value in (("intermediate_size", intermediate_size), ("state_size", state_size),
                        ("conv_kernel", conv_kernel), ("conv_dtype_bytes", conv_dtype_bytes),
                        ("ssm_dtype_bytes", ssm_dtype_bytes)):
        _positive(name, value)
    conv = intermediate_size * (conv_kernel - 1) * conv_dtype_bytes
    ssm = intermediate_size * state_size * ssm_dtype_bytes
    return conv + ssm


def align_hybrid_block_size(*, attn_bytes_per_token: int, state_bytes: int,
                            kernel_block_alignment: int = KERNEL_BLOCK_ALIGNMENT,
                            min_block_size: int = KERNEL_BLOCK_ALIGNMENT) -> int:
    """Unified block size of a hybrid attention + recurrent model (vLLM 0.33
    ``_align_hybrid_block_size`` with the default backend): the smallest multiple of
    ``max(kernel_block_alignment, min_block_size)`` whose one-layer attention page holds
    ``state_bytes``; never below ``min_block_size``.

    >>> align_hybrid_block_size(attn_bytes_per_token=4096, state_bytes=311296)   # Jamba
    80
    >>> align_hybrid_block_size(attn_bytes_per_token=4096, state_bytes=100)
    16
    """
    _positive("attn_bytes_per_token", attn_bytes_per_token)
    _positive("state_bytes", state_bytes)
    align = max(_positive("kernel_block_alignment", kernel_block_alignment),
                _positive("min_block_size", min_block_size))
    block = align * -(-state_bytes // (align * attn_bytes_per_token))
    block = kernel_block_alignment * -(-block // kernel_block_alignment)
    return max(block, min_block_size)


def checkpoint_page_padding(attn_bytes_per_token: int, block_size: int, state_bytes: int,
                            ) -> float:
    """Fraction of a unified page a checkpoint leaves empty (vLLM logs it as padding).

    >>> round(checkpoint_page_padding(4096, 784, 3207168), 5)
    0.00128
    """
    page = attn_bytes_per_token * block_size
    if page < state_bytes:
        raise ConfigError("block_size", block_size,
                          f"an attention page of {page} B cannot hold a {state_bytes} B "
                          "checkpoint; unify the block size first")
    return (page - state_bytes) / page

