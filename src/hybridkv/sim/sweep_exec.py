"""Running a sweep's cells on this machine: one after another, or in ``--jobs`` forked
processes (``run_processes``).

Both hand each finished cell to ``on_done`` as soon as it finishes (the parent then
stores it: an interrupted sweep keeps every finished cell). The processes are the ones
``hybridkv replay --jobs`` uses (``hybridkv.sim.commands._worker_init``): they ignore
Ctrl-C (the parent handles it and terminates the pool on the way out), die at once on
SIGTERM and with their parent (``PR_SET_PDEATHSIG``). The sweep's traces and models reach
them through ``fork`` (never pickled); only cell indices go in and rows come back.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rich.progress import Progress

from hybridkv.sim.commands import Source, _worker_init
from hybridkv.sim.model import ModelShape
from hybridkv.sim.sweep import Cell, CellError, CellOptions, Row, compute_cell, dispatch_order

OnDone = Callable[[Cell, "Row | CellError"], None]
"""Called in the parent with each finished cell and its outcome."""


@dataclass(frozen=True, slots=True)
class SweepWork:
    """What every cell may need: the sweep's sources, models and each source's settings,
    by label."""

    sources: Mapping[str, Source]
    models: Mapping[str, ModelShape]
    options: Mapping[str, CellOptions]

    def compute(self, cell: Cell, progress: Progress | None = None) -> Row | CellError:
        return compute_cell(self.sources[cell.source], self.models[cell.model], cell,
                            self.options[cell.source], progress)

    def costs(self) -> dict[str, int]:
        """Prompt tokens per source (the dispatch order's cost estimate)."""
        return {label: sum(r.input_length for t in source.scenarios.values()
                           for r in t.requests)
                for label, source in self.sources.items()}


def run_serial(work: SweepWork, cells: Sequence[Cell], on_done: OnDone,
               progress: Progress | None = None) -> None:
    """Compute the cells in this process, in order (each with its request progress bar)."""
    for cell in cells:
        on_done(cell, work.compute(cell, progress))


_JOB: tuple[SweepWork, Sequence[Cell]] | None = None
"""What forked workers compute (inherited through fork, never pickled)."""


def _compute_index(index: int) -> tuple[int, Row | CellError]:
    assert _JOB is not None
    work, cells = _JOB
    return index, work.compute(cells[index])


def run_processes(work: SweepWork, cells: Sequence[Cell], jobs: int, on_done: OnDone) -> None:
    """Compute the cells in ``jobs`` forked processes, expected-longest first; results
    reach ``on_done`` in completion order. Leaving (done, an error, Ctrl-C, or SIGTERM
    raised as an exception by the CLI) terminates the workers."""
    global _JOB  # noqa: PLW0603 - handed to forked workers without pickling the traces
    _JOB = (work, cells)
    try:
        context = multiprocessing.get_context("fork")
        with contextlib.ExitStack() as stack:
            # Ctrl-C / SIGTERM wait while the workers start (each unblocks them once its
            # handlers are set): a signal can then never find a half-started worker with
            # the CLI's handler, nor a pool the with block does not own yet.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:
                pool = stack.enter_context(context.Pool(
                    min(jobs, len(cells)) or 1, initializer=_worker_init,
                    initargs=(os.getpid(),)))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            try:
                order = dispatch_order(cells, work.costs())
                for index, outcome in pool.imap_unordered(_compute_index, order):
                    on_done(cells[index], outcome)
            except BaseException:
                _kill_workers(pool)
                raise
    finally:
        _JOB = None


def _kill_workers(pool: object) -> None:
    """SIGKILL every live worker before ``Pool.__exit__`` terminates the pool: its
    ``terminate`` joins the workers, and a SIGTERM that reached the parent while it was
    still starting them could leave one it never signals (seen: the parent waiting forever
    on an idle worker)."""
    for process in getattr(pool, "_pool", ()):
        if process.exitcode is None:
            process.kill()


__all__ = ["OnDone", "SweepWork", "run_processes", "run_serial"]
