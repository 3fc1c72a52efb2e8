"""The one drive loop: schedule → execute (sample) → update, step after step.

Every user of the ``Scheduler`` runs it through ``Driver``: the replay on the step clock and
on ``--clock time`` (``hybridkv.sim.replay``), cluster instances (``hybridkv.cluster.instance``),
the reference engine (``hybridkv.engine.runner``; ``verify`` through it) and the bench scripts
(``drive``). What differs between them is plugged in, never copied:

- ``execute(plan) -> sampled``: what a step does with its plan (a replay draws output tokens,
  ``OutputSampler.executor``; the engine runs the model). It may raise its own error for a
  plan that schedules nothing; otherwise the driver raises ``InvariantViolation``.
- ``clock`` (``Clock``) and ``step_seconds``: how time passes. None: the step clock, time is
  the step count (``Driver.num_steps``) and nothing is timed. ``ModelClock`` with a cost
  model's ``step_seconds``: simulated seconds; ``WallClock``: real seconds.
- ``record``: each request's times (``RequestTimes``: arrival, admission, first token,
  finish → TTFT, TPOT); ``record_steps``: each step's start, seconds and chunks
  (``TimedRun``).
- ``on_step(plan, finished)``: after every update (progress, invariants, observers).

Requests are ``add``-ed to the scheduler at once, or ``submit``-ted with an arrival time and
added when the clock reaches it (``run`` idles the clock to the next arrival).

Example: two requests of 4 prompt tokens and 2 outputs each, one running at a time, on a
model clock where a step takes 0.5 s::

    >>> from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager
    >>> from hybridkv.sched.scheduler import SchedRequest, Scheduler
    >>> manager = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 16),
    ...                          "latest")
    >>> scheduler = Scheduler(manager, max_running=1, chunk_size=8)
    >>> driver = Driver(scheduler, OutputSampler(first_id=100).executor(scheduler),
    ...                 clock=ModelClock(), step_seconds=lambda plan: 0.5, record=True)
    >>> driver.submit(SchedRequest("a", (1, 2, 3, 4), 2), 0.0)
    >>> driver.submit(SchedRequest("b", (1, 2, 3, 4), 2), 0.25)
    >>> driver.run_to_end()
    4
    >>> b = driver.run.requests["b"]
    >>> b.arrival_s, b.admitted_s, b.first_token_s, b.finished_s, b.ttft_s
    (0.25, 1.0, 1.5, 2.0, 1.25)
    >>> scheduler.requests["b"].output_token_ids
    [102, 103]
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.errors import InvariantViolation
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan
from hybridkv.traces.trace import OUTPUT_TOKEN_BASE, Trace, TraceRequest

Execute = Callable[[StepPlan], Mapping[str, int]]
"""Runs a planned step and returns one sampled token per sampling chunk."""

OnStep = Callable[[StepPlan, Sequence[str]], None]
"""Called after every update with the step's plan and the requests it finished."""


class Clock(Protocol):
    """Seconds since the run started."""

    def now(self) -> float: ...
    def wait_until(self, t: float) -> None: ...
    def advance(self, seconds: float) -> None: ...


class ModelClock:
    """Simulated seconds: steps ``advance`` it, idle time jumps.

    >>> c = ModelClock(); c.advance(0.25); c.wait_until(1.0); c.wait_until(0.5); c.now()
    1.0
    """

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def advance(self, seconds: float) -> None:
        self.t += seconds


