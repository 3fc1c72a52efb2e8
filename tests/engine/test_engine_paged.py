"""The paged pool: addressing through block tables, the null-block safety net, sharing."""

from __future__ import annotations

import pytest

from hybridkv import InvariantViolation
from hybridkv.engine.model_config import ModelConfig, alternating_pattern, cache_config_for_model
from hybridkv.engine.paged import PagedKVCache

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine


def _pool(*, full_block_size: int | None = None, poison: bool = False) -> PagedKVCache:
    config = ModelConfig.tiny(layer_types=alternating_pattern(4), sliding_window=5)
    cache_config = cache_config_for_model(config, num_blocks=10, block_size=4, dtype_bytes=8,
                                          full_block_size=full_block_size)
    return PagedKVCache(cache_config, num_kv_heads=2, head_dim=8, dtype=torch.float64,
                        device="cpu", poison=poison)


def test_layers_map_to_group_slots() -> None:
    pool = _pool()
    assert pool.location == {1: (0, 0), 3: (0, 1), 0: (1, 0), 2: (1, 1)}
    assert pool.kv.shape == (2, 2, 10 * 4, 2, 8)  # [slot, k/v, page * page_tokens, kvh, d]


def test_slots_follow_the_table() -> None:
    pool = _pool()
    slots = pool.slots(req_id="r", group_id=0, table=(7, 2, 5), start=3, end=10)
    assert slots.tolist() == [7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4, 5 * 4 + 1]


def test_smaller_blocks_use_the_head_of_a_page() -> None:
    pool = _pool(full_block_size=8)  # window blocks of 4 inside pages of 8 tokens
    assert pool.page_tokens == 8
    assert pool.slots(req_id="r", group_id=1, table=(3, 6), start=2, end=6).tolist() == \
        [3 * 8 + 2, 3 * 8 + 3, 6 * 8, 6 * 8 + 1]


def test_write_then_read_round_trips_and_poison_marks_unwritten() -> None:
    pool = _pool(poison=True)
    slots = pool.slots(req_id="r", group_id=1, table=(4, 9), start=0, end=6)
    k = torch.randn(6, 2, 8, dtype=torch.float64)
    v = torch.randn(6, 2, 8, dtype=torch.float64)
    pool.write(0, slots, k, v)
    got_k, got_v = pool.read(0, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    other_layer_k, _ = pool.read(2, slots)  # same pages, the group's other layer: untouched
    assert torch.isnan(other_layer_k).all()


def test_null_block_in_needed_range_is_refused() -> None:
    pool = _pool()
    pool.slots(req_id="r", group_id=1, table=(0, 0, 3, 4), start=8, end=16)  # nulls skipped
    with pytest.raises(InvariantViolation, match=r"request 'r', layer 0 .*position 6 is needed "
                                                 r"but maps to the null block 0"):
        pool.slots(req_id="r", group_id=1, table=(0, 0, 3, 4), start=6, end=16)
    with pytest.raises(InvariantViolation, match="table has 2 entries"):
        pool.slots(req_id="r", group_id=0, table=(1, 2), start=0, end=9)
    with pytest.raises(InvariantViolation, match="outside"):
        pool.slots(req_id="r", group_id=0, table=(1, 10), start=0, end=8)
