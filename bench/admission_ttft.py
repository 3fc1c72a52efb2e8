"""Engine TTFT under admission orders (issue 18): a ``weka_cc_agentic`` slice with several
conversations running at once, on the reference engine.

Run on one CUDA GPU (``PYTHONPATH=src python bench/admission_ttft.py``) or as a CPU smoke
test (``--quick``: a tiny model, prompts cut to a few hundred tokens).

Workload: the first ``--conversations`` sessions of the trace (trace order) whose first
``--turns`` requests all have at most ``--max-in`` input tokens; those requests, in trace
order (conversations interleave), prompts expanded per the replay protocol
(``sim.trace.expand_prompt``), ``--output-tokens`` greedy tokens each. All are queued at
the start; a session's next turn becomes eligible when its previous one finishes (the
shared scheduler's closed-loop rule), so ``--max-running`` conversations run at once and
the rest wait. Model: the Gemma-3-1B shape of "Engine TTFT (GPU)" (26 layers, 22 sliding
with window 512 + 4 global, random bf16 weights, flex/SDPA fast path, compiled pointwise
ops), block 64, chunked prefill under one ``--chunk-size`` token budget per step, a pool of
``--num-blocks`` (small enough that conversations evict each other's KV).

For each policy and each admission order (``--admission``; orders interleaved, each
configuration run ``--repeats`` times, the median kept):

- **TTFT** per request = its eligibility (start of the scheduler step at which it became
  eligible) → its first sampled token, device synchronised: the TTFT a client sees,
  waiting in the queue included. p50 / p99 / max, and the same from admission only.
- hit rate, waiting steps (eligibility → admission) p50 / p99, preemptions, run wall time.
- **Sanity**: each run's admissions (eligible step, admitted step, hit tokens per request)
  must equal those of a bare shared ``Scheduler`` over a fresh manager fed the tokens the
  engine sampled: the engine admits through the shared admission policy, nothing else.

Results: a table on stdout, ``admission_ttft.json`` and ``admission_ttft.md`` under
``--out`` (default ``$OUT`` when set, else ``out/admission_ttft``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_ttft as et

from hybridkv import KVCacheManager
from hybridkv.config import CacheConfig
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, cache_config_for_model
from hybridkv.engine.paged import PagedKVCache
from hybridkv.engine.runner import (
    Admissions,
    EngineRunner,
    RunOptions,
    RunResult,
    scheduler_admissions,
)
from hybridkv.sched.admission import parse_admissions
from hybridkv.sched.scheduler import SchedRequest, Scheduler
from hybridkv.traces.loaders import load_trace
from hybridkv.traces.trace import expand_prompt

TRACE_DIRS = ("out/traces/weka_cc_agentic", "../shared/traces/weka_cc_agentic",
              "/work/shared/traces/weka_cc_agentic")


def find_trace(arg: str | None) -> Path:
    for candidate in [arg] if arg else list(TRACE_DIRS):
        path = Path(candidate)
        if path.is_dir() and any(path.glob("trace_*.json*")):
            return path
    raise SystemExit(f"admission_ttft: no weka_cc_agentic trace directory at "
                     f"{arg or ', '.join(TRACE_DIRS)}; pass --trace-dir")


def load_conversations(directory: Path, *, conversations: int, turns: int, max_in: int,
                       output_tokens: int, scan: int, cut: int | None,
                       ) -> list[SchedRequest]:
    """The first ``conversations`` sessions whose first ``turns`` requests have at most
    ``max_in`` input tokens (among the first ``scan`` requests of the trace), their first
    ``turns`` requests in trace order. ``cut``: keep only the first ``cut`` prompt tokens
    (CPU smoke runs; prefix sharing is kept)."""
    trace = load_trace(directory, limit=scan)
    by_session: dict[str, list[int]] = defaultdict(list)
    for index, request in enumerate(trace.requests):
        by_session[request.session_id or request.request_id].append(index)
    chosen: list[int] = []
    for indices in by_session.values():
        first = indices[:turns]
        if len(first) == turns and all(trace.requests[i].input_length <= max_in
                                       for i in first):
            chosen.extend(first)
            conversations -= 1
            if conversations == 0:
                break
    requests = []
    for index in sorted(chosen):
        request = trace.requests[index]
        prompt = expand_prompt(request, index)
        requests.append(SchedRequest(request.request_id, prompt[:cut] if cut else prompt,
                                     output_tokens, request.session_id))
    return requests


def bare_scheduler_admissions(cache: CacheConfig, policy: str, admission: str,
                               options: RunOptions, requests: Sequence[SchedRequest],
                               outputs: dict[str, list[int]]) -> Admissions:
    """The same requests through a bare shared ``Scheduler`` (no model), sampling the tokens
    the engine sampled: per request (eligible step, admitted step, first hit tokens)."""
    scheduler = Scheduler(KVCacheManager(cache, policy), max_running=options.max_running,
                          chunk_size=options.chunk_size, admission=admission)
    for r in requests:
        scheduler.add_request(SchedRequest(r.req_id, list(r.prompt_token_ids),
                                           r.max_output_tokens, r.session_id))
    return scheduler_admissions(scheduler, dict(outputs))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 100]): p99 of 60 values is the largest.

    >>> percentile([3.0, 1.0, 2.0], 50), percentile(list(range(1, 101)), 99)
    (2.0, 99)
    """
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summarise(result: RunResult) -> dict[str, Any]:
    records = list(result.records.values())
    queued = [r.queued_ttft_s or 0.0 for r in records]
    own = [r.ttft_s or 0.0 for r in records]
    waits = [(r.admitted_step or 0) - (r.eligible_step or 0) for r in records]
    return {
        "requests": len(records), "prompt_tokens": result.prompt_tokens,
        "hit_tokens": result.hit_tokens,
        "hit_rate": result.hit_tokens / max(1, result.prompt_tokens),
        "ttft_p50_s": percentile(queued, 50), "ttft_p99_s": percentile(queued, 99),
        "ttft_max_s": max(queued), "ttft_mean_s": statistics.fmean(queued),
        "admitted_ttft_p50_s": percentile(own, 50), "admitted_ttft_p99_s": percentile(own, 99),
        "wait_steps_p50": percentile(waits, 50), "wait_steps_p99": percentile(waits, 99),
        "preemptions": result.num_preemptions, "steps": result.num_steps,
        "wall_s": result.wall_s,
        "ttft_s": {r.req_id: round(r.queued_ttft_s or 0.0, 4) for r in records},
    }


