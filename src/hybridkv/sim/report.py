"""Report rendering: the policy table (rich), the JSON document and plots (matplotlib)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybridkv.sim.limits import format_bytes
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
    }


def render_table(report: Report, console: Console) -> None:
    """Print the policy comparison table (best hit rate marked)."""
    table = Table(title=f"{report.trace} on {report.model}", title_justify="left")
    for name in ("policy", "hit rate", "bound", "ceiling", "hit tokens", "prompt tokens",
                 "preemptions", "manager s", "wall s"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    best = max((r.result.hit_rate for r in report.runs), default=0.0)
    for run in report.runs:
        r = run.result
        mark = " *" if report.runs and r.hit_rate == best and len(report.runs) > 1 else ""
        bound = "n/a" if report.bound is None else f"{100 * report.bound:.2f}%"
        table.add_row(f"{r.policy}{mark}", f"{100 * r.hit_rate:.2f}%", bound,
                      f"{100 * report.ceiling:.2f}%", f"{r.hit_tokens:,}",
                      f"{r.prompt_tokens:,}", str(r.preemptions),
                      f"{r.manager_seconds:.2f}", f"{r.wall_seconds:.2f}")
    console.print(table)
    pool = pool_line(report.settings)
    if pool:
        console.print(pool)
    console.print("bound: offline optimum (Belady MIN over chained full-attention blocks at "
                  "this pool's token capacity; ignores window KV and running requests) — "
                  "ceiling: infinite cache. * = best policy.", style="dim")
    if any(run.fractions for run in report.runs):
        _render_fractions(report, console)


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


def render_sweep_table(cells: Sequence[tuple[str, int, float | None]], title: str,
                       console: Console) -> None:
    """A sweep's hit rates: one row per policy, one column per pool size (blocks);
    ``cells`` are ``(policy, num_blocks, hit rate or None when the cell failed)``."""
    pools = list(dict.fromkeys(num_blocks for _, num_blocks, _ in cells))
    console.print(f"{title}: hit rate by pool size (blocks)")
    table = Table()
    table.add_column("policy")
    for num_blocks in pools:
        table.add_column(f"{num_blocks:,}", justify="right")
    rates = {(policy, num_blocks): rate for policy, num_blocks, rate in cells}
    for policy in dict.fromkeys(policy for policy, _, _ in cells):
        table.add_row(policy, *("failed" if rates[(policy, n)] is None
                                else f"{100 * float(rates[(policy, n)] or 0.0):.2f}%"
                                for n in pools))
    console.print(table)


def _render_fractions(report: Report, console: Console) -> None:
    fractions = list(report.runs[0].fractions)
    table = Table(title="replay-phase hit rate per prompt fraction", title_justify="left")
    table.add_column("policy")
    for fraction in fractions:
        table.add_column(fraction, justify="right")
    for run in report.runs:
        cells = [f"{100 * _tag(run.fractions[f], 'replay').hit_rate:.1f}"
                 for f in fractions]
        table.add_row(run.result.policy, *cells)
    console.print(table)


def plot_policies(report: Report, path: Path, *, format: str | None = None) -> None:
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
            ax.plot(xs, ys, marker="o", label=run.result.policy)
        ax.set_xlabel("replayed prompt fraction f")
        ax.legend(fontsize=8)
    else:
        names = [run.result.policy for run in report.runs]
        values = [100 * run.result.hit_rate for run in report.runs]
        ax.bar(names, values, color="tab:blue")
        ax.axhline(100 * report.ceiling, color="tab:red", linestyle="--", label="ceiling")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", rotation=30)
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title(f"{report.trace} on {report.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=format)
    plt.close(fig)


def plot_sweep(rows: Sequence[Mapping[str, object]], ceiling: float, title: str,
               path: Path, *, format: str | None = None) -> None:
    """Hit rate versus pool size, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    policies = list(dict.fromkeys(str(row["policy"]) for row in rows))
    for policy in policies:
        points = sorted((int(str(row["num_blocks"])), 100 * float(str(row["hit_rate"])))
                        for row in rows if row["policy"] == policy)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
    ax.axhline(100 * ceiling, color="tab:red", linestyle="--", label="ceiling")
    ax.set_xlabel("pool size (blocks)")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=format)
    plt.close(fig)
