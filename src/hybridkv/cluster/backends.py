"""Where the instances of a cluster replay run: forked processes (``--jobs``) or Ray actors
(``--ray``). The serial backend is ``simulate.SerialBackend``.

Each worker owns a fixed subset of instances (``split_instances``) and runs one epoch of
each per ``advance`` call; the driver waits for every worker (a barrier per epoch), so the
router's view is the same as in a serial run and so are the results.

Errors: a ``HybridKVError`` inside a worker (a pool too small for a request) comes back as
``WorkerError`` with the worker's one-line message (exit 2 in the CLI); anything else is a
bug and comes back with the worker's traceback in the message.

Signals (``--jobs``): workers ignore SIGINT and die with their parent
(``hybridkv.parallel.processes.worker_init``); the driver terminates them on every way
out, so Ctrl-C and SIGTERM leave no process behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

from hybridkv.cluster.instance import (
    InstanceGroup,
    InstanceReport,
    InstanceResult,
    InstanceSettings,
)
from hybridkv.cluster.simulate import split_instances
from hybridkv.config import CacheConfig
from hybridkv.errors import ConfigError, HybridKVError
from hybridkv.traces.trace import Trace


class WorkerError(HybridKVError):
    """A worker's ``HybridKVError`` (its message, one line)."""


class WorkerBug(RuntimeError):
    """A worker crashed with an unexpected exception (its traceback is the message)."""


_WORK: tuple[Trace, CacheConfig, str, InstanceSettings, bool] | None = None
"""What forked workers build their instances from (inherited through fork, not pickled)."""


def _worker_main(conn: Connection, indices: list[int], parent_pid: int) -> None:
    from hybridkv.parallel.processes import worker_init

    worker_init(parent_pid)
    assert _WORK is not None
    trace, config, policy, settings, events = _WORK
    try:
        group = InstanceGroup(indices, trace, config, policy, settings, events=events)
        while True:
            message = conn.recv()
            if message[0] == "advance":
                conn.send(("ok", group.advance(message[1], message[2])))
            elif message[0] == "results":
                conn.send(("ok", group.results()))
            else:
                break
    except HybridKVError as err:
        conn.send(("error", str(err)))
    except EOFError:  # the driver went away
        pass
    except Exception:
        conn.send(("bug", traceback.format_exc()))
    finally:
        conn.close()


class ProcessBackend:
    """Instances split over ``jobs`` forked processes."""

    def __init__(self, trace: Trace, config: CacheConfig, policy: str,
                 settings: InstanceSettings, num_instances: int, jobs: int, *,
                 events: bool) -> None:
        global _WORK  # noqa: PLW0603 - inherited by the forked workers
        context = multiprocessing.get_context("fork")
        self._workers: list[tuple[Any, Connection, list[int]]] = []
        _WORK = (trace, config, policy, settings, events)
        try:
            for indices in split_instances(num_instances, jobs):
                mine, theirs = context.Pipe()
                process = context.Process(target=_worker_main,
                                          args=(theirs, indices, os.getpid()), daemon=True)
                process.start()
                theirs.close()
                self._workers.append((process, mine, indices))
        except BaseException:
            self.close()
            raise
        finally:
            _WORK = None

    def _call(self, messages: list[tuple[object, ...]]) -> list[Any]:
        for (_, conn, _), message in zip(self._workers, messages, strict=True):
            conn.send(message)
        replies = []
        for process, conn, _ in self._workers:
            try:
                kind, payload = conn.recv()
            except EOFError:
                raise WorkerBug(f"cluster worker {process.pid} exited with code "
                                f"{process.exitcode}") from None
            if kind == "error":
                raise WorkerError(payload)
            if kind == "bug":
                raise WorkerBug(payload)
            replies.append(payload)
        return replies

    def advance(self, arrivals: dict[int, list[int]], num_steps: int,
                ) -> list[InstanceReport]:
        messages: list[tuple[object, ...]] = [
            ("advance", {i: arrivals[i] for i in indices if i in arrivals}, num_steps)
            for _, _, indices in self._workers]
        reports = [r for batch in self._call(messages) for r in batch]
        return sorted(reports, key=lambda r: r.instance)

    def results(self) -> list[InstanceResult]:
        results = [r for batch in self._call([("results",)] * len(self._workers))
                   for r in batch]
        return sorted(results, key=lambda r: r.instance)

    def close(self) -> None:
        for process, conn, _ in self._workers:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
            conn.close()
            process.join(timeout=2)
            if process.is_alive():
                process.terminate()
                process.join()
        self._workers = []


class RayBackend:
    """Instances split over ``jobs`` Ray actors (``ray.init`` here unless Ray is already
    initialised; shut down again by ``close`` when this backend started it)."""

    def __init__(self, trace: Trace, config: CacheConfig, policy: str,
                 settings: InstanceSettings, num_instances: int, jobs: int, *,
                 events: bool) -> None:
        ray = import_ray()
        self._ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            ray.init(num_cpus=max(1, min(jobs, num_instances)), include_dashboard=False,
                     log_to_driver=False, logging_level="ERROR", configure_logging=False)
        try:
            actor = ray.remote(num_cpus=1)(InstanceGroup)
            trace_ref = ray.put(trace)
            self._actors = [(actor.remote(indices, trace_ref, config, policy, settings,
                                          events=events), indices)
                            for indices in split_instances(num_instances, jobs)]
        except BaseException:
            self.close()
            raise

    def _get(self, refs: list[Any]) -> list[Any]:
        ray = self._ray
        try:
            return list(ray.get(refs))
        except ray.exceptions.RayTaskError as err:
            cause = err.as_instanceof_cause()
            if isinstance(cause, HybridKVError):
                raise WorkerError(str(cause).splitlines()[-1]) from None
            raise WorkerBug(str(err)) from None

    def advance(self, arrivals: dict[int, list[int]], num_steps: int,
                ) -> list[InstanceReport]:
        refs = [actor.advance.remote({i: arrivals[i] for i in indices if i in arrivals},
                                     num_steps) for actor, indices in self._actors]
        reports = [r for batch in self._get(refs) for r in batch]
        return sorted(reports, key=lambda r: r.instance)

    def results(self) -> list[InstanceResult]:
        results = [r for batch in self._get([a.results.remote() for a, _ in self._actors])
                   for r in batch]
        return sorted(results, key=lambda r: r.instance)

    def close(self) -> None:
        for actor, _ in getattr(self, "_actors", []):
            self._ray.kill(actor)
        self._actors = []
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()


def import_ray() -> Any:
    """The ``ray`` module, or a one-line ``ConfigError`` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray", "ray", "Ray is not installed: pip install 'hybridkv[ray]' "
                          "(or drop --ray and use --jobs)") from None
    return ray


__all__ = ["ProcessBackend", "RayBackend", "WorkerBug", "WorkerError", "import_ray"]
