"""``hybridkv verify``: prove prefix-cache hits exact on a real model.

The same workload runs once with caching off (the baseline: every token computed) and once
per retention policy with caching on (optionally also in EAGLE drop mode). With a float64
model and the reference attention path, a correct cache gives the same greedy tokens and
logits equal up to summation order; anything else is a divergence, reported by request,
position and policy (``EquivalenceError``).

Why the default tolerance ``atol = 1e-9``: cached and uncached runs compute the same
function on the same keys, but matrix products see different batch shapes (chunking, other
requests in the step), which changes float64 summation order: ~1e-16 relative per operation,
~1e-14 after a few layers on logits of magnitude ~1 (measured: < 1e-14). A wrong hit (a
shifted or swapped block, stale KV) moves logits by ~1e-2 or more. 1e-9 separates the two
by five orders of magnitude on each side.

Equivalence checking as a library (``run_verify``); the command is ``hybridkv.cli.verify``.
This module imports torch only when a run starts, so ``hybridkv --help`` works without the
``engine`` extra.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from hybridkv.errors import ConfigError, EquivalenceError

if TYPE_CHECKING:
    from collections.abc import Callable

    from hybridkv.engine.attention import AttentionFn
    from hybridkv.engine.gated_delta import Recurrence
    from hybridkv.engine.model import HybridDecoder
    from hybridkv.engine.runner import EngineRunner, RunOptions, RunResult
    from hybridkv.sched.scheduler import SchedRequest

    RunnerFactory: TypeAlias = Callable[["VerifySettings", RunOptions, bool, bool],
                                        EngineRunner]
    """``factory(settings, options, caching, use_eagle)``: the runner of one verify run,
    for models whose cache layout ``cache_config_for_model`` does not describe (V4-shaped
    models: ``engine.compressed_runner.compressed_runner_factory``)."""

DEFAULT_ATOL = 1e-9
DEFAULT_POLICIES = ("dense", "reachable", "prepend", "latest", "interval:32", "pin:64",
                    "latest+recompute", "interval:32+recompute")
BRANCH_POLICIES = ("latest+ckpt:branch", "prepend+ckpt:branch:4")
"""Sub-block hits (``ckpt:branch``: branch-point snapshots, copy-on-write hits inside a
block), added to the default policies of models made of full attention and Gated DeltaNet
layers only (``--pattern qwen3-next``): the models ``ckpt:branch`` serves."""
PATTERNS = ("gemma3", "alternating", "llama4", "mixed", "v4", "qwen3-next",
            "recurrent-mixed")
"""Layer patterns of ``--pattern`` (``all`` runs each in turn): ``qwen3-next`` is Gated
DeltaNet : full attention 3 : 1 (Qwen3-Next / Qwen3.5), ``recurrent-mixed`` cycles
Gated DeltaNet, sliding, full."""
DEFAULT_TRACE_MAX_TOKENS = 192


@dataclass(frozen=True, slots=True)
class VerifySettings:
    """Cache and scheduling settings shared by every run of one verification."""

    block_size: int = 8
    full_block_size: int | None = None
    num_blocks: int = 256
    chunk_size: int = 32
    max_running: int = 4
    atol: float = DEFAULT_ATOL


@dataclass(slots=True)
class PolicyOutcome:
    """One cached run compared with the baseline."""

    policy: str
    eagle: bool
    prompt_tokens: int
    hit_tokens: int
    readmission_hit_tokens: int
    num_preemptions: int
    max_logit_diff: float
    divergences: list[EquivalenceError] = field(default_factory=list)
    bridge_tokens: int = 0
    """Tokens recomputed by window-recompute bridges (manager ``stats.bridge_tokens``)."""
    cold_bridges: int = 0
    """Admissions whose bridge started cold (window KV before the hit missing)."""
    sub_block_hits: int = 0
    """``ckpt:branch``: admissions whose hit ends inside a block (copy-on-write)."""
    block_copies: int = 0
    """``ckpt:branch``: block copies the engine ran (snapshots and copy-on-write)."""

    @property
    def label(self) -> str:
        return f"{self.policy}+eagle" if self.eagle else self.policy

    @property
    def identical(self) -> bool:
        return not self.divergences

    def line(self) -> str:
        head = (f"{self.label:<22} hits {self.hit_tokens:>5}/{self.prompt_tokens:<5} tok  "
                f"readmit-hits {self.readmission_hit_tokens:>4}  "
                f"preemptions {self.num_preemptions:>2}  "
                f"bridges {self.bridge_tokens:>4} tok ({self.cold_bridges} cold)  "
                f"max|dlogit| {self.max_logit_diff:.1e}")
        if self.block_copies:
            head += (f"  sub-block hits {self.sub_block_hits} "
                     f"({self.block_copies} block copies)")
        if self.identical:
            return f"{head}  identical"
        return f"{head}  DIVERGED ({len(self.divergences)}): {self.divergences[0]}"


@dataclass(slots=True)
class VerifyReport:
    """All outcomes of one verification and the baseline's counters."""

    atol: float
    baseline_steps: int
    baseline_preemptions: int
    outcomes: list[PolicyOutcome]

    @property
    def ok(self) -> bool:
        return all(o.identical for o in self.outcomes)

    def first_divergence(self) -> EquivalenceError | None:
        for outcome in self.outcomes:
            if outcome.divergences:
                return outcome.divergences[0]
        return None

    def raise_on_divergence(self) -> None:
        error = self.first_divergence()
        if error is not None:
            raise error