def run_matrix(args: argparse.Namespace, model: HybridDecoder, cache: CacheConfig,
               attention: Any, kv_cache: PagedKVCache, requests: list[SchedRequest],
               deadline: float) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    orders = parse_admissions(args.admission)
    policies = [p for p in args.policy.split(",") if p]
    for repeat in range(args.repeats):
        for policy in policies:
            for order in orders:
                if time.perf_counter() > deadline:
                    print(f"deadline: skipping {policy} / {order} (repeat {repeat})",
                          flush=True)
                    continue
                options = RunOptions(policy=policy, chunk_size=args.chunk_size,
                                     max_running=args.max_running, record_logits=False,
                                     admission=order)
                result = EngineRunner(model, cache, options, attention=attention,
                                      kv_cache=kv_cache).run(requests)
                row = summarise(result)
                outputs = {rid: r.output_token_ids for rid, r in result.records.items()}
                same = result.admissions() == bare_scheduler_admissions(
                    cache, policy, order, options, requests, outputs)
                row |= {"policy": policy, "order": order, "repeat": repeat,
                        "admissions_match_scheduler": same}
                rows[policy, order].append(row)
                print(f"{policy:<28} {order:<8} hit {row['hit_rate']:6.1%}  TTFT p50 "
                      f"{row['ttft_p50_s']:.3f}s p99 {row['ttft_p99_s']:.3f}s  wait p99 "
                      f"{row['wait_steps_p99']} steps  preempt {row['preemptions']}  "
                      f"wall {row['wall_s']:.1f}s  scheduler-equal {same}", flush=True)
                if not same:
                    print("SANITY FAILED: engine admissions differ from the shared "
                          "scheduler's", flush=True)
    medians = []
    for runs in rows.values():
        runs.sort(key=lambda r: r["ttft_p50_s"])
        median = dict(runs[(len(runs) - 1) // 2])  # of two runs: the faster
        median["runs"] = len(runs)
        median["ttft_p50_all_s"] = [round(r["ttft_p50_s"], 4) for r in runs]
        median["ttft_p99_all_s"] = [round(r["ttft_p99_s"], 4) for r in runs]
        median["admissions_match_scheduler"] = all(r["admissions_match_scheduler"]
                                                   for r in runs)
        medians.append(median)
    return medians


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [f"Device: {env['device']} · torch {env['torch']} · {env['model']} · "
             f"{results['workload']}", "",
             "| policy | order | hit rate | TTFT p50 (s) | TTFT p99 (s) | TTFT max (s) | "
             "p50 / p99 from admission (s) | wait p50 / p99 (steps) | preemptions | "
             "run wall (s) | = scheduler |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(
            f"| {row['policy']} | {row['order']} | {row['hit_rate']:.1%} | "
            f"{row['ttft_p50_s']:.3f} | {row['ttft_p99_s']:.3f} | {row['ttft_max_s']:.3f} | "
            f"{row['admitted_ttft_p50_s']:.3f} / {row['admitted_ttft_p99_s']:.3f} | "
            f"{row['wait_steps_p50']} / {row['wait_steps_p99']} | {row['preemptions']} | "
            f"{row['wall_s']:.1f} | {'yes' if row['admissions_match_scheduler'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke test (tiny model)")
    parser.add_argument("--cpu", action="store_true", help="ignore CUDA")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/admission_ttft"))
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--scan", type=int, default=2000,
                        help="trace requests searched for conversations")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-in", type=int, default=48000)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--num-blocks", type=int, default=3000)
    parser.add_argument("--policy", default="latest")
    parser.add_argument("--admission", default="fcfs,warm")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--deadline-s", type=float, default=240.0,
                        help="start no configuration after this many seconds")
    return parser.parse_args()


