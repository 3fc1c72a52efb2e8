"""Where the step-time model's TTFT errors come from (issue 27), on a CPU, from recorded data.

Reproduces the analysis in ``docs/time-model.md`` ("Why TTFT misses"):

1. ``refit``: the shipped fit plus candidate admission terms (per first-token chunk, per
   1,000 prompt tokens of those chunks) fitted on the *calibration* steps only; the
   validation runs re-predicted (TTFT p50 / p99, makespan, TPOT p50 errors).
2. ``gaps``: the calibration slices replayed through the scheduler with each step's
   *measured* seconds plus a candidate time outside the timed step (per step, per
   first-token chunk); the gap that keeps the replay identical to the engine's plans the
   longest is the engine's (the engine's loop stamps arrivals on the wall clock, so a wrong
   gap makes an arrival land in another step).
3. ``modes``: the decode-only steps of ``bench/step_modes.py`` (``--modes FILE``).

    PYTHONPATH=src python bench/time_residuals.py bench/data/calibration-h200.json.gz \\
        --modes bench/data/step-modes-h200.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

import time_fit as tf

from hybridkv.cache import KVCacheManager
from hybridkv.engine.model_config import cache_config_for_model
from hybridkv.sched.driver import ModelClock, TimedRun, drive
from hybridkv.sched.scheduler import Scheduler, StepPlan
from hybridkv.sim.timed import arrival_times, summarise
from hybridkv.timing import PARAM_NAMES, Efficiencies, StepCostModel
from hybridkv.timing.cost import ChunkLike
from hybridkv.timing.fit import fit_coefficients, relative_errors

KEYS = ("ttft_p50_s", "ttft_p99_s", "makespan_s", "tpot_p50_s")


def admission_terms(chunks: Sequence[ChunkLike]) -> list[float]:
    """First-token chunks (prefill chunks that sample) and their prompt tokens / 1,000.

    >>> from hybridkv.timing import Chunk
    >>> admission_terms([Chunk(0, 3000, True), Chunk(500, 1, True), Chunk(0, 8192)])
    [1.0, 3.0]
    """
    first = [c for c in chunks if c.num_new_tokens > 1 and c.samples]
    return [float(len(first)),
            sum(c.num_computed_tokens + c.num_new_tokens for c in first) / 1e3]


class ExtendedModel(StepCostModel):
    """``StepCostModel`` plus the admission terms' fitted seconds."""

    def __init__(self, base: StepCostModel, extra_s: Sequence[float]) -> None:
        super().__init__(base.shape, base.gpu, base.efficiencies)
        self.extra_s = list(extra_s)

    def seconds(self, chunks: Sequence[ChunkLike]) -> float:
        base = super().seconds(chunks)
        return base + sum(c * x for c, x in zip(self.extra_s, admission_terms(chunks),
                                               strict=True)) if base else 0.0