class WallClock:
    """Real seconds (``time.perf_counter``): idle time is slept, steps take their time."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)

    def advance(self, seconds: float) -> None:
        """Nothing: real steps already took their time."""


@dataclass(slots=True)
class RequestTimes:
    """One request's life in seconds since the run's start (``None``: did not happen)."""

    arrival_s: float
    prompt_tokens: int
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    output_tokens: int = 0
    hit_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return (self.first_token_s or 0.0) - self.arrival_s

    @property
    def queue_s(self) -> float:
        """Arrival → start of the step that first admitted it."""
        return (self.admitted_s or 0.0) - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return (self.finished_s or 0.0) - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Seconds per output token after the first (0 with one output token)."""
        if self.output_tokens <= 1 or self.finished_s is None or self.first_token_s is None:
            return 0.0
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class TimedRun:
    """A finished open-loop run: requests by id, and per step (start, seconds, chunks)."""

    requests: dict[str, RequestTimes] = field(default_factory=dict)
    steps: list[tuple[float, float, tuple[tuple[int, int, bool], ...]]] = field(
        default_factory=list)

    @property
    def busy_s(self) -> float:
        return sum(seconds for _, seconds, _ in self.steps)

    @property
    def makespan_s(self) -> float:
        """First arrival → last finish."""
        if not self.requests:
            return 0.0
        return max(r.finished_s or 0.0 for r in self.requests.values()) - \
            min(r.arrival_s for r in self.requests.values())


class Driver:
    """Drives ``scheduler`` step by step (schedule → ``execute`` → update); see the module
    docstring. ``num_steps``: steps run; ``busy_s``: summed ``step_seconds``;
    ``step_started``: the clock's time at the start of the step being run (0 without a
    clock)."""

    def __init__(self, scheduler: Scheduler, execute: Execute, *, clock: Clock | None = None,
                 step_seconds: Callable[[StepPlan], float] | None = None,
                 on_step: OnStep | None = None, record: bool = False,
                 record_steps: bool = False) -> None:
        if step_seconds is not None and clock is None:
            raise ValueError("step_seconds needs a clock")
        self.scheduler = scheduler
        self.execute = execute
        self.clock = clock
        self.step_seconds = step_seconds
        self.on_step = on_step
        self.record = record
        self.record_steps = record_steps
        self.run = TimedRun()
        self.num_steps = 0
        self.busy_s = 0.0
        self.step_started = 0.0
        self._pending: deque[tuple[float, SchedRequest]] = deque()

    def now(self) -> float:
        return 0.0 if self.clock is None else self.clock.now()

    def add(self, request: SchedRequest, arrival_s: float | None = None) -> None:
        """Queue ``request`` now (recorded as arriving at ``arrival_s``, default now)."""
        self.scheduler.add_request(request)
        if self.record:
            self.run.requests[request.req_id] = RequestTimes(
                self.now() if arrival_s is None else arrival_s, len(request.prompt_token_ids))

    def submit(self, request: SchedRequest, arrival_s: float) -> None:
        """Queue ``request`` once the clock reaches ``arrival_s`` (submit in arrival order;
        ``drive`` sorts)."""
        self._pending.append((arrival_s, request))

    @property
    def has_work(self) -> bool:
        """Requests unfinished in the scheduler, or still to arrive."""
        return bool(self._pending) or self.scheduler.has_unfinished

    def step(self) -> Sequence[str]:
        """Run one step; returns the requests it finished."""
        scheduler = self.scheduler
        clock = self.clock
        started = self.step_started = 0.0 if clock is None else clock.now()
        plan = scheduler.schedule()
        sampled = self.execute(plan)  # may raise its own error for an empty plan
        if not plan.chunks:
            raise InvariantViolation(f"step {scheduler.num_steps}: nothing could be "
                                     "scheduled (the pool cannot hold the next request)")
        if self.step_seconds is not None and clock is not None:
            seconds = self.step_seconds(plan)
            clock.advance(seconds)
            self.busy_s += seconds
        done = 0.0 if clock is None else clock.now()
        if self.record:
            _stamp(self.run, plan, sampled, started, done)
        if self.record_steps:
            self.run.steps.append((started, done - started, tuple(
                (c.num_computed_tokens, c.num_new_tokens, c.samples) for c in plan.chunks)))
        finished = scheduler.update(plan, sampled)
        if self.record:
            for req_id in finished:
                self.run.requests[req_id].finished_s = done
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(plan, finished)
        return finished

    def run_to_end(self) -> int:
        """Step until every request arrived and finished (idling the clock to the next
        arrival when nothing runs); returns the steps run."""
        first = self.num_steps
        pending = self._pending
        scheduler = self.scheduler
        while pending or scheduler.has_unfinished:
            if pending:
                assert self.clock is not None, "arrival times need a clock"
                now = self.clock.now()
                while pending and pending[0][0] <= now:
                    at, request = pending.popleft()
                    self.add(request, at)
                if not scheduler.has_unfinished:
                    self.clock.wait_until(pending[0][0])
                    continue
            self.step()
        return self.num_steps - first


