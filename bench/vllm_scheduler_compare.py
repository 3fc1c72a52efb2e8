"""vLLM 0.33's real ``Scheduler`` driving (a) its own ``KVCacheManager`` and (b) hybridkv's
facade (``hybridkv.vllm``) over the same requests; used by ``compare_vllm.py
--through-vllm-scheduler``.

Both sides get identical vLLM ``Request`` objects (sha256 block hashes at the gcd of the
group block sizes) all queued at the start, a CPU stand-in ``ModelConfig`` (a local
``config.json``; no weights), synchronous scheduling, and the same sampled ids (a function
of request and position). Each step's ``SchedulerOutput`` block tables are recorded (new
requests' full tables, running requests' appended ids) and must be equal up to a
consistent renaming of block ids; each request's hit tokens are the ``num_computed_tokens``
of its first ``NewRequestData``. Time inside each manager: every manager method the
Scheduler calls is wrapped by the same timer.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.config import CacheConfig as VllmCacheConfig
from vllm.config import ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm_adapter import vllm_kv_cache_config

from hybridkv.config import CacheConfig
from hybridkv.traces.trace import OUTPUT_TOKEN_BASE, Trace
from hybridkv.vllm.scheduler import manager_swapped

TIMED_METHODS = ("get_computed_blocks", "allocate_slots", "free", "cache_blocks",
                 "new_step_starts", "get_blocks", "get_block_ids", "take_events",
                 "make_prefix_cache_stats", "record_prefix_cache_stats",
                 "estimate_cached_tokens", "take_new_block_ids",
                 "take_kv_cache_block_copies", "take_boundary_state_offloads")
MAX_MODEL_LEN = 1 << 21


@dataclass
class SchedulerRun:
    """One side's record: per-request first hit, per-step tables, manager time."""

    first_hits: dict[str, int] = field(default_factory=dict)
    tables: list[tuple[str, tuple[tuple[int, ...], ...], tuple[int, ...]]] = field(
        default_factory=list)
    """Per table record: request, per-group ids, per group how many leading ids are hit
    blocks (the rest were allocated fresh by that step)."""
    manager_seconds: float = 0.0
    wall_seconds: float = 0.0
    steps: int = 0
    preemptions: int = 0


def _stand_in_model(directory: Path) -> Path:
    """A local ``config.json`` ModelConfig accepts (OPT-shaped, long positions; no weights)."""
    model = directory / "stand-in-model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
        "word_embed_proj_dim": 768, "ffn_dim": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "vocab_size": 50272,
        "max_position_embeddings": MAX_MODEL_LEN, "torch_dtype": "float16"}))
    return model


def build_scheduler(config: CacheConfig, policy: str, *, facade: bool, max_running: int,
                    chunk_size: int, model_dir: Path) -> Scheduler:
    """vLLM's Scheduler over ``config``'s groups (its manager, or the facade)."""
    sizes = [g.spec.block_size for g in config.groups]
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float16", seed=0,
                                 skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN),
        cache_config=VllmCacheConfig(block_size=math.lcm(*sizes), enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_running, max_num_batched_tokens=chunk_size,
            max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
            async_scheduling=False, is_encoder_decoder=False, watermark=0.0))
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks  # EngineCore sets it
    kwargs = {"vllm_config": vllm_config,
              "kv_cache_config": vllm_kv_cache_config(config, policy),
              "structured_output_manager": StructuredOutputManager(vllm_config),
              "block_size": math.lcm(*sizes), "hash_block_size": math.gcd(*sizes),
              "log_stats": True}
    if not facade:
        return Scheduler(**kwargs)
    with manager_swapped(policy):
        return Scheduler(**kwargs)


