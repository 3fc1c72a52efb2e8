"""Builds a manager's ``EventLog`` from its groups (the events package's side of
``hybridkv.event_hook``: the core imports this module, and msgspec, only when events are
turned on)."""

from __future__ import annotations

from hybridkv.config import CacheConfig
from hybridkv.coordinator import HybridCoordinator
from hybridkv.events.log import EventLog, GroupEventInfo


def make_event_log(config: CacheConfig, coordinator: HybridCoordinator,
                   hash_block_tokens: int) -> EventLog:
    """One ``GroupEventInfo`` per cache group, in group order (= vLLM's ``group_idx``)."""
    hb = hash_block_tokens
    groups: list[GroupEventInfo] = []
    for group, group_manager in zip(config.groups, coordinator.managers, strict=True):
        spec = group.spec
        cap, bs = group_manager.max_hit_tail_blocks(), spec.block_size
        align = coordinator.alignment_tokens
        capped = cap > 0 and all(  # checked, not assumed: the rule is the manager's
            group_manager.hit_tail_blocks(p) == min(cap, p // bs)
            for p in range(align, (cap + 2) * bs + align, align))
        groups.append(GroupEventInfo(
            group_id=group.group_id, block_size=bs, hash_ratio=max(1, bs // hb),
            kind=spec.vllm_kind, sliding_window=spec.window_tokens,
            tail_blocks=group_manager.hit_tail_blocks, max_tail_blocks=cap,
            capped_prefix_rule=capped))
    return EventLog(groups, hb, coordinator.alignment_tokens,
                    config.hash_lookahead_tokens)
