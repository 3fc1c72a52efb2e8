"""``kill_pool_workers``: after it, the pool's ``terminate`` (what ``Pool.__exit__`` runs
when a sweep stops on SIGTERM or Ctrl-C) returns, whatever lock a killed worker held."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import hybridkv

SCRIPT = textwrap.dedent("""
    import multiprocessing, os, threading, time
    from hybridkv.parallel.processes import kill_pool_workers, worker_init
    pool = multiprocessing.get_context("fork").Pool(2, initializer=worker_init,
                                                    initargs=(os.getpid(),))
    pool.map(abs, range(4))  # both started; now idle, one waits for a task in get()
    time.sleep(0.5)  # holding the task queue's read lock
    kill_pool_workers(pool)
    assert all(p.exitcode is not None for p in pool._pool)
    stopper = threading.Thread(target=pool.terminate, daemon=True)
    stopper.start()
    stopper.join(20)
    print("hung" if stopper.is_alive() else "terminated", flush=True)
    os._exit(1 if stopper.is_alive() else 0)
""")


def test_terminate_returns_after_the_idle_workers_are_killed() -> None:
    src = Path(hybridkv.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, check=False,
                          env={"PYTHONPATH": str(src), "HYBRIDKV_PURE_PYTHON": "1"})
    assert (done.returncode, done.stdout.strip()) == (0, "terminated"), done.stderr
