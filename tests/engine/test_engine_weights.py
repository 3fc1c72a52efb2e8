"""Gemma-3 checkpoints (Hugging Face layout) written with safetensors and read back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hybridkv import ConfigError
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, cache_config_for_model, gemma3_pattern
from hybridkv.engine.runner import EngineRunner, RunOptions
from hybridkv.engine.weights import (
    hf_config_dict,
    hf_tensors,
    load_gemma3,
    model_config_from_hf,
    save_gemma3,
)
from hybridkv.sched.scheduler import SchedRequest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.engine


def _config(**overrides: object) -> ModelConfig:
    base = ModelConfig.tiny(layer_types=gemma3_pattern(6), sliding_window=5)
    return dataclasses.replace(base, query_pre_attn_scalar=16, rope_scaling_factor=4.0,
                               **overrides)  # type: ignore[arg-type]


def _logits(model: HybridDecoder) -> torch.Tensor:
    cache_config = cache_config_for_model(model.config, num_blocks=64, block_size=4,
                                          dtype_bytes=8, enable_caching=False)
    result = EngineRunner(model, cache_config, RunOptions(chunk_size=7)).run(
        [SchedRequest("r", list(range(30)), 2)])
    return torch.stack(result.records["r"].sampled_logits)


def _assert_same_weights(a: HybridDecoder, b: HybridDecoder) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip(tmp_path: Path, tied: bool) -> None:
    model = HybridDecoder(_config(tie_word_embeddings=tied), dtype=torch.float64, seed=5)
    save_gemma3(model, tmp_path)
    names = set(safetensors_torch.load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.5.self_attn.q_norm.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert ("lm_head.weight" in names) is not tied
    loaded = load_gemma3(tmp_path, dtype=torch.float64)
    assert loaded.config == model.config
    _assert_same_weights(model, loaded)
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)


def test_multimodal_layout_and_legacy_keys(tmp_path: Path) -> None:
    """``text_config`` nesting, ``language_model.model.`` prefixes, vision tensors ignored,
    and the older keys (sliding_window_pattern, rope_local_base_freq, rope_scaling)."""
    model = HybridDecoder(_config(), dtype=torch.float32, seed=6)
    text = hf_config_dict(model.config)
    del text["layer_types"]
    text |= {"sliding_window_pattern": 6, "rope_scaling": {"type": "linear", "factor": 4.0}}
    raw = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tensors = {name.replace("model.", "language_model.model.", 1): t
               for name, t in hf_tensors(model).items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(2, 2)
    safetensors_torch.save_file(dict(list(tensors.items())[:9]), str(tmp_path / "a.safetensors"))
    safetensors_torch.save_file(dict(list(tensors.items())[9:]), str(tmp_path / "b.safetensors"))
    loaded = load_gemma3(tmp_path, dtype=torch.float32)
    assert loaded.config == model.config
    _assert_same_weights(model, loaded)


def test_transformers_v5_rope_parameters() -> None:
    raw = hf_config_dict(_config())
    del raw["rope_theta"], raw["rope_local_base_freq"], raw["rope_scaling"]
    raw["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    cfg = model_config_from_hf(raw)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling_factor) == (5e5, 1e4, 8.0)


def test_bad_checkpoints_name_the_problem(tmp_path: Path) -> None:
    model = HybridDecoder(_config(), dtype=torch.float32, seed=7)
    save_gemma3(model, tmp_path)
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"layers\.2\.mlp\.up_proj\.weight.*missing"):
        load_gemma3(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match="rope_type"):
        model_config_from_hf(raw | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        model_config_from_hf(raw | {"attn_logit_softcapping": 50.0})
    raw["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="shape"):
        load_gemma3(tmp_path)
    with pytest.raises(ConfigError, match=r"config\.json"):
        load_gemma3(tmp_path / "nowhere")