def _timed(run: SchedulerRun, method: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.perf_counter

    def call(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return method(*args, **kwargs)
        finally:
            run.manager_seconds += clock() - started

    return call


def _requests(trace: Trace, hash_block_size: int) -> Iterator[Request]:
    hasher = get_request_block_hasher(hash_block_size, sha256)
    for index, request in enumerate(trace.requests):
        from hybridkv.traces.trace import expand_prompt

        yield Request(request_id=request.request_id,
                      prompt_token_ids=list(expand_prompt(request, index)),
                      sampling_params=SamplingParams(max_tokens=max(1, request.output_length),
                                                     ignore_eos=True),
                      pooling_params=None, block_hasher=hasher)


def run_through_scheduler(trace: Trace, config: CacheConfig, policy: str, *, facade: bool,
                          max_running: int, chunk_size: int) -> SchedulerRun:
    """Replay ``trace`` through vLLM's Scheduler (synchronous steps, greedy stand-in ids)."""
    init_none_hash(sha256)
    run = SchedulerRun()
    with tempfile.TemporaryDirectory() as scratch:
        scheduler = build_scheduler(config, policy, facade=facade, max_running=max_running,
                                    chunk_size=chunk_size, model_dir=_stand_in_model(
                                        Path(scratch)))
    manager = scheduler.kv_cache_manager
    for name in TIMED_METHODS:
        setattr(manager, name, _timed(run, getattr(manager, name)))
    order = {}
    sizes = [g.spec.block_size for g in config.groups]
    for index, request in enumerate(_requests(trace, math.gcd(
            *(g.spec.block_size for g in config.groups)))):
        order[request.request_id] = index
        scheduler.add_request(request)
    started = time.perf_counter()
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        run.steps += 1
        _record(run, output, sizes)
        sampled = []
        req_ids = list(output.num_scheduled_tokens)
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            position = request.num_output_tokens
            sampled.append([OUTPUT_TOKEN_BASE + order[req_id] * 65536 + position]
                           if done else [])
        scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled))
    run.wall_seconds = time.perf_counter() - started
    return run


def _record(run: SchedulerRun, output: Any, sizes: list[int]) -> None:
    for new in output.scheduled_new_reqs:
        run.first_hits.setdefault(new.req_id, new.num_computed_tokens)
        run.tables.append((new.req_id, tuple(tuple(ids) for ids in new.block_ids),
                           tuple(new.num_computed_tokens // size for size in sizes)))
    cached = output.scheduled_cached_reqs
    for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
        if new_ids is not None:
            run.tables.append((req_id, tuple(tuple(ids) for ids in new_ids),
                               (0,) * len(sizes)))


def tables_match(ours: SchedulerRun, theirs: SchedulerRun) -> tuple[bool, str]:
    """Equal step records up to one consistent renaming of block ids (a bijection that a
    block's fresh allocation may rebind); the first difference, described, otherwise."""
    if len(ours.tables) != len(theirs.tables):
        return False, f"{len(ours.tables)} vs {len(theirs.tables)} table records"
    forward: dict[int, int] = {0: 0}
    backward: dict[int, int] = {0: 0}
    renamed = 0
    for index, ((req_a, a, hits), (req_b, b, _)) in enumerate(zip(theirs.tables, ours.tables,
                                                                 strict=True)):
        if req_a != req_b or [len(t) for t in a] != [len(t) for t in b]:
            return False, f"record {index}: {req_a} {a} vs {req_b} {b}"
        for ids_a, ids_b, num_hit in zip(a, b, hits, strict=True):
            for position, (x, y) in enumerate(zip(ids_a, ids_b, strict=True)):
                if position < num_hit or x == 0 or y == 0:  # a hit block: must map
                    if forward.get(x, y) != y or backward.get(y, x) != x:
                        return False, (f"record {index} ({req_a}): hit block {x} maps to "
                                       f"{forward.get(x)}, got {y}")
                elif forward.get(x) != y:  # a fresh block: rebinds both ends
                    backward.pop(forward.pop(x, -1), None)
                    forward.pop(backward.pop(y, -1), None)
                renamed += x != y
                forward[x], backward[y] = y, x
    return True, "identical" if not renamed else f"identical up to renaming ({renamed} ids)"
