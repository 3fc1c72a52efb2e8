"""Model shapes: bundled presets, user TOML files, sizes and pool sizing."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from hybridkv import (
    ChunkedLocalSpec,
    ConfigError,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from hybridkv.models.shapes import (
    list_presets,
    load_model,
    num_blocks_for_memory,
    parse_model,
    parse_size,
)

PRESETS = sorted(["dsv4-bench", "gemma3-1b", "gemma3-27b", "gemma3-bench", "gpt-oss-120b",
                  "jamba-v0.1", "llama4-scout", "mistral-7b", "nemotron-3-nano",
                  "nemotron-h-56b", "qwen3-next-80b", "qwen3.5-27b",
                  "deepseek-v4-flash", "deepseek-v4-pro", "deepseek-v4.1-flash"])


def group_shape(name: str) -> list[tuple[str, int]]:
    config = load_model(name).cache_config(num_blocks=16)
    return [(g.spec.kind, len(g.layer_ids)) for g in config.groups]


def test_presets_ship_inside_the_package() -> None:
    folder = resources.files("hybridkv.models") / "presets"
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith(".toml")) == [
        f"{name}.toml" for name in PRESETS]
    assert list_presets() == PRESETS


def test_gemma3_bench_has_one_full_and_five_window_groups() -> None:
    assert group_shape("gemma3-bench") == [("full_attention", 8)] + [("sliding_window", 8)] * 5
    config = load_model("gemma3-bench").cache_config(num_blocks=16)
    assert config.alignment_tokens == 16
    window = config.groups[1].spec
    assert isinstance(window, SlidingWindowSpec) and window.sliding_window == 1024


def test_dsv4_bench_has_two_groups_aligned_to_256() -> None:
    shape = load_model("dsv4-bench")
    config = shape.cache_config(num_blocks=3716)
    assert group_shape("dsv4-bench") == [("full_attention", 43), ("sliding_window", 43)]
    assert config.alignment_tokens == 256
    full, window = (g.spec for g in config.groups)
    assert isinstance(full, FullAttentionSpec) and full.block_size == 256
    assert isinstance(window, SlidingWindowSpec)
    assert (window.block_size, window.sliding_window) == (64, 128)
    # both groups have the same page, so no block is padded
    assert full.block_size * full.kv_bytes_per_token == 64 * window.kv_bytes_per_token
    assert shape.bytes_per_block == config.bytes_per_block == 43 * 256 * 576


def test_public_model_presets() -> None:
    assert group_shape("gemma3-27b") == [("full_attention", 10)] + [("sliding_window", 10)] * 5 \
        + [("sliding_window", 2)]
    assert group_shape("gemma3-1b") == [("full_attention", 4)] + [("sliding_window", 4)] * 5 \
        + [("sliding_window", 2)]
    assert group_shape("gpt-oss-120b") == [("full_attention", 18), ("sliding_window", 18)]
    assert group_shape("mistral-7b") == [("sliding_window", 32)]
    assert group_shape("llama4-scout") == [("full_attention", 12)] + [("chunked_local", 12)] * 3

    gemma = load_model("gemma3-27b").layer_specs()
    assert [i for i, s in enumerate(gemma) if s.kind == "full_attention"] == list(range(5, 62, 6))
    assert gemma[0] == SlidingWindowSpec(block_size=16, kv_bytes_per_token=8192,
                                         sliding_window=1024)
    small = load_model("gemma3-1b").layer_specs()
    assert small[0] == SlidingWindowSpec(16, 2 * 1 * 256 * 2, 512)
    oss = load_model("gpt-oss-120b").layer_specs()
    assert [s.kind for s in oss[:4]] == ["sliding_window", "full_attention"] * 2
    assert oss[0] == SlidingWindowSpec(16, 2 * 8 * 64 * 2, 128)
    scout = load_model("llama4-scout").layer_specs()
    assert all((s.kind == "full_attention") == ((i + 1) % 4 == 0) for i, s in enumerate(scout))
    assert scout[0] == ChunkedLocalSpec(16, 4096, 8192)
    assert load_model("mistral-7b").layer_specs()[0] == SlidingWindowSpec(16, 4096, 4096)


def test_cache_config_passes_options() -> None:
    config = load_model("mistral-7b").cache_config(num_blocks=10, hash_algo="xxhash")
    assert config.hash_algo == "xxhash" and config.num_blocks == 10


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [("40GiB", 40 * 2**30), ("1.5 KiB", 1536), ("2GB", 2 * 10**9), ("512", 512), ("7B", 7),
     ("1tib", 2**40), ("3 MB", 3 * 10**6), ("0.5MiB", 2**19), ("10kb", 10_000), (4096, 4096)],
)
def test_parse_size(text: str | int, num_bytes: int) -> None:
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("text", ["", "GiB", "abc", "-1GB", "1.5.2GB", "10 XB", "1e9", -5])
def test_parse_size_rejects_garbage(text: str | int) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


def test_num_blocks_for_memory() -> None:
    shape = load_model("gemma3-bench")          # 8 layers * 16 tokens * 8192 B = 1 MiB blocks
    assert num_blocks_for_memory(shape, "1GiB") == 1024
    assert num_blocks_for_memory(shape, 3 * 2**20 - 1) == 2
    config = shape.cache_config(num_blocks=16)
    assert num_blocks_for_memory(config, "40GiB") == 40 * 1024
    with pytest.raises(ConfigError, match="at least two"):
        num_blocks_for_memory(shape, "1MiB")


RUNS_TOML = """
name = "tiny"
block_size = 4
kv_bytes_per_token = 10

