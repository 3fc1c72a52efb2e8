"""hybridkv.engine: a reference PyTorch engine on hybridkv's paged KV cache.

Optional (``pip install 'hybridkv[engine]'``: torch + safetensors); the core never imports
it, and importing this package imports torch only when one of the names below is used.

=====================  ==================================================================
``model_config``       ``ModelConfig``, layer patterns, matching cache specs
``model`` / ``rope``   the Gemma-3-style hybrid decoder
``weights``            Gemma-3 checkpoints (Hugging Face layout) in and out
``paged``              the paged KV pool, addressed through block tables only
``attention``          attention rules, reference and SDPA paths
``flex``               block-sparse ``flex_attention`` for long local chunks (CUDA)
``runner``             the scheduler-driven engine loop
``synthetic``          small workloads with shared prefixes
``verify``             ``hybridkv verify``: cached vs uncached equivalence
=====================  ==================================================================
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "model_config",
    "cache_config_for_model": "model_config",
    "layer_specs_for_model": "model_config",
    "HybridDecoder": "model",
    "PagedKVCache": "paged",
    "AttentionRule": "attention",
    "reference_attention": "attention",
    "sdpa_attention": "attention",
    "FlexAttention": "flex",
    "EngineRunner": "runner",
    "RunOptions": "runner",
    "load_gemma3": "weights",
    "save_gemma3": "weights",
    "run_verify": "verify",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridkv.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridkv.engine.{module}"), name)
