"""Model-file kinds for DeepSeek-V4's caches (see ``docs/model-format.md``).

========================  ==========================================================
``compressed_attention``  ``tokens_per_state`` r, ``entry_bytes``, ``role`` kv|indexer
``sliding_window_mla``    ``window``, per-token bytes (V4's SWA branch)
``compressor_state``      ``window``, per-token state bytes (C4: 8, C128: 128)
``ring_buffer``           ring capacity = ``block_size``, per-token row bytes (V4.1)
========================  ==========================================================

All take ``page_alignment`` (bytes a page is rounded up to; default 1).

>>> v4_spec("compressed_attention", {"block_size": 256, "tokens_per_state": 4,
...         "entry_bytes": 584, "page_alignment": 576}, {}, "x", "").page_bytes
37440
"""

from __future__ import annotations

from hybridkv.errors import ConfigError
from hybridkv.specs import (
    CompressedAttentionSpec,
    CompressorStateSpec,
    LayerSpec,
    RingBufferSpec,
    SlidingWindowMLASpec,
)


def v4_spec(kind: str, merged: dict[str, object], table: dict[str, object], source: str,
            where: str) -> LayerSpec:
    """One spec of a V4 kind from a model-file table (``merged``: with file defaults)."""
    from hybridkv.models.shapes import _kv_bytes, _positive_int

    def need(key: str) -> int:
        return _positive_int(merged.get(key), source, where + key)

    allowed = {"compressed_attention": {"tokens_per_state", "entry_bytes", "role"},
               "sliding_window_mla": {"window"}, "compressor_state": {"window"},
               "ring_buffer": set()}[kind] | {"page_alignment"}
    for key in ("tokens_per_state", "entry_bytes", "role", "window", "chunk"):
        if key in table and key not in allowed:
            raise ConfigError(f"{source}: {where}{key}", table[key],
                              f"{kind} layers do not take {key!r}")
    block_size = need("block_size")
    align = _positive_int(merged.get("page_alignment", 1), source, where + "page_alignment")
    if kind == "compressed_attention":
        role = merged.get("role", "kv")
        if role not in ("kv", "indexer"):
            raise ConfigError(f"{source}: {where}role", role, "choose 'kv' or 'indexer'")
        ratio = need("tokens_per_state")
        if block_size % ratio:
            raise ConfigError(f"{source}: {where}tokens_per_state", ratio,
                              f"must divide block_size={block_size}")
        return CompressedAttentionSpec(block_size, tokens_per_state=ratio,
                                       entry_bytes=need("entry_bytes"),
                                       page_alignment_bytes=align,
                                       role="kv" if role == "kv" else "indexer")
    kv_bytes = _kv_bytes(merged, source, where)
    if kind == "ring_buffer":
        if align != 1:
            raise ConfigError(f"{source}: {where}page_alignment", align,
                              "ring_buffer pages are not padded; remove it")
        return RingBufferSpec(block_size, kv_bytes)
    window = need("window")
    if kind == "sliding_window_mla":
        return SlidingWindowMLASpec(block_size, kv_bytes, window, page_alignment_bytes=align)
    return CompressorStateSpec(block_size, kv_bytes, window, page_alignment_bytes=align)
