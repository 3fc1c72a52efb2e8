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
it first becomes a candidate, when it is verified at the top, and never otherwise.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from hybridkv.errors import ConfigError

if TYPE_CHECKING:
    from hybridkv.cache import PrefixHit
    from hybridkv.sim.scheduler import SchedRequest

ProbeFn = Callable[["SchedRequest"], "PrefixHit"]
"""Looks a candidate's usable hit up now (registering it with the manager if needed)."""


class AdmissionOrder(ABC):
    """Chooses the next admission among the candidates (never empty, first-come order)."""

    name: ClassVar[str]

    @abstractmethod
    def choose(self, candidates: Sequence[SchedRequest], probe: ProbeFn, step: int,
               ) -> tuple[SchedRequest, PrefixHit | None]:
        """The request to admit and, when the order looked it up in this call, its fresh
        hit (valid: nothing mutates the cache between ``choose`` and the admission)."""

    def on_finished(self, request: SchedRequest, step: int) -> None:
        """A request finished (session orders remember when)."""

    def forget(self, request: SchedRequest) -> None:
        """The request was admitted: drop per-request state."""


class FirstComeOrder(AdmissionOrder):
    """The first candidate (what the scheduler's fcfs path does, kept for completeness)."""

    name = "fcfs"

    def choose(self, candidates: Sequence[SchedRequest], probe: ProbeFn, step: int,
               ) -> tuple[SchedRequest, PrefixHit | None]:
        return candidates[0], None


class RankedOrder(AdmissionOrder):
    """An order by a per-candidate score (larger first, ties to the earlier candidate).

    The ranking is kept while the scheduler hands over the same candidate list (it builds
    a new list only when the queue changes), so a step whose admission is refused again
    costs one verification, not a pass over the candidates. Probed scores are verified
    lazily: the top candidate is looked up afresh; if its fresh score still beats the
    runner-up's cached one it is chosen, else it is re-ranked and the next one verified.
    """

    probes: ClassVar[bool] = False
    """Scores come from hit lookups (verified at the top) rather than scheduler state."""

    def __init__(self) -> None:
        self._candidates: Sequence[SchedRequest] | None = None
        self._ranked: list[tuple[float, int]] = []
        """(-score, candidate index), ascending: best first."""
        self._cached_hit: dict[str, int] = {}
        self.num_probes = 0

    @abstractmethod
    def score(self, request: SchedRequest, hit_tokens: int) -> float:
        """Larger is admitted first; ``hit_tokens`` is the (cached) usable hit when the
        order probes, else 0."""

    def _hit(self, request: SchedRequest, probe: ProbeFn) -> int:
        value = self._cached_hit.get(request.req_id)
        if value is None:
            value = self._cached_hit[request.req_id] = probe(request).num_tokens
            self.num_probes += 1
        return value

    def choose(self, candidates: Sequence[SchedRequest], probe: ProbeFn, step: int,
               ) -> tuple[SchedRequest, PrefixHit | None]:
        if candidates is not self._candidates:
            self._candidates = candidates
            self._ranked = sorted(
                (-self.score(r, self._hit(r, probe) if self.probes else 0), i)
                for i, r in enumerate(candidates))
        ranked = self._ranked
        if not self.probes:
            return candidates[ranked[0][1]], None
        verified: dict[int, PrefixHit] = {}
        while True:
            index = ranked[0][1]
            request = candidates[index]
            hit = verified.get(index)
            if hit is not None:  # fresh already (nothing mutated since): it wins
                return request, hit
            hit = verified[index] = probe(request)
            self.num_probes += 1
            self._cached_hit[request.req_id] = hit.num_tokens
            entry = (-self.score(request, hit.num_tokens), index)
            if len(ranked) == 1 or entry <= ranked[1]:
                ranked[0] = entry
                return request, hit
            del ranked[0]
            bisect.insort(ranked, entry)

    def forget(self, request: SchedRequest) -> None:
        self._cached_hit.pop(request.req_id, None)


class LongestHitOrder(RankedOrder):
    """Longest usable hit first.

    >>> from types import SimpleNamespace
    >>> hits = {"a": 0, "b": 512, "c": 256}
    >>> order = LongestHitOrder()
    >>> probe = lambda r: SimpleNamespace(num_tokens=hits[r.req_id])
    >>> reqs = [SimpleNamespace(req_id=k) for k in "abc"]
    >>> order.choose(reqs, probe, 1)[0].req_id
    'b'
    >>> hits["b"] = 0  # evicted: the cached 512 is verified, demoted, and "c" wins
    >>> order.choose(reqs, probe, 2)[0].req_id
    'c'
    """

    name = "hit"
    probes = True

    def score(self, request: SchedRequest, hit_tokens: int) -> float:
        return float(hit_tokens)


class SessionOrder(RankedOrder):
    """Session continuity: the most recently finished session's next request first.

    >>> from types import SimpleNamespace
    >>> order = SessionOrder()
    >>> a, b, c = (SimpleNamespace(req_id=k, session_id=k) for k in "abc")
    >>> order.on_finished(SimpleNamespace(session_id="c"), 7)
    >>> order.on_finished(SimpleNamespace(session_id="b"), 9)
    >>> order.choose([a, b, c], None, 10)[0].req_id  # type: ignore[arg-type]
    'b'
    """

    name = "session"

    def __init__(self) -> None:
        super().__init__()
        self._finished_step: dict[str, int] = {}

    def score(self, request: SchedRequest, hit_tokens: int) -> float:
        session = request.session_id
        return float("-inf") if session is None else \
            float(self._finished_step.get(session, -1))

    def on_finished(self, request: SchedRequest, step: int) -> None:
        if request.session_id is not None:
            self._finished_step[request.session_id] = step


class StarvationGuard:
    """Bounded overtaking of the oldest candidate.

    ``mode`` "head": only the first candidate's count matters ... (experiment)
    """

    def __init__(self, bound: int, mode: str = "head") -> None:
        self.bound = bound
        self.mode = mode
        self._due_for: Sequence[SchedRequest] | None = None
        self._due: SchedRequest | None = None

    def due(self, candidates: Sequence[SchedRequest]) -> SchedRequest | None:
        if self.mode == "head":
            head = candidates[0]
            return head if head.num_overtaken >= self.bound else None
        if candidates is not self._due_for:
            self._due_for = candidates
            self._due = next((r for r in candidates if r.num_overtaken >= self.bound), None)
        return self._due

    def on_admitted(self, candidates: Sequence[SchedRequest], admitted: SchedRequest) -> None:
        if self.mode == "head":
            if candidates[0] is not admitted:
                candidates[0].num_overtaken += 1
            return
        for request in candidates:
            if request is admitted:
                return
            request.num_overtaken += 1


ORDERS: dict[str, type[AdmissionOrder]] = {
    FirstComeOrder.name: FirstComeOrder,
    LongestHitOrder.name: LongestHitOrder,
    SessionOrder.name: SessionOrder,
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
