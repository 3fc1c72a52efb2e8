"""Prefix-cache statistics with vLLM's definition: counted once per admission."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters of one cache manager.

    ``queries``/``hits`` count tokens of requests at their *first* admission (tokens looked
    up and tokens hit); re-admissions after preemption are counted in ``preempted_*``.
    ``hit_blocks_by_group`` counts non-null hit blocks per group at every admission;
    ``evicted_blocks_by_group`` counts hashed blocks whose hash was dropped on reuse.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    bridge_tokens: int = 0
    """Tokens recomputed by window-recompute bridges (prefill work, not hits)."""
    hit_blocks_by_group: list[int] = field(default_factory=list)
    evicted_blocks_by_group: list[int] = field(default_factory=list)

    def record(self, num_tokens: int, num_hit_tokens: int, *, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hit_tokens
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hit_tokens

    def record_bridge(self, num_tokens: int) -> None:
        self.bridge_tokens += num_tokens

    @property
    def hit_rate(self) -> float:
        """Token hit rate over first admissions (0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0
