"""TTFT of a recurrent-checkpoint hit against a full recompute, and the Gated DeltaNet fast
path against plain PyTorch (issue 13, GPU acceptance).

Run on one CUDA GPU (``PYTHONPATH=src python bench/recurrent_ttft.py``) or as a CPU smoke
test (``--quick``: tiny model, 1k context).

Two sections:

1. ``kernels``: one Gated DeltaNet layer's recurrence at the Qwen3.5-27B shape (48 value
   heads, 16 key heads, dk = dv = 128) over ``--kernel-lengths`` tokens: the plain
   PyTorch reference (token by token, float32; only up to ``--reference-max`` tokens, it
   is launch-bound) and the chunked form (64-token chunks, batched triangular solves,
   then a PyTorch loop over chunks). Accuracy: relative L2 error of the outputs and final
   state against the float64 token-by-token reference on the first ``--check-tokens``
   tokens.
2. ``ttft``: a Qwen3.5-like model (the 27B model's per-layer shape, ``--layers`` deep,
   every 4th layer full attention), bf16. Per context length: ``fill`` (a prompt of
   ``context`` tokens) then ``probe`` (the first ``context - --suffix`` tokens of
   ``fill`` plus ``--suffix`` new ones). With caching off the probe recomputes every
   token; with caching on (``latest``) it resumes every recurrent layer from the fill's
   checkpoint at its replay boundary (the last block boundary before its last token; the
   suffix is shorter than a block, so the shared prefix reaches it) and reads the
   full-attention KV before it. Each configuration runs once untimed, then ``--repeats``
   times (median). The probe's first-token logits with the hit are compared with the
   recompute.

Results: tables on stdout, ``recurrent_ttft.json`` and ``recurrent_ttft.md`` under
``--out`` (default ``$OUT`` when set, else ``out/recurrent_ttft``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from engine_ttft import FallbackAttention, random_prompt, rel_err, sync

from hybridkv.engine.attention import sdpa_attention
from hybridkv.engine.checkpoints import PagedStateCache
from hybridkv.engine.flex import FlexAttention
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, cache_config_for_model, qwen3_next_pattern
from hybridkv.engine.paged import PagedKVCache
from hybridkv.engine.recurrent import (
    Chunking,
    gated_delta_chunked,
    gated_delta_reference,
    random_inputs,
)
from hybridkv.engine.runner import EngineRunner, RunOptions
from hybridkv.sched.scheduler import SchedRequest


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls after one warm-up, and the last result."""
    result = fn()
    sync(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


# ------------------------------------------------------------------------ kernels
def section_kernels(args: argparse.Namespace, device: torch.device,
                    config: ModelConfig) -> list[dict[str, Any]]:
    heads, dk, dv = (config.linear_num_value_heads, config.linear_key_head_dim,
                     config.linear_value_head_dim)
    paths: dict[str, Any] = {
        "reference (token loop, fp32)": gated_delta_reference,
        "chunked, PyTorch loop": partial(gated_delta_chunked, chunking=Chunking(64)),
    }
    gen = torch.Generator().manual_seed(0)  # inputs drawn on the CPU, then moved
    rows: list[dict[str, Any]] = []
    # accuracy against float64 token by token
    n = args.check_tokens
    q, k, v, g, b = random_inputs(n, heads, dk, dv, generator=gen, device=device)
    s0 = 0.1 * torch.randn(heads, dk, dv, generator=gen, dtype=torch.float64).to(device)
    o_ref, s_ref = gated_delta_reference(q, k, v, g, b, s0, stops=[n])
    inputs32 = [x.float() for x in (q, k, v, g, b)]
    for name, path in list(paths.items()):
        try:
            o, s = path(*inputs32, s0.float(), stops=[n // 3, n])
        except Exception:  # a kernel that fails to build must not lose the whole run
            traceback.print_exc()
            del paths[name]
            continue
        rows.append({"section": "accuracy", "path": name, "tokens": n,
                     "rel_err_out": rel_err(o, o_ref), "rel_err_state": rel_err(s[-1], s_ref[0])})
        print(f"accuracy  {name:<30} {n} tok  out {rows[-1]['rel_err_out']:.1e}  "
              f"state {rows[-1]['rel_err_state']:.1e}", flush=True)
    for length in [int(x) for x in args.kernel_lengths.split(",")]:
        q, k, v, g, b = random_inputs(length, heads, dk, dv, generator=gen,
                                      dtype=torch.float32, device=device)
        s0 = torch.zeros(heads, dk, dv, device=device)
        for name, path in paths.items():
            if name.startswith("reference") and length > args.reference_max:
                continue

            def call(path: Any = path, inputs: tuple[Any, ...] = (q, k, v, g, b, s0),
                     length: int = length) -> Any:
                return path(*inputs, stops=[length])

            reps = 1 if name.startswith("reference") else args.repeats
            seconds, _ = timed(call, device, reps)
            rows.append({"section": "speed", "path": name, "tokens": length,
                         "seconds": seconds, "tokens_per_s": length / seconds})
            print(f"speed     {name:<30} {length:>6} tok  {seconds * 1e3:9.2f} ms  "
                  f"{length / seconds / 1e6:7.2f} M tok/s", flush=True)
    return rows


# --------------------------------------------------------------------------- TTFT
def build(args: argparse.Namespace, device: torch.device,
          quick: bool) -> tuple[HybridDecoder, Any, Any]:
    if quick:
        config = ModelConfig.tiny(layer_types=qwen3_next_pattern(4), sliding_window=None,
                                  vocab_size=512, hidden_size=64, intermediate_size=128)
        model = HybridDecoder(config, dtype=torch.float32, device=device, seed=0)
        return model, sdpa_attention, partial(gated_delta_chunked, chunking=Chunking(16))
    config = ModelConfig.qwen35_shape(num_layers=args.layers)
    model = HybridDecoder(config, dtype=torch.bfloat16, device=device, seed=0)
    model.use_compiled_pointwise()
    attention = FallbackAttention(FlexAttention(min_tokens=2048))
    chunking = Chunking(64)
    return model, attention, partial(gated_delta_chunked, chunking=chunking)


def section_ttft(args: argparse.Namespace, device: torch.device, quick: bool,
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    model, attention, recurrence = build(args, device, quick)
    contexts = [1024] if quick else [int(x) for x in args.contexts.split(",")]
    block = 64 if quick else args.block_size
    chunk = 256 if quick else args.chunk_size
    suffix = 50 if quick else args.suffix
    def config(caching: bool, num_blocks: int = 2) -> Any:
        return cache_config_for_model(model.config, num_blocks=num_blocks, block_size=block,
                                      dtype_bytes=model.embed.element_size(),
                                      enable_caching=caching, max_num_batched_tokens=chunk)

    # every group holds both prompts' blocks (fill stays cached while the probe runs)
    num_blocks = len(config(True).groups) * 2 * (-(-max(contexts) // block)) + 16
    config = partial(config, num_blocks=num_blocks)

    kv_cache = PagedKVCache(config(True), num_kv_heads=model.config.num_kv_heads,
                            head_dim=model.config.head_dim, dtype=model.dtype, device=device)
    state_cache = PagedStateCache(config(True), model.config, conv_dtype=model.dtype,
                                  state_dtype=torch.float32, device=device)
    env = {"model": f"Qwen3.5-27B per-layer shape, {model.config.num_layers} layers "
                    f"({model.config.layer_types.count('full_attention')} full attention, "
                    f"{model.config.layer_types.count('linear_attention')} Gated DeltaNet)"
                    if not quick else "tiny",
           "dtype": str(model.dtype).removeprefix("torch."), "block_size": block,
           "chunk_size": chunk, "suffix": suffix, "repeats": args.repeats,
           "checkpoint_bytes_per_layer": model.config.recurrent_state_bytes(2),
           "recurrence": "chunked, 64-token chunks"}
    rows: list[dict[str, Any]] = []
    vocab = model.config.vocab_size
    for context in contexts:
        fill = random_prompt(context, vocab, seed=1)
        probe = fill[:context - suffix] + random_prompt(suffix, vocab, seed=2)
        requests = [SchedRequest("fill", fill, 1), SchedRequest("probe", probe, 1)]
        logits_off: torch.Tensor | None = None
        for label, caching in (("full recompute (caching off)", False),
                               ("checkpoint hit", True)):
            times, record = [], None
            for rep in range(args.repeats + 1):
                options = RunOptions(policy="latest", chunk_size=chunk, max_running=1,
                                     record_logits=True)
                runner = EngineRunner(model, config(caching), options, attention=attention,
                                      kv_cache=kv_cache, recurrence=recurrence,
                                      state_cache=state_cache)
                record = runner.run(requests).records["probe"]
                assert record.ttft_s is not None
                if rep:
                    times.append(record.ttft_s)
            assert record is not None
            row = {"context": context, "config": label, "hit_tokens": record.hit_tokens[0],
                   "computed_tokens": context - record.hit_tokens[0],
                   "ttft_s": statistics.median(times), "ttft_all_s": times}
            logits = record.sampled_logits[0]
            if logits_off is None:
                logits_off = logits
            else:
                same = int(logits.argmax()) == int(logits_off.argmax())
                row["logits_vs_recompute"] = (f"rel. L2 {rel_err(logits, logits_off):.1e}, "
                                              f"{'same' if same else 'DIFFERENT'} token")
            rows.append(row)
            print(f"ttft  {context:>6}  {label:<28} hit {row['hit_tokens']:>6}  "
                  f"TTFT {row['ttft_s']:.3f}s  all {[round(t, 3) for t in times]}  "
                  f"{row.get('logits_vs_recompute', '')}", flush=True)
    return rows, env


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [f"Device: {env['device']} · torch {env['torch']} · {env['date']}", "",
             f"Gated DeltaNet recurrence, one layer ({env['recurrence_shape']}):", "",
             "| path | tokens | time (ms) | M tokens/s | vs plain PyTorch reference |",
             "|---|---|---|---|---|"]
    speed = [r for r in results["kernels"] if r["section"] == "speed"]
    reference = {r["tokens"]: r["seconds"] for r in speed if r["path"].startswith("reference")}
    loop = {r["tokens"]: r["seconds"] for r in speed if "PyTorch loop" in r["path"]}
    for r in speed:
        base = reference.get(r["tokens"])
        ratio = f"{base / r['seconds']:.1f}×" if base else \
            (f"{loop[r['tokens']] / r['seconds']:.1f}× (vs PyTorch loop)"
             if r["tokens"] in loop else "–")
        lines.append(f"| {r['path']} | {r['tokens']:,} | {r['seconds'] * 1e3:.2f} | "
                     f"{r['tokens_per_s'] / 1e6:.2f} | {ratio} |")
    lines += ["", "| path | tokens | rel. L2 error, outputs | final state |", "|---|---|---|---|"]
    for r in results["kernels"]:
        if r["section"] == "accuracy":
            lines.append(f"| {r['path']} | {r['tokens']:,} | {r['rel_err_out']:.1e} | "
                         f"{r['rel_err_state']:.1e} |")
    ttft = results.get("ttft_environment")
    if ttft:
        lines += ["", f"TTFT: {ttft['model']}, {ttft['dtype']}, block {ttft['block_size']}, "
                      f"chunk {ttft['chunk_size']}, probe suffix {ttft['suffix']} new tokens, "
                      f"median of {ttft['repeats']}, recurrence "
                      f"{ttft['recurrence']}", "",
                  "| context | configuration | hit (tokens) | computed (tokens) | TTFT (s) | "
                  "speed-up | first-token logits vs recompute |", "|---|---|---|---|---|---|---|"]
        off: dict[int, float] = {}
        for r in results["ttft"]:
            off.setdefault(r["context"], r["ttft_s"])
            lines.append(f"| {r['context']:,} | {r['config']} | {r['hit_tokens']:,} | "
                         f"{r['computed_tokens']:,} | {r['ttft_s']:.3f} | "
                         f"{off[r['context']] / r['ttft_s']:.1f}× | "
                         f"{r.get('logits_vs_recompute', '–')} |")
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke test (tiny model)")
    parser.add_argument("--cpu", action="store_true", help="ignore CUDA")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/recurrent_ttft"))
    parser.add_argument("--sections", default="kernels,ttft")
    parser.add_argument("--kernel-lengths", default="8192,32768,65536")
    parser.add_argument("--reference-max", type=int, default=8192)
    parser.add_argument("--check-tokens", type=int, default=2048)
    parser.add_argument("--contexts", default="32768,65536")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--suffix", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    quick = args.quick and not cuda
    if quick:
        torch.set_num_threads(1)
        args.kernel_lengths, args.reference_max, args.check_tokens = "256", 256, 64
        args.repeats = 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    results: dict[str, Any] = {"environment": {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}, "kernels": [],
        "ttft": []}
    started = time.perf_counter()
    shape = ModelConfig.qwen35_shape(num_layers=4) if not quick else \
        ModelConfig.tiny(layer_types=qwen3_next_pattern(4), linear_key_head_dim=16,
                         linear_value_head_dim=16)
    results["environment"]["recurrence_shape"] = (
        f"{shape.linear_num_value_heads} value heads, dk = {shape.linear_key_head_dim}, "
        f"dv = {shape.linear_value_head_dim}")
    if "kernels" in sections:
        results["kernels"] = section_kernels(args, device, shape)
    if "ttft" in sections:
        results["ttft"], results["ttft_environment"] = section_ttft(args, device, quick)
    results["environment"]["wall_s"] = round(time.perf_counter() - started, 1)
    (out / "recurrent_ttft.json").write_text(json.dumps(results, indent=1, default=str))
    text = markdown(results)
    (out / "recurrent_ttft.md").write_text(text)
    print(text)
    hits = [r for r in results["ttft"] if r["config"] == "checkpoint hit"]
    ok = all(r["hit_tokens"] > 0 and "same token" in r["logits_vs_recompute"] for r in hits)
    if not ok:
        print("expected: every probe hits a checkpoint and samples the recompute's token")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
