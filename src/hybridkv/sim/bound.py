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
from collections.abc import Container, Iterator, Sequence

import xxhash

from hybridkv.hashing import encode_token_ids
from hybridkv.sim.ceiling import HitTotals
from hybridkv.sim.trace import Trace, TraceRequest, expand_prompt

_NEVER = 1 << 62
_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15
_EMPTY = array("q")


def _hash_pair(parent: int, value: int) -> int:
    return int(xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, value & (2**64 - 1))))


def block_keys(request: TraceRequest, index: int, block_size: int) -> array[int]:
    """Chained keys of the prompt's full ``block_size``-token blocks (equal key ⇔ equal
    prefix, up to 64-bit collisions). Block-id traces are keyed from their ids without
    expanding tokens."""
    num_blocks = request.input_length // block_size
    if request.token_ids is None and request.trace_block_size and not request.token_id_ranges:
        return _keys_from_block_ids(request, index, block_size, num_blocks)
    tokens = expand_prompt(request, index)
    encoded = encode_token_ids(tokens[: num_blocks * block_size])
    width = 8 * block_size
    keys = array("Q")
    key = 0
    for i in range(num_blocks):
        key = int(xxhash.xxh3_64_intdigest(encoded[i * width : (i + 1) * width], seed=key))
        keys.append(key)
    return keys


def _keys_from_block_ids(request: TraceRequest, index: int, block_size: int,
                         num_blocks: int) -> array[int]:
    """Engine block ``i`` ends at token ``end = (i + 1) * block_size`` inside trace block
    ``(end - 1) // size``; its key mixes that trace block's chained key with ``end``
    (e.g. WEKA's 64-token trace blocks hold four 16-token blocks: ends 16, 32, 48, 64)."""
    size = request.trace_block_size
    chain: list[int] = []
    key = 0
    for block_id in request.block_ids:
        key = _hash_pair(key, block_id)
        chain.append(key)
    num_covered = min(num_blocks, len(request.block_ids) * size // block_size)
    keys = array("Q", [(chain[((i + 1) * block_size - 1) // size] ^ ((i + 1) * _GOLDEN))
                       & _MASK for i in range(num_covered)])
    unique = _hash_pair(1 << 63, index)  # fill tokens past the trace blocks: request-unique
    keys.extend(_hash_pair(unique, (i + 1) * block_size) for i in range(num_covered, num_blocks))
    return keys


def _num_leading_cached(keys: Sequence[int], cached: Container[int]) -> int:
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


def _next_uses(keyed: Sequence[array[int]]) -> list[array[int]]:
    """For each request and block, the index of the next request reading the same key."""
    last_seen: dict[int, int] = {}
    result: list[array[int]] = [array("q")] * len(keyed)
    for i in range(len(keyed) - 1, -1, -1):
        keys = keyed[i]
        get = last_seen.get
        result[i] = array("q", [get(k, _NEVER) for k in keys])
        last_seen.update(dict.fromkeys(keys, i))
    return result


def _iter_keys(trace: Trace, block_size: int) -> Iterator[tuple[TraceRequest, array[int]]]:
    for index, request in enumerate(trace.requests):
        yield request, block_keys(request, index, block_size)


def _runs(uses: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Maximal ``(start, end, use)`` depth ranges of equal next use, never-used ones left
    out. E.g. uses ``[5, 5, NEVER, 7, 7, 7]`` → ``(0, 2, 5), (3, 6, 7)``."""
    start = 0
    n = len(uses)
    if n == 0:
        return
    for depth in [d for d in range(1, n) if uses[d] != uses[d - 1]] + [n]:
        if uses[start] != _NEVER:
            yield start, depth, uses[start]
        start = depth


def offline_optimum(trace: Trace, capacity_tokens: int, block_size: int,
                    alignment_tokens: int) -> HitTotals:
    """Belady MIN hit tokens of ``trace`` for a cache of ``capacity_tokens`` tokens.

    Eviction order: farthest next use first, deeper first among equal next uses (no two
    cached keys share both: a request reads one key per depth). A request's blocks with the
    same next use form a run (a conversation's next turn rereads the whole prefix: one run),
    and the heap holds one entry per run — its deepest remaining block — instead of one per
    block access: WEKA's 45 M block accesses become ~10⁵ heap entries.
    """
    capacity = capacity_tokens // block_size
    keyed = [block_keys(r, i, block_size) for i, r in enumerate(trace.requests)]
    next_uses = _next_uses(keyed)
    cached: dict[int, int] = {}  # key -> next use
    heap: list[tuple[int, int, int]] = []  # (-use, -deepest depth, run id)
    runs: dict[int, tuple[array[int], int, int]] = {}  # run id -> (keys, start, end)
    next_run = 0
    prompt_tokens = hit_tokens = 0
    for i, request in enumerate(trace.requests):
        keys, uses = keyed[i], next_uses[i]
        keyed[i] = next_uses[i] = _EMPTY  # the runs keep what is still needed
        num_hit = _num_leading_cached(keys, cached)
        hit_tokens += _hit_tokens(num_hit, block_size, request.input_length, alignment_tokens)
        prompt_tokens += request.input_length
        cached.update(zip(keys, uses, strict=True))
        for start, end, use in _runs(uses):
            runs[next_run] = (keys, start, end)
            heapq.heappush(heap, (-use, 1 - end, next_run))
            next_run += 1
        if _NEVER in uses:
            for key, use in zip(keys, uses, strict=True):
                if use == _NEVER:
                    del cached[key]
        if i % 1024 == 1023:  # runs whose next use has passed were re-read: all stale
            heap = [e for e in heap if -e[0] > i]
            heapq.heapify(heap)
            runs = {e[2]: runs[e[2]] for e in heap}
        while len(cached) > capacity:
            neg_use, _, run_id = heapq.heappop(heap)
            run_keys, start, end = runs.pop(run_id)
            key = run_keys[end - 1]
            if cached.get(key) == -neg_use:  # not re-read since (uses only grow)
                del cached[key]
            if end - 1 > start:
                runs[run_id] = (run_keys, start, end - 1)
                heapq.heappush(heap, (neg_use, 2 - end, run_id))
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
