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
import random
import time

import hybridkv.native
import hybridkv.pool
from hybridkv.cache import KVCacheManager
from hybridkv.models.shapes import load_model
from hybridkv.sim.replay import replay
from hybridkv.traces.loaders import load_trace


def _core() -> str:
    selection = hybridkv.native.SELECTED
    pool_file = str(hybridkv.pool.__file__)
    return ("cython" if pool_file.endswith(".so") and "hybridkv-native" not in pool_file
            else selection.mode if selection is not None else "?")


def micro(model: str, num_blocks: int, policy: str, num_requests: int, seed: int,
          ) -> dict[str, float]:
    """Manager calls only: ``num_requests`` prompts (one of 8 shared prefixes of 2–12 Ki
    tokens + a unique 1–6 Ki tail) admitted in 8,192-token chunks behind the admission gate,
    decoded for 64 tokens and finished, at most 16 running; hashes precomputed (untimed).
    Returns the loop's CPU seconds and the hit rate."""
    rng = random.Random(seed)
    config = load_model(model).cache_config(num_blocks)
    manager = KVCacheManager(config, policy)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(rng.randrange(2048, 12_288))]
                for _ in range(8)]
    prompts = []
    for index in range(num_requests):
        prompt = prefixes[rng.randrange(8)] + [
            rng.randrange(1, 50_000) for _ in range(rng.randrange(1024, 6144))]
        prompts.append((f"m{index}", prompt, manager.hasher.hash_blocks(prompt)))
    next_token = 100_000
    running: list[tuple[str, int]] = []  # (request, decode tokens left)
    hit_tokens = prompt_tokens = 0
    cpu_started = time.process_time()
    for req_id, prompt, hashes in prompts:
        manager.add_request(req_id, prompt, block_hashes=hashes)
        while True:
            hit = manager.find_longest_hit(req_id)
            first = min(8192, len(prompt) - hit.num_tokens)
            if manager.allocate_slots(req_id, first, hit, reserve_full_prompt=True) is not None:
                break
            oldest, _ = running.pop(0)  # no room: finish the oldest request early
            manager.remove_request(oldest)
        hit_tokens += hit.num_tokens
        prompt_tokens += len(prompt)
        done = hit.num_tokens + first
        while done < len(prompt):
            step = min(8192, len(prompt) - done)
            if manager.allocate_slots(req_id, step) is None:
                break
            done += step
        running.append((req_id, 64))
        if len(running) > 16:
            oldest, _ = running.pop(0)
            manager.remove_request(oldest)
        for position, (other, left) in enumerate(running):  # one decode step for all
            manager.append_token_ids(other, (next_token,))
            next_token += 1
            if manager.allocate_slots(other, 1) is None:
                continue
            running[position] = (other, left - 1)
        for other, left in [r for r in running if r[1] <= 0]:
            running.remove((other, left))
            manager.remove_request(other)
    for other, _ in running:
        manager.remove_request(other)
    return {"cpu_s": round(time.process_time() - cpu_started, 3),
            "hit_rate": hit_tokens / prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="replay this trace (else: --micro)")
    parser.add_argument("--micro", type=int, default=0, metavar="N",
                        help="manager-only micro benchmark with N synthetic requests")
    parser.add_argument("--model", default="dsv4-bench")
    parser.add_argument("--num-blocks", type=int, default=18481)
    parser.add_argument("--policy", default="prepend,latest,interval:32768")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    if args.trace is None:
        rows = {policy: micro(args.model, args.num_blocks, policy, args.micro or 300, 0)
                for policy in (p.strip() for p in args.policy.split(",") if p.strip())}
        print(json.dumps({"label": args.label, "core": _core(), "micro": args.micro or 300,
                          "model": args.model, "num_blocks": args.num_blocks,
                          "policies": rows}), flush=True)
        return
    trace = load_trace(args.trace, limit=args.limit)
    config = load_model(args.model).cache_config(args.num_blocks)
    core = _core()
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
