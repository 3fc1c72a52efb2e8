"""hybridkv inside vLLM 0.33 (``pip install 'hybridkv[vllm]'``): a drop-in KV-cache manager.

- ``HybridKVCacheManager``: vLLM's ``KVCacheManager`` surface over hybridkv's manager;
- ``HybridKVScheduler`` / ``HybridKVAsyncScheduler``: for ``--scheduler-cls``;
- ``cache_config_from_vllm``: vLLM's ``KVCacheConfig`` → hybridkv's ``CacheConfig``;
- ``hybridkv.vllm.testing``: a pytest plugin running vLLM's own scheduler tests on it.

Nothing else in hybridkv imports this package; it needs vLLM 0.33.
"""

from hybridkv.vllm.config import UnsupportedFeature, VllmCacheSettings, cache_config_from_vllm
from hybridkv.vllm.manager import HybridKVCacheManager
from hybridkv.vllm.scheduler import HybridKVAsyncScheduler, HybridKVScheduler

__all__ = ["HybridKVAsyncScheduler", "HybridKVCacheManager", "HybridKVScheduler",
           "UnsupportedFeature", "VllmCacheSettings", "cache_config_from_vllm"]
