"""Cluster replay: dispatch rules, routers, determinism across backends."""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv.cli.cluster import run_router
from hybridkv.cluster.backends import ProcessBackend
from hybridkv.cluster.instance import Instance, InstanceSettings
from hybridkv.cluster.routers import Load, RoundRobin, RouteRequest, SessionAffinity
from hybridkv.cluster.simulate import (
    ClusterRun,
    ClusterSettings,
    Dispatcher,
    run_cluster,
    serial_backend,
)
from hybridkv.config import CacheConfig
from hybridkv.models.shapes import load_model
from hybridkv.traces.trace import Trace, TraceRequest
from hybridkv.traces.workloads import make_workload


def _config(num_blocks: int = 400) -> CacheConfig:
    return load_model("gemma3-bench").cache_config(num_blocks)


def _agentic(num_sessions: int = 6) -> Trace:
    return make_workload("agentic", num_sessions=num_sessions, num_turns=4, first_prompt_tokens=512,
                         turn_tokens=128, output_tokens=4)


def _settings(n: int = 3, **kwargs: object) -> ClusterSettings:
    return ClusterSettings(num_instances=n, instance=InstanceSettings(max_running=4),
                           **kwargs)  # type: ignore[arg-type]


def _numbers(run: object) -> dict[str, object]:
    data = run.to_json()  # type: ignore[attr-defined]
    return {k: v for k, v in data.items() if k != "wall_seconds"}


def test_dispatcher_serialises_sessions_and_caps_concurrency() -> None:
    reqs = tuple(TraceRequest(f"r{i}", 8, 1, session_id=None if i % 2 else "s")
                 for i in range(6))  # r0, r2, r4 share session s
    dispatcher = Dispatcher(Trace("t", reqs), concurrency=2)
    assert dispatcher.release() == [0, 1]          # cap 2
    dispatcher.finished(1)
    assert dispatcher.release() == [3]             # r2 waits for r0
    dispatcher.finished(0)
    assert dispatcher.release() == [2]
    assert dispatcher.in_flight == 2


def test_dispatcher_phase_barrier() -> None:
    reqs = (TraceRequest("a", 8, 1, phase=1), TraceRequest("b", 8, 1, phase=0))
    dispatcher = Dispatcher(Trace("t", reqs), concurrency=8)
    assert dispatcher.release() == [1]
    dispatcher.finished(1)
    assert dispatcher.release() == [0]


def test_session_affinity_is_sticky_and_balances_new_sessions() -> None:
    router = SessionAffinity(2)
    loads = [Load(0, 0), Load(0, 0)]
    first = router.route(RouteRequest(0, "a", "s1", 100), loads).instance
    loads[first].queued_tokens += 100
    second = router.route(RouteRequest(1, "b", "s2", 100), loads).instance
    assert first != second
    loads[first].queued_tokens += 10_000
    assert router.route(RouteRequest(2, "c", "s1", 100), loads).instance == first


def test_instance_hits_only_what_it_served() -> None:
    """Two instances: the second request of a shared prefix hits only where the first ran."""
    prompt = tuple(range(64))
    trace = Trace("t", (TraceRequest("a", 64, 1, token_ids=prompt),
                        TraceRequest("b", 64, 1, token_ids=prompt),
                        TraceRequest("c", 64, 1, token_ids=prompt)))
    here = Instance(0, trace, _config(), "latest", InstanceSettings())
    there = Instance(1, trace, _config(), "latest", InstanceSettings())
    assert here.advance([0], 5).finished[0].hit_tokens == 0
    assert here.advance([1], 5).finished[0].hit_tokens == 48   # 3 blocks (last token computed)
    assert there.advance([2], 5).finished[0].hit_tokens == 0


def test_round_robin_spreads_requests_evenly() -> None:
    trace = _agentic()
    run = run_cluster(trace, RoundRobin(3),
                      serial_backend(trace, _config(), "latest", _settings(), events=False),
                      _settings())
    assert run.routed_by_instance == [8, 8, 8]
    assert run.requests == 24 and sum(r.requests for r in run.instances) == 24
    assert run.load_imbalance >= 1.0
    doc = run.to_json()
    assert doc["mean_max_backlog_tokens"] == pytest.approx(
        run.load_imbalance * run.mean_backlog_tokens)
    assert run.mean_max_backlog_tokens >= run.mean_backlog_tokens > 0


def test_a_better_ratio_can_hide_a_more_loaded_worst_instance() -> None:
    """The imbalance ratio divides by each router's own mean backlog. Router A (hits cut
    its backlog): max 300 / mean 150 per step sums over 2 steps -> ratio 2.0, worst
    instance 150 tokens on average. Router B: 400 / 250 -> ratio 1.6 (looks better), worst
    instance 200 (more loaded). ``mean_max_backlog_tokens`` tells them apart."""
    a = ClusterRun("a", [], steps=2, backlog_max_sum=300, backlog_mean_sum=150.0)
    b = ClusterRun("b", [], steps=2, backlog_max_sum=400, backlog_mean_sum=250.0)
    assert a.load_imbalance > b.load_imbalance
    assert a.mean_max_backlog_tokens < b.mean_max_backlog_tokens
    assert (a.mean_max_backlog_tokens, b.mean_max_backlog_tokens) == (150.0, 200.0)


def test_session_affinity_beats_round_robin_on_agentic_hits() -> None:
    trace, config = _agentic(num_sessions=4), _config(2000)  # 4 sessions cycle over 3
    by_router = {name: run_router(name, trace, config, "latest", _settings())
                 for name in ("round-robin", "session")}
    assert by_router["session"].hit_rate > by_router["round-robin"].hit_rate


@pytest.mark.parametrize("router", ["round-robin", "session", "least-loaded"])
def test_parallel_processes_give_the_serial_numbers(router: str) -> None:
    trace, config = _agentic(), _config()
    serial = run_router(router, trace, config, "latest", _settings())
    parallel = run_router(router, trace, config, "latest", _settings(), jobs=2)
    assert _numbers(serial) == _numbers(parallel)
    assert serial.hit_tokens > 0


def test_sync_steps_changes_the_routers_view() -> None:
    """A slower feed (the view refreshed every 8 steps) is a different, still complete run."""
    trace, config = _agentic(), _config()
    fast = run_router("least-loaded", trace, config, "latest", _settings())
    slow = run_router("least-loaded", trace, config, "latest",
                      dataclasses.replace(_settings(), sync_steps=8))
    assert slow.requests == fast.requests == 24
    assert _numbers(slow) != _numbers(fast)


def test_worker_error_is_one_line() -> None:
    """A pool too small inside a worker comes back as a HybridKVError, workers stopped."""
    from hybridkv.errors import HybridKVError

    trace = Trace("t", (TraceRequest("big", 4000, 1, token_ids=tuple(range(4000))),
                        TraceRequest("big2", 4000, 1, token_ids=tuple(range(4000)))))
    backend = ProcessBackend(trace, _config(60), "latest", InstanceSettings(), 2, 2,
                             events=False)
    try:
        with pytest.raises(HybridKVError, match="big"):
            run_cluster(trace, RoundRobin(2), backend, _settings(2))
    finally:
        backend.close()
