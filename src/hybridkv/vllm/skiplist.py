# ruff: noqa: E501  (one entry per line: node ids are long)
"""vLLM 0.33.0 ``tests/v1/core`` cases the facade refuses, each with the refusal line it raises.

Keys: ``file::function`` (every case of it) or a full node id (one parametrisation). Every
entry passes with vLLM's own manager and raises ``UnsupportedFeature`` (one line, the
reason here) through the facade: a feature refused rather than answered wrongly.
``bench/vllm_tests.py`` checks that nothing outside this list fails, and that every entry
still fails with exactly this reason (a stale entry is reported).
"""

SKIPPED: dict[str, str] = {
    'tests/v1/core/test_async_scheduler.py::test_kv_pressure_preempt_mid_handoff[kv_consumer-False]':
        'KV connectors (remove_skipped_blocks)',
    'tests/v1/core/test_async_scheduler.py::test_kv_pressure_preempt_mid_handoff[kv_consumer-True]':
        'KV connectors (remove_skipped_blocks)',
    'tests/v1/core/test_deferred_block_free.py::test_abort_deferred_async_load_frees_after_inflight_step':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_deferred_block_free.py::test_abort_defers_free':
        'deferred block frees (KV connectors)',
    'tests/v1/core/test_deferred_block_free.py::test_abort_mid_prefill_defers_free':
        'deferred block frees (KV connectors)',
    'tests/v1/core/test_deferred_block_free.py::test_async_load_registers_immediately_without_deferral':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_deferred_block_free.py::test_cow_retentions_deferred_until_copy_step_processed':
        'vLLM internals (BlockPool.get_new_blocks)',
    'tests/v1/core/test_deferred_block_free.py::test_deferred_async_load_records_hit_sources_when_started':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_deferred_block_free.py::test_deferred_async_load_registers_after_inflight_step':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_deferred_block_free.py::test_fence_held_across_multiple_inflight_steps':
        'deferred block frees (KV connectors)',
    'tests/v1/core/test_deferred_block_free.py::test_finish_defers_free_until_inflight_step_done':
        'deferred block frees (KV connectors)',
    'tests/v1/core/test_deferred_block_free.py::test_multiple_deferred_frees_drain_in_order':
        'deferred block frees (KV connectors)',
    'tests/v1/core/test_deferred_block_free.py::test_non_async_abort_defers_via_last_sched_seq':
        'deferred block frees (KV connectors)',
    'tests/v1/core/test_deferred_block_free.py::test_preempt_defers_free_and_clears_bookkeeping':
        'deferred block frees (KV connectors)',
    'tests/v1/core/test_prefix_replay.py::test_async_remote_kv_hit_replays_after_load':
        'DeepSeek-V4 cache groups (SlidingWindowMLASpec) in the facade yet',
    'tests/v1/core/test_prefix_replay.py::test_decode_bench_fill_does_not_replay':
        'DeepSeek-V4 cache groups (SlidingWindowMLASpec) in the facade yet',
    'tests/v1/core/test_prefix_replay.py::test_hit_no_longer_than_window_is_ignored':
        'DeepSeek-V4 cache groups (SlidingWindowMLASpec) in the facade yet',
    'tests/v1/core/test_prefix_replay.py::test_hit_replays_window_without_reallocating':
        'DeepSeek-V4 cache groups (SlidingWindowMLASpec) in the facade yet',
    'tests/v1/core/test_prefix_replay.py::test_kv_load_carrying_window_does_not_replay':
        'DeepSeek-V4 cache groups (SlidingWindowMLASpec) in the facade yet',
    'tests/v1/core/test_prefix_replay.py::test_kv_load_zeroing_respects_loaded_groups':
        'DeepSeek-V4 cache groups (SlidingWindowMLASpec) in the facade yet',
    'tests/v1/core/test_prefix_replay.py::test_remote_kv_hit_is_taken_in_whole_blocks':
        'DeepSeek-V4 cache groups (SlidingWindowMLASpec) in the facade yet',
    'tests/v1/core/test_prefix_replay.py::test_replay_only_chunks_make_progress':
        'DeepSeek-V4 cache groups (SlidingWindowMLASpec) in the facade yet',
    'tests/v1/core/test_scheduler.py::test_abort_request_finished_recving':
        'KV connectors (partial tail offloads)',
    'tests/v1/core/test_scheduler.py::test_abort_request_waiting_for_remote_kvs':
        'KV connectors (partial tail offloads)',
    'tests/v1/core/test_scheduler.py::test_async_load_reservation_prevents_wedge_e2e':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_cross_attn_blocks_not_over_allocated':
        'encoder-decoder / encoder-only groups (CrossAttentionSpec)',
    'tests/v1/core/test_scheduler.py::test_cross_attn_blocks_not_under_allocated':
        'encoder-decoder / encoder-only groups (CrossAttentionSpec)',
    'tests/v1/core/test_scheduler.py::test_cross_attn_zero_blocks_without_encoder_inputs':
        'encoder-decoder / encoder-only groups (CrossAttentionSpec)',
    'tests/v1/core/test_scheduler.py::test_evicted_blocks_release_their_auxiliary_outputs_past_capacity':
        'vLLM internals (BlockPool.hash_block_size)',
    'tests/v1/core/test_scheduler.py::test_external_prefix_cache_metrics':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_has_sync_kv_loads':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_hybrid_divergent_hit_fallback_is_capped_at_retained_auxiliary_outputs':
        'Mamba / Gated DeltaNet groups (MambaSpec): its worker-side copy, zeroing and checkpoint contract is not mapped yet',
    'tests/v1/core/test_scheduler.py::test_hybrid_fa_deeper_hit_respects_connector_lookup_policy':
        'Mamba / Gated DeltaNet groups (MambaSpec): its worker-side copy, zeroing and checkpoint contract is not mapped yet',
    'tests/v1/core/test_scheduler.py::test_hybrid_per_group_hit_divergence_with_connector':
        'Mamba / Gated DeltaNet groups (MambaSpec): its worker-side copy, zeroing and checkpoint contract is not mapped yet',
    'tests/v1/core/test_scheduler.py::test_kv_connector_basic':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_kv_connector_handles_preemption':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_kv_connector_honors_skip_reading_prefix_cache':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_kv_connector_records_external_cache_hit_sources':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_kv_connector_unable_to_allocate':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_pause_new_drains_async_kv_loads':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_prefix_hit_is_capped_at_retained_auxiliary_outputs':
        'vLLM internals (BlockPool.hash_block_size)',
    'tests/v1/core/test_scheduler.py::test_priority_scheduling_preemption_and_resumption_when_out_of_kv':
        'KV connectors (partial tail offloads)',
    'tests/v1/core/test_scheduler.py::test_remote_kv_promotion_drains_before_grammar_prefix':
        'KV connectors (get_computed_blocks_for_connector)',
    'tests/v1/core/test_scheduler.py::test_routed_experts_hashes_follow_scheduled_tokens':
        'vLLM internals (BlockPool.hash_block_size)',
    'tests/v1/core/test_scheduler.py::test_routed_experts_prompt_start_at_prompt_end':
        'vLLM internals (BlockPool.hash_block_size)',
    'tests/v1/core/test_scheduler.py::test_scheduler_reset_prefix_cache':
        'vLLM internals (BlockPool.hash_block_size)',
    'tests/v1/core/test_scheduler.py::test_spec_decode_padding_resumed_request_without_running_requests':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_throttle_prefills_defers_remote_kv_resume_with_local_prefill':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_throttle_prefills_excludes_fully_transferred_remote_kv':
        'KV connectors (external computed tokens, delayed caching, reserved blocks)',
    'tests/v1/core/test_scheduler.py::test_variable_length_cross_attn_block_allocation':
        'encoder-decoder / encoder-only groups (CrossAttentionSpec)',
    'tests/v1/core/test_swa_inflight_window_free.py::test_chunked_local_free_waits_for_in_flight_step':
        'vLLM internals (SingleTypeManager._null_block)',
    'tests/v1/core/test_swa_inflight_window_free.py::test_connector_finish_frees_on_settled_basis':
        'KV connectors (partial tail offloads)',
    'tests/v1/core/test_swa_inflight_window_free.py::test_swa_free_immediate_when_sync':
        'vLLM internals (SingleTypeManager._null_block)',
    'tests/v1/core/test_swa_inflight_window_free.py::test_swa_free_waits_for_in_flight_step':
        'vLLM internals (SingleTypeManager._null_block)',
}

POLICY_SKIPPED: dict[str, dict[str, str]] = {
    "interval:32768+predict": {
        'tests/v1/core/test_scheduler.py::test_mamba_align_encoder_cache_cap_makes_progress':
            "the interval is not a multiple of this model's hit alignment (768 tokens)",
    },
}
"""Extra entries for one policy: a policy the model shape refuses at construction."""
