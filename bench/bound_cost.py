"""Time and peak memory of the offline bounds on one trace, each in its own process.

    W=../shared/traces/weka_cc_agentic
    python bench/bound_cost.py --trace $W --model gemma3-bench --num-blocks 308305

Runs, in fresh processes one after another: the legacy block MIN (``offline_optimum``, the
``bound`` of before issue 15, trace order), ``bound_fa`` and ``bound`` (``fa_optimum`` /
``hybrid_optimum`` over a trace-order admission log). ``bound``'s held blocks are a
deterministic profile — ``--held-fraction`` of the pool at every admission, ±50% in a
sawtooth — and its pins too: every admission holds all its units for ``--hold-events``
admissions (16: ``--max-running``'s default), since a real log needs a full replay; the
cost does not depend on the values beyond how often the capacity binds. Prints seconds
and peak RSS (MiB) of each, and the ratios to the legacy bound. Trace loading is timed
apart and excluded.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

from hybridkv.models.shapes import load_model
from hybridkv.sim.bound import (
    AdmissionLog,
    BoundShape,
    fa_optimum,
    hybrid_optimum,
    offline_optimum,
)
from hybridkv.traces.loaders import load_trace

KINDS = ("legacy", "bound_fa", "bound")


def measure(args: argparse.Namespace) -> None:
    trace = load_trace(args.trace, limit=args.limit)
    config = load_model(args.model).cache_config(args.num_blocks)
    shape = BoundShape.of(config)
    assert shape is not None
    log = AdmissionLog.in_trace_order(trace)
    base = int(args.held_fraction * (args.num_blocks - 1))
    for e in range(len(log)):
        log.held_blocks[e] = base // 2 + (e * 7919) % (base + 1)
        log.release[e] = e + args.hold_events - 1
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    if args.kind == "legacy":
        totals = offline_optimum(trace, (args.num_blocks - 1) * shape.fa_block_size,
                                 shape.fa_block_size, config.alignment_tokens)
    elif args.kind == "bound_fa":
        totals = fa_optimum(trace, log, shape)
    else:
        totals = hybrid_optimum(trace, log, shape)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.kind} {seconds:.1f} {peak:.0f} {rss_before:.0f} {100 * totals.hit_rate:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--model", default="gemma3-bench")
    parser.add_argument("--num-blocks", type=int, default=308305)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--held-fraction", type=float, default=0.2)
    parser.add_argument("--hold-events", type=int, default=16)
    parser.add_argument("--kind", choices=KINDS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind is not None:
        measure(args)
        return
    results = {}
    for kind in KINDS:
        command = [sys.executable, __file__, "--trace", args.trace, "--model", args.model,
                   "--num-blocks", str(args.num_blocks), "--held-fraction",
                   str(args.held_fraction), "--hold-events", str(args.hold_events),
                   "--kind", kind]
        if args.limit is not None:
            command += ["--limit", str(args.limit)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        name, seconds, peak, loaded, rate = out.split()
        results[name] = (float(seconds), float(peak))
        print(f"{name:9s} {float(seconds):7.1f} s  peak RSS {float(peak):6.0f} MiB "
              f"(trace loaded: {float(loaded):.0f} MiB)  hit rate {rate}%", flush=True)
    legacy_s, legacy_mib = results["legacy"]
    for kind in ("bound_fa", "bound"):
        seconds, mib = results[kind]
        print(f"{kind} / legacy: time {seconds / legacy_s:.2f}x, peak RSS "
              f"{mib / legacy_mib:.2f}x")


if __name__ == "__main__":
    main()
