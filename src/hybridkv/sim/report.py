"""Report rendering: the policy table (rich), the JSON document and plots (matplotlib)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybridkv.sim.replay import RunResult, TagTotals


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
    """Offline optimum at this pool's token capacity (``hybridkv.sim.bound``); ``None``
    for models without a full-attention group."""

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
                "bound": self.bound, "settings": self.settings, "runs": runs}

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
    }


def render_table(report: Report, console: Console) -> None:
    """Print the policy comparison table (best hit rate marked)."""
    table = Table(title=f"{report.trace} on {report.model}", title_justify="left")
    for name in ("policy", "admission", "hit rate", "bound", "ceiling", "hit tokens",
                 "prompt tokens", "preemptions", "wait p50/p99/max steps", "manager s",
                 "sched s", "wall s"):
        table.add_column(name, justify="left" if name in ("policy", "admission") else "right")
    best = max((r.result.hit_rate for r in report.runs), default=0.0)
    for run in report.runs:
        r = run.result
        mark = " *" if report.runs and r.hit_rate == best and len(report.runs) > 1 else ""
        bound = "n/a" if report.bound is None else f"{100 * report.bound:.2f}%"
        table.add_row(f"{r.policy}{mark}", r.admission, f"{100 * r.hit_rate:.2f}%", bound,
                      f"{100 * report.ceiling:.2f}%", f"{r.hit_tokens:,}",
                      f"{r.prompt_tokens:,}", str(r.preemptions),
                      f"{r.wait_p50_steps:,.0f} / {r.wait_p99_steps:,.0f} / "
                      f"{r.wait_max_steps:,}",
                      f"{r.manager_seconds:.2f}", f"{r.scheduler_seconds:.2f}",
                      f"{r.wall_seconds:.2f}")
    console.print(table)
    console.print("bound: offline optimum (Belady MIN over chained full-attention blocks at "
                  "this pool's token capacity; ignores window KV and running requests) — "
                  "ceiling: infinite cache. * = best policy. wait: steps from eligibility to "
                  "first admission (the replay has no time model: steps only); sched s: "
                  "manager + scheduler time.", style="dim")
    if any(run.fractions for run in report.runs):
        _render_fractions(report, console)


def _render_fractions(report: Report, console: Console) -> None:
    fractions = list(report.runs[0].fractions)
    table = Table(title="replay-phase hit rate per prompt fraction", title_justify="left")
    table.add_column("policy")
    for fraction in fractions:
        table.add_column(fraction, justify="right")
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


def plot_policies(report: Report, path: Path) -> None:
    """Bar chart of hit rate per policy with the ceiling (line per policy over fractions
    for the retention microbenchmark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
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
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", rotation=30)
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title(f"{report.trace} on {report.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: Sequence[Mapping[str, object]], ceiling: float, title: str,
               path: Path) -> None:
    """Hit rate versus pool size, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    keys = list(dict.fromkeys((str(row["policy"]), str(row.get("admission", "fcfs")))
                              for row in rows))
    for policy, admission in keys:
        points = sorted((int(str(row["num_blocks"])), 100 * float(str(row["hit_rate"])))
                        for row in rows if row["policy"] == policy
                        and str(row.get("admission", "fcfs")) == admission)
        label = policy if admission == "fcfs" else f"{policy} [{admission}]"
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.axhline(100 * ceiling, color="tab:red", linestyle="--", label="ceiling")
    ax.set_xlabel("pool size (blocks)")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
