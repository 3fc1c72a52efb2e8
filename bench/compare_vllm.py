"""Differential check: hybridkv's cache manager vs vLLM 0.33.0's, request by request.

Both managers are driven by hybridkv's own closed-loop ``Scheduler`` (replay protocol v1,
``shared/docs/replay-protocol.md``) over the same requests: prompts expanded with
``hybridkv.traces.trace.expand_prompt``, outputs drawn as globally unique ids. vLLM's side is
``bench/vllm_adapter.VllmManager`` (vLLM's ``KVCacheManager`` + ``Request`` objects, sha256
block hashes at the gcd of the group block sizes, ``full_sequence_must_fit`` admission gate,
``max_in_flight_tokens`` = chunk size). For each policy (ours → vLLM retention interval:
``prepend`` → None, ``latest`` → 0, ``interval:N`` → N) it reports the hit tokens each request
got at its first admission on both sides, the mismatches, both aggregate hit rates, the
seconds spent inside each manager in the same process, and whether the two sequences of
*all* lookups (refused admissions and re-admissions after preemption included) are identical.
``--no-admission-gate`` (with a small pool and a high ``--max-running``) over-admits so that
preemption, free and re-admission paths are compared too.

Needs the interpreter built by ``bench/setup_vllm.sh`` (vLLM is not a hybridkv dependency)::

    .venv-vllm/bin/python bench/compare_vllm.py \\
        --trace /work/shared/traces/mooncake_synthetic/synthetic_trace.jsonl \\
        --model dsv4-bench --num-blocks 18481 --policy prepend,latest,interval:32768 \\
        --json out/compare_vllm_dsv4.json

Known deviation: a sliding window of 1 token needs no window KV, so hybridkv hits every
aligned prefix there with null window tables, while vLLM 0.33 demands one cached window
block (its masks hash none): hits differ only on models with a window of 1, which none of
the configurations compared here has.

Exit status: 0 when every request and lookup matched, 1 on any mismatch, 2 when vLLM is not
importable.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hybridkv.native
from hybridkv.cache import Allocation, KVCacheManager, PrefixHit
from hybridkv.cli.app import OneLineParser
from hybridkv.cli.argtypes import non_empty_str, positive_int
from hybridkv.cli.replay import parse_params
from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError, HybridKVError
from hybridkv.models.shapes import ModelShape, load_model, num_blocks_for_memory, parse_size
from hybridkv.policies import PolicySpec
from hybridkv.sched.driver import Driver, OutputSampler
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan
from hybridkv.traces.loaders import load_trace
from hybridkv.traces.prompts import LazyPrompt
from hybridkv.traces.trace import Trace
from hybridkv.traces.workloads import make_workload

REFERENCE_HIT_RATES: dict[tuple[str, int, str, int, str], float] = {
    # replay-protocol.md "Reference numbers": vLLM 0.33.0 under protocol v1, in percent.
    # key: (trace file stem, requests, model, num_blocks, policy)
    **{("synthetic_trace", 3993, "dsv4-bench", 5681, p): v
       for p, v in (("prepend", 8.19), ("latest", 10.36), ("interval:32768", 13.21))},
    **{("synthetic_trace", 3993, "dsv4-bench", 18481, p): v
       for p, v in (("prepend", 20.86), ("latest", 25.32), ("interval:32768", 31.61))},
    **{("synthetic_trace", 3993, "dsv4-bench", 258097, p): v
       for p, v in (("prepend", 65.08), ("latest", 53.17), ("interval:32768", 58.41))},
    **{("synthetic_trace", 3993, "gemma3-bench", 103505, p): v
       for p, v in (("prepend", 5.00), ("latest", 5.98), ("interval:32768", 9.87))},
    **{("synthetic_trace", 3993, "gemma3-bench", 308305, p): v
       for p, v in (("prepend", 13.09), ("latest", 15.99), ("interval:32768", 23.74))},
}
MAX_LISTED_MISMATCHES = 20
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""``--clock``: what both sides' manager seconds measure (``cpu``: CPU time of this thread
inside the calls, which other processes on a shared machine do not inflate)."""




