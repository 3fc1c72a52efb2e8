"""The kinds a model file's layer tables name, and their parsers: ONE table,
``KIND_PARSERS`` (a new kind is a new entry; ``docs/model-format.md`` lists them).

===========================================  ================================================
``full_attention``                           KV bytes (``kv_bytes_per_token`` or heads × dim
                                             × dtype), ``block_size``
``sliding_window`` / ``chunked_local``       + ``window`` / ``chunk``
``recurrent_state``                          ``state_bytes`` or a ``mixer`` and its fields
``compressed_attention``                     ``tokens_per_state`` r, ``entry_bytes``,
                                             ``role`` kv|indexer (DeepSeek-V4)
``sliding_window_mla``                       ``window``, per-token bytes (V4's SWA branch)
``compressor_state``                         ``window``, per-token state bytes (C4: 8, C128:
                                             128)
``ring_buffer``                              ring capacity = ``block_size``, per-token row
                                             bytes (V4.1)
===========================================  ================================================

The V4 kinds also take ``page_alignment`` (bytes a page is rounded up to; default 1).

>>> parse_kind({"kind": "compressed_attention", "block_size": 256, "tokens_per_state": 4,
...             "entry_bytes": 584, "page_alignment": 576}, {}, "x", "").page_bytes
37440
>>> parse_kind({"kind": "sliding_window", "window": 512}, {"block_size": 16,
...            "kv_bytes_per_token": 1024}, "x", "")
SlidingWindowSpec(block_size=16, kv_bytes_per_token=1024, sliding_window=512)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from hybridkv.errors import ConfigError
from hybridkv.recurrent import (
    gated_delta_net_state_bytes,
    mamba1_state_bytes,
    mamba2_state_bytes,
)
from hybridkv.specs import (
    ChunkedLocalSpec,
    CompressedAttentionSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    LayerSpec,
    RecurrentStateSpec,
    RingBufferSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    kv_bytes_per_token,
)

KV_KEYS: Final = ("block_size", "dtype_bytes", "num_kv_heads", "head_dim",
                   "kv_bytes_per_token")
_RECURRENT_KEYS: Final = ("mixer", "state_bytes", "num_k_heads", "num_v_heads", "head_k_dim",
                          "head_v_dim", "num_ssm_heads", "ssm_head_dim", "n_groups",
                          "state_size", "intermediate_size", "conv_kernel",
                          "conv_dtype_bytes", "ssm_dtype_bytes")
_V4_KEYS: Final = frozenset({"tokens_per_state", "entry_bytes", "page_alignment", "role"})
KIND_KEYS: Final = frozenset({"kind", "window", "chunk", *KV_KEYS, *_RECURRENT_KEYS,
                               *_V4_KEYS})
_V4_KINDS: Final = ("compressed_attention", "sliding_window_mla", "compressor_state",
                    "ring_buffer")


def _plain_spec(kind: str, merged: dict[str, object], table: dict[str, object], source: str,
                where: str) -> LayerSpec:
    """One spec of a full, sliding, chunked or recurrent kind."""
    for key in sorted(_V4_KEYS & set(table)):
        raise ConfigError(f"{source}: {where}{key}", table[key],
                          f"only {', '.join(_V4_KINDS)} layers take {key!r}")
    block_size = positive_int(merged.get("block_size"), source, where + "block_size")
    recurrent_keys = sorted(k for k in table if k in _RECURRENT_KEYS)
    if kind == "recurrent_state":
        return RecurrentStateSpec(block_size, _state_bytes(merged, source, where))
    if recurrent_keys:
        raise ConfigError(f"{source}: {where}{recurrent_keys[0]}", table[recurrent_keys[0]],
                          "only recurrent_state layers take it")
    kv_bytes = _kv_bytes(merged, source, where)
    extra = {"sliding_window": "window", "chunked_local": "chunk"}
    for other_kind, key in extra.items():
        if key in table and kind != other_kind:
            raise ConfigError(f"{source}: {where}{key}", table[key], f"only {other_kind} "
                                                                     f"layers take {key!r}")
    if kind == "sliding_window":
        window = positive_int(merged.get("window"), source, where + "window")
        return SlidingWindowSpec(block_size, kv_bytes, window)
    if kind == "chunked_local":
        chunk = positive_int(merged.get("chunk"), source, where + "chunk")
        return ChunkedLocalSpec(block_size, kv_bytes, chunk)
    return FullAttentionSpec(block_size, kv_bytes)


_MIXER_FIELDS: Final = {
    "gated_delta_net": ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
                        "conv_kernel"),
    "mamba2": ("num_ssm_heads", "ssm_head_dim", "n_groups", "state_size", "conv_kernel"),
    "mamba": ("intermediate_size", "state_size", "conv_kernel"),
}


def _state_bytes(merged: dict[str, object], source: str, where: str) -> int:
    """One layer's checkpoint bytes: ``state_bytes`` as given, or computed from a
    ``mixer``'s public config fields (``hybridkv.recurrent``)."""
    mixer = merged.get("mixer")
    if mixer is None:
        if merged.get("state_bytes") is None:
            raise ConfigError(f"{source}: {where}mixer", None,
                              f"give state_bytes or a mixer: one of {sorted(_MIXER_FIELDS)}")
        return positive_int(merged["state_bytes"], source, where + "state_bytes")
    if mixer not in _MIXER_FIELDS:
        raise ConfigError(f"{source}: {where}mixer", mixer,
                          f"choose one of {sorted(_MIXER_FIELDS)}")
    if merged.get("state_bytes") is not None:
        raise ConfigError(f"{source}: {where}state_bytes", merged["state_bytes"],
                          "give either state_bytes or a mixer, not both")
    values = {key: positive_int(merged.get(key), source, where + key)
              for key in _MIXER_FIELDS[mixer]}
    dtype = merged.get("dtype_bytes", 2)
    conv_bytes = positive_int(merged.get("conv_dtype_bytes", dtype), source,
                               where + "conv_dtype_bytes")
    ssm_bytes = positive_int(merged.get("ssm_dtype_bytes", dtype), source,
                              where + "ssm_dtype_bytes")
    if mixer == "gated_delta_net":
        return gated_delta_net_state_bytes(
            num_k_heads=values["num_k_heads"], num_v_heads=values["num_v_heads"],
            head_k_dim=values["head_k_dim"], head_v_dim=values["head_v_dim"],
            conv_kernel=values["conv_kernel"], conv_dtype_bytes=conv_bytes,
            ssm_dtype_bytes=ssm_bytes)
    if mixer == "mamba2":
        inner = merged.get("intermediate_size")
        return mamba2_state_bytes(
            num_heads=values["num_ssm_heads"], head_dim=values["ssm_head_dim"],
            n_groups=values["n_groups"], state_size=values["state_size"],
            conv_kernel=values["conv_kernel"], conv_dtype_bytes=conv_bytes,
            ssm_dtype_bytes=ssm_bytes,
            intermediate_size=None if inner is None
            else positive_int(inner, source, where + "intermediate_size"))
    return mamba1_state_bytes(
        intermediate_size=values["intermediate_size"], state_size=values["state_size"],
        conv_kernel=values["conv_kernel"], conv_dtype_bytes=conv_bytes,
        ssm_dtype_bytes=ssm_bytes)



