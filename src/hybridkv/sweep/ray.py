"""Running a sweep's cells as Ray tasks (``hybridkv sweep --ray [ADDRESS]``).

Ray is an optional extra (``pip install 'hybridkv[ray]'``); without it ``--ray`` is one
line naming that command, exit 2 (``require_ray``, checked before any work). ``--ray``
alone starts a local Ray with ``--jobs`` CPUs (default: every CPU this process may use)
and shuts it down at the end; ``--ray ADDRESS`` connects to an existing cluster
(``ray start --head`` prints the address), whose nodes must run the same hybridkv: every
task returns the code fingerprint of the hybridkv it ran, and a different one stops the
sweep with one line.

Each source and model goes into the object store once (``ray.put``): a remote node needs
neither the trace files nor the model files. A task is one cell (``compute_cell``, the
same function ``--jobs`` workers run), then one bound task per distinct admission log
(``SharedCellBounds``), so the rows equal a serial run's. Ctrl-C, SIGTERM
or an error cancels every unfinished task (``ray.cancel(force=True)``) and shuts Ray down
before the CLI reports; Ray's own SIGTERM handler is replaced by the CLI's again right
after ``ray.init``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import hybridkv
from hybridkv.errors import ConfigError
from hybridkv.models.shapes import ModelShape
from hybridkv.sim.bound_share import BoundPair
from hybridkv.sweep.cells import (
    Cell,
    CellBoundTask,
    CellError,
    CellOptions,
    CellReplay,
    cell_bounds,
    code_fingerprint,
    dispatch_order,
    replay_cell,
)
from hybridkv.sweep.run import OnDone, SharedCellBounds, SweepWork
from hybridkv.traces.source import Source

LOCAL = "local"
"""``--ray`` without an address: start a local Ray for this sweep."""
RAY_PIN = "ray==2.60.0"
"""The Ray release the ``ray`` extra pins (tested in CI through a local Ray)."""
WAIT_SECONDS = 0.2
"""Longest wait for a task between checks for Ctrl-C / SIGTERM."""


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def require_ray(address: str) -> None:
    """Raise ``ConfigError`` naming the install command when Ray is missing."""
    if not ray_installed():
        raise ConfigError("--ray", address, "needs Ray, which is not installed: "
                          f"pip install 'hybridkv[ray]' (or pip install '{RAY_PIN}')")


def _ray_cell(source: Source, shape: ModelShape, cell: Cell,
              options: CellOptions) -> tuple[str, CellReplay | CellError]:
    """The replay task body: (this worker's code fingerprint, the cell's replay)."""
    return code_fingerprint(), replay_cell(source, shape, cell, options)


def _ray_bounds(source: Source, task: CellBoundTask) -> tuple[str, BoundPair]:
    """The bound task body: (this worker's code fingerprint, the log's bounds)."""
    return code_fingerprint(), cell_bounds(source, task)


@contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Restore SIGINT / SIGTERM handlers on exit (``ray.init`` installs its own)."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


@contextmanager
def _package_on_worker_path() -> Iterator[None]:
    """Local Ray workers inherit the environment of the processes ``ray.init`` starts:
    put the directory this hybridkv was imported from first on their ``PYTHONPATH``."""
    root = str(Path(hybridkv.__file__).resolve().parent.parent)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, before) if p)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


@contextmanager
def _deferred_signals() -> Iterator[Callable[[], None]]:
    """While Ray runs, SIGINT / SIGTERM only note the signal; the returned check (called
    between Ray calls) then hands it to the handler that was there before (the CLI's:
    ``KeyboardInterrupt`` / ``Terminated``). An exception raised by a signal handler in
    the middle of Ray's compiled code surfaces as a ``SystemError`` traceback instead."""
    received: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def note(signum: int, frame: FrameType | None) -> None:
        del frame
        received.append(signum)

    def check() -> None:
        if not received:
            return
        signum = received[0]
        handler = previous[signal.Signals(signum)]
        if callable(handler):
            handler(signum, None)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    for sig in previous:
        signal.signal(sig, note)
    try:
        yield check
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


CONNECT_SECONDS = 5.0
"""How long ``--ray ADDRESS`` may take to accept a TCP connection before the sweep gives
up with one line (Ray itself retries for minutes)."""


