"""Fit the step-time model to measured engine steps and predict runs, without a GPU.

``bench/calibrate.py`` measures on the GPU and imports this module; run alone it refits a
``calibration.json`` that an earlier GPU run wrote and re-predicts its validation runs (the
same requests, arrivals and scheduler, a model clock), so the shipped coefficients and the
documented errors are reproducible on any machine::

    PYTHONPATH=src python bench/time_fit.py bench/data/calibration-h200.json.gz

Fit: ``timing.fit.fit_coefficients`` (relative least squares) with every efficiency term
at or above the datasheet peak (``LOWER``), then one common factor that makes the
calibration steps' total time exact (a queued run's makespan is the sum of its steps).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.cache import KVCacheManager
from hybridkv.config import CacheConfig
from hybridkv.engine.model_config import ModelConfig, cache_config_for_model
from hybridkv.sched.driver import ModelClock, TimedRun, drive
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan
from hybridkv.sim.timed import arrival_times, summarise
from hybridkv.timing import PARAM_NAMES, Chunk, Efficiencies, StepCostModel
from hybridkv.timing.fit import fit_coefficients, relative_errors
from hybridkv.timing.shape import AttentionLayer, ComputeShape, ModelDims
from hybridkv.traces.loaders import load_trace
from hybridkv.traces.trace import expand_prompt

LOWER = tuple(1.0 if name in ("gemm", "weights", "attention", "kv") else 0.0
              for name in PARAM_NAMES)
"""Floors of the coefficients: no term runs faster than the datasheet peak."""

TRACE_ROOTS = (".devrun/traces", "traces", "../shared/traces", "/work/shared/traces")
TRACE_PATHS = {"mooncake_synthetic": "mooncake_synthetic/synthetic_trace.jsonl",
               "ragpulse": "ragpulse", "weka_cc_agentic": "weka_cc_agentic"}


SLICES = {  # trace → (max input tokens, calibration count, validation offset, count)
    "gemma": {"mooncake_synthetic": (16384, 60, 100, 100), "ragpulse": (8192, 80, 400, 120)},
    "qwen": {"mooncake_synthetic": (8192, 30, 100, 50), "ragpulse": (8192, 60, 400, 70)},
}

def engine_shape(config: ModelConfig, dtype_bytes: int, name: str) -> ComputeShape:
    """The timing shape of an engine ``ModelConfig`` (same matrices, same layer kinds)."""
    dims = ModelDims(config.hidden_size, config.num_heads, config.num_kv_heads,
                     config.head_dim, config.intermediate_size, config.vocab_size,
                     config.num_layers, dtype_bytes,
                     linear_num_key_heads=config.linear_num_key_heads,
                     linear_num_value_heads=config.linear_num_value_heads,
                     linear_key_head_dim=config.linear_key_head_dim,
                     linear_value_head_dim=config.linear_value_head_dim)
    kv = 2 * config.num_kv_heads * config.head_dim * dtype_bytes
    attention, recurrent = [], []
    for layer_id, kind in enumerate(config.layer_types):
        if kind == "full_attention":
            attention.append(AttentionLayer("full", kv))
        elif kind == "sliding_attention":
            attention.append(AttentionLayer("window", kv, window=config.window_of(layer_id)))
        elif kind == "chunked_attention":
            attention.append(AttentionLayer("chunked", kv,
                                            chunk=config.attention_chunk_size or 1))
        else:
            recurrent.append(config.recurrent_state_bytes(dtype_bytes, 4))
    return ComputeShape(dims, tuple(attention), tuple(recurrent), name=name)


def model_run(cost: StepCostModel, cache: CacheConfig,
              arrivals: Sequence[tuple[float, SchedRequest]], args: argparse.Namespace,
              policy: str = "latest") -> TimedRun:
    """The same run predicted: the same scheduler, a model clock."""
    scheduler = Scheduler(KVCacheManager(cache, policy), max_running=args.max_running,
                          chunk_size=args.chunk_size)
    counter = iter(range(1 << 60, 1 << 61))

    def execute(plan: StepPlan) -> dict[str, int]:
        return {c.req_id: next(counter) for c in plan.chunks if c.samples}

    return drive(scheduler, [(t, copy_request(r)) for t, r in arrivals], execute,
                 ModelClock(), step_seconds=lambda plan: cost.seconds(plan.chunks))


def copy_request(r: SchedRequest) -> SchedRequest:
    return SchedRequest(r.req_id, list(r.prompt_token_ids), r.max_output_tokens, r.session_id)


def trace_slice(trace_name: str, *, offset: int, count: int, max_in: int, output_cap: int,
                cut: int | None) -> tuple[list[SchedRequest], list[float]]:
    """``count`` requests of ``trace_name`` with at most ``max_in`` input tokens, from the
    ``offset``-th such request on; outputs capped at ``output_cap``."""
    for root in TRACE_ROOTS:
        path = Path(root) / TRACE_PATHS.get(trace_name, trace_name)
        if path.exists():
            break
    else:
        raise SystemExit(f"calibrate: trace {trace_name} not found under {TRACE_ROOTS}")
    trace = load_trace(path, limit=(offset + count) * 8 + 200)
    chosen = [(i, r) for i, r in enumerate(trace.requests) if r.input_length <= max_in]
    chosen = chosen[offset:offset + count]
    requests = []
    for index, request in chosen:
        prompt = expand_prompt(request, index)
        requests.append(SchedRequest(request.request_id, prompt[:cut] if cut else prompt,
                                     max(1, min(output_cap, request.output_length)),
                                     request.session_id))
    return requests, [r.arrival_seconds or 0.0 for _, r in chosen]


def fit(shape: ComputeShape, rows: Sequence[dict[str, Any]], gpu: str,
        ) -> tuple[list[float], list[float]]:
    """Coefficients over ``rows`` (steps of ``shape``) and each row's relative error."""
    ideal = StepCostModel(shape, gpu, Efficiencies.ideal())
    features = [ideal.features([_chunk(c) for c in row["chunks"]]) for row in rows]
    times = [row["seconds"] for row in rows]
    # weights are read once per step: for one dense model that term is a constant, which
    # step_s already is, so it stays at the datasheet bandwidth (identifiable only across
    # models of different sizes)
    fixed = (PARAM_NAMES.index("weights"),) + (
        () if shape.num_recurrent else (PARAM_NAMES.index("scan_s"),))
    coefficients = fit_coefficients(features, times, fixed_zero=fixed, lower=LOWER)
    # relative least squares leans low; one common factor on the part above the floors
    # makes the calibration steps' total time exact (a queued run's makespan is their sum)
    predicted = sum(sum(c * x for c, x in zip(coefficients, row, strict=True))
                    for row in features)
    floor = sum(sum(low * x for low, x in zip(LOWER, row, strict=True)) for row in features)
    factor = (sum(times) - floor) / max(predicted - floor, 1e-300)
    coefficients = [low + (c - low) * factor for c, low in zip(coefficients, LOWER,
                                                                strict=True)]
    return coefficients, relative_errors(features, times, coefficients)


