"""Overhead of KV events on the cache manager (issue 17 acceptance).

Replays one workload in fresh processes, interleaved round-robin so that machine load hits
every variant alike, and reports medians and ratios from the one run:

- ``base``: the code before the event hook (``--base-src``: a ``src`` directory of an
  older checkout, e.g. ``git archive <commit> src | tar -x -C /tmp/base``);
- ``off``: this checkout, events off (the default);
- ``on``: this checkout, events on, every step's events taken (``take_events``) and
  encoded as a vLLM ``KVEventBatch`` (what ``--events`` publishes; no socket).

Measured per replay: CPU seconds of the whole replay (``time.process_time``: the process
is single-threaded, so other processes' load does not inflate it) and the manager's own
``manager_seconds`` (time inside lookup / allocate / free, switched to CPU time here), which
for ``on`` includes resolving the pool's records into events (the encoding is not). The
order of the variants rotates every repetition; every process gets ``PYTHONHASHSEED=0`` (the
manager's dictionaries are keyed by byte hashes: a random seed changes their layout and the
time per process by ±20 %). ::

    git archive <commit-before-events> src | tar -x -C /tmp/base
    PYTHONPATH=$PWD/src python bench/events_overhead.py --base-src /tmp/base/src \\
        --model gemma3-bench --num-blocks 6000 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time, types
import hybridkv.cache
# manager_seconds in CPU time: the same clock as cpu_s, blind to other processes' load
hybridkv.cache.time = types.SimpleNamespace(perf_counter=time.process_time)
from hybridkv.models.shapes import load_model
from hybridkv.sim.replay import ReplaySettings, replay
from hybridkv.traces.workloads import agentic
variant, model, num_blocks, sessions, turns, policy = sys.argv[1:7]
config = load_model(model).cache_config(int(num_blocks))
trace = agentic(num_sessions=int(sessions), num_turns=int(turns), first_prompt_tokens=8000,
                turn_tokens=2000, output_tokens=128, seed=1)
observers = ()
counts = {"events": 0, "bytes": 0}
if variant == "on":
    from hybridkv.events import KVEventBatch, encode_batch
    class Encode:
        def attach(self, manager, scheduler, label):
            manager.start_kv_cache_events()
        def on_step(self, manager, scheduler):
            events = manager.take_events()
            if events:
                counts["events"] += len(events)
                counts["bytes"] += len(encode_batch(KVEventBatch(ts=time.time(), events=events,
                                                                  data_parallel_rank=0)))
        def detach(self, manager, scheduler, misses):
            self.on_step(manager, scheduler)
    observers = (Encode(),)
settings = ReplaySettings(observers=observers) if observers else ReplaySettings()
cpu = time.process_time()
result = replay(trace, config, policy, settings)
cpu = time.process_time() - cpu
print(json.dumps({"cpu_s": cpu, "manager_s": result.manager_seconds,
                  "hit_rate": result.hit_rate, "evicted": result.evicted_blocks, **counts}))
"""


def run(variant: str, src: str, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": "0"}  # same dict layouts
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, variant, args.model, str(args.num_blocks),
         str(args.sessions), str(args.turns), args.policy],
        env=env, check=False, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{variant} failed: {proc.stderr.strip().splitlines()[-1]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-src", required=True, type=Path)
    parser.add_argument("--model", default="gemma3-bench")
    parser.add_argument("--num-blocks", type=int, default=6000)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--policy", default="prepend")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--before-src", type=Path, default=None,
                        help="also run events on with this src (an earlier event log): "
                        "variant 'on-before'")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parent.parent / "src")
    variants = {"base": str(args.base_src), "off": here, "on": here}
    if args.before_src is not None:
        variants["on-before"] = str(args.before_src)
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    names = list(variants)
    for rep in range(args.reps):
        shift = rep % len(names)
        for variant in names[shift:] + names[:shift]:
            samples[variant].append(run(variant.removesuffix("-before"), variants[variant],
                                        args))
            print(f"rep {rep} {variant}: {samples[variant][-1]}", flush=True)
    med = {v: {k: statistics.median(s[k] for s in runs) for k in ("cpu_s", "manager_s")}
           for v, runs in samples.items()}
    spread = {v: {k: (min(s[k] for s in runs), max(s[k] for s in runs))
                  for k in ("cpu_s", "manager_s")} for v, runs in samples.items()}
    hit_rates = {v: runs[0]["hit_rate"] for v, runs in samples.items()}
    assert len(set(hit_rates.values())) == 1, f"variants replayed differently: {hit_rates}"
    report = {
        "median": med, "min_max": spread, "hit_rate": hit_rates["off"],
        "events_per_replay": samples["on"][0]["events"],
        "encoded_bytes_per_replay": samples["on"][0]["bytes"],
        "ratio_off_vs_base": {k: med["off"][k] / med["base"][k] for k in ("cpu_s", "manager_s")},
        "ratio_on_vs_off": {k: med["on"][k] / med["off"][k] for k in ("cpu_s", "manager_s")},
    }
    if "on-before" in med:
        report["ratio_on_before_vs_off"] = {
            k: med["on-before"][k] / med["off"][k] for k in ("cpu_s", "manager_s")}
    print(json.dumps(report, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
