"""``hybridkv cluster``: resolve the trace, model, pool and routers; run each router; report.

Order (as every command, ``docs/design.md`` "Error handling"): output paths first, then the
source, model, pool, policy and routers, then ``check_pool_holds_requests``; only then does a
replay start. Outputs are staged and renamed into place at the end.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

from rich.console import Console

from hybridkv.cli.replay import make_config, resolve_settings, resolve_source
from hybridkv.cluster.backends import ProcessBackend, RayBackend, import_ray
from hybridkv.cluster.instance import MAX_INSTANCES, InstanceSettings
from hybridkv.cluster.report import ClusterReport, plot_cluster, render_cluster_table
from hybridkv.cluster.routers import SIMPLE_ROUTERS, Router, parse_routers
from hybridkv.cluster.simulate import (
    Backend,
    ClusterRun,
    ClusterSettings,
    ProgressFn,
    run_cluster,
    serial_backend,
)
from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError
from hybridkv.models.shapes import load_model
from hybridkv.outputs import check_output_paths, plot_output, write_outputs
from hybridkv.sched.admission import parse_admissions
from hybridkv.sim.run import (
    DEFAULT_MODEL,
    check_policies_fit,
    check_pool_holds_requests,
    parse_policies,
    pool_summary,
    progress_bar,
    resolve_pool,
)
from hybridkv.traces.source import Source
from hybridkv.traces.trace import Trace

DEFAULT_POLICY = "latest"
DEFAULT_INSTANCES = 4

RouterBuilder = Callable[[int, CacheConfig, Trace, ClusterSettings], Router]


def router_builders() -> dict[str, RouterBuilder]:
    """Every router by name, in report order."""
    builders: dict[str, RouterBuilder] = {
        name: _simple(make) for name, make in SIMPLE_ROUTERS.items()}
    builders["prefix-fa"] = _prefix(residency=False)
    builders["prefix-residency"] = _prefix(residency=True)
    return builders


def _prefix(*, residency: bool) -> RouterBuilder:
    def build(n: int, config: CacheConfig, trace: Trace, settings: ClusterSettings) -> Router:
        from hybridkv.cluster.prefix import make_prefix_router

        return make_prefix_router(n, config, trace, residency=residency,
                                  load_weight=settings.load_weight,
                                  bounded_load=settings.bounded_load)
    return build


def _simple(make: Callable[[int], Router]) -> RouterBuilder:
    def build(n: int, config: CacheConfig, trace: Trace, settings: ClusterSettings) -> Router:
        del config, trace, settings
        return make(n)
    return build


def uses_events(name: str) -> bool:
    return name.startswith("prefix")


def make_backend(trace: Trace, config: CacheConfig, policy: str, settings: ClusterSettings,
                 *, jobs: int, ray: bool, events: bool) -> Backend:
    """Serial (``jobs`` 1), forked processes, or Ray actors."""
    n = settings.num_instances
    if ray:
        return RayBackend(trace, config, policy, settings.instance, n, jobs, events=events)
    if jobs > 1 and n > 1:
        return ProcessBackend(trace, config, policy, settings.instance, n, jobs,
                              events=events)
    return serial_backend(trace, config, policy, settings, events=events)


def run_router(name: str, trace: Trace, config: CacheConfig, policy: str,
               settings: ClusterSettings, *, jobs: int = 1, ray: bool = False,
               progress: ProgressFn | None = None) -> ClusterRun:
    """One router over the whole trace (a fresh set of instances)."""
    router = router_builders()[name](settings.num_instances, config, trace, settings)
    backend = make_backend(trace, config, policy, settings, jobs=jobs, ray=ray,
                           events=router.uses_events)
    try:
        return run_cluster(trace, router, backend, settings, progress)
    finally:
        backend.close()


DEFAULT_LOAD_WEIGHT = 1.0


def _check_prefix_options(args: argparse.Namespace, names: Sequence[str]) -> None:
    """``--load-weight`` and ``--bounded-load`` shape the prefix routers only: refused when
    ``--router`` runs none (they would be ignored); then ``--load-weight``'s default."""
    if not any(uses_events(name) for name in names):
        for flag, value in (("--load-weight", args.load_weight),
                            ("--bounded-load", args.bounded_load)):
            if value is not None:
                raise ConfigError(flag, value, f"shapes the prefix routers only; --router "
                                  f"{args.router} runs none: drop it or add prefix-fa / "
                                  "prefix-residency")
    if args.load_weight is None:
        args.load_weight = DEFAULT_LOAD_WEIGHT


def _single_trace(source: Source) -> Trace:
    if source.is_multi_scenario or len(source.scenarios) != 1:
        raise ConfigError("--workload", source.name, "a cluster replay needs one trace; the "
                          "retention microbenchmark is several scenarios: use another "
                          "workload or --trace")
    return next(iter(source.scenarios.values()))


def _single_policy(text: str, source: Source) -> str:
    policies = parse_policies(text, any(r.session_id for t in source.scenarios.values()
                                        for r in t.requests))
    if len(policies) != 1:
        raise ConfigError("--policy", text, "a cluster replay runs one policy on every "
                          "instance: name one, e.g. --policy latest")
    return policies[0]


EPOCH_SECONDS = 0.05
"""``--clock time``: seconds per ``--sync-steps`` unit of the router's epoch (arrivals are
routed at the first epoch start at or after them)."""


