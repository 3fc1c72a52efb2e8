"""The replay's link to a host tier (``hybridkv replay --host-memory``): what the replay's
manager (``ObservedManager``) asks it at a first admission and hands it at a release.

- **Admission** (first admissions only, the hit-rate protocol's): the GPU hit ``g`` comes
  from the manager; the tier looks further in GPU ∪ host (``HostTier.longest_hit``, capped
  at the last prompt token). A host hit at ``p > g`` is promoted: its host blocks are
  copied (counted), and ``[g, p)`` counts as *host hit* tokens. The replay has no clock:
  the request then fills ``[g, p)`` as a miss would (the same blocks are allocated and
  cached on the GPU again, which is what a promotion does); the copy's time is the time
  model's (issue 27), not the hit rate's.
- **Release** (finish or preemption): the request's cached blocks are offered to the tier
  (``ReleasedBlocks``), which keeps what its policy keeps.

Miss causes count GPU ∪ host: ``F`` is the chain's reach on either (so a chain the host
holds without a landing state is a ``tail`` miss), and they gain ``host_evicted``: an
``evicted`` miss whose first missing full-attention block had been held by the host too
and was dropped there (``HostTier.ever_stored``).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache import KVCacheManager
from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError
from hybridkv.host_policies import check_host_policy, make_host_tier
from hybridkv.host_tier import HostHit, HostReport, HostShape, HostTier, ReleasedBlocks
from hybridkv.ids import BlockHash, GroupId, ReqId
from hybridkv.models.shapes import parse_size


class HostLink:
    """One replay's host tier and its per-request host hits."""

    def __init__(self, tier: HostTier) -> None:
        self.tier = tier
        self.per_request: dict[str, int] = {}
        """Request id → tokens its first admission read past its GPU hit (host hits)."""

    @classmethod
    def for_manager(cls, manager: KVCacheManager, policy: str, capacity_bytes: int,
                    ) -> HostLink:
        """A ``policy`` tier of ``capacity_bytes`` (whole blocks) behind ``manager``."""
        coordinator = manager.coordinator
        shape = HostShape.of(manager.config, coordinator.managers, coordinator.alignment_tokens,
                             coordinator.bridge_tokens if manager.recompute else None)
        return cls(make_host_tier(policy, shape, capacity_bytes // shape.block_bytes))

    @classmethod
    def for_settings(cls, manager: KVCacheManager, policy: str, capacity_bytes: int,
                     ) -> HostLink | None:
        """``for_manager``, or ``None`` without host memory (``--host-memory`` not given)."""
        return cls.for_manager(manager, policy, capacity_bytes) if capacity_bytes else None

    @staticmethod
    def check(link: HostLink | None) -> None:
        """The tier's ``check_invariants`` (``--paranoid``), if there is a tier."""
        if link is not None:
            link.tier.check_invariants()

    @staticmethod
    def report_of(link: HostLink | None) -> HostReport | None:
        return None if link is None else link.report()

    def lookup(self, manager: KVCacheManager, hashes: Sequence[BlockHash],
               gpu_hit_tokens: int, num_prompt_tokens: int) -> tuple[HostHit | None, int]:
        """Before a first admission's allocation: a hit past the GPU's, if the tier has one
        (capped at the last prompt token), and the full-attention chain's reach on GPU ∪
        host (for the miss causes). Does not modify."""
        pool = manager.pool

        def on_gpu(group_id: GroupId, block_hash: BlockHash) -> bool:
            return block_hash in pool.group_index(group_id)

        cap = num_prompt_tokens - 1
        return (self.tier.longest_hit(hashes, on_gpu, gpu_hit_tokens=gpu_hit_tokens,
                                      max_tokens=cap),
                self.tier.full_reach(hashes, on_gpu, cap))

    def promote(self, req_id: ReqId, hashes: Sequence[BlockHash], hit: HostHit,
                gpu_hit_tokens: int) -> None:
        """The admission went through: count the host hit and its copies."""
        self.tier.promote(hashes, hit, gpu_hit_tokens)
        self.per_request[req_id] = hit.num_tokens - gpu_hit_tokens

    def release(self, manager: KVCacheManager, req_id: ReqId, hashes: Sequence[BlockHash],
                num_computed_tokens: int) -> None:
        """A running request gives its blocks back: offer its cached ones — every hashed
        full-attention block of its tables, and every non-full group's block ending at or
        shortly before one of its aligned points that the GPU still caches (a window
        leaves the table as it slides, so its retained tails may sit in the free queues)."""
        managers = manager.coordinator.managers
        shape = self.tier.shape
        a = shape.alignment_tokens
        end = min(num_computed_tokens, len(hashes) * shape.hash_block_size) // a * a
        cached: list[list[int]] = []
        for group in shape.groups:
            if group.is_full:
                table = managers[group.group_id].tables.get(req_id, [])
                cached.append([i for i, block in enumerate(table)
                               if block.block_hash is not None and not block.is_null])
                continue
            index = manager.pool.group_index(group.group_id)
            found: set[int] = set()
            for point in range(a, end + 1, a):
                last = point // group.block_size
                for i in range(last - group.tail_at(point), last):
                    if i not in found and shape.block_hash(hashes, group, i) in index:
                        found.add(i)
            cached.append(sorted(found))
        self.tier.store(ReleasedBlocks(hashes, tuple(cached), num_computed_tokens))

    def was_stored(self, block_hash: BlockHash) -> bool:
        return block_hash in self.tier.ever_stored

    def report(self) -> HostReport:
        return HostReport.of(self.tier, self.per_request)


def resolve_host_memory(value: str | None, policy: str, config: CacheConfig) -> int:
    """``--host-memory`` in bytes: a size (``64GiB``) or a multiple of the GPU pool's bytes
    (``8x`` = 8 × blocks × bytes per block, as the report states the pool); at least one
    block. Checks ``--host-policy`` too (one line, exit 2).

    >>> from hybridkv.config import CacheConfig
    >>> from hybridkv.specs import FullAttentionSpec
    >>> config = CacheConfig.from_layers([FullAttentionSpec(16, 64)], num_blocks=11)
    >>> resolve_host_memory("8x", "aware", config), resolve_host_memory("1MiB", "lru", config)
    (90112, 1048576)
    """
    if value is None:
        return 0
    check_host_policy(policy)
    text = value.strip().lower()
    if text.endswith("x"):
        try:
            times = float(text[:-1])
        except ValueError:
            times = -1.0
        if not 0 < times < 1e6:
            raise ConfigError("--host-memory", value,
                              "give a size (64GiB) or a positive multiple of the GPU pool (8x)")
        num_bytes = int(times * config.num_blocks * config.bytes_per_block)
    else:
        try:
            num_bytes = parse_size(value)
        except ConfigError as err:
            raise ConfigError("--host-memory", value, err.fix) from err
    if num_bytes < config.bytes_per_block:
        raise ConfigError("--host-memory", value, f"holds no block of {config.bytes_per_block} "
                          "bytes; give at least one block's worth")
    return num_bytes