@dataclass(slots=True)
class SideResult:
    """One manager's run of one policy."""

    hit_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    preemptions: int = 0
    steps: int = 0
    manager_seconds: float = 0.0
    timed_calls: int = 0
    """Intervals summed into ``manager_seconds``."""
    clock_overhead_seconds: float = 0.0
    """Mean reading of an empty timed interval (``clock_overhead``), measured before the
    run: what each timed call adds for the two clock calls around it."""
    hash_seconds: float = 0.0
    wall_seconds: float = 0.0
    first_hits: dict[str, int] = field(default_factory=dict)
    lookups: list[tuple[str, int]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def net_manager_seconds(self) -> float:
        """``manager_seconds`` less the clock's own cost in each timed interval (matters
        for ``--clock cpu``, whose clock is a system call: ~0.3-1.5 us per interval on the
        dev VM, against ~1 us for a whole hybridkv decode-step allocation)."""
        return max(0.0, self.manager_seconds - self.timed_calls * self.clock_overhead_seconds)

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("first_hits", "lookups")}
        out["lookups"] = len(self.lookups)
        out["hit_rate"] = self.hit_rate
        out["net_manager_seconds"] = self.net_manager_seconds
        return out


class HybridkvTypes:
    """The vLLM adapter as the compiled scheduler sees it: lookups return a real
    ``PrefixHit`` and allocations an ``Allocation`` (mypyc checks the declared types at
    run time), each mapped back to the adapter's own ``VllmHit`` / ``KVCacheBlocks``
    outside the timed manager calls."""

    def __init__(self, manager: Any, num_groups: int) -> None:
        self._manager = manager
        self._no_tables = ((),) * num_groups
        self._hits: dict[str, Any] = {}

    def find_longest_hit(self, req_id: str) -> PrefixHit:
        hit = self._manager.find_longest_hit(req_id)
        self._hits[req_id] = hit
        return PrefixHit(req_id, hit.num_tokens, self._no_tables, hit.junction_tokens, 0,
                         hit.num_tokens)

    def _theirs(self, req_id: str, hit: PrefixHit | None) -> Any:
        return None if hit is None else self._hits[req_id]

    def allocate_slots(self, req_id: str, num_new_tokens: int, hit: PrefixHit | None = None,
                       **kwargs: Any) -> Allocation | None:
        result = self._manager.allocate_slots(req_id, num_new_tokens,
                                              self._theirs(req_id, hit), **kwargs)
        return None if result is None else Allocation(0, num_new_tokens, 0, ())

    def align_prefill_chunk(self, req_id: str, num_new_tokens: int,
                            hit: PrefixHit | None = None, **kwargs: Any) -> int:
        return int(self._manager.align_prefill_chunk(req_id, num_new_tokens,
                                                     self._theirs(req_id, hit), **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


class LoggedLookups:
    """The scheduler's view of ``manager`` with every ``find_longest_hit`` logged (a
    compiled ``KVCacheManager`` takes no instance attributes, so it is wrapped, not
    patched); everything else is the manager's own. ``timed_calls`` counts the calls that
    hybridkv's manager adds to ``manager_seconds`` (lookups, allocations, frees, and the
    removal of a running request), outside those calls."""

    def __init__(self, manager: Any, lookups: list[tuple[str, int]]) -> None:
        self._manager = manager
        self._lookups = lookups
        self.timed_calls = 0

    def find_longest_hit(self, req_id: str, *rest: Any, **kwargs: Any) -> Any:
        hit = self._manager.find_longest_hit(req_id, *rest, **kwargs)
        self._lookups.append((req_id, hit.num_tokens))
        self.timed_calls += 1
        return hit

    def allocate_slots(self, *args: Any, **kwargs: Any) -> Any:
        self.timed_calls += 1
        return self._manager.allocate_slots(*args, **kwargs)

    def free(self, req_id: str) -> None:
        self.timed_calls += 1
        self._manager.free(req_id)

    def remove_request(self, req_id: str) -> None:
        if isinstance(self._manager, KVCacheManager) and self._manager.is_running(req_id):
            self.timed_calls += 1
        self._manager.remove_request(req_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def clock_overhead(clock: Any, num_intervals: int = 200_000) -> float:
    """Mean length of an empty interval timed as the managers time their calls
    (``started = clock(); ...; total += clock() - started``)."""
    total = 0.0
    for _ in range(num_intervals):
        started = clock()
        total += clock() - started
    return total / num_intervals


def run_side(manager: Any, trace: Trace, args: argparse.Namespace, label: str) -> SideResult:
    """Replay ``trace`` through ``manager`` with hybridkv's scheduler (protocol v1)."""
    started = time.perf_counter()
    lookups: list[tuple[str, int]] = []
    # every lookup, refused admissions included (logged outside the timed manager calls)
    logged = LoggedLookups(manager, lookups)
    overhead = clock_overhead(manager.clock)
    scheduler = Scheduler(logged, max_running=args.max_running,
                          chunk_size=args.chunk_size,
                          reserve_full_prompt=not args.no_admission_gate)
    requests: list[SchedRequest] = []
    for index, request in enumerate(trace.requests):
        sched = SchedRequest(request.request_id, LazyPrompt(request, index),
                             max(1, request.output_length), session_id=request.session_id,
                             phase=request.phase, tag=request.tag)
        requests.append(sched)
        scheduler.add_request(sched)
    finished = 0
    last_report = started

    def stalled(plan: StepPlan) -> Mapping[str, int]:
        if not plan.chunks:
            raise RuntimeError(f"{label}: no progress at step {scheduler.num_steps}")
        return sample(plan)

    def report(plan: StepPlan, done: Sequence[str]) -> None:
        nonlocal finished, last_report
        finished += len(done)
        now = time.perf_counter()
        if now - last_report > 60:
            last_report = now
            print(f"  [{label}] {finished}/{len(requests)} finished, step {scheduler.num_steps}, "
                  f"{now - started:.0f}s", file=sys.stderr, flush=True)

    sample = OutputSampler(trace).executor(scheduler)
    Driver(scheduler, stalled, on_step=report).run_to_end()
    timed_calls = manager.timed_calls if isinstance(manager, HybridkvTypes) else \
        logged.timed_calls
    result = SideResult(preemptions=scheduler.num_preemptions, steps=scheduler.num_steps,
                        manager_seconds=manager.manager_seconds, timed_calls=timed_calls,
                        clock_overhead_seconds=overhead,
                        hash_seconds=manager.hash_seconds, lookups=lookups)
    for sched in requests:
        hit = sched.first_hit_tokens or 0
        result.first_hits[sched.req_id] = hit
        result.hit_tokens += hit
        result.prompt_tokens += len(sched.prompt_token_ids)
        result.requests += 1
    result.wall_seconds = time.perf_counter() - started
    return result


def compare_policy(trace: Trace, config: CacheConfig, policy: str, args: argparse.Namespace,
                   ) -> dict[str, Any]:
    """Run both managers under one policy and diff their first-admission hits."""
    from vllm_adapter import VllmManager, retention_interval

    clock = CLOCKS[args.clock]
    manager = KVCacheManager(config, policy)
    manager.clock = clock
    ours = run_side(manager, trace, args, f"hybridkv {policy}")
    vllm_manager = VllmManager(config, policy)
    vllm_manager.clock = clock
    theirs = run_side(HybridkvTypes(vllm_manager, len(config.groups)), trace, args,
                      f"vllm {policy}")
    mismatches = [
        {"request_id": rid, "index": idx, "prompt_tokens": trace.requests[idx].input_length,
         "hybridkv": ours.first_hits[rid], "vllm": theirs.first_hits[rid]}
        for idx, rid in enumerate(r.request_id for r in trace.requests)
        if ours.first_hits[rid] != theirs.first_hits[rid]
    ]
    divergence = next(
        ({"lookup": i, "request_id": a[0], "hybridkv": a[1], "vllm_request_id": b[0],
          "vllm": b[1]}
         for i, (a, b) in enumerate(zip(ours.lookups, theirs.lookups, strict=False)) if a != b),
        None)
    if divergence is None and len(ours.lookups) != len(theirs.lookups):
        divergence = {"lookup": min(len(ours.lookups), len(theirs.lookups)),
                      "note": "one side made more lookups"}
    key = (Path(trace.source or trace.name).stem, len(trace), args.model, args.num_blocks,
           policy)
    reference = None if args.no_admission_gate or config.use_eagle else \
        REFERENCE_HIT_RATES.get(key)
    return {
        "policy": policy,
        "vllm_retention_interval": retention_interval(policy),
        "requests": len(trace),
        "mismatches": len(mismatches),
        "first_mismatches": mismatches[:MAX_LISTED_MISMATCHES],
        "lookup_sequences_identical": divergence is None,
        "first_lookup_divergence": divergence,
        "hybridkv": ours.summary(),
        "vllm": theirs.summary(),
        "manager_seconds_ratio_vllm_over_hybridkv": (
            theirs.manager_seconds / ours.manager_seconds if ours.manager_seconds else None),
        "net_manager_seconds_ratio_vllm_over_hybridkv": (
            theirs.net_manager_seconds / ours.net_manager_seconds
            if ours.net_manager_seconds else None),
        "reference_hit_rate_percent": reference,
        "vllm_matches_reference": (None if reference is None
                                   else round(100 * theirs.hit_rate, 2) == reference),
    }


def _print_row(row: dict[str, Any]) -> None:
    ours, theirs = row["hybridkv"], row["vllm"]
    ref = row["reference_hit_rate_percent"]
    ref_text = "" if ref is None else (
        f"  reference {ref:.2f}% ({'match' if row['vllm_matches_reference'] else 'DIFFERS'})")
    ratio = row["manager_seconds_ratio_vllm_over_hybridkv"]
    same = "identical" if row["lookup_sequences_identical"] else \
        f"DIVERGE at {row['first_lookup_divergence']}"
    print(f"{row['policy']:>16}  requests {row['requests']}  mismatches {row['mismatches']}  "
          f"lookups {ours['lookups']}/{theirs['lookups']} {same}  "
          f"hit hybridkv {100 * ours['hit_rate']:.2f}% vllm {100 * theirs['hit_rate']:.2f}%"
          f"{ref_text}")
    net = row["net_manager_seconds_ratio_vllm_over_hybridkv"]
    print(f"{'':>16}  manager s: hybridkv {ours['manager_seconds']:.2f} vllm "
          f"{theirs['manager_seconds']:.2f} (vllm/hybridkv {ratio:.2f}x); less the clock's "
          f"own cost ({ours['timed_calls']} / {theirs['timed_calls']} timed calls at "
          f"{1e9 * ours['clock_overhead_seconds']:.0f} / "
          f"{1e9 * theirs['clock_overhead_seconds']:.0f} ns): hybridkv "
          f"{ours['net_manager_seconds']:.2f} vllm {theirs['net_manager_seconds']:.2f} "
          f"({net:.2f}x)  preemptions "
          f"{ours['preemptions']}/{theirs['preemptions']}  steps {ours['steps']}/"
          f"{theirs['steps']}", flush=True)
    for mm in row["first_mismatches"]:
        print(f"{'':>18}{mm['request_id']} (#{mm['index']}, {mm['prompt_tokens']} tokens): "
              f"hybridkv {mm['hybridkv']} vllm {mm['vllm']}")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="compare_vllm.py", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=non_empty_str, help="trace file or directory")
    source.add_argument("--workload", default=None, type=non_empty_str,
                        help="a named workload instead of a trace (hybridkv replay's names)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="workload parameter (repeatable), as hybridkv replay --set")
    parser.add_argument("--model", required=True, type=non_empty_str,
                        help="preset name or model .toml")
    sizing = parser.add_mutually_exclusive_group()
    sizing.add_argument("--num-blocks", type=positive_int,
                        help="pool size including the null block (same for both)")
    sizing.add_argument("--kv-memory", type=non_empty_str,
                        help="KV memory budget (e.g. 40GiB): both sides plan their pool from "
                             "it and must get the same block count")
    parser.add_argument("--check-kv-memory", default=None, metavar="SIZES", type=non_empty_str,
                        help="comma-separated KV budgets (e.g. 20GiB,108GB): compare the block "
                             "counts both sides plan from them (block-outermost models: vLLM's "
                             "own grouping of the real specs); alone, only this check runs")
    parser.add_argument("--policy", default="prepend,latest,interval:32768", type=non_empty_str,
                        help="comma-separated hybridkv policies")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="first N requests only")
    parser.add_argument("--max-running", type=positive_int, default=16)
    parser.add_argument("--chunk-size", type=positive_int, default=8192)
    parser.add_argument("--no-admission-gate", action="store_true",
                        help="admit on the first chunk only (vLLM full_sequence_must_fit=False): "
                             "over-admits, so preemption and re-admission get exercised")
    parser.add_argument("--eagle", action="store_true",
                        help="EAGLE drafter on both sides: lookahead block hashes (vLLM 0.33's "
                             "default: each hash covers the next token, no drop)")
    parser.add_argument("--eagle-drop", action="store_true",
                        help="with --eagle: the older drop mode on both sides (vLLM with "
                             "lookahead block hashes disabled)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="manager seconds as wall time (default) or CPU time of the "
                             "thread inside the calls (both sides alike; robust to other "
                             "jobs on the machine)")
    parser.add_argument("--json", type=non_empty_str, default=None,
                        help="write the results here")
    parser.add_argument("--through-vllm-scheduler", action="store_true",
                        help="vLLM's own Scheduler drives vLLM's manager and hybridkv's "
                             "facade (hybridkv.vllm); compares hits and block tables")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 / 1 as the module says; 2 with one line on stderr for bad input (an option,
    the trace, the model, the output path) or a missing vLLM, checked before vLLM runs."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        shape, trace = _check_inputs(args, parser)
        try:
            import vllm
        except ImportError as err:
            print(f"vLLM is not importable ({err}); run bench/setup_vllm.sh and use its "
                  "python", file=sys.stderr)
            return 2
        return _compare(args, shape, trace, vllm.__version__)
    except HybridKVError as err:
        print(f"compare_vllm.py: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


def _check_inputs(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  ) -> tuple[ModelShape, Trace | None]:
    """Every option checked and the model and trace loaded (``None``: ``--check-kv-memory``
    alone), so that bad input fails in a line before vLLM is imported."""
    if args.json is not None:  # its directories are created when the first row is written
        args.json = Path(args.json)
        if args.json.is_dir() or str(args.json).endswith("/"):
            raise ConfigError("--json", str(args.json), "names a directory; name a file")
    for policy in args.policy.split(","):
        if policy.strip():
            PolicySpec.parse(policy.strip())
    shape = load_model(args.model)
    for flag, sizes in (("--kv-memory", args.kv_memory), ("--check-kv-memory",
                                                           args.check_kv_memory)):
        for budget in (sizes.split(",") if sizes else ()):
            try:
                parse_size(budget.strip())
            except ConfigError as err:
                raise ConfigError(flag, budget, err.fix) from err
    if args.check_kv_memory and args.trace is None and args.workload is None:
        return shape, None
    if (args.trace is None and args.workload is None) or (
            args.num_blocks is None and args.kv_memory is None):
        parser.error("--trace (or --workload) and --num-blocks (or --kv-memory) are required "
                     "unless --check-kv-memory runs alone")
    if args.workload is None:
        return shape, load_trace(args.trace, limit=args.limit)
    if args.limit is not None:
        raise ConfigError("--limit", args.limit, "applies to --trace; a workload's size is "
                          "its --set parameters")
    trace = make_workload(args.workload, **parse_params(args.set))
    args.trace = f"workload {args.workload} {' '.join(args.set)}".strip()
    return shape, trace


def _compare(args: argparse.Namespace, shape: ModelShape, trace: Trace | None,
             vllm_version: str) -> int:
    failed_blocks = False
    if args.check_kv_memory:
        failed_blocks = check_block_counts(args)
    if trace is None:
        return 1 if failed_blocks else 0
    if args.kv_memory is not None:
        from vllm_adapter import vllm_num_blocks_for_memory

        ours_blocks = num_blocks_for_memory(shape, args.kv_memory)
        theirs_blocks = vllm_num_blocks_for_memory(shape.cache_config(2),
                                                   parse_size(args.kv_memory))
        print(f"--kv-memory {args.kv_memory}: hybridkv {ours_blocks} blocks, "
              f"vllm {theirs_blocks} blocks", flush=True)
        if ours_blocks != theirs_blocks:
            print("block counts differ", file=sys.stderr)
            return 1
        args.num_blocks = ours_blocks
    config = shape.cache_config(
        args.num_blocks, max_num_batched_tokens=args.chunk_size,
        use_eagle=args.eagle or args.eagle_drop, eagle_block_drop=args.eagle_drop)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    eagle = "eagle drop mode" if args.eagle_drop else \
        "eagle lookahead hashes" if args.eagle else "no eagle"
    print(f"trace {trace.name} ({len(trace)} requests), model {args.model}, "
          f"{args.num_blocks} blocks, {eagle}, vllm {vllm_version}, "
          f"hybridkv core {_core()}, {args.clock} clock", flush=True)
    if args.through_vllm_scheduler:
        return compare_through_scheduler(trace, config, policies, args)
    rows = []
    for policy in policies:
        rows.append(compare_policy(trace, config, policy, args))
        _print_row(rows[-1])
        if args.json is not None:
            _write_json(args, trace, rows, vllm_version)
    return 1 if failed_blocks or any(row["mismatches"] or not row["lookup_sequences_identical"]
                                     for row in rows) else 0


def compare_through_scheduler(trace: Trace, config: CacheConfig, policies: list[str],
                              args: argparse.Namespace) -> int:
    """``--through-vllm-scheduler``: per policy, vLLM's Scheduler with its manager vs with
    the facade; 0 when hits and tables match everywhere, 1 otherwise (a refused model
    shape prints the facade's one-line reason and counts as a failure)."""
    from vllm_scheduler_compare import run_through_scheduler, tables_match

    from hybridkv.vllm import UnsupportedFeature

    rows: list[dict[str, Any]] = []
    for policy in policies:
        try:
            theirs = run_through_scheduler(trace, config, policy, facade=False,
                                           max_running=args.max_running,
                                           chunk_size=args.chunk_size)
            ours = run_through_scheduler(trace, config, policy, facade=True,
                                         max_running=args.max_running,
                                         chunk_size=args.chunk_size)
        except UnsupportedFeature as err:
            print(f"{policy}: refused: {err}")
            rows.append({"policy": policy, "refused": str(err)})
            continue
        mismatched = [{"request": r, "vllm": hit, "hybridkv": ours.first_hits.get(r)}
                      for r, hit in theirs.first_hits.items() if hit != ours.first_hits.get(r)]
        mismatches = len(mismatched)
        same_tables, detail = tables_match(ours, theirs)
        prompt = sum(r.input_length for r in trace.requests)
        row = {"policy": policy, "requests": len(theirs.first_hits),
               "hit_tokens_vllm": sum(theirs.first_hits.values()),
               "hit_tokens_hybridkv": sum(ours.first_hits.values()),
               "prompt_tokens": prompt, "mismatches": mismatches,
               "first_mismatches": mismatched[:MAX_LISTED_MISMATCHES], "tables": detail,
               "tables_identical": same_tables,
               "steps": [theirs.steps, ours.steps],
               "manager_seconds_vllm": round(theirs.manager_seconds, 3),
               "manager_seconds_hybridkv": round(ours.manager_seconds, 3)}
        rows.append(row)
        print(f"{policy}: {row['requests']} requests, hit tokens vllm "
              f"{row['hit_tokens_vllm']} / hybridkv {row['hit_tokens_hybridkv']}, "
              f"{mismatches} mismatching requests, tables {detail}, manager seconds "
              f"vllm {theirs.manager_seconds:.2f} / hybridkv {ours.manager_seconds:.2f} "
              f"(ratio {ours.manager_seconds / max(theirs.manager_seconds, 1e-9):.2f})",
              flush=True)
        for mm in row["first_mismatches"]:  # in admission order: the first one is the lead
            print(f"    {mm['request']}: first-admission hit tokens vllm {mm['vllm']} / "
                  f"hybridkv {mm['hybridkv']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mode": "through-vllm-scheduler",
                                         "trace": str(args.trace), "model": args.model,
                                         "num_blocks": args.num_blocks, "rows": rows},
                                        indent=1))
    return 1 if any(r.get("refused") or r["mismatches"] or not r["tables_identical"]
                    for r in rows) else 0


def check_block_counts(args: argparse.Namespace) -> bool:
    """Print our and vLLM's pool sizes for each ``--check-kv-memory`` budget; True on any
    difference. vLLM's side: its ``get_kv_cache_groups`` on the real V4 specs and its
    ``_get_kv_cache_bytes_per_block`` (block-outermost), ``num_blocks = bytes // per``."""
    from vllm_adapter import vllm_v4_bytes_per_block, vllm_v4_groups

    from hybridkv.models.shapes import num_blocks_for_memory, parse_size

    shape = load_model(args.model)
    layers = shape.layer_specs()
    groups = vllm_v4_groups(layers, "latest")
    per_block = vllm_v4_bytes_per_block(groups)
    ours_groups = [len(g.layer_ids) for g in shape.cache_config(2).groups]
    theirs_groups = [len(g.layer_names) for g in groups]
    failed = ours_groups != theirs_groups or per_block != shape.bytes_per_block
    print(f"groups hybridkv {ours_groups} vllm {theirs_groups}; bytes per block hybridkv "
          f"{shape.bytes_per_block:,} vllm {per_block:,}")
    for budget in (b.strip() for b in args.check_kv_memory.split(",") if b.strip()):
        ours = num_blocks_for_memory(shape, budget)
        theirs = parse_size(budget) // per_block
        failed |= ours != theirs
        print(f"  --kv-memory {budget}: hybridkv {ours:,} blocks, vllm {theirs:,} "
              f"({'identical' if ours == theirs else 'DIFFER'})", flush=True)
    return failed


def _core() -> str:
    selection = hybridkv.native.SELECTED or hybridkv.native.decide()
    return f"{selection.mode} ({selection.reason})"


def _write_json(args: argparse.Namespace, trace: Trace, rows: list[dict[str, Any]],
                vllm_version: str) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "trace": str(args.trace), "requests": len(trace), "model": args.model,
        "num_blocks": args.num_blocks, "max_running": args.max_running,
        "hybridkv_core": _core(), "clock": args.clock,
        "chunk_size": args.chunk_size, "admission_gate": not args.no_admission_gate,
        "eagle": "drop" if args.eagle_drop else "lookahead" if args.eagle else None,
        "vllm_version": vllm_version,
        "python": platform.python_version(), "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"), "results": rows,
    }
    args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
