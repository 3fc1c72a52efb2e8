"""Where an admission order's missed tokens are: miss causes split by whether the request
waited (issue 18: why `warm` gains 6.6 points, not 10, on the whole WEKA subset at 18,481
blocks, `latest`).

Usage (one JSON line per order on stdout; percentages are of all prompt tokens)::

    python bench/admission_misses.py --trace ../shared/traces/weka_cc_agentic \\
        --num-blocks 18481 --policy latest --admission fcfs,warm [--limit N] [--json out.json]

Each first admission's miss causes (``sim/misses.py``: cold / evicted / tail / alignment /
admission) are summed into ``wait0`` (admitted at the step it became eligible) and
``waited`` buckets, with the bucket's share of the prompt tokens and its hit. Worked
example: whole WEKA, 18,481 blocks, `latest`, `warm`: evicted 3.544 points of which 3.543
in ``waited`` (29.2% of the prompt tokens) — the residual misses are contexts evicted
while their request waited, which an order can only redistribute.

Runs on the pure-Python core (it observes ``ObservedManager._classify`` per request; the
compiled classes cannot be patched): ``HYBRIDKV_PURE_PYTHON`` is set before the import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["HYBRIDKV_PURE_PYTHON"] = "1"

from hybridkv.errors import HybridKVError
from hybridkv.models.shapes import load_model
from hybridkv.sched import scheduler as scheduler_module
from hybridkv.sched.admission import parse_admissions
from hybridkv.sim import misses
from hybridkv.sim.replay import ReplaySettings, replay
from hybridkv.traces.loaders import load_trace

CAUSES = misses.MISS_CAUSES


def run(trace_path: str, limit: int | None, model: str, num_blocks: int, policy: str,
        order: str) -> dict[str, Any]:
    """One replay; its miss causes by bucket (tokens), hit rate and waits."""
    per_request: dict[str, dict[str, int]] = {}
    requests: dict[str, scheduler_module.SchedRequest] = {}
    last: list[misses.MissCauses] = []
    split_miss, classify = misses.split_miss, misses.ObservedManager._classify
    add_request = scheduler_module.Scheduler.add_request

    def observed_split(*args: Any, **kwargs: Any) -> misses.MissCauses:
        causes = split_miss(*args, **kwargs)
        last.append(causes)
        return causes

    def observed_classify(self: misses.ObservedManager, req_id: str, hit_tokens: int) -> None:
        classify(self, req_id, hit_tokens)
        per_request[req_id] = last.pop().as_dict()

    def observed_add(self: scheduler_module.Scheduler,
                     request: scheduler_module.SchedRequest) -> None:
        requests[request.req_id] = request
        add_request(self, request)

    misses.split_miss = observed_split
    misses.ObservedManager._classify = observed_classify  # type: ignore[method-assign]
    scheduler_module.Scheduler.add_request = observed_add  # type: ignore[method-assign]
    try:
        trace = load_trace(trace_path, limit=limit)
        config = load_model(model).cache_config(num_blocks, max_num_batched_tokens=8192)
        result = replay(trace, config, policy, ReplaySettings(admission=order))
    finally:
        misses.split_miss = split_miss
        misses.ObservedManager._classify = classify  # type: ignore[method-assign]
        scheduler_module.Scheduler.add_request = add_request  # type: ignore[method-assign]
    buckets: dict[str, dict[str, int]] = {}
    for req_id, causes in per_request.items():
        request = requests[req_id]
        assert request.admitted_step is not None and request.eligible_step is not None
        bucket = buckets.setdefault(
            "wait0" if request.admitted_step == request.eligible_step else "waited",
            {"requests": 0, "prompt": 0, "hit": 0, **dict.fromkeys(CAUSES, 0)})
        bucket["requests"] += 1
        bucket["prompt"] += len(request.prompt_token_ids)
        bucket["hit"] += request.first_hit_tokens or 0
        for cause, tokens in causes.items():
            bucket[cause] += tokens
    total = result.prompt_tokens
    return {
        "trace": trace_path, "limit": limit, "num_blocks": num_blocks, "policy": policy,
        "order": order, "hit_rate": result.hit_rate, "prompt_tokens": total,
        "wait_p50_p99_max": [result.wait_p50_steps, result.wait_p99_steps,
                             result.wait_max_steps],
        "misses_pct": {c: round(100 * t / total, 3) for c, t in result.misses.as_dict().items()},
        "buckets_pct": {name: {"requests": b["requests"],
                               **{k: round(100 * b[k] / total, 3) for k in b if k != "requests"}}
                        for name, b in sorted(buckets.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--model", default="dsv4-bench")
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--policy", default="latest")
    parser.add_argument("--admission", default="fcfs,warm")
    parser.add_argument("--json", type=Path, default=None, help="also write the runs here")
    args = parser.parse_args()
    if args.num_blocks <= 0 or (args.limit is not None and args.limit <= 0):
        parser.error("--num-blocks and --limit must be positive")
    try:
        records = [run(args.trace, args.limit, args.model, args.num_blocks, args.policy, order)
                   for order in parse_admissions(args.admission)]
    except HybridKVError as error:
        print(f"admission_misses: {error}", file=sys.stderr)
        sys.exit(2)
    for record in records:
        print(json.dumps(record))
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
