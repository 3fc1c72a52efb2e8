"""Deterministic closed-loop replay of a trace through one cache manager per policy.

``replay`` turns each ``TraceRequest`` into a scheduler request (prompt ids expanded lazily
when the request is first admitted, so a 730 M-token trace never sits in memory at once),
runs the shared ``Scheduler`` step by step, draws output tokens (predetermined ones, or
unique ids from a global counter), and reports hit tokens at first admission.
The result depends only on the inputs: no wall clock enters it except the timing fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from hybridkv.cache import KVCacheManager
from hybridkv.config import CacheConfig
from hybridkv.errors import HybridKVError, InvariantViolation, PoolTooSmallError
from hybridkv.host_tier import HostReport
from hybridkv.sched.driver import Driver, ModelClock, OutputSampler, TimedRun, drive
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan
from hybridkv.sim.bound import AdmissionLog, BoundShape
from hybridkv.sim.bound_share import set_bounds, shared_bounds
from hybridkv.sim.host_replay import HostLink
from hybridkv.sim.misses import MissCauses, ObservedManager
from hybridkv.sim.timed import TimeSettings, arrival_times, summarise
from hybridkv.traces.prompts import LazyPrompt, PromptHasher
from hybridkv.traces.trace import (
    Trace,
)

ProgressFn = Callable[[int, int], None]
"""Called as ``progress(num_finished, num_requests)`` after each step."""


class ReplayObserver(Protocol):
    """Watches one replay or engine run (KV events, metrics): ``attach`` before the first
    request is added, ``on_step`` after every scheduler step, ``detach`` at the end with
    the run's missed tokens by cause (``None`` where they are not tracked: the engine)."""

    def attach(self, manager: KVCacheManager, scheduler: Scheduler, label: str) -> None: ...

    def on_step(self, manager: KVCacheManager, scheduler: Scheduler) -> None: ...

    def detach(self, manager: KVCacheManager, scheduler: Scheduler,
               misses: Mapping[str, int] | None) -> None: ...


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """Protocol knobs (``docs/replay-protocol.md``)."""

    max_running: int = 16
    chunk_size: int = 8192
    reserve_full_prompt: bool = True
    lookahead_requests: int = 256
    check_invariants: bool = False
    admission: str = "fcfs"
    """Admission order (``sim.admission.ORDERS``); ``fcfs`` is the protocol."""
    observers: tuple[ReplayObserver, ...] = ()
    """Called around every replay (``hybridkv replay --events / --metrics``)."""
    host_memory_bytes: int = 0
    """Host tier behind the pool (``--host-memory``; 0: none)."""
    host_policy: str = "aware"
    """The host tier's policy (``hybridkv.host_policies``)."""
    timing: TimeSettings | None = None
    """``--clock time``: open-loop arrivals, steps timed by the cost model (``None``: the
    step clock, the protocol)."""

    def __reduce__(self) -> tuple[type[ReplaySettings], tuple[object, ...]]:
        """Pickle through the constructor (sweep cells travel to ``--jobs`` / Ray workers):
        the compiled core's default unpickling sets the fields one by one, which a frozen
        class refuses."""
        return (type(self), tuple(getattr(self, f.name) for f in fields(self)))