[[layers]]
kind = "full_attention"
count = 2

[[layers]]
kind = "sliding_window"
window = 8
count = 2
block_size = 8          # per-run override

[[layers]]
kind = "chunked_local"
chunk = 16
num_kv_heads = 1        # kv bytes from heads wins only without kv_bytes_per_token
"""

PATTERN_TOML = """
block_size = 16
dtype_bytes = 2
num_kv_heads = 2
head_dim = 8
num_layers = 5
pattern = ["a", "a", "b"]
[kinds.a]
kind = "sliding_window"
window = 32
[kinds.b]
kind = "full_attention"
"""


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_user_toml_with_runs(tmp_path: Path, bom: bytes) -> None:
    """A byte-order mark (Windows editors write one) is not part of the TOML: it read as
    ``invalid TOML: Invalid statement (at line 1, column 1)``."""
    path = tmp_path / "mine.toml"
    path.write_bytes(bom + RUNS_TOML.encode())
    shape = load_model(path)
    assert shape.name == "tiny" and shape.source == str(path) and shape.num_layers == 5
    assert shape.layer_specs() == [FullAttentionSpec(4, 10)] * 2 \
        + [SlidingWindowSpec(8, 10, 8)] * 2 + [ChunkedLocalSpec(4, 10, 16)]


def test_user_toml_with_pattern(tmp_path: Path) -> None:
    path = tmp_path / "patterned.toml"
    path.write_text(PATTERN_TOML)
    shape = load_model(str(path))
    assert shape.name == "patterned"          # default: the file stem
    swa, full = SlidingWindowSpec(16, 64, 32), FullAttentionSpec(16, 64)
    assert shape.layer_specs() == [swa, swa, full, swa, swa]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("block_size = [", "<toml>"),
        ("window_size = 3\n" + RUNS_TOML, "window_size"),
        (RUNS_TOML + "window_size = 3\n", "layers[2].window_size"),
        (RUNS_TOML.replace("window = 8\n", ""), "layers[1].window"),
        (RUNS_TOML.replace("count = 2\nblock_size = 8", "count = 0"), "layers[1].count"),
        (RUNS_TOML.replace('kind = "full_attention"', 'kind = "mamba"'), "layers[0].kind"),
        (RUNS_TOML.replace('kind = "full_attention"', 'kind = "full_attention"\nwindow = 4'),
         "layers[0].window"),
        (RUNS_TOML.replace("kv_bytes_per_token = 10", ""), "layers[0].num_kv_heads"),
        (PATTERN_TOML.replace('pattern = ["a", "a", "b"]', 'pattern = ["a", "c"]'), "pattern"),
        (PATTERN_TOML.replace("num_layers = 5", ""), "num_layers"),
        (PATTERN_TOML + '[[layers]]\nkind = "full_attention"\n', "layers"),
        ('name = 3\nkv_bytes_per_token = 1\nblock_size = 1\n[[layers]]\nkind = "full_attention"',
         "name"),
    ],
)
def test_bad_toml_names_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_model(path)
    assert info.value.field == f"{path}: {field}"
    assert str(path) in str(info.value)


def test_unknown_model_and_parse_model_default_source() -> None:
    with pytest.raises(ConfigError, match="not a bundled preset"):
        load_model("gemma-9000")
    shape = parse_model('block_size = 2\nkv_bytes_per_token = 1\n[[layers]]\nkind = '
                        '"full_attention"\n')
    assert shape.name == "model" and shape.source == "<string>"
