"""Step-time model: seconds per scheduler step from a model shape on a named GPU.

Below ``sched`` in the layering (imports only the core's specs, config and errors):

- ``gpus``: the ``--gpu`` table (datasheet peaks);
- ``shape``: matrix sizes (``dims.toml``) joined with a preset's cache layers;
- ``cost``: ``StepCostModel`` (the per-step linear cost, tensor-parallel all-reduce);
- ``fit``: the non-negative relative least squares ``bench/calibrate.py`` uses;
- ``params``: the fitted coefficients shipped in ``params.toml`` with their provenance.

``docs/time-model.md`` describes the model, its calibration and its measured error.
"""

from hybridkv.timing.cost import PARAM_NAMES, Chunk, Efficiencies, StepCostModel
from hybridkv.timing.gpus import GPU, GPUS, gpu_named
from hybridkv.timing.params import cost_model, load_efficiencies
from hybridkv.timing.shape import AttentionLayer, ComputeShape, ModelDims, compute_shape

__all__ = ["GPU", "GPUS", "PARAM_NAMES", "AttentionLayer", "Chunk", "ComputeShape",
           "Efficiencies", "ModelDims", "StepCostModel", "compute_shape", "cost_model",
           "gpu_named", "load_efficiencies"]
