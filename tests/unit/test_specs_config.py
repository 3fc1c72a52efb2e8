"""Layer specs (window arithmetic, §2.4/§2.5/§3.1), group planning and CacheConfig validation."""

from __future__ import annotations

import pytest

from hybridkv import (
    CacheConfig,
    ChunkedLocalSpec,
    ConfigError,
    FullAttentionSpec,
    SlidingWindowSpec,
    kv_bytes_per_token,
    plan_cache_groups,
)


@pytest.mark.parametrize(("block_size", "window", "need"), [
    (2, 4, 2), (8, 8, 1), (16, 32, 2), (16, 64, 4), (16, 1024, 64),
    (64, 128, 2),  # DSV4 SWA
    (4, 8, 2),  # DSV4 C4
    (8, 128, 16),  # DSV4 C128
    (4, 13, 3),
    (8, 9, 1), (8, 2, 1),
])
def test_num_tail_blocks_is_ceil_w_minus_1_over_bs(block_size: int, window: int,
                                                   need: int) -> None:
    """§3.1: a hit at p needs the KV of [p - (w - 1), p)."""
    assert SlidingWindowSpec(block_size, 1, window).num_tail_blocks == need


@pytest.mark.parametrize(("computed", "skipped"), [(0, 0), (3, 0), (4, 1), (5, 2), (7, 4),
                                                   (11, 8)])
def test_sliding_window_skipped_tokens(computed: int, skipped: int) -> None:
    """§2.4: max(0, n - w + 1) with w = 4 (e.g. n = 7 → 4)."""
    assert SlidingWindowSpec(2, 1, 4).num_skipped_tokens(computed) == skipped


@pytest.mark.parametrize(("computed", "skipped"), [(0, 0), (7, 0), (8, 8), (13, 8), (16, 16)])
def test_chunked_local_skipped_tokens(computed: int, skipped: int) -> None:
    """§2.5: (n // chunk) * chunk with chunk 8."""
    assert ChunkedLocalSpec(4, 1, 8).num_skipped_tokens(computed) == skipped


def test_full_attention_never_skips() -> None:
    assert FullAttentionSpec(16, 1).num_skipped_tokens(10**6) == 0


def test_kv_bytes_per_token() -> None:
    assert kv_bytes_per_token(8, 128, 2) == 4096
    with pytest.raises(ConfigError, match="head_dim=0 is invalid: must be a positive integer"):
        kv_bytes_per_token(8, 0, 2)


@pytest.mark.parametrize(("factory", "field", "value"), [
    (lambda: FullAttentionSpec(0, 1), "block_size", 0),
    (lambda: FullAttentionSpec(16, -4), "kv_bytes_per_token", -4),
    (lambda: FullAttentionSpec(True, 1), "block_size", True),
    (lambda: SlidingWindowSpec(16, 1, 0), "sliding_window", 0),
    (lambda: ChunkedLocalSpec(16, 1, -8), "attention_chunk_size", -8),
])
def test_spec_validation_names_field_value_and_fix(factory: object, field: str,
                                                    value: object) -> None:
    with pytest.raises(ConfigError) as info:
        factory()  # type: ignore[operator]
    err = info.value
    assert err.field == field and err.value == value
    assert str(err) == f"{field}={value!r} is invalid: must be a positive integer"


def test_specs_are_frozen_and_hashable() -> None:
    spec = SlidingWindowSpec(16, 1, 32)
    assert spec == SlidingWindowSpec(16, 1, 32)
    assert len({spec, SlidingWindowSpec(16, 1, 32), SlidingWindowSpec(16, 1, 64)}) == 2
    with pytest.raises(AttributeError):
        spec.block_size = 8  # type: ignore[misc]


def test_plan_groups_gemma3_like() -> None:
    """8 full + 40 SWA layers: groups of 8 → 1 full group and 5 SWA groups, full first."""
    full = FullAttentionSpec(16, 1024)
    swa = SlidingWindowSpec(16, 1024, 1024)
    groups = plan_cache_groups([swa] * 20 + [full] * 8 + [swa] * 20)
    assert [g.spec.kind for g in groups] == ["full_attention"] + ["sliding_window"] * 5
    assert [g.group_id for g in groups] == list(range(6))
    assert groups[0].layer_ids == tuple(range(20, 28))
    assert {len(g.layer_ids) for g in groups} == {8}


def test_plan_groups_similar_counts_use_the_largest_group() -> None:
    """Counts 4 and 5 (5 < 1.5 × 4): group size 5, so each type forms one (padded) group."""
    full, swa = FullAttentionSpec(16, 1), SlidingWindowSpec(16, 1, 32)
    groups = plan_cache_groups([full] * 4 + [swa] * 5)
    assert [len(g.layer_ids) for g in groups] == [4, 5]


def test_plan_groups_identical_specs_share_a_group_and_distinct_specs_split() -> None:
    full = FullAttentionSpec(16, 1)
    assert len(plan_cache_groups([full] * 3)) == 1
    groups = plan_cache_groups([full, SlidingWindowSpec(16, 1, 32), SlidingWindowSpec(16, 1, 64)])
    assert [g.spec for g in groups][1:] == [SlidingWindowSpec(16, 1, 32),
                                           SlidingWindowSpec(16, 1, 64)]
    with pytest.raises(ConfigError, match="layer_specs=\\[\\] is invalid"):
        plan_cache_groups([])


def test_alignment_hash_block_size_and_bytes_per_block() -> None:
    full = FullAttentionSpec(256, 10)
    swa = SlidingWindowSpec(64, 4, 128)
    c4 = SlidingWindowSpec(4, 2, 8)
    config = CacheConfig.from_layers([full, swa, c4], 10)
    assert config.alignment_tokens == 256  # lcm
    assert config.hash_block_size == 4  # gcd
    assert config.layers_per_group == 1
    assert config.bytes_per_block == 256 * 10
    mixed = CacheConfig.from_layers([FullAttentionSpec(32, 1), SlidingWindowSpec(48, 1, 8)], 4)
    assert (mixed.alignment_tokens, mixed.hash_block_size) == (96, 16)


@pytest.mark.parametrize(("kwargs", "field", "fix"), [
    ({"num_blocks": 1}, "num_blocks", "block 0 is the reserved null block"),
    ({"num_blocks": 2.5}, "num_blocks", "must be an integer >= 2"),
    ({"hash_algo": "md5"}, "hash_algo", "choose 'sha256' or 'xxhash'"),
    ({"eagle_group_ids": (2,)}, "eagle_group_ids", "group ids must be in [0, 2)"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens", "must be a positive"),
    ({"max_model_len": 0}, "max_model_len", "must be positive or None"),
])
def test_cache_config_validation(kwargs: dict[str, object], field: str, fix: str) -> None:
    options: dict[str, object] = {"num_blocks": 10, **kwargs}
    num_blocks = options.pop("num_blocks")
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_layers([FullAttentionSpec(16, 1), SlidingWindowSpec(16, 1, 32)],
                                num_blocks, **options)  # type: ignore[arg-type]
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}={info.value.value!r} is invalid: ")
    assert fix in str(info.value)


def test_cache_config_without_groups_is_rejected() -> None:
    with pytest.raises(ConfigError, match="plan at least one cache group"):
        CacheConfig((), 10)


def test_config_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        CacheConfig.from_layers([FullAttentionSpec(16, 1)], 0)
