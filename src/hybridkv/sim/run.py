"""Replays of one source under many policies and admission orders, with their reference
limits (ceiling, offline bound): serially or on ``jobs`` forked processes (bounds shared
per distinct admission log). The library behind ``hybridkv replay`` (``hybridkv.cli.replay``)
and the sweep's cells.
"""

from __future__ import annotations

import difflib
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError, PoolTooSmallError
from hybridkv.limits import check_pool_fits
from hybridkv.models.shapes import ModelShape, num_blocks_for_memory, parse_size
from hybridkv.parallel.processes import worker_init
from hybridkv.parallel.task_feed import TaskFeed
from hybridkv.policies import CORE_POLICIES, PolicySpec
from hybridkv.sim.bound import AdmissionLog, BoundShape
from hybridkv.sim.bound_share import BoundBroker, BoundKeys, BoundPair, set_bounds, shared_bounds
from hybridkv.sim.ceiling import infinite_cache_ceiling
from hybridkv.sim.replay import ProgressFn, ReplaySettings, RunResult, attach_bounds, replay
from hybridkv.sim.report import PolicyRun
from hybridkv.traces.source import MICROBENCH, Source
from hybridkv.traces.trace import Trace

DEFAULT_MODEL = "gemma3-bench"
DEFAULT_KV_MEMORY = "64GiB"
PROTOCOL_POOLS = {(MICROBENCH, "dsv4-bench"): 3_716, (MICROBENCH, "gemma3-bench"): 60_230}
"""Pool sizes the replay protocol fixes for the retention microbenchmark."""


ALL_RETENTIONS = ("prepend", "latest", "interval:32768")
ALL_EVICTIONS = ("", "+scan", "+chain", "+scan+chain", "+session", "+scan+chain+session")


PREDICT_POLICIES = ("prepend+scan+predict", "latest+predict+recompute",
                    "interval:32768+predict+recompute", "latest+scan+predict+recompute")
"""The ``predict`` variants ``--policy all`` reports (one per family that can gain)."""


def all_policies(has_sessions: bool) -> list[str]:
    """Every retention × eviction combination worth reporting (``--policy all``): the
    vLLM-equivalent retentions with each eviction order, then the sparse retentions with
    window recompute, then the ``predict`` variants; session ones only for traces with
    sessions."""
    plain = [r + e for r in ALL_RETENTIONS for e in ALL_EVICTIONS
             if has_sessions or "session" not in e]
    bridged = [r + e + "+recompute" for r in ALL_RETENTIONS[1:]
               for e in ("", "+scan", "+scan+session")
               if has_sessions or "session" not in e]
    return plain + bridged + list(PREDICT_POLICIES)


def parse_policies(text: str, has_sessions: bool = False) -> list[str]:
    """``core``, ``all`` or a comma-separated list, each validated by name (a typo gets a
    suggestion).

    >>> parse_policies("latest,dense")
    ['latest', 'dense']
    >>> parse_policies("lastest")
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: --policy='lastest' is invalid: did you mean 'latest'? ...
    """
    names = [p.strip() for p in text.split(",")]
    if not any(names):
        raise ConfigError("--policy", text, "name at least one policy, e.g. latest,prepend")
    expanded: list[str] = []
    for name in names:
        if not name:
            raise ConfigError("--policy", text, "has an empty name between commas")
        if name == "core":
            expanded.extend(CORE_POLICIES)
        elif name == "all":
            expanded.extend(all_policies(has_sessions))
        else:
            try:
                PolicySpec.parse(name)  # unknown names fail here, before any replay
            except ConfigError as err:
                raise _policy_error(name, err) from err
            expanded.append(name)
    return list(dict.fromkeys(expanded))


