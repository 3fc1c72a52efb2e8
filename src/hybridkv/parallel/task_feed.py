"""Feeding tasks to a process pool a few at a time, so that follow-up tasks jump the queue.

``Pool.imap`` hands every task to the pool up front; a task that only exists once another
finished (the bound of an admission log a replay just produced) would then wait behind
every replay still queued. ``TaskFeed`` keeps at most ``limit`` tasks in the pool (one per
worker) and picks the next one from its own queue when a result comes back: tasks added
with ``first=True`` go before the rest.

>>> import multiprocessing
>>> with multiprocessing.get_context("fork").Pool(2) as pool:
...     feed = TaskFeed(pool, abs, limit=2)
...     for value in (-1, -2, -3):
...         feed.add(value)
...     done = []
...     for task, result in feed:
...         done.append(result)
...         if task == -1:
...             feed.add(-10, first=True)
>>> sorted(done)
[1, 2, 3, 10]
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.pool import Pool
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

POLL_SECONDS = 0.2
"""Longest wait for a result between checks for Ctrl-C (a signal interrupts the wait)."""


class TaskFeed(Generic[T, R]):
    """Tasks for ``func`` on ``pool``, at most ``limit`` in flight; iterate for
    ``(task, result)`` in completion order (a task's exception is raised there)."""

    def __init__(self, pool: Pool, func: Callable[[T], R], limit: int) -> None:
        self._pool = pool
        self._func = func
        self._limit = max(1, limit)
        self._ready: deque[T] = deque()
        self._done: queue.SimpleQueue[tuple[T, R | None, BaseException | None]] = \
            queue.SimpleQueue()
        self._in_flight = 0

    def add(self, task: T, *, first: bool = False) -> None:
        """Queue ``task``; ``first`` puts it before every task not started yet."""
        if first:
            self._ready.appendleft(task)
        else:
            self._ready.append(task)

    def _start(self, task: T) -> None:
        def done(result: R) -> None:
            self._done.put((task, result, None))

        def failed(err: BaseException) -> None:
            self._done.put((task, None, err))

        self._pool.apply_async(self._func, (task,), callback=done, error_callback=failed)
        self._in_flight += 1

    def __iter__(self) -> Iterator[tuple[T, R]]:
        while self._ready or self._in_flight:
            while self._ready and self._in_flight < self._limit:
                self._start(self._ready.popleft())
            while True:
                try:
                    task, result, err = self._done.get(timeout=POLL_SECONDS)
                    break
                except queue.Empty:
                    continue
            self._in_flight -= 1
            if err is not None:
                raise err
            yield task, result  # type: ignore[misc]  # None only with err


__all__ = ["TaskFeed"]
