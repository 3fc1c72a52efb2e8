"""Worker processes of the process-pool executors (``replay --jobs``, sweep ``--jobs``,
cluster ``--jobs``): how a worker starts (``worker_init``) and ``TaskFeed``
(``hybridkv.parallel.task_feed``) to feed the pool.
"""

from __future__ import annotations

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



__all__ = ["PR_SET_PDEATHSIG", "worker_init"]
