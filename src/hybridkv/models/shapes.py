"""Model shapes from TOML: which attention kind each layer has, its block size and KV bytes.

A shape is data, not code: bundled presets live in ``models/presets/*.toml`` and users pass
their own file. The format (also in ``docs/model-format.md``)::

    name = "gemma3-27b"        # optional, default: the file stem
    description = "…"          # optional
    block_size = 16            # tokens per block, every layer unless overridden
    dtype_bytes = 2            # bytes per KV element (bf16)
    num_kv_heads = 16          # KV bytes per token per layer = 2 * heads * head_dim * dtype
    head_dim = 128             # (or give kv_bytes_per_token directly instead of these three)

    # Either runs of consecutive layers, in model order …
    [[layers]]
    kind = "sliding_window"    # "full_attention" | "sliding_window" | "chunked_local"
    count = 5                  # default 1
    window = 1024              # sliding_window only: tokens a query sees, itself included
    # chunk = 8192             # chunked_local only: attention chunk size
    # block_size, dtype_bytes, num_kv_heads, head_dim, kv_bytes_per_token: overrides

    # … or a pattern of named kinds, cycled and cut to num_layers:
    num_layers = 62
    pattern = ["local", "local", "local", "local", "local", "global"]
    [kinds.local]
    kind = "sliding_window"
    window = 1024
    [kinds.global]
    kind = "full_attention"

Unknown keys are errors. Every error is a ``ConfigError`` whose field names the file.

>>> shape = load_model("gemma3-bench")
>>> len(shape.cache_config(num_blocks=100).groups)   # 1 full + 5 window groups of 8 layers
6
>>> parse_size("1.5 KiB"), parse_size("2GB")
(1536, 2000000000)
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Final

from hybridkv.config import CacheConfig, plan_cache_groups
from hybridkv.errors import ConfigError
from hybridkv.models.kinds import KIND_KEYS, KV_KEYS, parse_kind, positive_int, reject_unknown
from hybridkv.recurrent import (
    align_hybrid_block_size,
)
from hybridkv.specs import (
    LayerSpec,
    RecurrentStateSpec,
)

PRESET_SUFFIX: Final = ".toml"

_TOP_KEYS: Final = frozenset({"name", "description", "layers", "num_layers", "pattern",
                              "kinds", "unify_block_size", *KV_KEYS})

SIZE_UNITS: Final = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE_PATTERN: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

MAX_LAYERS: Final = 1024
"""Most layers a shape may have (the largest presets have 126; a typo such as
``count = 1000000000`` would otherwise build a billion-entry list)."""

MAX_MODEL_FILE_BYTES: Final = 1 << 20
"""Largest model TOML file read (1 MiB; presets are under 2 KiB)."""

MAX_SIZE_CHARS: Final = 40
"""Longest ``--kv-memory`` text parsed."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A model's layers as cache specs, in model order.

    Attributes:
        name: preset or file name.
        layers: one spec per layer.
        description: free text (sources of the numbers).
        source: the TOML file it came from.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    description: str = ""
    source: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_specs(self) -> list[LayerSpec]:
        """The per-layer specs (a fresh list)."""
        return list(self.layers)

    def cache_config(self, num_blocks: int, **options: object) -> CacheConfig:
        """Plan cache groups and build a ``CacheConfig`` (options as its fields)."""
        return CacheConfig.from_layers(self.layers, num_blocks, **options)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block (one page of one group, padded to the largest page).

        >>> load_model("dsv4-bench").bytes_per_block   # 43 layers * 256 tokens * 576 bytes
        6340608
        """
        return CacheConfig(plan_cache_groups(self.layers), num_blocks=2).bytes_per_block


def list_presets() -> list[str]:
    """Names of the bundled presets, sorted."""
    folder = resources.files("hybridkv.models") / "presets"
    return sorted(entry.name.removesuffix(PRESET_SUFFIX) for entry in folder.iterdir()
                  if entry.name.endswith(PRESET_SUFFIX))


def load_model(name_or_path: str | Path) -> ModelShape:
    """Load a bundled preset by name, or a user ``.toml`` file by path.

    Raises:
        ConfigError: unknown preset and no such file, invalid TOML, or an invalid field.
    """
    text = str(name_or_path)
    if not text.strip():
        raise ConfigError("model", text, f"is empty; name a preset ({', '.join(list_presets())})"
                                         " or a .toml file")
    if text in list_presets():
        preset = resources.files("hybridkv.models") / "presets" / (text + PRESET_SUFFIX)
        return parse_model(preset.read_text(encoding="utf-8"), source=f"preset {text}",
                           default_name=text)
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError("model", text, f"not a bundled preset ({', '.join(list_presets())}) "
                                         "and not an existing .toml file")
    try:
        with path.open("r", encoding="utf-8-sig") as stream:
            content = stream.read(MAX_MODEL_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("model", text, f"cannot be read: {err}") from err
    if len(content) > MAX_MODEL_FILE_BYTES:
        raise ConfigError("model", text, f"is larger than {MAX_MODEL_FILE_BYTES:,} characters; "
                                         "is it a model .toml file?")
    return parse_model(content, source=str(path), default_name=path.stem)


def parse_model(text: str, *, source: str = "<string>", default_name: str = "model",
                ) -> ModelShape:
    """Parse the TOML text of a model shape (see the module docstring for the format)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: <toml>", "…", f"invalid TOML: {err}") from err
    except RecursionError:
        raise ConfigError(f"{source}: <toml>", "…", "nested too deeply") from None
    except ValueError as err:  # an integer longer than sys.get_int_max_str_digits()
        raise ConfigError(f"{source}: <toml>", "…",
                          f"unreadable value: {str(err).split(':')[0]}") from err
    reject_unknown(doc, _TOP_KEYS, source, "")
    defaults: dict[str, object] = {key: doc[key] for key in KV_KEYS if key in doc}
    has_runs, has_pattern = "layers" in doc, "pattern" in doc
    if has_runs == has_pattern:
        raise ConfigError(f"{source}: layers", None,
                          "give either [[layers]] runs or pattern + num_layers + [kinds.*]")
    layers = (_layers_from_runs(doc["layers"], defaults, source) if has_runs
              else _layers_from_pattern(doc, defaults, source))
    unify = doc.get("unify_block_size", True)
    if not isinstance(unify, bool):
        raise ConfigError(f"{source}: unify_block_size", unify, "must be true or false")
    if unify:
        layers = unify_recurrent_block_size(layers)
    name = doc.get("name", default_name)
    description = doc.get("description", "")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{source}: name", name, "must be a non-empty string")
    if not isinstance(description, str):
        raise ConfigError(f"{source}: description", description, "must be a string")
    return ModelShape(name, tuple(layers), description, source)


