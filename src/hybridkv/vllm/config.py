"""vLLM 0.33's ``KVCacheConfig`` and scheduler settings → hybridkv's ``CacheConfig``.

Groups keep vLLM's order (group ``g`` of vLLM is group ``g`` here), block sizes and page
bytes; the hash unit is vLLM's ``hash_block_size`` (hybridkv is then fed vLLM's own
``request.block_hashes``); block 0 is the null block in both. Anything hybridkv cannot
represent exactly raises ``UnsupportedFeature`` with one line naming it.

Worked example: Gemma-3-like, one full group and one sliding-window group (window 128),
16-token blocks, 1,000 blocks: ``CacheConfig(groups=(full(16), sliding_window(16, w=128)),
num_blocks=1000, max_model_len=..., max_num_batched_tokens=<max_in_flight_tokens>)``, and
the default policy follows vLLM's ``prefix_cache_retention_interval`` (None → ``prepend``,
0 → ``latest``, N → ``interval:N``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hybridkv.config import CacheConfig
from hybridkv.ids import GroupId
from hybridkv.specs import (
    CacheGroup,
    ChunkedLocalSpec,
    FullAttentionSpec,
    LayerSpec,
    SlidingWindowSpec,
)


class UnsupportedFeature(NotImplementedError):
    """A vLLM feature the hybridkv facade refuses rather than answer wrongly."""

    def __init__(self, feature: str) -> None:
        super().__init__(f"hybridkv's vLLM KV-cache manager does not support {feature}")


class UnsupportedInternal(UnsupportedFeature, AttributeError):
    """A read of a vLLM manager internal the facade's shims do not model (an
    ``AttributeError`` too, so ``getattr(obj, name, default)`` probes still work)."""

    def __init__(self, owner: str, name: str) -> None:
        super().__init__(f"vLLM internals ({owner}.{name})")


def policy_from_retention_interval(interval: int | None) -> str:
    """vLLM's ``prefix_cache_retention_interval`` → the hybridkv policy that behaves the same.

    >>> [policy_from_retention_interval(i) for i in (None, 0, 32768)]
    ['prepend', 'latest', 'interval:32768']
    """
    if interval is None:
        return "prepend"
    return "latest" if interval == 0 else f"interval:{interval}"


def layer_spec_from_vllm(spec: Any) -> LayerSpec:
    """One vLLM 0.33 KV-cache spec as the hybridkv spec with the same shape.

    Full attention (also MLA, and full attention carrying a window when vLLM's hybrid
    manager is off: vLLM then manages it as full), sliding window, chunked local; every
    other kind raises ``UnsupportedFeature``. Page bytes: vLLM's ``page_size_bytes``.
    """
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        MambaSpec,
        SlidingWindowMLASpec,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec as VllmFull
    from vllm.v1.kv_cache_interface import SlidingWindowSpec as VllmWindow

    block_size = int(spec.block_size)
    kv_bytes = max(1, int(spec.page_size_bytes) // block_size)
    kind = type(spec).__name__
    if isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
        raise UnsupportedFeature(f"encoder-decoder / encoder-only groups ({kind})")
    if isinstance(spec, MambaSpec):
        raise UnsupportedFeature(f"Mamba / Gated DeltaNet groups ({kind}): its worker-side "
                                 "copy, zeroing and checkpoint contract is not mapped yet")
    if type(spec) is VllmFull or (kind == "MLAAttentionSpec" and \
            int(getattr(spec, "tokens_per_state", 1)) == 1):
        return FullAttentionSpec(block_size, kv_bytes)
    if type(spec) is VllmWindow:
        if int(getattr(spec, "extra_retained_tokens", 0)):
            raise UnsupportedFeature("sliding windows with extra_retained_tokens")
        return SlidingWindowSpec(block_size, kv_bytes, int(spec.sliding_window))
    if type(spec) is ChunkedLocalAttentionSpec:
        return ChunkedLocalSpec(block_size, kv_bytes, int(spec.attention_chunk_size))
    if isinstance(spec, SlidingWindowMLASpec):
        raise UnsupportedFeature(f"DeepSeek-V4 cache groups ({kind}) in the facade yet")
    raise UnsupportedFeature(f"KV-cache spec {kind}")


@dataclass(frozen=True, slots=True)
class VllmCacheSettings:
    """The scheduler settings vLLM passes its ``KVCacheManager`` that shape the cache."""

    max_model_len: int
    scheduler_block_size: int
    hash_block_size: int
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    use_eagle: bool = False
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0


def cache_config_from_vllm(kv_cache_config: Any, settings: VllmCacheSettings) -> CacheConfig:
    """hybridkv's ``CacheConfig`` for vLLM's ``KVCacheConfig`` and scheduler settings.

    EAGLE: vLLM's lookahead hashes (``num_hash_lookahead_tokens = L > 0``) map to
    ``use_eagle`` with ``eagle_lookahead_tokens = L``; vLLM's drop mode (``use_eagle``)
    to ``eagle_block_drop`` with vLLM's ``is_eagle_group`` flags.
    """
    groups = tuple(
        CacheGroup(GroupId(i), layer_spec_from_vllm(g.kv_cache_spec),
                   tuple(range(len(g.layer_names))))
        for i, g in enumerate(kv_cache_config.kv_cache_groups))
    sizes = [g.spec.block_size for g in groups]
    if math.lcm(*sizes) != settings.scheduler_block_size:
        raise UnsupportedFeature(f"scheduler_block_size {settings.scheduler_block_size} "
                                 f"other than the lcm of the group block sizes {sizes}")
    lookahead = settings.num_hash_lookahead_tokens
    eagle_ids = tuple(i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                      if getattr(g, "is_eagle_group", False))
    unit = settings.hash_block_size
    return CacheConfig(
        groups, int(kv_cache_config.num_blocks),
        enable_caching=settings.enable_caching,
        use_eagle=lookahead > 0 or settings.use_eagle,
        eagle_lookahead_tokens=max(1, lookahead),
        eagle_block_drop=settings.use_eagle and lookahead == 0,
        eagle_group_ids=(eagle_ids or None) if settings.use_eagle else None,
        max_num_batched_tokens=settings.max_in_flight_tokens or settings.max_model_len,
        max_model_len=settings.max_model_len,
        prefix_match_unit=None if unit == math.gcd(*sizes) else unit,
    )
