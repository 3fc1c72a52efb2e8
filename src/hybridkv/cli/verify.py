"""``hybridkv verify``: arguments → a model, a workload and the policies to prove exact
(``hybridkv.engine.verify.run_verify``), one line per policy, exit 1 on a divergence.

Imports torch only when a run starts, so ``hybridkv --help`` works without the ``engine``
extra.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridkv.cli.argtypes import non_empty_str, non_negative_float, non_negative_int, positive_int
from hybridkv.engine.verify import (
    BRANCH_POLICIES,
    DEFAULT_ATOL,
    DEFAULT_POLICIES,
    DEFAULT_TRACE_MAX_TOKENS,
    PATTERNS,
    VerifySettings,
    run_verify,
    trace_workload,
)
from hybridkv.errors import ConfigError
from hybridkv.policies import CORE_POLICIES, PolicySpec

if TYPE_CHECKING:
    from hybridkv.engine.verify import RunnerFactory


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hybridkv verify``."""
    from hybridkv.engine.synthetic import ENGINE_WORKLOADS

    parser.add_argument("--workload", choices=sorted(ENGINE_WORKLOADS), default=None,
                        help="synthetic workload with shared prefixes (default: all = "
                             "mixed, then bridges)")
    parser.add_argument("--trace", default=None, metavar="PATH", type=non_empty_str,
                        help="verify a slice of a real trace (any format replay reads) "
                             "instead of a synthetic workload")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="with --trace: its first N requests (default 24)")
    parser.add_argument("--trace-max-tokens", type=positive_int,
                        default=None,
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
    parser.add_argument("--attention-chunk", type=positive_int, default=None,
                        help="chunk of chunked-local layers (tokens; --pattern llama4 "
                             "and mixed; default 16)")
    parser.add_argument("--hca-ratio", type=int, default=None,
                        help="--pattern v4: tokens per entry of the non-overlapping "
                             "compressed layers (V4: 128; default 16)")
    parser.add_argument("--compressed-block-size", type=int, default=None,
                        help="--pattern v4: tokens per compressed-entries block (V4: 256; "
                             "default 32)")
    parser.add_argument("--index-topk", type=int, default=None,
                        help="--pattern v4: entries a C4 layer's lightning indexer keeps per "
                             "query (0: no indexer, read every completed entry; default 4)")
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


_SCOPED_DEFAULTS: dict[str, tuple[str, object, str]] = {
    "limit": ("--limit", 24, "trace"), "trace_max_tokens": (
        "--trace-max-tokens", DEFAULT_TRACE_MAX_TOKENS, "trace"),
    "workload": ("--workload", "all", "workload"),
    "attention_chunk": ("--attention-chunk", 16, "llama4,mixed"),
    "hca_ratio": ("--hca-ratio", 16, "v4"), "compressed_block_size": (
        "--compressed-block-size", 32, "v4"), "index_topk": ("--index-topk", 4, "v4"),
}
"""Options that apply to one source or some patterns: attribute → (flag, default, where it
applies: ``trace``, ``workload`` or the patterns)."""


def _fill_scoped_defaults(args: argparse.Namespace) -> None:
    """Refuse an option that would be ignored (``--limit`` without ``--trace``,
    ``--hca-ratio`` with ``--pattern gemma3``, ``--workload`` with ``--trace``), then fill
    in the defaults of those left out.

    >>> ns = argparse.Namespace(trace=None, pattern="gemma3", limit=None,
    ...     trace_max_tokens=None, workload=None, attention_chunk=None, hca_ratio=3,
    ...     compressed_block_size=None, index_topk=None)
    >>> _fill_scoped_defaults(ns)
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: --hca-ratio=3 is invalid: applies to --pattern v4 only; \
drop it or add --pattern v4
    """
    for attribute, (flag, default, scope) in _SCOPED_DEFAULTS.items():
        value = getattr(args, attribute)
        if value is None:
            setattr(args, attribute, default)
            continue
        if scope == "trace" and args.trace is None:
            raise ConfigError(flag, value, "applies to --trace only; drop it or add --trace")
        if scope == "workload" and args.trace is not None:
            raise ConfigError(flag, value, "--trace replaces the synthetic workload; give "
                              "one of them")
        patterns = scope.split(",")
        if scope not in ("trace", "workload") and args.pattern not in (*patterns, "all"):
            raise ConfigError(flag, value, f"applies to --pattern {' and '.join(patterns)} "
                              f"only; drop it or add --pattern {patterns[0]}")


def _run_verify_command(args: argparse.Namespace) -> int:
    _fill_scoped_defaults(args)
    block_tokens = math.lcm(args.block_size, args.full_block_size or args.block_size)
    if args.trace is not None and args.trace_max_tokens < 2 * block_tokens:
        raise ConfigError("--trace-max-tokens", args.trace_max_tokens, f"prompts cut below "
                          f"two {block_tokens}-token blocks share no cached block, so every "
                          f"policy would pass unchecked; give at least {2 * block_tokens}")
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


__all__ = ["add_verify_arguments", "cmd_verify"]
