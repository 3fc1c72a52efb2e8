"""The cluster replay: a trace over N instances behind one router, in epochs.

**Time model.** Time is the global step count; every instance runs one scheduler step per
global step (an instance with nothing queued idles). Steps are grouped into *epochs* of
``sync_steps`` steps (default 1). At each epoch's start:

1. *Arrivals* (closed loop, the replay protocol's order): requests are released in trace
   order (the trace's timestamps order it), at most ``concurrency`` in flight cluster-wide
   (released and not finished: a fixed population of clients); a request of a session is
   released only after the session's previous request finished (the next turn of a
   conversation is sent after the answer), and a request of phase ``k`` only after every
   request of a lower phase finished.
2. *Routing*: the router places each released request, in trace order. It sees each
   instance's load as reported at the end of the previous epoch plus what it routed since
   (each routed request adds its prompt tokens and one request to its instance's view), and
   the prefix routers see every KV event the instances emitted up to the end of the
   previous epoch — the lag of a router fed by an event stream delivered once per step
   (``sync_steps`` > 1 models a slower feed: a stale view).
3. Each instance queues its new requests and runs the epoch's steps; then its events and
   load are delivered to the router.

Everything is a function of the trace and the settings: instances never share state, the
router reads reports in instance order, so serial, ``--jobs`` and ``--ray`` runs produce the
same numbers (a test compares them).

**Load balance** (``load_imbalance``): with ``q_i(t)`` the queued prompt tokens of
instance ``i`` after global step ``t`` (``InstanceReport``), ``sum_t max_i q_i(t) /
sum_t mean_i q_i(t)`` over the steps at which any instance ran: 1.0 when every instance
always holds the same backlog, ``N`` when one instance holds all of it. The time integral
weighs busy periods by their backlog, so a few near-empty steps cannot dominate it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.cluster.instance import (
    InstanceGroup,
    InstanceReport,
    InstanceResult,
    InstanceSettings,
)
from hybridkv.cluster.routers import Load, Route, Router, RouteRequest
from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError, InvariantViolation
from hybridkv.sched.driver import RequestTimes, TimedRun
from hybridkv.sim.timed import SLO, TimeSettings, arrival_times, summarise
from hybridkv.traces.trace import Trace


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """Knobs of a cluster replay (``hybridkv cluster``)."""

    num_instances: int = 4
    sync_steps: int = 1
    """Steps per epoch: how often requests are dispatched and the router's view refreshed."""
    concurrency: int | None = None
    """Requests in flight cluster-wide (default: ``num_instances * max_running``)."""
    instance: InstanceSettings = field(default_factory=InstanceSettings)
    load_weight: float = 1.0
    """Prefix routers: score = matched tokens - ``load_weight`` x queued prompt tokens."""
    bounded_load: float | None = None
    """Prefix routers: the bounded-load rule's ``c`` (``prefix.bounded_load_instances``;
    ``None``: off)."""

    @property
    def max_in_flight(self) -> int:
        if self.concurrency is not None:
            return self.concurrency
        return self.num_instances * self.instance.max_running

    def validate(self) -> None:
        for flag, value in (("--instances", self.num_instances),
                            ("--sync-steps", self.sync_steps),
                            ("--concurrency", self.max_in_flight)):
            if value < 1:
                raise ConfigError(flag, value, "must be a positive integer")


class Backend(Protocol):
    """Runs the instances: one epoch at a time, reports in instance order."""

    def advance(self, arrivals: dict[int, list[int]], num_steps: int,
                ) -> list[InstanceReport]: ...

    def results(self) -> list[InstanceResult]: ...

    def close(self) -> None: ...


class SerialBackend:
    """Every instance in this process."""

    def __init__(self, group: InstanceGroup) -> None:
        self.group = group

    def advance(self, arrivals: dict[int, list[int]], num_steps: int,
                ) -> list[InstanceReport]:
        return self.group.advance(arrivals, num_steps)

    def results(self) -> list[InstanceResult]:
        return self.group.results()

    def close(self) -> None:
        pass


