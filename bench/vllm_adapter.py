"""Drive vLLM 0.33.0's ``KVCacheManager`` through hybridkv's scheduler-facing API.

``VllmManager`` exposes the methods ``hybridkv.sim.scheduler.Scheduler`` calls on a
``hybridkv.cache.KVCacheManager`` (``add_request``, ``find_longest_hit``, ``allocate_slots``,
``free``, ``remove_request``, ``append_token_ids``, ``num_tokens``, ``num_computed_tokens``,
``new_step``, ``token_ids``), backed by vLLM's own manager and vLLM ``Request`` objects, and
does the request bookkeeping vLLM's scheduler does around those calls (``num_computed_tokens``,
``status``, ``num_preemptions``, ``shared_prefix_boundary``).

vLLM is *not* a dependency of hybridkv: this module is imported only by bench scripts run with
the separate interpreter that ``bench/setup_vllm.sh`` builds.

Timing: ``manager_seconds`` is wall time inside vLLM's manager calls (``get_computed_blocks``,
``allocate_slots``, ``free``, ``new_step_starts``); request construction and block hashing
(done by the ``Request``'s hasher, as hybridkv's ``hash_seconds``) are in ``hash_seconds``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from hybridkv.config import CacheConfig
from hybridkv.specs import ChunkedLocalSpec, LayerSpec
from hybridkv.specs import SlidingWindowSpec as OurSlidingWindowSpec

DEFAULT_MAX_MODEL_LEN = 1 << 25
"""Longer than any replay request (hybridkv caps prompts at 2**24 tokens): never binds."""


def retention_interval(policy: str) -> int | None:
    """hybridkv policy name → vLLM ``prefix_cache_retention_interval``.

    >>> [retention_interval(p) for p in ("prepend", "latest", "interval:32768")]
    [None, 0, 32768]
    """
    if policy == "prepend":
        return None
    if policy == "latest":
        return 0
    if policy.startswith("interval:"):
        return int(policy.split(":", 1)[1])
    raise ValueError(f"no vLLM equivalent for policy {policy!r} "
                     "(use prepend, latest or interval:N)")


def _vllm_spec(spec: LayerSpec) -> Any:
    """One of our layer specs as the vLLM spec with the same block/window shape.

    Page bytes follow our ``kv_bytes_per_token`` (one 1-byte "head" of K and V halves), so
    pages match ours; hit rates do not depend on them.
    """
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


def vllm_kv_cache_config(config: CacheConfig, policy: str) -> KVCacheConfig:
    """A vLLM ``KVCacheConfig`` with the same groups (order, specs, layers) and pool size."""
    flagged = set(config.eagle_group_ids or ()) if config.drops_eagle_block else set()
    groups = [
        KVCacheGroupSpec([f"model.layers.{i}.attn" for i in group.layer_ids],
                         _vllm_spec(group.spec), is_eagle_group=group.group_id in flagged)
        for group in config.groups
    ]
    sizes = [g.spec.block_size for g in config.groups]
    return KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention_interval(policy),
        hash_block_size=math.gcd(*sizes),
        cache_hit_alignment_tokens=math.lcm(*sizes),
    )


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
        self.kv_cache_config = vllm_kv_cache_config(config, policy)
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
        self._sampling = SamplingParams(max_tokens=1 << 30)
        self._requests: dict[str, Request] = {}
        self.manager_seconds = 0.0
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
        started = time.perf_counter()
        self._requests[req_id] = Request(
            request_id=req_id, prompt_token_ids=list(prompt_token_ids),
            sampling_params=self._sampling, pooling_params=None, arrival_time=0.0,
            block_hasher=self._block_hasher, session_id=session_id)
        self.hash_seconds += time.perf_counter() - started

    def append_token_ids(self, req_id: str, token_ids: Sequence[int]) -> None:
        started = time.perf_counter()
        self._requests[req_id].append_output_token_ids(list(token_ids))
        self.hash_seconds += time.perf_counter() - started

    def remove_request(self, req_id: str) -> None:
        request = self._requests.pop(req_id)
        if request.status == RequestStatus.RUNNING:
            started = time.perf_counter()
            self.kv.free(request)
            self.manager_seconds += time.perf_counter() - started
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    # ------------------------------------------------------------------ lookup
    def find_longest_hit(self, req_id: str) -> VllmHit:
        request = self._requests[req_id]
        started = time.perf_counter()
        blocks, num_tokens, junction = self.kv.get_computed_blocks(request)
        self.manager_seconds += time.perf_counter() - started
        # vLLM's scheduler stores the junction on the request right after the lookup.
        request.shared_prefix_boundary = junction
        return VllmHit(req_id, num_tokens, blocks, junction)

    # -------------------------------------------------------------- allocation
    def allocate_slots(self, req_id: str, num_new_tokens: int, hit: VllmHit | None = None,
                       *, reserve_full_prompt: bool = False) -> KVCacheBlocks | None:
        request = self._requests[req_id]
        admitting = request.status != RequestStatus.RUNNING
        num_hit = hit.num_tokens if (admitting and hit is not None) else 0
        started = time.perf_counter()
        if admitting:
            result = self.kv.allocate_slots(
                request, num_new_tokens,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hit.blocks if hit is not None else None,
                full_sequence_must_fit=reserve_full_prompt)
        else:
            result = self.kv.allocate_slots(request, num_new_tokens)
        self.manager_seconds += time.perf_counter() - started
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
        started = time.perf_counter()
        self.kv.free(request)
        self.manager_seconds += time.perf_counter() - started
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def new_step(self) -> None:
        started = time.perf_counter()
        self.kv.new_step_starts()
        self.manager_seconds += time.perf_counter() - started

    def align_prefill_chunk(self, req_id: str, num_new_tokens: int, hit: object = None, *,
                            max_chunk_tokens: int | None = None) -> int:
        """The scheduler's chunk clipping hook: attention-only models keep the chunk
        (vLLM clips chunks only for Mamba "align" checkpoints)."""
        del req_id, hit, max_chunk_tokens
        return num_new_tokens

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