def _layers_from_runs(runs: object, defaults: dict[str, object], source: str,
                      ) -> list[LayerSpec]:
    if not isinstance(runs, list) or not runs:
        raise ConfigError(f"{source}: layers", runs, "must be a non-empty array of tables")
    layers: list[LayerSpec] = []
    for idx, run in enumerate(runs):
        where = f"layers[{idx}]."
        if not isinstance(run, dict):
            raise ConfigError(f"{source}: layers[{idx}]", run, "must be a table")
        reject_unknown(run, KIND_KEYS | {"count"}, source, where)
        count = positive_int(run.get("count", 1), source, where + "count")
        if len(layers) + count > MAX_LAYERS:
            raise ConfigError(f"{source}: {where}count", count,
                              f"the runs add up to more than {MAX_LAYERS} layers")
        spec = parse_kind(run, defaults, source, where)
        layers.extend([spec] * count)
    return layers


def _layers_from_pattern(doc: dict[str, object], defaults: dict[str, object], source: str,
                         ) -> list[LayerSpec]:
    num_layers = positive_int(doc.get("num_layers"), source, "num_layers")
    if num_layers > MAX_LAYERS:
        raise ConfigError(f"{source}: num_layers", num_layers, f"at most {MAX_LAYERS} layers")
    pattern, kinds = doc["pattern"], doc.get("kinds")
    if not isinstance(pattern, list) or not pattern:
        raise ConfigError(f"{source}: pattern", pattern, "must be a non-empty array of names")
    if not isinstance(kinds, dict):
        raise ConfigError(f"{source}: kinds", kinds, "define each pattern name as [kinds.<name>]")
    specs: dict[str, list[LayerSpec]] = {}
    for name in pattern:
        if not isinstance(name, str) or not isinstance(kinds.get(name), dict):
            raise ConfigError(f"{source}: pattern", name,
                              f"names a kind that is not a table; defined: {sorted(kinds)}")
        if name not in specs:
            specs[name] = _kind_specs(kinds, name, defaults, source)
    return [spec for i in range(num_layers) for spec in specs[pattern[i % len(pattern)]]]