class Dispatcher:
    """Releases requests in trace order under the closed-loop rules (module docstring).

    >>> from hybridkv.traces.trace import TraceRequest
    >>> reqs = (TraceRequest("a", 8, 1, session_id="s"), TraceRequest("b", 8, 1, session_id="s"),
    ...         TraceRequest("c", 8, 1))
    >>> d = Dispatcher(Trace("t", reqs), concurrency=8)
    >>> d.release(), d.release()     # b waits for a (same session)
    ([0, 2], [])
    >>> d.finished(0); d.release()
    [1]
    """

    def __init__(self, trace: Trace, concurrency: int) -> None:
        self._requests = trace.requests
        self._concurrency = concurrency
        self._later: dict[str, deque[int]] = {}
        self._ready: list[tuple[int, int]] = []
        """(phase, trace index) of released-able requests (a heap)."""
        self._unfinished_by_phase: dict[int, int] = {}
        self.in_flight = 0
        self.num_unfinished = len(trace.requests)
        for index, request in enumerate(trace.requests):
            self._unfinished_by_phase[request.phase] = (
                self._unfinished_by_phase.get(request.phase, 0) + 1)
            session = request.session_id
            if session is None:
                self._ready.append((request.phase, index))
            elif session in self._later:
                self._later[session].append(index)
            else:
                self._later[session] = deque()
                self._ready.append((request.phase, index))
        heapq.heapify(self._ready)

    def release(self) -> list[int]:
        """Trace indices released now, in trace order (lower phases first)."""
        released: list[int] = []
        lowest = min((p for p, n in self._unfinished_by_phase.items() if n), default=0)
        while self._ready and self.in_flight < self._concurrency \
                and self._ready[0][0] <= lowest:
            released.append(heapq.heappop(self._ready)[1])
            self.in_flight += 1
        return released

    def finished(self, index: int) -> None:
        request = self._requests[index]
        self.in_flight -= 1
        self.num_unfinished -= 1
        self._unfinished_by_phase[request.phase] -= 1
        if request.session_id is not None:
            later = self._later[request.session_id]
            if later:
                nxt = later.popleft()
                heapq.heappush(self._ready, (self._requests[nxt].phase, nxt))


