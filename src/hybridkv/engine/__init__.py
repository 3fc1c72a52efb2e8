"""hybridkv.engine: a reference PyTorch engine on hybridkv's paged KV cache.

Optional (``pip install hybridkv[engine]``: torch + safetensors); the core never imports it.
"""