def check_policies_fit(policies: Sequence[str], alignment_tokens: int, typed: str) -> None:
    """Check each policy's retention against a model's hit alignment before any replay; the
    error names ``--policy`` and, for a policy that ``core`` or ``all`` brought in, says so.

    >>> check_policies_fit(["latest", "interval:32768"], 48, "core")
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: --policy='interval:32768' is invalid: must be a positive \
multiple of the hit alignment 48 tokens (lcm of the groups' block sizes), e.g. 32736; \
--policy core includes it: list the policies instead
    """
    named = {part.strip() for part in typed.split(",")}
    for policy in policies:
        try:
            PolicySpec.parse(policy).retention_policy().validate(alignment_tokens, True)
        except ConfigError as err:
            origin = "" if policy in named else \
                f"; --policy {typed} includes it: list the policies instead"
            raise ConfigError("--policy", policy, f"{err.fix}{origin}") from err


def _policy_error(name: str, err: ConfigError) -> ConfigError:
    known = ["core", "all", *CORE_POLICIES, *all_policies(True)]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError("--policy", name, f"{hint}{err.fix}")


def resolve_pool(num_blocks: int | None, kv_memory: str | None, shape: ModelShape,
                 source: Source, *, num_processes: int = 1) -> int:
    """Pool size in blocks from ``--num-blocks`` or ``--kv-memory`` (or the protocol's or
    the default), refused when it is below 2 blocks or its bookkeeping would not fit in
    this host's available memory (``hybridkv.limits``)."""
    if num_blocks is not None:
        if num_blocks < 2:
            raise ConfigError("--num-blocks", num_blocks, "must be >= 2 (block 0 is reserved)")
        check_pool_fits(num_blocks, flag="--num-blocks", value=num_blocks,
                        num_processes=num_processes)
        return num_blocks
    if kv_memory is None:
        protocol = PROTOCOL_POOLS.get((source.workload or "", shape.name))
        if protocol is not None:
            return protocol
        kv_memory = DEFAULT_KV_MEMORY
    try:
        blocks = num_blocks_for_memory(shape, parse_size(kv_memory))
    except ConfigError as err:
        raise ConfigError("--kv-memory", kv_memory, err.fix) from err
    check_pool_fits(blocks, flag="--kv-memory", value=kv_memory, num_processes=num_processes)
    return blocks


