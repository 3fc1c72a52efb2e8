"""Open-loop runs in seconds: requests arrive at their times, steps take the time a clock
gives them, and every request's TTFT, TPOT, queueing and end-to-end latency is recorded.

``drive`` is the one loop both sides of the time model use: the replay (``ModelClock``:
each step advances the clock by the cost model's prediction) and the reference engine on a
GPU (``WallClock``: a step takes what it takes; ``bench/calibrate.py``). Per step::

    add the requests whose arrival time has come      (none running and none come: jump or
    plan = scheduler.schedule()                        sleep to the next arrival)
    sampled = execute(plan)                           the engine runs it / the replay samples
    clock advances by step_seconds(plan) (model clock; the wall clock just moved)
    scheduler.update(plan, sampled)                   first tokens, finishes stamped at the
                                                      step's end

Arrival process (``arrival_times``): the trace's ``arrival_seconds`` (relative to its first
arrival) times ``time_scale`` (2 = half the rate, 0.5 = twice); ``rate`` replaces them by a
Poisson process of ``rate`` requests per second (exponential gaps, ``random.Random(seed)``),
the process for workloads and traces without times. A session's next request still waits
for its previous one (the scheduler's rule), so its TTFT includes that wait.

>>> arrival_times([0.0, 2.0, 3.0], time_scale=0.5)
[0.0, 1.0, 1.5]
>>> [round(t, 3) for t in arrival_times([None, None, None], rate=2.0)]
[0.0, 0.93, 1.64]
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError, InvariantViolation
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan
from hybridkv.timing import StepCostModel, cost_model, gpu_named


def arrival_times(arrivals: Sequence[float | None], *, time_scale: float = 1.0,
                  rate: float | None = None, seed: int = 0) -> list[float]:
    """Seconds from the run's start at which each request arrives (see the module)."""
    if not time_scale > 0:
        raise ConfigError("time_scale", time_scale, "must be a positive factor (1 = as "
                          "recorded, 0.5 = twice the rate)")
    if rate is not None or any(a is None for a in arrivals):
        if rate is None or not rate > 0:
            raise ConfigError("rate", rate, "requests per second > 0 (the trace has no "
                              "arrival times: pass --rate)")
        rng, now, out = random.Random(seed), 0.0, []
        for index in range(len(arrivals)):
            if index:
                now += rng.expovariate(rate)
            out.append(now)
        return out
    known = [float(a) for a in arrivals if a is not None]
    first = min(known, default=0.0)
    return [(a - first) * time_scale for a in known]


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


Execute = Callable[[StepPlan], Mapping[str, int]]
"""Runs a planned step and returns one sampled token per sampling chunk."""


def drive(scheduler: Scheduler, arrivals: Sequence[tuple[float, SchedRequest]],
          execute: Execute, clock: Clock,
          step_seconds: Callable[[StepPlan], float] | None = None,
          on_step: Callable[[StepPlan, Sequence[str]], None] | None = None) -> TimedRun:
    """Run ``arrivals`` (seconds, request; any order) through ``scheduler`` to the end.

    ``step_seconds`` (a model clock): the step's predicted time, added to ``clock`` after
    ``execute``. ``on_step(plan, finished)`` after every update.
    """
    pending = deque(sorted(arrivals, key=lambda a: a[0]))
    run = TimedRun()
    while pending or scheduler.has_unfinished:
        now = clock.now()
        while pending and pending[0][0] <= now:
            at, request = pending.popleft()
            scheduler.add_request(request)
            run.requests[request.req_id] = RequestTimes(at, len(request.prompt_token_ids))
        if not scheduler.has_unfinished:
            clock.wait_until(pending[0][0])
            continue
        started = clock.now()
        plan = scheduler.schedule()
        sampled = execute(plan)  # may raise its own error for an empty plan
        if not plan.chunks:
            raise InvariantViolation(f"step {scheduler.num_steps}: nothing could be "
                                     "scheduled (the pool cannot hold the next request)")
        if step_seconds is not None:
            clock.advance(step_seconds(plan))
        done = clock.now()
        _stamp(run, plan, sampled, started, done)
        run.steps.append((started, done - started, tuple(
            (c.num_computed_tokens, c.num_new_tokens, c.samples) for c in plan.chunks)))
        finished = scheduler.update(plan, sampled)
        for req_id in finished:
            run.requests[req_id].finished_s = done
        if on_step is not None:
            on_step(plan, finished)
    return run


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


def percentile_s(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (0 for none).

    >>> percentile_s([0.3, 0.1, 0.2], 50), percentile_s([], 99)
    (0.2, 0.0)
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]


@dataclass(frozen=True, slots=True)
class SLO:
    """Goodput's service-level objective: TTFT and TPOT limits in seconds."""

    ttft_s: float = float("inf")
    tpot_s: float = float("inf")

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft=2,tpot=0.05`` (seconds; ``ms`` suffix allowed; either may be left out).

        >>> SLO.parse("ttft=2, tpot=50ms")
        SLO(ttft_s=2.0, tpot_s=0.05)
        >>> SLO.parse("ttft=fast")
        Traceback (most recent call last):
        ...
        hybridkv.errors.ConfigError: slo='ttft=fast' is invalid: write ttft=SECONDS,\
