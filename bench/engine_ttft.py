"""TTFT and prefill throughput of the hybridkv reference engine, against Hugging Face.

Run on one CUDA GPU (``python bench/engine_ttft.py``; without ``pip install -e .`` use
``PYTHONPATH=src``) or as a CPU smoke test (``python bench/engine_ttft.py --quick``).

What it measures, in one process:

1. **Correctness on the device**: a Gemma-3-1B-shaped model with random bf16 weights is
   built by ``transformers`` (``Gemma3ForCausalLM`` from a ``Gemma3TextConfig``, never
   downloaded) and loaded into our engine through ``hybridkv.engine.weights``; the
   last-token logits of both on one prompt are compared (relative L2 error).
2. **Single-sequence prefill** at 8k / 32k / 64k tokens: our engine (caching off, KV
   written to and read from pages through the block tables, flex/SDPA fast path, chunked
   prefill) vs HF's forward with ``attn_implementation`` ``sdpa`` and ``flex_attention``
   (``logits_to_keep=1``, no KV cache), median of ``--repeats`` after a warm-up; plus the
   FLOP floor at the measured bf16 matmul rate.
3. **Trace replay**: a slice of ``weka_cc_agentic`` (conversations as sessions, prompts of
   30k–120k tokens) through the engine with caching off and under each retention policy:
   TTFT per request, hit rate, prefill throughput.

Results: a table on stdout, ``engine_ttft.json`` and ``engine_ttft.md`` under ``--out``
(default ``$OUT`` when set, else ``out/engine_ttft``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from hybridkv import CORE_POLICIES
from hybridkv.engine.attention import sdpa_attention
from hybridkv.engine.flex import FlexAttention
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, cache_config_for_model, gemma3_pattern
from hybridkv.engine.paged import PagedKVCache
from hybridkv.engine.runner import EngineRunner, RunOptions
from hybridkv.engine.weights import model_from_hf_tensors
from hybridkv.sched.scheduler import SchedRequest

TRACE_DIRS = (".bench_traces", "../shared/traces/weka_cc_agentic",
              "/work/shared/traces/weka_cc_agentic")
TRACE_FILES = ("trace_0545.json.gz", "trace_0521.json.gz", "trace_0553.json.gz")
FILL_BASE = 1 << 50


# ------------------------------------------------------------------------ setup
@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    config: ModelConfig
    lengths: list[int]
    chunk_size: int
    block_size: int
    num_blocks: int
    repeats: int
    min_flex_tokens: int


def quick_cpu_model() -> ModelConfig:
    """The tiny Gemma-3-patterned model of ``--quick`` runs on a CPU (smoke tests)."""
    return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
                       num_kv_heads=1, head_dim=32, layer_types=gemma3_pattern(6),
                       sliding_window=48, query_pre_attn_scalar=32)


def make_setup(args: argparse.Namespace) -> Setup:
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    if args.quick and not cuda:
        return Setup(device, torch.float32, quick_cpu_model(), [256, 512], 256, 16, 4000, 2,
                     128)
    config = ModelConfig.gemma3_1b_shape()
    lengths = [8192] if args.quick else [int(x) for x in args.lengths.split(",")]
    return Setup(device, torch.bfloat16, config, lengths, args.chunk_size, 64,
                 args.num_blocks, 1 if args.quick else args.repeats, args.min_flex_tokens)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(setup: Setup) -> float:
    """Measured dense bf16 (CPU: float32) matmul rate, the FLOP-floor denominator."""
    n = 8192 if setup.device.type == "cuda" else 512
    a = torch.randn(n, n, device=setup.device, dtype=setup.dtype)
    b = torch.randn(n, n, device=setup.device, dtype=setup.dtype)
    for _ in range(3):
        a @ b
    sync(setup.device)
    reps = 20 if setup.device.type == "cuda" else 3
    started = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(setup.device)
    return 2 * n**3 * reps / (time.perf_counter() - started) / 1e12


def prefill_flops(config: ModelConfig, num_tokens: int) -> float:
    """Matmul FLOPs of one prefill: projections, attention over the keys each query reads,
    and the LM head for the last token."""
    hd, h, kvh = config.head_dim, config.num_heads, config.num_kv_heads
    per_layer = (config.hidden_size * (h + 2 * kvh) * hd + h * hd * config.hidden_size
                 + 3 * config.hidden_size * config.intermediate_size)
    flops = 2.0 * per_layer * config.num_layers * num_tokens
    for kind in config.layer_types:
        if kind == "sliding_attention":
            w = config.sliding_window or 0
            pairs = sum(min(p + 1, w) for p in range(min(num_tokens, w))) + \
                max(0, num_tokens - w) * w
        else:
            pairs = num_tokens * (num_tokens + 1) // 2
        flops += 4.0 * h * hd * pairs
    return flops + 2.0 * config.hidden_size * config.vocab_size


# ------------------------------------------------------------------- HF model
def hf_text_config(config: ModelConfig) -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, sliding_window=config.sliding_window,
        layer_types=list(config.layer_types),
        query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
        max_position_embeddings=131072, rms_norm_eps=config.rms_norm_eps)


def build_models(setup: Setup, use_hf: bool) -> tuple[HybridDecoder, Any, str]:
    """(our model, HF model or None, note). With HF, ours takes HF's random weights."""
    if use_hf:
        try:
            import transformers
            from transformers import Gemma3ForCausalLM

            torch.manual_seed(0)
            with torch.device(setup.device):
                hf = Gemma3ForCausalLM(hf_text_config(setup.config))
            hf = hf_cast(hf.eval(), setup.dtype)
            with torch.no_grad():  # HF initialises norms to 0; make (1 + w) matter
                for name, param in hf.named_parameters():
                    if "norm" in name:
                        param.normal_(0.0, 0.1)
            ours = model_from_hf_tensors(setup.config, hf.state_dict(), dtype=setup.dtype,
                                         device=setup.device)
            return ours, hf, f"transformers {transformers.__version__}"
        except Exception as exc:
            traceback.print_exc()
            note = f"HF unavailable: {type(exc).__name__}: {exc}"
    else:
        note = "HF skipped"
    return HybridDecoder(setup.config, dtype=setup.dtype, device=setup.device, seed=0), None, note


