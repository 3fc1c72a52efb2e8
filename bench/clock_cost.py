"""What ``--clock time`` costs: the same replay on the step clock and the time clock.

Replays the first ``--limit`` requests of a trace under one policy, alternating the two
clocks ``--repeats`` times in one process, and prints each run's CPU seconds
(``time.process_time``: other processes on a shared machine do not inflate it) and the
ratio of the medians (acceptance of issue 27: at most 1.3).

    PYTHONPATH=src python bench/clock_cost.py                 # mooncake_synthetic, 1,000
    PYTHONPATH=src python bench/clock_cost.py --trace ../shared/traces/weka_cc_agentic \\
        --limit 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

from hybridkv.models.shapes import load_model
from hybridkv.sim.replay import ReplaySettings, replay
from hybridkv.sim.timed import TimeSettings
from hybridkv.traces.loaders import load_trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace",
                        default="/work/shared/traces/mooncake_synthetic/synthetic_trace.jsonl")
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--model", default="gemma3-bench")
    parser.add_argument("--num-blocks", type=int, default=20_000)
    parser.add_argument("--policy", default="latest")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    trace = load_trace(args.trace, limit=args.limit)
    config = load_model(args.model).cache_config(args.num_blocks)
    step = ReplaySettings()
    timed = replace(step, timing=TimeSettings(args.model, time_scale=args.time_scale))
    seconds: dict[str, list[float]] = {"step": [], "time": []}
    for _ in range(args.repeats):
        for clock, settings in (("step", step), ("time", timed)):
            started = time.process_time()
            result = replay(trace, config, args.policy, settings)
            seconds[clock].append(time.process_time() - started)
            extra = (f", TTFT p99 {result.time['ttft_p99_s']:.2f} s" if result.time else "")
            print(f"{clock:>4}: {seconds[clock][-1]:.2f} CPU s, {result.steps:,} steps, "
                  f"hit rate {result.hit_rate:.2%}{extra}", flush=True)
    ratio = statistics.median(seconds["time"]) / statistics.median(seconds["step"])
    print(f"{trace.name} ({len(trace.requests)} requests, {args.model}, {args.policy}): "
          f"time clock / step clock = {ratio:.3f} (medians of {args.repeats}; target <= 1.3)")
    return 0 if ratio <= 1.3 else 1


if __name__ == "__main__":
    sys.exit(main())
