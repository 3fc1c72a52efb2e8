"""What ``hybridkv replay --events / --metrics`` attach to a run: the KV event stream
(``hybridkv.events``) and the Prometheus metrics (``hybridkv.sim.metrics``).

``--events ENDPOINT`` publishes every step's events (vLLM's ZMQ semantics, see
``events.publisher``); ``--events-replay ENDPOINT`` serves replays of the buffered batches;
``--metrics PORT`` serves the metrics over HTTP (``/metrics``) while the run lasts,
``--metrics PATH`` writes them in the Prometheus text format when it ends (atomically, with
the other outputs); ``--linger-seconds S`` keeps the replay endpoint and the HTTP server up
for ``S`` seconds after the report. Both need the optional extras (``events``,
``metrics``); the stream describes one cache, so ``--events`` takes one policy and one
admission order, and both need ``--jobs 1`` (the observers live in this process).

>>> parse_metrics_target("9400"), parse_metrics_target("out/run.prom")
(9400, PosixPath('out/run.prom'))
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridkv.errors import ConfigError

if TYPE_CHECKING:
    from hybridkv.cache import KVCacheManager
    from hybridkv.events.publisher import ZmqEventPublisher
    from hybridkv.sched.scheduler import Scheduler
    from hybridkv.sim.metrics import CacheMetrics
    from hybridkv.sim.replay import ReplayObserver

MAX_PORT = 65535


def parse_metrics_target(text: str) -> int | Path:
    """``--metrics``: a TCP port (all digits, 1–65535) or a text-file path."""
    stripped = text.strip()
    if not stripped:
        raise ConfigError("--metrics", text, "give a TCP port (1-65535) or a file path")
    if stripped.lstrip("+-").isdigit():  # "-1" is a mistyped port, not a file name
        port = int(stripped[:6])
        if len(stripped) > 5 or not 1 <= port <= MAX_PORT:
            raise ConfigError("--metrics", text, "a port must be in 1-65535 (or give a path)")
        return port
    return Path(text)


class KVEventStream:
    """``ReplayObserver`` publishing each step's KV events (vLLM skips empty steps). A
    replay after the first (a multi-scenario workload) starts with ``AllBlocksCleared``:
    its cache is a new, empty one."""

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher
        self.num_runs = 0

    def attach(self, manager: KVCacheManager, scheduler: Scheduler, label: str) -> None:
        del scheduler, label
        from hybridkv.events import AllBlocksCleared
        manager.start_kv_cache_events()
        if self.num_runs:
            self.publisher.publish([AllBlocksCleared()])
        self.num_runs += 1

    def on_step(self, manager: KVCacheManager, scheduler: Scheduler) -> None:
        del scheduler
        events = manager.take_events()
        if events:
            self.publisher.publish(events)

    def detach(self, manager: KVCacheManager, scheduler: Scheduler,
               misses: Mapping[str, int] | None) -> None:
        del misses
        self.on_step(manager, scheduler)


@dataclass
class Observing:
    """The observers of one command and the resources they hold (close them)."""

    observers: tuple[ReplayObserver, ...] = ()
    publisher: ZmqEventPublisher | None = None
    metrics: CacheMetrics | None = None
    metrics_path: Path | None = None
    http_server: Any = None
    notes: list[str] = field(default_factory=list)

    def write_metrics(self, path: Path) -> None:
        """The metrics in the Prometheus text format (what a scrape returns)."""
        from prometheus_client import generate_latest
        assert self.metrics is not None
        path.write_bytes(generate_latest(self.metrics.registry))

    def linger(self, seconds: float) -> None:
        if seconds > 0 and (self.publisher is not None or self.http_server is not None):
            time.sleep(seconds)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.http_server is not None:
            self.http_server.shutdown()
            self.http_server.server_close()
            self.http_server = None


def open_observers(*, events: str | None, events_replay: str | None,
                   metrics: int | Path | None, model_name: str, num_runs: int,
                   jobs: int, linger_seconds: float = 0.0) -> Observing:
    """Validate the flags and open the endpoints (one-line ``ConfigError`` otherwise)."""
    observing = Observing()
    if events is None and events_replay is not None:
        raise ConfigError("--events-replay", events_replay, "needs --events ENDPOINT too")
    if linger_seconds > 0 and events is None and not isinstance(metrics, int):
        raise ConfigError("--linger-seconds", linger_seconds, "keeps --events / "
                          "--events-replay or a --metrics PORT up after the report: give "
                          "one of them or drop it")
    if events is None and metrics is None:
        return observing
    flag = "--events" if events is not None else "--metrics"
    if jobs != 1:
        raise ConfigError("--jobs", jobs, f"{flag} observes the replays in this process: "
                          "use --jobs 1")
    observers: list[ReplayObserver] = []
    try:
        if metrics is not None:
            observers.append(_open_metrics(observing, metrics, model_name))
        if events is not None:
            if num_runs != 1:
                raise ConfigError("--events", events, f"one stream describes one cache: give "
                                  f"one --policy and one --admission (got {num_runs} runs)")
            try:
                from hybridkv.events.publisher import ZmqEventPublisher
            except ImportError as err:
                raise ConfigError("--events", events, "needs msgspec and pyzmq: pip install "
                                  f"'hybridkv[events]' ({err})") from err
            observing.publisher = ZmqEventPublisher(events, replay_endpoint=events_replay)
            observers.append(KVEventStream(observing.publisher))
    except BaseException:
        observing.close()
        raise
    observing.observers = tuple(observers)
    return observing


def _open_metrics(observing: Observing, target: int | Path, model_name: str) -> ReplayObserver:
    try:
        from prometheus_client import start_http_server

        from hybridkv.sim.metrics import CacheMetrics, ReplayMetrics
    except ImportError as err:
        raise ConfigError("--metrics", str(target), "needs prometheus_client: pip install "
                          f"'hybridkv[metrics]' ({err})") from err
    observing.metrics = CacheMetrics(model_name=model_name)
    if isinstance(target, Path):
        observing.metrics_path = target
    else:
        try:
            observing.http_server, _ = start_http_server(
                target, registry=observing.metrics.registry)
        except OSError as err:
            raise ConfigError("--metrics", target, f"cannot serve on port {target} ({err}); "
                              "pick a free port or give a file path") from err
    return ReplayMetrics(observing.metrics)