@dataclass(slots=True)
class ClusterRun:
    """The outcome of one router over the whole trace."""

    router: str
    instances: list[InstanceResult]
    steps: int = 0
    """Global steps at which any instance ran (the makespan)."""
    backlog_max_sum: int = 0
    """``sum_t max_i q_i(t)`` (see the module docstring)."""
    backlog_mean_sum: float = 0.0
    """``sum_t mean_i q_i(t)``."""
    backlog_peak: int = 0
    """Largest ``q_i(t)`` of any instance at any step."""
    predicted_hit_tokens: int = 0
    """Hit tokens the router expected where it routed (prefix routers)."""
    phantom_hit_tokens: int = 0
    """Expected hit tokens that did not materialise: sum over requests of
    ``max(0, predicted - actual first-admission hit)``."""
    routed_by_instance: list[int] = field(default_factory=list)
    seconds: float = 0.0
    request_times: dict[str, RequestTimes] = field(default_factory=dict)
    """``--clock time``: each finished request's times (empty on the step clock)."""
    time: dict[str, float] | None = None
    """``--clock time``: ``sim.timed.summarise`` of the requests, ``busy_fraction`` over
    every instance (``None`` on the step clock)."""

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.instances)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.instances)

    @property
    def hit_tokens(self) -> int:
        return sum(r.hit_tokens for r in self.instances)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def preemptions(self) -> int:
        return sum(r.preemptions for r in self.instances)

    @property
    def load_imbalance(self) -> float:
        """``sum_t max / sum_t mean`` of queued prompt tokens (1.0 = balanced)."""
        return self.backlog_max_sum / self.backlog_mean_sum if self.backlog_mean_sum else 1.0

    @property
    def mean_backlog_tokens(self) -> float:
        """Mean queued prompt tokens per instance over the busy steps."""
        return self.backlog_mean_sum / self.steps if self.steps else 0.0

    @property
    def mean_max_backlog_tokens(self) -> float:
        """The most loaded instance's backlog, averaged over the busy steps:
        ``sum_t max_i q_i(t) / steps`` (= ``load_imbalance * mean_backlog_tokens``).

        The absolute counterpart of ``load_imbalance``, whose denominator is the router's
        *own* mean backlog: prefix hits shrink every backlog, so a router with hits can
        show a worse ratio while its worst instance is less loaded. Worked example: 4 busy
        steps, ``sum_t max`` 400 and ``sum_t mean`` 250 tokens:

        >>> run = ClusterRun("r", [], steps=4, backlog_max_sum=400, backlog_mean_sum=250.0)
        >>> run.mean_max_backlog_tokens, run.load_imbalance
        (100.0, 1.6)
        """
        return self.backlog_max_sum / self.steps if self.steps else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "router": self.router, "hit_rate": self.hit_rate, "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens, "requests": self.requests,
            "preemptions": self.preemptions, "load_imbalance": self.load_imbalance,
            "mean_backlog_tokens": self.mean_backlog_tokens,
            "mean_max_backlog_tokens": self.mean_max_backlog_tokens,
            "peak_backlog_tokens": self.backlog_peak, "steps": self.steps,
            "predicted_hit_tokens": self.predicted_hit_tokens,
            "phantom_hit_tokens": self.phantom_hit_tokens,
            "wall_seconds": round(self.seconds, 4),
            **({"time": {k: round(v, 6) for k, v in self.time.items()}} if self.time else {}),
            "instances": [{
                "instance": r.instance, "requests": r.requests,
                "prompt_tokens": r.prompt_tokens, "hit_tokens": r.hit_tokens,
                "hit_rate": r.hit_rate, "preemptions": r.preemptions,
                "bridge_tokens": r.bridge_tokens, "evicted_blocks": r.evicted_blocks,
                "busy_steps": r.busy_steps,
            } for r in self.instances],
        }


ProgressFn = Callable[[int, int], None]
"""``progress(num_finished, num_requests)`` after each epoch."""


def run_cluster(trace: Trace, router: Router, backend: Backend, settings: ClusterSettings,
                progress: ProgressFn | None = None) -> ClusterRun:
    """Replay ``trace`` through ``backend``'s instances behind ``router``."""
    import time

    started = time.perf_counter()
    settings.validate()
    n = settings.num_instances
    dispatcher = Dispatcher(trace, settings.max_in_flight)
    loads = [Load(0, 0) for _ in range(n)]
    predicted: dict[int, int] = {}
    run = ClusterRun(router.name, [], routed_by_instance=[0] * n)
    total = len(trace.requests)
    timing = settings.instance.timing
    clock = None if timing is None else ArrivalClock(trace, timing,
                                                     settings.instance.epoch_seconds)
    while dispatcher.num_unfinished:
        released = dispatcher.release() if clock is None else clock.release()
        arrivals = _route(trace, router, released, loads, run, predicted)
        reports = backend.advance(arrivals, settings.sync_steps)
        busy = max((len(r.queued_tokens_by_step) for r in reports), default=0)
        if busy == 0 and not released and (clock is None or (
                clock.done and not any(r.num_requests for r in reports))):
            raise InvariantViolation("cluster replay stalled: requests are unfinished but "
                                     "none is queued or released")
        _count_backlogs(run, reports, busy, n)
        for report in reports:
            loads[report.instance] = Load(report.queued_tokens, report.num_requests)
            if report.events:
                router.observe(report.instance, report.events)
            for done in report.finished:
                dispatcher.finished(done.trace_index)
                if done.times is not None:
                    run.request_times[trace.requests[done.trace_index].request_id] = \
                        done.times
                guess = predicted.pop(done.trace_index, 0)
                run.predicted_hit_tokens += guess
                run.phantom_hit_tokens += max(0, guess - done.hit_tokens)
        if progress is not None:
            progress(total - dispatcher.num_unfinished, total)
    run.instances = backend.results()
    if timing is not None:
        run.time = cluster_time_summary(run, timing.slo, n)
    run.seconds = time.perf_counter() - started
    return run


