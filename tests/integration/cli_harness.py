"""What the CLI integration tests share: the tiny hybrid model, and child CLI processes
for the signal probes (spawned in their own session with a foreground Ctrl-C disposition,
killed whole at teardown by ``tests/integration/conftest.py``, watched through /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

TINY_MODEL = """
name = "tiny-hybrid"
block_size = 16
kv_bytes_per_token = 64
[[layers]]
kind = "full_attention"
count = 2
[[layers]]
kind = "sliding_window"
window = 32
count = 2
"""
"""Two full-attention and two 32-token sliding-window layers, 16-token blocks."""

needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")

_SPAWNED: list[subprocess.Popen[str]] = []


def _default_sigint() -> None:
    """A shell's background job (``land.sh &``) starts with SIGINT ignored and Python keeps
    it ignored: give the child the disposition a terminal's foreground process has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_cli(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    """Start ``hybridkv ARGV`` from this checkout's source in its own session."""
    process = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", *argv], cwd=cwd,
                               env={**os.environ, "PYTHONPATH": str(SRC)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=_default_sigint)  # noqa: PLW1509
    _SPAWNED.append(process)
    return process


def reap_spawned() -> None:
    """Kill every spawned CLI still running, with its workers (its whole session): a failed
    signal test must not leave a minutes-long replay behind."""
    while _SPAWNED:
        process = _SPAWNED.pop()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.communicate(timeout=10)


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def wait_busy(process: subprocess.Popen[str], seconds: float) -> None:
    """Wait until ``process`` has used ``seconds`` of CPU: past its imports and into the
    work however loaded the machine is (a wall-clock sleep is not, on a busy 2-core box)."""
    assert wait_for(lambda: process.poll() is not None
                    or cpu_seconds(process.pid) >= seconds, 120)