def hf_cast(hf: Any, dtype: torch.dtype) -> Any:
    """``hf.to(dtype)`` that keeps the rotary ``inv_freq`` buffers in float32, as
    ``from_pretrained(dtype=...)`` does; casting them to bf16 shifts every rotary angle
    (2^-9 relative: ~15 rad at position 8k) and made HF's logits 10% off its own float32."""
    saved = {name: buf.float().clone() for name, buf in hf.named_buffers() if "inv_freq" in name}
    hf = hf.to(dtype)
    for name, buf in saved.items():
        module, attr = name.rsplit(".", 1)
        setattr(hf.get_submodule(module), attr, buf)
    return hf


def hf_forward(hf: Any, ids: torch.Tensor, impl: str) -> torch.Tensor:
    hf.set_attn_implementation(impl)
    with torch.no_grad():
        out = hf(input_ids=ids, use_cache=False, logits_to_keep=1)
    return out.logits[0, -1]


def time_hf(setup: Setup, hf: Any, impl: str, num_tokens: int,
            ids: torch.Tensor) -> dict[str, Any]:
    try:
        hf_forward(hf, ids, impl)  # warm-up (compiles flex kernels)
        times = []
        for _ in range(setup.repeats):
            sync(setup.device)
            started = time.perf_counter()
            hf_forward(hf, ids, impl)
            sync(setup.device)
            times.append(time.perf_counter() - started)
        return {"seconds": statistics.median(times), "all": times}
    except Exception as exc:  # OOM at long contexts is a result, not a crash
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


