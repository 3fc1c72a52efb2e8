"""Report rendering: the policy table (rich), the JSON document and plots (matplotlib)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybridkv.limits import format_bytes
from hybridkv.sim.misses import MISS_CAUSES
from hybridkv.sim.replay import RunResult, TagTotals
from hybridkv.sim.table_layout import (
    CAUSE_LABELS,
    largest_miss,
    percent,
    report_table,
    seconds,
)

REPORT_HELP = """\
The default table: policy, hit rate, bound, largest miss (the miss cause below with the
largest share), wall s; ceiling in its title. --detail adds the miss-cause shares, tokens,
bound_fa, waiting and time; --json has every field.
Columns: hit rate = prompt tokens served from the cache at first admission.
bound = hybrid-aware offline optimum: Belady MIN over full-attention hit units with, at each
admission, the capacity left after the blocks then held that are not full-attention prompt
KV (running requests' window / chunked / other state, the admitted request's window tail
at its hit point, decode and partial blocks); the prompt KV running requests hold is
pinned while they hold it (no policy can evict it). bound_fa = the same over
full-attention blocks only with the whole pool, nothing pinned (the peer simulators'
"optimal"); bound <= bound_fa.
Both are upper bounds for the admission order the run used (each run's own: the order
changes the access sequence, so a cache-aware admission order can beat them); the report
line shows the largest per-run value. ceiling = infinite cache.
Miss causes (share of missed prompt tokens, each counted once, adding to 100%):
cold = never seen before; evicted = its full-attention chain was cached and evicted;
tail = full-attention KV resident but a window tail / state checkpoint was not;
align = seen, but below the alignment unit (or the always-computed last token);
admit = never cached (not cached by the policy, or still being computed).
Recommended setting: interval:32768+predict+recompute (at or above latest on every row of
docs/benchmarks.md). The +scan variants are not recommended: scan can lose to its base
(mooncake, dsv4-bench, 5,681 blocks: interval:32768+scan 2.6 points under interval:32768,
latest+scan 0.9 under latest), because it keeps once-hit blocks over fresh prefixes that
the next turns of a conversation need."""


@dataclass(slots=True)
class PolicyRun:
    """One policy's result, plus per-fraction results for the retention microbenchmark."""

    result: RunResult
    fractions: dict[str, RunResult] = field(default_factory=dict)


@dataclass(slots=True)
class Report:
    trace: str
    model: str
    ceiling: float
    runs: list[PolicyRun]
    settings: dict[str, object] = field(default_factory=dict)
    bound: float | None = None
    """Largest per-run hybrid-aware offline bound (``hybridkv.sim.bound``); ``None`` for
    models without a full-attention group."""
    bound_fa: float | None = None
    """Largest per-run full-attention-only bound."""

    def to_json(self) -> dict[str, object]:
        """The ``--json`` document: ``trace``, ``model``, ``ceiling``, ``runs``."""
        runs: list[dict[str, object]] = []
        for run in self.runs:
            item = _run_json(run.result)
            if run.fractions:
                item["fractions"] = {
                    fraction: {
                        "hit_rate": _tag(r, "replay").hit_rate,
                        "hit_tokens": _tag(r, "replay").hit_tokens,
                        "prompt_tokens": _tag(r, "replay").prompt_tokens,
                    }
                    for fraction, r in run.fractions.items()
                }
            runs.append(item)
        return {"trace": self.trace, "model": self.model, "ceiling": self.ceiling,
                "bound": self.bound, "bound_fa": self.bound_fa, "settings": self.settings,
                "runs": runs}

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")


def _tag(result: RunResult, tag: str) -> TagTotals:
    return result.by_tag.get(tag, TagTotals())


