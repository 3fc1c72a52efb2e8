"""Gemma-3 checkpoints in the Hugging Face layout: ``config.json`` + ``*.safetensors``.

Reads text-only (``Gemma3ForCausalLM``, ``model_type: gemma3_text``) and multimodal
(``Gemma3ForConditionalGeneration``: the text model under ``text_config`` and
``language_model.`` tensor prefixes; vision tensors are skipped) checkpoints, and writes the
text-only layout (for tests and benchmarks: a random model saved and loaded back).

Config keys understood: ``layer_types`` (else ``sliding_window_pattern``: layer ``i`` is
global when ``(i + 1) % pattern == 0``), ``sliding_window``, ``rope_theta`` /
``rope_local_base_freq`` / ``rope_scaling`` (linear) or the newer per-kind
``rope_parameters``, ``query_pre_attn_scalar``, ``rms_norm_eps``, ``final_logit_softcapping``,
``tie_word_embeddings``. Tensor names per layer ``i`` (after the prefix ``model.``)::

    layers.{i}.input_layernorm / post_attention_layernorm / pre_feedforward_layernorm /
        post_feedforward_layernorm .weight
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight
    embed_tokens.weight, norm.weight (and lm_head.weight when embeddings are untied)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import LAYER_KINDS, LayerKind, ModelConfig
from hybridkv.errors import ConfigError

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
"""Prefixes of text-model tensors, tried in order (multimodal layouts first)."""

_LAYER_NORMS = {
    "input_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "pre_ffn_norm": "pre_feedforward_layernorm",
    "post_ffn_norm": "post_feedforward_layernorm",
}


def model_config_from_hf(raw: Mapping[str, Any]) -> ModelConfig:
    """Translate a Gemma-3 ``config.json`` (text or multimodal) into a ``ModelConfig``."""
    cfg = raw.get("text_config") or raw
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError("attn_logit_softcapping", cfg["attn_logit_softcapping"],
                          "attention soft-capping is not supported (Gemma 3 has none)")
    activation = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError("hidden_activation", activation, "only gelu-tanh is supported")
    num_layers = int(cfg["num_hidden_layers"])
    global_theta, local_theta, factor = _rope(cfg)
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
        head_dim=int(cfg.get("head_dim", 256)),
        layer_types=_layer_types(cfg, num_layers),
        sliding_window=cfg.get("sliding_window"),
        attention_chunk_size=cfg.get("attention_chunk_size"),
        rope_theta=global_theta,
        rope_local_theta=local_theta,
        rope_scaling_factor=factor,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                         cfg.get("tie_word_embeddings", True))),
    )


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[LayerKind, ...]:
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(num_layers))
    if len(kinds) != num_layers or any(k not in LAYER_KINDS for k in kinds):
        raise ConfigError("layer_types", kinds,
                          f"need {num_layers} entries from {', '.join(LAYER_KINDS)}")
    return tuple(kinds)


def _rope(cfg: Mapping[str, Any]) -> tuple[float, float, float]:
    """``(global theta, local theta, linear factor of global layers)``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention", {})
        factor = _linear_factor(full)
        _linear_factor(local)  # validates
        return (float(full.get("rope_theta", 1e6)), float(local.get("rope_theta", 1e4)),
                factor)
    scaling = cfg.get("rope_scaling") or {}
    return (float(cfg.get("rope_theta", 1e6)), float(cfg.get("rope_local_base_freq", 1e4)),
            _linear_factor(scaling))


def _linear_factor(params: Mapping[str, Any]) -> float:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return 1.0
    if kind == "linear":
        return float(params["factor"])
    raise ConfigError("rope_type", kind, "only 'default' and 'linear' rope are supported")


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """A text-only Gemma-3 ``config.json`` for ``config``."""
    if config.layer_windows is not None:
        raise ConfigError("layer_windows", config.layer_windows,
                          "a Gemma-3 config has one sliding_window for every sliding layer")
    scaling = ({"rope_type": "linear", "factor": config.rope_scaling_factor}
               if config.rope_scaling_factor != 1.0 else None)
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        "rope_theta": config.rope_theta,
        "rope_local_base_freq": config.rope_local_theta,
        "rope_scaling": scaling,
        "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": config.tie_word_embeddings,
    }