@dataclass(slots=True)
class TagTotals:
    """First-admission totals of the requests sharing one tag."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class RunResult:
    """Outcome of one replay of one trace under one policy."""

    policy: str
    num_blocks: int
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    preempted_hit_tokens: int = 0
    bridge_tokens: int = 0
    steps: int = 0
    evicted_blocks: int = 0
    manager_seconds: float = 0.0
    hash_seconds: float = 0.0
    wall_seconds: float = 0.0
    by_tag: dict[str, TagTotals] = field(default_factory=dict)
    admission: str = "fcfs"
    scheduler_seconds: float = 0.0
    """CPU seconds inside the scheduler's ``schedule``/``update`` (manager calls included,
    prompt hashing excluded): the "manager + scheduler" cost of an admission order."""
    wait_steps: list[int] = field(default_factory=list)
    """Per request, steps from eligibility to first admission (trace order)."""

    @property
    def wait_p50_steps(self) -> float:
        return percentile(self.wait_steps, 50)

    @property
    def wait_p99_steps(self) -> float:
        return percentile(self.wait_steps, 99)

    @property
    def wait_max_steps(self) -> int:
        return max(self.wait_steps, default=0)
    misses: MissCauses = field(default_factory=MissCauses)
    """Missed prompt tokens (first admissions) by cause (``hybridkv.sim.misses``)."""
    misses_by_tag: dict[str, MissCauses] = field(default_factory=dict)
    log: AdmissionLog | None = None
    """The admissions, for the offline bounds (dropped once they are computed)."""
    bound_hit_tokens: int | None = None
    """Hit tokens of ``bound`` for this run's admissions (``attach_bounds``)."""
    bound_fa_hit_tokens: int | None = None
    host: HostReport | None = None
    """The host tier's summary (``--host-memory``); ``hit_tokens`` then counts GPU and host
    hits, ``host.hit_tokens`` the host's part."""
    time: dict[str, float] | None = None
    """``--clock time``: ``sim.timed.summarise`` of the run (``None`` on the step clock)."""
    request_times: list[dict[str, object]] | None = None
    """``--clock time``: per request (trace order) arrival, TTFT, TPOT, e2e, queueing."""
    time_label: str = ""
    """The GPU the times are for (``"... (scaled from h200)"`` when not calibrated on it)."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_tokens(self) -> int:
        return 0 if self.host is None else self.host.hit_tokens

    @property
    def bound(self) -> float | None:
        """``bound`` as a rate of this run's prompt tokens (``None`` when not computed)."""
        if self.bound_hit_tokens is None:
            return None
        return self.bound_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def bound_fa(self) -> float | None:
        if self.bound_fa_hit_tokens is None:
            return None
        return self.bound_fa_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def merge(self, other: RunResult) -> None:
        """Accumulate another run's counters (used for multi-scenario workloads)."""
        for name in ("requests", "prompt_tokens", "hit_tokens", "preemptions",
                     "preempted_hit_tokens", "bridge_tokens", "steps", "evicted_blocks"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("manager_seconds", "hash_seconds", "wall_seconds", "scheduler_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.wait_steps = self.wait_steps + other.wait_steps
        self.misses.add(other.misses)
        for tag, causes in other.misses_by_tag.items():
            self.misses_by_tag.setdefault(tag, MissCauses()).add(causes)
        for name in ("bound_hit_tokens", "bound_fa_hit_tokens"):
            mine_value, theirs = getattr(self, name), getattr(other, name)
            if theirs is not None:
                setattr(self, name, (mine_value or 0) + theirs)
        if other.host is not None:
            if self.host is None:
                self.host = HostReport(other.host.policy, other.host.capacity_bytes)
            self.host.merge(other.host)
        for tag, totals in other.by_tag.items():
            mine = self.by_tag.setdefault(tag, TagTotals())
            mine.requests += totals.requests
            mine.prompt_tokens += totals.prompt_tokens
            mine.hit_tokens += totals.hit_tokens


def percentile(values: Sequence[int], pct: float) -> float:
    """Nearest-rank percentile (0 for no values).

    >>> percentile([5, 1, 3, 2, 4], 50), percentile(list(range(1, 101)), 99), percentile([], 99)
    (3, 99, 0)
    """
    if not values:
        return 0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]


def replay(trace: Trace, config: CacheConfig, policy: str,
           settings: ReplaySettings | None = None, progress: ProgressFn | None = None,
           ) -> RunResult:
    """Replay ``trace`` under ``policy`` and return its counters."""
    started = time.perf_counter()
    settings = settings or ReplaySettings()
    manager = ObservedManager(
        config, policy, {r.request_id: i for i, r in enumerate(trace.requests)},
        {r.request_id: r.input_length + len(r.output_token_ids or ()) for r in trace.requests},
        {r.request_id: r.tag or "all" for r in trace.requests})
    scheduler = Scheduler(manager, max_running=settings.max_running,
                          chunk_size=settings.chunk_size,
                          reserve_full_prompt=settings.reserve_full_prompt,
                          lookahead_requests=settings.lookahead_requests,
                          admission=settings.admission)
    manager.host = HostLink.for_settings(manager, settings.host_policy,
                                         settings.host_memory_bytes)
    observers = settings.observers
    for observer in observers:
        observer.attach(manager, scheduler, policy if settings.admission == "fcfs"
                        else f"{policy} [{settings.admission}]")
    prompt_hasher = PromptHasher(manager.hasher)
    timing = settings.timing
    sched_requests = _sched_requests(trace, config, prompt_hasher)
    if timing is None:  # the step clock: everything queued at once (closed loop)
        for sched_request in sched_requests:
            scheduler.add_request(sched_request)
    sampler = OutputSampler(trace)
    finished_count = [0]
    num_requests = len(sched_requests)

    def sample(plan: StepPlan) -> dict[str, int]:
        if not plan.chunks:
            raise no_progress_error(trace, policy, config, manager, scheduler, plan.preempted)
        return {chunk.req_id: sampler.sample(scheduler.requests[chunk.req_id])
                for chunk in plan.chunks if chunk.samples}

    def after_step(plan: StepPlan, finished: Sequence[str]) -> None:
        for req_id in finished:  # the replay never reads outputs back: keep memory flat
            scheduler.requests[req_id].output_token_ids = []
        finished_count[0] += len(finished)
        if settings.check_invariants:
            manager.check_invariants()
            HostLink.check(manager.host)
        if progress is not None:
            progress(finished_count[0], num_requests)
        for observer in observers:
            observer.on_step(manager, scheduler)

    timed = _run(trace, config, scheduler, sched_requests, timing, sample, after_step)
    result = _collect(policy, config, manager, scheduler, sched_requests, started)
    result.hash_seconds += prompt_hasher.seconds
    result.scheduler_seconds = scheduler.seconds
    result.misses = manager.misses
    result.misses_by_tag = manager.misses_by_tag
    result.log = manager.log
    result.host = HostLink.report_of(manager.host)
    result.hit_tokens += result.host_hit_tokens
    if timed is not None and timing is not None:
        _attach_times(result, timed, timing, config)
    for observer in observers:
        observer.detach(manager, scheduler, result.misses.as_dict())
    return result


def _sched_requests(trace: Trace, config: CacheConfig, prompt_hasher: PromptHasher,
                    ) -> list[SchedRequest]:
    """The trace's requests as the scheduler sees them (prompts expanded lazily). A trace
    may say 0 output tokens; an engine always samples at least one."""
    return [SchedRequest(
        request.request_id, LazyPrompt(request, index), max(1, request.output_length),
        session_id=request.session_id, phase=request.phase, tag=request.tag,
        hash_prompt=prompt_hasher.for_request(request) if config.enable_caching else None)
        for index, request in enumerate(trace.requests)]


def _run(trace: Trace, config: CacheConfig, scheduler: Scheduler,
         sched_requests: Sequence[SchedRequest], timing: TimeSettings | None,
         sample: Callable[[StepPlan], dict[str, int]],
         after_step: Callable[[StepPlan, Sequence[str]], None]) -> TimedRun | None:
    """Drive the scheduler to the end: the step clock (requests already queued), or
    ``--clock time`` (``sched.driver.drive``: open-loop arrivals, steps timed by the cost
    model; returns the timed run)."""
    if timing is None:  # the step clock: the requests were queued at once
        Driver(scheduler, sample, on_step=after_step).run_to_end()
        return None
    cost = timing.cost_model(config)
    arrivals = arrival_times([r.arrival_seconds for r in trace.requests],
                             time_scale=timing.time_scale, rate=timing.rate, seed=timing.seed)
    return drive(scheduler, list(zip(arrivals, sched_requests, strict=True)), sample,
                 ModelClock(), step_seconds=lambda plan: cost.seconds(plan.chunks),
                 on_step=after_step)


def _attach_times(result: RunResult, timed: TimedRun, timing: TimeSettings,
                  config: CacheConfig) -> None:
    """The run's time summary and per-request times (``--clock time``)."""
    result.time = summarise(timed, timing.slo)
    result.request_times = [
        {"id": rid, "arrival_s": round(t.arrival_s, 6), "ttft_s": round(t.ttft_s, 6),
         "tpot_s": round(t.tpot_s, 6), "e2e_s": round(t.e2e_s, 6),
         "queue_s": round(t.queue_s, 6), "hit_tokens": t.hit_tokens}
        for rid, t in timed.requests.items()]
    result.time_label = timing.label(config)


def no_progress_error(trace: Trace, policy: str, config: CacheConfig, manager: KVCacheManager,
                      scheduler: Scheduler, preempted: Sequence[str]) -> HybridKVError:
    """Why a step scheduled nothing: the one running request preempted itself (it cannot
    grow inside the whole pool) or nothing runs and the next request cannot be admitted
    into the empty pool; both mean the pool is too small for that request
    (``PoolTooSmallError``). Anything else would be a scheduler bug."""
    blocked = (scheduler.requests[preempted[-1]] if preempted  # the request admission refused
               else scheduler.last_refused or scheduler._next_eligible())
    usable = config.num_blocks - 1
    if blocked is None or blocked.req_id not in manager.request_ids:
        return InvariantViolation(f"replay of {trace.name!r} under {policy!r} made no "
                                  f"progress at step {scheduler.num_steps} with no request "
                                  "to blame")
    num_tokens = manager.num_tokens(blocked.req_id)
    need = manager.coordinator.num_blocks_to_allocate(
        blocked.req_id, num_tokens, [()] * len(config.groups), 0, apply_admission_cap=True)
    if need <= usable and not preempted:
        return InvariantViolation(f"replay of {trace.name!r} under {policy!r} made no "
                                  f"progress at step {scheduler.num_steps}: request "
                                  f"{blocked.req_id!r} needs {need} of {usable} blocks")
    return PoolTooSmallError(blocked.req_id, num_tokens, max(need, usable + 1),
                             config.num_blocks, origin=trace.origin)


def attach_bounds(result: RunResult, trace: Trace, config: CacheConfig) -> None:
    """Compute ``bound`` and ``bound_fa`` for the admissions ``result`` logged (its
    ``bound_hit_tokens`` / ``bound_fa_hit_tokens``; ``None`` without full attention), then
    drop the log. One lockstep pass of both over the log's occurrences, once per process
    per distinct log (``hybridkv.sim.bound_share``: another policy that logged the same
    admissions gets the memoized pair)."""
    shape = BoundShape.of(config)
    if shape is not None and result.log is not None:
        set_bounds(result, shared_bounds(trace, result.log, shape))
    result.log = None


def _collect(policy: str, config: CacheConfig, manager: KVCacheManager, scheduler: Scheduler,
             sched_requests: Sequence[SchedRequest], started: float) -> RunResult:
    stats = manager.stats
    result = RunResult(
        policy=policy, num_blocks=config.num_blocks, requests=stats.requests,
        prompt_tokens=stats.queries, hit_tokens=stats.hits,
        preemptions=scheduler.num_preemptions, preempted_hit_tokens=stats.preempted_hits,
        bridge_tokens=stats.bridge_tokens,
        steps=scheduler.num_steps, evicted_blocks=sum(stats.evicted_blocks_by_group),
        manager_seconds=manager.manager_seconds, hash_seconds=manager.hash_seconds,
        admission=scheduler.admission.name,
    )
    for request in sched_requests:
        assert request.admitted_step is not None and request.eligible_step is not None
        result.wait_steps.append(request.admitted_step - request.eligible_step)
        totals = result.by_tag.setdefault(request.tag or "all", TagTotals())
        totals.requests += 1
        totals.prompt_tokens += len(request.prompt_token_ids)
        totals.hit_tokens += request.first_hit_tokens or 0
    result.wall_seconds = time.perf_counter() - started
    return result
