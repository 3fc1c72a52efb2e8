"""Builds a ``KVCacheManager``'s ``EventLog`` from its groups (kept apart from ``cache.py``
so the core imports msgspec only when events are turned on)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.events.log import VLLM_KIND_OF, EventLog, GroupEventInfo
from hybridkv.specs import SlidingWindowSpec

if TYPE_CHECKING:
    from hybridkv.cache import KVCacheManager


def make_event_log(manager: KVCacheManager) -> EventLog:
    """One ``GroupEventInfo`` per cache group, in group order (= vLLM's ``group_idx``)."""
    hb = manager.hasher.block_size
    groups: list[GroupEventInfo] = []
    for group, group_manager in zip(manager.config.groups, manager.coordinator.managers,
                                    strict=True):
        spec = group.spec
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        cap, bs = group_manager.max_hit_tail_blocks(), spec.block_size
        align = manager.coordinator.alignment_tokens
        capped = cap > 0 and all(  # checked, not assumed: the rule is the manager's
            group_manager.hit_tail_blocks(p) == min(cap, p // bs)
            for p in range(align, (cap + 2) * bs + align, align))
        groups.append(GroupEventInfo(
            group_id=group.group_id, block_size=bs, hash_ratio=max(1, bs // hb),
            kind=VLLM_KIND_OF.get(spec.kind, "unknown"), sliding_window=window,
            tail_blocks=group_manager.hit_tail_blocks, max_tail_blocks=cap,
            capped_prefix_rule=capped))
    return EventLog(groups, hb, manager.coordinator.alignment_tokens,
                    manager.config.hash_lookahead_tokens)