def drive(scheduler: Scheduler, arrivals: Sequence[tuple[float, SchedRequest]],
          execute: Execute, clock: Clock,
          step_seconds: Callable[[StepPlan], float] | None = None,
          on_step: OnStep | None = None) -> TimedRun:
    """Run ``arrivals`` (seconds, request; any order) through ``scheduler`` to the end,
    recording every request's and step's times (``Driver`` with ``record``).

    ``step_seconds`` (a model clock): the step's predicted time, added to ``clock`` after
    ``execute``. ``on_step(plan, finished)`` after every update.
    """
    driver = Driver(scheduler, execute, clock=clock, step_seconds=step_seconds,
                    on_step=on_step, record=True, record_steps=True)
    for at, request in sorted(arrivals, key=lambda a: a[0]):
        driver.submit(request, at)
    driver.run_to_end()
    return driver.run


def _stamp(run: TimedRun, plan: StepPlan, sampled: Mapping[str, int], started: float,
           done: float) -> None:
    for chunk in plan.chunks:
        times = run.requests[chunk.req_id]
        if chunk.req_id in plan.admitted and times.admitted_s is None:
            times.admitted_s = started
            times.hit_tokens = chunk.num_hit_tokens
    for req_id in sampled:
        times = run.requests[req_id]
        times.output_tokens += 1
        if times.first_token_s is None:
            times.first_token_s = done


class OutputSampler:
    """Deterministic "sampling": predetermined outputs, else unique ids counted up from
    ``first_id``.

    The replay registers every request up front (``OutputSampler(trace)``); a cluster
    instance registers the requests routed to it (``add``) and drops them when they finish
    (``forget``), drawing from its own id range so two instances never collide.

    >>> sampler = OutputSampler(first_id=100)
    >>> sampler.add(TraceRequest("a", 4, 2, output_token_ids=(7, 8)))
    >>> a = SchedRequest("a", (1, 2, 3, 4), 2)
    >>> b = SchedRequest("b", (1, 2, 3, 4), 2)
    >>> sampler.sample(a), sampler.sample(b), sampler.sample(b)
    (7, 100, 101)
    >>> sampler.forget("a"); sampler.sample(a)
    102
    """

    def __init__(self, trace: Trace | None = None, first_id: int = OUTPUT_TOKEN_BASE) -> None:
        self._predetermined: dict[str, tuple[int, ...]] = {}
        self._next_unique = first_id
        if trace is not None:
            for request in trace.requests:
                self.add(request)

    def add(self, request: TraceRequest) -> None:
        """Register ``request``'s predetermined outputs (if the trace gives any)."""
        if request.output_token_ids:
            self._predetermined[request.request_id] = request.output_token_ids

    def forget(self, req_id: str) -> None:
        """The request finished: drop its predetermined outputs."""
        self._predetermined.pop(req_id, None)

    def sample(self, request: SchedRequest) -> int:
        fixed = self._predetermined.get(request.req_id)
        position = len(request.output_token_ids)
        if fixed is not None and position < len(fixed):
            return fixed[position]
        token = self._next_unique
        self._next_unique += 1
        return token

    def executor(self, scheduler: Scheduler) -> Execute:
        """The ``Driver``'s ``execute`` of a replay on ``scheduler``: a token for each
        chunk that samples."""
        requests = scheduler.requests

        def execute(plan: StepPlan) -> dict[str, int]:
            return {chunk.req_id: self.sample(requests[chunk.req_id])
                    for chunk in plan.chunks if chunk.samples}

        return execute


__all__ = ["Clock", "Driver", "Execute", "ModelClock", "OnStep", "OutputSampler",
           "RequestTimes", "TimedRun", "WallClock", "drive"]
