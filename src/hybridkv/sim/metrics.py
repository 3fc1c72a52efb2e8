"""Prometheus metrics of replays and the reference engine (issue 17 part 2).

vLLM 0.33's names (``vllm/v1/metrics/loggers.py``) under a ``hybridkv:`` prefix, plus the
hybrid ones vLLM has no metric for. Counters follow vLLM's definitions (first admissions
only, as ``PrefixCacheStats``); prometheus_client appends ``_total`` to counters in the
text format, as for vLLM's.

=====================================  =======  ==========================================
name                                   type     value
=====================================  =======  ==========================================
``hybridkv:prefix_cache_queries``      counter  prompt tokens looked up (first admissions)
``hybridkv:prefix_cache_hits``         counter  of which hit
``hybridkv:kv_cache_usage_perc``       gauge    held blocks / usable blocks (1 = full)
``hybridkv:num_preemptions``           counter  preemptions
``hybridkv:num_requests_running``      gauge    running requests
``hybridkv:num_requests_waiting``      gauge    waiting requests
``hybridkv:group_hit_blocks``          counter  non-null hit blocks, per ``group`` / ``kind``
``hybridkv:kind_hit_blocks``           counter  the same summed per ``kind``
``hybridkv:group_evicted_blocks``      counter  cached blocks evicted on reuse, per group
``hybridkv:bridge_tokens``             counter  window-recompute bridge / bounded-replay
                                                tokens (recomputed prefill, not hits)
``hybridkv:prefix_cache_miss_tokens``  counter  missed prompt tokens per ``cause``
                                                (replays only: ``sim/misses.py``)
=====================================  =======  ==========================================

Every series carries ``model_name`` and ``policy`` labels (a replay of several policies
exports one series per policy).

>>> from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager
>>> manager = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 8))
>>> metrics = CacheMetrics(model_name="toy")
>>> metrics.start("prepend", manager)
>>> manager.add_request("a", list(range(9)))
>>> _ = manager.allocate_slots("a", 9, manager.find_longest_hit("a"))
>>> metrics.sync(manager, num_running=1, num_waiting=0, num_preemptions=0)
>>> metrics.value("hybridkv:prefix_cache_queries_total", policy="prepend")
9.0
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

if TYPE_CHECKING:
    from hybridkv.cache import KVCacheManager
    from hybridkv.sched.scheduler import Scheduler

PREFIX = "hybridkv:"


@dataclass(slots=True)
class _Seen:
    """Counter values already exported for one run (counters only move by deltas)."""

    queries: int = 0
    hits: int = 0
    preemptions: int = 0
    bridge: int = 0
    group_hits: list[int] = field(default_factory=list)
    group_evicted: list[int] = field(default_factory=list)


class CacheMetrics:
    """The metric families in their own registry; ``start`` / ``sync`` per manager."""

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None,
                 ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        base = ["model_name", "policy"]
        reg = self.registry
        self.queries = Counter(f"{PREFIX}prefix_cache_queries", "Prefix cache queries, in "
                               "terms of number of queried tokens.", base, registry=reg)
        self.hits = Counter(f"{PREFIX}prefix_cache_hits", "Prefix cache hits, in terms of "
                            "number of cached tokens.", base, registry=reg)
        self.usage = Gauge(f"{PREFIX}kv_cache_usage_perc", "KV-cache usage. 1 means 100 "
                           "percent usage.", base, registry=reg)
        self.preemptions = Counter(f"{PREFIX}num_preemptions", "Cumulative number of "
                                   "preemptions.", base, registry=reg)
        self.running = Gauge(f"{PREFIX}num_requests_running", "Number of running requests.",
                             base, registry=reg)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Number of waiting requests.",
                             base, registry=reg)
        self.group_hits = Counter(f"{PREFIX}group_hit_blocks", "Non-null prefix-hit blocks "
                                  "handed out, per cache group.", [*base, "group", "kind"],
                                  registry=reg)
        self.kind_hits = Counter(f"{PREFIX}kind_hit_blocks", "Non-null prefix-hit blocks "
                                 "handed out, per group kind.", [*base, "kind"], registry=reg)
        self.group_evicted = Counter(f"{PREFIX}group_evicted_blocks", "Cached blocks evicted "
                                     "on reuse, per cache group.", [*base, "group", "kind"],
                                     registry=reg)
        self.bridge = Counter(f"{PREFIX}bridge_tokens", "Prompt tokens recomputed to rebuild "
                              "window state at a hit (window-recompute bridges, bounded "
                              "replay): prefill work, not hits.", base, registry=reg)
        self.misses = Counter(f"{PREFIX}prefix_cache_miss_tokens", "Missed prompt tokens of "
                              "first admissions, by cause.", [*base, "cause"], registry=reg)
        self._policy = ""
        self._kinds: list[str] = []
        self._seen = _Seen()

    def start(self, policy: str, manager: KVCacheManager) -> None:
        """Begin exporting ``manager`` under label ``policy`` (series start at 0)."""
        self._policy = policy
        self._kinds = [g.spec.kind for g in manager.config.groups]
        self._seen = _Seen(group_hits=[0] * len(self._kinds),
                           group_evicted=[0] * len(self._kinds))
        labels = self._labels()
        for family in (self.queries, self.hits, self.preemptions, self.bridge):
            family.labels(*labels)
        for group_id, kind in enumerate(self._kinds):
            self.group_hits.labels(*labels, str(group_id), kind)
            self.group_evicted.labels(*labels, str(group_id), kind)
            self.kind_hits.labels(*labels, kind)

    def _labels(self) -> tuple[str, str]:
        return self.model_name, self._policy

    def sync(self, manager: KVCacheManager, *, num_running: int, num_waiting: int,
             num_preemptions: int) -> None:
        """Bring every series up to ``manager``'s counters (cheap: a few increments)."""
        labels = self._labels()
        stats, seen = manager.stats, self._seen
        if stats.queries != seen.queries:
            self.queries.labels(*labels).inc(stats.queries - seen.queries)
            seen.queries = stats.queries
        if stats.hits != seen.hits:
            self.hits.labels(*labels).inc(stats.hits - seen.hits)
            seen.hits = stats.hits
        if num_preemptions != seen.preemptions:
            self.preemptions.labels(*labels).inc(num_preemptions - seen.preemptions)
            seen.preemptions = num_preemptions
        if stats.bridge_tokens != seen.bridge:
            self.bridge.labels(*labels).inc(stats.bridge_tokens - seen.bridge)
            seen.bridge = stats.bridge_tokens
        for group_id, kind in enumerate(self._kinds):
            hit = stats.hit_blocks_by_group[group_id]
            if hit != seen.group_hits[group_id]:
                delta = hit - seen.group_hits[group_id]
                self.group_hits.labels(*labels, str(group_id), kind).inc(delta)
                self.kind_hits.labels(*labels, kind).inc(delta)
                seen.group_hits[group_id] = hit
            evicted = stats.evicted_blocks_by_group[group_id]
            if evicted != seen.group_evicted[group_id]:
                self.group_evicted.labels(*labels, str(group_id), kind).inc(
                    evicted - seen.group_evicted[group_id])
                seen.group_evicted[group_id] = evicted
        self.usage.labels(*labels).set(manager.usage)
        self.running.labels(*labels).set(num_running)
        self.waiting.labels(*labels).set(num_waiting)

    def add_misses(self, causes: Mapping[str, int]) -> None:
        """Missed tokens by cause (a replay's ``MissCauses.as_dict()``, once at its end)."""
        for cause, tokens in causes.items():
            self.misses.labels(*self._labels(), cause).inc(tokens)

    def value(self, sample_name: str, **labels: str) -> float | None:
        """One sample's current value (``model_name`` defaults to this exporter's)."""
        labels.setdefault("model_name", self.model_name)
        return self.registry.get_sample_value(sample_name, labels)


class ReplayMetrics:
    """``ReplayObserver`` exporting each replay of a ``hybridkv replay`` run (one series per
    policy label: the policy, with ``[order]`` for a non-fcfs admission order)."""

    def __init__(self, metrics: CacheMetrics) -> None:
        self.metrics = metrics

    def attach(self, manager: KVCacheManager, scheduler: Scheduler, label: str) -> None:
        del scheduler
        self.metrics.start(label, manager)

    def on_step(self, manager: KVCacheManager, scheduler: Scheduler) -> None:
        self.metrics.sync(manager, num_running=len(scheduler.running),
                          num_waiting=len(scheduler.waiting),
                          num_preemptions=scheduler.num_preemptions)

    def detach(self, manager: KVCacheManager, scheduler: Scheduler,
               misses: Mapping[str, int] | None) -> None:
        self.on_step(manager, scheduler)
        if misses is not None:
            self.metrics.add_misses(misses)