# -------------------------------------------------------------------- our engine
class FallbackAttention:
    """Flex first; on any error (compilation, unsupported shape) print it and use SDPA for
    the rest of the run, so one failure does not lose the whole device run."""

    def __init__(self, primary: Any) -> None:
        self.primary = primary
        self.failure: str | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
        if self.failure is None:
            try:
                return self.primary(q, k, v, **kwargs)
            except Exception as exc:
                traceback.print_exc()
                self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return sdpa_attention(q, k, v, **kwargs)

    @property
    def name(self) -> str:
        return "flex+sdpa" if self.failure is None else f"sdpa (flex failed: {self.failure})"


SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def attention_path(setup: Setup, backends: str) -> Any:
    if setup.device.type == "cuda":
        chosen = [SDPA_BACKENDS[name] for name in backends.split(",")]
        return FallbackAttention(FlexAttention(min_tokens=setup.min_flex_tokens,
                                               sdpa_backends=chosen))
    return sdpa_attention


def profile_prefill(setup: Setup, model: HybridDecoder, num_tokens: int, attention: Any,
                    kv_cache: PagedKVCache, out: Path) -> None:
    """Kernel-time breakdown of one prefill (CUDA only), top entries printed."""
    from torch.profiler import ProfilerActivity, profile

    prompt = random_prompt(num_tokens, setup.config.vocab_size, seed=99)
    runner = engine_runner(setup, model, "latest", False, kv_cache, attention)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.run([SchedRequest("prof", prompt, 1)])
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    (out / f"profile_{num_tokens}.txt").write_text(table)
    print("\n".join(table.splitlines()[:20]), flush=True)


def engine_runner(setup: Setup, model: HybridDecoder, policy: str, caching: bool,
                  kv_cache: PagedKVCache | None, attention: Any, *, record_logits: bool = False,
                  max_running: int = 1) -> EngineRunner:
    cache_config = cache_config_for_model(
        setup.config, num_blocks=setup.num_blocks, block_size=setup.block_size,
        dtype_bytes=model.embed.element_size(), enable_caching=caching,
        max_num_batched_tokens=setup.chunk_size)
    options = RunOptions(policy=policy, chunk_size=setup.chunk_size, max_running=max_running,
                         record_logits=record_logits)
    return EngineRunner(model, cache_config, options, attention=attention, kv_cache=kv_cache)


def random_prompt(num_tokens: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_tokens,), generator=gen).tolist()


def time_ours(setup: Setup, model: HybridDecoder, prompt: list[int], attention: Any,
              kv_cache: PagedKVCache | None) -> tuple[dict[str, Any], torch.Tensor]:
    times, logits = [], torch.empty(0)
    for rep in range(setup.repeats + 1):  # the first run warms up (compiles)
        runner = engine_runner(setup, model, "latest", False, kv_cache, attention,
                               record_logits=True)
        record = runner.run([SchedRequest("p", prompt, 1)]).records["p"]
        if rep:
            times.append(record.ttft_s)
        logits = record.sampled_logits[0]
    return {"seconds": statistics.median(times), "all": times}, logits


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return float((got - ref).norm() / ref.norm())


# ------------------------------------------------------------------- trace slice
def trace_dir(arg: str | None) -> Path | None:
    for candidate in ([arg] if arg else list(TRACE_DIRS)):
        path = Path(candidate)
        if path.is_dir() and any(path.glob("trace_*.json.gz")):
            return path
    return None


