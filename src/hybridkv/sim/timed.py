"""Open-loop runs in seconds: requests arrive at their times, steps take the time a clock
gives them, and every request's TTFT, TPOT, queueing and end-to-end latency is recorded.

The loop is ``hybridkv.sched.driver`` (``drive``, ``Driver``: arrivals, the clock,
per-request times); this module holds what the time model adds around it: arrival
processes, SLOs, the run summary and the ``--clock time`` settings.

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

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError
from hybridkv.sched.driver import ModelClock, RequestTimes, TimedRun, WallClock, drive
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
        return _finite(out, "--rate", rate)
    known = [float(a) for a in arrivals if a is not None]
    first = min(known, default=0.0)
    return _finite([(a - first) * time_scale for a in known], "--time-scale", time_scale)


def _finite(times_s: list[float], flag: str, value: float) -> list[float]:
    """``times_s`` when its last (largest) arrival is a finite number of seconds; a
    ``ConfigError`` naming ``flag`` otherwise (``1e300`` s of trace times ``--time-scale
    1e300`` overflow to ``inf``, and every latency would be ``nan``).

    >>> _finite([0.0, 2.0], "--time-scale", 2.0)
    [0.0, 2.0]
    """
    if times_s and not math.isfinite(max(times_s)):
        raise ConfigError(flag, value, "the arrival times overflow to infinity; use a value "
                          "that keeps them finite (1 = as recorded)")
    return times_s


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
    >>> parse_time_settings(clock="step", model="x", gpu="h200", tp=1, time_scale=1.0,
    ...                     rate=None, slo="ttft=2")
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: --slo='ttft=2' is invalid: it sets the time model, which \
runs only with --clock time (the default step clock counts scheduler steps); add --clock time
    """
    if clock == "step":
        for flag, value, default in (("--gpu", gpu, "h200"), ("--tp", tp, 1),
                                     ("--time-scale", time_scale, 1.0), ("--rate", rate, None),
                                     ("--slo", slo, None)):
            if value != default:  # a time flag on the step clock would be ignored silently
                raise ConfigError(flag, value, "it sets the time model, which runs only with "
                                  "--clock time (the default step clock counts scheduler "
                                  "steps); add --clock time")
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


__all__ = [  # the loop and its clocks are hybridkv.sched.driver's, named here too
    "SLO", "ModelClock", "RequestTimes", "TimeSettings", "TimedRun", "WallClock", "arrival_times",
    "drive", "parse_time_settings", "percentile_s", "summarise",
]