def hf_tensors(model: HybridDecoder) -> dict[str, torch.Tensor]:
    """The model's weights under Gemma-3 text tensor names (fused projections split)."""
    cfg = model.config
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed,
                                    "model.norm.weight": model.final_norm}
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head
    for i, w in enumerate(model.layer_weights()):
        p = f"model.layers.{i}."
        q, k, v = torch.split(w.qkv, [q_rows, kv_rows, kv_rows])
        gate, up = torch.chunk(w.gate_up, 2)
        out |= {
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": w.o_proj,
            p + "self_attn.q_norm.weight": w.q_norm, p + "self_attn.k_norm.weight": w.k_norm,
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": w.down,
        }
        for ours, theirs in _LAYER_NORMS.items():
            out[p + theirs + ".weight"] = getattr(w, ours)
    return {name: t.detach().contiguous().cpu() for name, t in out.items()}


def save_gemma3(model: HybridDecoder, directory: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (text-only Gemma-3 layout)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2))
    save_file(hf_tensors(model), str(path / "model.safetensors"))


def load_gemma3(directory: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu") -> HybridDecoder:
    """Build a ``HybridDecoder`` from a local Gemma-3 checkpoint directory."""
    path = Path(directory)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError("directory", str(path), "needs a config.json (Hugging Face layout)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError("directory", str(path), "holds no *.safetensors files")
    config = model_config_from_hf(json.loads(config_path.read_text()))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors |= load_file(str(file))
    return model_from_hf_tensors(config, tensors, dtype=dtype, device=device)


def model_from_hf_tensors(config: ModelConfig, tensors: Mapping[str, torch.Tensor], *,
                          dtype: torch.dtype, device: torch.device | str) -> HybridDecoder:
    """Fill a fresh model from Gemma-3 tensor names (prefixes as in ``TEXT_PREFIXES``)."""
    text = _strip_prefixes(tensors)
    model = HybridDecoder(config, dtype=dtype, device=device, seed=None)

    def take(name: str, target: torch.Tensor) -> None:
        if name not in text:
            raise ConfigError("tensor", name, "missing from the checkpoint")
        source = text[name]
        if tuple(source.shape) != tuple(target.shape):
            raise ConfigError("tensor", name, f"has shape {tuple(source.shape)}, the config "
                              f"implies {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(source)

    take("embed_tokens.weight", model.embed)
    take("norm.weight", model.final_norm)
    if model.lm_head is not None:
        take("lm_head.weight", model.lm_head)
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i, w in enumerate(model.layer_weights()):
        p = f"layers.{i}."
        q, k, v = torch.split(w.qkv, [q_rows, kv_rows, kv_rows])
        gate, up = torch.chunk(w.gate_up, 2)
        for name, target in ((f"{p}self_attn.q_proj.weight", q), (f"{p}self_attn.k_proj.weight", k),
                             (f"{p}self_attn.v_proj.weight", v),
                             (f"{p}self_attn.o_proj.weight", w.o_proj),
                             (f"{p}self_attn.q_norm.weight", w.q_norm),
                             (f"{p}self_attn.k_norm.weight", w.k_norm),
                             (f"{p}mlp.gate_proj.weight", gate), (f"{p}mlp.up_proj.weight", up),
                             (f"{p}mlp.down_proj.weight", w.down)):
            take(name, target)
        for ours, theirs in _LAYER_NORMS.items():
            take(f"{p}{theirs}.weight", getattr(w, ours))
    return model


def _strip_prefixes(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    text: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name == "lm_head.weight" or name.startswith("language_model.lm_head."):
            text["lm_head.weight"] = tensor
            continue
        for prefix in TEXT_PREFIXES:
            if name.startswith(prefix):
                text.setdefault(name[len(prefix):], tensor)
                break
    return text
