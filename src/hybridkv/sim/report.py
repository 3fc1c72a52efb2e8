"""Report rendering: the policy table (rich), the JSON document and plots (matplotlib)."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from hybridkv.sim.limits import format_bytes
from hybridkv.sim.misses import MISS_CAUSES
from hybridkv.sim.replay import RunResult, TagTotals
from hybridkv.sim.table_layout import (
    CAUSE_LABELS,
    largest_miss,
    percent,
    report_table,
    seconds,
)

if TYPE_CHECKING:  # sweep imports the commands, which import this module
    from hybridkv.sim.sweep import Cell

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
        **({"time": {k: round(v, 6) for k, v in result.time.items()},
            "time_gpu": result.time_label, "request_times": result.request_times}
           if result.time is not None else {}),
    }


def render_table(report: Report, console: Console, *, detail: bool = False) -> None:
    """Print the default policy table (what a user decides on: hit rate, ``bound``, the
    largest miss cause, time; ``ceiling`` in the title, the best hit rate starred) and,
    with ``detail``, the tables of the rest (miss causes, tokens, waiting and time)."""
    show_admission = any(run.result.admission != "fcfs" for run in report.runs)
    timed = any(run.result.time is not None for run in report.runs)
    table = report_table(
        f"{report.trace} on {report.model} · ceiling {percent(report.ceiling)}",
        ["policy", *(["admission"] if show_admission else []), "hit rate", "bound",
         *(["TTFT p99"] if timed else []), "largest miss", "wall s"],
        labels={"policy", "admission"})
    best = max((r.result.hit_rate for r in report.runs), default=0.0)
    for run in report.runs:
        r = run.result
        mark = " *" if r.hit_rate == best and len(report.runs) > 1 else ""
        ttft = [seconds(r.time["ttft_p99_s"]) if r.time else "–"] if timed else []
        table.add_row(f"{r.policy}{mark}", *([r.admission] if show_admission else []),
                      percent(r.hit_rate), percent(r.bound), *ttft,
                      largest_miss(r.misses.shares()), f"{r.wall_seconds:.2f}")
    console.print(table)
    pool = pool_line(report.settings)
    if pool:
        console.print(pool, soft_wrap=True)
    console.print(f"* = best hit rate; bound: offline optimum for each run's admission "
                  f"order (the largest: {percent(report.bound)}); ceiling: infinite cache; "
                  "largest miss: the miss cause of most missed tokens"
                  + ("" if detail else "; more columns: --detail, --json")
                  + " (hybridkv replay --help)", style="dim", soft_wrap=True)
    if detail:
        _render_detail(report, console)
    if any(run.fractions for run in report.runs):
        _render_fractions(report, console)


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
                  "scheduler time.", style="dim", soft_wrap=True)


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


def render_sweep_cells(cells: Sequence[Cell], rows: Mapping[str, Mapping[str, object]],
                       resumed: Collection[str], console: Console, *,
                       detail: bool = False) -> None:
    """A sweep's cells, one table per (trace, model) with its ``ceiling`` in the title:
    pool, policy, admission order (when not all ``fcfs``), hit rate, ``bound``, the
    largest miss cause and time; ``*`` marks the best hit rate of a pool size, ``r`` a
    cell resumed from ``--results``; a pool too small for the trace reads ``too small``
    and ``needs ≥ N`` (the smallest pool that holds its largest request). ``detail`` adds
    a table per (trace, model) of the miss-cause shares, ``bound_fa``, tokens and
    preemptions."""
    panels = list(dict.fromkeys((c.source, c.model) for c in cells))
    show = _SweepColumns(admission=any(c.admission != "fcfs" for c in cells),
                         memory=any(c.kv_memory for c in cells),
                         resumed=any(c.key in resumed for c in cells))
    from hybridkv.sim.sweep import is_too_small  # sweep imports this module (commands)

    measured = {key: row for key, row in rows.items() if not is_too_small(row)}
    best: dict[tuple[str, str, int], float] = {}
    for c in cells:
        if c.key in measured:
            rate = float(str(rows[c.key]["hit_rate"]))
            slot = (c.source, c.model, c.num_blocks)
            best[slot] = max(best.get(slot, rate), rate)
    for source, model in panels:
        panel = [c for c in cells if (c.source, c.model) == (source, model)]
        ceilings = sorted({float(str(measured[c.key]["ceiling"])) for c in panel
                           if c.key in measured})
        ceiling = ("n/a" if not ceilings else percent(ceilings[0]) if len(ceilings) == 1
                   else f"{percent(ceilings[0])}–{percent(ceilings[-1])}")
        table = report_table(f"{source} on {model} · ceiling {ceiling}",
                             [*show.lead(), "hit rate", "bound", "largest miss", "wall s",
                              *([""] if show.resumed else [])],
                             labels={"policy", "admission", ""})
        for c in panel:
            row = rows.get(c.key)
            if row is None or is_too_small(row):
                needs = "" if row is None else f"needs ≥ {int(str(row['min_num_blocks'])):,}"
                table.add_row(*show.lead_cells(c), "not run" if row is None else "too small",
                              "", needs, "", *([""] if show.resumed else []))
                continue
            rate = float(str(row["hit_rate"]))
            mark = " *" if rate == best[(c.source, c.model, c.num_blocks)] else ""
            table.add_row(*show.lead_cells(c), f"{percent(rate)}{mark}",
                          percent(_float(row["bound"])), largest_miss(_shares(row)),
                          f"{float(str(row['wall_seconds'])):.1f}",
                          *(["r" if c.key in resumed else ""] if show.resumed else []))
        console.print(table)
        if detail:
            _render_sweep_detail(panel, rows, show, console)
    too_small = any(is_too_small(row) for row in rows.values())
    console.print("* = best hit rate of its pool size; r = resumed from --results; bound: "
                  "offline optimum of each run's admissions; largest miss: the miss cause of "
                  "most missed tokens"
                  + ("; too small: the pool cannot hold the trace's largest request, needs ≥ "
                     "N blocks" if too_small else "")
                  + ("" if detail else "; more columns: --detail, --csv, --json")
                  + " (hybridkv replay --help)", style="dim", soft_wrap=True)


@dataclass(frozen=True, slots=True)
class _SweepColumns:
    """Which optional columns a sweep's tables show."""

    admission: bool
    memory: bool
    resumed: bool

    def lead(self) -> list[str]:
        return ["blocks", *(["memory"] if self.memory else []), "policy",
                *(["admission"] if self.admission else [])]

    def lead_cells(self, cell: Cell) -> list[str]:
        return [f"{cell.num_blocks:,}", *([cell.kv_memory or ""] if self.memory else []),
                cell.policy, *([cell.admission] if self.admission else [])]


