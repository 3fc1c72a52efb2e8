"""Infinite-cache ceilings of a trace or workload at several hit units (issue 13).

``hybridkv replay`` reports the ceiling at the model's hit alignment (784 tokens for
qwen3.5-27b); ``ckpt:branch`` hits every 16 tokens, so its ceiling is the one at 16.

    python bench/hit_unit_ceiling.py --workload short-prompts --units 784,16
    python bench/hit_unit_ceiling.py --trace PATH [--limit 600] --units 784,16
"""

from __future__ import annotations

import argparse

from hybridkv.sim.ceiling import infinite_cache_ceiling
from hybridkv.traces.trace import Trace
from hybridkv.traces.workloads import make_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace")
    source.add_argument("--workload")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--units", default="784,16")
    args = parser.parse_args()
    if args.trace is not None:
        from hybridkv.traces.loaders import load_trace
        trace = load_trace(args.trace, limit=args.limit)
    else:
        trace = make_workload(args.workload)
        if args.limit is not None:
            trace = Trace(trace.name, trace.requests[: args.limit])
    for unit in (int(u) for u in args.units.split(",")):
        totals = infinite_cache_ceiling(trace, unit)
        print(f"{trace.name}: ceiling at {unit}-token hits = {totals.hit_rate:.2%} "
              f"({totals.hit_tokens:,} / {totals.prompt_tokens:,} prompt tokens)")


if __name__ == "__main__":
    main()
