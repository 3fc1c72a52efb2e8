"""Closed-loop scheduler shared by the replay simulator and the reference engine.

One step (``schedule``), per ``docs/replay-protocol.md``:

1. Running requests, in admission order, ask for ``min(num_tokens - num_computed, budget)``
   slots (prefill chunk or one decode token). When the pool cannot provide them the most
   recently admitted running request is preempted (blocks freed, progress reset, back to the
   head of the waiting queue) and the allocation retried; a requester that is itself the
   most recent is preempted.
2. If nothing was preempted: admissions among the first ``lookahead_requests`` waiting
   requests whose session and phase allow it (the *candidates*), while budget remains and
   fewer than ``max_running`` run: the admission order picks one (``fcfs``, the protocol
   and the default: the first; see ``sim/admission.py`` for the cache-aware orders and
   their starvation guard), then look up the prefix hit, allocate
   ``min(num_tokens - hit, budget)`` slots behind the admission gate; a refusal ends
   admissions for the step.
3. The caller executes the returned chunks in order and calls ``update`` with one sampled
   token per chunk that completed its request's known tokens.

Waiting cost: a request is *eligible* from the first step at which the protocol would let
it be admitted if pool and budget allowed (its phase is open, it is the first unadmitted
request of its session and no request of its session runs), look-ahead window aside;
``eligible_step`` and ``admitted_step`` (first admission) are recorded for every request
under every order, so ``admitted_step - eligible_step`` is the steps it waited.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.block import Block
from hybridkv.cache import Allocation, PrefixHit
from hybridkv.errors import ConfigError, RequestError
from hybridkv.ids import BlockHash
from hybridkv.sched.admission import AdmissionOrder, StarvationGuard, make_admission_order


@dataclass(slots=True)
class SchedRequest:
    """A request as the scheduler sees it.

    ``phase`` is a barrier: a request of phase k is admitted only after every request of a
    lower phase has finished. ``session_id`` serialises requests of one session.
    """

    req_id: str
    prompt_token_ids: Sequence[int]
    max_output_tokens: int
    session_id: str | None = None
    phase: int = 0
    tag: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    hash_prompt: Callable[[Sequence[int]], Sequence[BlockHash] | None] | None = None
    """Optional: the prompt's block hashes computed by the caller with the manager's hasher
    (a replayer memoising shared prefixes); ``None`` lets the manager hash."""
    num_admissions: int = 0
    first_hit_tokens: int | None = None
    eligible_step: int | None = None
    """First step at which it was eligible (see the module docstring)."""
    admitted_step: int | None = None
    """Step of its first admission."""
    num_overtaken: int = 0
    """Admissions of later candidates while it was a candidate (the starvation guard
    caps it; always 0 under ``fcfs``)."""
    overtaken_tokens: int = 0
    """New (non-hit) prompt tokens of those admissions: the prefill work put ahead of it
    (the starvation guard's work budget; always 0 under ``fcfs``)."""


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute positions ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.

    ``num_hit_tokens > 0`` only on an admission step (positions below it come from the
    cache). ``samples`` is true when the chunk reaches the request's last known token: the
    caller then samples one token for it.
    """

    req_id: str
    num_computed_tokens: int
    num_new_tokens: int
    num_hit_tokens: int
    samples: bool


@dataclass(frozen=True, slots=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]
    admitted: tuple[str, ...]


class SchedulableManager(Protocol):
    """What the scheduler calls on its cache manager: ``KVCacheManager`` (or an adapter
    over another engine's manager, e.g. ``bench/vllm_adapter.py``). A protocol rather than
    the class, so that the compiled scheduler accepts any object with these methods."""

    def new_step(self) -> None: ...
    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], *,
                    session_id: str | None = None,
                    block_hashes: Sequence[BlockHash] | None = None) -> None: ...
    def find_longest_hit(self, req_id: str) -> PrefixHit: ...
    def may_extend(self, req_id: str, num_tokens: int, matched_tokens: int = 0) -> bool: ...
    @property
    def lookup_version(self) -> tuple[int, int]: ...
    def num_tokens(self, req_id: str) -> int: ...
    def num_computed_tokens(self, req_id: str) -> int: ...
    def align_prefill_chunk(self, req_id: str, num_new_tokens: int,
                            hit: PrefixHit | None = None, *,
                            max_chunk_tokens: int | None = None) -> int: ...
    def allocate_slots(self, req_id: str, num_new_tokens: int, hit: PrefixHit | None = None,
                       *, reserve_full_prompt: bool = False) -> Allocation | None: ...
    def append_token_ids(self, req_id: str, token_ids: Sequence[int]) -> None: ...
    def free(self, req_id: str) -> None: ...
    def remove_request(self, req_id: str) -> None: ...


class Scheduler:
    """Scheduler with chunked prefill, decode, preemption of the newest request, and an
    admission order (``admission``: a name from ``sim.admission.ORDERS`` or an
    ``AdmissionOrder``; default ``fcfs``)."""

    def __init__(self, manager: SchedulableManager, *, max_running: int = 16,
                 chunk_size: int = 8192, reserve_full_prompt: bool = True,
                 lookahead_requests: int = 256,
                 admission: str | AdmissionOrder = "fcfs") -> None:
        if max_running <= 0:
            raise ConfigError("max_running", max_running, "must be a positive request count")
        if chunk_size <= 0:
            raise ConfigError("chunk_size", chunk_size, "must be a positive token count")
        self.admission = make_admission_order(admission) if isinstance(admission, str) \
            else admission
        self._is_fcfs = self.admission.name == "fcfs"
        self.guard = StarvationGuard(free_admissions=max_running,
                                     max_prefill_tokens=max_running * chunk_size,
                                     max_admissions=max(1, lookahead_requests))
        self.manager = manager
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.reserve_full_prompt = reserve_full_prompt
        self.lookahead_requests = lookahead_requests
        self.waiting: deque[SchedRequest] = deque()
        self.running: list[SchedRequest] = []
        self.requests: dict[str, SchedRequest] = {}
        self.num_preemptions = 0
        self.last_refused: SchedRequest | None = None
        """The request whose admission this step refused (the pool could not take it)."""
        self.num_steps = 0
        self._active_session: dict[str, str] = {}
        self._unfinished_by_phase: dict[int, int] = {}
        self._registered: set[str] = set()
        self._unadmitted: dict[str, deque[SchedRequest]] = {}
        """Per session, its never-admitted requests in queue order."""
        self._to_check: list[SchedRequest] = []
        """Requests that may have become eligible (checked at the next step's start)."""
        self._queue_version = 0
        self._candidates: list[SchedRequest] = []
        self._candidates_version = -1
        self.seconds = 0.0
        """CPU time (``time.process_time``: machine load does not inflate it) inside
        ``schedule`` and ``update``, manager calls included, request registration (prompt
        hashing) excluded: the manager + scheduler cost of an admission order."""
        self._registration_seconds = 0.0

    def add_request(self, request: SchedRequest) -> None:
        """Queue a request (registered with the cache manager when first admitted)."""
        if request.req_id in self.requests:
            raise RequestError(f"request_id={request.req_id!r} was already added")
        if request.max_output_tokens <= 0:
            raise ConfigError("max_output_tokens", request.max_output_tokens,
                              "must be >= 1 (a request samples at least one token)")
        self.requests[request.req_id] = request
        self.waiting.append(request)
        self._unfinished_by_phase[request.phase] = (
            self._unfinished_by_phase.get(request.phase, 0) + 1)
        if request.session_id is not None:
            self._unadmitted.setdefault(request.session_id, deque()).append(request)
        self._to_check.append(request)
        self._queue_version += 1

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ step
    def schedule(self) -> StepPlan:
        """Plan one step: allocations for running requests, then admissions."""
        started = time.process_time()
        registration = self._registration_seconds
        try:
            return self._schedule()
        finally:
            self.seconds += time.process_time() - started - (
                self._registration_seconds - registration)

    def _schedule(self) -> StepPlan:
        self.num_steps += 1
        self.last_refused = None
        if self._to_check:
            self._stamp_eligible()
        self.manager.new_step()
        budget = self.chunk_size
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            chunk = self._schedule_running(request, budget, preempted)
            if chunk is None:
                break  # the requester itself was preempted (it was the newest)
            if chunk.num_new_tokens:  # 0: no checkpoint-aligned chunk fits this step
                chunks.append(chunk)
                budget -= chunk.num_new_tokens
            idx += 1
        admitted: list[str] = []
        if not preempted:
            while budget > 0 and len(self.running) < self.max_running:
                chunk = self._admit_next(budget)
                if chunk is None:
                    break
                chunks.append(chunk)
                admitted.append(chunk.req_id)
                budget -= chunk.num_new_tokens
        return StepPlan(tuple(chunks), tuple(preempted), tuple(admitted))

    def _schedule_running(self, request: SchedRequest, budget: int, preempted: list[str],
                          ) -> ScheduledChunk | None:
        manager = self.manager
        req_id = request.req_id
        num_computed = manager.num_computed_tokens(req_id)
        num_new = manager.align_prefill_chunk(
            req_id, min(manager.num_tokens(req_id) - num_computed, budget),
            max_chunk_tokens=self.chunk_size)
        if num_new == 0:
            return ScheduledChunk(req_id, num_computed, 0, 0, False)
        while True:
            allocation = manager.allocate_slots(req_id, num_new)
            if allocation is not None:
                break
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.req_id)
            if victim is request:
                return None
        return ScheduledChunk(req_id, num_computed, num_new, 0,
                              num_computed + num_new == manager.num_tokens(req_id))

    def _preempt(self, request: SchedRequest) -> None:
        self.manager.free(request.req_id)
        self.waiting.appendleft(request)
        self.guard.on_requeued(request)
        self.num_preemptions += 1
        self._queue_version += 1

    def _register(self, request: SchedRequest) -> None:
        req_id = request.req_id
        if req_id not in self._registered:
            started = time.process_time()
            prompt = request.prompt_token_ids
            hashes = None if request.hash_prompt is None else request.hash_prompt(prompt)
            self.manager.add_request(req_id, prompt, session_id=request.session_id,
                                     block_hashes=hashes)
            self._registered.add(req_id)
            self._registration_seconds += time.process_time() - started

    # The ``admission.Probe`` an order asks about candidates (the manager's public lookup).
    def hit(self, request: SchedRequest) -> PrefixHit:
        self._register(request)
        return self.manager.find_longest_hit(request.req_id)

    def may_extend(self, request: SchedRequest, num_tokens: int, matched_tokens: int) -> bool:
        return self.manager.may_extend(request.req_id, num_tokens, matched_tokens)

    def growth_probe_parts(self, request: SchedRequest, num_tokens: int, matched_tokens: int,
                           ) -> tuple[tuple[tuple[Mapping[BlockHash, Block], BlockHash], ...],
                                      tuple[tuple[Mapping[BlockHash, Block],
                                                  tuple[BlockHash, ...]], ...]] | None:
        """``KVCacheManager.growth_probe_parts`` (a manager without it: ``None``,
        always look again)."""
        parts = getattr(self.manager, "growth_probe_parts", None)
        if parts is None:
            return None
        result: tuple[tuple[tuple[Mapping[BlockHash, Block], BlockHash], ...],
                      tuple[tuple[Mapping[BlockHash, Block], tuple[BlockHash, ...]], ...]] | \
            None = parts(request.req_id, num_tokens, matched_tokens)
        return result

    @property
    def version(self) -> tuple[int, int]:
        return self.manager.lookup_version

    def new_hashes(self, marks: Sequence[int] | None,
                   ) -> tuple[list[int], tuple[list[BlockHash], list[BlockHash]] | None]:
        """``KVCacheManager.hashes_indexed_since`` (a manager without it: no marks, hashes
        not known; the caller checks every probe itself)."""
        since = getattr(self.manager, "hashes_indexed_since", None)
        if since is None:
            return [], None
        result: tuple[list[int], tuple[list[BlockHash], list[BlockHash]] | None] = \
            since(marks)
        return result

    def _admit_next(self, budget: int) -> ScheduledChunk | None:
        hit: PrefixHit | None = None
        candidates: list[SchedRequest] = []
        if self._is_fcfs:
            request = self._next_eligible()
        else:
            candidates = self._current_candidates()
            request, hit = self._choose(candidates)
        if request is None:
            return None
        manager = self.manager
        req_id = request.req_id
        self._register(request)
        if hit is None:
            hit = manager.find_longest_hit(req_id)
        num_tokens = manager.num_tokens(req_id)
        num_new = manager.align_prefill_chunk(req_id, min(num_tokens - hit.num_tokens, budget),
                                              hit, max_chunk_tokens=self.chunk_size)
        if num_new == 0:
            return None
        allocation = manager.allocate_slots(req_id, num_new, hit,
                                            reserve_full_prompt=self.reserve_full_prompt)
        if allocation is None:
            self.last_refused = request
            return None
        self.waiting.remove(request)
        self.running.append(request)
        self._queue_version += 1
        if request.session_id is not None:
            self._active_session[request.session_id] = req_id
        if request.num_admissions == 0:
            request.first_hit_tokens = hit.num_tokens
            request.admitted_step = self.num_steps
            if request.session_id is not None:
                unadmitted = self._unadmitted[request.session_id]
                if unadmitted[0] is request:
                    unadmitted.popleft()
                else:  # a phase barrier let a later request of the session go first
                    unadmitted.remove(request)
        request.num_admissions += 1
        if candidates:
            self.guard.on_admitted(candidates, request, num_tokens - hit.num_tokens)
            self.admission.forget(request)
        return ScheduledChunk(req_id, hit.num_tokens, num_new, hit.num_tokens,
                              hit.num_tokens + num_new == num_tokens)

    def _choose(self, candidates: list[SchedRequest],
                ) -> tuple[SchedRequest | None, PrefixHit | None]:
        """The starvation guard's due candidate, else the admission order's choice."""
        if not candidates:
            return None, None
        due = self.guard.due(candidates)
        if due is not None:
            return due, None
        return self.admission.choose(candidates, self)

    def _current_candidates(self) -> list[SchedRequest]:
        """The eligible waiting requests of the look-ahead window, in queue order: the
        ones ``_next_eligible`` would accept, first of each session only (cached until the
        queue changes)."""
        if self._candidates_version == self._queue_version:
            return self._candidates
        lowest_phase = min((p for p, n in self._unfinished_by_phase.items() if n > 0),
                           default=0)
        candidates: list[SchedRequest] = []
        seen_sessions: set[str] = set()
        position = 0
        for request in self.waiting:
            if request.phase > lowest_phase:
                continue  # as in ``_next_eligible``: not counted against the window
            if position >= self.lookahead_requests:
                break
            position += 1
            session = request.session_id
            if session is not None:
                if session in seen_sessions or self._active_session.get(
                        session, request.req_id) != request.req_id:
                    continue
                seen_sessions.add(session)
            candidates.append(request)
        self._candidates = candidates
        self._candidates_version = self._queue_version
        return candidates

    def _stamp_eligible(self) -> None:
        """Record ``eligible_step`` of the requests that may have become eligible."""
        lowest_phase = min((p for p, n in self._unfinished_by_phase.items() if n > 0),
                           default=0)
        for request in self._to_check:
            if request.eligible_step is not None or request.phase > lowest_phase:
                continue
            session = request.session_id
            if session is not None and (
                    session in self._active_session
                    or self._session_head(session, lowest_phase) is not request):
                continue  # re-checked when its session's running request finishes
            request.eligible_step = self.num_steps
        self._to_check = []

    def _next_eligible(self) -> SchedRequest | None:
        lowest_phase = min((p for p, n in self._unfinished_by_phase.items() if n > 0),
                           default=0)
        position = 0
        for request in self.waiting:
            if request.phase > lowest_phase:
                # NOTE: behind a phase barrier it cannot be admitted now, so it must not use
                # up the look-ahead window (an earlier-phase request queued behind enough of
                # them would never be reached: deadlock)
                continue
            if position >= self.lookahead_requests:
                return None
            position += 1
            session = request.session_id
            if session is not None and self._active_session.get(session, request.req_id) \
                    != request.req_id:
                continue
            return request
        return None

    def _session_head(self, session: str, lowest_phase: int) -> SchedRequest | None:
        """The session's first unadmitted request whose phase is open (the one
        ``_next_eligible`` would reach first)."""
        return next((r for r in self._unadmitted[session] if r.phase <= lowest_phase), None)

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[str]:
        """Record sampled tokens of the step's sampling chunks; finish and free requests
        that reached ``max_output_tokens``. Returns the finished request ids."""
        started = time.process_time()
        try:
            return self._update(plan, sampled)
        finally:
            self.seconds += time.process_time() - started

    def _update(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[str]:
        finished: list[str] = []
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            request = self.requests[chunk.req_id]
            token = sampled[chunk.req_id]
            request.output_token_ids.append(token)
            if len(request.output_token_ids) >= request.max_output_tokens:
                self._finish(request)
                finished.append(request.req_id)
            else:
                self.manager.append_token_ids(request.req_id, (token,))
        return finished

    def _finish(self, request: SchedRequest) -> None:
        self.running.remove(request)
        self.manager.remove_request(request.req_id)
        self._registered.discard(request.req_id)
        if request.session_id is not None:
            self._active_session.pop(request.session_id, None)
            lowest_phase = min((p for p, n in self._unfinished_by_phase.items() if n > 0),
                               default=0)
            head = self._session_head(request.session_id, lowest_phase)
            if head is not None:
                self._to_check.append(head)
        self._unfinished_by_phase[request.phase] -= 1
        if self._unfinished_by_phase[request.phase] == 0:
            self._to_check.extend(self.waiting)  # a phase barrier may have opened
        self._queue_version += 1
        self.admission.on_finished(request, self.num_steps)
