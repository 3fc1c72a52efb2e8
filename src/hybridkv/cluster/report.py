"""Cluster report: the router table (rich), the JSON document and the plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from hybridkv.cluster.simulate import ClusterRun
from hybridkv.sim.table_layout import percent, report_table, seconds

CLUSTER_HELP = """\
Columns: hit = cluster prefix-hit rate (first-admission hit tokens / prompt tokens, all
instances); per-instance = each instance's own hit rate; imbalance = sum over steps of the
largest instance backlog / sum over steps of the mean backlog, where an instance's backlog
is the prompt tokens routed to it and not yet computed or loaded from its cache (1.00 =
every instance always equally loaded, N = one instance holds all of it); backlog = mean
backlog per instance (tokens); max backlog = the most loaded instance's backlog, averaged
over the steps (imbalance x backlog: the ratio divides by the router's own mean backlog,
which prefix hits shrink, so compare this too); steps = global steps until the last
request finished; phantom = prompt tokens a prefix router expected to hit where it routed
that did not hit (its index said resident, the instance could not use it)."""


@dataclass(slots=True)
class ClusterReport:
    trace: str
    model: str
    policy: str
    runs: list[ClusterRun]
    settings: dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"trace": self.trace, "model": self.model, "policy": self.policy,
                "settings": self.settings, "runs": [run.to_json() for run in self.runs]}

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def render_cluster_table(report: ClusterReport, console: Console, *,
                         detail: bool = False) -> None:
    """The default table, one row per router (the best cluster hit rate starred): hit
    rate, the instances' lowest and highest hit rate, load imbalance, preemptions, time;
    ``detail`` adds every instance's hit rate, the backlogs, steps and phantom hits."""
    n = int(str(report.settings.get("instances", 0)) or 0)
    timed = any(run.time is not None for run in report.runs)
    table = report_table(f"{report.trace} on {report.model}, {n} instances, policy "
                         f"{report.policy}", ["router", "hit rate", "instances",
                                              "imbalance", *(["TTFT p99"] if timed else []),
                                              "preempt", "wall s"],
                         labels={"router"})
    best = max((run.hit_rate for run in report.runs), default=0.0)
    for run in report.runs:
        star = " *" if run.hit_rate == best and len(report.runs) > 1 else ""
        rates = [100 * r.hit_rate for r in run.instances]
        spread = f"{min(rates):.1f}–{max(rates):.1f}%" if rates else "n/a"
        ttft = [seconds(run.time["ttft_p99_s"]) if run.time else "–"] if timed else []
        table.add_row(run.router + star, percent(run.hit_rate), spread,
                      f"{run.load_imbalance:.2f}", *ttft, f"{run.preemptions:,}",
                      f"{run.seconds:.1f}")
    console.print(table)
    settings = report.settings
    console.print(f"pool {settings.get('num_blocks', '?'):,} blocks per instance; "
                  f"{settings.get('workload', report.trace)}")
    console.print("* = best cluster hit rate; instances: the lowest and highest instance "
                  "hit rate; imbalance: max / mean backlog over time"
                  + ("" if detail else "; more columns: --detail, --json")
                  + " (hybridkv cluster --help)", style="dim")
    if detail:
        _render_detail(report, console)


def _render_detail(report: ClusterReport, console: Console) -> None:
    table = report_table("backlogs (tokens), steps, phantom hits (tokens); per-instance "
                         "hit rates (%)", ["router", "backlog", "max backlog", "steps",
                                           "phantom", "per-instance"],
                         labels={"router", "per-instance"})
    for run in report.runs:
        table.add_row(run.router, f"{run.mean_backlog_tokens:,.0f}",
                      f"{run.mean_max_backlog_tokens:,.0f}", f"{run.steps:,}",
                      f"{run.phantom_hit_tokens:,}",
                      " ".join(f"{100 * r.hit_rate:.1f}" for r in run.instances))
    console.print(table)
    timed = [run for run in report.runs if run.time is not None]
    if timed:
        times = report_table(f"time model ({report.settings.get('time_gpu', '')}): latency "
                             "per router", [
            "router", "TTFT p50", "p90", "p99", "TPOT p50", "queue p99", "in tok/s",
            "busy"], labels={"router"})
        for run in timed:
            t = run.time or {}
            times.add_row(run.router, *(seconds(t[k]) for k in (
                "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "queue_p99_s")),
                f"{t['input_tokens_per_s']:,.0f}", percent(t["busy_fraction"]))
        console.print(times)


def plot_cluster(report: ClusterReport, path: Path, *, format: str = "png") -> None:
    """Two panels: cluster (bar) and per-instance (dots) hit rate by router; load imbalance
    by router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [run.router for run in report.runs]
    positions = range(len(names))
    figure, (hits, balance) = plt.subplots(1, 2, figsize=(11, 4.2))
    hits.bar(positions, [100 * run.hit_rate for run in report.runs], color="#4C72B0",
             label="cluster")
    for x, run in zip(positions, report.runs, strict=True):
        hits.scatter([x] * len(run.instances), [100 * r.hit_rate for r in run.instances],
                     color="black", s=10, zorder=3,
                     label="per instance" if x == 0 else None)
    hits.set_ylabel("prefix-hit rate (%)")
    hits.set_title("hit rate")
    hits.legend(loc="best", fontsize=8)
    balance.bar(positions, [run.load_imbalance for run in report.runs], color="#DD8452")
    balance.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    balance.set_ylabel("max / mean queued prompt tokens (over time)")
    balance.set_title("load imbalance (lower is better)")
    for axis in (hits, balance):
        axis.set_xticks(list(positions))
        axis.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    instances = report.settings.get("instances", "?")
    figure.suptitle(f"{report.trace} on {report.model}: {instances} instances, "
                    f"{report.settings.get('num_blocks', '?')} blocks each, "
                    f"policy {report.policy}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, format=format)
    plt.close(figure)


__all__: Sequence[str] = ("CLUSTER_HELP", "ClusterReport", "plot_cluster",
                          "render_cluster_table")