def v4_spec(kind: str, merged: dict[str, object], table: dict[str, object], source: str,
            where: str) -> LayerSpec:
    """One spec of a V4 kind from a model-file table (``merged``: with file defaults)."""
    def need(key: str) -> int:
        return positive_int(merged.get(key), source, where + key)

    allowed = {"compressed_attention": {"tokens_per_state", "entry_bytes", "role"},
               "sliding_window_mla": {"window"}, "compressor_state": {"window"},
               "ring_buffer": set()}[kind] | {"page_alignment"}
    for key in ("tokens_per_state", "entry_bytes", "role", "window", "chunk"):
        if key in table and key not in allowed:
            raise ConfigError(f"{source}: {where}{key}", table[key],
                              f"{kind} layers do not take {key!r}")
    block_size = need("block_size")
    align = positive_int(merged.get("page_alignment", 1), source, where + "page_alignment")
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


def _kv_bytes(merged: dict[str, object], source: str, where: str) -> int:
    if merged.get("kv_bytes_per_token") is not None:
        return positive_int(merged["kv_bytes_per_token"], source, where + "kv_bytes_per_token")
    heads = positive_int(merged.get("num_kv_heads"), source, where + "num_kv_heads")
    head_dim = positive_int(merged.get("head_dim"), source, where + "head_dim")
    dtype_bytes = positive_int(merged.get("dtype_bytes"), source, where + "dtype_bytes")
    return kv_bytes_per_token(heads, head_dim, dtype_bytes)


def positive_int(value: object, source: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fix = "is missing" if value is None else "must be a positive integer"
        raise ConfigError(f"{source}: {field}", value, fix)
    return value


def reject_unknown(table: dict[str, object], allowed: frozenset[str], source: str,
                    where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{source}: {where}{unknown[0]}", table[unknown[0]],
                          f"unknown key; allowed: {sorted(allowed)}")


KindParser = Callable[[str, dict[str, object], dict[str, object], str, str], LayerSpec]
"""``(kind, merged table with the file's defaults, the table as written, source file,
where in it)`` → the layer's spec."""

KIND_PARSERS: Final[dict[str, KindParser]] = {
    "full_attention": _plain_spec, "sliding_window": _plain_spec,
    "chunked_local": _plain_spec, "recurrent_state": _plain_spec,
    "compressed_attention": v4_spec, "sliding_window_mla": v4_spec,
    "compressor_state": v4_spec, "ring_buffer": v4_spec,
}
_KINDS: Final = tuple(KIND_PARSERS)


def parse_kind(table: dict[str, object], defaults: dict[str, object], source: str,
               where: str) -> LayerSpec:
    """The spec of one layer table (``defaults``: the file's top-level keys)."""
    merged = {**defaults, **table}
    kind = merged.get("kind")
    if kind not in _KINDS:
        raise ConfigError(f"{source}: {where}kind", kind, f"choose one of {list(_KINDS)}")
    assert isinstance(kind, str)
    return KIND_PARSERS[kind](kind, merged, table, source, where)


__all__ = ["KIND_KEYS", "KIND_PARSERS", "KV_KEYS", "KindParser", "parse_kind", "positive_int",
           "reject_unknown"]
