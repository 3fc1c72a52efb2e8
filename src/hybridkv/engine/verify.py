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

This module imports torch only when a run starts, so ``hybridkv --help`` works without the
``engine`` extra.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from hybridkv.argtypes import non_empty_str, non_negative_float, non_negative_int, positive_int
from hybridkv.errors import ConfigError, EquivalenceError
from hybridkv.policies import CORE_POLICIES, PolicySpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from hybridkv.engine.attention import AttentionFn
    from hybridkv.engine.gated_delta import Recurrence
    from hybridkv.engine.model import HybridDecoder
    from hybridkv.engine.runner import EngineRunner, RunOptions, RunResult
    from hybridkv.sim.scheduler import SchedRequest

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
    from hybridkv.sim.loaders import load_trace
    from hybridkv.sim.scheduler import SchedRequest
    from hybridkv.sim.trace import expand_prompt

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
def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hybridkv verify``."""
    from hybridkv.engine.synthetic import ENGINE_WORKLOADS

    parser.add_argument("--workload", choices=sorted(ENGINE_WORKLOADS), default="all",
                        help="synthetic workload with shared prefixes (default: all = "
                             "mixed, then bridges)")
    parser.add_argument("--trace", default=None, metavar="PATH", type=non_empty_str,
                        help="verify a slice of a real trace (any format replay reads) "
                             "instead of a synthetic workload")
    parser.add_argument("--limit", type=positive_int, default=24,
                        help="with --trace: its first N requests (default 24)")
    parser.add_argument("--trace-max-tokens", type=positive_int,
                        default=DEFAULT_TRACE_MAX_TOKENS,
                        help="with --trace: keep every s-th prompt token so the longest "
                             f"prompt has at most this many (default {DEFAULT_TRACE_MAX_TOKENS})")
    parser.add_argument("--policy", default=None, type=non_empty_str,
                        help="retention policies, comma separated "
                             f"(default: {','.join(DEFAULT_POLICIES)}, plus "
                             f"{','.join(BRANCH_POLICIES)} for models of full attention "
                             "and Gated DeltaNet layers; 'core' = "
                             f"{','.join(CORE_POLICIES)})")
    parser.add_argument("--eagle", action="store_true",
                        help="also run every policy in EAGLE drop mode")
    parser.add_argument("--num-blocks", type=positive_int, default=256,
                        help="pool size incl. the null block (small values force preemption)")
    parser.add_argument("--block-size", type=positive_int, default=8)
    parser.add_argument("--full-block-size", type=positive_int, default=None,
                        help="block size of full-attention layers (default: --block-size)")
    parser.add_argument("--chunk-size", type=positive_int, default=32,
                        help="scheduler token budget per step")
    parser.add_argument("--max-running", type=positive_int, default=4)
    parser.add_argument("--seed", type=non_negative_int, default=0, help="model and workload seed")
    parser.add_argument("--pattern", choices=(*PATTERNS, "all"), default="gemma3",
                        help="layer pattern: gemma3 (5 local : 1 global), alternating "
                             "(gpt-oss), llama4 (chunked-local : global), mixed (sliding, "
                             "chunked, full), v4 (DeepSeek-V4-shaped: every layer a window, "
                             "compressed C4 / C-hca layers after the first), qwen3-next "
                             "(Gated DeltaNet : full 3 : 1), recurrent-mixed (Gated DeltaNet, "
                             "sliding, full); all: each in turn")
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--hidden", type=positive_int, default=32)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--kv-heads", type=positive_int, default=2)
    parser.add_argument("--head-dim", type=positive_int, default=8)
    parser.add_argument("--vocab", type=positive_int, default=97)
    parser.add_argument("--window", type=positive_int, default=12, help="sliding window (tokens)")
    parser.add_argument("--attention-chunk", type=positive_int, default=16,
                        help="chunk of chunked-local layers (tokens)")
    parser.add_argument("--hca-ratio", type=int, default=16,
                        help="--pattern v4: tokens per entry of the non-overlapping "
                             "compressed layers (V4: 128)")
    parser.add_argument("--compressed-block-size", type=int, default=32,
                        help="--pattern v4: tokens per compressed-entries block (V4: 256)")
    parser.add_argument("--index-topk", type=int, default=4,
                        help="--pattern v4: entries a C4 layer's lightning indexer keeps per "
                             "query (0: no indexer, read every completed entry)")
    parser.add_argument("--attention", choices=("reference", "sdpa"), default="reference",
                        help="attention path (reference: explicit masks)")
    parser.add_argument("--atol", type=non_negative_float, default=DEFAULT_ATOL,
                        help="max allowed |logit difference| (float64)")


def _policies(text: str) -> list[str]:
    names: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if item == "core":
            names.extend(CORE_POLICIES)
        elif item:
            try:
                PolicySpec.parse(item)
            except ConfigError as err:
                raise ConfigError("--policy", item, err.fix) from err
            names.append(item)
    if not names:
        raise ConfigError("--policy", text, "name at least one policy")
    return names


def _default_policies(kinds: Sequence[str], args: argparse.Namespace) -> list[str]:
    """``--policy`` left out: ``DEFAULT_POLICIES``, plus ``BRANCH_POLICIES`` where the
    model suits ``ckpt:branch`` (full attention and Gated DeltaNet layers, one block size).

    >>> ns = argparse.Namespace(full_block_size=None, block_size=8)
    >>> len(_default_policies(("linear_attention", "full_attention"), ns))
    10
    >>> len(_default_policies(("sliding_attention", "full_attention"), ns))
    8
    """
    names = list(DEFAULT_POLICIES)
    one_block = args.full_block_size in (None, args.block_size)
    if one_block and "linear_attention" in kinds \
            and set(kinds) <= {"linear_attention", "full_attention"}:
        names.extend(BRANCH_POLICIES)
    return names


def _layer_types(pattern: str, num_layers: int) -> tuple[str, ...]:
    from hybridkv.engine.model_config import (
        alternating_pattern,
        gemma3_pattern,
        llama4_pattern,
        qwen3_next_pattern,
    )

    if pattern == "gemma3":
        return gemma3_pattern(num_layers, period=min(6, num_layers))
    if pattern == "alternating":
        return alternating_pattern(num_layers)
    if pattern == "llama4":
        return llama4_pattern(num_layers, period=min(4, num_layers))
    if pattern == "qwen3-next":
        return qwen3_next_pattern(num_layers, interval=min(4, num_layers))
    if pattern == "recurrent-mixed":
        cycle = ("linear_attention", "sliding_attention", "full_attention")
        return tuple(cycle[i % 3] for i in range(num_layers))
    if pattern == "v4":  # the raw window of every layer; compress ratios come separately
        return ("sliding_attention",) * num_layers
    kinds = ("sliding_attention", "chunked_attention", "full_attention")
    return tuple(kinds[i % 3] for i in range(num_layers))


def cmd_verify(args: argparse.Namespace) -> int:
    """Entry point of ``hybridkv verify``: 0 when every policy is identical, 1 otherwise."""
    try:
        return _run_verify_command(args)
    except ConfigError as err:  # name the option the user typed, not the internal field
        raise ConfigError(_FLAG_FOR_FIELD.get(err.field, err.field), err.value,
                          _FIELD_PATTERN.sub(lambda m: _FLAG_FOR_FIELD[m.group(0)], err.fix),
                          ) from err


_FLAG_FOR_FIELD = {
    "num_kv_heads": "--kv-heads", "num_heads": "--heads", "num_blocks": "--num-blocks",
    "alignment_tokens": "--block-size", "head_dim": "--head-dim", "hidden_size": "--hidden",
    "vocab_size": "--vocab", "sliding_window": "--window", "block_size": "--block-size",
    "attention_chunk_size": "--attention-chunk", "max_num_batched_tokens": "--chunk-size",
    "chunk_size": "--chunk-size", "max_running": "--max-running",
}
"""Internal field → the ``verify`` option that sets it (for error messages)."""
_FIELD_PATTERN = re.compile(r"\b(" + "|".join(_FLAG_FOR_FIELD) + r")\b")


def _run_verify_command(args: argparse.Namespace) -> int:
    try:
        import torch

        from hybridkv.engine.attention import reference_attention, sdpa_attention
        from hybridkv.engine.model import HybridDecoder
        from hybridkv.engine.model_config import ModelConfig
        from hybridkv.engine.synthetic import make_engine_workload
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ConfigError("verify", "torch", "install the engine extra; from a checkout: "
                          f"pip install -e '.[engine]' ({exc})") from exc
    torch.set_num_threads(1)  # test-sized matrices: threads cost more than they save
    settings = VerifySettings(block_size=args.block_size, full_block_size=args.full_block_size,
                              num_blocks=args.num_blocks, chunk_size=args.chunk_size,
                              max_running=args.max_running, atol=args.atol)
    alignment = math.lcm(args.block_size, args.full_block_size or args.block_size)
    if args.trace is not None:
        trace_requests, stride = trace_workload(args.trace, limit=args.limit,
                                                max_prompt_tokens=args.trace_max_tokens)
    attention = reference_attention if args.attention == "reference" else sdpa_attention
    ok = True
    for pattern in PATTERNS if args.pattern == "all" else (args.pattern,):
        kinds = _layer_types(pattern, args.layers)
        config = ModelConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
            layer_types=kinds,  # type: ignore[arg-type]
            sliding_window=args.window, attention_chunk_size=args.attention_chunk)
        model = HybridDecoder(config, dtype=torch.float64, seed=args.seed)
        runner_factory: RunnerFactory | None = None
        pattern_alignment = alignment
        if pattern == "v4":
            from hybridkv.engine.compressed_runner import v4_verify_setup

            model, runner_factory, pattern_alignment, kinds = v4_verify_setup(
                config, window_block_size=args.block_size, hca_ratio=args.hca_ratio,
                compressed_block_size=args.compressed_block_size, index_topk=args.index_topk,
                attention=args.attention, seed=args.seed)
        if args.trace is not None:
            workload = trace_requests
            source = (f"trace {args.trace}: first {len(workload)} requests, every "
                      f"{stride}th prompt token")
        else:
            workload = make_engine_workload(args.workload, alignment_tokens=pattern_alignment,
                                            seed=args.seed)
            source = f"workload {args.workload}"
        policies = _default_policies(kinds, args) if args.policy is None \
            else _policies(args.policy)
        report = run_verify(model, workload, policies=policies, eagle=args.eagle,
                            settings=settings, attention=attention,
                            runner_factory=runner_factory)
        print(f"verify: {source}, {len(workload)} requests, pattern {pattern} {kinds}, "
              f"block {args.block_size}, window {args.window}, chunk {args.chunk_size}, "
              f"pool {args.num_blocks}; baseline (no caching): {report.baseline_steps} "
              f"steps, {report.baseline_preemptions} preemptions")
        for outcome in report.outcomes:
            print(outcome.line())
        ok = ok and report.ok
    print("all identical" if ok else "DIVERGENCE")
    return 0 if ok else 1
