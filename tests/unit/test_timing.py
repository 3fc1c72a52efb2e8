"""The step-time model (``hybridkv.timing``): closed forms against brute force, the fit
against known coefficients, and the model's response to cache hits per layer kind."""

from __future__ import annotations

import random

import pytest

from hybridkv.errors import ConfigError
from hybridkv.models.shapes import list_presets, load_model
from hybridkv.timing import (
    PARAM_NAMES,
    AttentionLayer,
    Chunk,
    Efficiencies,
    StepCostModel,
    cost_model,
    gpu_named,
)
from hybridkv.timing.fit import fit_coefficients, relative_errors
from hybridkv.timing.shape import bundled_dims, shape_of_engine_gemma1b


def brute_pairs(layer: AttentionLayer, start: int, end: int) -> int:
    total = 0
    for p in range(start, end):
        if layer.kind == "full":
            total += p + 1
        elif layer.kind == "window":
            total += min(p + 1, layer.window)
        elif layer.kind == "chunked":
            total += p % layer.chunk + 1
        else:
            entries = (p + 1) // layer.ratio
            if layer.topk:
                entries = min(entries, layer.topk)
            total += entries + (min(p + 1, layer.window) if layer.kind == "compressed" else 0)
    return total


def test_pairs_match_brute_force_for_every_kind() -> None:
    rng = random.Random(7)
    layers = [AttentionLayer("full", 1), AttentionLayer("window", 1, window=5),
              AttentionLayer("window", 1, window=1), AttentionLayer("chunked", 1, chunk=7),
              AttentionLayer("compressed", 1, window=3, ratio=4),
              AttentionLayer("compressed", 1, window=3, ratio=4, topk=2),
              AttentionLayer("indexer", 1, ratio=4)]
    for _ in range(300):
        start = rng.randrange(0, 60)
        end = start + rng.randrange(1, 40)
        for layer in layers:
            assert layer.pairs(start, end) == brute_pairs(layer, start, end), (layer, start,
                                                                               end)


def test_span_is_the_gathered_key_range() -> None:
    assert AttentionLayer("full", 1).span(100, 110) == 110
    assert AttentionLayer("window", 1, window=8).span(100, 110) == 110 - 93
    assert AttentionLayer("window", 1, window=8).span(3, 10) == 10
    assert AttentionLayer("chunked", 1, chunk=64).span(100, 110) == 110 - 64


def test_fit_recovers_known_coefficients() -> None:
    rng = random.Random(3)
    truth = [0.002, 4e-5, 2e-5, 1e-4, 1.3, 1.1, 2.5, 0.0, 0.7, 3e-4]
    rows = [[1.0, rng.uniform(10, 500), rng.uniform(0, 300), rng.uniform(0, 40),
             rng.uniform(0, 0.05), rng.uniform(1e-4, 1e-3),
             rng.uniform(0, 0.01), rng.uniform(0, 1e-4), rng.uniform(0, 1e-3),
             rng.uniform(0, 50)] for _ in range(60)]
    times = [sum(c * x for c, x in zip(truth, row, strict=True)) for row in rows]
    fitted = fit_coefficients(rows, times)
    assert max(abs(e) for e in relative_errors(rows, times, fitted)) < 1e-6
    for got, want in zip(fitted, truth, strict=True):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-9)
    assert all(c >= 0 for c in fit_coefficients(rows, [t * rng.uniform(0.8, 1.2)
                                                       for t in times]))


def test_window_layers_do_not_pay_for_context_beyond_the_window() -> None:
    window_only = StepCostModel(shape_of_engine_gemma1b(), "h200", Efficiencies.ideal())
    f_short = window_only.features([Chunk(4096, 1024, True)])
    f_long = window_only.features([Chunk(60_000, 1024, True)])
    attention = PARAM_NAMES.index("attention")
    # only the 4 full layers' pairs grow: 4 x 4 x 4 x 256 x 1024 x 55,904 more FLOPs
    extra = (f_long[attention] - f_short[attention]) * gpu_named("h200").bf16_dense_flops
    assert extra == pytest.approx(4 * 4096 * 1024 * (60_000 - 4096))


def test_a_hit_shortens_the_step_and_decode_is_weight_bound() -> None:
    model = StepCostModel(shape_of_engine_gemma1b(), "h200", Efficiencies.ideal())
    cold = model.seconds([Chunk(0, 32_768, True)])
    hit = model.seconds([Chunk(30_720, 2048, True)])
    assert hit < cold / 8
    breakdown = model.breakdown([Chunk(8192, 1, True)])
    assert max(breakdown, key=lambda k: breakdown[k]) == "weights"


def test_recurrent_layers_cost_a_checkpoint_read_only_after_token_zero() -> None:
    layers = list(load_model("qwen3.5-27b").layers)
    model = cost_model("qwen3.5-27b", layers, "h200")
    kv = PARAM_NAMES.index("kv")
    first = model.features([Chunk(0, 1024)])[kv]
    resumed = model.features([Chunk(1024, 1024)])[kv]
    state_bytes = 48 * 3_207_168
    full_read = 16 * 1024 * 4096   # 16 full layers gather 1,024 more keys
    assert (resumed - first) * gpu_named("h200").hbm_bytes_per_s == pytest.approx(
        state_bytes + full_read)


def test_tensor_parallel_splits_work_and_adds_all_reduce() -> None:
    shape = shape_of_engine_gemma1b()
    one = StepCostModel(shape, "h100", Efficiencies.ideal(), tp=1)
    two = StepCostModel(shape, "h100", Efficiencies.ideal(), tp=2)
    step = [Chunk(0, 8192, True)]
    assert two.seconds(step) == pytest.approx(one.seconds(step) / 2 + two.allreduce_seconds(8192))
    with pytest.raises(ConfigError, match="tp=0"):
        StepCostModel(shape, "h100", Efficiencies.ideal(), tp=0)


def test_bad_gpu_name_names_the_input_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"gpu='rtx4090'.*h100, h200, b200, a100, l40s, "
                                          r"mi300x"):
        gpu_named("rtx4090")


def test_bundled_dims_cover_named_presets() -> None:
    presets = set(list_presets())
    for name, dims in bundled_dims().items():
        assert name in presets, name
        model = load_model(name)
        recurrent = sum(1 for s in model.layers if s.kind == "recurrent_state")
        assert recurrent <= dims.num_layers
        assert cost_model(name, model.layers).seconds([Chunk(0, 512, True)]) > 0


def test_unmeasured_gpu_is_scaled() -> None:
    layers = list(load_model("gemma3-1b").layers)
    assert not cost_model("gemma3-1b", layers, "h200").scaled
    assert cost_model("gemma3-1b", layers, "mi300x").scaled
