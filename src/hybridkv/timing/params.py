"""The fitted coefficients shipped with the package (``params.toml``) and the one-call
constructor of a cost model for a preset on a GPU.

>>> eff = load_efficiencies()
>>> eff.gpu, len(eff.values)
('h200', 10)
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from importlib import resources
from typing import Any, Final

from hybridkv.errors import ConfigError
from hybridkv.specs import LayerSpec
from hybridkv.timing.cost import PARAM_NAMES, Efficiencies, StepCostModel
from hybridkv.timing.gpus import gpu_named
from hybridkv.timing.shape import bundled_dims, compute_shape

PARAMS_FILE: Final = "params.toml"
PROVENANCE_KEYS: Final = ("gpu", "engine", "date", "torch", "fit")


def _tables() -> dict[str, dict[str, Any]]:
    text = resources.files("hybridkv.timing").joinpath(PARAMS_FILE).read_text()
    return tomllib.loads(text)


def load_efficiencies(table: str = "default") -> Efficiencies:
    """One table of ``params.toml`` as ``Efficiencies`` (provenance in one line)."""
    tables = _tables()
    if table not in tables:
        raise ConfigError("efficiencies", table, f"choose one of {', '.join(tables)}")
    row = tables[table]
    missing = [name for name in PARAM_NAMES if name not in row]
    if missing:
        raise ConfigError(f"{PARAMS_FILE}[{table}]", missing, "missing coefficients")
    provenance = ", ".join(f"{k} {row[k]}" for k in PROVENANCE_KEYS if row.get(k))
    return Efficiencies(tuple(float(row[name]) for name in PARAM_NAMES), str(row["gpu"]),
                        provenance)


def cost_model(model_name: str, layers: Sequence[LayerSpec], gpu: str = "h200",
               tp: int = 1, table: str = "default") -> StepCostModel:
    """A ``StepCostModel`` for a bundled preset (its ``dims.toml`` row) on ``gpu``; the
    ``default`` table becomes ``recurrent`` for a model with recurrent layers.

    >>> from hybridkv.specs import FullAttentionSpec
    >>> m = cost_model("mistral-7b", [FullAttentionSpec(16, 2 * 8 * 128 * 2)] * 32, "b200")
    >>> m.scaled, m.gpu.name
    (True, 'NVIDIA B200')
    >>> cost_model("my-model", [FullAttentionSpec(16, 4096)])
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: model='my-model' is invalid: no compute dims for this \
model (--clock time knows gemma3-1b, gemma3-27b, gemma3-bench, mistral-7b, qwen3.5-27b, \
qwen3-next-80b, gpt-oss-120b, llama4-scout); add a row to hybridkv/timing/dims.toml
    """
    dims = bundled_dims()
    if model_name not in dims:
        raise ConfigError("model", model_name,
                          f"no compute dims for this model (--clock time knows "
                          f"{', '.join(dims)}); add a row to hybridkv/timing/dims.toml")
    shape = compute_shape(list(layers), dims[model_name], model_name)
    if table == "default" and shape.num_recurrent:
        table = "recurrent"
    return StepCostModel(shape, gpu_named(gpu), load_efficiencies(table), tp)
