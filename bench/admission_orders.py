"""Admission orders against ``fcfs``: hit rate, waiting cost, manager + scheduler time.

Usage (a markdown table on stdout, one row per trace × pool × policy × order)::

    python bench/admission_orders.py --trace ../shared/traces/weka_cc_agentic --limit 600 \\
        --model dsv4-bench --num-blocks 5681,18481 \\
        --policy latest,interval:32768+predict+recompute --admission fcfs,hit,warm

Each order is replayed ``--repeat`` times, the orders interleaved (fcfs, hit, …, fcfs,
hit, …) so machine-load drift hits them alike; hit rates and waits are deterministic, the
time is the fastest run. ``time ×`` is manager + scheduler CPU seconds (``RunResult.
scheduler_seconds``: inside ``schedule``/``update``, prompt hashing excluded) over fcfs's.
"""

from __future__ import annotations

import argparse

from hybridkv.sim.admission import parse_admissions
from hybridkv.sim.loaders import load_trace
from hybridkv.sim.model import load_model
from hybridkv.sim.replay import ReplaySettings, RunResult, replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--model", default="dsv4-bench")
    parser.add_argument("--num-blocks", required=True, help="comma-separated pool sizes")
    parser.add_argument("--policy", default="latest")
    parser.add_argument("--admission", default="fcfs,warm")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    trace = load_trace(args.trace, limit=args.limit)
    shape = load_model(args.model)
    orders = parse_admissions(args.admission)
    if orders[0] != "fcfs":
        orders = ["fcfs", *[o for o in orders if o != "fcfs"]]
    name = trace.name + (f" (first {args.limit})" if args.limit else "")
    print("| trace | blocks | policy | order | hit rate | vs fcfs | wait p50 / p99 / max "
          "steps | p99 × fcfs | mgr+sched s | time × fcfs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for num_blocks in (int(n) for n in args.num_blocks.split(",")):
        config = shape.cache_config(num_blocks, max_num_batched_tokens=8192)
        for policy in args.policy.split(","):
            results: dict[str, RunResult] = {}
            seconds: dict[str, float] = {}
            for _ in range(args.repeat):
                for order in orders:
                    result = replay(trace, config, policy, ReplaySettings(admission=order))
                    results[order] = result
                    seconds[order] = min(seconds.get(order, float("inf")),
                                         result.scheduler_seconds)
            base = results["fcfs"]
            for order in orders:
                r = results[order]
                p99_ratio = r.wait_p99_steps / base.wait_p99_steps \
                    if base.wait_p99_steps else float("nan")
                print(f"| {name} | {num_blocks:,} | `{policy}` | {order} | "
                      f"{100 * r.hit_rate:.2f}% | {100 * (r.hit_rate - base.hit_rate):+.2f} | "
                      f"{r.wait_p50_steps:,.0f} / {r.wait_p99_steps:,.0f} / "
                      f"{r.wait_max_steps:,} | {p99_ratio:.2f} | {seconds[order]:.2f} | "
                      f"{seconds[order] / seconds['fcfs']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
