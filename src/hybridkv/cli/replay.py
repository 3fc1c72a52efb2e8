"""``hybridkv replay``: arguments → a ``Source``, scheduler settings and a pool; the replays
(``hybridkv.sim.run``); the table, JSON, plot and metrics.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError
from hybridkv.models.shapes import ModelShape, load_model
from hybridkv.outputs import check_output_paths, plot_output, write_outputs
from hybridkv.sched.admission import parse_admissions
from hybridkv.sim.host_replay import resolve_host_memory
from hybridkv.sim.observe import open_observers, parse_metrics_target
from hybridkv.sim.replay import ReplaySettings
from hybridkv.sim.report import Report, plot_policies, render_table
from hybridkv.sim.run import (
    DEFAULT_MODEL,
    check_policies_fit,
    check_pool_holds_requests,
    parse_policies,
    pool_summary,
    resolve_pool,
    run_policies,
)
from hybridkv.sim.timed import parse_time_settings
from hybridkv.traces.source import Source, load_source


def parse_params(items: Sequence[str]) -> dict[str, object]:
    """``KEY=VALUE`` pairs, values kept as text: the workload converts each to its
    parameter's type (``fractions=0.1,0.5`` → a tuple).

    >>> parse_params(["num-sessions=8", "fractions=0.1,0.5"])
    {'num_sessions': '8', 'fractions': '0.1,0.5'}
    """
    params: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", item, "use KEY=VALUE, e.g. --set num_sessions=8")
        if not value.strip():
            raise ConfigError("--set", item, f"give {key.strip()} a value, e.g. {key.strip()}=8")
        name = key.strip().replace("-", "_")
        if name in params:
            raise ConfigError("--set", item, f"{name} is set twice")
        params[name] = value.strip()
    return params



def resolve_source(args: argparse.Namespace) -> Source:
    """The ``Source`` that ``--trace`` / ``--workload`` / ``--set`` / ``--limit`` name."""
    params = parse_params(args.set)
    if args.trace is not None and params:
        raise ConfigError("--set", args.set, "workload parameters need --workload, not --trace")
    return load_source(args.trace, args.workload, params, args.limit)


def resolve_settings(args: argparse.Namespace, source: Source) -> ReplaySettings:
    defaults = source.protocol_defaults
    max_running = (defaults.get("max_running", 16) if args.max_running is None
                   else args.max_running)
    chunk_size = defaults.get("chunk_size", 8192) if args.chunk_size is None else args.chunk_size
    for flag, value in (("--max-running", max_running), ("--chunk-size", chunk_size)):
        if value <= 0:
            raise ConfigError(flag, value, "must be a positive integer")
    timing = parse_time_settings(
        clock=getattr(args, "clock", "step"), model=_model_name(args), gpu=args.gpu,
        tp=args.tp, time_scale=args.time_scale, rate=args.rate,
        slo=args.slo)
    if timing is not None and timing.rate is None and any(
            r.arrival_seconds is None for t in source.scenarios.values() for r in t.requests):
        raise ConfigError("--clock", "time", f"{source.name} has no arrival times: add "
                          "--rate REQUESTS_PER_SECOND (Poisson arrivals)")
    return ReplaySettings(max_running=max_running, chunk_size=chunk_size,
                          check_invariants=bool(getattr(args, "paranoid", False)),
                          timing=timing)


def _model_name(args: argparse.Namespace) -> str:
    """The preset whose matrix sizes the time model uses; ``""`` for a sweep's several
    models (each cell sets its own: ``sweep.cells.replay_cell``)."""
    model = args.model or DEFAULT_MODEL
    if isinstance(model, list):
        names = [n for m in model for n in m.split(",") if n]
        if len(names) != 1:
            return ""
        model = names[0]
    return Path(model).stem if model.endswith(".toml") else model



def make_config(shape: ModelShape, num_blocks: int, args: argparse.Namespace,
                settings: ReplaySettings) -> CacheConfig:
    return shape.cache_config(num_blocks, hash_algo=args.hash_algo, use_eagle=args.eagle,
                              max_num_batched_tokens=settings.chunk_size)



def cmd_replay(args: argparse.Namespace, console: Console, err_console: Console) -> int:
    metrics = None if getattr(args, "metrics", None) is None else \
        parse_metrics_target(args.metrics)
    outputs = check_output_paths([("--json", args.json), ("--plot", args.plot),
                                  ("--metrics", metrics if isinstance(metrics, Path) else None)])
    json_path, plot_path = outputs["--json"], outputs["--plot"]
    if isinstance(metrics, Path):
        metrics = outputs["--metrics"]
    source = resolve_source(args)
    shape = load_model(DEFAULT_MODEL if args.model is None else args.model)
    settings = resolve_settings(args, source)
    jobs = args.jobs
    num_blocks = resolve_pool(args.num_blocks, args.kv_memory, shape, source,
                              num_processes=jobs)
    config = make_config(shape, num_blocks, args, settings)
    settings = replace(settings, host_policy=args.host_policy, host_memory_bytes=(
        resolve_host_memory(args.host_memory, args.host_policy, config)))
    policies = parse_policies(args.policy, source.has_sessions)
    admissions = parse_admissions(args.admission)
    check_policies_fit(policies, config.alignment_tokens, args.policy)
    check_pool_holds_requests(source, config)
    observing = open_observers(
        events=getattr(args, "events", None), events_replay=getattr(args, "events_replay", None),
        metrics=metrics, model_name=shape.name, num_runs=len(policies) * len(admissions),
        jobs=jobs, linger_seconds=getattr(args, "linger_seconds", 0.0))
    try:
        settings = replace(settings, observers=observing.observers)
        limits, runs = run_policies(source, config, policies, settings, jobs=jobs,
                                    show_progress=not args.quiet, admissions=admissions)
        report = Report(source.name, shape.name, limits.ceiling, runs, {
            **pool_summary(shape, config), "workload": source.describe(),
            "max_running": settings.max_running,
            "chunk_size": settings.chunk_size, "hash_algo": args.hash_algo,
            "eagle": args.eagle,
        }, _max_rate([run.result.bound for run in runs]),
            _max_rate([run.result.bound_fa for run in runs]))
        render_table(report, console, detail=args.detail)
        write_outputs([
            ("--json", json_path, report.write_json),
            plot_output(plot_path, lambda tmp, fmt: plot_policies(report, tmp, format=fmt)),
            ("--metrics", observing.metrics_path, observing.write_metrics)])
        if getattr(args, "linger_seconds", 0.0) > 0:
            err_console.print(f"serving the event replay / metrics for "
                              f"{args.linger_seconds:g} s")
            observing.linger(args.linger_seconds)
    finally:
        observing.close()
    return 0


def _max_rate(rates: Sequence[float | None]) -> float | None:
    """The report-level bound: the largest per-run one, so it bounds every run shown."""
    known = [r for r in rates if r is not None]
    return max(known) if known else None



__all__ = ["cmd_replay", "make_config", "parse_params", "resolve_settings", "resolve_source"]
