"""Offline optima: the hybrid-aware ``bound`` and the full-attention-only ``bound_fa``.

Both are Belady MIN over *hit units* (``A``-token pieces of chained full-attention KV, ``A`` =
the hit alignment) for the admission order a replay used (``AdmissionLog``); the argument why
each is an upper bound is in ``docs/design.md`` ("The offline bounds"):

- ``bound_fa`` (``unit_optimum`` with a constant capacity): the pool as if every non-null
  block held full-attention KV of one group: ``(num_blocks - 1) * bs / A`` units.
- ``bound`` (``hybrid_optimum``): at each admission ``e`` the capacity is what is left after
  the blocks held then that are *not* full-attention prompt KV —
  ``floor((num_blocks - 1 - held[e]) / u)`` units, ``u`` = full-attention blocks per unit
  summed over the full-attention groups. ``held[e]`` (recorded by the replay right after the
  allocation) counts running requests' window / chunked / other non-full blocks — the
  admitted request's own window tail (its hit point's state) included — and their
  full-attention blocks past their prompts' last whole unit (decode, partial blocks).
  Which held blocks are cache items is each group manager's hook
  (``GroupManager.bound_item_blocks``): a new group kind is charged automatically.

A request reads only the units a hit can use (``(n - 1) // A`` of an ``n``-token prompt, at
its first admission); every admission inserts all its units (prompt, and predetermined
outputs). Re-admissions after preemption and units past the usable depth insert without
reading: the next "use" of a unit whose next occurrence only recomputes it is never.

>>> from hybridkv.sim.trace import Trace, TraceRequest
>>> reqs = tuple(TraceRequest(f"r{i}", 9, 1, block_ids=(ids,), trace_block_size=8)
...              for i, ids in enumerate([1, 2, 1, 2, 1]))
>>> log = AdmissionLog.in_trace_order(Trace("t", reqs))
>>> unit_optimum(Trace("t", reqs), log, [2] * 5, unit_tokens=4)   # 2 units of 4 tokens
HitTotals(prompt_tokens=45, hit_tokens=16)
>>> unit_optimum(Trace("t", reqs), log, [1] * 5, unit_tokens=4)  # r2, r4 hit 1 unit each
HitTotals(prompt_tokens=45, hit_tokens=8)
>>> unit_optimum(Trace("t", reqs), log, [1, 1, 0, 1, 1], unit_tokens=4)  # r2's unit dropped
HitTotals(prompt_tokens=45, hit_tokens=4)

The legacy ``offline_optimum`` (trace order, blocks of ``bs``, leading-run reads of every
block, alignment floor) is kept for the tests comparing it with a textbook MIN.

Definition of the legacy ``offline_optimum``. Every request, in trace order, reads the chained
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
from dataclasses import dataclass, field

import xxhash

from hybridkv.config import CacheConfig
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


# ----------------------------------------------------------------- the unit bounds


@dataclass(slots=True)
class AdmissionLog:
    """The admissions of one replay, in order (first admissions and re-admissions).

    ``request_indices[e]``: trace index of the request admitted at event ``e``;
    ``reads[e]``: 1 on its first admission (the hit the report counts), 0 on a re-admission
    after preemption; ``held_blocks[e]``: blocks held right after that allocation that are not
    full-attention prompt KV (the charge of ``hybrid_optimum``).
    """

    request_indices: array[int] = field(default_factory=lambda: array("q"))
    reads: array[int] = field(default_factory=lambda: array("b"))
    held_blocks: array[int] = field(default_factory=lambda: array("q"))

    def append(self, request_index: int, is_first: bool, held_blocks: int) -> None:
        self.request_indices.append(request_index)
        self.reads.append(1 if is_first else 0)
        self.held_blocks.append(held_blocks)

    def __len__(self) -> int:
        return len(self.request_indices)

    @classmethod
    def in_trace_order(cls, trace: Trace) -> AdmissionLog:
        """Every request admitted once, in trace order, nothing held (FCFS without
        preemption or session reordering)."""
        n = len(trace.requests)
        return cls(array("q", range(n)), array("b", [1]) * n, array("q", [0]) * n)


def unit_keys(request: TraceRequest, index: int, unit_tokens: int) -> array[int]:
    """Chained keys of every whole ``unit_tokens`` unit a request computes: its prompt, and
    its outputs when the trace predetermines them (a later prompt may resend them)."""
    if not request.output_token_ids:
        return block_keys(request, index, unit_tokens)
    tokens = expand_prompt(request, index) + list(request.output_token_ids)
    num_units = len(tokens) // unit_tokens
    encoded = encode_token_ids(tokens[: num_units * unit_tokens])
    width = 8 * unit_tokens
    keys = array("Q")
    key = 0
    for i in range(num_units):
        key = int(xxhash.xxh3_64_intdigest(encoded[i * width : (i + 1) * width], seed=key))
        keys.append(key)
    return keys


def unit_optimum(trace: Trace, log: AdmissionLog, capacity_units: Sequence[int],
                 unit_tokens: int) -> HitTotals:
    """Belady MIN hit tokens over the admissions of ``log``, with ``capacity_units[e]`` units
    cached right after admission ``e``.

    At each admission the request first reads its usable units (first admission only: the
    ``(n - 1) // unit_tokens`` units of an ``n``-token prompt; each one cached is a hit of
    ``unit_tokens`` tokens, counted whether or not an earlier one missed), then inserts all
    of its units; the cache then keeps, up to the capacity, the units whose next *read* comes
    soonest (deeper first among equal ones). A unit whose next occurrence is not a read
    (past that request's usable depth, or a re-admission) is recomputed there for free, so
    keeping it until then is worthless: its next use is never. Runs of equal next use share
    one heap entry (as in ``offline_optimum``).
    """
    requests = trace.requests
    keys_of: dict[int, array[int]] = {}
    for index in dict.fromkeys(log.request_indices):
        keys_of[index] = unit_keys(requests[index], index, unit_tokens)
    num_events = len(log)
    depth = [((requests[i].input_length - 1) // unit_tokens) if r else 0
             for i, r in zip(log.request_indices, log.reads, strict=True)]
    next_uses = _next_reads([keys_of[i] for i in log.request_indices], depth)
    cached: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []
    runs: dict[int, tuple[array[int], int, int]] = {}
    next_run = 0
    hit_units = 0
    prompt_tokens = sum(requests[i].input_length
                        for i, r in zip(log.request_indices, log.reads, strict=True) if r)
    for e in range(num_events):
        keys, uses = keys_of[log.request_indices[e]], next_uses[e]
        next_uses[e] = _EMPTY
        usable = min(depth[e], len(keys))
        if usable and cached:
            hit_units += sum(map(cached.__contains__, keys[:usable]))
        cached.update(zip(keys, uses, strict=True))
        for start, end, use in _runs(uses):
            runs[next_run] = (keys, start, end)
            heapq.heappush(heap, (-use, 1 - end, next_run))
            next_run += 1
        if _NEVER in uses:
            for key, use in zip(keys, uses, strict=True):
                if use == _NEVER:
                    del cached[key]
        if e % 1024 == 1023:  # runs whose next use has passed were re-read: all stale
            heap = [entry for entry in heap if -entry[0] > e]
            heapq.heapify(heap)
            runs = {entry[2]: runs[entry[2]] for entry in heap}
        capacity = max(0, capacity_units[e])
        while len(cached) > capacity:
            neg_use, _, run_id = heapq.heappop(heap)
            run_keys, start, end = runs.pop(run_id)
            key = run_keys[end - 1]
            if cached.get(key) == -neg_use:
                del cached[key]
            if end - 1 > start:
                runs[run_id] = (run_keys, start, end - 1)
                heapq.heappush(heap, (neg_use, 2 - end, run_id))
    return HitTotals(prompt_tokens, hit_units * unit_tokens)


def _next_reads(keyed: Sequence[array[int]], depth: Sequence[int]) -> list[array[int]]:
    """Per event and unit: the next event that *reads* the same key, or never when the next
    occurrence only recomputes it (past that event's usable ``depth``).

    >>> [list(u) for u in _next_reads([array("Q", [1, 2]), array("Q", [1, 2])], [2, 1])]
    [[1, 4611686018427387904], [4611686018427387904, 4611686018427387904]]
    """
    next_uses: list[array[int]] = [_EMPTY] * len(keyed)
    last_seen: dict[int, int] = {}
    for e in range(len(keyed) - 1, -1, -1):
        keys = keyed[e]
        get = last_seen.get
        next_uses[e] = array("q", [get(k, _NEVER) for k in keys])
        usable = min(depth[e], len(keys))
        if usable:
            last_seen.update(dict.fromkeys(keys[:usable], e))
        if usable < len(keys):
            last_seen.update(dict.fromkeys(keys[usable:], _NEVER))
    return next_uses


@dataclass(frozen=True, slots=True)
class BoundShape:
    """What the unit bounds need to know of a cache configuration.

    ``unit_tokens`` = the hit alignment ``A``; ``unit_blocks`` = full-attention blocks one
    unit takes over all full-attention groups; ``fa_block_size`` = the first full-attention
    group's block size (``bound_fa``'s pool holds ``(num_blocks - 1)`` blocks of it).
    """

    num_blocks: int
    unit_tokens: int
    unit_blocks: int
    fa_block_size: int

    @classmethod
    def of(cls, config: CacheConfig) -> BoundShape | None:
        """``None`` for a model without full attention (no chain to bound)."""
        full = [g.spec.block_size for g in config.groups if g.spec.kind == "full_attention"]
        if not full:
            return None
        a = config.alignment_tokens
        return cls(config.num_blocks, a, sum(a // bs for bs in full), full[0])

    @property
    def fa_capacity_units(self) -> int:
        """``bound_fa``'s constant capacity, e.g. dsv4-bench 18,481 blocks → 18,480 units."""
        return (self.num_blocks - 1) * self.fa_block_size // self.unit_tokens

    def hybrid_capacity_units(self, held_blocks: int) -> int:
        """``bound``'s capacity after ``held_blocks`` non-item blocks, e.g. gemma3-bench
        (1 full + 5 window groups, A 16 → u 1), 103,505 blocks, 40,000 held → 63,504."""
        return max(0, (self.num_blocks - 1 - held_blocks) // self.unit_blocks)


def fa_optimum(trace: Trace, log: AdmissionLog, shape: BoundShape) -> HitTotals:
    """``bound_fa``: full-attention blocks only, the whole pool, the log's order."""
    return unit_optimum(trace, log, [shape.fa_capacity_units] * len(log), shape.unit_tokens)


def hybrid_optimum(trace: Trace, log: AdmissionLog, shape: BoundShape) -> HitTotals:
    """``bound``: the capacity left at each admission by the blocks held then that are not
    full-attention prompt KV (``log.held_blocks``). Never above ``fa_optimum``."""
    capacities = [shape.hybrid_capacity_units(h) for h in log.held_blocks]
    return unit_optimum(trace, log, capacities, shape.unit_tokens)
