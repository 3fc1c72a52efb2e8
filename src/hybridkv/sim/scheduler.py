"""Closed-loop scheduler shared by the replay simulator and the reference engine.

One step (``schedule``), per ``docs/replay-protocol.md``:

1. Running requests, in admission order, ask for ``min(num_tokens - num_computed, budget)``
   slots (prefill chunk or one decode token). When the pool cannot provide them the most
   recently admitted running request is preempted (blocks freed, progress reset, back to the
   head of the waiting queue) and the allocation retried; a requester that is itself the
   most recent is preempted.
2. If nothing was preempted: admissions, first come first served among the first
   ``lookahead_requests`` waiting requests whose session and phase allow it, while budget
   remains and fewer than ``max_running`` run: look up the prefix hit, allocate
   ``min(num_tokens - hit, budget)`` slots behind the admission gate; a refusal ends
   admissions for the step.
3. The caller executes the returned chunks in order and calls ``update`` with one sampled
   token per chunk that completed its request's known tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hybridkv.cache import KVCacheManager
from hybridkv.errors import ConfigError, RequestError
from hybridkv.ids import BlockHash


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


class Scheduler:
    """FCFS scheduler with chunked prefill, decode, preemption of the newest request."""

    def __init__(self, manager: KVCacheManager, *, max_running: int = 16,
                 chunk_size: int = 8192, reserve_full_prompt: bool = True,
                 lookahead_requests: int = 256) -> None:
        if max_running <= 0:
            raise ConfigError("max_running", max_running, "must be a positive request count")
        if chunk_size <= 0:
            raise ConfigError("chunk_size", chunk_size, "must be a positive token count")
        self.manager = manager
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.reserve_full_prompt = reserve_full_prompt
        self.lookahead_requests = lookahead_requests
        self.waiting: deque[SchedRequest] = deque()
        self.running: list[SchedRequest] = []
        self.requests: dict[str, SchedRequest] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self._active_session: dict[str, str] = {}
        self._unfinished_by_phase: dict[int, int] = {}
        self._registered: set[str] = set()

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

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ step
    def schedule(self) -> StepPlan:
        """Plan one step: allocations for running requests, then admissions."""
        self.num_steps += 1
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
        self.num_preemptions += 1

    def _admit_next(self, budget: int) -> ScheduledChunk | None:
        request = self._next_eligible()
        if request is None:
            return None
        manager = self.manager
        req_id = request.req_id
        if req_id not in self._registered:
            prompt = request.prompt_token_ids
            hashes = None if request.hash_prompt is None else request.hash_prompt(prompt)
            manager.add_request(req_id, prompt, session_id=request.session_id,
                                block_hashes=hashes)
            self._registered.add(req_id)
        hit = manager.find_longest_hit(req_id)
        num_tokens = manager.num_tokens(req_id)
        num_new = manager.align_prefill_chunk(req_id, min(num_tokens - hit.num_tokens, budget),
                                              hit, max_chunk_tokens=self.chunk_size)
        if num_new == 0:
            return None
        allocation = manager.allocate_slots(req_id, num_new, hit,
                                            reserve_full_prompt=self.reserve_full_prompt)
        if allocation is None:
            return None
        self.waiting.remove(request)
        self.running.append(request)
        if request.session_id is not None:
            self._active_session[request.session_id] = req_id
        if request.num_admissions == 0:
            request.first_hit_tokens = hit.num_tokens
        request.num_admissions += 1
        return ScheduledChunk(req_id, hit.num_tokens, num_new, hit.num_tokens,
                              hit.num_tokens + num_new == num_tokens)

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

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[str]:
        """Record sampled tokens of the step's sampling chunks; finish and free requests
        that reached ``max_output_tokens``. Returns the finished request ids."""
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
        self._unfinished_by_phase[request.phase] -= 1