def _run_json(result: RunResult) -> dict[str, object]:
    return {
        "policy": result.policy,
        "admission": result.admission,
        "num_blocks": result.num_blocks,
        "requests": result.requests,
        "prompt_tokens": result.prompt_tokens,
        "hit_tokens": result.hit_tokens,
        "hit_rate": result.hit_rate,
        "preemptions": result.preemptions,
        "preempted_hit_tokens": result.preempted_hit_tokens,
        "bridge_tokens": result.bridge_tokens,
        "computed_tokens": result.prompt_tokens - result.hit_tokens,
        "steps": result.steps,
        "evicted_blocks": result.evicted_blocks,
        "manager_seconds": round(result.manager_seconds, 4),
        "hash_seconds": round(result.hash_seconds, 4),
        "wall_seconds": round(result.wall_seconds, 4),
        "scheduler_seconds": round(result.scheduler_seconds, 4),
        "wait_steps": {"p50": result.wait_p50_steps, "p99": result.wait_p99_steps,
                       "max": result.wait_max_steps},
        "bound": result.bound,
        "bound_fa": result.bound_fa,
        "bound_hit_tokens": result.bound_hit_tokens,
        "bound_fa_hit_tokens": result.bound_fa_hit_tokens,
        "miss_tokens": result.misses.as_dict(),
        "miss_shares": {k: round(v, 6) for k, v in result.misses.shares().items()},
        **({} if result.host is None else {"host": {
            **result.host.as_dict(),
            "gpu_hit_rate": (result.hit_tokens - result.host_hit_tokens) / result.prompt_tokens
            if result.prompt_tokens else 0.0,
            "host_hit_rate": result.host_hit_tokens / result.prompt_tokens
            if result.prompt_tokens else 0.0}}),
        **({"time": {k: round(v, 6) for k, v in result.time.items()},
            "time_gpu": result.time_label, "request_times": result.request_times}
           if result.time is not None else {}),
    }


def host_line(result: RunResult) -> str | None:
    """One line on a run's host tier: hit rate by tier, bytes moved, occupancy by kind."""
    host = result.host
    if host is None:
        return None
    prompt = result.prompt_tokens or 1
    gib = float(1 << 30)
    return (f"host tier {host.policy} ({host.capacity_bytes / gib:,.1f} GiB) under "
            f"{result.policy}: hit rate GPU "
            f"{100 * (result.hit_tokens - host.hit_tokens) / prompt:.2f}% + host "
            f"{100 * host.hit_tokens / prompt:.2f}% = {100 * result.hit_rate:.2f}%; "
            f"moved GPU→host {host.stored_bytes / gib:,.1f} GiB, host→GPU "
            f"{host.loaded_bytes / gib:,.1f} GiB; held KV {host.kv_bytes / gib:,.1f} GiB, "
            f"state {host.state_bytes / gib:,.1f} GiB; evicted {host.evicted_blocks:,} blocks, "
            f"not kept {host.refused_blocks:,}")


def render_table(report: Report, console: Console, *, detail: bool = False) -> None:
    """Print the default policy table (what a user decides on: hit rate, ``bound``, the
    largest miss cause, time: the replay's wall seconds on the step clock, TTFT p99 and,
    under ``--slo``, goodput on ``--clock time``; ``ceiling`` in the title, ``*`` per
    ``_star_rule``) and,
    with ``detail``, the tables of the rest (miss causes, tokens, waiting and time)."""
    show_admission = any(run.result.admission != "fcfs" for run in report.runs)
    timed = any(run.result.time is not None for run in report.runs)
    score, star = _star_rule(report)
    goodput = star == "best goodput"  # the number the star is given for is in the table
    table = report_table(
        f"{report.trace} on {report.model} · ceiling {percent(report.ceiling)}",
        ["policy", *(["admission"] if show_admission else []), "hit rate", "bound",
         *(["TTFT p99"] if timed else []), *(["goodput/s"] if goodput else []),
         "largest miss", *([] if timed else ["wall s"])],
        labels={"policy", "admission"})
    best = max((score(run.result) for run in report.runs), default=0.0)
    for run in report.runs:
        r = run.result
        mark = " *" if score(r) == best and len(report.runs) > 1 else ""
        ttft = [seconds(r.time["ttft_p99_s"]) if r.time else "–"] if timed else []
        rps = [f"{(r.time or {}).get('goodput_rps', 0.0):.3g}"] if goodput else []
        table.add_row(f"{r.policy}{mark}", *([r.admission] if show_admission else []),
                      percent(r.hit_rate), percent(r.bound), *ttft, *rps,
                      largest_miss(r.misses.shares()),
                      *([] if timed else [f"{r.wall_seconds:.2f}"]))
    console.print(table)
    pool = pool_line(report.settings)
    if pool:
        console.print(pool)
    for run in report.runs:
        line = host_line(run.result)
        if line is not None:
            console.print(line)
    console.print(f"* = {star}; bound: offline optimum for each run's admission "
                  f"order (the largest: {percent(report.bound)}); ceiling: infinite cache; "
                  "largest miss: the miss cause of most missed tokens"
                  + ("" if detail else "; more columns: --detail, --json")
                  + " (hybridkv replay --help)", style="dim")
    if detail:
        _render_detail(report, console)
    if any(run.fractions for run in report.runs):
        _render_fractions(report, console)


