"""Admission orders against ``fcfs``: hit rate, waiting cost, manager + scheduler time.

Usage (a markdown table on stdout, one row per trace × pool × policy × order)::

    python bench/admission_orders.py --trace ../shared/traces/weka_cc_agentic --limit 600 \\
        --model dsv4-bench --num-blocks 5681,18481 \\
        --policy latest,interval:32768+predict+recompute --admission fcfs,hit,warm --repeat 3

Each order is replayed ``--repeat`` times in this one process, the orders interleaved
(fcfs, warm, fcfs, warm, …) so machine-load drift hits them alike. Hit rates and waits are
deterministic (the bench checks that the repeats agree); the time is manager + scheduler
CPU seconds (``RunResult.scheduler_seconds``: inside ``schedule``/``update``, prompt
hashing excluded). ``time ×`` is the median over the repeats of each repeat's ratio to the
fcfs run next to it, with the smallest and largest ratio (the spread) in brackets.

``--json PATH`` also writes every run (one object per replay: hit rate, waits, seconds,
miss causes, and with ``--bounds`` the run's ``bound`` / ``bound_fa``) so that runs made
in separate processes can be put into one table with ``--render A.json B.json …``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from hybridkv.models.shapes import load_model
from hybridkv.sched.admission import parse_admissions
from hybridkv.sim.replay import ReplaySettings, RunResult, attach_bounds, replay
from hybridkv.traces.loaders import load_trace

HEADER = ("| trace | blocks | policy | order | hit rate | vs fcfs | wait p50 / p99 / max steps "
          "| p99 × fcfs | mgr+sched s (median of n) | time × fcfs (median [min–max]) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def run_record(name: str, num_blocks: int, policy: str, order: str, repeat: int,
               result: RunResult) -> dict[str, Any]:
    """One replay as a JSON-able record."""
    record: dict[str, Any] = {
        "trace": name, "num_blocks": num_blocks, "policy": policy, "order": order,
        "repeat": repeat, "hit_rate": result.hit_rate, "hit_tokens": result.hit_tokens,
        "prompt_tokens": result.prompt_tokens, "wait_p50": result.wait_p50_steps,
        "wait_p99": result.wait_p99_steps, "wait_max": result.wait_max_steps,
        "seconds": result.scheduler_seconds, "wall_seconds": result.wall_seconds,
        "misses": result.misses.as_dict(),
    }
    if result.bound is not None:
        record["bound"] = result.bound
        record["bound_fa"] = result.bound_fa
    return record


def render(records: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    """The markdown table of ``records`` (rows in first-seen order; fcfs is the base of
    each trace × pool × policy; time ratios pair the n-th fcfs repeat with the n-th of
    each order)."""
    rows: dict[tuple[str, int, str], dict[str, list[dict[str, Any]]]] = {}
    for record in records:
        key = (record["trace"], record["num_blocks"], record["policy"])
        rows.setdefault(key, {}).setdefault(record["order"], []).append(record)
    print(HEADER, file=out)
    for (name, num_blocks, policy), by_order in rows.items():
        base_runs = sorted(by_order.get("fcfs", []), key=lambda r: r["repeat"])
        orders = sorted(by_order, key=lambda o: (o != "fcfs", list(by_order).index(o)))
        for order in orders:
            runs = sorted(by_order[order], key=lambda r: r["repeat"])
            first = runs[0]
            for other in runs[1:]:  # deterministic replays: the repeats must agree
                assert other["hit_tokens"] == first["hit_tokens"], (name, policy, order)
                assert other["wait_p99"] == first["wait_p99"], (name, policy, order)
            seconds = statistics.median(r["seconds"] for r in runs)
            if base_runs:
                base = base_runs[0]
                delta = f"{100 * (first['hit_rate'] - base['hit_rate']):+.2f}"
                p99 = (f"{first['wait_p99'] / base['wait_p99']:.2f}" if base["wait_p99"]
                       else "n/a")
                pairs = zip(runs, base_runs, strict=False)
                ratios = [r["seconds"] / b["seconds"] for r, b in pairs if b["seconds"] > 0]
                time_ratio = (f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–"
                              f"{max(ratios):.2f}]" if ratios else "n/a")
            else:
                delta = p99 = time_ratio = "n/a"
            print(f"| {name} | {num_blocks:,} | `{policy}` | {order} | "
                  f"{100 * first['hit_rate']:.2f}% | {delta} | "
                  f"{first['wait_p50']:,.0f} / {first['wait_p99']:,.0f} / "
                  f"{first['wait_max']:,} | {p99} | {seconds:.2f} (n={len(runs)}) | "
                  f"{time_ratio} |", file=out, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--model", default="dsv4-bench")
    parser.add_argument("--num-blocks", help="comma-separated pool sizes")
    parser.add_argument("--policy", default="latest")
    parser.add_argument("--admission", default="fcfs,warm")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--bounds", action="store_true",
                        help="also compute each run's bound / bound_fa (its own order)")
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    parser.add_argument("--render", nargs="+", type=Path, default=None,
                        help="print the table of runs from these --json files and exit")
    args = parser.parse_args()
    if args.render:
        render([r for path in args.render for r in json.loads(path.read_text())])
        return
    if not args.trace or not args.num_blocks:
        parser.error("--trace and --num-blocks are required (or --render)")
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give a positive number of repeats")
    trace = load_trace(args.trace, limit=args.limit)
    shape = load_model(args.model)
    orders = parse_admissions(args.admission)
    if "fcfs" in orders:  # the base of every ratio runs first in each repeat
        orders = ["fcfs", *[o for o in orders if o != "fcfs"]]
    name = trace.name + (f" (first {args.limit})" if args.limit else "")
    records: list[dict[str, Any]] = []
    for num_blocks in (int(n) for n in args.num_blocks.split(",")):
        config = shape.cache_config(num_blocks, max_num_batched_tokens=8192)
        for policy in args.policy.split(","):
            for repeat in range(args.repeat):
                for order in orders:
                    result = replay(trace, config, policy, ReplaySettings(admission=order))
                    if args.bounds and repeat == 0:
                        attach_bounds(result, trace, config)
                    records.append(run_record(name, num_blocks, policy, order, repeat,
                                              result))
                    print(f"# {name} {num_blocks} {policy} {order} #{repeat}: "
                          f"{100 * result.hit_rate:.2f}% {result.scheduler_seconds:.2f} s",
                          file=sys.stderr, flush=True)
                    if args.json is not None:
                        args.json.write_text(json.dumps(records, indent=1))
    render(records)


if __name__ == "__main__":
    main()