def load_trace_slice(directory: Path, args: argparse.Namespace,
                     max_prompt_tokens: int | None) -> list[SchedRequest]:
    """Requests with ``min_in <= in <= max_in`` from the first conversations, tokens
    expanded per the replay protocol (block id ``h`` of file ``f`` → ``B`` ids)."""
    files = [directory / f for f in TRACE_FILES if (directory / f).exists()]
    files = files or sorted(directory.glob("trace_*.json.gz"))
    requests: list[SchedRequest] = []
    for file_index, path in enumerate(files[: args.conversations]):
        with gzip.open(path) as handle:
            data = json.loads(handle.read())
        block = int(data["block_size"])
        namespace = (file_index + 1) << 40
        taken = 0
        for turn, entry in enumerate(data["requests"]):
            if entry.get("type") == "subagent" or not args.min_in <= entry["in"] <= args.max_in:
                continue
            tokens = [namespace + h * block + j for h in entry["hash_ids"] for j in range(block)]
            index = len(requests)
            tokens += [FILL_BASE + (index << 24) + p for p in range(len(tokens), entry["in"])]
            if max_prompt_tokens is not None:
                tokens = tokens[:max_prompt_tokens]
            requests.append(SchedRequest(f"{path.name[6:10]}-{turn}", tokens[: entry["in"]],
                                         args.output_tokens, session_id=path.name))
            taken += 1
            if taken == args.requests_per_conversation:
                break
    return requests


def warm_up(setup: Setup, model: HybridDecoder, attention: Any, kv_cache: PagedKVCache) -> None:
    """Compile every kernel variant a replay can meet (flex buckets, short masked chunks,
    dynamic pointwise shapes, decode) before anything is timed."""
    started = time.perf_counter()
    lengths = [700, 2100, 4200, 8400, 16500, 33000] if setup.device.type == "cuda" else [300]
    for num_tokens in lengths:
        runner = engine_runner(setup, model, "latest", False, kv_cache, attention)
        runner.run([SchedRequest("warm", random_prompt(num_tokens, setup.config.vocab_size,
                                                       seed=num_tokens), 2)])
    print(f"  warm-up {time.perf_counter() - started:.1f}s", flush=True)


