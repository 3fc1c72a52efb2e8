"""Admission orders: which eligible waiting request the shared scheduler admits next.

The scheduler (``sim/scheduler.py``) owns eligibility (session serialisation, phase
barriers, the look-ahead window) and hands an order its *candidates*: the eligible waiting
requests of the window, in queue (first-come) order. The order picks one; the scheduler
then looks its hit up (or reuses the one the order probed), allocates, and admits it.

Orders (``--admission``):

``fcfs``
    The protocol: the first candidate (trace position). The scheduler keeps its original
    code path for it, so numbers are identical to before admission orders existed.
``hit``
    Longest *usable* hit first: the hit ``KVCacheManager.find_longest_hit`` reports now
    (window tails, checkpoints, bridges all count as the manager counts them; a full
    attention match whose window tail is gone is not a hit). Ties go to the earlier request.
``session``
    Session continuity: the candidate whose session's previous request finished most
    recently (its context is the most likely to still be resident) goes first; requests
    with no finished predecessor follow in first-come order. No lookups at all.
``warm``
    (the recommended cache-aware order) ...

Every order except ``fcfs`` runs under the same starvation guard (``StarvationGuard``);
its bound is stated there.

Probing is cheap: an order keeps each candidate's last probed hit and trusts it until the
candidate reaches the top of the order; only then is it looked up again (the lookup the
admission needs anyway), and if the fresh value no longer beats the runner-up's cached one
the next candidate is verified instead (lazy greedy selection). A candidate is probed when
it first becomes a candidate, when it is verified at the top, and when new cached blocks
may have extended its hit (``RankedOrder``).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING, ClassVar, Protocol

from hybridkv.errors import ConfigError
from hybridkv.native import mypyc_attr

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hybridkv.block import Block
    from hybridkv.cache import PrefixHit
    from hybridkv.ids import BlockHash
    from hybridkv.sched.scheduler import SchedRequest

_Probes = tuple[tuple["Mapping[BlockHash, Block]", "BlockHash"], ...]
_WindowProbes = tuple[tuple["Mapping[BlockHash, Block]", tuple["BlockHash", ...]], ...]
_Growth = tuple[_Probes, _WindowProbes, int]


class Probe(Protocol):
    """What an order may ask the cache about a candidate (the scheduler provides it).

    ``hit`` and ``version`` are required. A probe may also offer the growth checks
    (``growth_probe_parts`` and ``new_hashes``, as the scheduler does from the manager's
    public methods): without them an order looks a cached candidate up again whenever
    anything was cached since its probe."""

    def hit(self, request: SchedRequest) -> PrefixHit:
        """The candidate's usable hit now (``KVCacheManager.find_longest_hit``)."""

    def may_extend(self, request: SchedRequest, num_tokens: int, matched_tokens: int) -> bool:
        """``KVCacheManager.may_extend``: False ⇒ no hit longer than ``num_tokens``."""

    def growth_probe_parts(self, request: SchedRequest, num_tokens: int, matched_tokens: int,
                           ) -> tuple[_Probes, _WindowProbes] | None:
        """``KVCacheManager.growth_probe_parts``: ``may_extend``'s dictionary probes, to
        repeat later without a call (``None``: always true). Optional."""

    def new_hashes(self, marks: Sequence[int] | None,
                   ) -> tuple[list[int], tuple[list[BlockHash], list[BlockHash]] | None]:
        """``KVCacheManager.hashes_indexed_since``: the hashes indexed since ``marks``
        (full attention's, the other groups'), and the marks now. Optional."""

    @property
    def version(self) -> tuple[int, int]:
        """``KVCacheManager.lookup_version`` now."""


@mypyc_attr(allow_interpreted_subclasses=True)  # tests subclass it
class AdmissionOrder(ABC):
    """Chooses the next admission among the candidates (never empty, first-come order)."""

    name: ClassVar[str]

    @abstractmethod
    def choose(self, candidates: Sequence[SchedRequest], probe: Probe,
               ) -> tuple[SchedRequest, PrefixHit | None]:
        """The request to admit and, when the order has it, its current hit (valid:
        nothing mutates the cache between ``choose`` and the admission). ``version`` is the
        manager's ``lookup_version`` now: a hit probed at an equal version is current."""

    def on_finished(self, request: SchedRequest, step: int) -> None:  # noqa: B027
        """A request finished (session orders remember when); nothing by default."""

    def forget(self, request: SchedRequest) -> None:  # noqa: B027
        """The request was admitted: drop per-request state; nothing by default."""