def compare_runs(baseline: RunResult, cached: RunResult, *, policy: str,
                 atol: float) -> tuple[float, list[EquivalenceError]]:
    """Max logit difference over every sampled token, and one error per diverged request
    (the first position where tokens differ or logits differ by more than ``atol``)."""
    worst = 0.0
    errors: list[EquivalenceError] = []
    for req_id, ref in baseline.records.items():
        got = cached.records[req_id]
        first_bad: tuple[int, str] | None = None
        if len(got.output_token_ids) != len(ref.output_token_ids):
            first_bad = (ref.num_prompt_tokens - 1, f"{len(got.output_token_ids)} tokens "
                         f"generated, baseline {len(ref.output_token_ids)}")
        for k, (a, b) in enumerate(zip(ref.sampled_logits, got.sampled_logits, strict=False)):
            diff = float((a - b).abs().max())
            diff = math.inf if math.isnan(diff) else diff
            worst = max(worst, diff)
            same_token = ref.output_token_ids[k] == got.output_token_ids[k]
            if first_bad is None and (diff > atol or not same_token):
                first_bad = (ref.num_prompt_tokens - 1 + k,
                             f"sampled token {k}: {got.output_token_ids[k]} vs baseline "
                             f"{ref.output_token_ids[k]}, max|dlogit| {diff:.3e} "
                             f"(atol {atol:.0e})")
        if first_bad is not None:
            errors.append(EquivalenceError(policy, req_id, first_bad[0], first_bad[1]))
    return worst, errors


