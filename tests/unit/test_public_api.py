"""The public façade: ``hybridkv.__all__`` is pinned so the API cannot drift silently."""

from __future__ import annotations

import subprocess
import sys

import hybridkv

EXPECTED = [
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


def isort_key(name: str) -> tuple[int, str]:
    """ruff RUF022 order: CONSTANTS, then CamelCase, then everything else."""
    kind = 0 if name.isupper() else 1 if name[0].isupper() else 2
    return kind, name


def test_all_is_pinned_and_sorted() -> None:
    assert hybridkv.__all__ == EXPECTED
    assert hybridkv.__all__ == sorted(hybridkv.__all__, key=isort_key)


def test_every_exported_name_exists_and_public_names_are_exported() -> None:
    for name in hybridkv.__all__:
        assert hasattr(hybridkv, name), name
    public_objects = {
        name for name, value in vars(hybridkv).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("hybridkv")
    }
    assert public_objects <= set(hybridkv.__all__)


def test_core_policies_and_version() -> None:
    assert hybridkv.CORE_POLICIES == (
        "dense", "reachable", "prepend", "latest", "interval:32768", "pin:32768")
    assert hybridkv.__version__ == "0.1.0"


def test_core_import_does_not_need_torch() -> None:
    """The core is torch-free: importing hybridkv works with torch import blocked."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import hybridkv\n"
        "from hybridkv import KVCacheManager, CacheConfig, FullAttentionSpec\n"
        "m = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 4))\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.strip() == "False"