@mypyc_attr(allow_interpreted_subclasses=True)  # tests subclass it
class FirstComeOrder(AdmissionOrder):
    """The first candidate (what the scheduler's fcfs path does, kept for completeness)."""

    name = "fcfs"

    def choose(self, candidates: Sequence[SchedRequest], probe: Probe,
               ) -> tuple[SchedRequest, PrefixHit | None]:
        return candidates[0], None


def _matched_tokens(hit: PrefixHit) -> int:
    """How far full attention matched at the probe: the hit, a longer junction (the window
    tail there was missing) or a bridge's end."""
    return max(hit.num_tokens, hit.junction_tokens, hit.full_attention_tokens)


def _index_of_zero(scores: list[float], start: int) -> int:
    """The first index at or after ``start`` whose score is 0, else -1 (a C-level scan)."""
    try:
        return scores.index(0.0, start)
    except ValueError:
        return -1


class _Positions:
    """Candidate id → index, built only when first asked: a few lookups scan the id list
    (``list.index``, C); many build the dictionary once."""

    __slots__ = ("_asked", "_by_id", "ids")

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self._by_id: dict[str, int] | None = None
        self._asked = 0

    def __getitem__(self, req_id: str) -> int:
        if self._by_id is not None:
            return self._by_id[req_id]
        self._asked += 1
        if self._asked > 8:
            self._by_id = dict(zip(self.ids, range(len(self.ids)), strict=True))
            return self._by_id[req_id]
        return self.ids.index(req_id)