def _kind_specs(kinds: dict[str, object], name: str, defaults: dict[str, object],
                source: str) -> list[LayerSpec]:
    """The caches of one pattern name: one spec, or with ``caches = [names]`` a model layer
    holding several caches (DeepSeek-V4: window, compressed KV, indexer, compressor state),
    each a "layer" of its own as in vLLM."""
    table = kinds[name]
    assert isinstance(table, dict)
    if "caches" not in table:
        reject_unknown(table, KIND_KEYS, source, f"kinds.{name}.")
        return [parse_kind(table, defaults, source, f"kinds.{name}.")]
    reject_unknown(table, frozenset({"caches"}), source, f"kinds.{name}.")
    caches = table["caches"]
    def single(c: object) -> bool:
        table = kinds.get(c) if isinstance(c, str) else None
        return isinstance(table, dict) and "caches" not in table

    if not isinstance(caches, list) or not caches or not all(single(c) for c in caches):
        raise ConfigError(f"{source}: kinds.{name}.caches", caches,
                          "must list names of single-cache [kinds.*] tables")
    return [spec for cache in caches for spec in _kind_specs(kinds, cache, defaults, source)]


def unify_recurrent_block_size(layers: list[LayerSpec]) -> list[LayerSpec]:
    """Give every layer of a model with recurrent layers the unified block size (vLLM's
    ``_align_hybrid_block_size``: one checkpoint fills one attention page); other models
    are returned unchanged. The given attention block size is the minimum.

    >>> from hybridkv.specs import FullAttentionSpec
    >>> out = unify_recurrent_block_size([FullAttentionSpec(16, 4096),
    ...                                   RecurrentStateSpec(16, 3_207_168)])
    >>> [spec.block_size for spec in out]
    [784, 784]
    """
    states = [s.state_bytes for s in layers if isinstance(s, RecurrentStateSpec)]
    attention = [s for s in layers if not isinstance(s, RecurrentStateSpec)]
    if not states or not attention:
        return layers
    block_size = align_hybrid_block_size(
        attn_bytes_per_token=max(s.kv_bytes_per_token for s in attention),
        state_bytes=max(states), min_block_size=max(s.block_size for s in attention))
    return [replace(spec, block_size=block_size) for spec in layers]


def parse_size(size: str | int) -> int:
    """Bytes in a size such as ``"40GiB"``, ``"1.5 TB"`` or ``"4096"`` (floored to a byte).

    Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024),
    case-insensitive.

    >>> parse_size("40GiB")
    42949672960
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 0:
            raise ConfigError("size", size, "must be >= 0 bytes")
        return size
    if isinstance(size, str) and len(size) > MAX_SIZE_CHARS:
        raise ConfigError("size", size[:MAX_SIZE_CHARS] + "…",
                          f"longer than {MAX_SIZE_CHARS} characters; write e.g. '40GiB'")
    match = _SIZE_PATTERN.match(size) if isinstance(size, str) else None
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in SIZE_UNITS:
        raise ConfigError("size", size, "write a number and a unit, e.g. '40GiB' or '512MB' "
                                        "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as err:  # pragma: no cover - the regex admits only decimals
        raise ConfigError("size", size, "not a number") from err
    return int(number * SIZE_UNITS[unit])


def num_blocks_for_memory(config_or_shape: CacheConfig | ModelShape, memory: str | int) -> int:
    """Pool size for ``memory`` bytes: ``floor(bytes / bytes_per_block)``.

    The result counts every block including the reserved null block (replay-protocol.md,
    "Pool size"), so it can be passed as ``num_blocks`` directly.

    >>> num_blocks_for_memory(load_model("gemma3-bench"), "1GiB")  # 8 * 16 * 8192 B blocks
    1024
    """
    num_bytes = parse_size(memory)
    bytes_per_block = config_or_shape.bytes_per_block
    num_blocks = num_bytes // bytes_per_block
    if num_blocks < 2:
        raise ConfigError("memory", memory, f"holds {num_blocks} blocks of {bytes_per_block} "
                                            "bytes; give at least two blocks' worth")
    return num_blocks
