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

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from hybridkv.errors import ConfigError
from hybridkv.ids import GroupId


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


class KindFacts:
    """What the rest of the package asks of a layer kind, stated once on its spec class
    (class attributes and properties, never type tests elsewhere). The defaults here are
    overridden where a kind differs; a new kind states its own facts and registers its
    manager in ``hybridkv.managers.MANAGER_FOR_SPEC``.

    >>> [(s.kind, s.is_full_attention, s.prefix_cacheable, s.vllm_kind) for s in
    ...  (FullAttentionSpec(4, 1), RingBufferSpec(8, 4), RecurrentStateSpec(4, 8))]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('full_attention', True, True, 'full_attention'), ('ring_buffer', False, False, 'unknown'),
     ('recurrent_state', False, True, 'mamba')]
    """

    __slots__ = ()
    kind: ClassVar[str]
    vllm_kind: ClassVar[str] = "unknown"
    """vLLM 0.33's ``KVCacheSpecKind`` value of the spec vLLM uses for this kind (KV events;
    DeepSeek-V4's compressed KV is an ``MLAAttentionSpec``, its compressor state a
    sliding-window MLA spec)."""
    is_full_attention: ClassVar[bool] = False
    """Reads the whole prefix: a hit at ``p`` needs every block before ``p`` (full and
    compressed attention); such groups bound every hybrid hit."""
    is_attention_window: ClassVar[bool] = False
    """Sliding-window attention (``bounded-replay`` rebuilds it; not window-like state)."""
    prefix_cacheable: ClassVar[bool] = True
    """Takes part in prefix caching (vLLM's ``prefix_cacheable``): all but V4.1's ring."""
    packs_block_outermost: ClassVar[bool] = False
    """Planned with vLLM 0.33's block-outermost packing (``hybridkv.packing``)."""
    flops_role: ClassVar[Literal["chain", "points"] | None] = None
    """What ``flops`` eviction reads a group of this kind as: ``chain`` (full attention,
    the chain its hit points lie on), ``points`` (recurrent checkpoints: the hit points);
    ``None``: a model with such a group cannot use ``flops``."""

    @property
    def window_tokens(self) -> int | None:
        """The sliding window ``w`` of a window kind (window-like state included);
        ``None`` for every other kind."""
        return None

    @property
    def num_tail_blocks(self) -> int:
        """Contiguous blocks a hit at a block boundary needs in a window kind; 0 for the
        kinds without a window."""
        return 0

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens whose KV no later token reads once ``num_computed_tokens`` are computed:
        none by default (full attention never releases KV while a request runs; V4.1's
        ring is rewritten in place)."""
        del num_computed_tokens
        return 0

    def packing_key(self) -> tuple[object, ...]:
        """Layers with equal keys may share a block-outermost packed group: equal block
        size and slot needs (the kind's tag first: ``full``, ``window``, ``chunked``,
        ``ring``). ``ConfigError`` for a kind without a packing rule."""
        raise ConfigError("layer_specs", type(self).__name__,
                          "has no block-outermost packing rule")


class PagedKV(KindFacts):
    """Kinds whose block holds ``block_size`` tokens of ``kv_bytes_per_token`` bytes each
    (a page of ``block_size * kv_bytes_per_token`` bytes, before padding to the pool's)."""

    __slots__ = ()
    block_size: int
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("kv_bytes_per_token", self.kv_bytes_per_token)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (before padding to the pool's page).

        >>> FullAttentionSpec(block_size=16, kv_bytes_per_token=4096).page_bytes
        65536
        """
        return self.block_size * self.kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(PagedKV):
    """A layer that attends to every earlier token: a hit needs the whole prefix."""

    block_size: int
    kv_bytes_per_token: int
    kind: ClassVar[str] = "full_attention"
    vllm_kind: ClassVar[str] = "full_attention"
    is_full_attention: ClassVar[bool] = True
    flops_role: ClassVar[Literal["chain", "points"] | None] = "chain"

    def packing_key(self) -> tuple[object, ...]:
        """Full-attention kinds of one block size pack together, whatever their page.

        >>> CompressedAttentionSpec(256, tokens_per_state=128, entry_bytes=584).packing_key()
        ('full', 256)
        """
        return ("full", self.block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(PagedKV):
    """A layer whose token ``p`` attends to ``[p - (w - 1), p]`` (the window includes itself)."""

    block_size: int
    kv_bytes_per_token: int
    sliding_window: int
    kind: ClassVar[str] = "sliding_window"
    vllm_kind: ClassVar[str] = "sliding_window"
    is_attention_window: ClassVar[bool] = True

    @property
    def window_tokens(self) -> int | None:
        return self.sliding_window

    def packing_key(self) -> tuple[object, ...]:
        return ("window", self.block_size, self.sliding_window)

    def __post_init__(self) -> None:
        PagedKV.__post_init__(self)
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
class ChunkedLocalSpec(PagedKV):
    """A layer attending only within its chunk of ``attention_chunk_size`` tokens (Llama 4)."""

    block_size: int
    kv_bytes_per_token: int
    attention_chunk_size: int
    kind: ClassVar[str] = "chunked_local"
    vllm_kind: ClassVar[str] = "chunked_local_attention"

    def packing_key(self) -> tuple[object, ...]:
        return ("chunked", self.block_size, self.attention_chunk_size)

    def __post_init__(self) -> None:
        PagedKV.__post_init__(self)
        _require_positive("attention_chunk_size", self.attention_chunk_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of completed chunks: ``(n // chunk) * chunk``."""
        chunk = self.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``.

    >>> round_up(37376, 576), round_up(8192, 576)
    (37440, 8640)
    """
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class CompressedAttentionSpec(FullAttentionSpec):
    """DeepSeek-V4 compressed attention: one stored entry per ``tokens_per_state`` tokens.

    A block of ``block_size`` tokens holds ``block_size // r`` entries of ``entry_bytes``,
    padded to ``page_alignment_bytes``. It reads the whole prefix (a full-attention kind:
    a hit at ``p`` needs every block before ``p``; table index ``i`` holds the entries of
    tokens ``[i * bs, (i + 1) * bs)``, entry ``j`` of that block compressing tokens
    ``[i * bs + j * r, i * bs + (j + 1) * r)``). ``role`` is ``"kv"`` (the compressed
    latent, vLLM's sparse cache) or ``"indexer"`` (the lightning indexer's keys).
    ``kv_bytes_per_token`` is derived: the padded page spread over the block's tokens.

    V4 C4 layer, fp8_ds_mla (vLLM 0.33 ``MLAAttentionSpec(tokens_per_state=4)``):

    >>> c4 = CompressedAttentionSpec(256, tokens_per_state=4, entry_bytes=584,
    ...                              page_alignment_bytes=576)
    >>> c4.entries_per_block, c4.page_bytes, c4.kv_bytes_per_token
    (64, 37440, 147)
    >>> CompressedAttentionSpec(256, tokens_per_state=128, entry_bytes=584,
    ...                         page_alignment_bytes=576).page_bytes   # 2 * 584 → 1728
    1728
    """

    kv_bytes_per_token: int = field(init=False, repr=False)
    tokens_per_state: int = 1
    entry_bytes: int = 1
    page_alignment_bytes: int = 1
    role: Literal["kv", "indexer"] = "kv"
    kind: ClassVar[str] = "compressed_attention"
    vllm_kind: ClassVar[str] = "mla_attention"
    flops_role: ClassVar[Literal["chain", "points"] | None] = None
    packs_block_outermost: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("tokens_per_state", self.tokens_per_state)
        _require_positive("entry_bytes", self.entry_bytes)
        _require_positive("page_alignment_bytes", self.page_alignment_bytes)
        if self.block_size % self.tokens_per_state:
            raise ConfigError("block_size", self.block_size,
                              f"must be a multiple of tokens_per_state={self.tokens_per_state}")
        if self.role not in ("kv", "indexer"):
            raise ConfigError("role", self.role, "choose 'kv' or 'indexer'")
        object.__setattr__(self, "kv_bytes_per_token", -(-self.page_bytes // self.block_size))

    @property
    def entries_per_block(self) -> int:
        return self.block_size // self.tokens_per_state

    @property
    def page_bytes(self) -> int:
        return round_up(self.entries_per_block * self.entry_bytes, self.page_alignment_bytes)


@dataclass(frozen=True, slots=True)
class PaddedWindowSpec(SlidingWindowSpec):
    """Window semantics with a page padded to ``page_alignment_bytes``, packed
    block-outermost (vLLM 0.33's DeepSeek-V4 layout): the shared page math of the V4 window
    branch and the compressor state.

    >>> PaddedWindowSpec(4, 10, 8, page_alignment_bytes=16).page_bytes  # 40 → 48
    48
    """

    page_alignment_bytes: int = 1
    kind: ClassVar[str] = "padded_window"
    packs_block_outermost: ClassVar[bool] = True

    def __post_init__(self) -> None:
        SlidingWindowSpec.__post_init__(self)
        _require_positive("page_alignment_bytes", self.page_alignment_bytes)

    @property
    def page_bytes(self) -> int:
        return round_up(self.block_size * self.kv_bytes_per_token, self.page_alignment_bytes)


@dataclass(frozen=True, slots=True)
class SlidingWindowMLASpec(PaddedWindowSpec):
    """DeepSeek-V4's sliding-window branch (every layer, MTP included): window semantics of
    ``SlidingWindowSpec`` plus a padded page (V4.1's ``swa_bounded_replay`` is the
    ``bounded-replay`` retention policy, not a spec field).

    >>> SlidingWindowMLASpec(64, 584, 128, page_alignment_bytes=576).page_bytes  # 64 * 584
    37440
    """

    kind: ClassVar[str] = "sliding_window_mla"
    vllm_kind: ClassVar[str] = "sliding_window_mla"


@dataclass(frozen=True, slots=True)
class CompressorStateSpec(PaddedWindowSpec):
    """DeepSeek-V4 compressor residual state (fp32 kv + score rows of the tokens not yet
    folded into an entry): window-like, ``kv_bytes_per_token`` state bytes per token.
    C4 (overlapping): window 2 * 4 = 8, block 4; C128: window 128, block 8 (vLLM 0.33 fixes
    the block sizes so the state pages share the KV pages' tensor).

    >>> c4 = CompressorStateSpec(4, 2 * 2 * 512 * 4, 8, page_alignment_bytes=576)
    >>> c4.num_tail_blocks, c4.page_bytes          # ceil(7 / 4); 4 * 8192 → 32832
    (2, 32832)
    """

    kind: ClassVar[str] = "compressor_state"
    vllm_kind: ClassVar[str] = "sliding_window_mla"
    is_attention_window: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class RingBufferSpec(PagedKV):
    """DeepSeek-V4.1 compressor state: one ring block per request (vLLM 0.33's
    ``CircularBufferSpec``) holding the raw rows of the token group being compressed.
    Never prefix-cached: a request claims its ring at admission and frees it at the end.
    ``block_size`` is the ring capacity in tokens; ``kv_bytes_per_token`` its row bytes.

    >>> RingBufferSpec(block_size=8, kv_bytes_per_token=4096).page_bytes
    32768
    """

    block_size: int
    kv_bytes_per_token: int
    kind: ClassVar[str] = "ring_buffer"
    packs_block_outermost: ClassVar[bool] = True
    prefix_cacheable: ClassVar[bool] = False

    def packing_key(self) -> tuple[object, ...]:
        return ("ring", self.block_size)


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec(KindFacts):
    """A layer with a fixed-size recurrent state (Mamba, Mamba-2 SSD, Gated DeltaNet, KDA).

    A prefix hit at token ``p`` needs the layer's state *exactly after* ``p`` tokens: one
    *checkpoint* (conv state + SSM state), whatever ``p`` is. One block holds one checkpoint
    (vLLM 0.33 ``mamba_cache_mode="align"``); the block table maps positions to checkpoints:
    table index ``i`` holds the state after ``(i + 1) * block_size`` tokens, or the null
    block when no checkpoint is kept there (``docs/recurrent.md``).

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
    vllm_kind: ClassVar[str] = "mamba"
    flops_role: ClassVar[Literal["chain", "points"] | None] = "points"

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


LayerSpec = (FullAttentionSpec | SlidingWindowSpec | ChunkedLocalSpec | RecurrentStateSpec
             | CompressedAttentionSpec | SlidingWindowMLASpec | CompressorStateSpec
             | RingBufferSpec)
"""Any layer spec (a "layer" is one cache of a model layer: a V4 layer has up to five)."""


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """Layers that share one block table; ``layer_ids`` may be shorter than the group size
    for the last group of a type (vLLM pads it; the padding still costs memory)."""

    group_id: GroupId
    spec: LayerSpec
    layer_ids: tuple[int, ...]
    layer_specs: tuple[LayerSpec, ...] = ()
    """Per-member specs of a block-outermost packed group (``hybridkv.packing``): members
    share ``spec``'s kind and block size but may differ in page bytes. Empty: every member
    is ``spec`` (uniform-page planning)."""