class RankedOrder(AdmissionOrder):
    """An order by a per-candidate score (larger first, ties to the earlier candidate).

    The ranking is kept while the scheduler hands over the same candidate list (it builds
    a new list only when the queue changes), so a step whose admission is refused again
    costs at most one lookup, not a pass over the candidates.

    Probed scores are cached with the manager's ``lookup_version`` (epoch, hashes ever
    indexed) and kept honest both ways:

    - *growth* (a running request cached blocks a candidate can use): when the candidate
      list is rebuilt, a candidate probed before new hashes were indexed is looked up
      again only if ``may_extend`` says the full-attention block right after its cached
      hit is now cached (a few dictionary probes); otherwise its hit cannot have grown;
    - *shrinkage* (evictions): lazy verification: the top candidate is looked up again
      unless nothing changed since its probe; if its fresh score still beats the
      runner-up's cached one it is chosen, else it is re-ranked and the next one verified.
    """

    probes: ClassVar[bool] = False
    """Scores come from hit lookups (verified at the top) rather than scheduler state."""
    live_scores: ClassVar[bool] = False
    """A probing order whose score of a cached hit reads live pool state (``warm``: whether
    the hit's last blocks are free now): recomputed at every ranking, not kept (a hit of
    0 tokens keeps its score: nothing of the pool is read for it)."""

    def __init__(self) -> None:
        self._candidates: Sequence[SchedRequest] | None = None
        self._ranked: list[tuple[float, int]] = []
        """(-score, candidate index) as a heap: the best at index 0."""
        self._cached: dict[str, tuple[tuple[int, int], PrefixHit]] = {}
        """Request id → (lookup version, hit) of its last probe."""
        self._checked: dict[str, int] = {}
        """Request id → hashes ever indexed at its last probe or growth check."""
        self._growth: dict[str, _Growth | None] = {}
        """Request id → ``may_extend``'s probes for its cached hit, split (when the probe
        offers them; ``None``: always true): the full-attention block past the match,
        the window blocks inside it, and the match's length. The check is repeated
        without a call into the manager, the long window part only when a hit up to the
        match could beat the best score."""
        self._watchers: dict[BlockHash, set[str]] = {}
        """Full-attention hash → candidates whose growth check asks for it (when the
        probe lists new hashes: ``new_hashes``): a hash that enters an index marks its
        watchers, so a ranking touches only those (window hashes: ``_window_watch``)."""
        self._window_watch: dict[BlockHash, tuple[str, int]] = {}
        """Window hash → the (request, generation) token that last registered it (the
        window part of the watchers: thousands of hashes per long prompt, registered by
        C-level updates; a token is live while ``_generation`` holds its generation)."""
        self._window_more: dict[BlockHash, list[tuple[str, int]]] = {}
        """Window hash → the other live tokens registered for it before."""
        self._generation: dict[str, int] = {}
        self._window_count: dict[str, int] = {}
        self._window_live = 0
        self._next_generation = 0
        self._grown: tuple[set[str], set[str]] = (set(), set())
        """Candidates a watched hash entered an index for since their probe: through full
        attention (any longer hit possible) / only inside the match (window tails). A
        mark is a hint, not a verdict: the one-by-one check decides (the hash may have
        been evicted again)."""
        self._held: set[str] = set()
        """Candidates whose growth check already held at their probe (``growth_probes``
        ``None``: no full attention; or a probed hash was indexed then — a window group
        with blocks larger than full attention's can hold the block past a match it
        cannot extend yet). The watchers see only hashes indexed *after* a probe, so
        these get the check one by one whenever something was indexed since."""
        self._scores_now: list[float] = []
        """The last ranking's scores (by candidate index): where ``choose`` finds the next
        zero-score candidate."""
        self._zero = -1
        """Index of the zero-score candidate standing in the heap for all of them (-1:
        none)."""
        self._marks: list[int] | None = None
        self._watching = True
        """Whether the probe lists new hashes; else every stale candidate is scanned."""
        self._growth_key: dict[str, tuple[int, int]] = {}
        """Request id → (hit tokens, matched tokens) its growth probes were computed for."""
        self._with_hit: set[str] = set()
        """Candidates whose cached hit has tokens (``live_scores``: rescored per ranking)."""
        self._scores: dict[str, float] = {}
        """Request id → ``score`` of its cached hit (a function of the hit alone)."""
        self._ceilings: dict[str, float] = {}
        """Request id → ``ceiling`` (a function of the prompt alone)."""
        self.num_probes = 0
        self.num_window_checks = 0
        """Growth checks that had to test the window blocks inside a match."""

    @abstractmethod
    def score(self, request: SchedRequest, hit: PrefixHit | None) -> float:
        """Larger is admitted first; ``hit`` is the (cached) usable hit when the order
        probes, else ``None``. A probing order scores a hit of 0 tokens 0 and a longer
        one above 0 (the ranking keeps only one zero-score candidate in its heap)."""

    def ceiling(self, request: SchedRequest) -> float:
        """The largest score any hit could give ``request`` (probing orders)."""
        return float("inf")

    def potential(self, request: SchedRequest, num_tokens: int) -> float:
        """The largest score a hit of at most ``num_tokens`` could give ``request``."""
        return self.ceiling(request)

    def _probe(self, request: SchedRequest, probe: Probe, version: tuple[int, int],
               ) -> PrefixHit:
        hit = probe.hit(request)
        self.num_probes += 1
        req_id = request.req_id
        self._cached[req_id] = (version, hit)
        self._checked[req_id] = version[1]
        self._scores[req_id] = self.score(request, hit)
        if hit.num_tokens:
            self._with_hit.add(req_id)
        else:
            self._with_hit.discard(req_id)
        parts = getattr(probe, "growth_probe_parts", None)  # optional: see ``Probe``
        if parts is not None:
            matched = _matched_tokens(hit)
            key = (hit.num_tokens, matched)
            if self._growth_key.get(req_id) == key:
                # the same probes as at the last registration (a re-probe at the top that
                # found the same hit): watchers, marks and ``_held`` stay as they were
                # (the watchers' guarantee holds from that registration; the marked path
                # asks whether anything was indexed since this probe)
                return hit
            self._growth_key[req_id] = key
            split = parts(request, hit.num_tokens, matched)
            growth: _Growth | None = None if split is None else (split[0], split[1], matched)
            self._unwatch(req_id)
            self._growth[req_id] = growth
            if growth is None:
                self._held.add(req_id)
            else:
                full, window, _ = growth
                if any(block_hash in index for index, block_hash in full) or any(
                        not index.keys().isdisjoint(hashes) for index, hashes in window):
                    self._held.add(req_id)  # checked one by one: not watched
                elif self._watching:
                    watchers = self._watchers
                    for _, block_hash in full:
                        watching = watchers.get(block_hash)
                        if watching is None:
                            watchers[block_hash] = {req_id}
                        else:
                            watching.add(req_id)
                    if window:
                        self._watch_window(req_id, window)
        return hit

    def _watch_window(self, req_id: str, window: _WindowProbes) -> None:
        """Register ``req_id`` as a watcher of its window probes: C-level dictionary
        updates with a (request, generation) token; unwatching only retires the
        generation (stale tokens are skipped, and dropped when the table is rebuilt)."""
        generation = self._next_generation
        self._next_generation += 1
        self._generation[req_id] = generation
        token = (req_id, generation)
        watch, generations = self._window_watch, self._generation
        count = 0
        for _, hashes in window:
            for block_hash in watch.keys() & hashes:  # another live watcher: keep both
                other = watch[block_hash]
                if other[0] != req_id and generations.get(other[0]) == other[1]:
                    self._window_more.setdefault(block_hash, []).append(other)
            watch.update(zip(hashes, repeat(token)))
            count += len(hashes)
        self._window_count[req_id] = count
        self._window_live += count
        if len(watch) > 2 * self._window_live + 4096:
            self._rebuild_window_watch()

    def _rebuild_window_watch(self) -> None:
        """Drop the retired tokens: the table from the live registrations only."""
        self._window_watch.clear()
        self._window_more.clear()
        generations = self._generation
        live = list(generations.items())
        generations.clear()
        self._window_live = 0
        for req_id, _ in live:
            growth = self._growth.get(req_id)
            if growth is None:
                continue
            self._watch_window(req_id, growth[1])

    def _unwatch(self, req_id: str) -> None:
        growth = self._growth.get(req_id)
        self._held.discard(req_id)
        if not self._watching:
            return
        for grown in self._grown:
            grown.discard(req_id)
        if self._generation.pop(req_id, None) is not None:  # its window tokens retire
            self._window_live -= self._window_count.pop(req_id, 0)
        if growth is None:
            return
        watchers = self._watchers
        for _, block_hash in growth[0]:
            watching = watchers.get(block_hash)
            if watching is not None:
                watching.discard(req_id)
                if not watching:
                    del watchers[block_hash]

    def _note_new_hashes(self, probe: Probe, indexed: int) -> bool:
        """Mark the watchers of hashes indexed since the last ranking; False when the
        probe cannot list them (then stale candidates are checked one by one). When it
        cannot list them this time (a first call, an index shrunk other than by
        eviction), every cached candidate with something indexed since its last check
        is marked: no hash indexed meanwhile is missed."""
        if not self._watching:
            return False
        new_hashes = getattr(probe, "new_hashes", None)  # optional: see ``Probe``
        if new_hashes is None:
            self._watching = False
            self._watchers.clear()
            for grown in self._grown:
                grown.clear()
            self._window_watch.clear()
            self._window_more.clear()
            self._generation.clear()
            return False
        self._marks, hashes = new_hashes(self._marks)
        if hashes is None:
            checked = self._checked
            self._grown[0].update(r for r in self._cached if checked.get(r) != indexed)
            return True
        watchers, (full_grown, window_grown) = self._watchers, self._grown
        for block_hash in hashes[0]:
            watching = watchers.get(block_hash)
            if watching is not None:
                full_grown.update(watching)
        watch, more, generations = self._window_watch, self._window_more, self._generation
        for block_hash in hashes[1]:
            token = watch.get(block_hash)
            if token is not None and generations.get(token[0]) == token[1]:
                window_grown.add(token[0])
            for token in more.get(block_hash, ()):
                if generations.get(token[0]) == token[1]:
                    window_grown.add(token[0])
        return True

    def _may_grow(self, request: SchedRequest, hit: PrefixHit, probe: Probe, best: float,
                  ) -> bool | None:
        """Whether the cached hit may have grown (``may_extend``) into a score above
        ``best``; ``None``: undecided because only a hit up to the match (window tails
        inside it) could have grown and that cannot beat ``best`` now — asked again at
        the next ranking. (The check one by one, when the probe lists no new hashes.)"""
        req_id = request.req_id
        if req_id not in self._growth:
            return probe.may_extend(request, hit.num_tokens, _matched_tokens(hit))
        growth = self._growth[req_id]
        if growth is None:
            return True
        full, window, matched = growth
        if any(block_hash in index for index, block_hash in full):
            return True  # full attention reaches past the match: any longer hit possible
        if not window:
            return False
        if self.potential(request, matched) <= best:
            return None
        self.num_window_checks += 1
        return any(not index.keys().isdisjoint(hashes) for index, hashes in window)

    def _rank(self, candidates: Sequence[SchedRequest], probe: Probe,
              version: tuple[int, int]) -> list[tuple[float, int]]:
        """(-score, index) of every candidate as a heap (best first). New candidates are probed; a
        cached one is probed again only if blocks were cached since, ``may_extend`` says
        they can lengthen its hit, and its prompt is long enough that a longer hit could
        beat the best score already known.

        Incremental: scores and ceilings are kept per candidate from its last probe, and
        growth is found by watching: each probe registers the hashes its growth check
        asks for, each ranking lists the hashes indexed since the last one (the probe's
        ``new_hashes``) and marks their watchers, so a ranking looks only at marked
        candidates — not at every probe of every candidate (thousands per candidate on
        100k-token prompts whose window tail was evicted). A probe that cannot list new
        hashes gets the check one by one (``_may_grow``)."""
        if not self.probes:
            ranked = [(-self.score(r, None), i) for i, r in enumerate(candidates)]
            heapq.heapify(ranked)
            return ranked
        scores_of, checked = self._scores, self._checked
        indexed = version[1]
        listed = self._note_new_hashes(probe, indexed)
        # one Python-level pass over the (up to ``lookahead_requests``) candidates; the
        # rest runs in C (map, zip, set intersections) or touches only the few new / hit /
        # held / marked ones
        ids = [r.req_id for r in candidates]
        position = _Positions(ids)
        known = list(map(scores_of.get, ids))
        if None in known:
            for index, score in enumerate(known):  # new ones: probed (checked now)
                if score is None:
                    self._probe(candidates[index], probe, version)
        scores: list[float] = list(map(scores_of.__getitem__, ids))
        # stale: something indexed since the last check; with watchers, only those whose
        # growth check held at their probe are checked one by one
        if not listed:
            stale = [index for index, req_id in enumerate(ids) if checked[req_id] != indexed]
        elif self._held:
            stale = sorted(position[req_id] for req_id in self._held.intersection(ids)
                           if checked[req_id] != indexed)
        else:
            stale = []
        if self.live_scores and self._with_hit:  # hits with tokens: rescored on the pool
            cached, rescore = self._cached, self.score
            for req_id in self._with_hit.intersection(ids):
                index = position[req_id]
                scores[index] = rescore(candidates[index], cached[req_id][1])
        best = max(scores)  # before any growth probe, as the check one by one has it
        if listed:
            self._regrow_marked(candidates, position, probe, version, scores, best)
        if stale:
            self._regrow_stale(candidates, probe, version, scores, stale, best)
        # The heap holds every candidate with a positive score (a hit: ``_with_hit``) and
        # the first one scoring 0; the other zeros (most candidates, usually) are only
        # implied, in index order behind it: ``choose`` pushes the next one when the
        # representative leaves 0. Scores of probing orders are never negative.
        ranked = [(-scores[index], index)
                  for index in map(position.__getitem__, self._with_hit.intersection(ids))]
        self._scores_now = scores
        self._zero = _index_of_zero(scores, 0)
        if self._zero >= 0:
            ranked.append((-0.0, self._zero))
        heapq.heapify(ranked)
        return ranked

    def _ceiling_of(self, request: SchedRequest) -> float:
        ceiling = self._ceilings.get(request.req_id)
        if ceiling is None:
            ceiling = self._ceilings[request.req_id] = self.ceiling(request)
        return ceiling

    def _regrow_marked(self, candidates: Sequence[SchedRequest], position: _Positions,
                       probe: Probe, version: tuple[int, int], scores: list[float],
                       best: float) -> None:
        """The check one by one for the marked candidates (a watched hash entered an
        index since their probe): probe again those whose hit may have grown above
        ``best`` (``scores`` updated in place). Undecided ones stay marked for the next
        ranking; a check that finds nothing (the hash was evicted again) unmarks.

        Same decisions as checking every candidate with something indexed since its last
        check (``_regrow_stale``): a growth check that did not hold at the probe holds
        now only if one of its hashes was indexed after the probe, which marks it (held
        ones are in ``_held``, checked one by one)."""
        full_grown, window_grown = self._grown
        if not (full_grown or window_grown):
            return
        checked, indexed, held = self._checked, version[1], self._held
        for req_id in [*full_grown.intersection(position.ids),
                       *window_grown.intersection(position.ids)]:
            if req_id in held or req_id not in self._cached:
                continue
            index = position[req_id]
            if checked[req_id] == indexed:
                continue  # nothing indexed since its last probe or check: stays marked
            request = candidates[index]
            if self._ceiling_of(request) <= best:
                continue  # stays marked: looked at again at the next ranking
            grows = self._may_grow(request, self._cached[req_id][1], probe, best)
            if grows is None:
                continue  # stays marked
            checked[req_id] = indexed
            if grows:
                self._probe(request, probe, version)  # clears its marks
                scores[index] = self._scores[req_id]
            else:
                full_grown.discard(req_id)
                window_grown.discard(req_id)

    def _regrow_stale(self, candidates: Sequence[SchedRequest], probe: Probe,
                      version: tuple[int, int], scores: list[float], stale: list[int],
                      best: float) -> None:
        """The check one by one (a probe without ``new_hashes``, or a candidate whose
        growth check held at its probe): probe again the stale candidates whose hit may
        have grown above ``best``."""
        checked, indexed = self._checked, version[1]
        for index in stale:
            request = candidates[index]
            req_id = request.req_id
            if self._ceiling_of(request) <= best:
                continue
            grows = self._may_grow(request, self._cached[req_id][1], probe, best)
            if grows is None:
                continue  # not marked checked: asked again at the next ranking
            checked[req_id] = indexed  # no re-check until more is indexed
            if grows:
                self._probe(request, probe, version)
                scores[index] = self._scores[req_id]  # fresh: live or not, the same now

    def choose(self, candidates: Sequence[SchedRequest], probe: Probe,
               ) -> tuple[SchedRequest, PrefixHit | None]:
        version = probe.version
        if candidates is not self._candidates:
            self._candidates = candidates
            self._ranked = self._rank(candidates, probe, version)
        ranked = self._ranked
        if not self.probes:
            return candidates[ranked[0][1]], None
        while True:  # ``ranked`` is a heap: the best at 0, the runner-up a child of it
            index = ranked[0][1]
            request = candidates[index]
            probed_at, hit = self._cached[request.req_id]
            if probed_at == version:  # exact now: it beats every cached runner-up
                return request, hit
            hit = self._probe(request, probe, version)
            entry = (-self._scores[request.req_id], index)
            if index == self._zero and entry[0]:  # the zeros' representative grew
                self._zero = _index_of_zero(self._scores_now, index + 1)
                if self._zero >= 0:
                    heapq.heappush(ranked, (-0.0, self._zero))  # below the top: a heap
            if len(ranked) == 1 or entry <= min(ranked[1:3]):
                ranked[0] = entry  # still at most both children: a heap
                return request, hit
            heapq.heapreplace(ranked, entry)

    def forget(self, request: SchedRequest) -> None:
        req_id = request.req_id
        self._unwatch(req_id)
        self._cached.pop(req_id, None)
        self._checked.pop(req_id, None)
        self._growth.pop(req_id, None)
        self._scores.pop(req_id, None)
        self._ceilings.pop(req_id, None)
        self._with_hit.discard(req_id)
        self._growth_key.pop(req_id, None)


