"""``HybridKVCacheManager``: hybridkv's ``KVCacheManager`` behind vLLM 0.33's manager surface.

vLLM's ``Scheduler`` (and ``EngineCore``) call their ``KVCacheManager`` with vLLM
``Request`` objects; this facade answers every one of those calls from a hybridkv
``KVCacheManager`` (the table of calls: ``docs/integration.md``, "Inside vLLM"). vLLM's
``Request`` stays the source of truth for tokens and progress; at each call the facade
brings hybridkv's copy up to date:

- tokens: ids appended since the last call (with vLLM's own ``request.block_hashes`` for
  the blocks they complete: hybridkv never hashes a vLLM request itself), or a streaming
  session's replaced tail (``truncate_tokens`` then the new input as prompt);
- progress: ``request.num_computed_tokens`` (lower after rejected drafts) and
  ``request.num_in_flight_tokens`` (steps not reported back) → ``settle``; every slot the
  Scheduler asks for is allocated ``in_flight`` (async scheduling allocates slots for
  tokens whose ids are not sampled yet).

Blocks are handed out as vLLM ``KVCacheBlock`` objects, one per pool block id (block 0 is
the shared null block), so the Scheduler reads ``block_id`` as from its own manager.
Features hybridkv cannot serve exactly raise ``UnsupportedFeature`` with one line, at
construction or at the call — never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.cache import KVCacheManager
from hybridkv.ids import BlockHash
from hybridkv.results import PrefixHit
from hybridkv.vllm.config import (
    UnsupportedFeature,
    VllmCacheSettings,
    cache_config_from_vllm,
    policy_from_retention_interval,
)
from hybridkv.vllm.shims import BlockPoolShim, CoordinatorShim, VllmBlocks


class HybridKVCacheManager:
    """Drop-in for vLLM 0.33's ``KVCacheManager`` (same keyword signature), backed by
    hybridkv. ``policy``: a hybridkv policy name (default: the one equal to vLLM's
    ``prefix_cache_retention_interval``: None → ``prepend``, 0 → ``latest``, N →
    ``interval:N``); policies needing worker-side work (``+recompute``, ``ckpt:branch``)
    are refused.

    Invariants: every request hybridkv knows was seen by ``get_computed_blocks`` or
    ``allocate_slots``; hybridkv's computed tokens are never below vLLM's (vLLM only
    lowers them: rejections, resumable sessions); a request holds hybridkv blocks ⇔ it
    holds vLLM-visible blocks (``get_blocks`` non-empty).
    """

    def __init__(self, kv_cache_config: Any,  # noqa: PLR0913, PLR0917 - vLLM's signature
                 max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None,
                 enable_caching: bool = True, use_eagle: bool = False,
                 num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0,
                 log_stats: bool = False, enable_kv_cache_events: bool = False,
                 dcp_world_size: int = 1, pcp_world_size: int = 1,
                 metrics_collector: Any = None, watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False, *,
                 policy: str | None = None) -> None:
        _refuse_settings(dcp_world_size, pcp_world_size, metrics_collector, watermark,
                         enable_mamba_shared_prefix_checkpoint, enable_kv_cache_events)
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.metrics.stats import PrefixCacheStats

        settings = VllmCacheSettings(max_model_len, scheduler_block_size, hash_block_size,
                                     max_in_flight_tokens, enable_caching, use_eagle,
                                     num_hash_lookahead_tokens, num_prefill_lookahead)
        config = cache_config_from_vllm(kv_cache_config, settings)
        name = policy or policy_from_retention_interval(
            getattr(kv_cache_config, "prefix_cache_retention_interval", None))
        if "recompute" in name.split("+") or "ckpt:branch" in name:
            raise UnsupportedFeature(f"policy {name!r}: it needs worker-side copies or "
                                     "recompute bridges vLLM's model runner does not run")
        self.core = KVCacheManager(config, name)
        self.policy_name = self.core.policy_name
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = False
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = None
        self.mamba_shared_prefix_checkpoint = False
        self.num_kv_cache_groups = len(config.groups)
        self.watermark_blocks = 0
        self._stats_type = PrefixCacheStats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self._blocks_type = KVCacheBlocks
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in config.groups))
        self.blocks = VllmBlocks(self.core)
        self.block_pool = BlockPoolShim(self.core, self.blocks)
        self.coordinator = CoordinatorShim(self.core, kv_cache_config, self.blocks)
        self._hits: dict[str, PrefixHit] = {}
        self._num_hashes: dict[str, int] = {}
        self._num_prompt_tokens: dict[str, int] = {}
        self._objects: dict[str, Any] = {}
        """The vLLM ``Request`` each known id belongs to (a new object: a new request)."""

    # ------------------------------------------------------------------ requests
    def _sync(self, request: Any) -> None:
        """Register the request, or bring hybridkv's tokens up to vLLM's."""
        req_id = request.request_id
        core = self.core
        hashes = request.block_hashes
        if req_id in self._num_hashes and self._objects[req_id] is not request:
            if core.is_running(req_id):
                raise UnsupportedFeature(f"two live requests with one id {req_id!r}")
            self._forget(req_id)  # a new Request reusing a waiting one's id
        if req_id not in self._num_hashes:
            self._objects[req_id] = request
            core.add_request(req_id, request.all_token_ids, block_hashes=hashes,
                             external_hashes=True)
            self._num_hashes[req_id] = len(hashes)
            self._num_prompt_tokens[req_id] = request.num_prompt_tokens
            return
        known = core.num_tokens(req_id)
        num_tokens = request.num_tokens
        if request.num_prompt_tokens != self._num_prompt_tokens[req_id] or num_tokens < known:
            self._replace_tail(request)
            return
        if num_tokens > known:
            self._append(req_id, request.all_token_ids[known:], hashes, as_prompt=False)

    def _append(self, req_id: str, token_ids: Sequence[int], hashes: Sequence[BlockHash],
                *, as_prompt: bool) -> None:
        have = self._num_hashes[req_id]
        self.core.append_token_ids(req_id, token_ids, block_hashes=hashes[have:],
                                   as_prompt=as_prompt)
        self._num_hashes[req_id] = len(hashes)

    def _replace_tail(self, request: Any) -> None:
        """A streaming session's next input: vLLM dropped the last sampled token and
        appended the new prompt; keep the common head, replace the rest."""
        req_id = request.request_id
        core = self.core
        if core.is_running(req_id):  # vLLM lowered its progress to the settled tokens
            self._settle(request)
        ours = core.token_ids(req_id)
        theirs = request.all_token_ids
        keep = core.num_computed_tokens(req_id)
        limit = min(len(ours), len(theirs))
        while keep < limit and ours[keep] == theirs[keep]:
            keep += 1
        core.truncate_tokens(req_id, keep)
        kept = max(0, keep - core.config.hash_lookahead_tokens) // core.hasher.block_size
        self._num_hashes[req_id] = min(self._num_hashes[req_id], kept)  # as truncate_tokens
        self._append(req_id, theirs[keep:], request.block_hashes, as_prompt=True)
        self._num_prompt_tokens[req_id] = request.num_prompt_tokens

    def _settle(self, request: Any) -> None:
        """hybridkv's progress ← vLLM's (rejected drafts roll back; steps report back)."""
        computed = request.num_computed_tokens
        core = self.core
        if computed > core.num_computed_tokens(request.request_id):
            raise UnsupportedFeature("computed tokens the manager did not allocate "
                                     "(external KV loads)")
        core.settle(request.request_id, computed,
                    min(request.num_in_flight_tokens, computed))

    # -------------------------------------------------------------------- lookup
    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None,
                            ) -> tuple[Any, int, int]:
        """(hit blocks, hit tokens, shared-prefix boundary) as vLLM's lookup returns."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        self._sync(request)
        req_id = request.request_id
        if self.core.is_running(req_id):
            raise UnsupportedFeature("a prefix lookup for a request that holds blocks")
        hit = self.core.find_longest_hit(req_id, max_cache_hit_length)
        self._hits[req_id] = hit
        return self.blocks.of_ids(hit.block_ids), hit.num_tokens, hit.junction_tokens

    def get_computed_blocks_for_connector(self, request: Any,
                                          max_cache_hit_length: int | None = None) -> Any:
        raise UnsupportedFeature("KV connectors (get_computed_blocks_for_connector)")

    # ---------------------------------------------------------------- allocation
    def allocate_slots(self, request: Any, num_new_tokens: int,  # noqa: PLR0913, PLR0917
                       num_new_computed_tokens: int = 0,  # vLLM's signature, kept whole
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:
        """Slots for ``num_new_tokens`` (+ lookahead); the blocks appended, or ``None``."""
        del has_scheduled_reqs, skip_zeroing_group_ids  # watermark 0; no zeroing groups
        if num_external_computed_tokens or delay_cache_blocks or reserved_blocks:
            raise UnsupportedFeature("KV connectors (external computed tokens, delayed "
                                     "caching, reserved blocks)")
        if num_encoder_tokens:
            raise UnsupportedFeature("encoder-decoder models (num_encoder_tokens)")
        if num_new_tokens <= 0:
            raise UnsupportedFeature("an allocation of 0 new tokens (bounded replay)")
        self._sync(request)
        req_id = request.request_id
        core = self.core
        hit = None
        if core.is_running(req_id):
            self._settle(request)
        else:
            hit = self._admission_hit(req_id, num_new_computed_tokens)
        allocation = core.allocate_slots(
            req_id, num_new_tokens, hit, num_lookahead_tokens=num_lookahead_tokens,
            reserve_full_prompt=full_sequence_must_fit, in_flight=True)
        if allocation is None:
            return None
        self._hits.pop(req_id, None)
        return self.blocks.of_ids(allocation.new_block_ids)

    def _admission_hit(self, req_id: str, num_new_computed_tokens: int) -> PrefixHit | None:
        """The lookup's own hit for this admission. A miss is passed on too: it still
        carries the junction (vLLM's ``shared_prefix_boundary``, e.g. full attention
        matched 2,560 tokens, the window groups none) that this admission must retain
        for the next request with that prefix (``latest`` / ``interval:N``)."""
        hit = self._hits.get(req_id)
        if num_new_computed_tokens == 0:
            return hit if hit is not None and hit.num_tokens == 0 else None
        if hit is None or hit.num_tokens != num_new_computed_tokens:
            raise UnsupportedFeature("a prefix hit other than the lookup's own "
                                     "(truncated or connector-supplied)")
        return hit

    def free(self, request: Any) -> None:
        """Finish (``request.is_finished()``: forgotten; ``predict`` sees its output
        length) or preemption (blocks released, tokens kept). Unknown: a no-op."""
        req_id = request.request_id
        if req_id not in self._num_hashes:
            return
        self._hits.pop(req_id, None)
        if request.is_finished():
            self._forget(req_id)
        else:
            self.core.free(req_id)

    def _forget(self, req_id: str) -> None:
        self.core.remove_request(req_id)
        del self._num_hashes[req_id], self._num_prompt_tokens[req_id], self._objects[req_id]
        self._hits.pop(req_id, None)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Settled tokens ``< num_computed_tokens`` become cacheable (vLLM's call after a
        step with output placeholders or drafts reports back)."""
        req_id = request.request_id
        if not self.enable_caching or req_id not in self._num_hashes \
                or not self.core.is_running(req_id):
            return
        self._sync(request)
        computed = request.num_computed_tokens
        self.core.settle(req_id, computed, max(0, computed - num_computed_tokens))

    def pop_blocks_for_free(self, request: Any) -> Any:
        raise UnsupportedFeature("deferred block frees (KV connectors)")

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        raise UnsupportedFeature("KV connectors (remove_skipped_blocks)")

    def evict_blocks(self, block_ids: set[int]) -> None:
        raise UnsupportedFeature("KV connectors (evict_blocks after a failed load)")

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        raise UnsupportedFeature("KV connectors (zeroing after a failed load)")

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        raise UnsupportedFeature("KV connectors (partial tail offloads)")

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        raise UnsupportedFeature("KV connectors (truncate_computed_blocks)")

    # ------------------------------------------------------------------- queries
    def get_blocks(self, request_id: str) -> Any:
        if request_id not in self._num_hashes or not self.core.is_running(request_id):
            return self.empty_kv_cache_blocks
        return self.blocks.of_ids(self.core.get_block_ids(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id not in self._num_hashes or not self.core.is_running(request_id):
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(list(ids) for ids in self.core.get_block_ids(request_id))

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> Any:
        raise UnsupportedFeature("KV connectors (get_block_ids_for_computed_tokens)")

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request's table that are cached in every group (vLLM: the
        longest hashed prefix per prefix-cacheable group, the minimum over groups)."""
        req_id = request.request_id
        if req_id not in self._num_hashes or not self.core.is_running(req_id):
            return 0
        pool_blocks = self.core.pool.blocks
        cached: int | None = None
        for group, ids in zip(self.core.config.groups, self.core.get_block_ids(req_id),
                              strict=True):
            size = group.spec.block_size
            group_cached = max(((i + 1) * size for i, block_id in enumerate(ids)
                               if block_id and pool_blocks[block_id].block_hash is not None),
                               default=0)
            cached = group_cached if cached is None else min(cached, group_cached)
        return cached or 0

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> Any:
        """vLLM ``KVCacheBlocks`` of per-group block lists (the shared empty one if none)."""
        return self._blocks_type(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33 (no cascade attention): zeros, as vLLM."""
        return [0] * self.num_kv_cache_groups

    @property
    def usage(self) -> float:
        return self.core.usage

    # --------------------------------------------------------------- step hooks
    def new_step_starts(self) -> None:
        self.core.new_step()

    def take_new_block_ids(self) -> list[int]:
        """No group needs zeroing (Mamba and mixed precision are refused): always []."""
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """No copy-on-write hits: nothing to copy, nothing retained."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def take_events(self) -> list[Any]:
        return []

    # --------------------------------------------------------------------- stats
    def make_prefix_cache_stats(self) -> Any:
        """The stats since the last call (and a fresh record), or None without log_stats."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._stats_type()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """One admitted request's lookup: queries = its tokens, hits = ``num_hits``."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix while no request holds blocks (as vLLM)."""
        if not self.core.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True


def _refuse_settings(dcp_world_size: int, pcp_world_size: int, metrics_collector: Any,
                     watermark: float, shared_prefix_checkpoint: bool,
                     enable_kv_cache_events: bool) -> None:
    """One ``UnsupportedFeature`` line for the first setting the facade cannot honour."""
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise UnsupportedFeature(f"context parallelism (dcp_world_size={dcp_world_size}, "
                                 f"pcp_world_size={pcp_world_size})")
    if metrics_collector is not None:
        raise UnsupportedFeature("KV-cache residency metrics (kv_cache_metrics)")
    if watermark:
        raise UnsupportedFeature(f"a scheduler watermark ({watermark})")
    if shared_prefix_checkpoint:
        raise UnsupportedFeature("Mamba shared-prefix checkpoints")
    if enable_kv_cache_events:
        raise UnsupportedFeature("KV cache events (kv_events_config) in the facade yet")
