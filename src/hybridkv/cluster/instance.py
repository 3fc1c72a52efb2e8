"""One serving instance of a cluster replay: its own cache manager, pool and scheduler.

An ``Instance`` is driven from outside in *epochs*: ``advance(arrivals, num_steps)`` queues
the requests the router sent it (trace indices) and runs up to ``num_steps`` scheduler
steps (fewer when it runs dry; an idle instance does nothing). It reports what a router
could learn about it at the epoch's end — the KV events its manager emitted (the only
window into its cache) and its load — plus, for the cluster report only, which requests
finished and what they hit.

Its result depends only on the sequence of ``advance`` calls, never on which process runs
it, so serial, ``--jobs`` and ``--ray`` replays agree exactly.

>>> from hybridkv.models.shapes import load_model
>>> from hybridkv.traces.trace import Trace, TraceRequest
>>> trace = Trace("t", (TraceRequest("a", 40, 2, token_ids=tuple(range(40))),
...                     TraceRequest("b", 40, 2, token_ids=tuple(range(40)))))
>>> config = load_model("gemma3-bench").cache_config(64)
>>> instance = Instance(0, trace, config, "latest", InstanceSettings())
>>> report = instance.advance([0], 10)
>>> report.finished, report.queued_tokens_by_step   # 1 prefill step + 1 decode step
((Finished(trace_index=0, prompt_tokens=40, hit_tokens=0),), (0, 0))
>>> instance.advance([1], 10).finished[0].hit_tokens  # 2 whole 16-token blocks cached
32
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.cache import KVCacheManager
from hybridkv.config import CacheConfig
from hybridkv.sched.driver import Driver, ModelClock, OutputSampler, RequestTimes
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan
from hybridkv.sim.replay import no_progress_error
from hybridkv.sim.timed import TimeSettings, arrival_times
from hybridkv.traces.prompts import LazyPrompt, PromptHasher
from hybridkv.traces.trace import OUTPUT_TOKEN_BASE, Trace

OUTPUT_IDS_PER_INSTANCE = 1 << 50
"""Output-id range of each instance: instance ``i`` samples unique ids from
``OUTPUT_TOKEN_BASE + i * 2**50`` (below ``2**62`` for up to 2,048 instances), so two
instances never produce equal generated tokens by accident."""

MAX_INSTANCES = 2048


@dataclass(frozen=True, slots=True)
class InstanceSettings:
    """Scheduler knobs of every instance (the replay protocol's)."""

    max_running: int = 16
    chunk_size: int = 8192
    lookahead_requests: int = 256
    admission: str = "fcfs"
    check_invariants: bool = False
    timing: TimeSettings | None = None
    """``--clock time``: every instance's steps last what the cost model says and an epoch
    is ``epoch_seconds`` long (``None``: the step clock)."""
    epoch_seconds: float = 0.05


@dataclass(frozen=True, slots=True)
class Finished:
    """A request that finished on an instance: its prompt and first-admission hit."""

    trace_index: int
    prompt_tokens: int
    hit_tokens: int
    times: RequestTimes | None = field(default=None, repr=False)
    """``--clock time``: arrival, admission, first token and finish (seconds)."""


@dataclass(frozen=True, slots=True)
class InstanceReport:
    """What one epoch of one instance produced.

    ``events``: the epoch's KV events as vLLM 0.33 publishes them — msgpack-encoded
    ``KVEventBatch`` payloads (``hybridkv.events.encode_batch``; ``ts`` = the instance's
    epoch count, so the bytes are deterministic), one per epoch that emitted any, empty when
    events are off; ``queued_tokens_by_step``: after each step run, the prompt tokens of its
    requests not yet computed (a waiting request counts its whole prompt, a running one
    what its prefill has left) — an idle instance runs no steps and has none queued.
    """

    instance: int
    finished: tuple[Finished, ...]
    queued_tokens_by_step: tuple[int, ...]
    queued_tokens: int
    num_requests: int
    """Requests queued or running at the epoch's end."""
    events: tuple[bytes, ...] = ()


@dataclass(slots=True)
class InstanceResult:
    """Counters of one instance over the whole replay."""

    instance: int
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    bridge_tokens: int = 0
    evicted_blocks: int = 0
    busy_steps: int = 0
    manager_seconds: float = 0.0
    busy_seconds: float = 0.0
    """``--clock time``: seconds of steps the cost model gave this instance."""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Instance:
    """A manager + scheduler pair replaying the requests routed to it."""

    def __init__(self, index: int, trace: Trace, config: CacheConfig, policy: str,
                 settings: InstanceSettings, *, events: bool = False) -> None:
        if not 0 <= index < MAX_INSTANCES:
            raise ValueError(f"instance index {index} outside [0, {MAX_INSTANCES})")
        self.index = index
        self.trace = trace
        self.config = config
        self.policy = policy
        self.settings = settings
        self.manager = make_manager(config, policy, events)
        self.events = events
        self.scheduler = Scheduler(self.manager, max_running=settings.max_running,
                                   chunk_size=settings.chunk_size,
                                   lookahead_requests=settings.lookahead_requests,
                                   admission=settings.admission)
        self._hasher = PromptHasher(self.manager.hasher)
        self._sampler = OutputSampler(first_id=OUTPUT_TOKEN_BASE
                                      + index * OUTPUT_IDS_PER_INSTANCE)
        self._index_of: dict[str, int] = {}
        self._epochs = 0
        timing = settings.timing
        self._cost = None if timing is None else timing.cost_model(config)
        self._arrivals = [] if timing is None else arrival_times(
            [r.arrival_seconds for r in trace.requests], time_scale=timing.time_scale,
            rate=timing.rate, seed=timing.seed)
        cost = self._cost
        self.driver = Driver(
            self.scheduler, self._execute, on_step=self._on_step,
            clock=None if cost is None else ModelClock(), record=cost is not None,
            step_seconds=None if cost is None else (lambda plan: cost.seconds(plan.chunks)))
        self._finished: list[Finished] = []

    @property
    def clock_s(self) -> float:
        """``--clock time``: the instance's simulated seconds (0 on the step clock)."""
        return self.driver.now()

    @property
    def busy_seconds(self) -> float:
        return self.driver.busy_s

    @property
    def busy_steps(self) -> int:
        return self.driver.num_steps

    def advance(self, arrivals: Sequence[int], num_steps: int) -> InstanceReport:
        """Queue ``arrivals`` (trace indices, in routing order) and run at most
        ``num_steps`` steps (``--clock time``: until the epoch's end)."""
        scheduler, driver = self.scheduler, self.driver
        for index in arrivals:
            request = self.trace.requests[index]
            self._index_of[request.request_id] = index
            self._sampler.add(request)
            driver.add(SchedRequest(
                request.request_id, LazyPrompt(request, index), max(1, request.output_length),
                session_id=request.session_id, phase=request.phase, tag=request.tag,
                hash_prompt=self._hasher.for_request(request)
                if self.config.enable_caching else None),
                self._arrivals[index] if self._cost is not None else None)  # its true
            # arrival: the routing wait counts
        self._finished = []
        queued: list[int] = []
        until = (self._epochs + 1) * self.settings.epoch_seconds
        for _ in range(num_steps if self._cost is None else 1 << 62):
            if not scheduler.has_unfinished or (self._cost is not None
                                                and self.clock_s >= until):
                break
            driver.step()
            queued.append(self.queued_tokens())
        if driver.clock is not None:
            driver.clock.wait_until(until)  # idle to the epoch's end
        events = self._take_events()
        return InstanceReport(self.index, tuple(self._finished), tuple(queued),
                              queued[-1] if queued else self.queued_tokens(),
                              len(scheduler.waiting) + len(scheduler.running), events)

    def _execute(self, plan: StepPlan) -> dict[str, int]:
        scheduler = self.scheduler
        if not plan.chunks:
            raise no_progress_error(self.trace, self.policy, self.config, self.manager,
                                    scheduler, plan.preempted)
        return {chunk.req_id: self._sampler.sample(scheduler.requests[chunk.req_id])
                for chunk in plan.chunks if chunk.samples}

    def _on_step(self, plan: StepPlan, finished: Sequence[str]) -> None:
        del plan
        times = self.driver.run.requests
        for req_id in finished:
            request = self.scheduler.requests.pop(req_id)
            self._sampler.forget(req_id)
            self._finished.append(Finished(self._index_of.pop(req_id),
                                           len(request.prompt_token_ids),
                                           request.first_hit_tokens or 0,
                                           times.pop(req_id, None)))
        if self.settings.check_invariants:
            self.manager.check_invariants()

    def queued_tokens(self) -> int:
        """Prompt tokens routed here and not yet computed (or loaded from the cache)."""
        manager = self.manager
        total = sum(len(r.prompt_token_ids) for r in self.scheduler.waiting)
        for request in self.scheduler.running:
            left = len(request.prompt_token_ids) - manager.num_computed_tokens(request.req_id)
            total += max(0, left)
        return total

    def _take_events(self) -> tuple[bytes, ...]:
        self._epochs += 1
        if not self.events:
            return ()
        events = self.manager.take_events()
        if not events:
            return ()
        from hybridkv.events import KVEventBatch, encode_batch

        return (encode_batch(KVEventBatch(ts=float(self._epochs), events=events,
                                          data_parallel_rank=0)),)

    def result(self) -> InstanceResult:
        stats = self.manager.stats
        return InstanceResult(
            self.index, requests=stats.requests, prompt_tokens=stats.queries,
            hit_tokens=stats.hits, preemptions=self.scheduler.num_preemptions,
            bridge_tokens=stats.bridge_tokens,
            evicted_blocks=sum(stats.evicted_blocks_by_group), busy_steps=self.busy_steps,
            manager_seconds=self.manager.manager_seconds, busy_seconds=self.busy_seconds)


def make_manager(config: CacheConfig, policy: str, events: bool) -> KVCacheManager:
    """The instance's manager (emitting KV events when ``events``)."""
    if events:
        return KVCacheManager(config, policy, enable_kv_cache_events=True)
    return KVCacheManager(config, policy)


class InstanceGroup:
    """The instances one process (or Ray actor) runs, addressed by cluster index."""

    def __init__(self, indices: Sequence[int], trace: Trace, config: CacheConfig,
                 policy: str, settings: InstanceSettings, *, events: bool = False) -> None:
        self.instances = {i: Instance(i, trace, config, policy, settings, events=events)
                          for i in indices}

    def advance(self, arrivals: dict[int, list[int]], num_steps: int,
                ) -> list[InstanceReport]:
        """One epoch of each instance of the group, in index order."""
        return [instance.advance(arrivals.get(i, ()), num_steps)
                for i, instance in sorted(self.instances.items())]

    def results(self) -> list[InstanceResult]:
        return [instance.result() for _, instance in sorted(self.instances.items())]


__all__ = ["Finished", "Instance", "InstanceGroup", "InstanceReport", "InstanceResult",
           "InstanceSettings", "make_manager"]
