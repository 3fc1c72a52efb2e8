"""One bound computation per distinct admission log: ``BoundKeys`` and the per-process memo.

``bound`` and ``bound_fa`` (``hybridkv.sim.bound``) are functions of exactly four inputs:
the admission log (request order, first admission or not, held blocks, held units, release
events, growths), the prompts the log admits (what ``unit_keys`` hashes: length, token /
range / block-id representation, predetermined outputs, the request's index), the pool size
and the model's full-attention groups (``BoundShape``). Policies that admit the same
requests at the same steps with the same held blocks therefore share their bounds — on
WEKA the four retentions that hash every window block (``dense``, ``reachable``,
``prepend``, ``pin:32768``) log identically, so ``--policy core`` needs three bound passes,
not six.

``BoundKeys.of`` digests those inputs (BLAKE2b, 160 bits); equal keys mean equal inputs up
to a digest collision. ``shared_bounds`` memoizes per process by that key; ``hybridkv
replay --jobs`` and ``hybridkv sweep`` (forked processes or Ray) start one bound task per
distinct key in the parent (``BoundBroker``).

>>> from hybridkv.sim.bound import AdmissionLog
>>> from hybridkv.traces.trace import Trace, TraceRequest
>>> trace = Trace("t", tuple(TraceRequest(f"r{i}", 9, 1, block_ids=(b,), trace_block_size=8)
...                          for i, b in enumerate([1, 2, 1])))
>>> shape = BoundShape(num_blocks=3, unit_tokens=4, unit_blocks=1, fa_block_size=4)
>>> log = AdmissionLog.in_trace_order(trace)
>>> BoundKeys.of(trace, log, shape) == BoundKeys.of(trace, AdmissionLog.in_trace_order(trace),
...                                                 shape)
True
>>> other = AdmissionLog.in_trace_order(trace); other.held_blocks[1] = 1   # one held block
>>> BoundKeys.of(trace, log, shape) == BoundKeys.of(trace, other, shape)
False
>>> shared_bounds(trace, log, shape)   # (bound, bound_fa) hit tokens
(8, 8)
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from hybridkv.sim.bound import AdmissionLog, BoundShape, both_optima
from hybridkv.traces.trace import Trace, TraceRequest

if TYPE_CHECKING:
    from hybridkv.sim.replay import RunResult

BoundPair = tuple[int, int]
"""(``bound`` hit tokens, ``bound_fa`` hit tokens) of one log."""

MEMO_ENTRIES = 4096
"""Bound pairs a process keeps (oldest dropped first); each is two integers."""

TRACE_DIGESTS = 8
"""Traces whose per-request digests a process keeps (least recently used dropped)."""

_LOG_FIELDS = ("request_indices", "reads", "held_blocks", "held_units", "release",
               "growth_events", "growth_admissions", "growth_units")
"""Every ``AdmissionLog`` array: the bounds read all of them."""


@dataclass(frozen=True, slots=True)
class BoundKeys:
    """Digest of what ``both_optima`` reads: the pool shape, every log array, and each
    admitted request's prompt (see the module docstring)."""

    digest: str

    @classmethod
    def of(cls, trace: Trace, log: AdmissionLog, shape: BoundShape) -> BoundKeys:
        digest = hashlib.blake2b(digest_size=20)
        digest.update(repr((shape.num_blocks, shape.unit_tokens, shape.unit_blocks,
                            shape.fa_block_size)).encode())
        for name in _LOG_FIELDS:
            values: array[int] = getattr(log, name)
            digest.update(name.encode() + b"\0" + values.typecode.encode()
                          + len(values).to_bytes(8, "little") + values.tobytes())
        prompts = _prompt_digests(trace)
        for index in dict.fromkeys(log.request_indices):
            digest.update(prompts[index])
        return cls(digest.hexdigest())


_TRACES: OrderedDict[int, tuple[Trace, list[bytes]]] = OrderedDict()
"""``id(trace)`` → (the trace, kept alive so the id stays its own; per-request digests)."""


def _prompt_digests(trace: Trace) -> list[bytes]:
    """Per request of ``trace``, a digest of what the bounds read of it (memoized)."""
    entry = _TRACES.get(id(trace))
    if entry is not None and entry[0] is trace:
        _TRACES.move_to_end(id(trace))
        return entry[1]
    digests = [request_digest(r, i) for i, r in enumerate(trace.requests)]
    _TRACES[id(trace)] = (trace, digests)
    while len(_TRACES) > TRACE_DIGESTS:
        _TRACES.popitem(last=False)
    return digests


