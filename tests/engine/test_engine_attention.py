"""The fast attention paths compute what the reference path computes."""

from __future__ import annotations

import pytest

from hybridkv.engine.attention import AttentionRule, reference_attention, sdpa_attention
from hybridkv.engine.flex import FlexAttention
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, cache_config_for_model
from hybridkv.engine.runner import EngineRunner, RunOptions, RunResult
from hybridkv.engine.synthetic import make_engine_workload

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

RULES = [AttentionRule("full_attention"), AttentionRule("sliding_attention", window=1),
         AttentionRule("sliding_attention", window=5), AttentionRule("sliding_attention",
                                                                      window=40),
         AttentionRule("chunked_attention", chunk=16), AttentionRule("chunked_attention",
                                                                      chunk=48)]


def _case(rule: AttentionRule, num_q: int, q_start: int, dtype: torch.dtype,
          seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    kv_start, _ = rule.key_range(q_start, q_start + num_q)
    num_kv = q_start + num_q - kv_start
    return {
        "q": torch.randn(num_q, 4, 8, generator=gen, dtype=dtype),
        "k": torch.randn(num_kv, 2, 8, generator=gen, dtype=dtype),
        "v": torch.randn(num_kv, 2, 8, generator=gen, dtype=dtype),
        "q_start": q_start, "kv_start": kv_start, "rule": rule, "scale": 0.37,
    }


def test_rule_key_ranges() -> None:
    assert AttentionRule("full_attention").key_range(10, 20) == (0, 20)
    assert AttentionRule("sliding_attention", window=4).key_range(2, 5) == (0, 5)
    assert AttentionRule("sliding_attention", window=4).key_range(10, 12) == (7, 12)
    assert AttentionRule("chunked_attention", chunk=8).key_range(16, 20) == (16, 20)
    allowed = AttentionRule("sliding_attention", window=2).allowed(
        torch.arange(3, 5), torch.arange(2, 5))
    assert allowed.tolist() == [[True, True, False], [False, True, True]]


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize(("num_q", "q_start"), [(1, 0), (1, 37), (7, 0), (30, 0), (30, 45)])
def test_sdpa_matches_reference(rule: AttentionRule, num_q: int, q_start: int) -> None:
    case = _case(rule, num_q, q_start, torch.float64, seed=num_q + q_start)
    expected = reference_attention(**case)  # type: ignore[arg-type]
    got = sdpa_attention(**case)  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rule", RULES[1:], ids=str)
@pytest.mark.parametrize(("num_q", "q_start"), [(64, 0), (65, 3), (100, 50), (200, 333)])
def test_flex_block_masks_match_reference(rule: AttentionRule, num_q: int, q_start: int) -> None:
    """The block-sparse path (flex's unfused kernel on the CPU: same masks, same blocks)."""
    flex = FlexAttention(min_tokens=64, block=16, compile=False)
    case = _case(rule, num_q, q_start, torch.float64, seed=num_q * 7 + q_start)
    expected = reference_attention(**case)  # type: ignore[arg-type]
    torch.testing.assert_close(flex(**case), expected, rtol=0, atol=1e-12)  # type: ignore[arg-type]


def test_flex_layout_and_block_mask_are_exact_bands() -> None:
    flex = FlexAttention(min_tokens=64, block=16, compile=False)
    rule = AttentionRule("sliding_attention", window=20)
    layout = flex._layout(70, 89, 100, 81, rule)
    assert (layout.padded_q, layout.extra) == (128, 32)
    assert layout.padded_kv == layout.padded_q + layout.extra
    assert layout.front == layout.extra - 19
    mask = flex._block_mask(layout, rule, torch.device("cpu"))
    dense = mask.to_dense()[0, 0]  # [q blocks, kv blocks]: 1 where any key is read
    assert dense[0].nonzero().flatten().tolist() == [0, 1, 2]
    assert dense[5:].sum() == 0  # padded query blocks read nothing


def _run(attention: object, dtype: torch.dtype, *, chunk_size: int = 24) -> RunResult:
    config = ModelConfig.tiny(layer_types=("sliding_attention", "chunked_attention",
                                           "full_attention", "sliding_attention"),
                              sliding_window=7, attention_chunk_size=16)
    model = HybridDecoder(config, dtype=torch.float64, seed=3).converted(dtype=dtype)
    cache_config = cache_config_for_model(config, num_blocks=300, block_size=8,
                                          dtype_bytes=model.embed.element_size(),
                                          max_num_batched_tokens=chunk_size)
    runner = EngineRunner(model, cache_config, RunOptions(chunk_size=chunk_size, max_running=3),
                          attention=attention)  # type: ignore[arg-type]
    return runner.run(make_engine_workload("mixed", alignment_tokens=8, seed=3))


def _max_diff(a: RunResult, b: RunResult) -> float:
    return max(float((x - y).abs().max())
               for rid in a.records
               for x, y in zip(a.records[rid].sampled_logits, b.records[rid].sampled_logits,
                               strict=True))


def test_engine_with_sdpa_matches_reference_float64() -> None:
    ref = _run(reference_attention, torch.float64)
    fast = _run(sdpa_attention, torch.float64)
    assert ref.hit_tokens > 0
    assert {r: x.output_token_ids for r, x in ref.records.items()} == \
        {r: x.output_token_ids for r, x in fast.records.items()}
    assert _max_diff(ref, fast) < 1e-9


def test_engine_with_flex_matches_reference_float64() -> None:
    flex = FlexAttention(min_tokens=16, block=16, compile=False)
    ref = _run(reference_attention, torch.float64, chunk_size=40)
    fast = _run(flex, torch.float64, chunk_size=40)
    assert _max_diff(ref, fast) < 1e-9


def test_engine_float32_sdpa_close_to_float64_reference() -> None:
    """float32 end to end: logits within 1e-4 of the float64 reference (float32 has
    ~1e-7 relative precision; a few layers and a 97-way softmax head amplify it ~100x)."""
    ref = _run(reference_attention, torch.float64)
    fast = _run(sdpa_attention, torch.float32)
    assert _max_diff(ref, fast) < 1e-4
