"""Compressed attention (DeepSeek-V4 CSA/HCA) in float64 on the CPU: the pooling against its
definition, the paged incremental engine against the full-sequence reference."""

from __future__ import annotations

import doctest
import importlib
import random

import pytest

from hybridkv.engine.compressed import (
    CompressionRule,
    completed_entries,
    compressed_attention,
    indexer_selection,
    pool_entries,
    pool_sequence_reference,
    state_rows,
)
from hybridkv.engine.compressed_model import (
    CompressedDecoder,
    CompressedModelConfig,
    sequence_logits,
    v4_ratios,
)
from hybridkv.engine.compressed_runner import (
    CompressedCacheLayout,
    CompressedRunner,
    PagedRows,
)
from hybridkv.engine.model_config import ModelConfig
from hybridkv.engine.runner import RunOptions
from hybridkv.errors import ConfigError, InvariantViolation
from hybridkv.sched.scheduler import SchedRequest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

F64 = torch.float64


@pytest.mark.parametrize("name", ["hybridkv.engine.compressed",
                                  "hybridkv.engine.compressed_model",
                                  "hybridkv.engine.compressed_runner"])
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted >= 3 and result.failed == 0


def _rows(rule: CompressionRule, num_tokens: int, kv_heads: int, head_dim: int,
          seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = rule.halves * kv_heads * head_dim
    kv, score = (torch.randn(num_tokens, width, generator=g, dtype=F64) for _ in range(2))
    ape = torch.randn(rule.compress_ratio, width, generator=g, dtype=F64)
    return state_rows(kv, score, ape, torch.arange(num_tokens), rule)


@pytest.mark.parametrize("ratio", [2, 3, 4, 16])
def test_pooling_matches_the_definition(ratio: int) -> None:
    rule = CompressionRule(ratio, window=5)
    rows = _rows(rule, 6 * ratio + ratio // 2, kv_heads=2, head_dim=4, seed=ratio)
    reference = pool_sequence_reference(rows, rule, kv_heads=2)
    assert reference.shape == (6, 2, 4)
    assert torch.allclose(pool_entries(rows, 0, 0, 6, rule, kv_heads=2), reference,
                          rtol=0, atol=1e-15)
    # any slice of rows that covers the pooled positions gives the same entries
    for first, last in ((2, 5), (5, 6), (0, 1)):
        start, end = rule.rows_of_entry(first)[0], rule.rows_of_entry(last - 1)[1]
        got = pool_entries(rows[start:end], start, first, last, rule, kv_heads=2)
        assert torch.allclose(got, reference[first:last], rtol=0, atol=1e-15)
    with pytest.raises(ConfigError, match="pool positions"):
        pool_entries(rows[1:], 1, 0, 2, rule, kv_heads=2)


def test_equal_scores_average_the_window() -> None:
    """Worked case: with equal scores an overlapping C4 entry is the mean of 8 rows, the
    earlier chunk through its first half, its own chunk through its second."""
    rule = CompressionRule(4, window=4)
    kv = torch.arange(12 * 2, dtype=F64).reshape(12, 2)      # halves of width 1
    rows = torch.stack((kv, torch.zeros_like(kv)), dim=1)
    entries = pool_entries(rows, 0, 0, 3, rule, kv_heads=1)
    # entry 0: only its own chunk exists: rows 0..3, second half -> mean(1, 3, 5, 7)
    # entry 1: rows 0..3 first half (0, 2, 4, 6), rows 4..7 second (9, 11, 13, 15)
    # entry 2: rows 4..7 first half (8, 10, 12, 14), rows 8..11 second (17, 19, 21, 23)
    assert entries.flatten().tolist() == [4.0, 7.5, 15.5]
    # ratio 5, no overlap, one half (kv 0, 2, 4, ...): entries of rows 0..4 and 5..9
    hca = pool_entries(rows[:, :, :1], 0, 0, 2, CompressionRule(5, window=4), kv_heads=1)
    assert hca.flatten().tolist() == [4.0, 14.0]


def test_an_entry_depends_only_on_its_rows() -> None:
    rule = CompressionRule(4, window=4)
    rows = _rows(rule, 24, kv_heads=1, head_dim=4, seed=0)
    before = pool_sequence_reference(rows, rule, kv_heads=1)
    changed = rows.clone()
    changed[9] += 1.0                                 # chunk 2: read by entries 2 and 3
    after = pool_sequence_reference(changed, rule, kv_heads=1)
    moved = [j for j in range(6) if not torch.equal(before[j], after[j])]
    assert moved == [2, 3]


def test_queries_read_only_completed_entries() -> None:
    rule = CompressionRule(4, window=3)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(12, 2, 4, generator=g, dtype=F64)
    k, v = (torch.randn(12, 1, 4, generator=g, dtype=F64) for _ in range(2))
    entries = torch.randn(3, 1, 4, generator=g, dtype=F64)
    allowed = completed_entries(0, 12, 3, rule, "cpu")
    out = compressed_attention(q, k, v, entries, allowed, q_start=0, rule=rule, scale=0.5)
    bumped = entries.clone()
    bumped[1] += 1.0                                  # entry 1 = tokens 4..7
    again = compressed_attention(q, k, v, bumped, allowed, q_start=0, rule=rule, scale=0.5)
    differs = [p for p in range(12) if not torch.equal(out[p], again[p])]
    assert differs == list(range(7, 12))              # from token 7, its chunk's last


def test_indexer_keeps_the_topk_allowed_entries_ties_to_the_lower_index() -> None:
    keys = torch.tensor([[2.0], [1.0], [2.0], [-1.0], [5.0]], dtype=F64)
    q, w = torch.ones(1, 1, 1, dtype=F64), torch.ones(1, 1, dtype=F64)
    allowed = torch.tensor([[True, True, True, True, False]])
    assert indexer_selection(q, w, keys, allowed, topk=2).tolist() == [[True, False, True,
                                                                        False, False]]
    # negated query: entry 3 scores 1, the others relu to 0 and tie, lower index first
    assert indexer_selection(-q, w, keys, allowed, topk=3).tolist() == [[True, True, False,
                                                                         True, False]]
    # fewer allowed entries than topk: all of them, nothing else
    few = torch.tensor([[False, True, False, False, False]])
    assert indexer_selection(q, w, keys, few, topk=3).tolist() == few.tolist()
    # entries no query may read yet never change the choice (stable sort)
    cut = indexer_selection(q, w, keys[:4], allowed[:, :4], topk=2)
    assert cut.tolist() == [[True, False, True, False]]


# ----------------------------------------------------------------- model and paged engine
def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 40) for _ in range(n)]


