"""Admission growth probes: cheap checks of whether a waiting request's prefix hit may have
grown since it was looked up (used by the admission orders through the façade's
``lookup_version``, ``may_extend``, ``growth_probe_parts`` and ``hashes_indexed_since``).

A hybrid hit is bounded by full attention: it can grow past ``num_tokens`` only if a
full-attention group gained the block right after the full-attention match, or (when full
attention matched further than the hit, ``matched``) another group gained a block of the
request's chain inside ``(num_tokens, matched]`` (a window tail there could make a hit).
Each such check is one dictionary probe of the pool's per-group hash index, so a scheduler
can precompute the (index, hash) pairs once and repeat them without a call.

Worked example (hash blocks of 2 tokens; full attention 4-token blocks, a window group of
2-token blocks; a hit of 4 tokens whose full attention matched 12): full attention is
probed at the 4-token block ending at 16 (chain position ``16 // 2 - 1 = 7``), the window
group at its blocks ending at 6, 8, 10, 12 (positions 2, 3, 4, 5):

>>> from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
>>> m = KVCacheManager(CacheConfig.from_layers(
...     (FullAttentionSpec(4, 1), SlidingWindowSpec(2, 1, 2)), 64), "latest")
>>> m.add_request("r", list(range(20)))
>>> full, window = m.growth_probe_parts("r", 4, 12)
>>> [len(full)], [len(hashes) for _, hashes in window]
([1], [4])
>>> m.may_extend("r", 4, 12)  # nothing cached yet
False
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.block import Block
from hybridkv.ids import BlockHash, GroupId
from hybridkv.managers.base import GroupManager
from hybridkv.pool import BlockPool

Probes = tuple[tuple[Mapping[BlockHash, Block], BlockHash], ...]
"""(index, hash) pairs: the probe holds when ``hash in index``."""
WindowProbes = tuple[tuple[Mapping[BlockHash, Block], tuple[BlockHash, ...]], ...]
"""Per non-full-attention group, its index and the chain hashes probed inside the match."""


def lookup_version(pool: BlockPool, num_groups: int) -> tuple[int, int]:
    """(pool epoch, hashes ever indexed over all groups): see
    ``KVCacheManager.lookup_version``."""
    return pool.epoch, sum(pool.index_mark(GroupId(g)) for g in range(num_groups))


def may_extend(pool: BlockPool, managers: Sequence[GroupManager], hashes: Sequence[BlockHash],
               hash_block_tokens: int, num_tokens: int, matched_tokens: int) -> bool:
    """``KVCacheManager.may_extend`` over the request's chain ``hashes`` (one per
    ``hash_block_tokens`` tokens)."""
    hb = hash_block_tokens
    matched = max(num_tokens, matched_tokens)
    has_full = False
    for manager in managers:
        if not manager.is_full_attention:
            continue
        has_full = True
        position = (matched // manager.block_size + 1) * manager.block_size // hb - 1
        if position < len(hashes) and hashes[position] in pool.group_index(manager.group_id):
            return True
    if not has_full:
        return True
    for manager in managers:
        if manager.is_full_attention or matched <= num_tokens:
            continue
        index = pool.group_index(manager.group_id)
        step = manager.block_size // hb
        first = (num_tokens // manager.block_size + 1) * step - 1
        last = min(matched // hb, len(hashes))
        if any(hashes[j] in index for j in range(first, last, step)):
            return True
    return False


def growth_probe_parts(pool: BlockPool, managers: Sequence[GroupManager],
                       hashes: Sequence[BlockHash], hash_block_tokens: int, num_tokens: int,
                       matched_tokens: int) -> tuple[Probes, WindowProbes] | None:
    """``may_extend``'s probes, precomputed: the full-attention (index, hash) pairs, and per
    other group its index with the hashes probed inside the match (one slice of the chain
    each). ``None``: no full attention (always true)."""
    hb = hash_block_tokens
    matched = max(num_tokens, matched_tokens)
    full: list[tuple[Mapping[BlockHash, Block], BlockHash]] = []
    full_managers = [m for m in managers if m.is_full_attention]
    if not full_managers:
        return None
    for manager in full_managers:
        position = (matched // manager.block_size + 1) * manager.block_size // hb - 1
        if position < len(hashes):
            full.append((pool.group_index(manager.group_id), hashes[position]))
    window: list[tuple[Mapping[BlockHash, Block], tuple[BlockHash, ...]]] = []
    if matched > num_tokens:
        for manager in managers:
            if manager.is_full_attention:
                continue
            step = manager.block_size // hb
            first = (num_tokens // manager.block_size + 1) * step - 1
            last = min(matched // hb, len(hashes))
            if first < last:
                window.append((pool.group_index(manager.group_id),
                               tuple(hashes[first:last:step])))
    return tuple(full), tuple(window)


def flatten(parts: tuple[Probes, WindowProbes] | None) -> Probes | None:
    """``growth_probe_parts`` as one list of (index, hash) pairs, in the same order."""
    if parts is None:
        return None
    full, window = parts
    return (*full, *((index, h) for index, hashes in window for h in hashes))


def hashes_indexed_since(pool: BlockPool, managers: Sequence[GroupManager],
                         marks: Sequence[int] | None,
                         ) -> tuple[list[int], tuple[list[BlockHash], list[BlockHash]] | None]:
    """``KVCacheManager.hashes_indexed_since``: the marks now (one ``index_mark`` per
    group) and the hashes indexed since ``marks`` in the full-attention groups and in the
    others (``None``: not known)."""
    groups = [(m.group_id, m.is_full_attention) for m in managers]
    now = [pool.index_mark(g) for g, _ in groups]
    if marks is None or len(marks) != len(now):
        return now, None
    full: list[BlockHash] = []
    window: list[BlockHash] = []
    for (group_id, is_full), count, mark in zip(groups, now, marks, strict=True):
        if count < mark:
            return now, None
        if count > mark:
            (full if is_full else window).extend(pool.newest_hashes(group_id, count - mark))
    return now, (full, window)