def refit_extended(shape: Any, steps: Sequence[dict[str, Any]]) -> tuple[ExtendedModel, float]:
    """``time_fit.fit``'s procedure with the admission terms appended (floors 0)."""
    ideal = StepCostModel(shape, "h200", Efficiencies.ideal())
    rows = []
    for step in steps:
        chunks = [tf._chunk(c) for c in step["chunks"]]
        rows.append(ideal.features(chunks) + admission_terms(chunks))
    times = [step["seconds"] for step in steps]
    lower = [*tf.LOWER, 0.0, 0.0]
    fixed = (PARAM_NAMES.index("weights"),) + (
        () if shape.num_recurrent else (PARAM_NAMES.index("scan_s"),))
    coef = fit_coefficients(rows, times, fixed_zero=fixed, lower=lower)
    pred = sum(sum(c * x for c, x in zip(coef, r, strict=True)) for r in rows)
    floor = sum(sum(lo * x for lo, x in zip(lower, r, strict=True)) for r in rows)
    factor = (sum(times) - floor) / max(pred - floor, 1e-300)
    coef = [lo + (c - lo) * factor for c, lo in zip(coef, lower, strict=True)]
    errors = sorted(abs(e) for e in relative_errors(rows, times, coef))
    base = StepCostModel(shape, "h200", Efficiencies(tuple(coef[:len(PARAM_NAMES)]), "h200"))
    return ExtendedModel(base, coef[len(PARAM_NAMES):]), errors[len(errors) // 2]


def validation_errors(results: dict[str, Any], model: str, cost: StepCostModel,
                      ) -> list[str]:
    """One line per validation run of ``model``: the four errors of ``KEYS``."""
    args = argparse.Namespace(**results["args"])
    config = tf.engine_config(model, args.qwen_layers)
    block, blocks = (args.block, args.num_blocks) if model == "gemma" else \
        (args.qwen_block, args.qwen_blocks)
    cache = cache_config_for_model(config, num_blocks=blocks, block_size=block,
                                   dtype_bytes=2, max_num_batched_tokens=args.chunk_size)
    lines = []
    for row in results["validation"]:
        if row["model"] != model:
            continue
        requests, raw = tf.slice_requests(model, row["trace"], "validation", args, False,
                                          row["num_requests"])
        times = arrival_times(raw, time_scale=row["time_scale"])
        predicted = summarise(tf.model_run(cost, cache, list(zip(times, requests,
                                                                 strict=True)), args))
        measured = row["measured"]
        lines.append(f"  {row['trace']:<19}" + " ".join(
            f"{k[:-2]} {(predicted[k] - measured[k]) / measured[k]:+.1%}" for k in KEYS))
    return lines


def refit(results: dict[str, Any]) -> None:
    for model, steps in results["steps"].items():
        shape = tf.engine_shape(tf.engine_config(model, results["args"]["qwen_layers"]), 2,
                                model)
        coef, errors = tf.fit(shape, steps, "h200")
        shipped = StepCostModel(shape, "h200", Efficiencies(tuple(coef), "h200"))
        median = sorted(abs(e) for e in errors)[len(errors) // 2]
        print(f"{model}: shipped terms (median |error| {median:.1%})")
        print("\n".join(validation_errors(results, model, shipped)))
        extended, median = refit_extended(shape, steps)
        print(f"{model}: + {extended.extra_s[0] * 1e3:.2f} ms per first-token chunk, "
              f"+ {extended.extra_s[1] * 1e3:.2f} ms per 1k of its prompt tokens "
              f"(median |error| {median:.1%})")
        print("\n".join(validation_errors(results, model, extended)))


def replay(cache: Any, arrivals: Sequence[tuple[float, Any]], args: argparse.Namespace,
           seconds: Callable[[StepPlan], float]) -> TimedRun:
    scheduler = Scheduler(KVCacheManager(cache, "latest"), max_running=args.max_running,
                          chunk_size=args.chunk_size)
    counter = iter(range(1 << 60, 1 << 61))
    return drive(scheduler, [(t, tf.copy_request(r)) for t, r in arrivals],
                 lambda plan: {c.req_id: next(counter) for c in plan.chunks if c.samples},
                 ModelClock(), step_seconds=seconds)


class _Diverged(Exception):
    pass


def matched_steps(cache: Any, arrivals: Sequence[tuple[float, Any]],
                  args: argparse.Namespace, measured: Sequence[dict[str, Any]],
                  per_step_s: float, per_first_s: float) -> int:
    """How many steps the replay plans exactly as the engine did, with each step lasting
    its measured seconds plus the candidate gaps."""
    done = [0]

    def seconds(plan: StepPlan) -> float:
        if done[0] >= len(measured):
            raise _Diverged
        step = measured[done[0]]
        if [[c.num_computed_tokens, c.num_new_tokens, c.samples]
                for c in plan.chunks] != step["chunks"]:
            raise _Diverged
        done[0] += 1
        return float(step["seconds"]) + per_step_s + per_first_s * admission_terms(
            plan.chunks)[0]

    with contextlib.suppress(_Diverged):
        replay(cache, arrivals, args, seconds)
    return done[0]


def gaps(results: dict[str, Any]) -> None:
    """The calibration slices' arrivals (``bench/calibrate.py``: the grid-only fit's busy
    time at ``load`` 1.25, the run that measured these steps) replayed with gaps."""
    args = argparse.Namespace(**{**results["args"], "load": 1.25})
    for model, steps in results["steps"].items():
        config = tf.engine_config(model, args.qwen_layers)
        shape = tf.engine_shape(config, 2, model)
        coef, _ = tf.fit(shape, [s for s in steps if not s["source"].startswith("slice:")],
                         "h200")
        grid_cost = StepCostModel(shape, "h200", Efficiencies(tuple(coef), "h200"))
        block, blocks = (args.block, args.num_blocks) if model == "gemma" else \
            (args.qwen_block, args.qwen_blocks)
        cache = cache_config_for_model(config, num_blocks=blocks, block_size=block,
                                       dtype_bytes=2, max_num_batched_tokens=args.chunk_size)
        for trace in args.traces.split(","):
            measured = [s for s in steps if s["source"] == f"slice:{trace}"]
            requests, raw = tf.slice_requests(model, trace, "calibration", args, False)
            busy = tf.model_run(grid_cost, cache, [(0.0, r) for r in requests], args).busy_s
            scale = busy / (args.load * ((max(raw) - min(raw)) or 1.0))
            arrivals = list(zip(arrival_times(raw, time_scale=scale), requests, strict=True))
            scores = sorted(((matched_steps(cache, arrivals, args, measured, g * 1e-3,
                                            a * 1e-3), g, a)
                             for g in (0, 0.25, 0.5, 1, 2, 4) for a in (0, 2, 5, 10, 20)),
                            reverse=True)
            print(f"{model} {trace}: {len(measured)} steps; best (matched steps, ms per "
                  f"step, ms per first token): {scores[:3]}")


def modes(path: Path) -> None:
    """Decode-only steps per (model, batch): wall quantiles, CPU time / wall, and the
    steps over 1.25x the shape's median (compile stalls over 1 s left out) against the
    rest, with the CPU probe timed before each."""
    from step_modes import decode_groups  # imports torch: only for --modes

    rows = json.loads(gzip.decompress(path.read_bytes()))
    for model, batch, group in decode_groups(rows):
        walls = sorted(r["wall_s"] * 1e3 for r in group)
        cpu_share = statistics.median(r["cpu_s"] / r["wall_s"] for r in group)
        steady = [r for r in group if r["wall_s"] < 1.0]
        cut = 1.25 * statistics.median(r["wall_s"] for r in steady)
        slow = [r for r in steady if r["wall_s"] > cut]
        rest = [r for r in steady if r["wall_s"] <= cut]

        def med(part: list[dict[str, Any]], key: str) -> float:
            return statistics.median(r[key] for r in part) * 1e3 if part else 0.0

        print(f"{model} decode batch {batch}: {len(group)} steps, wall p10 / p50 / p90 "
              f"{walls[len(walls) // 10]:.1f} / {walls[len(walls) // 2]:.1f} / "
              f"{walls[9 * len(walls) // 10]:.1f} ms (max {walls[-1]:.0f}), CPU time / wall "
              f"{cpu_share:.3f}; {len(slow)} slow: wall {med(slow, 'wall_s'):.1f} vs "
              f"{med(rest, 'wall_s'):.1f} ms, CPU probe {med(slow, 'cpu_probe_s'):.2f} vs "
              f"{med(rest, 'cpu_probe_s'):.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="calibration.json(.gz) of a GPU run")
    parser.add_argument("--modes", type=Path, default=None,
                        help="step_modes.json.gz of bench/step_modes.py")
    parser.add_argument("--skip-gaps", action="store_true")
    ns = parser.parse_args()
    path = Path(ns.results)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    results = json.loads(raw)
    refit(results)
    if not ns.skip_gaps:
        gaps(results)
    if ns.modes:
        modes(ns.modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