def _chunk(c: Sequence[Any]) -> Chunk:
    return Chunk(int(c[0]), int(c[1]), bool(c[2]))


def error_summary(errors: Sequence[float]) -> dict[str, float]:
    mags = sorted(abs(e) for e in errors)
    if not mags:
        return {}
    return {"steps": len(mags), "median_abs": mags[len(mags) // 2],
            "p90_abs": mags[int(0.9 * (len(mags) - 1))], "max_abs": mags[-1],
            "mean_signed": sum(errors) / len(errors)}


def compare(engine: TimedRun, model: TimedRun) -> dict[str, Any]:
    measured, predicted = summarise(engine), summarise(model)
    per_request = [(model.requests[rid].ttft_s - r.ttft_s) / r.ttft_s
                   for rid, r in engine.requests.items() if r.ttft_s > 0]
    out: dict[str, Any] = {"measured": measured, "predicted": predicted}
    for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "makespan_s", "queue_p50_s",
                "tpot_p50_s", "busy_fraction"):
        if measured[key]:
            out[f"err_{key}"] = (predicted[key] - measured[key]) / measured[key]
    out["per_request_ttft"] = error_summary(per_request)
    out["requests"] = {rid: [round(r.arrival_s, 4), round(r.ttft_s, 4),
                             round(model.requests[rid].ttft_s, 4), r.hit_tokens]
                       for rid, r in engine.requests.items()}
    return out


