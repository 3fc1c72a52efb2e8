"""``hybridkv check-trace``: validate a trace and print its statistics."""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console

from hybridkv.errors import ConfigError
from hybridkv.models.shapes import load_model
from hybridkv.sim.ceiling import infinite_cache_ceiling
from hybridkv.sim.run import DEFAULT_MODEL
from hybridkv.traces.loaders import load_trace


def cmd_check_trace(args: argparse.Namespace, console: Console, err_console: Console) -> int:
    trace = load_trace(args.path, limit=args.limit)
    shape = load_model(DEFAULT_MODEL if args.model is None else args.model)
    alignment = shape.cache_config(2).alignment_tokens
    lengths = [r.input_length for r in trace.requests]
    if not lengths:
        raise ConfigError("path", args.path, "the trace holds no requests")
    sessions = {r.session_id for r in trace.requests if r.session_id is not None}
    ceiling = infinite_cache_ceiling(trace, alignment)
    quantiles = statistics.quantiles(lengths, n=100) if len(lengths) > 1 else [lengths[0]] * 99
    console.print(f"trace        {trace.name}")
    console.print(f"requests     {len(lengths):,}   sessions {len(sessions):,}")
    console.print(f"input tokens total {sum(lengths):,}   mean {statistics.fmean(lengths):,.0f}"
                  f"   p50 {quantiles[49]:,.0f}   p99 {quantiles[98]:,.0f}")
    outputs = [r.output_length for r in trace.requests]
    console.print(f"output tokens total {sum(outputs):,}   mean {statistics.fmean(outputs):,.1f}")
    console.print(f"ceiling      {100 * ceiling.hit_rate:.2f}% (infinite cache, hits aligned to "
                  f"{alignment} tokens of {shape.name})")
    del err_console
    return 0


__all__ = ["cmd_check_trace"]