class ArrivalClock:
    """``--clock time``: open-loop release, epoch by epoch: at the start of epoch ``k``
    (``k · epoch_seconds``) every request that has arrived by then is routed."""

    def __init__(self, trace: Trace, timing: TimeSettings, epoch_seconds: float) -> None:
        times = arrival_times([r.arrival_seconds for r in trace.requests],
                              time_scale=timing.time_scale, rate=timing.rate,
                              seed=timing.seed)
        self._pending = deque(sorted((t, i) for i, t in enumerate(times)))
        self._epoch_seconds = epoch_seconds
        self._epoch = 0

    @property
    def done(self) -> bool:
        return not self._pending

    def release(self) -> list[int]:
        now = self._epoch * self._epoch_seconds
        self._epoch += 1
        released = []
        while self._pending and self._pending[0][0] <= now:
            released.append(self._pending.popleft()[1])
        return released


def _route(trace: Trace, router: Router, released: Sequence[int], loads: list[Load],
           run: ClusterRun, predicted: dict[int, int]) -> dict[int, list[int]]:
    """Route the released requests in order; each updates its instance's load view."""
    arrivals: dict[int, list[int]] = {}
    n = len(loads)
    for index in released:
        request = trace.requests[index]
        route: Route = router.route(
            RouteRequest(index, request.request_id, request.session_id,
                         request.input_length), loads)
        if not 0 <= route.instance < n:
            raise InvariantViolation(f"router {router.name!r} chose instance "
                                     f"{route.instance} of {n}")
        arrivals.setdefault(route.instance, []).append(index)
        load = loads[route.instance]
        load.queued_tokens += request.input_length
        load.num_requests += 1
        run.routed_by_instance[route.instance] += 1
        if route.predicted_hit_tokens:
            predicted[index] = route.predicted_hit_tokens
    return arrivals


def _count_backlogs(run: ClusterRun, reports: Sequence[InstanceReport], busy: int,
                    n: int) -> None:
    """Add the epoch's per-step backlogs to the run's balance sums."""
    for step in range(busy):
        backlog = [r.queued_tokens_by_step[step] if step < len(r.queued_tokens_by_step)
                   else 0 for r in reports]
        top = max(backlog)
        run.backlog_max_sum += top
        run.backlog_mean_sum += sum(backlog) / n
        run.backlog_peak = max(run.backlog_peak, top)
    run.steps += busy


def cluster_time_summary(run: ClusterRun, slo: SLO | None,
                         num_instances: int) -> dict[str, float]:
    """``sim.timed.summarise`` over every instance's requests; the busy fraction is the
    instances' busy seconds over ``num_instances`` x the makespan."""
    summary = summarise(TimedRun(dict(run.request_times)), slo)
    span = summary["makespan_s"] or 1e-12
    summary["busy_fraction"] = sum(r.busy_seconds for r in run.instances) / (
        num_instances * span)
    return summary


def serial_backend(trace: Trace, config: CacheConfig, policy: str,
                   settings: ClusterSettings, *, events: bool) -> SerialBackend:
    return SerialBackend(InstanceGroup(range(settings.num_instances), trace, config, policy,
                                       settings.instance, events=events))


def split_instances(num_instances: int, num_workers: int) -> list[list[int]]:
    """Instances of each worker: round-robin, no empty worker.

    >>> split_instances(5, 2), split_instances(2, 4)
    ([[0, 2, 4], [1, 3]], [[0], [1]])
    """
    workers = min(num_instances, num_workers)
    return [list(range(w, num_instances, workers)) for w in range(workers)]


__all__: Sequence[str] = (
    "Backend", "ClusterRun", "ClusterSettings", "Dispatcher", "SerialBackend", "run_cluster",
    "serial_backend", "split_instances",
)
