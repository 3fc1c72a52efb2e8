"""Calibrate and validate the step-time model (``hybridkv.timing``) on the reference engine.

Run on one CUDA GPU (``PYTHONPATH=src python bench/calibrate.py --out $OUT``) or as a CPU
smoke test (``--quick``: tiny models, a few requests).

For each model (``--models``: ``gemma`` = the Gemma-3-1B shape, 22 sliding-window-512 + 4
full layers; ``qwen`` = Qwen3.5-27B's per-layer shape cut to ``--qwen-layers`` layers, 3
Gated DeltaNet : 1 full attention), bf16, block ``--block`` (qwen: ``--qwen-block``):

1. **Measure** (``calibration`` rows): every step of
   - prefills of ``n`` new tokens over ``c`` cached ones (a request of ``c`` tokens, then one
     sharing them plus ``n`` more; one request at a time);
   - decode batches of ``b`` requests at ``L`` tokens of context (16 output tokens each);
   - an open-loop replay of the *calibration* slice of each trace (mixed steps);
   each step's wall time (scheduler + model, device synchronised) with its chunks.
2. **Fit** the coefficients of ``timing.cost.PARAM_NAMES`` (non-negative, relative least
   squares) per model and jointly; report per-step relative errors.
3. **Validate** on the *validation* slices (other requests of the same traces): the engine
   replays them in real time (requests arrive at their scaled trace times, continuous
   batching through ``hybridkv.sched.scheduler``, ``hybridkv.sched.driver.drive`` with a wall
   clock), recording each request's TTFT; the model predicts the same run (the same loop
   with a model clock). Arrivals are compressed so that the slice's arrival span is
   ``--load`` × less than its predicted busy time (a load that queues).
   Per-request and percentile errors of TTFT, and the makespan error.

Results (written after every section, so a failure keeps what was measured):
``calibration.json`` (steps, fits, validation rows and per-request times) and
``calibration.md`` under ``--out`` (default ``$OUT`` when set, else ``out/calibrate``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_ttft as et
from time_fit import (
    TRACE_ROOTS,
    _chunk,
    by_source,
    compare,
    copy_request,
    engine_shape,
    error_summary,
    fit,
    model_run,
    slice_requests,
)

from hybridkv.cache import KVCacheManager
from hybridkv.config import CacheConfig
from hybridkv.engine.checkpoints import PagedStateCache
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import (
    ModelConfig,
    cache_config_for_model,
    qwen3_next_pattern,
)
from hybridkv.engine.paged import PagedKVCache
from hybridkv.engine.recurrent import Chunking, gated_delta_chunked
from hybridkv.engine.runner import EngineRunner, RunOptions
from hybridkv.sched.driver import TimedRun, WallClock, drive
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan
from hybridkv.sim.timed import arrival_times, summarise
from hybridkv.timing import PARAM_NAMES, Efficiencies, StepCostModel
from hybridkv.timing.shape import ComputeShape


# ----------------------------------------------------------------------------- models
@dataclass
class Bundle:
    """One engine model ready to run, and its cost-model shape."""

    name: str
    model: HybridDecoder
    cache: CacheConfig
    attention: Any
    recurrence: Any
    kv_cache: PagedKVCache
    state_cache: PagedStateCache
    shape: ComputeShape
    label: str


def build(name: str, args: argparse.Namespace, device: torch.device) -> Bundle:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if name == "gemma":
        config = ModelConfig.gemma3_1b_shape() if cuda else et.quick_cpu_model()
        block, blocks, recurrence = args.block, args.num_blocks, None
        label = "Gemma-3-1B shape (22 window-512 + 4 full layers)" if cuda else "tiny gemma"
    else:
        config = ModelConfig.qwen35_shape(num_layers=args.qwen_layers) if cuda else \
            ModelConfig.tiny(layer_types=qwen3_next_pattern(4), sliding_window=None,
                             vocab_size=512, hidden_size=64, intermediate_size=128)
        block, blocks = args.qwen_block, args.qwen_blocks
        recurrence = partial(gated_delta_chunked, chunking=Chunking(64 if cuda else 16))
        label = (f"Qwen3.5-27B per-layer shape, {config.num_layers} layers "
                 f"({config.layer_types.count('linear_attention')} Gated DeltaNet)") \
            if cuda else "tiny qwen"
    if not cuda:
        block, blocks = 16, 400
    model = HybridDecoder(config, dtype=dtype, device=device, seed=0)
    if cuda:
        model.use_compiled_pointwise()
    setup = et.Setup(device, dtype, config, [], args.chunk_size, block, blocks, 1,
                     2048 if cuda else 128)
    attention = et.attention_path(setup, "flash,efficient,math")
    cache = cache_config_for_model(config, num_blocks=blocks, block_size=block,
                                   dtype_bytes=model.embed.element_size(),
                                   max_num_batched_tokens=args.chunk_size)
    runner = EngineRunner(model, cache, RunOptions(record_logits=False), attention=attention,
                          **({"recurrence": recurrence} if recurrence else {}))
    return Bundle(name, model, cache, attention, recurrence, runner.kv_cache,
                  runner.state_cache, engine_shape(config, model.embed.element_size(), name),
                  label)


# ------------------------------------------------------------------------ the loop
def engine_run(bundle: Bundle, arrivals: Sequence[tuple[float, SchedRequest]],
               args: argparse.Namespace, policy: str = "latest") -> TimedRun:
    """The engine replays ``arrivals`` in real time through the shared loop."""
    options = RunOptions(policy=policy, chunk_size=args.chunk_size,
                         max_running=args.max_running, record_logits=False)
    kwargs = {"recurrence": bundle.recurrence} if bundle.recurrence else {}
    runner = EngineRunner(bundle.model, bundle.cache, options, attention=bundle.attention,
                          kv_cache=bundle.kv_cache, state_cache=bundle.state_cache, **kwargs)
    manager = KVCacheManager(bundle.cache, policy)
    scheduler = Scheduler(manager, max_running=args.max_running, chunk_size=args.chunk_size)

    def execute(plan: StepPlan) -> dict[str, int]:
        copies = manager.take_block_copies()
        runner.copy_blocks([c for c in copies if not c.after_forward])
        sampled = runner._execute(manager, plan, {})
        runner.copy_blocks([c for c in copies if c.after_forward])
        return sampled

    requests = [(t, copy_request(r)) for t, r in arrivals]
    gc.collect()
    gc.disable()  # no collector pauses inside timed steps (reference counting still frees)
    try:
        return drive(scheduler, requests, execute, WallClock())
    finally:
        gc.enable()


# ---------------------------------------------------------------------- workloads
def random_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << 40, (n,), generator=gen).tolist()


def prefill_grid(cached: Sequence[int], new: Sequence[int], seed: int,
                 ) -> list[tuple[float, SchedRequest]]:
    """Per (c, n): a request of c tokens, then one sharing them plus n more (one session,
    so the second waits for the first)."""
    out: list[tuple[float, SchedRequest]] = []
    for c in cached:
        for n in new:
            seed += 1
            base = random_ids(c, seed) if c else []
            session = f"p{c}-{n}"
            if c:
                out.append((0.0, SchedRequest(f"{session}-fill", base, 1, session)))
            out.append((0.0, SchedRequest(f"{session}-probe", base + random_ids(n, -seed), 1,
                                          session)))
    return out


def decode_grid(batches: Sequence[int], contexts: Sequence[int], seed: int,
                output_tokens: int) -> list[list[tuple[float, SchedRequest]]]:
    """Per (b, L): b requests of L distinct tokens arriving together."""
    return [[(0.0, SchedRequest(f"d{b}-{ctx}-{i}", random_ids(ctx, seed + 1000 * b + i + ctx),
                                output_tokens)) for i in range(b)]
            for b in batches for ctx in contexts]


# ------------------------------------------------------------------------ sections
def step_rows(run: TimedRun, source: str) -> list[dict[str, Any]]:
    return [{"source": source, "seconds": seconds, "chunks": list(chunks)}
            for _, seconds, chunks in run.steps]


def warm_up(bundle: Bundle, args: argparse.Namespace) -> None:
    """Compile the kernel variants (flex buckets, pointwise shapes, decode), untimed."""
    started = time.perf_counter()
    engine_run(bundle, prefill_grid([0, 4096], [300, 700, 1500, 2100, 4200, 8192], 77), args)
    for arrivals in decode_grid([4, 32], [2048], 78, 4):
        engine_run(bundle, arrivals, args)
    print(f"[{bundle.name}] warm-up {time.perf_counter() - started:.1f}s", flush=True)


def measure(bundle: Bundle, args: argparse.Namespace, quick: bool,
            save: Callable[[], None], rows: list[dict[str, Any]]) -> None:
    cached = [0, 256] if quick else [0, 2048, 8192, 24576]
    new = [64, 256] if quick else [256, 1024, 4096, 8192]
    batches = [1, 4] if quick else [1, 4, 16, 32]
    contexts = [128] if quick else [1024, 8192, 24576]
    if not quick:
        warm_up(bundle, args)
    started = time.perf_counter()
    one = argparse.Namespace(**{**vars(args), "max_running": 1})   # one chunk per step
    rows += step_rows(engine_run(bundle, prefill_grid(cached, new, 1), one), "prefill")
    rows += step_rows(engine_run(bundle, prefill_grid(cached[:2], new, 50), args), "mixed")
    for arrivals in decode_grid(batches, contexts, 2, 16):
        rows += step_rows(engine_run(bundle, arrivals, args), "decode")
    print(f"[{bundle.name}] measured {len(rows)} steps in "
          f"{time.perf_counter() - started:.1f}s", flush=True)
    save()


def queued_arrivals(cost: StepCostModel, bundle: Bundle, requests: Sequence[SchedRequest],
                    raw: Sequence[float], args: argparse.Namespace,
                    ) -> tuple[list[tuple[float, SchedRequest]], float]:
    """Arrivals compressed so the slice's span is ``args.load`` x less than its predicted
    busy time (offered load above capacity: a queue builds), and the time scale used."""
    busy = model_run(cost, bundle.cache, [(0.0, r) for r in requests], args).busy_s
    span = (max(raw) - min(raw)) or 1.0
    scale = busy / (args.load * span)
    times = arrival_times(raw, time_scale=scale)
    return list(zip(times, requests, strict=True)), scale


def calibrate_model(bundle: Bundle, args: argparse.Namespace, quick: bool,
                    results: dict[str, Any], save: Callable[[], None]) -> None:
    rows: list[dict[str, Any]] = results["steps"].setdefault(bundle.name, [])
    if args.fit_from:  # steps measured by an earlier run: refit them, compile, validate
        rows += json.loads(Path(args.fit_from).read_text())["steps"][bundle.name]
        coefficients, errors = fit(bundle.shape, rows, args.gpu)
        results["fits"][bundle.name] = {"coefficients": dict(zip(PARAM_NAMES, coefficients,
                                                                 strict=True)),
                                        "errors": error_summary(errors),
                                        "by_source": by_source(rows, errors),
                                        "from": args.fit_from}
        if not quick:
            warm_up(bundle, args)
        return
    measure(bundle, args, quick, save, rows)
    coefficients, errors = fit(bundle.shape, rows, args.gpu)
    cost = StepCostModel(bundle.shape, args.gpu, Efficiencies(tuple(coefficients), args.gpu))
    for trace in args.traces.split(","):
        requests, raw = slice_requests(bundle.name, trace, "calibration", args, quick)
        arrivals, scale = queued_arrivals(cost, bundle, requests, raw, args)
        run = engine_run(bundle, arrivals, args)
        rows += step_rows(run, f"slice:{trace}")
        print(f"[{bundle.name}] calibration slice {trace}: {len(requests)} requests, scale "
              f"{scale:.3g}, {len(run.steps)} steps, makespan {run.makespan_s:.1f}s", flush=True)
    coefficients, errors = fit(bundle.shape, rows, args.gpu)
    results["fits"][bundle.name] = {"coefficients": dict(zip(PARAM_NAMES, coefficients,
                                                             strict=True)),
                                    "errors": error_summary(errors),
                                    "by_source": by_source(rows, errors)}
    print(f"[{bundle.name}] fit {results['fits'][bundle.name]}", flush=True)
    save()


def validate_model(bundle: Bundle, args: argparse.Namespace, quick: bool,
                   results: dict[str, Any], save: Callable[[], None], deadline: float) -> None:
    coefficients = [results["fits"][bundle.name]["coefficients"][n] for n in PARAM_NAMES]
    cost = StepCostModel(bundle.shape, args.gpu, Efficiencies(tuple(coefficients), args.gpu))
    for trace in args.traces.split(","):
        if time.perf_counter() > deadline:
            print(f"deadline: skipping validation {bundle.name} × {trace}", flush=True)
            continue
        requests, raw = slice_requests(bundle.name, trace, "validation", args, quick)
        arrivals, scale = queued_arrivals(cost, bundle, requests, raw, args)
        engine = engine_run(bundle, arrivals, args)
        started = time.perf_counter()
        model = model_run(cost, bundle.cache, arrivals, args)
        row = compare(engine, model) | {"model": bundle.name, "trace": trace,
                                        "time_scale": scale, "num_requests": len(requests),
                                        "predict_wall_s": time.perf_counter() - started,
                                        "engine_steps": len(engine.steps),
                                        "model_steps": len(model.steps)}
        results["validation"].append(row)
        print(f"[{bundle.name}] validation {trace}: TTFT p50 {row['measured']['ttft_p50_s']:.3f}"
              f" → {row['predicted']['ttft_p50_s']:.3f}s, p99 "
              f"{row['measured']['ttft_p99_s']:.3f} → {row['predicted']['ttft_p99_s']:.3f}s, "
              f"makespan {row['measured']['makespan_s']:.2f} → "
              f"{row['predicted']['makespan_s']:.2f}s", flush=True)
        save()


def recompute_section(bundle: Bundle, args: argparse.Namespace, quick: bool,
                      results: dict[str, Any], save: Callable[[], None]) -> None:
    """Part 6: the issue's WEKA run (12 conversations x 5 turns of at most 48,000 input
    tokens, 16 output tokens, pool ``--recompute-blocks``, 4 running, all queued at 0)
    under each ``--recompute-policies`` policy; per step measured vs predicted seconds (the
    model sees only the chunks, so a policy whose steps run slower than predicted pays for
    something other than the tokens it computes)."""
    import admission_ttft as at

    local = next((str(Path(root) / "weka_cc_agentic") for root in TRACE_ROOTS
                  if (Path(root) / "weka_cc_agentic").is_dir()), None)
    requests = at.load_conversations(at.find_trace(local),
        conversations=4 if quick else 12, turns=3 if quick else 5,
        max_in=48000, output_tokens=2 if quick else 16, scan=2000, cut=300 if quick else None)
    coefficients = [results["fits"][bundle.name]["coefficients"][n] for n in PARAM_NAMES]
    cost = StepCostModel(bundle.shape, args.gpu, Efficiencies(tuple(coefficients), args.gpu))
    small = argparse.Namespace(**{**vars(args), "max_running": 4})
    cache = cache_config_for_model(bundle.model.config, num_blocks=bundle.cache.num_blocks,
                                   block_size=bundle.cache.groups[0].spec.block_size,
                                   dtype_bytes=bundle.model.embed.element_size(),
                                   max_num_batched_tokens=args.chunk_size)
    cache = _limit_blocks(cache, args.recompute_blocks if not quick else 200)
    fresh = EngineRunner(bundle.model, cache, RunOptions(), attention=bundle.attention)
    limited = Bundle(**{**bundle.__dict__, "cache": cache, "kv_cache": fresh.kv_cache,
                        "state_cache": fresh.state_cache})
    rows = []
    for policy in args.recompute_policies.split(","):
        run = engine_run(limited, [(0.0, r) for r in requests], small, policy)
        ratios = [seconds / cost.seconds([_chunk(c) for c in chunks])
                  for _, seconds, chunks in run.steps]
        summary = summarise(run)
        row = {"policy": policy, "steps": len(run.steps), "busy_s": run.busy_s,
               "makespan_s": run.makespan_s, "ttft_p50_s": summary["ttft_p50_s"],
               "ttft_p99_s": summary["ttft_p99_s"],
               "hit_tokens": sum(r.hit_tokens for r in run.requests.values()),
               "prompt_tokens": sum(r.prompt_tokens for r in run.requests.values()),
               "computed_tokens": sum(c[1] for _, _, cs in run.steps for c in cs),
               "predicted_busy_s": sum(cost.seconds([_chunk(c) for c in cs])
                                       for _, _, cs in run.steps),
               "measured_over_predicted_median": sorted(ratios)[len(ratios) // 2],
               "step_log": step_rows(run, policy)}
        rows.append(row)
        print(f"[recompute] {policy}: steps {row['steps']}, busy {row['busy_s']:.2f}s "
              f"(predicted {row['predicted_busy_s']:.2f}s), computed "
              f"{row['computed_tokens']:,}, hit {row['hit_tokens']:,}, TTFT p50 "
              f"{row['ttft_p50_s']:.3f} p99 {row['ttft_p99_s']:.3f}", flush=True)
        results["recompute"] = rows
        save()


def _limit_blocks(cache: CacheConfig, num_blocks: int) -> CacheConfig:
    import dataclasses
    return dataclasses.replace(cache, num_blocks=num_blocks)


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [f"Device: {env['device']} · torch {env['torch']} · {env['date']}", "",
             "| model | steps | fit median / p90 / max abs error | " +
             " | ".join(PARAM_NAMES) + " |", "|---|---|---|" + "---|" * len(PARAM_NAMES)]
    for name, f in results["fits"].items():
        e = f["errors"]
        lines.append(f"| {name} | {e['steps']} | {e['median_abs']:.1%} / {e['p90_abs']:.1%} / "
                     f"{e['max_abs']:.1%} | " + " | ".join(
                         f"{f['coefficients'][n]:.3g}" for n in PARAM_NAMES) + " |")
    lines += ["", "| model | trace | requests | scale | TTFT p50 meas → pred | TTFT p99 meas → "
              "pred | makespan meas → pred | per-request TTFT median abs error |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results["validation"]:
        m, p = r["measured"], r["predicted"]
        lines.append(
            f"| {r['model']} | {r['trace']} | {r['num_requests']} | {r['time_scale']:.3g} | "
            f"{m['ttft_p50_s']:.3f} → {p['ttft_p50_s']:.3f} s ({r.get('err_ttft_p50_s', 0):+.1%})"
            f" | {m['ttft_p99_s']:.3f} → {p['ttft_p99_s']:.3f} s "
            f"({r.get('err_ttft_p99_s', 0):+.1%}) | {m['makespan_s']:.2f} → "
            f"{p['makespan_s']:.2f} s ({r.get('err_makespan_s', 0):+.1%}) | "
            f"{r['per_request_ttft'].get('median_abs', 0):.1%} |")
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke test (tiny models)")
    parser.add_argument("--cpu", action="store_true", help="ignore CUDA")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/calibrate"))
    parser.add_argument("--models", default="gemma,qwen")
    parser.add_argument("--traces", default="mooncake_synthetic,ragpulse")
    parser.add_argument("--gpu", default="h200", help="timing.gpus key of this device")
    parser.add_argument("--qwen-layers", type=int, default=8)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=20000)
    parser.add_argument("--qwen-block", type=int, default=512)
    parser.add_argument("--qwen-blocks", type=int, default=1500)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--output-cap", type=int, default=32)
    parser.add_argument("--load", type=float, default=1.25,
                        help="offered load: predicted busy time / arrival span")
    parser.add_argument("--recompute-policies",
                        default="latest,interval:32768+predict+recompute")
    parser.add_argument("--recompute-blocks", type=int, default=3000)
    parser.add_argument("--fit-from", default=None,
                        help="calibration.json of an earlier run: refit its steps, skip "
                        "measuring, validate")
    parser.add_argument("--deadline-s", type=float, default=500.0)
    return parser.parse_args()


def main() -> int:
    started = time.perf_counter()
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    quick = args.quick or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "environment": {"device": torch.cuda.get_device_name(device) if cuda else
                        platform.processor() or "cpu", "torch": torch.__version__,
                        "date": time.strftime("%Y-%m-%d"), "gpu_key": args.gpu},
        "args": vars(args), "steps": {}, "fits": {}, "validation": [], "labels": {}}

    def save() -> None:
        (out / "calibration.json").write_text(json.dumps(results, default=str))
        if results["fits"]:
            (out / "calibration.md").write_text(markdown(results))

    failures = 0
    for name in args.models.split(","):
        try:
            bundle = build(name, args, device)
            results["labels"][name] = bundle.label
            calibrate_model(bundle, args, quick, results, save)
            validate_model(bundle, args, quick, results, save, started + args.deadline_s)
            if name == "gemma" and args.recompute_policies and \
                    time.perf_counter() < started + args.deadline_s:
                recompute_section(bundle, args, quick, results, save)
        except (Exception, SystemExit):
            traceback.print_exc()
            failures += 1
        finally:
            save()
            if cuda:
                torch.cuda.empty_cache()
    results["environment"]["total_s"] = time.perf_counter() - started
    save()
    if results["fits"]:
        print(markdown(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
