"""Worker processes of the process-pool executors (``replay --jobs``, sweep ``--jobs``,
cluster ``--jobs``): how a worker starts (``worker_init``) and ``TaskFeed``
(``hybridkv.parallel.task_feed``) to feed the pool.
"""

from __future__ import annotations

import multiprocessing.pool
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal a process gets when its parent dies (Linux)."""


def worker_init(parent_pid: int) -> None:
    """Set up a ``--jobs`` worker: the parent alone handles Ctrl-C (it then terminates the
    pool); SIGTERM kills the worker at once; the parent's death sends it SIGTERM
    (``PR_SET_PDEATHSIG`` on Linux, else a thread polling the parent's pid)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # a parent that starts its pool with both blocked (sweep_exec) hands them over now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    if not _set_parent_death_signal():
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)


def kill_pool_workers(pool: object) -> None:
    """SIGKILL every live worker of a ``multiprocessing`` pool, so that its ``terminate``
    (``Pool.__exit__``) can no longer wait on one: a SIGTERM that reached the parent while
    it was still starting them could leave one it never signals (seen: the parent waiting
    forever on an idle worker).

    A worker killed inside a queue operation dies holding that queue's lock, and
    ``terminate`` takes two of them: the task queue's read lock (an idle worker holds it
    while it waits for a task: ``Pool(2)`` idle, killed, then ``terminate`` hung every
    time) and the result queue's write lock. Once the workers are dead and the pool makes
    no new ones, a lock still taken can only be a dead worker's: it is released.
    """
    handler = getattr(pool, "_worker_handler", None)
    if handler is not None:  # ``terminate``'s first step: no replacements for the killed
        handler._state = multiprocessing.pool.TERMINATE
    workers = [p for p in getattr(pool, "_pool", ()) if p.exitcode is None]
    for process in workers:
        process.kill()
    for process in workers:
        process.join(timeout=5.0)
    for queue, name in ((getattr(pool, "_inqueue", None), "_rlock"),
                        (getattr(pool, "_outqueue", None), "_wlock")):
        lock = getattr(queue, name, None)
        if lock is None:
            continue
        if lock.acquire(False):  # free: give it back
            lock.release()
        elif not any(p.exitcode is None for p in workers):
            lock.release()  # held by a killed worker


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _exit_with_parent(parent_pid: int) -> None:  # pragma: no cover - non-Linux fallback
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)



__all__ = ["PR_SET_PDEATHSIG", "kill_pool_workers", "worker_init"]
