"""Frozen layer specs: what one attention layer needs from the KV cache, and its page math.

A spec says how many tokens one block holds (``block_size``), how many KV bytes one token
costs in one layer (``kv_bytes_per_token``) and which earlier tokens a new token still reads.

>>> swa = SlidingWindowSpec(block_size=16, kv_bytes_per_token=512, sliding_window=1024)
>>> swa.num_tail_blocks          # ceil((1024 - 1) / 16): blocks a hit needs before its end
64
>>> swa.num_skipped_tokens(2000) # tokens entirely before the next token's window
977
>>> chunked = ChunkedLocalSpec(block_size=4, kv_bytes_per_token=8, attention_chunk_size=8)
>>> chunked.num_skipped_tokens(13)
8
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hybridkv.errors import ConfigError


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV bytes one token costs in one layer: keys plus values.

    >>> kv_bytes_per_token(num_kv_heads=8, head_dim=128, dtype_bytes=2)
    4096
    """
    for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes)):
        _require_positive(name, value)
    return 2 * num_kv_heads * head_dim * dtype_bytes


def _require_positive(field: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(field, value, "must be a positive integer")


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """A layer that attends to every earlier token: a hit needs the whole prefix."""

    block_size: int
    kv_bytes_per_token: int
    kind: ClassVar[str] = "full_attention"

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("kv_bytes_per_token", self.kv_bytes_per_token)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Full attention never releases KV while a request runs."""
        del num_computed_tokens
        return 0


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """A layer whose token ``p`` attends to ``[p - (w - 1), p]`` (the window includes itself)."""

    block_size: int
    kv_bytes_per_token: int
    sliding_window: int
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("kv_bytes_per_token", self.kv_bytes_per_token)
        _require_positive("sliding_window", self.sliding_window)

    @property
    def num_tail_blocks(self) -> int:
        """Contiguous blocks a hit at a block boundary needs: ``ceil((w - 1) / block_size)``.

        >>> SlidingWindowSpec(block_size=2, kv_bytes_per_token=1, sliding_window=4).num_tail_blocks
        2
        >>> SlidingWindowSpec(block_size=8, kv_bytes_per_token=1, sliding_window=8).num_tail_blocks
        1
        """
        return -(-(self.sliding_window - 1) // self.block_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token: ``max(0, n - w + 1)``.

        >>> spec = SlidingWindowSpec(block_size=2, kv_bytes_per_token=1, sliding_window=4)
        >>> spec.num_skipped_tokens(7)
        4
        """
        return max(0, num_computed_tokens - self.sliding_window + 1)


@dataclass(frozen=True, slots=True)
class ChunkedLocalSpec:
    """A layer attending only within its chunk of ``attention_chunk_size`` tokens (Llama 4)."""

    block_size: int
    kv_bytes_per_token: int
    attention_chunk_size: int
    kind: ClassVar[str] = "chunked_local"

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("kv_bytes_per_token", self.kv_bytes_per_token)
        _require_positive("attention_chunk_size", self.attention_chunk_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of completed chunks: ``(n // chunk) * chunk``."""
        chunk = self.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk


LayerSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalSpec
"""Any layer spec. Mamba state and compressed attention join this union later."""