def request_digest(request: TraceRequest, index: int) -> bytes:
    """Digest of the fields ``unit_keys`` reads: index, prompt length, the prompt's
    representation (token ids, id ranges, or block ids and their size) and predetermined
    outputs. Request ids, sessions, arrival times and tags do not enter the bounds.

    >>> a = TraceRequest("a", 9, 1, block_ids=(1, 2), trace_block_size=8)
    >>> request_digest(a, 0) == request_digest(TraceRequest("b", 9, 1, block_ids=(1, 2),
    ...                                                     trace_block_size=8), 0)
    True
    >>> request_digest(a, 0) == request_digest(a, 1)   # fill tokens depend on the index
    False
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((index, request.input_length, request.trace_block_size,
                        request.token_ids is None, request.output_token_ids is None,
                        request.token_id_ranges)).encode())
    for ids in (request.block_ids, request.token_ids or (), request.output_token_ids or ()):
        digest.update(len(ids).to_bytes(8, "little") + _int_bytes(ids))
    return digest.digest()


def _int_bytes(values: Sequence[int]) -> bytes:
    try:
        return array("Q", values).tobytes()
    except OverflowError:  # ids outside [0, 2**64): their text
        return repr(tuple(values)).encode()


_MEMO: OrderedDict[BoundKeys, BoundPair] = OrderedDict()


def shared_bounds(trace: Trace, log: AdmissionLog, shape: BoundShape,
                  keys: BoundKeys | None = None) -> BoundPair:
    """``(bound, bound_fa)`` hit tokens of ``log``, computed once per process per
    ``BoundKeys`` (``keys`` when the caller has them already)."""
    keys = keys or BoundKeys.of(trace, log, shape)
    pair = _MEMO.get(keys)
    if pair is None:
        hybrid, fa = both_optima(trace, log, shape)
        pair = (hybrid.hit_tokens, fa.hit_tokens)
        _MEMO[keys] = pair
        while len(_MEMO) > MEMO_ENTRIES:
            _MEMO.popitem(last=False)
    else:
        _MEMO.move_to_end(keys)
    return pair


def clear_memo() -> None:
    """Forget every memoized bound and trace digest (tests)."""
    _MEMO.clear()
    _TRACES.clear()


W = TypeVar("W")


@dataclass(slots=True)
class BoundBroker(Generic[W]):
    """The parent's view of the bound tasks of a parallel run: which keys are known,
    which are being computed, and who waits for each.

    >>> broker: BoundBroker[str] = BoundBroker()
    >>> k = BoundKeys("k")
    >>> broker.wait(k, "dense"), broker.wait(k, "prepend")   # start one task, not two
    (True, False)
    >>> broker.resolve(k, (8, 9))
    ['dense', 'prepend']
    >>> broker.known[k], broker.wait(k, "pin")   # known now: nothing to start, no waiting
    ((8, 9), False)
    """

    known: dict[BoundKeys, BoundPair] = field(default_factory=dict)
    waiting: dict[BoundKeys, list[W]] = field(default_factory=dict)

    def wait(self, keys: BoundKeys, waiter: W) -> bool:
        """Register ``waiter`` for ``keys`` (unless known); True when a task for ``keys``
        must start now (the first waiter of an unknown key)."""
        if keys in self.known:
            return False
        waiters = self.waiting.setdefault(keys, [])
        waiters.append(waiter)
        return len(waiters) == 1

    def resolve(self, keys: BoundKeys, pair: BoundPair) -> list[W]:
        """Record ``pair`` for ``keys``; the waiters it completes."""
        self.known[keys] = pair
        return self.waiting.pop(keys, [])

    def place(self: BoundBroker[tuple[int, str]], owner: int,
              results: Mapping[str, RunResult], keys: Mapping[str, BoundKeys]) -> list[str]:
        """Replay ``owner``'s scenarios (``results``, their logs' ``keys``): each gets its
        bounds now where its key is known, else waits for it as ``(owner, scenario)``;
        returns the scenarios whose bound task must start now (first of their key)."""
        started: list[str] = []
        for scenario, scenario_keys in keys.items():
            pair = self.known.get(scenario_keys)
            if pair is not None:
                set_bounds(results[scenario], pair)
            elif self.wait(scenario_keys, (owner, scenario)):
                started.append(scenario)
        return started


def set_bounds(result: RunResult, pair: BoundPair) -> None:
    """Store a ``(bound, bound_fa)`` hit-token pair in ``result`` and drop its log."""
    result.bound_hit_tokens, result.bound_fa_hit_tokens = pair
    result.log = None


__all__ = ["BoundBroker", "BoundKeys", "BoundPair", "clear_memo", "request_digest",
           "set_bounds", "shared_bounds"]