def _star_rule(report: Report) -> tuple[Callable[[RunResult], float], str]:
    """What ``*`` marks: the best hit rate on the step clock; with ``--clock time`` the
    best goodput under ``--slo`` (else the lowest TTFT p99): the recommendation is made in
    time when there is time."""
    if all(run.result.time is not None for run in report.runs) and report.runs:
        if all("goodput_rps" in (run.result.time or {}) for run in report.runs):
            return (lambda r: _sig3((r.time or {}).get("goodput_rps", 0.0))), "best goodput"
        return (lambda r: -_sig3((r.time or {}).get("ttft_p99_s", 0.0))), "lowest TTFT p99"
    return (lambda r: r.hit_rate), "best hit rate"


def _sig3(value: float) -> float:
    """``value`` to the 3 significant digits the table shows: runs that differ only below
    them tie for ``*`` (0.172021 and 0.17202 requests/s are the same goodput).

    >>> _sig3(0.172021) == _sig3(0.17202), _sig3(1234.5)
    (True, 1230.0)
    """
    return float(f"{value:.3g}")


def _render_detail(report: Report, console: Console) -> None:
    """The ``--detail`` tables: miss-cause shares; tokens, ``bound_fa`` and preemptions;
    waiting (steps from eligibility to admission) and time."""
    causes = report_table("miss causes (shares of the missed prompt tokens)",
                          ["policy", *(CAUSE_LABELS[c] for c in MISS_CAUSES)],
                          labels={"policy"})
    tokens = report_table("tokens", ["policy", "hit tokens", "prompt tokens", "bridge",
                                     "bound_fa", "preempt"], labels={"policy"})
    times = report_table("waiting (steps) and time (s)",
                         ["policy", "wait p50", "p99", "max", "steps", "manager s",
                          "sched s", "wall s"], labels={"policy"})
    for run in report.runs:
        r = run.result
        label = _label(r)
        shares = r.misses.shares()
        causes.add_row(label, *(f"{100 * shares[c]:.1f}%" for c in MISS_CAUSES))
        tokens.add_row(label, f"{r.hit_tokens:,}", f"{r.prompt_tokens:,}",
                       f"{r.bridge_tokens:,}", percent(r.bound_fa), f"{r.preemptions:,}")
        times.add_row(label, f"{r.wait_p50_steps:,.0f}", f"{r.wait_p99_steps:,.0f}",
                      f"{r.wait_max_steps:,}", f"{r.steps:,}", f"{r.manager_seconds:.2f}",
                      f"{r.scheduler_seconds:.2f}", f"{r.wall_seconds:.2f}")
    tables = [causes, tokens, times]
    timed = [run.result for run in report.runs if run.result.time is not None]
    if timed:
        tables.append(_time_table(timed))
    for table in tables:
        console.print(table)
    console.print(f"bound_fa: the offline optimum over full-attention blocks only (the "
                  f"largest: {percent(report.bound_fa)}); wait: steps from eligibility to "
                  "first admission (the replay has no time model); sched s: manager + "
                  "scheduler time.", style="dim")