def replay(setup: Setup, model: HybridDecoder, requests: list[SchedRequest],
           policies: list[str], attention: Any, kv_cache: PagedKVCache,
           deadline: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    warm_up(setup, model, attention, kv_cache)
    for policy in ["caching off", *policies]:
        if time.perf_counter() > deadline:
            print(f"  replay: deadline reached, skipping {policy}", flush=True)
            continue
        runner = engine_runner(setup, model, "latest" if policy == "caching off" else policy,
                               policy != "caching off", kv_cache, attention)
        result = runner.run(requests)
        records = list(result.records.values())
        ttfts = [r.ttft_s or 0.0 for r in records]
        prefill_computed = sum(r.num_prompt_tokens - r.hit_tokens[0] for r in records)
        rows.append({
            "policy": policy,
            "requests": len(records),
            "prompt_tokens": result.prompt_tokens,
            "hit_tokens": result.hit_tokens,
            "hit_rate": result.hit_tokens / max(1, result.prompt_tokens),
            "preemptions": result.num_preemptions,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_max_s": max(ttfts),
            "effective_tok_per_s": result.prompt_tokens / sum(ttfts),
            "computed_tok_per_s": prefill_computed / sum(ttfts),
            "ttft_s": {r.req_id: round(r.ttft_s or 0.0, 4) for r in records},
            "prompt_len": {r.req_id: r.num_prompt_tokens for r in records},
            "hit": {r.req_id: r.hit_tokens[0] for r in records},
            "wall_s": result.wall_s,
        })
        print(f"  replay {policy:<16} hit {rows[-1]['hit_rate']:6.1%}  TTFT p50 "
              f"{rows[-1]['ttft_p50_s']:.3f}s mean {rows[-1]['ttft_mean_s']:.3f}s  "
              f"{rows[-1]['effective_tok_per_s']:,.0f} tok/s effective", flush=True)
    return rows


# ------------------------------------------------------------------------- report
def _seconds_cell(value: dict[str, Any] | None) -> str:
    if not value:
        return "–"
    return f"{value['seconds']:.3f}" if "seconds" in value else value["error"][:40]


def _ratio_cell(value: dict[str, Any] | None, ours: float) -> str:
    """HF time over ours: > 1 means our prefill is faster."""
    if not value or "seconds" not in value:
        return "–"
    return f"{value['seconds'] / ours:.2f}×"


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [f"Device: {env['device']} · torch {env['torch']} · {env['hf']} · "
             f"bf16 matmul {env['matmul_tflops']:.0f} TFLOP/s (measured) · "
             f"chunk {env['chunk_size']} · block {env['block_size']}", ""]
    check = results.get("hf_check")
    if check:
        parts = ", ".join(f"{k} {v:.2e}" for k, v in check.items() if k != "tokens")
        lines += [f"Last-token logits ({env['dtype']}), relative L2 error against our float32 "
                  f"run of the same weights ({check['tokens']} tokens): {parts}.", ""]
    lines += ["| tokens | ours TTFT (s) | ours tok/s | HF sdpa (s) | HF flex (s) | HF sdpa ÷ ours "
              "| HF flex ÷ ours | FLOP floor (s) | ours ÷ floor |",
              "|---|---|---|---|---|---|---|---|---|"]
    cudnn_notes: list[str] = []
    for row in results["prefill"]:
        cell = {key: _seconds_cell(row.get(key)) for key in ("hf_sdpa", "hf_flex_attention")}
        ratio = {key: _ratio_cell(row.get(key), row["ours"]["seconds"])
                 for key in ("hf_sdpa", "hf_flex_attention")}
        ours = row["ours"]["seconds"]
        if "ours_cudnn" in row:
            cudnn_notes.append(f"{row['tokens']:,}: {row['ours_cudnn']['seconds']:.3f} s")
        lines.append(f"| {row['tokens']:,} | {ours:.3f} | {row['tokens'] / ours:,.0f} | "
                     f"{cell['hf_sdpa']} | {cell['hf_flex_attention']} | {ratio['hf_sdpa']} | "
                     f"{ratio['hf_flex_attention']} | {row['floor_s']:.3f} | "
                     f"{ours / row['floor_s']:.2f}× |")
    if cudnn_notes:
        lines += ["", "Ours with cuDNN attention allowed for full layers: "
                  + ", ".join(cudnn_notes) + "."]
    if results.get("replay"):
        lines += ["", f"Trace replay: {results['replay_note']}", "",
                  "| policy | hit rate | TTFT p50 (s) | TTFT mean (s) | TTFT max (s) | "
                  "prompt tok/s (effective) | computed tok/s | preemptions |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in results["replay"]:
            lines.append(f"| {row['policy']} | {row['hit_rate']:.1%} | {row['ttft_p50_s']:.3f} | "
                         f"{row['ttft_mean_s']:.3f} | {row['ttft_max_s']:.3f} | "
                         f"{row['effective_tok_per_s']:,.0f} | {row['computed_tok_per_s']:,.0f} "
                         f"| {row['preemptions']} |")
        first = results["replay"]
        lines += ["", "TTFT per request (s), caching off → " + first[1]["policy"] + ":", ""]
        off, on = first[0], first[1]
        lines.append(", ".join(f"{rid} ({off['prompt_len'][rid] // 1000}k, hit "
                               f"{on['hit'][rid] // 1000}k): {off['ttft_s'][rid]:.3f}→"
                               f"{on['ttft_s'][rid]:.3f}" for rid in off["ttft_s"]))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main
def save(out: Path, results: dict[str, Any]) -> None:
    (out / "engine_ttft.json").write_text(json.dumps(results, indent=1, default=str))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test (CPU: tiny model; CUDA: 8k prefill, few requests)")
    parser.add_argument("--cpu", action="store_true", help="ignore CUDA")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/engine_ttft"))
    parser.add_argument("--lengths", default="8192,32768,65536")
    parser.add_argument("--chunk-size", type=int, default=32768)
    parser.add_argument("--num-blocks", type=int, default=40000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-flex-tokens", type=int, default=2048)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--pointwise", choices=("compiled", "eager"), default=None,
                        help="norm/rope/activation kernels (default: compiled on CUDA)")
    parser.add_argument("--compare-cudnn", action="store_true",
                        help="also time our prefill with cuDNN attention allowed")
    parser.add_argument("--sdpa-backends", default="flash,efficient,math",
                        help="SDPA kernels for full layers and short chunks (CUDA)")
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--requests-per-conversation", type=int, default=6)
    parser.add_argument("--min-in", type=int, default=30000)
    parser.add_argument("--max-in", type=int, default=120000)
    parser.add_argument("--output-tokens", type=int, default=2)
    parser.add_argument("--policies", default=",".join(CORE_POLICIES))
    parser.add_argument("--deadline-s", type=float, default=520.0,
                        help="stop starting replay configurations after this many seconds")
    return parser.parse_args()


@dataclass
class Bench:
    """Everything the three sections share."""

    args: argparse.Namespace
    setup: Setup
    out: Path
    ours: HybridDecoder
    hf: Any
    attention: Any
    kv_cache: PagedKVCache
    results: dict[str, Any]
    started: float


def _last_logits(b: Bench, model: HybridDecoder, attention: Any, prompt: list[int],
                 kv_cache: PagedKVCache | None) -> torch.Tensor:
    runner = engine_runner(b.setup, model, "latest", False, kv_cache, attention,
                           record_logits=True)
    return runner.run([SchedRequest("c", prompt, 1)]).records["c"].sampled_logits[0]


def section_check(b: Bench) -> None:
    """Last-token logits of every path against a float32 reference of the same weights
    (ours in float32, eager ops, SDPA). A random 26-layer model amplifies rounding a lot,
    so the bf16 paths are judged against HF's own bf16 error, not against zero."""
    setup = b.setup
    tokens = min(setup.lengths[0], 8192)
    prompt = random_prompt(tokens, setup.config.vocab_size, seed=1)
    wide = b.ours.converted(dtype=torch.float32)
    small = Setup(**{**setup.__dict__,
                     "num_blocks": setup.config.num_layers * (tokens // setup.block_size + 2) + 16})
    runner = engine_runner(small, wide, "latest", False, None, sdpa_attention,
                           record_logits=True)
    ref = runner.run([SchedRequest("c", prompt, 1)]).records["c"].sampled_logits[0]
    del runner, wide
    check: dict[str, Any] = {"tokens": tokens,
                             "ours_fast": rel_err(_last_logits(b, b.ours, b.attention, prompt,
                                                                    b.kv_cache), ref),
                             "ours_sdpa_only": rel_err(_last_logits(b, b.ours, sdpa_attention,
                                                                    prompt, b.kv_cache), ref)}
    if b.hf is not None:
        ids = torch.tensor([prompt], device=setup.device)
        check["hf_sdpa"] = rel_err(hf_forward(b.hf, ids, "sdpa"), ref)
        b.hf = hf_cast(b.hf, torch.float32)
        check["hf_fp32_vs_ours_fp32"] = rel_err(hf_forward(b.hf, ids, "sdpa"), ref)
        b.hf = hf_cast(b.hf, setup.dtype)
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    b.results["hf_check"] = check
    print("check (relative L2 error vs our float32 logits)", check, flush=True)


def section_prefill(b: Bench) -> None:
    """Single-sequence prefill: ours vs HF (sdpa, flex_attention) vs the FLOP floor."""
    setup = b.setup
    b.results["prefill"] = []
    tflops = b.results["environment"]["matmul_tflops"]
    for num_tokens in setup.lengths:
        prompt = random_prompt(num_tokens, setup.config.vocab_size, seed=num_tokens)
        row: dict[str, Any] = {"tokens": num_tokens,
                               "floor_s": prefill_flops(setup.config, num_tokens) / tflops / 1e12}
        row["ours"], _ = time_ours(setup, b.ours, prompt, b.attention, b.kv_cache)
        if b.args.compare_cudnn and setup.device.type == "cuda":
            with_cudnn = attention_path(setup, "cudnn,flash,efficient,math")
            row["ours_cudnn"], _ = time_ours(setup, b.ours, prompt, with_cudnn, b.kv_cache)
        if b.hf is not None:
            ids = torch.tensor([prompt], device=setup.device)
            for impl in ("sdpa", "flex_attention"):
                row[f"hf_{impl}"] = time_hf(setup, b.hf, impl, num_tokens, ids)
                if setup.device.type == "cuda":
                    torch.cuda.empty_cache()
        b.results["prefill"].append(row)
        print("prefill", json.dumps(row), flush=True)
        save(b.out, b.results)


def section_replay(b: Bench) -> None:
    """The weka_cc_agentic slice, caching off and under each policy."""
    args, setup = b.args, b.setup
    directory = trace_dir(args.trace_dir)
    if directory is None:
        b.results["replay_note"] = "no weka_cc_agentic trace found (--trace-dir)"
        return
    quick_cpu = args.quick and setup.device.type == "cpu"
    if args.quick:
        args.conversations, args.requests_per_conversation = 2, 3
    requests = load_trace_slice(directory, args, 600 if quick_cpu else None)
    total = sum(len(r.prompt_token_ids) for r in requests)
    b.results["replay_note"] = (
        f"{len(requests)} requests from {args.conversations} conversations of "
        f"{directory.name} ({args.min_in:,}–{args.max_in:,} input tokens"
        f"{', cut to 600 tokens' if quick_cpu else ''}; {total:,} prompt tokens), one "
        f"request at a time (max_running 1), sessions in trace order, "
        f"{args.output_tokens} output tokens, block {setup.block_size}, pool "
        f"{setup.num_blocks:,} blocks")
    print("replay:", b.results["replay_note"], flush=True)
    policies = [p for p in args.policies.split(",") if p]
    b.results["replay"] = replay(setup, b.ours, requests, policies, b.attention, b.kv_cache,
                                 b.started + args.deadline_s)


def main() -> int:
    started = time.perf_counter()
    args = parse_args()
    setup = make_setup(args)
    if setup.device.type == "cpu":
        torch.set_num_threads(1)  # tiny matrices: OpenMP hand-offs cost more than they save
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ours, hf, hf_note = build_models(setup, use_hf=not args.no_hf)
    device_name = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" \
        else platform.processor() or "cpu"
    results: dict[str, Any] = {"environment": {
        "device": device_name, "torch": torch.__version__, "hf": hf_note,
        "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"),
        "matmul_tflops": matmul_tflops(setup), "chunk_size": setup.chunk_size,
        "block_size": setup.block_size, "dtype": str(setup.dtype),
        "model": "gemma3-1b shape" if setup.config.num_layers == 26 else "tiny",
    }}
    print(json.dumps(results["environment"]), flush=True)
    pointwise = args.pointwise or ("compiled" if setup.device.type == "cuda" else "eager")
    if pointwise == "compiled":
        ours.use_compiled_pointwise()
    results["environment"] |= {"pointwise": pointwise, "sdpa_backends": args.sdpa_backends}
    attention = attention_path(setup, args.sdpa_backends)
    kv_cache = engine_runner(setup, ours, "latest", True, None, attention).kv_cache
    bench = Bench(args, setup, out, ours, hf, attention, kv_cache, results, started)
    section_check(bench)
    section_prefill(bench)
    bench.hf = None
    del hf
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
        if not args.quick:
            try:
                profile_prefill(setup, ours, 32768, attention, kv_cache, out)
            except Exception:
                traceback.print_exc()
    section_replay(bench)
    results["environment"]["attention"] = getattr(attention, "name", "sdpa")
    save(out, results)
    text = markdown(results)
    (out / "engine_ttft.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