class LongestHitOrder(RankedOrder):
    """Longest usable hit first.

    >>> from types import SimpleNamespace as NS
    >>> hits = {"a": 0, "b": 512, "c": 256}
    >>> probe = NS(hit=lambda r: NS(num_tokens=hits[r.req_id]), version=(1, 0))
    >>> order = LongestHitOrder()
    >>> reqs = [NS(req_id=k) for k in "abc"]
    >>> order.choose(reqs, probe)[0].req_id
    'b'
    >>> hits["b"] = 0  # evicted, but the lookup version did not move: not looked at again
    >>> order.choose(reqs, probe)[0].req_id
    'b'
    >>> probe.version = (2, 0)  # an allocation: "b" verified, demoted; "c" verified, wins
    >>> order.choose(reqs, probe)[0].req_id
    'c'
    >>> order.num_probes  # a, b, c once each, then b and c again
    5
    """

    name = "hit"
    probes = True

    def score(self, request: SchedRequest, hit: PrefixHit | None) -> float:
        return float(hit.num_tokens) if hit is not None else 0.0

    def ceiling(self, request: SchedRequest) -> float:
        return float(len(request.prompt_token_ids) - 1)

    def potential(self, request: SchedRequest, num_tokens: int) -> float:
        return float(num_tokens)


