"""The sweep's report: its table (one panel per trace × model) and plot (hit rate versus
pool size, one line per policy and admission order)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from hybridkv.sim.misses import MISS_CAUSES
from hybridkv.sim.report import as_float, row_shares
from hybridkv.sim.table_layout import CAUSE_LABELS, largest_miss, percent, report_table
from hybridkv.sweep.cells import Cell, is_too_small


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
                          percent(as_float(row["bound"])), largest_miss(row_shares(row)),
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
                  + " (hybridkv replay --help)", style="dim")


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


def _render_sweep_detail(panel: Sequence[Cell], rows: Mapping[str, Mapping[str, object]],
                         show: _SweepColumns, console: Console) -> None:
    """Two tables: the miss-cause shares; ``bound_fa``, tokens and preemptions."""
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
        shares = row_shares(row)
        causes.add_row(*cells, *(f"{100 * shares[k]:.1f}%" for k in MISS_CAUSES))
        tokens.add_row(*cells, percent(as_float(row["bound_fa"])),
                       f"{int(str(row['hit_tokens'])):,}",
                       f"{int(str(row['prompt_tokens'])):,}",
                       f"{int(str(row['preemptions'])):,}")
    console.print(causes)
    console.print(tokens)


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
                   and (b := as_float(r["bound"])) is not None), default=None)
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


__all__ = ["SWEEP_BOUND_COLOR", "SWEEP_CEILING_COLOR", "SWEEP_POLICY_COLORS",
           "SWEEP_TOO_SMALL_COLOR", "plot_sweep", "render_sweep_cells"]
