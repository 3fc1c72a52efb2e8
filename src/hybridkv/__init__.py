"""hybridkv: paged KV-cache management with prefix caching for hybrid-attention models."""

from __future__ import annotations

import hybridkv.native  # noqa: F401  (first: picks the compiled or pure-Python core)
from hybridkv.cache import Allocation, KVCacheManager, PrefixHit
from hybridkv.config import CacheConfig, plan_cache_groups
from hybridkv.errors import (
    CapacityError,
    ConfigError,
    DoubleFreeError,
    DuplicateRequestError,
    EquivalenceError,
    HybridKVError,
    InvariantViolation,
    RequestError,
    StaleHitError,
    TraceFormatError,
    UnknownRequestError,
)
from hybridkv.hashing import BlockHasher, ExtraKeys, MultiModalFeature
from hybridkv.policies import CORE_POLICIES, RetentionPolicy, make_retention_policy
from hybridkv.specs import (
    CacheGroup,
    ChunkedLocalSpec,
    FullAttentionSpec,
    LayerSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    kv_bytes_per_token,
)
from hybridkv.stats import PrefixCacheStats
from hybridkv.views import BlockView, CachedBlock, CacheSnapshot, GroupUsage

__version__ = "0.1.0"

__all__ = [
    "CORE_POLICIES",
    "Allocation",
    "BlockHasher",
    "BlockView",
    "CacheConfig",
    "CacheGroup",
    "CacheSnapshot",
    "CachedBlock",
    "CapacityError",
    "ChunkedLocalSpec",
    "ConfigError",
    "DoubleFreeError",
    "DuplicateRequestError",
    "EquivalenceError",
    "ExtraKeys",
    "FullAttentionSpec",
    "GroupUsage",
    "HybridKVError",
    "InvariantViolation",
    "KVCacheManager",
    "LayerSpec",
    "MultiModalFeature",
    "PrefixCacheStats",
    "PrefixHit",
    "RecurrentStateSpec",
    "RequestError",
    "RetentionPolicy",
    "SlidingWindowSpec",
    "StaleHitError",
    "TraceFormatError",
    "UnknownRequestError",
    "__version__",
    "kv_bytes_per_token",
    "make_retention_policy",
    "plan_cache_groups",
]
