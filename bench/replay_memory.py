"""Resident memory across a long replay: flat after warm-up means no growth beyond the pool
and the live requests.

    T=../shared/traces/mooncake_synthetic/synthetic_trace.jsonl
    python bench/replay_memory.py --trace $T --model dsv4-bench --num-blocks 18481

Prints RSS (MiB) every ``--every`` finished requests; the interesting number is the
difference between the RSS at 25 % of the requests and at the end.
"""

from __future__ import annotations

import argparse
import os
import time

from hybridkv.models.shapes import load_model
from hybridkv.sim.replay import replay
from hybridkv.traces.loaders import load_trace


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--model", default="dsv4-bench")
    parser.add_argument("--num-blocks", type=int, default=18481)
    parser.add_argument("--policy", default="latest")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--every", type=int, default=500)
    args = parser.parse_args()
    trace = load_trace(args.trace, limit=args.limit)
    config = load_model(args.model).cache_config(args.num_blocks)
    samples: list[tuple[int, float]] = []
    started = time.perf_counter()
    print(f"before replay: {rss_mib():.0f} MiB ({len(trace.requests)} requests loaded)")

    def progress(num_finished: int, num_requests: int) -> None:
        if not samples or num_finished >= samples[-1][0] + args.every:
            samples.append((num_finished, rss_mib()))
            print(f"{num_finished:>6}/{num_requests} finished: {samples[-1][1]:.0f} MiB",
                  flush=True)

    result = replay(trace, config, args.policy, progress=progress)
    quarter = next(mib for done, mib in samples if done >= len(trace.requests) // 4)
    print(f"hit rate {100 * result.hit_rate:.2f}%, {time.perf_counter() - started:.0f} s; "
          f"RSS at 25 %: {quarter:.0f} MiB, at the end: {rss_mib():.0f} MiB "
          f"(growth {rss_mib() - quarter:+.0f} MiB)")


if __name__ == "__main__":
    main()
