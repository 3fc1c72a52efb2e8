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




@dataclass(frozen=True, slots=True)
class RecurrentStateSpec:
    """A layer with a fixed-size recurrent state (Mamba, Mamba-2 SSD, Gated DeltaNet, KDA).

    A prefix hit at token ``p`` needs the layer's state *exactly after* ``p`` tokens: one
    *checkpoint* (conv state + SSM state), whatever ``p`` is. One block holds one checkpoint
    (vLLM 0.33 ``mamba_cache_mode="align"``); the block table maps positions to checkpoints:
    table index ``i`` holds the state after ``(i + 1) * block_size`` tokens, or the null
    block when no checkpoint is kept there (``docs/design.md``, "Recurrent state").

    ``block_size`` is the checkpoint spacing in tokens; in a hybrid model it equals the
    attention block size after unification (``hybridkv.recurrent.align_hybrid_block_size``).
    ``state_bytes`` is one layer's checkpoint in bytes (its page; padded up to the largest
    page of the pool, as vLLM pads the Mamba page to the attention page).

    >>> gdn = RecurrentStateSpec(block_size=784, state_bytes=3_207_168)   # Qwen3.5-27B GDN
    >>> gdn.num_skipped_tokens(2000)    # only the state after the last token is still needed
    1999
    >>> gdn.page_bytes
    3207168
    """

    block_size: int
    state_bytes: int
    kind: ClassVar[str] = "recurrent_state"

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("state_bytes", self.state_bytes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer: one checkpoint."""
        return self.state_bytes

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Every token but the last: the running state already summarises them."""
        return max(0, num_computed_tokens - 1)


LayerSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalSpec | RecurrentStateSpec
"""Any layer spec."""


def page_bytes(spec: LayerSpec) -> int:
    """Bytes of one block of one layer of ``spec`` (before padding to the pool's page).

    >>> page_bytes(FullAttentionSpec(block_size=16, kv_bytes_per_token=4096))
    65536
    >>> page_bytes(RecurrentStateSpec(block_size=16, state_bytes=1000))
    1000
    """
    if isinstance(spec, RecurrentStateSpec):
        return spec.page_bytes
    return spec.block_size * spec.kv_bytes_per_token