def run_verify(model: HybridDecoder, workload: Sequence[SchedRequest], *,
               policies: Sequence[str] = DEFAULT_POLICIES, eagle: bool = False,
               settings: VerifySettings | None = None,
               attention: AttentionFn | None = None,
               recurrence: Recurrence | None = None,
               runner_factory: RunnerFactory | None = None) -> VerifyReport:
    """Run ``workload`` without caching and under each policy (and EAGLE mode when
    ``eagle``); compare every cached run with the uncached one. ``recurrence`` is the
    Gated DeltaNet path of ``linear_attention`` layers (default: the token-by-token
    reference); ``runner_factory`` builds each run's runner (default: ``EngineRunner`` on
    ``cache_config_for_model``)."""
    from hybridkv.engine.attention import reference_attention
    from hybridkv.engine.model_config import cache_config_for_model
    from hybridkv.engine.recurrent import gated_delta_reference
    from hybridkv.engine.runner import EngineRunner, RunOptions

    s = settings or VerifySettings()
    attend = attention or reference_attention
    dtype_bytes = model.embed.element_size()

    def run(policy: str, caching: bool, use_eagle: bool) -> RunResult:
        options = RunOptions(policy=policy, chunk_size=s.chunk_size, max_running=s.max_running,
                             record_logits=True, poison=True)
        if runner_factory is not None:
            return runner_factory(s, options, caching, use_eagle).run(workload)
        cache_config = cache_config_for_model(
            model.config, num_blocks=s.num_blocks, block_size=s.block_size,
            full_block_size=s.full_block_size, dtype_bytes=dtype_bytes,
            enable_caching=caching, use_eagle=use_eagle, max_num_batched_tokens=s.chunk_size)
        return EngineRunner(model, cache_config, options, attention=attend,
                            recurrence=recurrence or gated_delta_reference).run(workload)

    baseline = run("latest", False, False)
    outcomes: list[PolicyOutcome] = []
    modes = (False, True) if eagle else (False,)
    for use_eagle in modes:
        for policy in policies:
            label = f"{policy}+eagle" if use_eagle else policy
            result = run(policy, True, use_eagle)
            worst, errors = compare_runs(baseline, result, policy=label, atol=s.atol)
            outcomes.append(PolicyOutcome(
                policy, use_eagle, result.prompt_tokens, result.hit_tokens,
                result.total_hit_tokens - result.hit_tokens, result.num_preemptions, worst,
                errors, result.bridge_tokens, result.num_cold_bridges, result.sub_block_hits,
                result.block_copies))
    return VerifyReport(s.atol, baseline.num_steps, baseline.num_preemptions, outcomes)


def trace_workload(path: str, *, limit: int, max_prompt_tokens: int = DEFAULT_TRACE_MAX_TOKENS,
                   output_tokens: int = 2) -> tuple[list[SchedRequest], int]:
    """The first ``limit`` requests of a real trace as engine requests, and the stride.

    Prompts are expanded from the trace (block hashes → token ids, replay-protocol.md),
    then every ``stride``-th token is kept, ``stride = ceil(median prompt /
    (max_prompt_tokens / 2))``, and the result is cut to ``max_prompt_tokens``, so a
    float64 model on one CPU core verifies them in seconds. Both keep the sharing
    structure: prompts equal on their first ``L`` tokens stay equal on their first
    ``min(ceil(L / s), max_prompt_tokens)``. Sessions, phases and output lengths (capped at
    ``output_tokens``, at least 1) carry over.

    >>> import json, pathlib, tempfile
    >>> rows = [{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},
    ...         {"timestamp": 1, "input_length": 1536, "output_length": 1,
    ...          "hash_ids": [1, 2, 3]}]
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "mooncake.jsonl"
    >>> _ = path.write_text("".join(json.dumps(r) + chr(10) for r in rows))
    >>> requests, stride = trace_workload(str(path), limit=2, max_prompt_tokens=64)
    >>> stride, [len(r.prompt_token_ids) for r in requests]      # median 1536 / 32
    (48, [22, 32])
    >>> requests[1].prompt_token_ids[:22] == requests[0].prompt_token_ids
    True

    Raises:
        TraceFormatError: the path is missing or malformed (``load_trace``).
        ConfigError: ``limit`` or ``max_prompt_tokens`` below 1, or an empty slice.
    """
    from hybridkv.sched.scheduler import SchedRequest
    from hybridkv.traces.loaders import load_trace
    from hybridkv.traces.trace import expand_prompt

    for name, value in (("limit", limit), ("trace-max-tokens", max_prompt_tokens),
                        ("output-tokens", output_tokens)):
        if value < 1:
            raise ConfigError(name, value, "must be a positive integer")
    trace = load_trace(path, limit=limit)
    if not trace.requests:
        raise ConfigError("trace", path, "holds no requests")
    lengths = sorted(r.input_length for r in trace.requests)
    stride = -(-lengths[len(lengths) // 2] // max(1, max_prompt_tokens // 2))
    requests = [SchedRequest(r.request_id,
                             expand_prompt(r, index)[::stride][:max_prompt_tokens],
                             max(1, min(r.output_length, output_tokens)), r.session_id,
                             r.phase, r.tag)
                for index, r in enumerate(trace.requests)]
    return requests, stride


# ------------------------------------------------------------------------------ CLI