class AtRiskHitOrder(LongestHitOrder):
    """Longest usable hit *that would otherwise be lost* first, then longest hit.

    A hit whose blocks a running request holds cannot be evicted while it runs: that
    candidate loses nothing by waiting. A hit on free (cached, unreferenced) blocks is
    at risk: the next allocations may evict it. So candidates whose hit ends on a free
    block (in any group: a usable hit needs every group) rank first, by hit length; then
    the others, by hit length. The check (``PrefixHit.ends_on_free_block``) reads only the
    last block of each group's hit table (a chain is freed and evicted tail first).

    >>> from types import SimpleNamespace as NS
    >>> order = AtRiskHitOrder()
    >>> r = NS(prompt_token_ids=range(1000))
    >>> safe = order.score(r, NS(num_tokens=512, ends_on_free_block=False))
    >>> risky = order.score(r, NS(num_tokens=256, ends_on_free_block=True))
    >>> risky > safe > order.score(r, NS(num_tokens=256, ends_on_free_block=False))
    True
    """

    name = "warm"
    live_scores = True

    RISK_WEIGHT = float(1 << 32)
    """Lexicographic weight: any at-risk hit outranks every held one (tokens < 2^32)."""

    def score(self, request: SchedRequest, hit: PrefixHit | None) -> float:
        if hit is None or not hit.num_tokens:
            return 0.0
        return (self.RISK_WEIGHT + 1.0) * hit.num_tokens if hit.ends_on_free_block else \
            float(hit.num_tokens)

    def ceiling(self, request: SchedRequest) -> float:
        return (self.RISK_WEIGHT + 1.0) * (len(request.prompt_token_ids) - 1)

    def potential(self, request: SchedRequest, num_tokens: int) -> float:
        return (self.RISK_WEIGHT + 1.0) * num_tokens