def _run(model: CompressedDecoder, layout: CompressedCacheLayout,
         requests: list[SchedRequest], *, chunk: int, caching: bool, num_blocks: int = 300,
         policy: str = "latest"):  # type: ignore[no-untyped-def]
    config = layout.cache_config(num_blocks=num_blocks, enable_caching=caching,
                                 max_num_batched_tokens=chunk)
    runner = CompressedRunner(model, layout, config,
                              RunOptions(policy=policy, chunk_size=chunk, poison=True))
    return runner.run(requests)


@pytest.mark.parametrize("chunk", [1, 5, 32, 400])
def test_paged_incremental_engine_matches_the_full_sequence_reference(chunk: int) -> None:
    """Every sampled logits row (last prompt token and each decode step) equals the
    reference that pools every entry from the whole sequence at once."""
    shape = CompressedModelConfig.tiny(compress_ratios=(0, 4, 16, 4), window=6)
    model = CompressedDecoder(shape, seed=3)
    layout = CompressedCacheLayout(shape, window_block_size=4, compressed_block_size=16)
    prompts = {"a": _prompt(45, 0), "b": _prompt(33, 1)}
    result = _run(model, layout, [SchedRequest(r, p, 4) for r, p in prompts.items()],
                  chunk=chunk, caching=False)
    for req_id, prompt in prompts.items():
        record = result.records[req_id]
        sequence = prompt + record.output_token_ids[:-1]
        reference = sequence_logits(model, sequence)[len(prompt) - 1 :]
        got = torch.stack(record.sampled_logits)
        assert got.shape == reference.shape
        assert float((got - reference).abs().max()) < 1e-12
        assert record.output_token_ids == reference.argmax(dim=-1).tolist()


def test_compressed_layers_change_the_output() -> None:
    """The entries matter: the same base model without compressors gives other logits."""
    prompt = _prompt(40, 2)
    shape = CompressedModelConfig.tiny(compress_ratios=(0, 4, 16, 4))
    plain = CompressedModelConfig.tiny(compress_ratios=(0, 0, 0, 0))
    with_entries = sequence_logits(CompressedDecoder(shape, seed=0), prompt)
    model = CompressedDecoder(plain, seed=0)
    model.load_state_dict(CompressedDecoder(shape, seed=0).state_dict(), strict=False)
    without = sequence_logits(model, prompt)
    assert float((with_entries[:3] - without[:3]).abs().max()) < 1e-12   # no entry yet
    assert float((with_entries[-1] - without[-1]).abs().max()) > 1e-3


def test_converted_keeps_the_compressors_and_every_weight() -> None:
    """``converted`` builds a ``CompressedDecoder`` (not the base class) of the same shape
    and copies every weight, the compressors' and indexers' included."""
    shape = CompressedModelConfig.tiny(compress_ratios=(0, 4, 16, 4))
    model = CompressedDecoder(shape, seed=3)
    wide = model.converted(dtype=torch.float32)
    assert type(wide) is CompressedDecoder and wide.shape == shape
    assert wide.compressors.keys() == model.compressors.keys()
    prompt = _prompt(40, 2)
    got, want = sequence_logits(wide, prompt).double(), sequence_logits(model, prompt)
    assert float((got - want).abs().max()) < 1e-3
    assert float((got - sequence_logits(CompressedDecoder(shape, seed=4), prompt))
                 .abs().max()) > 1e-3  # another seed's weights: the check can fail