def _shares(row: Mapping[str, object]) -> dict[str, float]:
    """A sweep row's miss-cause shares of the missed tokens (all 0 when none missed).

    >>> _shares({"miss_cold": 1, "miss_evicted": 3, "miss_tail": 0, "miss_alignment": 0,
    ...          "miss_admission": 0})["evicted"]
    0.75
    """
    missed = {cause: int(str(row[f"miss_{cause}"])) for cause in MISS_CAUSES}
    total = sum(missed.values())
    return {cause: tokens / total if total else 0.0 for cause, tokens in missed.items()}


def _render_sweep_detail(panel: Sequence[Cell], rows: Mapping[str, Mapping[str, object]],
                         show: _SweepColumns, console: Console) -> None:
    """Two tables: the miss-cause shares; ``bound_fa``, tokens and preemptions."""
    from hybridkv.sim.sweep import is_too_small

    lead = ["blocks", "policy", *(["admission"] if show.admission else [])]
    causes = report_table("miss causes (shares of the missed tokens)",
                          [*lead, *(CAUSE_LABELS[c] for c in MISS_CAUSES)],
                          labels={"policy", "admission"})
    tokens = report_table("bound_fa, tokens, preemptions",
                          [*lead, "bound_fa", "hit tokens", "prompt tokens", "preempt"],
                          labels={"policy", "admission"})
    for c in panel:
        row = rows.get(c.key)
        if row is None or is_too_small(row):
            continue
        cells = [f"{c.num_blocks:,}", c.policy, *([c.admission] if show.admission else [])]
        shares = _shares(row)
        causes.add_row(*cells, *(f"{100 * shares[k]:.1f}%" for k in MISS_CAUSES))
        tokens.add_row(*cells, percent(_float(row["bound_fa"])),
                       f"{int(str(row['hit_tokens'])):,}",
                       f"{int(str(row['prompt_tokens'])):,}",
                       f"{int(str(row['preemptions'])):,}")
    console.print(causes)
    console.print(tokens)


