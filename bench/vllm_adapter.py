"""Drive vLLM 0.33.0's ``KVCacheManager`` through hybridkv's scheduler-facing API.

``VllmManager`` exposes the methods ``hybridkv.sched.scheduler.Scheduler`` calls on a
``hybridkv.cache.KVCacheManager`` (``add_request``, ``find_longest_hit``, ``allocate_slots``,
``free``, ``remove_request``, ``append_token_ids``, ``num_tokens``, ``num_computed_tokens``,
``new_step``, ``token_ids``), backed by vLLM's own manager and vLLM ``Request`` objects, and
does the request bookkeeping vLLM's scheduler does around those calls (``num_computed_tokens``,
``status``, ``num_preemptions``, ``shared_prefix_boundary``).

vLLM is *not* a dependency of hybridkv: this module is imported only by bench scripts run with
the separate interpreter that ``bench/setup_vllm.sh`` builds.

Timing: ``manager_seconds`` is wall time (``clock``; CPU time with ``time.thread_time``)
inside vLLM's manager calls (``get_computed_blocks``,
``allocate_slots``, ``free``, ``new_step_starts``); request construction and block hashing
(done by the ``Request``'s hasher, as hybridkv's ``hash_seconds``) are in ``hash_seconds``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_planning, kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_interface import SlidingWindowMLASpec as VllmSlidingWindowMLASpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request, RequestStatus

from hybridkv.config import CacheConfig
from hybridkv.specs import (
    ChunkedLocalSpec,
    CompressedAttentionSpec,
    CompressorStateSpec,
    LayerSpec,
    RecurrentStateSpec,
    RingBufferSpec,
    SlidingWindowMLASpec,
)
from hybridkv.specs import SlidingWindowSpec as OurSlidingWindowSpec

DEFAULT_MAX_MODEL_LEN = 1 << 25
"""Longer than any replay request (hybridkv caps prompts at 2**24 tokens): never binds."""


def retention_interval(policy: str) -> int | None:
    """hybridkv policy name → vLLM ``prefix_cache_retention_interval``.

    >>> [retention_interval(p) for p in ("prepend", "latest", "interval:32768", "bounded-replay")]
    [None, 0, 32768, 0]
    """
    if policy == "prepend":
        return None
    if policy in ("latest", "bounded-replay"):  # bounded-replay: V4.1's default retention
        return 0
    if policy.startswith("interval:"):
        return int(policy.split(":", 1)[1])
    raise ValueError(f"no vLLM equivalent for policy {policy!r} "
                     "(use prepend, latest or interval:N)")


def _vllm_spec(spec: LayerSpec, padded_page_bytes: int | None = None) -> Any:
    """One of our layer specs as the vLLM spec with the same block/window shape.

    Page bytes follow our ``kv_bytes_per_token`` (one 1-byte "head" of K and V halves), so
    pages match ours; hit rates do not depend on them.
    """
    if isinstance(spec, RecurrentStateSpec):
        # one int8 tensor of the checkpoint's bytes: the page equals ours
        # (padded to the pool's page, as vLLM's _align_hybrid_block_size pads it)
        padded = padded_page_bytes if padded_page_bytes and \
            padded_page_bytes > spec.state_bytes else None
        return MambaSpec(block_size=spec.block_size, shapes=((spec.state_bytes,),),
                         dtypes=(torch.int8,), mamba_cache_mode="align",
                         page_size_padded=padded)
    kv_bytes = spec.kv_bytes_per_token
    common: dict[str, Any] = {
        "block_size": spec.block_size,
        "num_kv_heads": 1,
        "head_size": max(1, kv_bytes // 2),
        "dtype": torch.int8,
    }
    if isinstance(spec, OurSlidingWindowSpec):
        return SlidingWindowSpec(sliding_window=spec.sliding_window, **common)
    if isinstance(spec, ChunkedLocalSpec):
        return ChunkedLocalAttentionSpec(attention_chunk_size=spec.attention_chunk_size, **common)
    return FullAttentionSpec(**common)


def vllm_kv_cache_groups(config: CacheConfig) -> list[KVCacheGroupSpec]:
    """Our groups (order, layers, EAGLE flags) as vLLM groups with the same pages."""
    largest_page = max(g.spec.page_bytes for g in config.groups)
    flagged = set(config.eagle_group_ids or ()) if config.drops_eagle_block else set()
    return [
        KVCacheGroupSpec([f"model.layers.{i}.attn" for i in group.layer_ids],
                         _vllm_spec(group.spec, largest_page),
                         is_eagle_group=group.group_id in flagged)
        for group in config.groups
    ]


def vllm_num_blocks_for_memory(config: CacheConfig, num_bytes: int) -> int:
    """The pool size vLLM 0.33 plans for ``num_bytes`` of KV memory: its own bytes per block
    (``kv_cache_planning._get_kv_cache_bytes_per_block``, layer-outer layout, the default)
    and ``available_memory // bytes_per_block`` (``get_kv_cache_config_from_groups``)."""
    from vllm.v1.core.kv_cache_planning import _get_kv_cache_bytes_per_block
    from vllm.v1.kv_cache_layout import KVCacheLayout

    bytes_per_block = _get_kv_cache_bytes_per_block(vllm_kv_cache_groups(config),
                                                    KVCacheLayout.LBHNC)
    return int(num_bytes // bytes_per_block)


def vllm_kv_cache_config(config: CacheConfig, policy: str) -> KVCacheConfig:
    """A vLLM ``KVCacheConfig`` with the same groups (order, specs, layers) and pool size."""
    groups = vllm_kv_cache_groups(config)
    sizes = [g.spec.block_size for g in config.groups]
    return KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention_interval(policy),
        hash_block_size=math.gcd(*sizes),
        cache_hit_alignment_tokens=math.lcm(*sizes),
    )