def test_indexer_narrows_the_entries_and_covers_all_when_topk_is_large() -> None:
    prompt = _prompt(48, 4)
    logits = {topk: sequence_logits(CompressedDecoder(
        CompressedModelConfig.tiny(index_topk=topk), seed=0), prompt) for topk in (0, 3, 99)}
    assert float((logits[99] - logits[0]).abs().max()) < 1e-12   # every entry selected
    assert float((logits[3][-1] - logits[0][-1]).abs().max()) > 1e-3
    # up to token 14 a C4 query has at most 3 completed entries: all selected
    assert float((logits[3][:15] - logits[0][:15]).abs().max()) < 1e-12


def test_prefix_hits_are_exact_and_use_every_role() -> None:
    shape = CompressedModelConfig.tiny()
    model = CompressedDecoder(shape, seed=0)
    layout = CompressedCacheLayout(shape)
    doc = _prompt(70, 5)
    requests = [SchedRequest("a", doc + _prompt(5, 6), 2),
                SchedRequest("b", doc + _prompt(9, 7), 2)]
    cold = _run(model, layout, requests, chunk=16, caching=False)
    warm = _run(model, layout, requests, chunk=16, caching=True)
    assert warm.records["b"].hit_tokens == [64]        # two 32-token compressed blocks
    for req_id in ("a", "b"):
        a, b = cold.records[req_id], warm.records[req_id]
        assert a.output_token_ids == b.output_token_ids
        assert max(float((x - y).abs().max()) for x, y in
                   zip(a.sampled_logits, b.sampled_logits, strict=True)) < 1e-12
    roles = {layer.role for layer in layout.layers}
    assert roles == {"window", "entries", "state", "indexer", "indexer_state"}


# ------------------------------------------------------------------------ config and pool
def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ConfigError, match="compress_ratios"):
        CompressedModelConfig.tiny(compress_ratios=(0, 1, 4, 4))
    base = CompressedModelConfig.tiny().base
    with pytest.raises(ConfigError, match="compress_ratios"):
        CompressedModelConfig(base, (0, 4))
    with pytest.raises(ConfigError, match="every layer of a V4-shaped model slides"):
        CompressedModelConfig(ModelConfig.tiny(), (0, 4, 4, 4))
    with pytest.raises(ConfigError, match="window-only layer"):
        CompressedModelConfig.tiny().rule(0)


def test_layout_and_pool_checks() -> None:
    shape = CompressedModelConfig.tiny()
    with pytest.raises(ConfigError, match="multiple of every compress ratio"):
        CompressedCacheLayout(shape, compressed_block_size=24)
    with pytest.raises(ConfigError, match="compress_ratio"):
        CompressionRule(1, window=4)
    layout = CompressedCacheLayout(shape)
    other = CompressedCacheLayout(CompressedModelConfig.tiny(compress_ratios=(0, 4, 4, 4)))
    config = layout.cache_config(num_blocks=8)
    with pytest.raises(ConfigError, match="cache layer"):
        PagedRows(config, other.layers, dtype=F64, device="cpu")
    with pytest.raises(ConfigError, match="another model"):
        CompressedRunner(CompressedDecoder(other.shape, seed=None), layout, config)
    assert v4_ratios(5, hca_ratio=128, window_only_layers=2) == (0, 0, 4, 128, 4)


def test_pool_refuses_null_and_missing_blocks() -> None:
    shape = CompressedModelConfig.tiny()
    layout = CompressedCacheLayout(shape)
    pool = PagedRows(layout.cache_config(num_blocks=8), layout.layers, dtype=F64,
                     device="cpu", poison=True)
    entries = layout.cache_layer(1, "entries")
    index = pool.index(req_id="r", cache_layer=entries, table=[3, 5], first=6, end=12)
    assert index.blocks.tolist() == [3, 3, 5, 5, 5, 5] and index.rows.tolist() == [6, 7, 0, 1,
                                                                                    2, 3]
    pool.write(entries, index, torch.ones(6, 8, dtype=F64))
    assert torch.equal(pool.read(entries, index.tail(8)), torch.ones(4, 8, dtype=F64))
    fresh = pool.index(req_id="r", cache_layer=entries, table=[4], first=0, end=2)
    assert torch.isnan(pool.read(entries, fresh)).all()          # poisoned, never written
    with pytest.raises(InvariantViolation,
                       match=r"request 'r', layer 1 entries .*entry 8 is needed but maps to "
                             r"the null block 0 \(table index 1\)"):
        pool.index(req_id="r", cache_layer=entries, table=[3, 0], first=6, end=12)
    with pytest.raises(InvariantViolation, match="position 4 needs table index 1"):
        pool.index(req_id="r", cache_layer=layout.cache_layer(1, "state"), table=[2],
                   first=0, end=5)
    with pytest.raises(InvariantViolation, match="outside"):
        pool.index(req_id="r", cache_layer=entries, table=[9], first=0, end=1)
