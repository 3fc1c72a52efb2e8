"""TTFT of a window-recompute bridge hit against a full recompute (issue 6 acceptance).

Run on one CUDA GPU (``PYTHONPATH=src python bench/bridge_ttft.py``) or as a CPU smoke test
(``--quick``: tiny model, 1k context).

Scenario, per configuration (one request at a time, fresh cache manager, shared pages):

1. ``fill``: a ``--context``-token prompt (default 65,536), prefilled and cached;
2. ``probe``: a prompt of the same length sharing ``fill``'s first ``--shared`` tokens
   (default 60,000), then diverging. Its TTFT is the number reported.

Configurations: caching off; ``latest`` (full attention matches ~60k tokens but ``fill``
left no window tail there: a 0-token hit, full recompute); ``latest+recompute`` (a cold
bridge: hit ``s = F - B``, full-attention KV read from the cache up to ``F``, only the
``B`` bridge tokens plus the suffix computed; ``B = 22 × 511 → 11,264`` on the
Gemma-3-1B shape). Each configuration runs once untimed (kernel compilation), then
``--repeats`` times; the median is reported. The probe's first-token logits under each
cached configuration are compared with caching off (relative L2 error, same argmax).

Results: a table on stdout, ``bridge_ttft.json`` and ``bridge_ttft.md`` under ``--out``
(default ``$OUT`` when set, else ``out/bridge_ttft``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from engine_ttft import (
    Setup,
    attention_path,
    engine_runner,
    quick_cpu_model,
    random_prompt,
    rel_err,
)

from hybridkv import KVCacheManager
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig
from hybridkv.engine.paged import PagedKVCache
from hybridkv.sched.scheduler import SchedRequest

CONFIGS = (("caching off", "latest", False), ("latest", "latest", True),
           ("latest+recompute", "latest+recompute", True))


def make_setup(args: argparse.Namespace) -> tuple[Setup, int, int]:
    """(setup, context tokens, shared tokens)."""
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    if args.quick and not cuda:
        return Setup(device, torch.float32, quick_cpu_model(), [], 256, 16, 4000, 2, 128), \
            1024, 900
    setup = Setup(device, torch.bfloat16, ModelConfig.gemma3_1b_shape(), [], args.chunk_size,
                  64, args.num_blocks, args.repeats, args.min_flex_tokens)
    return setup, args.context, args.shared


def workload(setup: Setup, context: int, shared: int) -> list[SchedRequest]:
    vocab = setup.config.vocab_size
    fill = random_prompt(context, vocab, seed=1)
    probe = fill[:shared] + random_prompt(context - shared, vocab, seed=2)
    return [SchedRequest("fill", fill, 1), SchedRequest("probe", probe, 1)]


def run_config(setup: Setup, model: HybridDecoder, attention: Any, kv_cache: PagedKVCache,
               requests: list[SchedRequest], policy: str, caching: bool) -> dict[str, Any]:
    """One untimed run, then ``setup.repeats`` timed runs of fill + probe."""
    times: list[float] = []
    row: dict[str, Any] = {}
    for rep in range(setup.repeats + 1):
        runner = engine_runner(setup, model, policy, caching, kv_cache, attention,
                               record_logits=True)
        result = runner.run(requests)
        probe = result.records["probe"]
        assert probe.ttft_s is not None
        if rep:
            times.append(probe.ttft_s)
        plan = probe.prefill_plans[0]
        row = {"hit_tokens": probe.hit_tokens[0],
               "full_attention_cached_tokens": plan.full_attention_cached_tokens,
               "window_floor_tokens": plan.window_floor_tokens,
               "bridge_tokens": result.bridge_tokens,
               "computed_tokens": probe.num_prompt_tokens - probe.hit_tokens[0],
               "logits": probe.sampled_logits[0],
               "fill_ttft_s": result.records["fill"].ttft_s}
    row |= {"ttft_s": statistics.median(times), "ttft_all_s": times}
    return row


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [f"Device: {env['device']} · torch {env['torch']} · {env['model']} "
             f"({env['dtype']}) · attention {env['attention']} · chunk {env['chunk_size']} · "
             f"block {env['block_size']} · bridge length B = {env['bridge_tokens_B']:,} · "
             f"context {env['context']:,}, shared prefix {env['shared']:,} · median of "
             f"{env['repeats']} · {env['date']}", "",
             "| configuration | probe hit (tokens) | full-attention KV cached | bridge "
             "(tokens) | computed (tokens) | TTFT (s) | caching off ÷ this | first-token "
             "logits vs caching off |",
             "|---|---|---|---|---|---|---|---|"]
    off = results["rows"][0]["ttft_s"]
    for row in results["rows"]:
        check = row.get("logits_vs_off", "–")
        lines.append(f"| {row['label']} | {row['hit_tokens']:,} | "
                     f"{row['full_attention_cached_tokens']:,} | {row['bridge_tokens']:,} | "
                     f"{row['computed_tokens']:,} | {row['ttft_s']:.3f} | "
                     f"{off / row['ttft_s']:.2f}× | {check} |")
    ratio = results["rows"][1]["ttft_s"] / results["rows"][2]["ttft_s"]
    lines += ["", f"Bridge hit vs full recompute (`latest` ÷ `latest+recompute`): "
                  f"{ratio:.2f}× faster TTFT."]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke test (tiny model)")
    parser.add_argument("--cpu", action="store_true", help="ignore CUDA")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/bridge_ttft"))
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--shared", type=int, default=60000)
    parser.add_argument("--chunk-size", type=int, default=32768)
    parser.add_argument("--num-blocks", type=int, default=12000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-flex-tokens", type=int, default=2048)
    parser.add_argument("--sdpa-backends", default="flash,efficient,math")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    setup, context, shared = make_setup(args)
    if setup.device.type == "cpu":
        torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = HybridDecoder(setup.config, dtype=setup.dtype, device=setup.device, seed=0)
    if setup.device.type == "cuda":
        model.use_compiled_pointwise()
    attention = attention_path(setup, args.sdpa_backends)
    probe_runner = engine_runner(setup, model, "latest+recompute", True, None, attention)
    kv_cache = probe_runner.kv_cache
    bridge_b = KVCacheManager(probe_runner.cache_config,
                              "latest+recompute").coordinator.bridge_tokens
    requests = workload(setup, context, shared)
    results: dict[str, Any] = {"environment": {
        "device": torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "model": "gemma3-1b shape" if setup.config.num_layers == 26 else "tiny",
        "dtype": str(setup.dtype).removeprefix("torch."), "chunk_size": setup.chunk_size,
        "block_size": setup.block_size, "context": context, "shared": shared,
        "repeats": setup.repeats, "bridge_tokens_B": bridge_b}, "rows": []}
    started = time.perf_counter()
    for label, policy, caching in CONFIGS:
        row = run_config(setup, model, attention, kv_cache, requests, policy, caching)
        row["label"] = label
        results["rows"].append(row)
        print(f"{label:<18} hit {row['hit_tokens']:>7,}  "
              f"F {row['full_attention_cached_tokens']:>7,}  bridge {row['bridge_tokens']:>6,}  "
              f"computed {row['computed_tokens']:>7,}  "
              f"TTFT {row['ttft_s']:.3f}s  (all {[round(t, 4) for t in row['ttft_all_s']]})",
              flush=True)
    off_logits = results["rows"][0]["logits"]
    for row in results["rows"]:
        logits = row.pop("logits")
        if row is not results["rows"][0]:
            same = int(logits.argmax()) == int(off_logits.argmax())
            row["logits_vs_off"] = (f"rel. L2 {rel_err(logits, off_logits):.1e}, "
                                    f"{'same' if same else 'DIFFERENT'} token")
    results["environment"]["attention"] = getattr(attention, "name", "sdpa")
    results["environment"]["wall_s"] = round(time.perf_counter() - started, 1)
    (out / "bridge_ttft.json").write_text(json.dumps(results, indent=1, default=str))
    text = markdown(results)
    (out / "bridge_ttft.md").write_text(text)
    print(text)
    rows = {row["label"]: row for row in results["rows"]}
    bridged = rows["latest+recompute"]
    ok = rows["latest"]["hit_tokens"] == 0 and bridged["window_floor_tokens"] > 0 and \
        bridged["bridge_tokens"] > 0
    if not ok:
        print("expected: no hit under latest, a cold bridge under latest+recompute")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
