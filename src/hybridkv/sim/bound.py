"""Offline optima: the hybrid-aware ``bound`` and the full-attention-only ``bound_fa``.

Both are Belady MIN over *hit units* (``A``-token pieces of chained full-attention KV, ``A`` =
the hit alignment) for the admission order a replay used (``AdmissionLog``); the argument why
each is an upper bound is in ``docs/bounds.md``:

- ``bound_fa`` (``unit_optimum`` with a constant capacity): the pool as if every non-null
  block held full-attention KV of one group: ``(num_blocks - 1) * bs / A`` units.
- ``bound`` (``hybrid_optimum``): at each admission ``e`` the capacity is what is left after
  the blocks held then that are *not* full-attention item KV —
  ``floor((num_blocks - 1 - held[e]) / u)`` units, ``u`` = full-attention blocks per unit
  summed over the full-attention groups. ``held[e]`` (recorded by the replay right after the
  allocation) counts running requests' window / chunked / other non-full blocks — the
  admitted request's own window tail (its hit point's state) included — and their
  full-attention blocks past their items' last whole unit (decode, partial blocks).
  Which held blocks are cache items is each group manager's hook
  (``GroupManager.bound_item_blocks``): a new group kind is charged automatically. The
  units a running request holds are *pinned* while it holds them: they count against the
  capacity and cannot be evicted (no online policy can evict them either).

A request's units enter the cache when the replay sees it holding them (``AdmissionLog``:
its admission, then the first admission after each later prefill chunk or decode block);
a first admission reads the units a hit can use (``(n - 1) // A`` of an ``n``-token
prompt). Re-admissions after preemption read nothing; the next "use" of a unit whose next
occurrence recomputes (or re-holds) it is never.

>>> from hybridkv.traces.trace import Trace, TraceRequest
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

>>> from hybridkv.traces.trace import Trace, TraceRequest
>>> reqs = tuple(TraceRequest(f"r{i}", 8, 1, block_ids=(ids,), trace_block_size=8)
...              for i, ids in enumerate([1, 2, 1, 2, 1]))
>>> offline_optimum(Trace("t", reqs), capacity_tokens=4, block_size=4, alignment_tokens=4)
HitTotals(prompt_tokens=40, hit_tokens=8)
>>> lru_full_attention(Trace("t", reqs), capacity_tokens=4, block_size=4, alignment_tokens=4)
HitTotals(prompt_tokens=40, hit_tokens=0)
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat

import xxhash

from hybridkv.config import CacheConfig
from hybridkv.hashing import encode_token_ids
from hybridkv.sim.ceiling import HitTotals, chain_key
from hybridkv.traces.trace import Trace, TraceRequest, common_prefix_length, expand_prompt

_NEVER = 1 << 62
_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15
_EMPTY = array("q")


def _keyed_by_block_ids(request: TraceRequest) -> bool:
    return request.token_ids is None and bool(request.trace_block_size) \
        and not request.token_id_ranges


def block_keys(request: TraceRequest, index: int, block_size: int) -> array[int]:
    """Chained keys of the prompt's full ``block_size``-token blocks (equal key ⇔ equal
    prefix, up to 64-bit collisions). Block-id traces are keyed from their ids without
    expanding tokens."""
    num_blocks = request.input_length // block_size
    if _keyed_by_block_ids(request):
        return _keys_from_block_ids(request, index, block_size, num_blocks).keys
    return _chained_keys(expand_prompt(request, index), num_blocks, block_size)


def _chained_keys(tokens: Sequence[int], num_units: int, unit_tokens: int) -> array[int]:
    """Keys of the first ``num_units`` ``unit_tokens``-token units of ``tokens``: unit
    ``i``'s key is the xxh3-64 of its encoded tokens seeded with unit ``i - 1``'s key (0
    for the first), so equal keys mean equal prefixes.

    >>> a, b = _chained_keys([1, 2, 3, 4, 5], 2, 2), _chained_keys([1, 2, 9, 4], 2, 2)
    >>> len(a), a[0] == b[0], a[1] == b[1]
    (2, True, False)
    """
    encoded = encode_token_ids(tokens[: num_units * unit_tokens])
    width = 8 * unit_tokens
    keys = array("Q")
    key = 0
    for i in range(num_units):
        key = int(xxhash.xxh3_64_intdigest(encoded[i * width : (i + 1) * width], seed=key))
        keys.append(key)
    return keys


@dataclass(frozen=True, slots=True)
class _ChainedKeys:
    """A block-id request's keys and what the next prompt of its session can reuse: its
    trace block ids, their chained keys, and how many of its keys come from them."""

    block_ids: Sequence[int]
    chain: list[int]
    keys: array[int]
    num_covered: int
    trace_block_size: int
    block_size: int


def _keys_from_block_ids(request: TraceRequest, index: int, block_size: int,
                         num_blocks: int, previous: _ChainedKeys | None = None) -> _ChainedKeys:
    """Engine block ``i`` ends at token ``end = (i + 1) * block_size`` inside trace block
    ``(end - 1) // size``; its key mixes that trace block's chained key with ``end``
    (e.g. WEKA's 64-token trace blocks hold four 16-token blocks: ends 16, 32, 48, 64).

    With ``previous`` (the session's latest prompt), the chain of the trace blocks the two
    share from the start and the keys inside them are copied instead of rehashed: a
    conversation's next turn resends the whole history (WEKA: ~1,800 trace blocks per
    prompt, nearly all shared with the previous turn)."""
    size = request.trace_block_size
    ids = request.block_ids
    num_covered = min(num_blocks, len(ids) * size // block_size)
    first = reused = 0
    if previous is not None and previous.trace_block_size == size \
            and previous.block_size == block_size:
        first = common_prefix_length(previous.block_ids, ids)
        # key i reads chain[((i + 1) * block_size - 1) // size]: shared while i < this
        reused = min(previous.num_covered, num_covered, first * size // block_size)
    chain = previous.chain[:first] if first and previous is not None else []
    key = chain[-1] if chain else 0
    for block_id in ids[first:]:
        key = chain_key(key, block_id)
        chain.append(key)
    keys = previous.keys[:reused] if reused and previous is not None else array("Q")
    keys.extend([(chain[((i + 1) * block_size - 1) // size] ^ ((i + 1) * _GOLDEN)) & _MASK
                 for i in range(reused, num_covered)])
    unique = chain_key(1 << 63, index)  # fill tokens past the trace blocks: request-unique
    keys.extend(chain_key(unique, (i + 1) * block_size) for i in range(num_covered, num_blocks))
    return _ChainedKeys(ids, chain, keys, num_covered, size, block_size)


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
        result[i] = array("q", map(get, keys, repeat(_NEVER)))
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
    """The admissions of one replay, in order (first admissions and re-admissions), and
    when each admission's units were held.

    ``request_indices[e]``: trace index of the request admitted at event ``e``;
    ``reads[e]``: 1 on its first admission (the hit the report counts), 0 on a re-admission
    after preemption; ``held_blocks[e]``: blocks held right after that allocation that are not
    full-attention item KV (the charge of ``hybrid_optimum``); ``held_units[e]``: how many of
    the request's units (a prefix) it holds right after that allocation (``-1``: all its
    units, not held — the trace-order model); ``release[e]``: the last event whose check
    sees that admission still holding its units (``e - 1``: never held); ``growth_*``: at
    event ``growth_events[i]`` (before its lookup) admission ``growth_admissions[i]`` is
    seen holding ``growth_units[i]`` units, more than before (later prefill chunks,
    decode of predetermined outputs; at release, the final count).
    """

    request_indices: array[int] = field(default_factory=lambda: array("q"))
    reads: array[int] = field(default_factory=lambda: array("b"))
    held_blocks: array[int] = field(default_factory=lambda: array("q"))
    held_units: array[int] = field(default_factory=lambda: array("q"))
    release: array[int] = field(default_factory=lambda: array("q"))
    growth_events: array[int] = field(default_factory=lambda: array("q"))
    growth_admissions: array[int] = field(default_factory=lambda: array("q"))
    growth_units: array[int] = field(default_factory=lambda: array("q"))

    def append(self, request_index: int, is_first: bool, held_blocks: int,
               held_units: int = -1) -> int:
        """Log an admission; returns its event index. Until ``release_at``, it is held
        to the end (``_NEVER``); trace-order entries (``held_units`` -1) are never held."""
        event = len(self.request_indices)
        self.request_indices.append(request_index)
        self.reads.append(1 if is_first else 0)
        self.held_blocks.append(held_blocks)
        self.held_units.append(held_units)
        self.release.append(event - 1 if held_units < 0 else _NEVER)
        return event

    def grow(self, event: int, admission: int, units: int) -> None:
        """Admission ``admission`` holds ``units`` units from event ``event`` on."""
        self.growth_events.append(event)
        self.growth_admissions.append(admission)
        self.growth_units.append(units)

    def release_at(self, admission: int, last_event: int) -> None:
        """Admission ``admission`` released its blocks after event ``last_event``."""
        self.release[admission] = last_event

    def __len__(self) -> int:
        return len(self.request_indices)

    @classmethod
    def in_trace_order(cls, trace: Trace) -> AdmissionLog:
        """Every request admitted once, in trace order, inserting all its units at its
        admission, nothing held (FCFS without preemption, chunking or session reordering)."""
        log = cls()
        for i in range(len(trace.requests)):
            log.append(i, True, 0)
        return log


def unit_keys(request: TraceRequest, index: int, unit_tokens: int) -> array[int]:
    """Chained keys of every whole ``unit_tokens`` unit a request computes: its prompt, and
    its outputs when the trace predetermines them (a later prompt may resend them)."""
    if not request.output_token_ids:
        return block_keys(request, index, unit_tokens)
    tokens = expand_prompt(request, index) + list(request.output_token_ids)
    return _chained_keys(tokens, len(tokens) // unit_tokens, unit_tokens)


def unit_keys_by_index(trace: Trace, indices: Iterable[int],
                       unit_tokens: int) -> dict[int, array[int]]:
    """``unit_keys`` of the requests at ``indices`` (in that order), a block-id request
    reusing the keys its session's previous prompt shares with it from the start.

    >>> from hybridkv.traces.trace import TraceRequest
    >>> reqs = (TraceRequest("a", 64, 1, block_ids=(1, 2), trace_block_size=32, session_id="s"),
    ...         TraceRequest("b", 96, 1, block_ids=(1, 2, 3), trace_block_size=32,
    ...                      session_id="s"))
    >>> keys = unit_keys_by_index(Trace("t", reqs), [0, 1], 16)
    >>> [len(keys[0]), len(keys[1])], keys[1][:4] == keys[0]
    ([4, 6], True)
    >>> keys[1] == unit_keys(reqs[1], 1, 16)   # the same keys as without reuse
    True
    """
    requests = trace.requests
    latest: dict[str, _ChainedKeys] = {}
    keys_of: dict[int, array[int]] = {}
    for index in indices:
        request = requests[index]
        if request.output_token_ids or not _keyed_by_block_ids(request):
            keys_of[index] = unit_keys(request, index, unit_tokens)
            continue
        session = request.session_id
        chained = _keys_from_block_ids(request, index, unit_tokens,
                                       request.input_length // unit_tokens,
                                       None if session is None else latest.get(session))
        if session is not None:
            latest[session] = chained
        keys_of[index] = chained.keys
    return keys_of


_INSERT, _READ = 0, 1


@dataclass(slots=True)
class _Op:
    """One occurrence of a range of a request's units at an event: a read (first
    admission's usable units; ``uses`` covers only ``[update_from, hi)``, the keys no
    insert of the same event follows) or an insert (units held from now; ``pin`` = the last
    event they are held, below ``event`` when not held; ``update_from``: its units before
    it were read just before, at the same event)."""

    event: int
    kind: int
    keys: array[int]
    lo: int
    hi: int
    pin: int
    update_from: int = 0
    uses: array[int] = field(default_factory=lambda: _EMPTY)
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    """``_runs_all(uses)``, computed once for every cache walking the op."""


def _unit_ops(trace: Trace, log: AdmissionLog, unit_tokens: int) -> list[_Op]:
    """The log as ordered occurrences: per event, the inserts of units other admissions
    were seen holding since the previous event, then the admission's read, then its own
    insert.

    >>> from hybridkv.traces.trace import TraceRequest
    >>> reqs = (TraceRequest("r0", 33, 1, block_ids=(1, 2), trace_block_size=16),)
    >>> log = AdmissionLog()
    >>> log.append(0, True, 0, held_units=1)  # the first chunk holds unit 0 of 2
    0
    >>> log.append(0, False, 0, held_units=0)  # a re-admission (reads nothing)
    1
    >>> log.grow(1, 0, 2); log.release_at(0, 1)
    >>> [(o.event, o.kind, o.lo, o.hi, o.pin) for o in _unit_ops(Trace("t", reqs), log, 16)]
    [(0, 1, 0, 2, 1), (0, 0, 0, 1, 1), (1, 0, 1, 2, 1), (1, 0, 0, 0, 4611686018427387904)]
    >>> [op.update_from for op in _unit_ops(Trace("t", reqs), log, 16)]
    [1, 1, 0, 0]
    """
    requests = trace.requests
    keys_of = unit_keys_by_index(trace, dict.fromkeys(log.request_indices), unit_tokens)
    held: dict[int, int] = {}
    ops: list[_Op] = []
    g = 0
    num_growths = len(log.growth_events)
    for e, index in enumerate(log.request_indices):
        while g < num_growths and log.growth_events[g] <= e:
            a = log.growth_admissions[g]
            keys = keys_of[log.request_indices[a]]
            lo, hi = held.get(a, 0), min(len(keys), log.growth_units[g])
            if hi > lo:
                ops.append(_Op(e, _INSERT, keys, lo, hi, log.release[a]))
                held[a] = hi
            g += 1
        keys = keys_of[index]
        own = len(keys) if log.held_units[e] < 0 else min(len(keys), log.held_units[e])
        held[e] = own
        usable = 0
        if log.reads[e]:
            usable = min((requests[index].input_length - 1) // unit_tokens, len(keys))
            if usable:
                ops.append(_Op(e, _READ, keys, 0, usable, log.release[e], min(own, usable)))
        ops.append(_Op(e, _INSERT, keys, 0, own, log.release[e], min(own, usable)))
    return ops


def _attach_next_reads(ops: Sequence[_Op]) -> None:
    """Per op and unit: the next event that *reads* the same key, or never when its next
    occurrence is an insert (recomputed, or held, there: keeping it until then is
    worthless) or there is none.

    >>> k = array("Q", [1, 2])
    >>> ops = [_Op(0, _INSERT, k, 0, 2, -1), _Op(1, _READ, k, 0, 2, 0, 1),
    ...        _Op(1, _INSERT, k, 0, 1, -1, 1)]
    >>> _attach_next_reads(ops)
    >>> [list(o.uses) for o in ops]
    [[1, 1], [4611686018427387904], [4611686018427387904]]
    """
    last_seen: dict[int, int] = {}
    for op in reversed(ops):
        keys = op.keys[op.lo : op.hi]
        get = last_seen.get
        if op.kind == _INSERT:
            op.uses = array("q", map(get, keys, repeat(_NEVER)))
            if op.update_from:  # the read just before overwrites these: skip the NEVERs
                keys = op.keys[op.lo + op.update_from : op.hi]
            last_seen.update(dict.fromkeys(keys, _NEVER))
        else:
            op.uses = array("q", map(get, op.keys[op.update_from : op.hi], repeat(_NEVER)))
            last_seen.update(dict.fromkeys(keys, op.event))
        op.runs = _runs_all(op.uses)


def _runs_all(uses: array[int]) -> list[tuple[int, int, int]]:
    """Like ``_runs`` but keeping never-used runs. E.g. ``[5, NEVER]`` → ``(0, 1, 5),
    (1, 2, NEVER)``. One C-level count when every use is equal (most occurrences: a
    prompt's units all reread by the next turn, or all re-inserted by its own chunks).

    >>> _runs_all(array("q", [5, 5, 7])), _runs_all(array("q", [3, 3]))
    ([(0, 2, 5), (2, 3, 7)], [(0, 2, 3)])
    """
    n = len(uses)
    if n == 0:
        return []
    if uses.count(uses[0]) == n:
        return [(0, n, uses[0])]
    runs = []
    start = 0
    for depth in [d for d in range(1, n) if uses[d] != uses[d - 1]] + [n]:
        runs.append((start, depth, uses[start]))
        start = depth
    return runs


def unit_optimum(trace: Trace, log: AdmissionLog, capacity_units: Sequence[int],
                 unit_tokens: int, *, pin_held: bool = False) -> HitTotals:
    """Belady MIN hit tokens over the admissions of ``log``, with at most
    ``capacity_units[e]`` units cached right after admission ``e``.

    Occurrences (``_unit_ops``): a request's units enter the cache when it is seen holding
    them (at its admission, then at the first event after each later allocation); a first
    admission reads its usable units (``(n - 1) // unit_tokens`` of an ``n``-token prompt;
    each one cached is a hit of ``unit_tokens`` tokens, counted whether or not an earlier
    one missed). The cache keeps, up to the capacity, the units whose next *read* comes
    soonest (deeper first among equal ones). A unit whose next occurrence is an insert is
    recomputed there for free, so its next use is never. With ``pin_held``, a unit is
    pinned while an admission holding it runs (``log.release``): it counts against the
    capacity and is not evicted (``hybrid_optimum``). Runs of equal next use share one heap
    entry (as in ``offline_optimum``); a run whose deepest unit is pinned waits until that
    unit's release (every holder holds a prefix, so the shallower units are pinned at
    least as long).
    """
    cache = _UnitCache(pin_held)
    prompt_tokens = _walk(trace, log, unit_tokens, [(cache, capacity_units)])
    return HitTotals(prompt_tokens, cache.hit_units * unit_tokens)


def _walk(trace: Trace, log: AdmissionLog, unit_tokens: int,
          caches: Sequence[tuple[_UnitCache, Sequence[int]]]) -> int:
    """Feed the log's occurrences to every (cache, capacities) in lockstep — one pass
    over the occurrences and their next reads, however many bounds walk them; returns
    the prompt tokens of the first admissions."""
    requests = trace.requests
    ops = _unit_ops(trace, log, unit_tokens)
    _attach_next_reads(ops)
    num_ops = len(ops)
    i = 0
    for e in range(len(log)):
        while i < num_ops and ops[i].event == e:
            op = ops[i]
            ops[i] = _OP_DONE  # the runs keep what is still needed
            i += 1
            for cache, _ in caches:
                if op.kind == _READ:
                    cache.read(op, e)
                else:
                    cache.insert(op, e)
        for cache, capacity_units in caches:
            cache.release(e)
            if e % 1024 == 1023:
                cache.drop_stale(e)
            cache.evict(e, max(0, capacity_units[e]))
    return sum(requests[i].input_length
               for i, r in zip(log.request_indices, log.reads, strict=True) if r)


class _UnitCache:
    """The Belady cache of ``unit_optimum``: ``cached`` key → next read (pinned units
    included), a heap of runs by farthest next read (deeper first), ``pinned`` key → last
    event held (max over holders), and the runs whose deepest unit was held when chosen,
    by the event they may go (``waiting``)."""

    def __init__(self, pin_held: bool) -> None:
        self.pin_held = pin_held
        self.cached: dict[int, int] = {}
        self.pinned: dict[int, int] = {}
        self.heap: list[tuple[int, int, int]] = []
        self.runs: dict[int, tuple[array[int], int, int]] = {}
        self.waiting: dict[int, list[tuple[int, array[int], int, int]]] = {}
        self.next_run = 0
        self.hit_units = 0

    def push(self, keys: array[int], start: int, end: int, use: int) -> None:
        self.runs[self.next_run] = (keys, start, end)
        heapq.heappush(self.heap, (-use, 1 - end, self.next_run))
        self.next_run += 1

    def _drop_never(self, keys: array[int], start: int, end: int,
                    present: Sequence[int] | None, e: int) -> None:
        """Units ``keys[start:end]`` (only the ``present`` ones when given: the cached
        ones) whose next use is never: gone now unless some admission holds them; the held
        ones stay, each its own run (in depth order). The deletes go in one C-level pass
        (e.g. a prompt read whose units its own later chunks re-insert: ~6,000 per WEKA
        prompt)."""
        cached, pinned = self.cached, self.pinned
        ks: Sequence[int] = keys[start:end]
        if present is not None:
            ks = list(compress(ks, present))
        if pinned:
            untils = list(map(pinned.get, ks, repeat(-1)))
            if untils and max(untils) >= e:
                depths = range(start, end) if present is None else \
                    list(compress(range(start, end), present))
                for depth, key, until in zip(depths, ks, untils, strict=True):
                    if until >= e:
                        cached[key] = _NEVER
                        self.push(keys, depth, depth + 1, _NEVER)
                ks = [k for k, until in zip(ks, untils, strict=True) if until < e]
        deque(map(cached.__delitem__, ks), maxlen=0)

    def read(self, op: _Op, e: int) -> None:
        cached = self.cached
        if not cached:
            return
        keys, lo, first = op.keys, op.lo, op.update_from
        present = list(map(cached.__contains__, keys[lo : op.hi]))
        self.hit_units += sum(present)
        # op.runs: of the uses of depths first.. (hits no insert of this event follows)
        for start, end, use in op.runs:
            flags = present[first + start - lo : first + end - lo]
            if use == _NEVER:
                self._drop_never(keys, first + start, first + end, flags, e)
                continue
            for depth in compress(range(first + start, first + end), flags):
                cached[keys[depth]] = use
                self.push(keys, depth, depth + 1, use)

    def insert(self, op: _Op, e: int) -> None:
        keys, lo, uses = op.keys, op.lo, op.uses
        ks = keys[lo : op.hi]
        self.cached.update(zip(ks, uses, strict=True))
        if self.pin_held and op.pin >= e:
            pin, pinned = op.pin, self.pinned
            olds = list(map(pinned.get, ks, repeat(-1)))
            if olds and max(olds) > pin:
                pinned.update((k, max(old, pin)) for k, old in zip(ks, olds, strict=True))
            else:
                pinned.update(dict.fromkeys(ks, pin))
            for start, end, use in op.runs:
                self.push(keys, lo + start, lo + end, use)
            return
        for start, end, use in op.runs:
            if use == _NEVER:  # its held units' runs may go before later runs: other uses
                self._drop_never(keys, lo + start, lo + end, None, e)
            else:
                self.push(keys, lo + start, lo + end, use)

    def release(self, e: int) -> None:
        """Runs that waited for a release at ``e - 1`` compete again."""
        for neg_use, keys, start, end in self.waiting.pop(e, ()):
            self.push(keys, start, end, -neg_use)

    def drop_stale(self, e: int) -> None:
        """Runs whose next use has passed were re-read: all stale; so are past pins."""
        self.heap = [entry for entry in self.heap if -entry[0] > e]
        heapq.heapify(self.heap)
        self.runs = {entry[2]: self.runs[entry[2]] for entry in self.heap}
        self.pinned = {k: t for k, t in self.pinned.items() if t >= e}

    def evict(self, e: int, capacity: int) -> None:
        cached, pinned, heap, runs = self.cached, self.pinned, self.heap, self.runs
        while len(cached) > capacity and heap:
            neg_use, _, run_id = heapq.heappop(heap)
            keys, start, end = runs.pop(run_id)
            use = -neg_use
            while end > start and len(cached) > capacity:  # the run's units tie: go on
                key = keys[end - 1]
                if cached.get(key) == use:
                    until = pinned.get(key, -1)
                    if until >= e:  # held: wait for the release
                        self.waiting.setdefault(until + 1, []).append(
                            (neg_use, keys, start, end))
                        break
                    del cached[key]
                end -= 1
            else:
                if end > start:
                    runs[run_id] = (keys, start, end)
                    heapq.heappush(heap, (neg_use, 1 - end, run_id))


_OP_DONE = _Op(-1, _INSERT, _EMPTY, 0, 0, -1)


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
        full = [g.spec.block_size for g in config.groups  # compressed attention counts too
                if g.spec.is_full_attention]
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
    """``bound_fa``: full-attention blocks only, the whole pool, the log's order, nothing
    pinned."""
    return unit_optimum(trace, log, [shape.fa_capacity_units] * len(log), shape.unit_tokens)


def both_optima(trace: Trace, log: AdmissionLog,
                shape: BoundShape) -> tuple[HitTotals, HitTotals]:
    """``(hybrid_optimum, fa_optimum)`` in one lockstep pass: the two walk the same
    occurrences (one ``_unit_ops`` and one next-read pass instead of two; the key
    hashing and next-read pass were about half of each bound's time on WEKA).

    >>> from hybridkv.traces.trace import TraceRequest
    >>> reqs = tuple(TraceRequest(f"r{i}", 9, 1, block_ids=(ids,), trace_block_size=8)
    ...              for i, ids in enumerate([1, 2, 1]))
    >>> log = AdmissionLog.in_trace_order(Trace("t", reqs))
    >>> shape = BoundShape(num_blocks=3, unit_tokens=4, unit_blocks=1, fa_block_size=4)
    >>> both_optima(Trace("t", reqs), log, shape)   # 2 units: r2 rereads both of r0's
    (HitTotals(prompt_tokens=27, hit_tokens=8), HitTotals(prompt_tokens=27, hit_tokens=8))
    """
    hybrid, fa = _UnitCache(pin_held=True), _UnitCache(pin_held=False)
    capacities = [shape.hybrid_capacity_units(h) for h in log.held_blocks]
    prompt_tokens = _walk(trace, log, shape.unit_tokens,
                          [(hybrid, capacities), (fa, [shape.fa_capacity_units] * len(log))])
    return (HitTotals(prompt_tokens, hybrid.hit_units * shape.unit_tokens),
            HitTotals(prompt_tokens, fa.hit_units * shape.unit_tokens))


def hybrid_optimum(trace: Trace, log: AdmissionLog, shape: BoundShape) -> HitTotals:
    """``bound``: the capacity left at each admission by the blocks held then that are not
    full-attention item KV (``log.held_blocks``), and the units running requests hold
    pinned while they hold them. Never above ``fa_optimum``."""
    capacities = [shape.hybrid_capacity_units(h) for h in log.held_blocks]
    return unit_optimum(trace, log, capacities, shape.unit_tokens, pin_held=True)
