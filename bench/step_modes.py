"""Why the reference engine's decode steps take two times for one batch shape (issue 27).

Run on one CUDA GPU (``PYTHONPATH=src python bench/step_modes.py --out $OUT``) or as a CPU
smoke test (``--quick``). For each model of ``bench/calibrate.py`` (same build, warm-up and
scheduler), decode batches run step by step; before every step two fixed probes are timed:

- ``cpu_probe_s``: a fixed pure-Python loop (host speed: frequency, contention);
- ``gpu_probe_s``: a fixed bf16 matmul chain timed with CUDA events (GPU clocks);

and per step the wall time and the process's CPU time (``time.process_time``). If slow
steps of one shape come with slow CPU probes, the bimodality is the host's, not the step's
features; ``nvidia-smi`` samples clocks beside it (``clocks.csv``).

Results: ``step_modes.json`` (one row per step) and a summary on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibrate as cal

from hybridkv.cache import KVCacheManager
from hybridkv.engine.runner import EngineRunner, RunOptions
from hybridkv.sched.driver import WallClock, drive
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan

SHAPES = ((4, 8192, 100), (16, 1024, 48), (1, 8192, 100))
"""(batch, context tokens, output tokens) of each decode run."""


def cpu_probe_s() -> float:
    """Seconds of a fixed pure-Python loop (about 0.3 ms on a 3 GHz core)."""
    started = time.perf_counter()
    total = 0
    for i in range(20000):
        total += i & 7
    return time.perf_counter() - started


def gpu_probe_s(a: torch.Tensor) -> float:
    """Seconds of four chained ``a @ a`` on the GPU (CUDA events; 0 on a CPU)."""
    if a.device.type != "cuda":
        return 0.0
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    x = a
    for _ in range(4):
        x = x @ a
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end)) / 1e3


def run_shape(bundle: cal.Bundle, args: argparse.Namespace, batch: int, context: int,
              outputs: int, probe: torch.Tensor) -> list[dict[str, Any]]:
    """One decode batch through the shared loop; one row per step."""
    options = RunOptions(policy="latest", chunk_size=args.chunk_size,
                         max_running=args.max_running, record_logits=False)
    kwargs = {"recurrence": bundle.recurrence} if bundle.recurrence else {}
    runner = EngineRunner(bundle.model, bundle.cache, options, attention=bundle.attention,
                          kv_cache=bundle.kv_cache, state_cache=bundle.state_cache, **kwargs)
    manager = KVCacheManager(bundle.cache, "latest")
    scheduler = Scheduler(manager, max_running=args.max_running, chunk_size=args.chunk_size)
    rows: list[dict[str, Any]] = []

    def execute(plan: StepPlan) -> dict[str, int]:
        row: dict[str, Any] = {"cpu_probe_s": cpu_probe_s(), "gpu_probe_s": gpu_probe_s(probe)}
        wall, cpu = time.perf_counter(), time.process_time()
        sampled = runner._execute(manager, plan, {})
        row |= {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                "chunks": [[c.num_computed_tokens, c.num_new_tokens] for c in plan.chunks],
                "batch": batch, "context": context, "model": bundle.name}
        rows.append(row)
        return sampled

    arrivals: list[tuple[float, SchedRequest]] = cal.decode_grid([batch], [context], 9,
                                                                 outputs)[0]
    gc.collect()
    gc.disable()
    try:
        drive(scheduler, arrivals, execute, WallClock())
    finally:
        gc.enable()
    return rows


def decode_groups(rows: list[dict[str, Any]],
                  min_steps: int = 8) -> list[tuple[str, int, list[dict[str, Any]]]]:
    """``(model, batch, steps)`` of the decode-only steps (every chunk one token) of each
    (model, batch size), sorted, leaving out shapes with fewer than ``min_steps`` steps.

    >>> decode, prefill = {"model": "m", "chunks": [["a", 1], ["b", 1]]}, {"model": "m",
    ...                                                                   "chunks": [["a", 5]]}
    >>> rows = [decode] * 8 + [prefill] * 8 + [{**decode, "model": "n"}] * 7
    >>> [(model, batch, len(steps)) for model, batch, steps in decode_groups(rows)]
    [('m', 2, 8)]
    """
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if all(n == 1 for _, n in row["chunks"]):
            groups.setdefault((row["model"], len(row["chunks"])), []).append(row)
    return [(model, batch, group) for (model, batch), group in sorted(groups.items())
            if len(group) >= min_steps]


def summary(rows: list[dict[str, Any]]) -> None:
    """Per (model, batch): decode steps split at their median wall time; the probes of
    the slow half against the fast half."""
    for model, batch, group in decode_groups(rows):
        cut = statistics.median(r["wall_s"] for r in group)
        halves = ([r for r in group if r["wall_s"] <= cut], [r for r in group if r["wall_s"] > cut])
        parts = []
        for name, half in zip(("fast", "slow"), halves, strict=True):
            med = {k: statistics.median(r[k] for r in half) * 1e3
                   for k in ("wall_s", "cpu_s", "cpu_probe_s", "gpu_probe_s")}
            parts.append(f"{name} n={len(half)} " + " ".join(f"{k[:-2]} {v:.2f}ms"
                                                               for k, v in med.items()))
        walls = sorted(r["wall_s"] * 1e3 for r in group)
        print(f"{model} batch {batch}: wall p10/p50/p90 {walls[len(walls) // 10]:.1f}/"
              f"{walls[len(walls) // 2]:.1f}/{walls[9 * len(walls) // 10]:.1f} ms | "
              + " | ".join(parts), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/step_modes"))
    parser.add_argument("--models", default="qwen,gemma")
    parser.add_argument("--deadline-s", type=float, default=240.0)
    ns = parser.parse_args()
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and not ns.quick
    device = torch.device("cuda" if cuda else "cpu")
    args = argparse.Namespace(qwen_layers=8, block=64, num_blocks=20000, qwen_block=512,
                              qwen_blocks=1500, chunk_size=8192, max_running=16)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,"
                            "power.draw,temperature.gpu,utilization.gpu", "--format=csv",
                            "-lms", "200"], stdout=(out / "clocks.csv").open("w"),
                           stderr=subprocess.DEVNULL) if cuda else None
    probe = torch.randn(2048, 2048, device=device,
                        dtype=torch.bfloat16 if cuda else torch.float32) / 45
    rows: list[dict[str, Any]] = []
    try:
        for name in ns.models.split(","):
            bundle = cal.build(name, args, device)
            if cuda:
                cal.warm_up(bundle, args)
            for batch, context, outputs in SHAPES if cuda else ((2, 64, 6),):
                if time.perf_counter() - started > ns.deadline_s:
                    print(f"deadline: skipping {name} {batch}x{context}", flush=True)
                    continue
                rows += run_shape(bundle, args, batch, context, outputs, probe)
                (out / "step_modes.json").write_text(json.dumps(rows))
            del bundle
            if cuda:
                torch.cuda.empty_cache()
    finally:
        if smi is not None:
            smi.terminate()
    summary(rows)
    print(f"total {time.perf_counter() - started:.1f}s, cpu count {os.cpu_count()}, "
          f"loadavg {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
