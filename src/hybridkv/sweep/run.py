"""Running a sweep's cells on this machine: one after another, or in ``--jobs`` forked
processes (``run_processes``).

A cell is a replay task, then its bounds: the replay returns its admission logs' keys
(``BoundKeys``), and the parent (``SharedCellBounds``) starts one bound task per distinct
key — cells whose policies logged the same admissions (same trace, model, pool) share it
— ahead of the replays not started yet; a cell is done when its last bound arrives.

Both hand each finished cell to ``on_done`` as soon as it finishes (the parent then
stores it: an interrupted sweep keeps every finished cell). The processes are the ones
``hybridkv replay --jobs`` uses (``hybridkv.parallel.processes.worker_init``): they ignore
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

from hybridkv.models.shapes import ModelShape
from hybridkv.parallel.processes import kill_pool_workers, worker_init
from hybridkv.parallel.task_feed import TaskFeed
from hybridkv.sim.bound_share import BoundBroker, BoundPair, set_bounds
from hybridkv.sweep.cells import (
    Cell,
    CellBoundTask,
    CellError,
    CellOptions,
    CellReplay,
    Row,
    cell_bounds,
    cell_row,
    compute_cell,
    dispatch_order,
    replay_cell,
)
from hybridkv.traces.source import Source

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

    def replay(self, cell: Cell) -> CellReplay | CellError:
        return replay_cell(self.sources[cell.source], self.models[cell.model], cell,
                           self.options[cell.source])

    def bounds(self, task: CellBoundTask) -> BoundPair:
        return cell_bounds(self.sources[task.source], task)

    def row(self, cell: Cell, replayed: CellReplay) -> Row:
        return cell_row(self.sources[cell.source], self.models[cell.model], cell, replayed)

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


class SharedCellBounds:
    """The parent's side of the bound tasks: which cells wait for which distinct log.

    ``replayed`` takes a cell's replay and returns the bound tasks to start (one per key
    no task was started for yet) and the cell's row when it needs none; ``bounded`` takes
    a finished bound task and returns the rows it completes."""

    def __init__(self, work: SweepWork) -> None:
        self._work = work
        self._broker: BoundBroker[tuple[int, str]] = BoundBroker()
        self._waiting: dict[int, tuple[Cell, CellReplay]] = {}

    def replayed(self, index: int, cell: Cell, outcome: CellReplay | CellError,
                 ) -> tuple[list[CellBoundTask], Row | CellError | None]:
        if isinstance(outcome, CellError):
            return [], outcome
        tasks: list[CellBoundTask] = []
        for scenario in self._broker.place(index, outcome.results, outcome.keys):
            log = outcome.results[scenario].log
            assert log is not None and outcome.shape is not None
            tasks.append(CellBoundTask(cell.source, scenario, outcome.shape, log,
                                       outcome.keys[scenario]))
        if outcome.complete:
            return tasks, self._work.row(cell, outcome)
        self._waiting[index] = (cell, outcome)
        return tasks, None

    def bounded(self, task: CellBoundTask, pair: BoundPair) -> list[tuple[Cell, Row]]:
        rows: list[tuple[Cell, Row]] = []
        for index, scenario in self._broker.resolve(task.keys, pair):
            cell, outcome = self._waiting[index]
            set_bounds(outcome.results[scenario], pair)
            if outcome.complete:
                del self._waiting[index]
                rows.append((cell, self._work.row(cell, outcome)))
        return rows


_JOB: tuple[SweepWork, Sequence[Cell]] | None = None
"""What forked workers compute (inherited through fork, never pickled)."""


def _compute_item(item: int | CellBoundTask) -> CellReplay | CellError | BoundPair:
    assert _JOB is not None
    work, cells = _JOB
    if isinstance(item, CellBoundTask):
        return work.bounds(item)
    return work.replay(cells[item])


def run_processes(work: SweepWork, cells: Sequence[Cell], jobs: int, on_done: OnDone) -> None:
    """Compute the cells in ``jobs`` forked processes, expected-longest first, each
    distinct log's bounds once, before the replays not started yet; results reach
    ``on_done`` in completion order. Leaving (done, an error, Ctrl-C, or SIGTERM raised as
    an exception by the CLI) terminates the workers."""
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
                workers = min(jobs, len(cells)) or 1
                pool = stack.enter_context(context.Pool(
                    workers, initializer=worker_init, initargs=(os.getpid(),)))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            try:
                feed: TaskFeed[int | CellBoundTask, CellReplay | CellError | BoundPair] = \
                    TaskFeed(pool, _compute_item, workers)
                for index in dispatch_order(cells, work.costs()):
                    feed.add(index)
                shared = SharedCellBounds(work)
                for item, outcome in feed:
                    if isinstance(item, CellBoundTask):
                        assert isinstance(outcome, tuple)
                        for cell, row in shared.bounded(item, outcome):
                            on_done(cell, row)
                        continue
                    assert not isinstance(outcome, tuple)
                    tasks, done = shared.replayed(item, cells[item], outcome)
                    for task in tasks:
                        feed.add(task, first=True)
                    if done is not None:
                        on_done(cells[item], done)
            except BaseException:
                kill_pool_workers(pool)
                raise
    finally:
        _JOB = None


__all__ = ["OnDone", "SharedCellBounds", "SweepWork", "run_processes", "run_serial"]
