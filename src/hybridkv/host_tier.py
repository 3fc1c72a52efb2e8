"""Host-memory (CPU DRAM) tier behind the GPU pool: shape, hit search, counters, registry.

A request that finishes hands its cached blocks to the tier (``HostTier.store``: the copy
GPU → host is written then, before the GPU can evict them — HiCache's write-through on
release, vLLM's offloading store of computed blocks); a later request whose GPU hit stops
short looks further in GPU ∪ host (``longest_hit``) and promotes what it reads
(``promote``: the copy host → GPU). What the tier keeps, and what it drops when full, is the
policy's job (``host_aware.LandingTier``, ``host_lru.BlockLRUTier``); this module holds
what every policy shares.

**Hit rule** (the same for every policy, the router rule of ``hybridkv.events``): a hit at
an aligned ``p`` needs, in every full-attention group, every block of ``[0, p)``, and in
every other group the ``hit_tail_blocks(p)`` blocks ending at ``p`` (window tail, recurrent
checkpoint, compressor state) — each on the GPU or on the host. A block of group ``g``
ending at ``q`` is named by the request's hash-block hash ending at ``q`` (the chained
hash of ``[0, q)``), as in the pool.

Worked example (one full-attention group and one window group, blocks of 4 tokens, window
tail 1 block, alignment 4): the host holds full blocks ``h4 h8`` and the window block
``h8``; the GPU holds the full block ``h4``. A 10-token prompt hashing ``h4 h8`` finds no
GPU hit and a host hit at 8, loading 2 blocks (full ``h8``, window ``h8``; full ``h4`` is
read from the GPU):

>>> from hybridkv.ids import BlockHash, GroupId
>>> shape = HostShape((HostGroup(GroupId(0), 4, None), HostGroup(GroupId(1), 4, 1)),
...                   hash_block_size=4, alignment_tokens=4, block_bytes=100)
>>> h4, h8 = BlockHash(b"h4"), BlockHash(b"h8")
>>> host = [{h4, h8}, {h8}]
>>> gpu = [{h4}, set()]
>>> hit = find_host_hit(shape, [h4, h8], lambda g, h: h in gpu[g], lambda g, h: h in host[g],
...                     gpu_hit_tokens=0, max_tokens=8)
>>> hit.num_tokens, [(int(g), bytes(h)) for g, h in hit.loaded]
(8, [(0, b'h8'), (1, b'h8')])
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError
from hybridkv.ids import BlockHash, GroupId
from hybridkv.managers.base import GroupManager

HostKey = tuple[GroupId, BlockHash]
"""One block on the host: its group and the hash it is cached under."""

Resident = Callable[[GroupId, BlockHash], bool]
"""Whether a group holds a block under a hash (the GPU's index, or the host's)."""


@dataclass(frozen=True, slots=True)
class HostGroup:
    """One prefix-cacheable cache group as the tier sees it.

    ``tail_blocks`` is ``None`` for a full-attention kind (a hit needs every block from 0),
    else the largest number of blocks ending at a hit point that a hit there needs
    (``GroupManager.hit_tail_blocks``; capped at ``p / block_size`` at point ``p``)."""

    group_id: GroupId
    block_size: int
    tail_blocks: int | None

    @property
    def is_full(self) -> bool:
        return self.tail_blocks is None

    def tail_at(self, num_tokens: int) -> int:
        """Blocks ending at ``num_tokens`` a hit there needs (every one for full attention).

        >>> HostGroup(GroupId(1), 16, 2).tail_at(16), HostGroup(GroupId(0), 16, None).tail_at(64)
        (1, 4)
        """
        num_blocks = num_tokens // self.block_size
        return num_blocks if self.tail_blocks is None else min(self.tail_blocks, num_blocks)


@dataclass(frozen=True, slots=True)
class HostShape:
    """The model's groups, hash granularity, alignment and the bytes of one block (every
    group's block costs the pool's uniform page, as vLLM's CPU offloading copies GPU
    blocks one for one)."""

    groups: tuple[HostGroup, ...]
    hash_block_size: int
    alignment_tokens: int
    block_bytes: int
    bridge_tokens: int | None = None
    """Window-recompute bridges (``+recompute``): a hit may land at ``s`` on the
    full-attention chain alone when it reaches ``F ≥ s + bridge_tokens`` (the window layers
    recompute ``[s, F)`` reading the chain); ``None``: no bridges."""

    def block_hash(self, hashes: Sequence[BlockHash], group: HostGroup, index: int,
                   ) -> BlockHash:
        """The hash of ``group``'s block ``index`` (tokens ``[index·bs, (index+1)·bs)``)."""
        return hashes[(index + 1) * (group.block_size // self.hash_block_size) - 1]

    @property
    def full_groups(self) -> tuple[HostGroup, ...]:
        return tuple(g for g in self.groups if g.is_full)

    @property
    def tail_groups(self) -> tuple[HostGroup, ...]:
        return tuple(g for g in self.groups if not g.is_full)

    @classmethod
    def of(cls, config: CacheConfig, managers: Sequence[GroupManager],
           alignment_tokens: int, bridge_tokens: int | None = None) -> HostShape:
        """The shape of a manager's groups (ring buffers, never prefix-cached, left out)."""
        groups = tuple(
            HostGroup(m.group_id, m.block_size,
                      None if m.is_full_attention else m.max_hit_tail_blocks())
            for m in managers if m.spec.prefix_cacheable)
        return cls(groups, config.hash_block_size, alignment_tokens, config.bytes_per_block,
                   bridge_tokens)

    def bridge_start(self, full_tokens: int) -> int:
        """Where a bridge hit on a chain of ``full_tokens`` lands (0: none).

        >>> full = HostGroup(GroupId(0), 4, None)
        >>> HostShape((full,), 4, 4, 1, bridge_tokens=8).bridge_start(30)
        20
        """
        if self.bridge_tokens is None or not self.full_groups:
            return 0
        a = self.alignment_tokens
        return max(0, (full_tokens // a * a - self.bridge_tokens) // a * a)

    def landing_keys(self, hashes: Sequence[BlockHash], point: int) -> list[HostKey]:
        """The non-full groups' blocks a hit at ``point`` needs (tails ending there)."""
        keys: list[HostKey] = []
        for group in self.tail_groups:
            last = point // group.block_size
            for index in range(last - group.tail_at(point), last):
                keys.append((group.group_id, self.block_hash(hashes, group, index)))
        return keys


@dataclass(frozen=True, slots=True)
class HostHit:
    """A hit that reaches past the GPU hit: its length and the host blocks it reads (a
    bridge hit also reads the chain up to ``full_attention_tokens``)."""

    num_tokens: int
    loaded: tuple[HostKey, ...]
    full_attention_tokens: int = 0


def full_prefix_tokens(shape: HostShape, hashes: Sequence[BlockHash], resident: Resident,
                        max_tokens: int) -> int:
    """Tokens of ``[0, max_tokens)`` every full-attention group holds (GPU ∪ host)."""
    reach = max_tokens
    for group in shape.full_groups:
        num = 0
        while (num + 1) * group.block_size <= reach and resident(
                group.group_id, shape.block_hash(hashes, group, num)):
            num += 1
        reach = min(reach, num * group.block_size)
    return reach


def find_host_hit(shape: HostShape, hashes: Sequence[BlockHash], on_gpu: Resident,
                  on_host: Resident, *, gpu_hit_tokens: int, max_tokens: int,
                  ) -> HostHit | None:
    """The longest aligned hit ``p`` in ``(gpu_hit_tokens, max_tokens]`` that GPU ∪ host can
    serve (module doc), with the host blocks it reads; ``None`` if there is none."""
    def either(group_id: GroupId, block_hash: BlockHash) -> bool:
        return on_gpu(group_id, block_hash) or on_host(group_id, block_hash)

    a = shape.alignment_tokens
    cap = min(max_tokens, len(hashes) * shape.hash_block_size)
    reach = full_prefix_tokens(shape, hashes, either, cap) // a * a
    bridge = shape.bridge_start(reach)
    point = reach
    while point > max(gpu_hit_tokens, bridge):
        if all(either(g, h) for g, h in shape.landing_keys(hashes, point)):
            return HostHit(point, tuple(_loaded(shape, hashes, point, gpu_hit_tokens, on_gpu)))
        point -= a
    if bridge > gpu_hit_tokens:  # the chain alone: the window layers recompute [s, F)
        loaded = _loaded(shape, hashes, reach, gpu_hit_tokens, on_gpu, tails=False)
        return HostHit(bridge, tuple(loaded), reach)
    return None


def _loaded(shape: HostShape, hashes: Sequence[BlockHash], point: int, gpu_hit_tokens: int,
            on_gpu: Resident, *, tails: bool = True) -> list[HostKey]:
    """The blocks a hit at ``point`` reads from the host: those not on the GPU (the GPU
    hit's own full-attention blocks, before ``gpu_hit_tokens``, are on the GPU)."""
    loaded: list[HostKey] = []
    for group in shape.full_groups:
        for index in range(gpu_hit_tokens // group.block_size, point // group.block_size):
            key = (group.group_id, shape.block_hash(hashes, group, index))
            if not on_gpu(*key):
                loaded.append(key)
    if tails:
        loaded.extend(key for key in shape.landing_keys(hashes, point) if not on_gpu(*key))
    return loaded


@dataclass(slots=True)
class HostCounters:
    """What the tier did: blocks copied each way, dropped, and hits served."""

    stored_blocks: int = 0
    """Copies GPU → host (a block already on the host is not copied again)."""
    loaded_blocks: int = 0
    """Copies host → GPU (promotions)."""
    evicted_blocks: int = 0
    """Host blocks dropped for room."""
    refused_blocks: int = 0
    """Blocks offered that the policy did not keep (no landing state, or no room)."""
    hits: int = 0
    hit_tokens: int = 0
    """Tokens past the GPU hit served by host hits (first admissions)."""


@dataclass(frozen=True, slots=True)
class ReleasedBlocks:
    """What a finishing request hands the tier: its hash-block hashes and, per group of
    the shape (same order), the table indexes of its cached blocks (ascending)."""

    hashes: Sequence[BlockHash]
    cached: tuple[Sequence[int], ...]
    num_tokens: int
    """Tokens the request computed (its cached prefix ends at or before this)."""


class HostTier(ABC):
    """A host tier of ``capacity_blocks`` blocks behind one GPU pool.

    Invariants (``check_invariants``, per policy): ``used_blocks ≤ capacity_blocks``;
    ``used_blocks`` equals the blocks the policy's structures hold; ``holds`` agrees with
    them. Policies add their own (``LandingTier``: no dead content)."""

    name: str = ""

    def __init__(self, shape: HostShape, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ConfigError("capacity_blocks", capacity_blocks, "use 0 or more blocks")
        self.shape = shape
        self.capacity_blocks = capacity_blocks
        self.counters = HostCounters()
        self.ever_stored: set[BlockHash] = set()
        """Hashes of full-attention blocks the tier has held (miss cause ``host_evicted``)."""
        self._full_ids = frozenset(g.group_id for g in shape.full_groups)

    @abstractmethod
    def holds(self, group_id: GroupId, block_hash: BlockHash) -> bool:
        """Whether the host holds this block (readable by a hit)."""

    @property
    @abstractmethod
    def used_blocks(self) -> int: ...

    @abstractmethod
    def occupancy_blocks(self) -> tuple[int, int]:
        """Blocks held as (full-attention KV, state: window tails / checkpoints / others)."""

    @abstractmethod
    def store(self, released: ReleasedBlocks) -> None:
        """A request released its blocks: copy what the policy keeps."""

    @abstractmethod
    def touch(self, hashes: Sequence[BlockHash], hit: HostHit) -> None:
        """A hit read ``hit.loaded`` (and landed at ``hit.num_tokens``): recency."""

    @abstractmethod
    def check_invariants(self) -> None: ...

    def longest_hit(self, hashes: Sequence[BlockHash], on_gpu: Resident, *,
                    gpu_hit_tokens: int, max_tokens: int) -> HostHit | None:
        """``find_host_hit`` against this tier. Does not modify."""
        return find_host_hit(self.shape, hashes, on_gpu, self.holds,
                             gpu_hit_tokens=gpu_hit_tokens, max_tokens=max_tokens)

    def full_reach(self, hashes: Sequence[BlockHash], on_gpu: Resident, max_tokens: int,
                   ) -> int:
        """Tokens of ``[0, max_tokens)`` the full-attention groups hold on GPU ∪ host (the
        ``F`` of the miss causes). Does not modify."""
        def either(group_id: GroupId, block_hash: BlockHash) -> bool:
            return on_gpu(group_id, block_hash) or self.holds(group_id, block_hash)

        return full_prefix_tokens(self.shape, hashes, either, min(
            max_tokens, len(hashes) * self.shape.hash_block_size))

    def promote(self, hashes: Sequence[BlockHash], hit: HostHit, gpu_hit_tokens: int) -> None:
        """Count a hit served (first admission) and its copies; refresh recency."""
        self.counters.hits += 1
        self.counters.hit_tokens += hit.num_tokens - gpu_hit_tokens
        self.counters.loaded_blocks += len(hit.loaded)
        self.touch(hashes, hit)

    def note_stored(self, key: HostKey) -> None:
        """A block was copied onto the host."""
        self.counters.stored_blocks += 1
        if key[0] in self._full_ids:
            self.ever_stored.add(key[1])


@dataclass(slots=True)
class HostReport:
    """A replay's host-tier summary (bytes = blocks × the pool's block bytes)."""

    policy: str
    capacity_bytes: int
    hit_tokens: int = 0
    hits: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    evicted_blocks: int = 0
    refused_blocks: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0
    per_request: dict[str, int] = field(default_factory=dict)
    """Request id → tokens its first admission read from the host (host hits only)."""

    @classmethod
    def of(cls, tier: HostTier, per_request: dict[str, int]) -> HostReport:
        c, b = tier.counters, tier.shape.block_bytes
        kv, state = tier.occupancy_blocks()
        return cls(tier.name, tier.capacity_blocks * b, c.hit_tokens, c.hits,
                   c.stored_blocks * b, c.loaded_blocks * b, c.evicted_blocks,
                   c.refused_blocks, kv * b, state * b, per_request)

    def merge(self, other: HostReport) -> None:
        for name in ("hit_tokens", "hits", "stored_bytes", "loaded_bytes", "evicted_blocks",
                     "refused_blocks"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.kv_bytes, self.state_bytes = other.kv_bytes, other.state_bytes
        self.per_request.update(other.per_request)

    def as_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "capacity_bytes": self.capacity_bytes,
                "hit_tokens": self.hit_tokens, "hits": self.hits,
                "stored_bytes": self.stored_bytes, "loaded_bytes": self.loaded_bytes,
                "evicted_blocks": self.evicted_blocks, "refused_blocks": self.refused_blocks,
                "occupancy_bytes": {"kv": self.kv_bytes, "state": self.state_bytes},
                "per_request_hit_tokens": dict(self.per_request)}