def _float(value: object) -> float | None:
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
              "tail": "tab:orange", "alignment": "tab:purple", "admission": "tab:brown"}
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


SWEEP_POLICY_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown",
                       "tab:pink", "tab:olive", "tab:cyan", "navy", "darkgoldenrod",
                       "teal", "slateblue")
"""Line colours of a sweep plot's policies (cycled, with a new dash style each round)."""
SWEEP_CEILING_COLOR = "red"
"""The ceiling's colour: none of ``SWEEP_POLICY_COLORS``."""
SWEEP_BOUND_COLOR = "black"
SWEEP_TOO_SMALL_COLOR = "grey"
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p")
_DASHES = ("-", "--", "-.", ":")


def plot_sweep(rows: Sequence[Mapping[str, object]], path: Path, *,
               format: str | None = None) -> None:
    """Hit rate versus pool size, one panel per (trace, model), one line per policy
    (and admission order), with ``bound`` (the largest per-run one of each pool size,
    black) and ``ceiling`` (red, a colour no policy uses). Coinciding lines stay
    readable: each policy has its own hollow marker, drawn smaller than the one before,
    so equal points nest instead of hiding each other. Pool sizes too small for the
    trace are grey crosses on the axis, with the smallest pool that holds it. Pool sizes
    spanning 10× or more get a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybridkv.sim.sweep import is_too_small

    traces = list(dict.fromkeys(str(r["trace"]) for r in rows))
    models = list(dict.fromkeys(str(r["model"]) for r in rows))
    timed = any(r.get("goodput_rps") is not None for r in rows)
    fig, axes = plt.subplots(len(traces) * (2 if timed else 1), len(models), squeeze=False,
                             figsize=(6.5 * len(models),
                                      4.2 * len(traces) * (2 if timed else 1)))
    lines = list(dict.fromkeys((str(r["policy"]), str(r["admission"])) for r in rows))
    if timed:
        for (ti, trace), (mi, model) in ((t, m) for t in enumerate(traces)
                                         for m in enumerate(models)):
            panel = [r for r in rows if r["trace"] == trace and r["model"] == model
                     and not is_too_small(r)]
            _plot_goodput(axes[len(traces) + ti][mi], lines, panel, f"{trace} on {model}")
    for (ti, trace), (mi, model) in ((t, m) for t in enumerate(traces)
                                     for m in enumerate(models)):
        ax = axes[ti][mi]
        panel = [r for r in rows if r["trace"] == trace and r["model"] == model]
        if not panel:
            ax.set_visible(False)
            continue
        measured = [r for r in panel if not is_too_small(r)]
        for number, line in enumerate(lines):
            _plot_policy_line(ax, number, line, measured)
        _plot_limits(ax, measured)
        _mark_too_small(ax, [r for r in panel if is_too_small(r)])
        pools = sorted({int(str(r["num_blocks"])) for r in panel})
        if pools[-1] >= 10 * pools[0]:
            ax.set_xscale("log")
        ax.set_xlabel("pool size (blocks)")
        ax.set_ylabel("prefix-cache hit rate (%)")
        ax.set_title(f"{trace} on {model}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=format)
    plt.close(fig)


SLO_ATTAINMENT = 0.9
"""A pool "meets the SLO" when this share of its requests meet ``--slo`` (the goodput
plot marks the smallest such pool of each policy)."""


def _plot_goodput(ax: Any, lines: Sequence[tuple[str, str]],
                  panel: Sequence[Mapping[str, object]], title: str) -> None:
    """``--clock time`` sweeps: goodput (requests/s meeting ``--slo``) against KV memory,
    one line per policy, a star on the smallest pool where ``SLO_ATTAINMENT`` of the
    requests meet the SLO."""
    for number, line in enumerate(lines):
        points = sorted((int(str(r["pool_bytes"])) / 2**30, float(str(r["goodput_rps"])),
                         float(str(r.get("slo_attained") or 0.0)))
                        for r in panel if (r["policy"], r["admission"]) == line
                        and r.get("goodput_rps") is not None)
        if not points:
            continue
        color = SWEEP_POLICY_COLORS[number % len(SWEEP_POLICY_COLORS)]
        label = line[0] if line[1] == "fcfs" else f"{line[0]} [{line[1]}]"
        ax.plot([p[0] for p in points], [p[1] for p in points], color=color,
                marker=_MARKERS[number % len(_MARKERS)], markerfacecolor="none", label=label)
        meets = [p for p in points if p[2] >= SLO_ATTAINMENT]
        if meets:
            ax.plot([meets[0][0]], [meets[0][1]], marker="*", markersize=14, color=color,
                    linestyle="none")
    ax.set_xlabel("KV memory (GiB)")
    ax.set_ylabel("goodput (requests/s within the SLO)")
    ax.set_title(f"{title}: goodput (* smallest pool with {SLO_ATTAINMENT:.0%} within "
                 "the SLO)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _plot_policy_line(ax: Any, number: int, line: tuple[str, str],
                      panel: Sequence[Mapping[str, object]]) -> None:
    """One policy's (and admission order's) hit rate over the pool sizes, in the
    ``number``-th colour, dash and marker."""
    policy, admission = line
    points = sorted((int(str(r["num_blocks"])), 100 * float(str(r["hit_rate"])))
                    for r in panel if (r["policy"], r["admission"]) == line)
    if not points:
        return
    label = policy if admission == "fcfs" else f"{policy} [{admission}]"
    color = SWEEP_POLICY_COLORS[number % len(SWEEP_POLICY_COLORS)]
    dash = _DASHES[number // len(SWEEP_POLICY_COLORS) % len(_DASHES)]
    ax.plot([p[0] for p in points], [p[1] for p in points], color=color,
            linestyle=dash, marker=_MARKERS[number % len(_MARKERS)],
            markersize=max(3.0, 11.0 - 1.2 * number), markerfacecolor="none",
            markeredgewidth=1.4, linewidth=1.2, label=label)


def _plot_limits(ax: Any, panel: Sequence[Mapping[str, object]]) -> None:
    """``bound`` (the largest of each pool size) and ``ceiling`` of a panel's measured
    cells."""
    if not panel:
        return
    pools = sorted({int(str(r["num_blocks"])) for r in panel})
    bounds = [max((b for r in panel if int(str(r["num_blocks"])) == n
                   and (b := _float(r["bound"])) is not None), default=None)
              for n in pools]
    known = [(n, 100 * b) for n, b in zip(pools, bounds, strict=True) if b is not None]
    if known:
        ax.plot([k[0] for k in known], [k[1] for k in known], color=SWEEP_BOUND_COLOR,
                linestyle=":", marker="x", linewidth=1.2, label="bound")
    ceiling = max(float(str(r["ceiling"])) for r in panel)
    ax.axhline(100 * ceiling, color=SWEEP_CEILING_COLOR, linestyle="--", linewidth=1.2,
               label="ceiling")


def _mark_too_small(ax: Any, panel: Sequence[Mapping[str, object]]) -> None:
    """Grey crosses at 0% for the pool sizes too small for the trace, labelled with the
    smallest pool that holds it."""
    if not panel:
        return
    pools = sorted({int(str(r["num_blocks"])) for r in panel})
    needs = max(int(str(r["min_num_blocks"])) for r in panel)
    ax.scatter(pools, [0.0] * len(pools), marker="X", s=60, color=SWEEP_TOO_SMALL_COLOR,
               zorder=3, label=f"too small: needs ≥ {needs:,} blocks")
