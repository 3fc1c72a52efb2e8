"""``hybridkv sweep``: traces × models × pool sizes × policies × admission orders.

Everything the user typed is checked before the first cell runs (output paths, the
results directory, Ray, every trace, model, pool size, policy and admission order);
then the cells whose rows are not stored yet in ``--results DIR`` run serially, in
``--jobs N`` processes or on Ray (``--ray [ADDRESS]``), each stored the moment it
finishes. The table covers every cell; CSV / JSON / plot go only to the paths named with
``--csv`` / ``--json`` / ``--plot``, staged and renamed into place together at the end
(nothing is written into the working directory unasked, nothing partial on Ctrl-C).

A pool size too small for some request of the trace is a result, not a failure: its
cells say "too small" and the smallest pool that holds the request (table, CSV, JSON and
plot; stored in ``--results`` like any cell), and the sweep exits 0. (A single ``hybridkv
replay`` on such a pool is an error, exit 2.)
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

import hybridkv
from hybridkv.cli.replay import resolve_settings, resolve_source
from hybridkv.errors import ConfigError
from hybridkv.models.shapes import ModelShape, load_model
from hybridkv.outputs import check_output_paths, plot_output, write_outputs
from hybridkv.sched.admission import parse_admissions
from hybridkv.sim.run import (
    DEFAULT_MODEL,
    check_policies_fit,
    parse_policies,
    progress_bar,
    resolve_pool,
)
from hybridkv.sweep.cells import (
    ROW_FIELDS,
    TIME_FIELDS,
    Cell,
    CellError,
    CellOptions,
    Row,
    cell_key,
    default_workers,
    file_fingerprint,
    is_too_small,
    key_material,
    too_small_row,
)
from hybridkv.sweep.report import plot_sweep, render_sweep_cells
from hybridkv.sweep.run import SweepWork, run_processes, run_serial
from hybridkv.sweep.store import ResultStore
from hybridkv.traces.source import Source


@dataclass(slots=True)
class SweepState:
    """Outcome of every cell so far, by key."""

    rows: dict[str, Row] = field(default_factory=dict)
    resumed: set[str] = field(default_factory=set)
    computed: int = 0


@dataclass(frozen=True, slots=True)
class Outputs:
    csv: Path | None
    json: Path | None
    plot: Path | None


def _check_outputs(args: argparse.Namespace) -> Outputs:
    checked = check_output_paths([("--csv", args.csv), ("--json", args.json),
                                  ("--plot", args.plot)])
    return Outputs(checked["--csv"], checked["--json"], checked["--plot"])


def _split(values: Sequence[str] | None, flag: str) -> list[str]:
    """Repeated and comma-separated values, in order, without duplicates."""
    items: list[str] = []
    for value in values or ():
        parts = [part.strip() for part in value.split(",")]
        if not all(parts):
            raise ConfigError(flag, value, "has an empty item between commas")
        items.extend(parts)
    return list(dict.fromkeys(items))


def _unique(label: str, taken: set[str]) -> str:
    candidate, number = label, 2
    while candidate in taken:
        candidate, number = f"{label} #{number}", number + 1
    taken.add(candidate)
    return candidate


def resolve_sources(args: argparse.Namespace) -> list[tuple[str, Source, dict[str, object]]]:
    """(label, source, identity) per ``--trace`` and ``--workload`` (the default workload
    when neither is given); ``--set`` applies to every workload."""
    traces = list(dict.fromkeys(args.trace or ()))
    workloads = _split(args.workload, "--workload")
    if args.set and traces and not workloads:
        raise ConfigError("--set", args.set, "workload parameters need --workload, not --trace")
    taken: set[str] = set()
    resolved: list[tuple[str, Source, dict[str, object]]] = []
    for trace in traces:
        source = resolve_source(argparse.Namespace(trace=trace, workload=None, set=[],
                                                   limit=args.limit))
        identity = {"trace": file_fingerprint(Path(trace)), "limit": args.limit}
        resolved.append((_unique(source.name, taken), source, identity))
    chosen: list[str | None] = [*workloads] if workloads or traces else [None]
    for workload in chosen:
        source = resolve_source(argparse.Namespace(trace=None, workload=workload,
                                                   set=args.set, limit=args.limit))
        identity = {"workload": source.workload, "params": source.params,
                    "limit": args.limit}
        resolved.append((_unique(source.name, taken), source, identity))
    return resolved


def resolve_models(args: argparse.Namespace) -> list[tuple[str, ModelShape]]:
    names = _split(args.model, "--model") or [DEFAULT_MODEL]
    taken: set[str] = set()
    return [(_unique(shape.name, taken), shape) for shape in map(load_model, names)]


def resolve_pools(args: argparse.Namespace, shape: ModelShape, source: Source,
                  workers: int) -> list[tuple[int, str | None]]:
    """(blocks, the ``--kv-memory`` budget it came from) per pool size, in order."""
    pools: list[tuple[int, str | None]] = []
    if args.num_blocks is not None:
        for item in _split([args.num_blocks], "--num-blocks"):
            if not item.isdigit() or len(item) > 30:
                raise ConfigError("--num-blocks", item, "must be an integer >= 2")
            pools.append((resolve_pool(int(item), None, shape, source,
                                       num_processes=workers), None))
    elif args.kv_memory is not None:
        pools = [(resolve_pool(None, memory, shape, source, num_processes=workers), memory)
                 for memory in _split([args.kv_memory], "--kv-memory")]
    else:
        raise ConfigError("--num-blocks", None, "a sweep needs --num-blocks or --kv-memory "
                          "lists, e.g. --num-blocks 5000,10000")
    return list(dict.fromkeys(pools))


def plan_cells(args: argparse.Namespace, sources: Sequence[tuple[str, Source, dict[str, object]]],
               models: Sequence[tuple[str, ModelShape]], options: Mapping[str, CellOptions],
               workers: int) -> tuple[list[Cell], dict[str, dict[str, object]]]:
    """Every cell in grid order (trace, model, pool, admission, policy) and each cell's
    key material by key."""
    admissions = parse_admissions(args.admission)
    cells: list[Cell] = []
    materials: dict[str, dict[str, object]] = {}
    for source_label, source, identity in sources:
        policies = parse_policies(args.policy, source.has_sessions)
        for model_label, shape in models:
            alignment = shape.cache_config(2).alignment_tokens
            check_policies_fit(policies, alignment, args.policy)
            for num_blocks, memory in resolve_pools(args, shape, source, workers):
                for admission in admissions:
                    for policy in policies:
                        material = key_material(identity, shape, num_blocks, policy,
                                                admission, options[source_label])
                        key = cell_key(material)
                        materials[key] = material  # equal content under two names: one key
                        cells.append(Cell(source_label, model_label, num_blocks, policy,
                                          admission, memory, key))
    return cells, materials


@contextmanager
def _progress(enabled: bool, total: int, resumed: int) -> Iterator[Progress | None]:
    """``progress_bar`` with one task counting the cells (``resumed`` of ``total`` done)."""
    with progress_bar(enabled) as progress:
        if progress is not None:
            progress.add_task("cells" + (f" ({resumed} resumed)" if resumed else ""),
                              total=total, completed=resumed)
        yield progress


def cmd_sweep(args: argparse.Namespace, console: Console, err_console: Console) -> int:
    """Check everything, run the cells not stored yet, print the table, write the outputs
    (see the module docstring)."""
    outputs = _check_outputs(args)
    store = None if args.results is None else ResultStore.open(
        args.results, outputs={"--csv": outputs.csv, "--json": outputs.json,
                               "--plot": outputs.plot})
    ray_address: str | None = args.ray
    if ray_address is not None:
        from hybridkv.sweep.ray import check_reachable, require_ray

        require_ray(ray_address)
        check_reachable(ray_address)
    workers = args.jobs or (default_workers() if ray_address is not None else 1)
    sources = resolve_sources(args)
    models = resolve_models(args)
    options = {label: CellOptions(resolve_settings(args, source), args.hash_algo, args.eagle)
               for label, source, _ in sources}  # a workload's own protocol defaults
    cells, materials = plan_cells(args, sources, models, options, workers)
    state = SweepState()
    for cell in cells:
        row = None if store is None else store.load(cell.key, materials[cell.key])
        if row is not None:
            state.rows[cell.key] = row
            state.resumed.add(cell.key)
    first: dict[str, Cell] = {}
    for cell in cells:  # one computation per key (equal traces under two names share it)
        if cell.key not in state.rows:
            first.setdefault(cell.key, cell)
    pending = list(first.values())
    work = SweepWork({label: source for label, source, _ in sources}, dict(models), options)
    try:
        with _progress(not args.quiet, len(state.resumed) + len(pending),
                       len(state.resumed)) as progress:
            on_done = _recorder(state, store, materials, progress)
            if ray_address is not None and pending:
                from hybridkv.sweep.ray import run_ray

                run_ray(work, pending, ray_address, workers, on_done)
            elif workers > 1 and len(pending) > 1:
                run_processes(work, pending, workers, on_done)
            elif pending:
                run_serial(work, pending, on_done, progress)
    except BaseException as err:  # Ctrl-C, SIGTERM (the CLI's Terminated), errors
        if store is not None and state.computed:
            err.add_note(f"{state.computed} finished cells kept in {store.directory} "
                         "(a re-run resumes)")
        raise
    return _report(args, console, cells, state, outputs, store)


def _recorder(state: SweepState, store: ResultStore | None,
              materials: dict[str, dict[str, object]],
              progress: Progress | None) -> Callable[[Cell, Row | CellError], None]:
    def on_done(cell: Cell, outcome: Row | CellError) -> None:
        row = too_small_row(cell, outcome) if isinstance(outcome, CellError) else outcome
        if store is not None:
            store.save(cell.key, materials[cell.key], row)
        state.rows[cell.key] = row
        state.computed += 1
        if progress is not None:
            progress.advance(progress.task_ids[0])
    return on_done


def _report(args: argparse.Namespace, console: Console, cells: Sequence[Cell],
            state: SweepState, outputs: Outputs, store: ResultStore | None) -> int:
    render_sweep_cells(cells, state.rows, state.resumed, console, detail=args.detail)
    rows = [_labelled(state.rows[c.key], c) for c in cells if c.key in state.rows]
    written = [str(p) for p in (outputs.csv, outputs.json, outputs.plot) if p is not None]
    if rows and written:
        write_outputs([
            ("--csv", outputs.csv, lambda tmp: _write_csv(rows, tmp)),
            ("--json", outputs.json, lambda tmp: _write_json(rows, state, tmp)),
            plot_output(outputs.plot, lambda tmp, fmt: plot_sweep(rows, tmp, format=fmt))])
    where = "" if store is None else f" in {store.directory}"
    too_small = sum(is_too_small(row) for row in rows)
    console.print(f"{len(cells)} cells: {state.computed} computed, {len(state.resumed)} "
                  f"resumed{where}" + (f", {too_small} too small" if too_small else "")
                  + (f"; wrote {', '.join(written)}" if rows and written else ""))
    return 0


def _labelled(row: Row, cell: Cell) -> Row:
    """A stored row under this run's labels (a resumed cell may have been stored under
    another trace path or label)."""
    return {**row, "trace": cell.source, "model": cell.model,
            "kv_memory": cell.kv_memory or ""}


def _write_csv(rows: Sequence[Row], path: Path) -> None:
    with path.open("w", newline="") as handle:
        timed = any("ttft_p99_s" in row for row in rows)
        writer = csv.DictWriter(handle, fieldnames=list(ROW_FIELDS) + (
            list(TIME_FIELDS) if timed else []), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _write_json(rows: Sequence[Row], state: SweepState, path: Path) -> None:
    import json

    cells_json = [{**row, "resumed": row["key"] in state.resumed} for row in rows]
    path.write_text(json.dumps({"hybridkv": hybridkv.__version__, "cells": cells_json},
                               indent=2) + "\n")


__all__ = ["cmd_sweep", "plan_cells", "resolve_sources"]