def main() -> int:
    started = time.perf_counter()
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.conversations, args.turns, args.output_tokens = 4, 3, 2
        args.max_running, args.chunk_size, args.repeats = 2, 256, 1
    cut = 600 if args.quick and not cuda else None
    requests = load_conversations(find_trace(args.trace_dir), conversations=args.conversations,
                                  turns=args.turns, max_in=args.max_in,
                                  output_tokens=args.output_tokens, scan=args.scan, cut=cut)
    total = sum(len(r.prompt_token_ids) for r in requests)
    if cuda:
        config, dtype, block = ModelConfig.gemma3_1b_shape(), torch.bfloat16, 64
    else:
        torch.set_num_threads(1)
        config, dtype, block = et.quick_cpu_model(), torch.float32, 16
        args.num_blocks = min(args.num_blocks, 200)
    setup = et.Setup(device, dtype, config, [], args.chunk_size, block, args.num_blocks, 1,
                     2048 if cuda else 128)
    model = HybridDecoder(config, dtype=dtype, device=device, seed=0)
    if cuda:
        model.use_compiled_pointwise()
    attention = et.attention_path(setup, "flash,efficient,math")
    cache = cache_config_for_model(config, num_blocks=args.num_blocks, block_size=block,
                                   dtype_bytes=model.embed.element_size(),
                                   max_num_batched_tokens=args.chunk_size)
    kv_cache = EngineRunner(model, cache, RunOptions(), attention=attention).kv_cache
    results: dict[str, Any] = {
        "environment": {
            "device": torch.cuda.get_device_name(device) if cuda else
            platform.processor() or "cpu",
            "torch": torch.__version__, "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d"),
            "model": "gemma3-1b shape, bf16" if cuda else "tiny, float32"},
        "workload": (f"{len(requests)} requests = first {args.turns} turns of "
                     f"{len({r.session_id for r in requests})} weka_cc_agentic conversations "
                     f"(≤ {args.max_in:,} input tokens{f', cut to {cut}' if cut else ''}; "
                     f"{total:,} prompt tokens), {args.output_tokens} output tokens, "
                     f"max_running {args.max_running}, chunk {args.chunk_size}, block {block}, "
                     f"pool {args.num_blocks:,} blocks"),
        "args": vars(args)}
    print(json.dumps(results["environment"]), "\n", results["workload"], flush=True)
    if cuda:
        warm = et.Setup(**{**setup.__dict__, "num_blocks": max(args.num_blocks, 3000)})
        et.warm_up(warm, model, attention, PagedKVCache(
            cache_config_for_model(config, num_blocks=warm.num_blocks, block_size=block,
                                   dtype_bytes=model.embed.element_size(),
                                   enable_caching=False, max_num_batched_tokens=args.chunk_size),
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype,
            device=device))
    results["rows"] = run_matrix(args, model, cache, attention, kv_cache, requests,
                                 started + args.deadline_s)
    results["environment"]["attention"] = getattr(attention, "name", "sdpa")
    results["environment"]["total_s"] = time.perf_counter() - started
    (out / "admission_ttft.json").write_text(json.dumps(results, indent=1, default=str))
    text = markdown(results)
    (out / "admission_ttft.md").write_text(text)
    print(text)
    return 0 if all(r["admissions_match_scheduler"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