def slice_requests(model: str, trace: str, part: str, args: argparse.Namespace, quick: bool,
                   count: int | None = None) -> tuple[list[SchedRequest], list[float]]:
    """A trace's calibration or validation slice (``SLICES``; ``count``: the number of
    requests a recorded run used, when ``SLICES`` changed since)."""
    max_in, n_cal, offset, n_val = SLICES[model][trace]
    if quick:
        n_cal, offset, n_val = 6, 10, 8
    if count is not None:
        n_cal = n_val = count
    start, count = (0, n_cal) if part == "calibration" else (offset, n_val)
    return trace_slice(trace, offset=start, count=count, max_in=max_in,
                       output_cap=4 if quick else args.output_cap, cut=200 if quick else None)


def by_source(rows: Sequence[dict[str, Any]], errors: Sequence[float]) -> dict[str, Any]:
    groups: dict[str, list[float]] = {}
    for row, err in zip(rows, errors, strict=True):
        groups.setdefault(row["source"], []).append(err)
    return {k: error_summary(v) for k, v in groups.items()}


def engine_config(model: str, qwen_layers: int) -> ModelConfig:
    """The engine model of ``bench/calibrate.py --models`` (``gemma`` / ``qwen``)."""
    return ModelConfig.gemma3_1b_shape() if model == "gemma" else \
        ModelConfig.qwen35_shape(num_layers=qwen_layers)


def repredict(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Refit every model's steps in ``results`` and re-predict its validation runs."""
    args = argparse.Namespace(**results["args"])
    rows = []
    for model, steps in results["steps"].items():
        config = engine_config(model, args.qwen_layers)
        shape = engine_shape(config, 2, model)
        coefficients, errors = fit(shape, steps, args.gpu)
        results["fits"][model] = {"coefficients": dict(zip(PARAM_NAMES, coefficients,
                                                           strict=True)),
                                  "errors": error_summary(errors),
                                  "by_source": by_source(steps, errors)}
        cost = StepCostModel(shape, args.gpu, Efficiencies(tuple(coefficients), args.gpu))
        block, blocks = (args.block, args.num_blocks) if model == "gemma" else \
            (args.qwen_block, args.qwen_blocks)
        cache = cache_config_for_model(config, num_blocks=blocks, block_size=block,
                                       dtype_bytes=2, max_num_batched_tokens=args.chunk_size)
        for row in results["validation"]:
            if row["model"] != model:
                continue
            requests, raw = slice_requests(model, row["trace"], "validation", args, False,
                                           row["num_requests"])
            times = arrival_times(raw, time_scale=row["time_scale"])
            predicted = summarise(model_run(cost, cache, list(zip(times, requests,
                                                                  strict=True)), args))
            measured = row["measured"]
            rows.append({"model": model, "trace": row["trace"], "measured": measured,
                         "predicted": predicted, "num_requests": len(requests),
                         "time_scale": row["time_scale"]} | {
                f"err_{k}": (predicted[k] - measured[k]) / measured[k]
                for k in ("ttft_p50_s", "ttft_p99_s", "makespan_s") if measured[k]})
    return rows


def params_table(results: dict[str, Any], model: str, name: str) -> str:
    """A ``params.toml`` table of one model's fit, with its provenance."""
    env, fit_row = results["environment"], results["fits"][model]
    lines = [f"[{name}]", f'gpu = "{env["gpu_key"]}"',
             f'engine = "hybridkv reference engine, {results["labels"].get(model, model)}"',
             f'date = "{env["date"]}"', f'torch = "{env["torch"]}"',
             f'fit = "{fit_row["errors"]["steps"]} steps, median |error| '
             f'{fit_row["errors"]["median_abs"]:.1%}"']
    lines += [f"{k} = {v:.6g}" for k, v in fit_row["coefficients"].items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="calibration.json(.gz) of a GPU run")
    path = Path(parser.parse_args().results)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    results = json.loads(raw)
    rows = repredict(results)
    for model in results["fits"]:
        print(params_table(results, model, f"engine-{results['environment']['gpu_key']}-"
                                           f"{model}"))
    print("| model | trace | requests | TTFT p50 meas → pred | TTFT p99 meas → pred | "
          "makespan meas → pred |\n|---|---|---|---|---|---|")
    for r in rows:
        m, p = r["measured"], r["predicted"]
        print(f"| {r['model']} | {r['trace']} | {r['num_requests']} | "
              + " | ".join(f"{m[k]:.3f} → {p[k]:.3f} s ({r.get('err_' + k, 0):+.1%})"
                           for k in ("ttft_p50_s", "ttft_p99_s", "makespan_s")) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
