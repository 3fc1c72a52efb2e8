"""A wrong hit must be caught: by the logit comparison, or by the null-block safety net.

Each test corrupts the block tables the engine reads (monkeypatching the public
``KVCacheManager.get_block_ids``) only where a request's prefix hit lies, so requests that
hit nothing run correctly and the damage reaches the outputs only through cached KV.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from hybridkv import InvariantViolation, KVCacheManager
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, gemma3_pattern
from hybridkv.engine.synthetic import make_engine_workload
from hybridkv.engine.verify import VerifyReport, VerifySettings, run_verify
from hybridkv.errors import EquivalenceError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

BLOCK = 8
WINDOW = 13  # two tail blocks of 8: a hit's window table ends in two non-null blocks
TableEdit = Callable[[list[int], int], None]
"""Edits one group's table in place, given the request's hit length in blocks."""


class HitLog(dict[str, int]):
    """Per request, its latest admission's hit length (tokens); ``ever`` keeps the longest
    hit seen across every run of the test (runs reuse request ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.ever: dict[str, int] = {}


@pytest.fixture
def hit_lengths(monkeypatch: pytest.MonkeyPatch, pure_python: None) -> Iterator[HitLog]:
    log = HitLog()
    original = KVCacheManager.find_longest_hit

    def find_longest_hit(self: KVCacheManager, req_id: str,
                         max_num_tokens: int | None = None):  # type: ignore[no-untyped-def]
        hit = original(self, req_id, max_num_tokens)
        log[req_id] = hit.num_tokens
        log.ever[req_id] = max(log.ever.get(req_id, 0), hit.num_tokens)
        return hit

    monkeypatch.setattr(KVCacheManager, "find_longest_hit", find_longest_hit)
    yield log


def _corrupt(monkeypatch: pytest.MonkeyPatch, hits: HitLog, group_id: int,
             edit: TableEdit) -> None:
    original = KVCacheManager.get_block_ids

    def get_block_ids(self: KVCacheManager, req_id: str) -> tuple[tuple[int, ...], ...]:
        tables = [list(t) for t in original(self, req_id)]
        if self.config.enable_caching and hits.get(req_id, 0):
            edit(tables[group_id], hits[req_id] // self.config.groups[group_id].spec.block_size)
        return tuple(tuple(t) for t in tables)

    monkeypatch.setattr(KVCacheManager, "get_block_ids", get_block_ids)


def _run(policies: tuple[str, ...] = ("dense", "latest")) -> VerifyReport:
    config = ModelConfig.tiny(layer_types=gemma3_pattern(4, period=4), sliding_window=WINDOW)
    model = HybridDecoder(config, dtype=torch.float64, seed=1)
    workload = make_engine_workload("mixed", alignment_tokens=BLOCK, seed=1)
    return run_verify(model, workload, policies=policies,
                      settings=VerifySettings(block_size=BLOCK, num_blocks=400))


def _window_group() -> int:
    config = ModelConfig.tiny(layer_types=gemma3_pattern(4, period=4), sliding_window=WINDOW)
    kinds = [config.layer_types[i] for i in range(config.num_layers)]
    return 1 if kinds[-1] == "full_attention" else 0  # full attention is planned first


def test_correct_tables_pass(hit_lengths: HitLog) -> None:
    report = _run()
    assert report.ok
    assert any(hit_lengths.values())


def swap_last_two_hit_blocks(table: list[int], num_hit_blocks: int) -> None:
    """The window's two tail blocks trade places (both real blocks, nothing null)."""
    if num_hit_blocks >= 2 and table[num_hit_blocks - 2] and table[num_hit_blocks - 1]:
        table[num_hit_blocks - 2], table[num_hit_blocks - 1] = \
            table[num_hit_blocks - 1], table[num_hit_blocks - 2]


def shift_hit_blocks_by_one(table: list[int], num_hit_blocks: int) -> None:
    """Every hit block moves one slot right: the window reads KV one block too late, and
    the slot before the tail becomes null."""
    hit = table[:num_hit_blocks]
    table[1:num_hit_blocks] = hit[:-1]


def _assert_divergence_named(report: VerifyReport, hits: HitLog) -> None:
    assert not report.ok
    error = report.first_divergence()
    assert isinstance(error, EquivalenceError)
    assert error.policy in ("dense", "latest")
    assert hits.ever.get(error.req_id, 0) > 0  # only requests with a hit can go wrong
    assert error.position >= hits.ever[error.req_id]  # at or after the prompt end
    with pytest.raises(EquivalenceError, match=r"policy='(dense|latest)' request="):
        report.raise_on_divergence()


def test_swapped_window_blocks_diverge(monkeypatch: pytest.MonkeyPatch,
                                       hit_lengths: HitLog) -> None:
    """Wrong-but-written KV (no NaN, no null block): only the comparison can see it."""
    _corrupt(monkeypatch, hit_lengths, _window_group(), swap_last_two_hit_blocks)
    _assert_divergence_named(_run(), hit_lengths)


def test_shifted_window_table_is_caught(monkeypatch: pytest.MonkeyPatch,
                                        hit_lengths: HitLog) -> None:
    _corrupt(monkeypatch, hit_lengths, _window_group(), shift_hit_blocks_by_one)
    with pytest.raises(InvariantViolation, match="null block"):
        _run()


def test_swapped_full_attention_blocks_are_harmless(monkeypatch: pytest.MonkeyPatch,
                                                    hit_lengths: HitLog) -> None:
    """Swapping two hit blocks that every later query sees in full is *not* an error:
    keys carry their rotary position, and attention sums over keys in any order."""
    def swap_first_two(table: list[int], num_hit_blocks: int) -> None:
        if num_hit_blocks >= 2:
            table[0], table[1] = table[1], table[0]

    _corrupt(monkeypatch, hit_lengths, 0, swap_first_two)
    assert _run().ok


def test_duplicated_full_attention_block_is_detected(monkeypatch: pytest.MonkeyPatch,
                                                     hit_lengths: HitLog) -> None:
    def read_block_zero_twice(table: list[int], num_hit_blocks: int) -> None:
        if num_hit_blocks >= 2:
            table[1] = table[0]

    _corrupt(monkeypatch, hit_lengths, 0, read_block_zero_twice)
    report = _run()
    assert not report.ok
    assert all(not o.identical for o in report.outcomes)


def test_null_block_where_kv_is_needed_raises(monkeypatch: pytest.MonkeyPatch,
                                              hit_lengths: HitLog) -> None:
    def drop_last_hit_block(table: list[int], num_hit_blocks: int) -> None:
        table[num_hit_blocks - 1] = 0

    _corrupt(monkeypatch, hit_lengths, _window_group(), drop_last_hit_block)
    with pytest.raises(InvariantViolation, match=r"request '.*', layer \d+ .*position \d+ is "
                                                 r"needed but maps to the null block 0"):
        _run()


def test_never_written_block_poisons_logits(monkeypatch: pytest.MonkeyPatch,
                                            hit_lengths: HitLog) -> None:
    """A hit block that nobody computed (here: the pool's last block, never handed out)
    holds the NaN poison, so the logits turn NaN and the comparison reports infinity."""
    def point_at_unwritten_block(table: list[int], num_hit_blocks: int) -> None:
        if num_hit_blocks >= 1 and table[num_hit_blocks - 1]:
            table[num_hit_blocks - 1] = 399  # num_blocks - 1

    _corrupt(monkeypatch, hit_lengths, _window_group(), point_at_unwritten_block)
    report = _run()
    _assert_divergence_named(report, hit_lengths)
    assert all(o.max_logit_diff == float("inf") for o in report.outcomes)