tpot=SECONDS (e.g. ttft=2,tpot=50ms)
        """
        limits: dict[str, float] = {}
        fix = "write ttft=SECONDS,tpot=SECONDS (e.g. ttft=2,tpot=50ms)"
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            key, value = key.strip().lower(), value.strip().lower()
            scale = 1e-3 if value.endswith("ms") else 1.0
            value = value.removesuffix("ms").removesuffix("s")
            try:
                number = float(value) * scale
            except ValueError:
                raise ConfigError("slo", text, fix) from None
            if key not in ("ttft", "tpot") or key in limits or not number > 0:
                raise ConfigError("slo", text, fix)
            limits[key] = number
        if not limits:
            raise ConfigError("slo", text, fix)
        return cls(limits.get("ttft", float("inf")), limits.get("tpot", float("inf")))

    def met(self, times: RequestTimes) -> bool:
        return times.ttft_s <= self.ttft_s and times.tpot_s <= self.tpot_s


def summarise(run: TimedRun, slo: SLO | None = None) -> dict[str, float]:
    """Report fields of a run: TTFT p50/p90/p99, TPOT, e2e, queueing, throughputs,
    goodput (requests per second meeting ``slo``), GPU busy fraction."""
    reqs = [r for r in run.requests.values() if r.finished_s is not None]
    ttft = [r.ttft_s for r in reqs]
    tpot = [r.tpot_s for r in reqs if r.output_tokens > 1]
    span = run.makespan_s or 1e-12
    out = {"requests": float(len(reqs)), "makespan_s": run.makespan_s,
           "busy_fraction": run.busy_s / span,
           "input_tokens_per_s": sum(r.prompt_tokens for r in reqs) / span,
           "output_tokens_per_s": sum(r.output_tokens for r in reqs) / span}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", [r.e2e_s for r in reqs]),
                         ("queue", [r.queue_s for r in reqs])):
        for pct in (50, 90, 99):
            out[f"{name}_p{pct}_s"] = percentile_s(values, pct)
        out[f"{name}_mean_s"] = sum(values) / len(values) if values else 0.0
    if slo is not None:
        good = sum(1 for r in reqs if slo.met(r))
        out["goodput_rps"] = good / span
        out["slo_attained"] = good / len(reqs) if reqs else 0.0
    return out


@dataclass(frozen=True, slots=True)
class TimeSettings:
    """``--clock time``: the cost model (``model`` preset on ``gpu`` × ``tp``) and the
    arrival process (``time_scale``, ``rate``, ``seed``), goodput's ``slo``."""

    model: str
    gpu: str = "h200"
    tp: int = 1
    time_scale: float = 1.0
    rate: float | None = None
    seed: int = 0
    slo: SLO | None = None

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ConfigError("--rate", self.rate, "requests per second, > 0")
        if not self.time_scale > 0:
            raise ConfigError("--time-scale", self.time_scale,
                              "a positive factor (1 = trace times, 0.5 = twice the rate)")

    def cost_model(self, config: CacheConfig) -> StepCostModel:
        """The step-cost model of ``config``'s layers (one spec per layer of each group)."""
        if not self.model:
            raise ConfigError("model", self.model, "--clock time needs the model preset")
        layers = [group.spec for group in config.groups for _ in group.layer_ids]
        return cost_model(self.model, layers, self.gpu, self.tp)

    def label(self, config: CacheConfig) -> str:
        """What reports print: GPU, tensor parallelism, the calibration (or "scaled").

        >>> from hybridkv.specs import FullAttentionSpec
        >>> from hybridkv.config import CacheConfig
        >>> config = CacheConfig.from_layers([FullAttentionSpec(16, 4096)] * 32, 10)
        >>> TimeSettings("mistral-7b", gpu="b200", tp=2).label(config)
        'NVIDIA B200 x2 (scaled from h200)'
        """
        model = self.cost_model(config)
        text = model.gpu.name + (f" x{self.tp}" if self.tp > 1 else "")
        return text + (f" (scaled from {model.efficiencies.gpu})" if model.scaled else "")


def parse_time_settings(*, clock: str, model: str, gpu: str, tp: int, time_scale: float,
                        rate: float | None, slo: str | None) -> TimeSettings | None:
    """The ``--clock`` family of flags as settings (``None``: the step clock).

    >>> parse_time_settings(clock="step", model="x", gpu="h200", tp=1, time_scale=1.0,
    ...                     rate=None, slo=None) is None
    True
    >>> parse_time_settings(clock="wall", model="x", gpu="h200", tp=1, time_scale=1.0,
    ...                     rate=None, slo=None)
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: --clock='wall' is invalid: choose step (the default: \
scheduler steps) or time (seconds from the step-time model)
    """
    if clock == "step":
        return None
    if clock != "time":
        raise ConfigError("--clock", clock, "choose step (the default: scheduler steps) or "
                          "time (seconds from the step-time model)")
    try:  # a bad --gpu or --slo fails here, before any replay
        gpu_named(gpu)
        limits = SLO.parse(slo) if slo else None
    except ConfigError as err:
        raise ConfigError(f"--{err.field}", err.value, err.fix) from None
    return TimeSettings(model, gpu, tp, time_scale, rate, 0, limits)
