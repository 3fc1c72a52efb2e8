"""Block-outermost packing: vLLM 0.33's grouping for models whose pages differ in size.

DeepSeek-V4's caches (sliding-window MLA, compressed KV, indexer keys, compressor state)
have different page sizes, and its indexer backend only supports a block-outermost layout
(``BLHNC``): one pool block id addresses a *row* holding a page of every layer of a group,
so pages need not be equal and a block costs the widest group's summed pages. vLLM 0.33
(``kv_cache_planning._get_packed_kv_cache_groups``) plans the groups like this:

1. *Buckets*: each layer joins the first bucket of its "uniform type" (same block size and
   the same slot needs: full-attention-like of any compression, or windows of one size,
   or ring buffers), else opens a new bucket; buckets keep first-seen order.
2. Inside a bucket, layers are listed per page size. A bucket is *balanced* when every
   page size has the same number of layers (one layer of each per pattern repeat).
3. The repeats per group ``R`` are the padding-minimising divisor (``approximate_gcd``)
   of the balanced buckets' layer counts, at least the largest balanced mixed-page bucket.
4. A balanced bucket splits into ``ceil(count / R)`` groups, repeats dealt round-robin;
   an unbalanced one stays whole. Window and ring buckets (when no ``R`` exists) are
   "state buckets": they split so no group is wider than the widest other group.
5. A pool block costs the widest group's summed pages.

Worked example (``deepseek-v4-flash``: 43 layers + 1 MTP, fp8_ds_mla, block 256): buckets
SWA (44 × 37,440 B), compressed (21 C4 KV × 37,440 + 21 indexer × 8,640 + 20 C128 KV
× 1,728: unbalanced), C4 compressor (21 × 32,832 + 21 indexer-compressor × 8,640:
balanced, mixed → R ≥ 21), C128 compressor (20 × 32,832). ``R`` = 22 (pads 44/21/20 by
0+1+2), so SWA splits in 2 groups of 22: five groups, a block is the compressed group's
1,002,240 B.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from hybridkv.errors import ConfigError
from hybridkv.ids import GroupId
from hybridkv.specs import CacheGroup, LayerSpec


def approximate_gcd(values: Sequence[int], lower_bound: int) -> int:
    """The ``d >= lower_bound`` minimising ``sum(ceil(x / d) * d - x)``; ties → larger d.

    >>> approximate_gcd([44, 21, 20], lower_bound=21)   # pads 0 + 1 + 2
    22
    """
    lo = max(1, lower_bound)
    hi = max(values)
    if lo > hi:
        return lo
    best, best_pad = lo, None
    for d in range(lo, hi + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:  # d grows: a tie keeps the larger d
            best, best_pad = d, pad
    return best


class _Bucket:
    __slots__ = ("by_page", "first_spec", "key", "layers")

    def __init__(self, key: Hashable, first_spec: LayerSpec) -> None:
        self.key = key
        self.first_spec = first_spec
        self.layers: list[int] = []
        self.by_page: dict[int, list[int]] = {}

    @property
    def balanced(self) -> bool:
        return len({len(ids) for ids in self.by_page.values()}) == 1

    @property
    def max_layers_per_page(self) -> int:
        return max(len(ids) for ids in self.by_page.values())

    def widest_group_bytes(self, num_groups: int) -> int:
        return sum(-(-len(ids) // num_groups) * page for page, ids in self.by_page.items())


def plan_packed_groups(layer_specs: Sequence[LayerSpec]) -> tuple[CacheGroup, ...]:
    """Cache groups of a block-outermost model, as vLLM 0.33 plans them (module docstring).

    Each group's ``spec`` is its first layer's spec (vLLM's ``first_spec`` picks the
    manager); ``layer_specs`` lists every member's spec for the page arithmetic.
    """
    buckets: list[_Bucket] = []
    index: dict[Hashable, _Bucket] = {}
    for layer_id, spec in enumerate(layer_specs):
        key = spec.packing_key()
        bucket = index.get(key)
        if bucket is None:
            bucket = index[key] = _Bucket(key, spec)
            buckets.append(bucket)
        bucket.layers.append(layer_id)
        bucket.by_page.setdefault(spec.page_bytes, []).append(layer_id)
    mixed_balanced = [b.max_layers_per_page for b in buckets
                      if b.balanced and len(b.by_page) > 1]
    min_repeats = max(mixed_balanced, default=0)
    repeats: int | None = None
    if min_repeats:
        repeats = approximate_gcd([b.max_layers_per_page for b in buckets if b.balanced],
                                  lower_bound=min_repeats)

    def num_groups_for(bucket: _Bucket) -> int:
        if bucket.balanced and repeats is not None:
            return -(-bucket.max_layers_per_page // repeats)
        return 1

    def is_state_bucket(bucket: _Bucket) -> bool:
        tag = bucket.first_spec.packing_key()[0]
        return tag == "ring" or (repeats is None and tag == "window")

    anchor = max(b.widest_group_bytes(len(b.layers) if is_state_bucket(b) else num_groups_for(b))
                 for b in buckets)
    groups: list[CacheGroup] = []
    for bucket in buckets:
        num_groups = num_groups_for(bucket)
        if anchor and is_state_bucket(bucket):
            per_block = max(anchor // bucket.first_spec.page_bytes, 1)
            num_groups = max(num_groups, -(-len(bucket.layers) // per_block))
        if num_groups == 1:
            member_lists = [bucket.layers]
        else:
            pattern = list(zip(*bucket.by_page.values(), strict=False))
            member_lists = [[layer for repeat in pattern[i::num_groups] for layer in repeat]
                            for i in range(num_groups)]
            if sum(len(m) for m in member_lists) != len(bucket.layers):
                raise ConfigError(
                    "layer_specs", f"{len(bucket.layers)} layers of {bucket.key}",
                    "cannot be packed: split buckets need one layer of each page size "
                    "per repeat (as in vLLM 0.33)")
        for members in member_lists:
            groups.append(CacheGroup(GroupId(len(groups)), layer_specs[members[0]],
                                     tuple(members),
                                     tuple(layer_specs[i] for i in members)))
    return tuple(groups)


def packed_bytes_per_block(groups: Sequence[CacheGroup]) -> int:
    """One pool block: the widest group's summed pages (block-outermost rows)."""
    return max(sum(s.page_bytes for s in g.layer_specs) for g in groups)
