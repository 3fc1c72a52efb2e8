"""Offline optimum (``bound``): Belady's MIN over chained full-attention blocks.

Definition (the report's ``bound`` column). Every request, in trace order, reads the chained
full-attention blocks of its prompt (``floor(prompt / bs)`` blocks of the first
full-attention group's block size ``bs``); it hits the longest prefix of them that is cached,
floored to the hit alignment and capped at ``prompt - 1`` tokens (as in the replay). Then all
its blocks are offered to a cache of ``capacity_tokens / bs`` blocks that evicts, with full
knowledge of the future, the block whose next use is farthest away (never-reused blocks are
not kept at all; among equal next uses the deeper block goes first, which keeps every cached
set prefix-closed). Assumptions, all of which make it an upper bound for any online policy
at the same memory: running requests' working sets take no room, sliding-window (and every
other non-full-attention) KV takes no room, and outputs are never reused.

``capacity_tokens`` is the pool's token capacity were every non-null block a full-attention
block: ``(num_blocks - 1) * bs`` (e.g. dsv4-bench, 18,481 blocks of 256 tokens → 4.73 M).

>>> from hybridkv.sim.trace import Trace, TraceRequest
>>> reqs = tuple(TraceRequest(f"r{i}", 8, 1, block_ids=(ids,), trace_block_size=8)
...              for i, ids in enumerate([1, 2, 1, 2, 1]))
>>> offline_optimum(Trace("t", reqs), capacity_tokens=4, block_size=4, alignment_tokens=4)
HitTotals(prompt_tokens=40, hit_tokens=8)
>>> lru_full_attention(Trace("t", reqs), capacity_tokens=4, block_size=4, alignment_tokens=4)
HitTotals(prompt_tokens=40, hit_tokens=0)
"""

from __future__ import annotations

import heapq
import struct
from array import array
from collections import OrderedDict
from collections.abc import Container, Iterator

import xxhash

from hybridkv.hashing import encode_token_ids
from hybridkv.sim.ceiling import HitTotals
from hybridkv.sim.trace import Trace, TraceRequest, expand_prompt

_NEVER = 1 << 62


def _hash_pair(parent: int, value: int) -> int:
    return int(xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, value & (2**64 - 1))))


def block_keys(request: TraceRequest, index: int, block_size: int) -> list[int]:
    """Chained keys of the prompt's full ``block_size``-token blocks (equal key ⇔ equal
    prefix). Block-id traces are keyed from their ids without expanding tokens."""
    num_blocks = request.input_length // block_size
    if request.token_ids is None and request.trace_block_size and not request.token_id_ranges:
        return _keys_from_block_ids(request, index, block_size, num_blocks)
    tokens = expand_prompt(request, index)
    encoded = encode_token_ids(tokens[: num_blocks * block_size])
    width = 8 * block_size
    keys: list[int] = []
    key = 0
    for i in range(num_blocks):
        key = int(xxhash.xxh3_64_intdigest(encoded[i * width : (i + 1) * width], seed=key))
        keys.append(key)
    return keys


def _keys_from_block_ids(request: TraceRequest, index: int, block_size: int,
                         num_blocks: int) -> list[int]:
    size = request.trace_block_size
    chain: list[int] = []
    key = 0
    for block_id in request.block_ids:
        key = _hash_pair(key, block_id)
        chain.append(key)
    keys: list[int] = []
    num_covered = len(request.block_ids) * size
    for i in range(num_blocks):
        end = (i + 1) * block_size
        if end > num_covered:  # reaches request-unique fill tokens: unique to the request
            keys.append(_hash_pair(_hash_pair(1 << 63, index), end))
            continue
        keys.append(_hash_pair(chain[(end - 1) // size], end))
    return keys


def _num_leading_cached(keys: list[int], cached: Container[int]) -> int:
    num_hit = 0
    for key in keys:
        if key not in cached:
            break
        num_hit += 1
    return num_hit


def _hit_tokens(num_cached_blocks: int, block_size: int, prompt_tokens: int,
                alignment_tokens: int) -> int:
    cap = ((prompt_tokens - 1) // alignment_tokens) * alignment_tokens
    hit = (num_cached_blocks * block_size // alignment_tokens) * alignment_tokens
    return min(hit, cap)


def _next_uses(trace: Trace, block_size: int) -> list[array[int]]:
    """For each request and block, the index of the next request reading the same key."""
    keyed = [block_keys(r, i, block_size) for i, r in enumerate(trace.requests)]
    last_seen: dict[int, int] = {}
    result: list[array[int]] = [array("q")] * len(keyed)
    for i in range(len(keyed) - 1, -1, -1):
        keys = keyed[i]
        result[i] = array("q", (last_seen.get(k, _NEVER) for k in keys))
        for k in keys:
            last_seen[k] = i
    return result


def _iter_keys(trace: Trace, block_size: int) -> Iterator[tuple[TraceRequest, list[int]]]:
    for index, request in enumerate(trace.requests):
        yield request, block_keys(request, index, block_size)


def offline_optimum(trace: Trace, capacity_tokens: int, block_size: int,
                    alignment_tokens: int) -> HitTotals:
    """Belady MIN hit tokens of ``trace`` for a cache of ``capacity_tokens`` tokens."""
    capacity = capacity_tokens // block_size
    next_uses = _next_uses(trace, block_size)
    cached: dict[int, int] = {}  # key -> next use
    heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, key), lazily invalidated
    prompt_tokens = hit_tokens = 0
    for i, (request, keys) in enumerate(_iter_keys(trace, block_size)):
        num_hit = _num_leading_cached(keys, cached)
        hit_tokens += _hit_tokens(num_hit, block_size, request.input_length, alignment_tokens)
        prompt_tokens += request.input_length
        uses = next_uses[i]
        for depth, key in enumerate(keys):
            use = uses[depth]
            if use == _NEVER:
                cached.pop(key, None)
                continue
            cached[key] = use
            heapq.heappush(heap, (-use, -depth, key))
        while len(cached) > capacity:
            neg_use, _, key = heapq.heappop(heap)
            if cached.get(key) == -neg_use:
                del cached[key]
        if len(heap) > 4 * max(capacity, 1024):  # drop stale entries now and then
            heap = [e for e in heap if cached.get(e[2]) == -e[0]]
            heapq.heapify(heap)
    return HitTotals(prompt_tokens, hit_tokens)


def lru_full_attention(trace: Trace, capacity_tokens: int, block_size: int,
                       alignment_tokens: int) -> HitTotals:
    """One LRU list over full-attention blocks only (same accounting as the optimum);
    within a request the deepest block is the least recently used."""
    capacity = capacity_tokens // block_size
    cache: OrderedDict[int, None] = OrderedDict()
    prompt_tokens = hit_tokens = 0
    for request, keys in _iter_keys(trace, block_size):
        num_hit = _num_leading_cached(keys, cache)
        hit_tokens += _hit_tokens(num_hit, block_size, request.input_length, alignment_tokens)
        prompt_tokens += request.input_length
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return HitTotals(prompt_tokens, hit_tokens)