def check_pool_holds_requests(source: Source, config: CacheConfig) -> None:
    """Raise ``PoolTooSmallError`` for the first request whose tokens (prompt and every
    output token but the last) need more full-attention blocks than the pool holds: no
    schedule can ever finish it. A lower bound (window and other groups need blocks too);
    the replay itself catches the rest (``replay``'s no-progress check)."""
    full = [g.spec.block_size for g in config.groups  # compressed attention counts too
            if g.spec.is_full_attention]
    if not full:
        return
    usable = config.num_blocks - 1
    for trace in source.scenarios.values():
        for request in trace.requests:
            num_tokens = request.input_length + max(1, request.output_length) - 1
            needed = sum(-(-num_tokens // block_size) for block_size in full)
            if needed > usable:
                raise PoolTooSmallError(request.request_id, num_tokens, needed,
                                        config.num_blocks, origin=trace.origin)


def pool_summary(shape: ModelShape, config: CacheConfig) -> dict[str, object]:
    """The pool as the report states it: blocks, token slots (blocks × tokens per block of
    the first group) and bytes."""
    block_size = config.groups[0].spec.block_size
    bytes_per_block = shape.bytes_per_block
    return {"num_blocks": config.num_blocks, "block_tokens": block_size,
            "pool_token_slots": config.num_blocks * block_size,
            "pool_bytes": config.num_blocks * bytes_per_block}



@contextmanager
def progress_bar(enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    with progress:
        yield progress


def run_policy(source: Source, config: CacheConfig, policy: str, settings: ReplaySettings,
               progress: Progress | None) -> PolicyRun:
    """Replay every scenario of ``source`` under ``policy``, with its bounds (memoized per
    distinct admission log: ``hybridkv.sim.bound_share``)."""
    results = replay_policy(source, config, policy, settings, progress)
    for key, result in results.items():
        attach_bounds(result, source.scenarios[key], config)
    return policy_run(source, results)


def replay_policy(source: Source, config: CacheConfig, policy: str, settings: ReplaySettings,
                  progress: Progress | None) -> dict[str, RunResult]:
    """Replay every scenario of ``source`` under ``policy``; each result keeps its
    admission log (no bounds yet)."""
    results: dict[str, RunResult] = {}
    for key, trace in source.scenarios.items():
        label = f"{policy} f={key}" if key else policy
        if settings.admission != "fcfs":
            label += f" [{settings.admission}]"
        callback: ProgressFn | None = None
        if progress is not None:
            task = progress.add_task(label, total=len(trace.requests))
            callback = _throttled(progress, task)
        results[key] = replay(trace, config, policy, settings, callback)
        if progress is not None:
            progress.remove_task(task)
    return results


def policy_run(source: Source, results: dict[str, RunResult]) -> PolicyRun:
    """One policy's run from its scenarios' results (bounds attached): the trace's result,
    or the microbenchmark's fractions and their merged replay phases."""
    if not source.is_multi_scenario:
        return PolicyRun(results[""], {})
    total: RunResult | None = None
    for result in results.values():
        measured = _replay_phase_only(result)
        total = measured if total is None else _merged(total, measured)
    assert total is not None
    return PolicyRun(total, dict(results))


def log_keys(source: Source, config: CacheConfig,
             results: dict[str, RunResult]) -> dict[str, BoundKeys]:
    """``BoundKeys`` of each scenario's admission log (none without full attention); the
    logs that get none are dropped from ``results`` (nothing will bound them)."""
    shape = BoundShape.of(config)
    keys = {} if shape is None else {
        key: BoundKeys.of(source.scenarios[key], result.log, shape)
        for key, result in results.items() if result.log is not None}
    for scenario, result in results.items():
        if scenario not in keys:
            result.log = None
    return keys


def scenario_bounds(source: Source, config: CacheConfig, scenario: str, log: AdmissionLog,
                    keys: BoundKeys) -> BoundPair:
    """The bound task of a parallel run: ``(bound, bound_fa)`` of one distinct log."""
    shape = BoundShape.of(config)
    assert shape is not None
    return shared_bounds(source.scenarios[scenario], log, shape, keys)


_WORK: tuple[Source, CacheConfig, ReplaySettings] | None = None
"""What forked workers replay (inherited through fork, never pickled)."""

_LIMITS = ("", "")
"""Worker task of the ceiling + bound computation (no policy has an empty name)."""

Task = tuple[str, str]
"""(policy, admission order) of one replay."""


@dataclass(frozen=True, slots=True)
class BoundTask:
    """Worker task of a parallel run: the bounds of one distinct admission log."""

    scenario: str
    log: AdmissionLog
    keys: BoundKeys


@dataclass(slots=True)
class Replayed:
    """A worker's replay of one policy: each scenario's result with its log, and the
    logs' ``BoundKeys`` (the parent starts one ``BoundTask`` per distinct key)."""

    results: dict[str, RunResult]
    keys: dict[str, BoundKeys]


@dataclass(frozen=True, slots=True)
class Limits:
    """The report's reference columns: infinite-cache ceiling and offline optimum."""

    ceiling: float
    bound: float | None


def source_limits(source: Source, config: CacheConfig) -> Limits:
    """The ceiling; ``bound`` / ``bound_fa`` come with each run (its admission order)."""
    return Limits(source_ceiling(source, config.alignment_tokens), None)



def _run_in_worker(item: tuple[int, Task] | BoundTask) -> Replayed | Limits | BoundPair:
    """One task of a parallel run: a bound, the limits, or a replay (``(position, task)``;
    its results keep only the logs that have ``BoundKeys``)."""
    assert _WORK is not None
    source, config, settings = _WORK
    if isinstance(item, BoundTask):
        return scenario_bounds(source, config, item.scenario, item.log, item.keys)
    task = item[1]
    if task == _LIMITS:
        return source_limits(source, config)
    results = replay_policy(source, config, task[0], replace(settings, admission=task[1]), None)
    return Replayed(results, log_keys(source, config, results))


def _dispatch_order(tasks: Sequence[Task]) -> list[int]:
    """Task indices, expected-longest first (a greedy longest-first schedule shortens the
    run on few processes): sparse retentions (``RetentionPolicy.is_sparse``) after the
    others, the limits last.

    >>> _dispatch_order([("latest", "fcfs"), ("interval:32768", "hit"), ("dense", "fcfs"),
    ...                  ("", "")])
    [2, 0, 1, 3]
    """
    def rank(index: int) -> int:
        name = tasks[index][0]
        if tasks[index] == _LIMITS:
            return 2
        return 1 if PolicySpec.parse(name).retention_policy().is_sparse else 0
    return sorted(range(len(tasks)), key=rank)


def run_policies(source: Source, config: CacheConfig, policies: Sequence[str],
                 settings: ReplaySettings, *, jobs: int = 1,
                 show_progress: bool = True,
                 admissions: Sequence[str] | None = None) -> tuple[Limits, list[PolicyRun]]:
    """Compute the limits and replay every policy under every admission order (default:
    ``settings.admission``; order-major), in ``jobs`` forked processes when > 1 (the limits
    then run as one more task, last, beside the replays; results in order)."""
    if jobs < 1:
        raise ConfigError("--jobs", jobs, "must be a positive number of processes")
    all_tasks = [(p, a) for a in (admissions or (settings.admission,)) for p in policies]
    if jobs == 1 or len(all_tasks) == 1:
        limits = source_limits(source, config)
        with progress_bar(show_progress) as progress:
            return limits, [run_policy(source, config, p, replace(settings, admission=a),
                                       progress) for p, a in all_tasks]
    return _run_parallel(source, config, settings, all_tasks, jobs, show_progress)


def _run_parallel(source: Source, config: CacheConfig, settings: ReplaySettings,
                  all_tasks: Sequence[Task], jobs: int,
                  show_progress: bool) -> tuple[Limits, list[PolicyRun]]:
    """``run_policies`` on ``jobs`` forked processes: the replays longest first, the limits
    last, and one bound task per distinct admission log, started before any replay not
    begun yet (``BoundKeys``: policies that logged the same admissions share it)."""
    global _WORK  # noqa: PLW0603 - handed to forked workers without pickling the trace
    _WORK = (source, config, settings)
    try:
        context = multiprocessing.get_context("fork")
        # NOTE: leaving the with block (results, Ctrl-C, SIGTERM turned into an exception by
        # the CLI) terminates the workers: Pool.__exit__ calls terminate()
        with progress_bar(show_progress) as progress, context.Pool(
                jobs, initializer=worker_init, initargs=(os.getpid(),)) as pool:
            task = None if progress is None else progress.add_task(
                f"{len(all_tasks)} replays on {jobs} processes", total=len(all_tasks) + 1)
            tasks = [*all_tasks, _LIMITS]
            feed: TaskFeed[tuple[int, Task] | BoundTask, Replayed | Limits | BoundPair] = \
                TaskFeed(pool, _run_in_worker, jobs)
            for i in _dispatch_order(tasks):
                feed.add((i, tasks[i]))
            computed: Limits | None = None
            replayed: dict[int, Replayed] = {}
            runs: dict[int, PolicyRun] = {}
            broker: BoundBroker[tuple[int, str]] = BoundBroker()
            for done, outcome in feed:
                if isinstance(done, BoundTask):
                    assert isinstance(outcome, tuple)
                    for index, scenario in broker.resolve(done.keys, outcome):
                        set_bounds(replayed[index].results[scenario], outcome)
                        _finish(source, replayed, runs, index)
                elif isinstance(outcome, Limits):
                    computed = outcome
                else:
                    assert isinstance(outcome, Replayed)
                    index = done[0]
                    replayed[index] = outcome
                    for scenario in broker.place(index, outcome.results, outcome.keys):
                        log = outcome.results[scenario].log
                        assert log is not None
                        feed.add(BoundTask(scenario, log, outcome.keys[scenario]), first=True)
                    _finish(source, replayed, runs, index)
                if progress is not None and task is not None and not isinstance(done, BoundTask):
                    progress.advance(task)
        assert computed is not None and len(runs) == len(all_tasks)
        return computed, [runs[i] for i in range(len(all_tasks))]
    finally:
        _WORK = None


def _finish(source: Source, replayed: dict[int, Replayed], runs: dict[int, PolicyRun],
            index: int) -> None:
    """Turn replay ``index`` into its ``PolicyRun`` once every scenario has its bounds
    (a scenario without full attention never had a log)."""
    results = replayed[index].results
    if all(result.log is None for result in results.values()):
        del replayed[index]
        runs[index] = policy_run(source, results)


def _throttled(progress: Progress, task: object) -> ProgressFn:
    """Progress callback that touches the bar only when a request finished (the replay
    calls it every step; most steps finish nothing)."""
    shown = -1

    def update(num_finished: int, num_requests: int) -> None:
        nonlocal shown
        if num_finished != shown:
            shown = num_finished
            progress.update(task, completed=num_finished)  # type: ignore[arg-type]
        del num_requests

    return update


def _replay_phase_only(result: RunResult) -> RunResult:
    """Run-level numbers of a microbenchmark scenario = its replay phase."""
    phase = result.by_tag.get("replay")
    copy = RunResult(result.policy, result.num_blocks, preemptions=result.preemptions,
                     misses=result.misses_by_tag.get("replay", result.misses),
                     misses_by_tag=dict(result.misses_by_tag),
                     bound_hit_tokens=result.bound_hit_tokens,
                     bound_fa_hit_tokens=result.bound_fa_hit_tokens,
                     bridge_tokens=result.bridge_tokens,
                     steps=result.steps, evicted_blocks=result.evicted_blocks,
                     manager_seconds=result.manager_seconds, hash_seconds=result.hash_seconds,
                     wall_seconds=result.wall_seconds, by_tag=dict(result.by_tag),
                     admission=result.admission, scheduler_seconds=result.scheduler_seconds,
                     wait_steps=result.wait_steps)
    if phase is not None:
        copy.requests, copy.prompt_tokens, copy.hit_tokens = (
            phase.requests, phase.prompt_tokens, phase.hit_tokens)
    return copy


def _merged(a: RunResult, b: RunResult) -> RunResult:
    merged = RunResult(a.policy, a.num_blocks, admission=a.admission)
    merged.merge(a)
    merged.merge(b)
    return merged


def source_ceiling(source: Source, alignment_tokens: int) -> float:
    """Ceiling of the measured requests (the replay phase for the microbenchmark)."""
    prompt = hits = 0
    for trace in source.scenarios.values():
        ceiling = infinite_cache_ceiling(trace, alignment_tokens)
        if source.is_multi_scenario:
            fill = [r for r in trace.requests if r.tag != "replay"]
            fill_ceiling = infinite_cache_ceiling(Trace(trace.name, tuple(fill)),
                                                  alignment_tokens)
            prompt += ceiling.prompt_tokens - fill_ceiling.prompt_tokens
            hits += ceiling.hit_tokens - fill_ceiling.hit_tokens
        else:
            prompt += ceiling.prompt_tokens
            hits += ceiling.hit_tokens
    return hits / prompt if prompt else 0.0


__all__ = [
    "DEFAULT_MODEL", "Limits", "all_policies", "check_policies_fit", "check_pool_holds_requests",
    "log_keys", "parse_policies", "policy_run", "pool_summary", "progress_bar", "replay_policy",
    "resolve_pool", "run_policies", "scenario_bounds", "source_ceiling",
]
