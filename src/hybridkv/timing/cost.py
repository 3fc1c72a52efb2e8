"""Seconds of one scheduler step: a linear model over what the step computes and moves.

A step is the scheduler's plan: chunks ``[num_computed_tokens, num_computed_tokens +
num_new_tokens)``, some of them sampling. Its time is::

    t = step_s                                   fixed per step (scheduling, launch, sync)
      + seq_layer_s · chunks · layers            per chunk and decoder layer (kernels each
                                                 sequence launches: KV write, gather, attend)
      + prefill_layer_s · prefill chunks · layers   chunks of more than one token (masks,
                                                 causal variants, a prefill's own launches)
      + long_chunk_layer_s · long chunks · local layers   chunks of >= 2,048 tokens on
                                                 window / chunked layers (block-sparse path)
      + gemm        · GEMM FLOPs / peak          projections, MLP, LM head
      + weights     · weight bytes / bandwidth   weights read once per step (decode-bound)
      + attention   · attention FLOPs / peak     (query, key) pairs of every layer kind, the
                                                 indexer's scores, the recurrent scan
      + kv          · KV + state bytes / bw      keys gathered, KV written, checkpoints read
                                                 and written
      + activations · pointwise bytes / bw       norms, residuals, rotary, gates
      + scan_s      · scan sub-chunks            recurrent layers: per 64-token sub-chunk
      + all-reduce (tensor parallel)             2 per layer, ring: latency + 2(N−1)/N · bytes
                                                 / peer bandwidth

``gemm``, ``weights``, ``attention``, ``kv`` and ``activations`` are the inverses of
efficiencies (1.0 = the datasheet peak; a GEMM at 80 % of peak has 1.25); the others are
seconds. ``Efficiencies`` holds one fitted set (``params.toml``, ``bench/calibrate.py``).
Window-recompute bridges cost nothing extra here: the scheduler plans the recomputed tokens
as ordinary chunk tokens; block copies and snapshots cost ``copy_seconds`` of their bytes.

>>> from hybridkv.timing.shape import shape_of_engine_gemma1b
>>> model = StepCostModel(shape_of_engine_gemma1b(), gpu_named("h200"), Efficiencies.ideal())
>>> round(model.seconds([Chunk(0, 32768, True)]) * 1e3, 1)   # 32k prefill at datasheet peak
57.4
>>> round(model.seconds([Chunk(32768, 1, True)]) * 1e3, 2)   # one decode token: weights + KV
0.45
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, Protocol

from hybridkv.errors import ConfigError
from hybridkv.timing.gpus import GPU, gpu_named
from hybridkv.timing.shape import ComputeShape

PARAM_NAMES: Final = ("step_s", "seq_layer_s", "prefill_layer_s", "long_chunk_layer_s",
                      "gemm", "weights", "attention", "kv", "activations", "scan_s")
"""Coefficient order of ``Efficiencies.values`` and of ``StepCostModel.features``."""

LONG_CHUNK_TOKENS: Final = 2048
"""Chunks of at least this many tokens take the block-sparse path on local layers (the
engine's ``FlexAttention(min_tokens=2048)``: a block mask per chunk and step, padded
copies), a per-chunk cost of its own."""

SCAN_SUBCHUNK_TOKENS: Final = 64
"""Tokens of one recurrent sub-chunk (the engine's chunked Gated DeltaNet form)."""

ALLREDUCE_LATENCY_S: Final = 10e-6
"""Fixed cost of one all-reduce (NCCL ring on NVLink, small messages), an assumption."""


class ChunkLike(Protocol):
    """A scheduled chunk (``ScheduledChunk`` has these fields)."""

    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def samples(self) -> bool: ...


class Chunk(NamedTuple):
    """A chunk written by hand (tests, calibration): queries ``[num_computed_tokens,
    num_computed_tokens + num_new_tokens)``."""

    num_computed_tokens: int
    num_new_tokens: int
    samples: bool = False


@dataclass(frozen=True, slots=True)
class Efficiencies:
    """One set of coefficients (``PARAM_NAMES`` order) and where it came from.

    ``gpu``: the key it was measured on; ``provenance``: engine, date, torch, fit error.
    """

    values: tuple[float, ...]
    gpu: str = ""
    provenance: str = ""

    def __post_init__(self) -> None:
        if len(self.values) != len(PARAM_NAMES) or any(v < 0 for v in self.values):
            raise ConfigError("efficiencies", self.values,
                              f"{len(PARAM_NAMES)} non-negative numbers ({PARAM_NAMES})")

    @classmethod
    def ideal(cls) -> Efficiencies:
        """Datasheet peaks, no overheads: a lower bound on any step.

        >>> Efficiencies.ideal().values
        (0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0)
        """
        return cls((0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0),
                   provenance="datasheet peaks")

    def as_dict(self) -> dict[str, float]:
        return dict(zip(PARAM_NAMES, self.values, strict=True))


class StepCostModel:
    """Seconds per step for one model shape on one GPU (``tp`` GPUs, tensor parallel).

    ``scaled``: the efficiencies were measured on another GPU (reports say so).
    """

    def __init__(self, shape: ComputeShape, gpu: GPU | str, efficiencies: Efficiencies,
                 tp: int = 1) -> None:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError("tp", tp, "must be a positive GPU count (1, 2, 4, 8)")
        self.shape = shape
        self.gpu = gpu_named(gpu) if isinstance(gpu, str) else gpu
        self.efficiencies = efficiencies
        self.tp = tp
        self.scaled = bool(efficiencies.gpu) and efficiencies.gpu != self.gpu.key
        dims = shape.dims
        self._peak = self.gpu.peak_flops(dims.dtype_bytes) * tp
        self._bw = self.gpu.hbm_bytes_per_s * tp
        self._attn_flops_per_pair = {
            layer: count * (2.0 * dims.index_heads * dims.index_head_dim
                            if layer.kind == "indexer" else 4.0 * dims.num_heads * dims.head_dim)
            for layer, count in shape.groups}
        self._layer_terms = [(layer, self._attn_flops_per_pair[layer],
                              count * layer.kv_bytes_per_token)
                             for layer, count in shape.groups]
        """Per distinct attention layer: FLOPs per (query, key) pair and KV bytes per
        token, its count of layers folded in."""
        self._scan_flops_per_token = 8.0 * dims.scan_state_elements * shape.num_recurrent
        self._recurrent_bytes = float(sum(shape.recurrent_state_bytes))
        self._local_layers = sum(count for layer, count in shape.groups
                                 if layer.kind in ("window", "chunked"))

    def features(self, chunks: Iterable[ChunkLike]) -> list[float]:
        """The step's terms before their coefficients (``PARAM_NAMES`` order).

        >>> from hybridkv.timing.shape import shape_of_engine_gemma1b
        >>> m = StepCostModel(shape_of_engine_gemma1b(), "h200", Efficiencies.ideal())
        >>> [round(x, 6) for x in m.features([Chunk(0, 1, True)])]   # 2.0 GB of weights
        [1.0, 26.0, 0.0, 0.0, 2e-06, 0.000417, 0.0, 0.0, 0.0, 0.0]
        """
        shape, attn_flops, kv_bytes = self.shape, 0.0, 0.0
        tokens = sampled = num_chunks = subchunks = long_chunks = prefills = 0
        for chunk in chunks:
            start, n = chunk.num_computed_tokens, chunk.num_new_tokens
            if n <= 0:
                continue
            end = start + n
            tokens += n
            sampled += bool(chunk.samples)
            num_chunks += 1
            long_chunks += n >= LONG_CHUNK_TOKENS
            prefills += n > 1
            for layer, per_pair, kv_per_token in self._layer_terms:
                attn_flops += per_pair * layer.pairs(start, end)
                kv_bytes += (layer.span(start, end) + n) * kv_per_token
            if shape.num_recurrent:
                attn_flops += self._scan_flops_per_token * n
                kv_bytes += self._recurrent_bytes * (2 if start else 1)
                subchunks += -(-n // SCAN_SUBCHUNK_TOKENS) * shape.num_recurrent
            kv_bytes += 2.0 * shape.state_bytes_per_chunk
        if not tokens:
            return [0.0] * len(PARAM_NAMES)
        return [1.0, float(num_chunks * shape.dims.num_layers),
                float(prefills * shape.dims.num_layers),
                float(long_chunks * self._local_layers),
                shape.gemm_flops(tokens, sampled) / self._peak,
                shape.weight_bytes(tokens) / self._bw, attn_flops / self._peak,
                kv_bytes / self._bw, shape.activation_bytes(tokens) / self._bw,
                float(subchunks)]

    def seconds(self, chunks: Sequence[ChunkLike]) -> float:
        """Predicted seconds of a step (0 for an empty one)."""
        features = self.features(chunks)
        total = sum(c * f for c, f in zip(self.efficiencies.values, features, strict=True))
        if self.tp > 1 and features[0]:
            total += self.allreduce_seconds(sum(c.num_new_tokens for c in chunks))
        return total

    def breakdown(self, chunks: Sequence[ChunkLike]) -> dict[str, float]:
        """Seconds per term (``PARAM_NAMES`` plus ``allreduce``)."""
        features = self.features(chunks)
        out = {name: c * f for name, c, f in zip(PARAM_NAMES, self.efficiencies.values,
                                                 features, strict=True)}
        out["allreduce"] = self.allreduce_seconds(sum(c.num_new_tokens for c in chunks)) \
            if self.tp > 1 else 0.0
        return out

    def allreduce_seconds(self, num_tokens: int) -> float:
        """Two ring all-reduces per decoder layer of ``num_tokens × hidden`` activations.

        >>> from hybridkv.timing.shape import shape_of_engine_gemma1b
        >>> m = StepCostModel(shape_of_engine_gemma1b(), "h100", Efficiencies.ideal(), tp=2)
        >>> round(m.allreduce_seconds(8192) * 1e3, 3)   # 52 x (10 us + 18.9 MB / 450 GB/s)
        2.701
        """
        if self.tp == 1 or num_tokens <= 0:
            return 0.0
        dims = self.shape.dims
        message = num_tokens * dims.hidden_size * dims.dtype_bytes
        per = ALLREDUCE_LATENCY_S + 2 * (self.tp - 1) / self.tp * message / \
            self.gpu.peer_bytes_per_s
        return 2 * dims.num_layers * per

    def copy_seconds(self, num_bytes: float) -> float:
        """A device-to-device copy (block copies, snapshots): read and write at the
        fitted KV efficiency.

        >>> from hybridkv.timing.shape import shape_of_engine_gemma1b
        >>> m = StepCostModel(shape_of_engine_gemma1b(), "h200", Efficiencies.ideal())
        >>> m.copy_seconds(2.4e9)      # 2.4 GB read + 2.4 GB written at 4.8 TB/s
        0.001
        """
        return 2.0 * num_bytes / self._bw * self.efficiencies.values[PARAM_NAMES.index("kv")]