# --------------------------------------------------------------------------- DeepSeek-V4
def vllm_v4_layer_spec(spec: LayerSpec, policy: str) -> Any:
    """One of our DeepSeek-V4 cache specs as the vLLM 0.33 spec DeepSeek-V4 itself builds
    (``models/deepseek_v4/attention.py``, ``compressor.py``; fp8_ds_mla KV, FP8 indexer)."""
    if isinstance(spec, CompressedAttentionSpec):
        if spec.role == "kv":
            return MLAAttentionSpec(
                block_size=spec.block_size, num_kv_heads=1, max_tp_shards=1, head_size=512,
                dtype=torch.uint8, tokens_per_state=spec.tokens_per_state,
                cache_dtype_str="fp8_ds_mla", alignment=spec.page_alignment_bytes,
                model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
                state_content_bytes=spec.entry_bytes)
        return MLAAttentionSpec(  # DeepseekV4IndexerCache: head_dim carries the fp8 scales
            block_size=spec.block_size, num_kv_heads=1, max_tp_shards=1,
            head_size=spec.entry_bytes, dtype=torch.uint8,
            tokens_per_state=spec.tokens_per_state, alignment=spec.page_alignment_bytes)
    if isinstance(spec, CompressorStateSpec):
        if spec.kv_bytes_per_token % 4:
            raise ValueError(f"compressor state of {spec.kv_bytes_per_token} B/token is not fp32")
        return VllmSlidingWindowMLASpec(  # CompressorStateCache: fp32 state rows
            block_size=spec.block_size, num_kv_heads=1, max_tp_shards=1,
            head_size=spec.kv_bytes_per_token // 4, dtype=torch.float32,
            sliding_window=spec.sliding_window, alignment=spec.page_alignment_bytes)
    if isinstance(spec, SlidingWindowMLASpec):
        return VllmSlidingWindowMLASpec(  # DeepseekV4SWACache
            bounded_replay=policy == "bounded-replay", block_size=spec.block_size,
            num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8,
            sliding_window=spec.sliding_window, cache_dtype_str="fp8_ds_mla",
            state_content_bytes=spec.kv_bytes_per_token, alignment=spec.page_alignment_bytes,
            model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"))
    if isinstance(spec, RingBufferSpec):
        if spec.kv_bytes_per_token % 4:
            raise ValueError(f"ring rows of {spec.kv_bytes_per_token} B/token are not fp32")
        return CircularBufferSpec(block_size=spec.block_size, num_kv_heads=1,
                                  head_size=spec.kv_bytes_per_token // 4, head_size_v=0,
                                  dtype=torch.float32)
    raise ValueError(f"{type(spec).__name__} is not a DeepSeek-V4 cache kind")


def _planner_config() -> Any:
    """The few ``VllmConfig`` fields vLLM 0.33's grouping reads, as DeepSeek-V4 resolves
    them: hybrid manager on, no HiSparse, block-outermost layout (its indexer backend
    supports only BLHNC / BLNHC)."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLHNC),
        model_config=SimpleNamespace(supports_kv_cache_grouping=False),
        speculative_config=None)


def vllm_v4_groups(layers: Sequence[LayerSpec], policy: str) -> list[KVCacheGroupSpec]:
    """vLLM 0.33's own grouping (``kv_cache_planning.get_kv_cache_groups``) of the real V4
    specs, one layer name ``caches.<i>`` per entry of ``layers``."""
    specs = {f"caches.{i}": vllm_v4_layer_spec(s, policy) for i, s in enumerate(layers)}
    return kv_cache_planning.get_kv_cache_groups(_planner_config(), specs)


def vllm_v4_bytes_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """vLLM 0.33's bytes of one pool block (``_get_kv_cache_bytes_per_block``)."""
    return kv_cache_planning._get_kv_cache_bytes_per_block(list(groups), KVCacheLayout.BLHNC)


def check_v4_groups(config: CacheConfig, groups: Sequence[KVCacheGroupSpec]) -> None:
    """Raise unless vLLM planned the same groups (members in order) as hybridkv."""
    ours = [[f"caches.{i}" for i in g.layer_ids] for g in config.groups]
    theirs = [list(g.layer_names) for g in groups]
    if ours != theirs:
        raise ValueError(f"vLLM groups {[len(t) for t in theirs]} differ from hybridkv's "
                         f"{[len(o) for o in ours]}")


def model_layers(config: CacheConfig) -> list[LayerSpec]:
    """The per-cache layer specs of a block-outermost config, in model order."""
    layers: dict[int, LayerSpec] = {}
    for group in config.groups:
        layers.update(zip(group.layer_ids, group.layer_specs, strict=True))
    return [layers[i] for i in range(len(layers))]


def vllm_v4_kv_cache_config(config: CacheConfig, policy: str) -> KVCacheConfig:
    """The scheduler-side ``KVCacheConfig`` vLLM builds for a V4 model: its own groups of
    the real specs, each represented by its first layer spec
    (``generate_scheduler_kv_cache_config``)."""
    groups = vllm_v4_groups(model_layers(config), policy)
    check_v4_groups(config, groups)
    cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    sizes = [g.kv_cache_spec.block_size for g in groups]
    worker = KVCacheConfig(
        num_blocks=config.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
        prefix_cache_retention_interval=retention_interval(policy),
        hash_block_size=math.gcd(*cacheable), cache_hit_alignment_tokens=math.lcm(*sizes))
    return kv_cache_utils.generate_scheduler_kv_cache_config([worker])


@dataclass(frozen=True, slots=True)
class VllmHit:
    """What ``find_longest_hit`` returns: the hit length plus vLLM's lookup results."""

    req_id: str
    num_tokens: int
    blocks: KVCacheBlocks
    junction_tokens: int


class VllmManager:
    """hybridkv's manager API over vLLM 0.33.0's ``KVCacheManager``.

    Args:
        config: our cache config (groups, ``num_blocks`` incl. the null block, hashing,
            ``max_num_batched_tokens`` = vLLM's in-flight bound for the window admission cap).
        policy: ``prepend`` | ``latest`` | ``interval:N`` (vLLM retention None / 0 / N).
        max_model_len: vLLM's ``max_model_len`` (default: never binds).
    """

    def __init__(self, config: CacheConfig, policy: str,
                 max_model_len: int | None = None) -> None:
        sizes = [g.spec.block_size for g in config.groups]
        self.hash_block_size = math.gcd(*sizes)
        self.scheduler_block_size = math.lcm(*sizes)
        packed = any(g.layer_specs for g in config.groups)  # DeepSeek-V4: real V4 specs
        self.kv_cache_config = vllm_v4_kv_cache_config(config, policy) if packed \
            else vllm_kv_cache_config(config, policy)
        if packed:
            cacheable = [g.kv_cache_spec.block_size
                         for g in self.kv_cache_config.kv_cache_groups
                         if g.kv_cache_spec.prefix_cacheable]
            self.hash_block_size = math.gcd(*cacheable)
        self.prefix_replay_tokens = max(g.kv_cache_spec.prefix_replay_tokens
                                        for g in self.kv_cache_config.kv_cache_groups)
        """vLLM's scheduler: hits no longer than this are dropped (V4.1 bounded replay)."""
        hash_fn = get_hash_fn_by_name(config.hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)
        # EAGLE as vLLM 0.33's scheduler sets it up: lookahead block hashes (the request
        # hasher covers the next L tokens, the manager gets use_eagle=False and
        # num_prefill_lookahead = L), or with lookahead hashes disabled the drop mode
        # (use_eagle=True, the groups of ``eagle_group_ids`` flagged)
        lookahead = config.hash_lookahead_tokens
        self._block_hasher = kv_cache_utils.get_request_block_hasher(
            self.hash_block_size, hash_fn, num_hash_lookahead_tokens=lookahead)
        self.max_model_len = max_model_len or config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.kv = KVCacheManager(
            kv_cache_config=self.kv_cache_config,
            max_model_len=self.max_model_len,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            max_in_flight_tokens=config.max_num_batched_tokens,
            enable_caching=config.enable_caching,
            use_eagle=config.drops_eagle_block,
            num_hash_lookahead_tokens=lookahead,
            num_prefill_lookahead=config.eagle_lookahead_tokens if config.use_eagle else 0,
            log_stats=True,
        )
        self._max_in_flight_tokens = config.max_num_batched_tokens
        self._mamba_split: Any = None
        self._mamba_split_self: Any = None
        mamba_sizes = [g.spec.block_size for g in config.groups
                       if isinstance(g.spec, RecurrentStateSpec)]
        if mamba_sizes:
            from types import SimpleNamespace

            from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
            self._mamba_split = VllmScheduler._mamba_block_aligned_split
            self._mamba_split_self = SimpleNamespace(
                cache_config=SimpleNamespace(block_size=mamba_sizes[0]),
                hash_block_size=self.hash_block_size, block_size=self.scheduler_block_size,
                mamba_partial_cache_hit=False, use_eagle_block_drop=False,
                num_hash_lookahead_tokens=0, mamba_has_prefill_checkpoint_blocks=False,
                mamba_prefill_checkpoint_alignment=None, mamba_shared_prefix_checkpoint=False,
                max_num_scheduled_tokens=config.max_num_batched_tokens,
                scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))
        self._sampling = SamplingParams(max_tokens=1 << 30)
        self._requests: dict[str, Request] = {}
        self.clock = time.perf_counter
        """Timer of ``manager_seconds`` / ``hash_seconds`` (as hybridkv's
        ``KVCacheManager.clock``; ``time.thread_time`` for CPU time)."""
        self.manager_seconds = 0.0
        self.timed_calls = 0
        """Intervals added to ``manager_seconds`` (each carries one clock call's cost)."""
        self.hash_seconds = 0.0
        self.requests = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    # ---------------------------------------------------------------- requests
    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], *,
                    extra_keys: object = None, session_id: str | None = None,
                    block_hashes: object = None) -> None:
        """Build the vLLM ``Request`` (its hasher hashes the prompt; ``block_hashes``, our
        precomputed chain, is ignored: vLLM's keys are its own)."""
        del block_hashes
        if extra_keys is not None:
            raise ValueError("the vLLM adapter does not map extra keys (LoRA, salt, MM)")
        started = self.clock()
        self._requests[req_id] = Request(
            request_id=req_id, prompt_token_ids=list(prompt_token_ids),
            sampling_params=self._sampling, pooling_params=None, arrival_time=0.0,
            block_hasher=self._block_hasher, session_id=session_id)
        self.hash_seconds += self.clock() - started

    def append_token_ids(self, req_id: str, token_ids: Sequence[int]) -> None:
        started = self.clock()
        self._requests[req_id].append_output_token_ids(list(token_ids))
        self.hash_seconds += self.clock() - started

    def remove_request(self, req_id: str) -> None:
        request = self._requests.pop(req_id)
        if request.status == RequestStatus.RUNNING:
            started = self.clock()
            self.kv.free(request)
            self.manager_seconds += self.clock() - started
            self.timed_calls += 1
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    # ------------------------------------------------------------------ lookup
    def find_longest_hit(self, req_id: str) -> VllmHit:
        request = self._requests[req_id]
        started = self.clock()
        blocks, num_tokens, junction = self.kv.get_computed_blocks(request)
        self.manager_seconds += self.clock() - started
        self.timed_calls += 1
        if self.prefix_replay_tokens and 0 < num_tokens <= self.prefix_replay_tokens:
            # vLLM's scheduler: replaying the whole hit would save nothing
            blocks, num_tokens = self.kv.empty_kv_cache_blocks, 0
        # vLLM's scheduler stores the junction on the request right after the lookup.
        request.shared_prefix_boundary = junction
        return VllmHit(req_id, num_tokens, blocks, junction)

    # -------------------------------------------------------------- allocation
    def allocate_slots(self, req_id: str, num_new_tokens: int, hit: VllmHit | None = None,
                       *, reserve_full_prompt: bool = False) -> KVCacheBlocks | None:
        request = self._requests[req_id]
        admitting = request.status != RequestStatus.RUNNING
        num_hit = hit.num_tokens if (admitting and hit is not None) else 0
        started = self.clock()
        if admitting:
            result = self.kv.allocate_slots(
                request, num_new_tokens,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hit.blocks if hit is not None else None,
                full_sequence_must_fit=reserve_full_prompt)
        else:
            result = self.kv.allocate_slots(request, num_new_tokens)
        self.manager_seconds += self.clock() - started
        self.timed_calls += 1
        if result is None:
            return None
        if admitting:
            if request.num_preemptions == 0:
                self.requests += 1
                self.prompt_tokens += request.num_tokens
                self.hit_tokens += num_hit
            request.status = RequestStatus.RUNNING
        # Synchronous scheduling: the step's tokens are computed before the next step.
        request.num_computed_tokens += num_hit + num_new_tokens
        return result

    def free(self, req_id: str) -> None:
        """Preemption: free all blocks, reset progress (vLLM ``_preempt_request``)."""
        request = self._requests[req_id]
        started = self.clock()
        self.kv.free(request)
        self.manager_seconds += self.clock() - started
        self.timed_calls += 1
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def new_step(self) -> None:
        started = self.clock()
        self.kv.new_step_starts()
        self.manager_seconds += self.clock() - started
        self.timed_calls += 1

    def align_prefill_chunk(self, req_id: str, num_new_tokens: int,
                            hit: VllmHit | None = None, *,
                            max_chunk_tokens: int | None = None) -> int:
        """vLLM's own ``Scheduler._mamba_block_aligned_split`` (models with Mamba groups in
        align mode; unchanged otherwise), run on a stand-in for the scheduler's fields with
        vLLM's defaults: no fine-grained hash hits, no internal prefill checkpoints, no
        shared-prefix checkpoint, no EAGLE drop, no long-prefill threshold."""
        if self._mamba_split is None:
            return num_new_tokens
        request = self._requests[req_id]
        admitting = request.status != RequestStatus.RUNNING
        num_hit = hit.num_tokens if (admitting and hit is not None) else 0
        self._mamba_split_self.max_num_scheduled_tokens = (
            max_chunk_tokens or self._max_in_flight_tokens)
        # scheduler work, not manager work: not in manager_seconds (nor is ours)
        return int(self._mamba_split(self._mamba_split_self, request, num_new_tokens, num_hit))

    # ----------------------------------------------------------------- queries
    def num_tokens(self, req_id: str) -> int:
        return self._requests[req_id].num_tokens

    def num_computed_tokens(self, req_id: str) -> int:
        return self._requests[req_id].num_computed_tokens

    def token_ids(self, req_id: str) -> Sequence[int]:
        return self._requests[req_id].all_token_ids

    @property
    def num_free_blocks(self) -> int:
        return self.kv.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.kv.usage