class SessionOrder(RankedOrder):
    """Session continuity: the most recently finished session's next request first.

    >>> from types import SimpleNamespace as NS
    >>> order = SessionOrder()
    >>> a, b, c = (NS(req_id=k, session_id=k) for k in "abc")
    >>> order.on_finished(NS(session_id="c"), 7)
    >>> order.on_finished(NS(session_id="b"), 9)
    >>> order.choose([a, b, c], NS(version=(0, 0)))[0].req_id
    'b'
    """

    name = "session"

    def __init__(self) -> None:
        super().__init__()
        self._finished_step: dict[str, int] = {}

    def score(self, request: SchedRequest, hit: PrefixHit | None) -> float:
        session = request.session_id
        return float("-inf") if session is None else \
            float(self._finished_step.get(session, -1))

    def on_finished(self, request: SchedRequest, step: int) -> None:
        if request.session_id is not None:
            self._finished_step[request.session_id] = step


class StarvationGuard:
    """Bounded overtaking: a count of admissions, extended for cheap ones by prefill work.

    Each admission adds, to every candidate ahead of the admitted one in first-come order,
    one to ``num_overtaken`` and the admitted request's new (computed, non-hit) tokens to
    ``overtaken_tokens``. A candidate is *due* once it has been passed ``free_admissions``
    times *and* the passes computed ``max_prefill_tokens`` new tokens in total, or once it
    has been passed ``max_admissions`` times; a due candidate is admitted before the order
    is asked again (the first-come due one first; a refusal of its allocation ends the
    step's admissions, as under ``fcfs``).

    Why work as well as a count: what delays a waiting request is the prefill its
    overtakers compute, and the cache-aware orders overtake with *hits* — an admission
    whose prompt is mostly cached computes a few tokens, a cold one its whole prompt. A
    count alone charges both alike, so it cuts hit-driven reordering hardest exactly where
    reordering costs the passed request least (a tuned count moved hit rates by 23 points
    either way in the prototype); work alone lets one long cold prompt exhaust the budget.
    So any ``free_admissions`` passes are allowed (one turnover of the running set, the
    session-1 guard), and passing beyond that continues only while all passes together
    stay under one turnover's prefill budget.

    The bound (the scheduler uses ``free_admissions = max_running``, ``max_prefill_tokens =
    max_running * chunk_size`` — the prefill budget of ``max_running`` steps — and
    ``max_admissions = lookahead_requests``): while a request is eligible in the window,
    the later requests admitted before it are at most ``max_admissions``, and either at
    most ``free_admissions`` or they computed fewer than ``max_prefill_tokens`` new tokens
    before the last of them (so at most that minus one plus one request's prompt). It is
    admitted no later than first-come order would admit it, delayed by at most that many
    admissions / that much prefill of later requests (``fcfs``: none).

    >>> from types import SimpleNamespace
    >>> guard = StarvationGuard(free_admissions=2, max_prefill_tokens=100, max_admissions=4)
    >>> a, b = (SimpleNamespace(req_id=k, num_overtaken=0, overtaken_tokens=0) for k in "ab")
    >>> guard.on_admitted([a, b], b, 150)  # one long pass: 150 tokens, but only 1 pass
    >>> guard.due([a]) is None
    True
    >>> guard.on_admitted([a], SimpleNamespace(), 1)  # a 2nd pass: 2 passes, 151 tokens
    >>> (a.num_overtaken, a.overtaken_tokens, guard.due([a]) is a)
    (2, 151, True)
    """

    def __init__(self, *, free_admissions: int, max_prefill_tokens: int,
                 max_admissions: int) -> None:
        if min(free_admissions, max_prefill_tokens, max_admissions) <= 0:
            raise ConfigError("starvation guard",
                              (free_admissions, max_prefill_tokens, max_admissions),
                              "needs positive admission counts and a token budget")
        self.free_admissions = free_admissions
        self.max_prefill_tokens = max_prefill_tokens
        self.max_admissions = max(max_admissions, free_admissions)
        self._due_for: Sequence[SchedRequest] | None = None
        self._due: SchedRequest | None = None
        self._waiting_due: set[str] = set()
        """Ids of the waiting requests that are due (none: ``due`` scans nothing)."""

    def is_due(self, request: SchedRequest) -> bool:
        passes = request.num_overtaken
        return passes >= self.max_admissions or (
            passes >= self.free_admissions
            and request.overtaken_tokens >= self.max_prefill_tokens)

    def due(self, candidates: Sequence[SchedRequest]) -> SchedRequest | None:
        """The first due candidate (cached per candidate list: counts change only by
        admissions, which make a new list; no scan while no waiting request is due)."""
        if candidates is not self._due_for:
            self._due_for = candidates
            self._due = None if not self._waiting_due else next(
                (r for r in candidates if self.is_due(r)), None)
        return self._due

    def on_requeued(self, request: SchedRequest) -> None:
        """``request`` (admitted before) is waiting again (preempted): due again if its
        counts say so."""
        if self.is_due(request):
            self._waiting_due.add(request.req_id)

    def on_admitted(self, candidates: Sequence[SchedRequest], admitted: object,
                    new_tokens: int) -> None:
        """``admitted`` (computing ``new_tokens`` prompt tokens) passed the candidates
        ahead of it."""
        waiting_due = self._waiting_due
        admitted_id = getattr(admitted, "req_id", None)
        if waiting_due and isinstance(admitted_id, str):
            waiting_due.discard(admitted_id)
        for request in candidates:
            if request is admitted:
                return
            request.num_overtaken += 1
            request.overtaken_tokens += new_tokens
            if self.is_due(request):
                waiting_due.add(request.req_id)


ORDERS: dict[str, type[AdmissionOrder]] = {
    FirstComeOrder.name: FirstComeOrder,
    LongestHitOrder.name: LongestHitOrder,
    SessionOrder.name: SessionOrder,
    AtRiskHitOrder.name: AtRiskHitOrder,
}


def parse_admissions(text: str) -> list[str]:
    """``--admission``: a comma-separated list of order names, or ``all``.

    >>> parse_admissions("fcfs, hit"), parse_admissions("all") == list(ORDERS)
    (['fcfs', 'hit'], True)
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError("--admission", text, f"name an order: {', '.join(ORDERS)}, or all")
    expanded: list[str] = []
    for name in names:
        if name == "all":
            expanded.extend(ORDERS)
        elif name in ORDERS:
            expanded.append(name)
        else:
            raise ConfigError("--admission", name,
                              f"choose from {', '.join(ORDERS)}, or all (comma-separated)")
    return list(dict.fromkeys(expanded))


def make_admission_order(name: str) -> AdmissionOrder:
    """An order by name (``--admission``)."""
    order = ORDERS.get(name)
    if order is None:
        raise ConfigError("--admission", name, f"choose one of {', '.join(ORDERS)}")
    return order()
