"""CacheConfig: validated, frozen settings of one cache manager, and layer → group planning.

Layers with identical specs are grouped into *cache groups* of equal layer count, the way
vLLM plans hybrid models: one block is one page of one group and all groups share one pool.

Worked example (``gemma3-bench``): 8 full-attention and 40 sliding-window layers. The group
size is the smallest per-type layer count (8), because the largest (40) is at least 1.5x
of it; so full attention forms 1 group and sliding window ``ceil(40 / 8) = 5`` groups.

>>> from hybridkv.specs import FullAttentionSpec, SlidingWindowSpec
>>> full = FullAttentionSpec(block_size=16, kv_bytes_per_token=1024)
>>> swa = SlidingWindowSpec(block_size=16, kv_bytes_per_token=1024, sliding_window=1024)
>>> groups = plan_cache_groups([full] * 8 + [swa] * 40)
>>> [(g.spec.kind, len(g.layer_ids)) for g in groups]  # doctest: +NORMALIZE_WHITESPACE
[('full_attention', 8), ('sliding_window', 8), ('sliding_window', 8), ('sliding_window', 8),
 ('sliding_window', 8), ('sliding_window', 8)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hybridkv.errors import ConfigError
from hybridkv.ids import GroupId
from hybridkv.packing import plan_packed_groups
from hybridkv.specs import CacheGroup, LayerSpec

HashAlgo = Literal["sha256", "xxhash"]


def plan_cache_groups(layer_specs: Sequence[LayerSpec]) -> tuple[CacheGroup, ...]:
    """Group layers into cache groups of equal layer count (full attention first)."""
    if not layer_specs:
        raise ConfigError("layer_specs", [], "a model needs at least one layer")
    if any(spec.packs_block_outermost for spec in layer_specs):
        return plan_packed_groups(layer_specs)
    by_spec: dict[LayerSpec, list[int]] = {}
    for layer_id, spec in enumerate(layer_specs):
        by_spec.setdefault(spec, []).append(layer_id)
    ordered = sorted(by_spec.items(), key=lambda item: not item[0].is_full_attention)
    if len(ordered) == 1:
        spec, layer_ids = ordered[0]
        return (CacheGroup(GroupId(0), spec, tuple(layer_ids)),)
    counts = [len(layer_ids) for _, layer_ids in ordered]
    smallest, largest = min(counts), max(counts)
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[CacheGroup] = []
    for spec, layer_ids in ordered:
        for start in range(0, len(layer_ids), group_size):
            chunk = tuple(layer_ids[start : start + group_size])
            groups.append(CacheGroup(GroupId(len(groups)), spec, chunk))
    return tuple(groups)


def group_size_of(groups: Sequence[CacheGroup]) -> int:
    """Layers per group (the largest group; shorter ones are padded)."""
    return max(len(g.layer_ids) for g in groups)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Everything a ``KVCacheManager`` needs except the retention policy.

    Attributes:
        groups: cache groups, from ``plan_cache_groups``.
        num_blocks: pool size *including* the reserved null block 0.
        enable_caching: prefix caching on/off (off: every lookup misses, nothing is hashed).
        hash_algo: ``"sha256"`` (collision resistant, default) or ``"xxhash"`` (128-bit, fast).
        use_eagle: an EAGLE/MTP drafter reads the cache. Its KV at a block's last slot was
            computed from the token after the block, so by default (vLLM 0.33's default) each
            block hash also covers the ``eagle_lookahead_tokens`` tokens after the block and
            is emitted only once they exist: two copies of one block followed by different
            tokens get different hashes, and lookups need no drop.
        eagle_lookahead_tokens: tokens after a block its hash covers under EAGLE (1 for
            EAGLE / EAGLE-3 / single-module MTP, the speculative token count for
            multi-module MTP, whose last ``L - 1`` computed tokens are never cached).
        eagle_block_drop: the older EAGLE drop mode instead of lookahead hashes (vLLM with
            ``disable_lookahead_block_hashes``): lookups match one extra block and drop it.
            It can hand out a block whose drafter KV came from another next token when
            two copies of the block exist (see ``tests/unit/test_eagle_lookahead.py``).
        eagle_group_ids: the groups the drafter reads (``None``: every group), used by the
            drop mode. Groups with an identical spec share the flag when any of them has it.
        max_num_batched_tokens: tokens in flight per step; caps a window group's admission need.
        max_model_len: longest sequence; ``None`` means unbounded.
        prefix_match_unit: hash granularity finer than the groups' gcd (vLLM 0.33's
            ``prefix_match_unit``); must divide every prefix-cacheable group's block size.
            ``None``: the gcd. Sub-block hits (``ckpt:branch``) hash at it.
    """

    groups: tuple[CacheGroup, ...]
    num_blocks: int
    enable_caching: bool = True
    hash_algo: HashAlgo = "sha256"
    use_eagle: bool = False
    eagle_group_ids: tuple[int, ...] | None = None
    eagle_lookahead_tokens: int = 1
    eagle_block_drop: bool = False
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    prefix_match_unit: int | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("groups", (), "plan at least one cache group")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ConfigError(
                "num_blocks", self.num_blocks,
                "must be an integer >= 2 (block 0 is the reserved null block)",
            )
        if self.hash_algo not in ("sha256", "xxhash"):
            raise ConfigError("hash_algo", self.hash_algo, "choose 'sha256' or 'xxhash'")
        if self.eagle_group_ids is not None and any(
            not 0 <= g < len(self.groups) for g in self.eagle_group_ids
        ):
            raise ConfigError("eagle_group_ids", self.eagle_group_ids,
                              f"group ids must be in [0, {len(self.groups)})")
        if not isinstance(self.eagle_lookahead_tokens, int) or self.eagle_lookahead_tokens < 1:
            raise ConfigError("eagle_lookahead_tokens", self.eagle_lookahead_tokens,
                              "must be a positive number of tokens (1 for EAGLE)")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError("max_num_batched_tokens", self.max_num_batched_tokens,
                              "must be a positive number of tokens")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("max_model_len", self.max_model_len, "must be positive or None")
        unit = self.prefix_match_unit
        if unit is not None:
            sizes = [g.spec.block_size for g in self.groups if g.spec.prefix_cacheable]
            if isinstance(unit, bool) or not isinstance(unit, int) or unit <= 0 \
                    or any(size % unit for size in sizes):
                raise ConfigError("prefix_match_unit", unit,
                                  f"must be a positive divisor of every block size {sizes}")

    @classmethod
    def from_layers(cls, layer_specs: Sequence[LayerSpec], num_blocks: int,
                    **options: object) -> CacheConfig:
        """Plan groups from per-layer specs and build a config (options as in the fields)."""
        return cls(plan_cache_groups(layer_specs), num_blocks, **options)  # type: ignore[arg-type]

    @property
    def drops_eagle_block(self) -> bool:
        """EAGLE in drop mode: lookups peek one block past the hit and drop it."""
        return self.use_eagle and self.eagle_block_drop

    @property
    def hash_lookahead_tokens(self) -> int:
        """Tokens after each block that its hash covers (``L``; 0 without EAGLE lookahead).

        >>> from hybridkv.specs import FullAttentionSpec as F
        >>> [CacheConfig.from_layers([F(4, 1)], 8, use_eagle=e, eagle_block_drop=d)
        ...  .hash_lookahead_tokens for e, d in ((False, False), (True, False), (True, True))]
        [0, 1, 0]
        """
        if not self.use_eagle or self.eagle_block_drop or not self.enable_caching:
            return 0
        return self.eagle_lookahead_tokens

    @property
    def alignment_tokens(self) -> int:
        """Hit alignment ``S``: the lcm of the groups' block sizes.

        >>> from hybridkv.specs import FullAttentionSpec, SlidingWindowSpec
        >>> full = FullAttentionSpec(256, 1); swa = SlidingWindowSpec(64, 1, 128)
        >>> CacheConfig.from_layers([full, swa], num_blocks=10).alignment_tokens
        256
        """
        return math.lcm(*(g.spec.block_size for g in self.groups))

    @property
    def hash_block_size(self) -> int:
        """Granularity of request block hashes: the gcd of the prefix-cacheable groups'
        block sizes (all groups when none is; V4.1's ring buffers never hash)."""
        if self.prefix_match_unit is not None:
            return self.prefix_match_unit
        sizes = [g.spec.block_size for g in self.groups if g.spec.prefix_cacheable]
        return math.gcd(*(sizes or [g.spec.block_size for g in self.groups]))

    @property
    def layers_per_group(self) -> int:
        return group_size_of(self.groups)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block: the largest group page (smaller pages are padded to it);
        for block-outermost packed groups, the widest group's summed member pages."""
        if any(g.layer_specs for g in self.groups):
            return max(sum(s.page_bytes for s in g.layer_specs or (g.spec,) * len(
                g.layer_ids)) for g in self.groups)
        return self.layers_per_group * max(g.spec.page_bytes for g in self.groups)