def _time_table(results: Sequence[RunResult]) -> Table:
    """``--clock time``: latency percentiles, input throughput, goodput, busy fraction
    (e2e latency, output throughput and the share meeting the SLO: ``--json``)."""
    goodput = any("goodput_rps" in (r.time or {}) for r in results)
    table = report_table(f"time model ({results[0].time_label})",
                         ["policy", "TTFT p50", "p90", "p99", "TPOT p50", "queue p99",
                          "in tok/s", *(["goodput/s"] if goodput else []), "busy"],
                         labels={"policy"})
    for r in results:
        t = r.time or {}
        table.add_row(_label(r), *(seconds(t[k]) for k in (
            "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "queue_p99_s")),
            f"{t['input_tokens_per_s']:,.0f}",
            *([f"{t.get('goodput_rps', 0.0):.2f}"] if goodput else []),
            percent(t["busy_fraction"]))
    return table


def pool_line(settings: Mapping[str, object]) -> str:
    """The report's line about the pool and the workload (empty when not known).

    >>> pool_line({"num_blocks": 1025, "block_tokens": 16, "pool_token_slots": 16400,
    ...            "pool_bytes": 1025 << 20, "workload": "workload aba"})
    'pool 1,025 blocks × 16 tokens = 16,400 token slots, 1.0 GiB; workload aba'
    """
    if "pool_bytes" not in settings:
        return ""
    line = (f"pool {settings['num_blocks']:,} blocks × {settings['block_tokens']} tokens = "
            f"{settings['pool_token_slots']:,} token slots, "
            f"{format_bytes(float(str(settings['pool_bytes'])))}")
    workload = settings.get("workload")
    return f"{line}; {workload}" if workload else line


def row_shares(row: Mapping[str, object]) -> dict[str, float]:
    """A sweep row's miss-cause shares of the missed tokens (all 0 when none missed).

    >>> row_shares({"miss_cold": 1, "miss_evicted": 3, "miss_tail": 0, "miss_alignment": 0,
    ...          "miss_admission": 0})["evicted"]
    0.75
    """
    missed = {cause: int(str(row.get(f"miss_{cause}", 0))) for cause in MISS_CAUSES}
    total = sum(missed.values())
    return {cause: tokens / total if total else 0.0 for cause, tokens in missed.items()}


def as_float(value: object) -> float | None:
    return None if value is None or value == "" else float(str(value))


def _render_fractions(report: Report, console: Console) -> None:
    fractions = list(report.runs[0].fractions)
    table = report_table("replay-phase hit rate (%) per prompt fraction",
                         ["policy", *fractions], labels={"policy"})
    for run in report.runs:
        cells = [f"{100 * _tag(run.fractions[f], 'replay').hit_rate:.1f}"
                 for f in fractions]
        table.add_row(_label(run.result), *cells)
    console.print(table)


def _label(result: RunResult) -> str:
    """Policy name, with the admission order unless it is the protocol's ``fcfs``."""
    if result.admission == "fcfs":
        return result.policy
    return f"{result.policy} [{result.admission}]"


def plot_policies(report: Report, path: Path, *, format: str | None = None) -> None:
    """Bar chart of hit rate per policy with the ceiling (line per policy over fractions
    for the retention microbenchmark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, causes_ax) = plt.subplots(1, 2, figsize=(14, 4.5))
    if any(run.fractions for run in report.runs):
        for run in report.runs:
            xs = [float(f) for f in run.fractions]
            ys = [100 * _tag(r, "replay").hit_rate for r in run.fractions.values()]
            ax.plot(xs, ys, marker="o", label=_label(run.result))
        ax.set_xlabel("replayed prompt fraction f")
        ax.legend(fontsize=8)
    else:
        names = [_label(run.result) for run in report.runs]
        values = [100 * run.result.hit_rate for run in report.runs]
        ax.bar(names, values, color="tab:blue")
        ax.axhline(100 * report.ceiling, color="tab:red", linestyle="--", label="ceiling")
        for value, label, style in ((report.bound, "bound", ":"),
                                    (report.bound_fa, "bound_fa", "-.")):
            if value is not None:
                ax.axhline(100 * value, color="tab:green", linestyle=style, label=label)
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", rotation=30)
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title(f"{report.trace} on {report.model}")
    plot_miss_causes(causes_ax, report.runs)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=format)
    plt.close(fig)


def plot_miss_causes(ax: object, runs: Sequence[PolicyRun]) -> None:
    """Stacked bars per policy: hit tokens, then each miss cause, as shares of the prompt
    tokens (each bar adds up to 100%)."""
    names = [run.result.policy for run in runs]
    bottoms = [0.0] * len(runs)
    colors = {"hit": "tab:blue", "cold": "tab:gray", "evicted": "tab:red",
              "tail": "tab:orange", "alignment": "tab:purple", "admission": "tab:brown",
              "host_evicted": "tab:pink"}
    for part in ("hit", *MISS_CAUSES):
        heights = []
        for run in runs:
            r = run.result
            tokens = r.hit_tokens if part == "hit" else getattr(r.misses, part)
            heights.append(100 * tokens / r.prompt_tokens if r.prompt_tokens else 0.0)
        ax.bar(names, heights, bottom=bottoms, color=colors[part],  # type: ignore[attr-defined]
               label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_ylabel("share of prompt tokens (%)")  # type: ignore[attr-defined]
    ax.set_title("hits and miss causes")  # type: ignore[attr-defined]
    ax.tick_params(axis="x", rotation=30)  # type: ignore[attr-defined]
    ax.legend(fontsize=8)  # type: ignore[attr-defined]