def check_reachable(address: str) -> None:
    """Raise ``ConfigError`` unless ``host:port`` (or ``ray://host:port``) accepts a TCP
    connection within ``CONNECT_SECONDS``; ``local`` and ``auto`` are left to Ray.

    >>> check_reachable("auto")
    >>> check_reachable("no-port-here")
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: --ray='no-port-here' is invalid: is not HOST:PORT ...
    """
    if address in (LOCAL, "auto"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("--ray", address, "is not HOST:PORT (e.g. 10.0.0.5:6379, as "
                          "ray start --head prints it), 'auto', or nothing for a local Ray")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CONNECT_SECONDS):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError("--ray", address, f"nothing answers there ({reason}); start the "
                          "cluster (ray start --head) or leave the address out for a "
                          "local Ray") from err


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to ``/dev/null`` (Ray's C++ core logs warnings there while
    it starts, retries a connection or shuts down; the sweep's errors stay one line)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _reason(err: BaseException) -> str:
    """The useful part of Ray's error: the last line of the innermost cause that names an
    error (Ray wraps an authentication failure in a connection error)."""
    texts: list[str] = []
    while err is not None and len(texts) < 5:
        texts.append(str(err))
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    for text in reversed(texts):
        lines = [line.strip() for line in text.splitlines() if "Error" in line]
        if lines:
            return " ".join(lines[-1].split())[:300]
    return " ".join(texts[0].split())[:300] if texts and texts[0] else "unknown error"


def _init(ray: Any, address: str, num_cpus: int) -> None:
    options: dict[str, object] = {"include_dashboard": False, "log_to_driver": False,
                                  "logging_level": logging.ERROR}
    try:
        with _signal_handlers_kept(), _stderr_silenced():
            if address == LOCAL:
                with _package_on_worker_path():  # "local": a new instance, never a running one
                    ray.init(address=LOCAL, num_cpus=num_cpus, **options)
            else:
                ray.init(address=address, **options)
    except Exception as err:  # Ray raises ConnectionError, ValueError, RuntimeError, …
        detail = _reason(err)
        if "InvalidAuthToken" in detail or "AuthenticationError" in detail:
            raise ConfigError("--ray", address, "the cluster wants its authentication token: "
                              "run with RAY_AUTH_MODE=token and the token in "
                              "~/.ray/auth_token or RAY_AUTH_TOKEN") from err
        fix = ("leave the address out for a local Ray, or give a running cluster's "
               "address (ray start --head prints it)") if address != LOCAL else \
            "check that this machine can start Ray processes"
        raise ConfigError("--ray", address, f"Ray did not start ({detail}); {fix}") from err


def run_ray(work: SweepWork, cells: Sequence[Cell], address: str, num_cpus: int,
            on_done: OnDone) -> None:
    """Compute the cells as Ray tasks, expected-longest first; results reach ``on_done``
    in completion order."""
    require_ray(address)
    check_reachable(address)
    import ray

    pending: dict[Any, int | CellBoundTask] = {}
    with _deferred_signals() as check_signals:
        try:
            _init(ray, address, num_cpus)
            check_signals()
            task = ray.remote(num_cpus=1, max_retries=0)(_ray_cell)
            bound_task = ray.remote(num_cpus=1, max_retries=0)(_ray_bounds)
            sources = {label: ray.put(source) for label, source in work.sources.items()}
            models = {label: ray.put(shape) for label, shape in work.models.items()}
            for index in dispatch_order(cells, work.costs()):
                cell = cells[index]
                pending[task.remote(sources[cell.source], models[cell.model], cell,
                                    work.options[cell.source])] = index
            expected = code_fingerprint()
            shared = SharedCellBounds(work)
            while pending:
                check_signals()
                done, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_SECONDS)
                for ref in done:
                    item = pending.pop(ref)
                    fingerprint, outcome = ray.get(ref)
                    if fingerprint != expected:
                        raise ConfigError("--ray", address, "the cluster's workers run other "
                                          "hybridkv code than this sweep; install the same "
                                          "hybridkv on every node")
                    if isinstance(item, CellBoundTask):
                        for cell, row in shared.bounded(item, outcome):
                            on_done(cell, row)
                        continue
                    tasks, finished = shared.replayed(item, cells[item], outcome)
                    for bound in tasks:
                        pending[bound_task.remote(sources[bound.source], bound)] = bound
                    if finished is not None:
                        on_done(cells[item], finished)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            with _stderr_silenced():
                ray.shutdown()


__all__ = ["LOCAL", "RAY_PIN", "check_reachable", "ray_installed", "require_ray", "run_ray"]