def cmd_cluster(args: argparse.Namespace, console: Console, err_console: Console) -> int:
    outputs = check_output_paths([("--json", args.json), ("--plot", args.plot)])
    json_path, plot_path = outputs["--json"], outputs["--plot"]
    if args.instances > MAX_INSTANCES:
        raise ConfigError("--instances", args.instances, f"at most {MAX_INSTANCES}")
    if args.ray:
        import_ray()
    names = parse_routers(args.router, list(router_builders()))
    _check_prefix_options(args, names)
    source = resolve_source(args)
    trace = _single_trace(source)
    shape = load_model(DEFAULT_MODEL if args.model is None else args.model)
    replay_settings = resolve_settings(args, source)
    num_blocks = resolve_pool(args.num_blocks, args.kv_memory, shape, source,
                              num_processes=args.instances)
    config = make_config(shape, num_blocks, args, replay_settings)
    policy = _single_policy(args.policy, source)
    check_policies_fit([policy], config.alignment_tokens, args.policy)
    admissions = parse_admissions(args.admission)
    if len(admissions) != 1:
        raise ConfigError("--admission", args.admission, "a cluster replay runs one "
                          "admission order on every instance")
    settings = ClusterSettings(
        num_instances=args.instances, sync_steps=args.sync_steps,
        concurrency=args.concurrency, load_weight=args.load_weight,
        bounded_load=args.bounded_load,
        instance=InstanceSettings(max_running=replay_settings.max_running,
                                  chunk_size=replay_settings.chunk_size,
                                  admission=admissions[0],
                                  check_invariants=replay_settings.check_invariants,
                                  timing=replay_settings.timing,
                                  epoch_seconds=EPOCH_SECONDS * args.sync_steps))
    settings.validate()
    check_pool_holds_requests(source, config)
    jobs = args.jobs if args.jobs is not None else (
        min(args.instances, os.cpu_count() or 1) if args.ray else 1)
    runs: list[ClusterRun] = []
    with progress_bar(not args.quiet) as progress:
        for name in names:
            callback: ProgressFn | None = None
            if progress is not None:
                task = progress.add_task(f"{name} ({args.instances} instances)",
                                         total=len(trace.requests))

                def callback(done: int, total: int, task: object = task) -> None:
                    progress.update(task, completed=done)  # type: ignore[arg-type]
                    del total
            runs.append(run_router(name, trace, config, policy, settings, jobs=jobs,
                                   ray=args.ray, progress=callback))
            if progress is not None:
                progress.remove_task(task)
    report = ClusterReport(source.name, shape.name, policy, runs, {
        **pool_summary(shape, config), "workload": source.describe(),
        "instances": args.instances, "max_running": settings.instance.max_running,
        "chunk_size": settings.instance.chunk_size, "sync_steps": settings.sync_steps,
        "concurrency": settings.max_in_flight, "admission": settings.instance.admission,
        "hash_algo": args.hash_algo, "eagle": args.eagle, "load_weight": args.load_weight,
        "bounded_load": args.bounded_load,
        **({"time_gpu": replay_settings.timing.label(config)}
           if replay_settings.timing is not None else {}),
    })
    render_cluster_table(report, console, detail=args.detail)
    write_outputs([
        ("--json", json_path, report.write_json),
        plot_output(plot_path, lambda tmp, fmt: plot_cluster(report, tmp, format=fmt))])
    del err_console
    return 0


def _at_least_one(text: str) -> float:
    """``--bounded-load``: a factor >= 1 (below 1 no instance could ever take a request).

    >>> _at_least_one("1.25")
    1.25
    """
    import argparse

    from hybridkv.cli.argtypes import non_negative_float

    try:
        value = non_negative_float(text)
    except argparse.ArgumentTypeError:
        value = -1.0  # nan, inf, words: the same message as a number below 1
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, got {text!r}")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser,
                          add_source: Callable[[argparse.ArgumentParser], None],
                          add_pool: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``cluster`` subcommand's own options, between the source and pool options and
    the report options it shares with replay."""
    from hybridkv.cli.argtypes import non_empty_str, non_negative_float, positive_int

    add_source(parser)
    add_pool(parser)
    parser.add_argument("--instances", type=positive_int, default=DEFAULT_INSTANCES,
                        help=f"serving instances, each with its own pool of --num-blocks / "
                        f"--kv-memory (default {DEFAULT_INSTANCES})")
    parser.add_argument("--router", default="all", type=non_empty_str,
                        help="comma-separated routers or 'all' (default): "
                        + ", ".join(router_builders()))
    parser.add_argument("--policy", default=DEFAULT_POLICY, type=non_empty_str,
                        help=f"retention/eviction policy of every instance "
                        f"(default {DEFAULT_POLICY})")
    parser.add_argument("--load-weight", type=non_negative_float, default=None,
                        help="prefix routers' score = matched tokens - WEIGHT x queued "
                        "prompt tokens (default 1: the prefill tokens computed before the "
                        "request's first token)")
    parser.add_argument("--bounded-load", type=_at_least_one, default=None, metavar="C",
                        help="prefix routers: an instance takes a request only while its "
                        "backlog plus the request's uncached tokens stays within C x the "
                        "mean (consistent hashing with bounded loads; 1.25 is the common "
                        "default; off by default)")
    parser.add_argument("--sync-steps", type=positive_int, default=1,
                        help="steps between router view refreshes (events, load) and "
                        "dispatches (default 1)")
    parser.add_argument("--concurrency", type=positive_int, default=None,
                        help="requests in flight cluster-wide (default instances x "
                        "max-running)")
    parser.add_argument("--jobs", type=positive_int, default=None,
                        help="run the instances in this many processes (Ray actors with "
                        "--ray); results are identical to a serial run (default 1)")
    parser.add_argument("--ray", action="store_true",
                        help="run the instances as Ray actors (pip install 'hybridkv[ray]')")


__all__: Sequence[str] = ("add_cluster_arguments", "cmd_cluster", "router_builders",
                          "run_router")
