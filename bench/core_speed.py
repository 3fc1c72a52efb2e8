"""Speed of one core build on one replay: pure Python vs mypyc vs Cython (issue 16 part 1).

Runs ``hybridkv.sim.replay.replay`` (trace loading excluded) in this process, once per
policy, and prints one JSON line: the core in use, per policy the replay's wall seconds,
manager seconds (inside the manager's calls) and hit rate (to check that every build gives
the same hits). Which core runs is chosen outside: ``HYBRIDKV_PURE_PYTHON=1`` for pure
Python, nothing for the mypyc build of these sources, or ``PYTHONPATH`` pointing at a copy
of ``src`` whose modules sit beside their Cython extensions (plus ``HYBRIDKV_PURE_PYTHON=1``
so that the mypyc finder stays out of the way)::

    T=../shared/traces/mooncake_synthetic/synthetic_trace.jsonl
    for core in pure mypyc cython; do ... python bench/core_speed.py --trace $T --limit 800 \\
        --model dsv4-bench --num-blocks 18481 --policy prepend,latest,interval:32768; done
"""

from __future__ import annotations

import argparse
import json
import time

import hybridkv.native
import hybridkv.pool
from hybridkv.sim.loaders import load_trace
from hybridkv.sim.model import load_model
from hybridkv.sim.replay import replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--model", default="dsv4-bench")
    parser.add_argument("--num-blocks", type=int, default=18481)
    parser.add_argument("--policy", default="prepend,latest,interval:32768")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    trace = load_trace(args.trace, limit=args.limit)
    config = load_model(args.model).cache_config(args.num_blocks)
    selection = hybridkv.native.SELECTED
    pool_file = str(hybridkv.pool.__file__)
    core = ("cython" if pool_file.endswith(".so") and "hybridkv-native" not in pool_file
            else selection.mode if selection is not None else "?")
    rows = {}
    for policy in (p.strip() for p in args.policy.split(",") if p.strip()):
        started, cpu_started = time.perf_counter(), time.process_time()
        result = replay(trace, config, policy)
        rows[policy] = {"cpu_s": round(time.process_time() - cpu_started, 3),
                        "wall_s": round(time.perf_counter() - started, 3),
                        "manager_s": round(result.manager_seconds, 3),
                        "hit_rate": result.hit_rate}
    print(json.dumps({"label": args.label, "core": core, "requests": len(trace),
                      "model": args.model, "num_blocks": args.num_blocks, "policies": rows}),
          flush=True)


if __name__ == "__main__":
    main()
