"""Event-fed prefix routers: they see only the KV event streams, and the residency-aware
one knows what the full-attention-only one cannot (window tails, checkpoints)."""

from __future__ import annotations

import pytest

from hybridkv.cli.cluster import run_router
from hybridkv.cluster.instance import Instance, InstanceSettings
from hybridkv.cluster.prefix import PrefixRouter, make_prefix_router
from hybridkv.cluster.routers import Load, Route, RouteRequest
from hybridkv.cluster.simulate import ClusterRun, ClusterSettings, run_cluster, serial_backend
from hybridkv.config import CacheConfig
from hybridkv.events.schema import external_hash
from hybridkv.models.shapes import load_model
from hybridkv.specs import FullAttentionSpec, SlidingWindowSpec
from hybridkv.traces.trace import Trace, TraceRequest
from hybridkv.traces.workloads import make_workload


def _tiny(num_blocks: int = 200) -> CacheConfig:
    """Full attention + a window of 8 tokens, blocks of 4: a hit at p needs the 2 window
    blocks ending at p."""
    full = FullAttentionSpec(block_size=4, kv_bytes_per_token=64)
    swa = SlidingWindowSpec(block_size=4, kv_bytes_per_token=64, sliding_window=8)
    return CacheConfig.from_layers([full, swa], num_blocks=num_blocks)


P = tuple(range(100, 133))  # 33 tokens


def _tail_trace() -> Trace:
    """r0 (P, 33 tokens) and r1 (P[:16] + 1 token) run first; r2 shares P's first 16
    tokens. Under ``latest`` r0 keeps its window tail at 32 only, r1 keeps the one at 16."""
    return Trace("tail", (
        TraceRequest("r0", 33, 1, token_ids=P),
        TraceRequest("r1", 17, 1, token_ids=(*P[:16], 7)),
        TraceRequest("r2", 40, 1, token_ids=(*P[:16], *range(900, 924)), phase=1),
    ))


def _settings(n: int = 2) -> ClusterSettings:
    return ClusterSettings(num_instances=n, instance=InstanceSettings(max_running=4))


def test_fa_index_routes_to_a_gone_tail_the_residency_index_does_not() -> None:
    trace, config = _tail_trace(), _tiny()
    runs = {name: run_router(name, trace, config, "latest", _settings())
            for name in ("prefix-fa", "prefix-residency")}
    fa, residency = runs["prefix-fa"], runs["prefix-residency"]
    # r0 → instance 0, r1 → instance 1 (nothing cached yet: least loaded); then r2:
    assert fa.routed_by_instance == [2, 1]          # FA chain of 16 on both: the tie → 0
    assert residency.routed_by_instance == [1, 2]   # the tail at 16 lives on instance 1
    assert fa.hit_tokens == 0 and fa.phantom_hit_tokens == 16
    assert residency.hit_tokens == 16 and residency.phantom_hit_tokens == 0
    assert residency.hit_rate > fa.hit_rate


def test_router_sees_only_events() -> None:
    """Fed nothing, the prefix router knows nothing; fed instance 1's stream, it finds the
    landable tail there, computed from the events alone."""
    trace, config = _tail_trace(), _tiny()
    instances = [Instance(i, trace, config, "latest", InstanceSettings(), events=True)
                 for i in range(2)]
    reports = [instances[0].advance([0], 5), instances[1].advance([1], 5)]
    router = make_prefix_router(2, config, trace, residency=True, load_weight=1.0)
    external = [external_hash(h) for h in router.prompt_hashes(2)]
    assert [router.match(i, external, 40) for i in range(2)] == [0, 0]
    for report in reports:
        assert report.events, "an instance with events on reports them"
        router.observe(report.instance, report.events)
    assert [router.match(i, external, 40) for i in range(2)] == [0, 16]
    fa = make_prefix_router(2, config, trace, residency=False, load_weight=1.0)
    for report in reports:
        fa.observe(report.instance, report.events)
    assert [fa.match(i, external, 40) for i in range(2)] == [16, 16]


def test_load_weight_keeps_a_prefix_router_balancing() -> None:
    """score = exact hit + chain - weight x queued: instance 1's 16-token landable hit on
    a 16-token chain (32) beats a backlog of 31 tokens, not one of 33; with weight 0 the
    match alone decides."""
    trace, config = _tail_trace(), _tiny()
    instance = Instance(1, trace, config, "latest", InstanceSettings(), events=True)
    events = instance.advance([1], 5).events
    request = _route_request(trace, 2)
    router = make_prefix_router(2, config, trace, residency=True, load_weight=1.0,
                                self_paying=False)
    greedy = make_prefix_router(2, config, trace, residency=True, load_weight=0.0,
                                self_paying=False)
    for each in (router, greedy):
        each.observe(1, events)
    assert router.route(request, [Load(0, 0), Load(31, 1)]) == Route(1, 16)
    assert router.route(request, [Load(0, 0), Load(33, 1)]) == Route(0, 0)
    assert greedy.route(request, [Load(0, 0), Load(10**6, 9)]).instance == 1


def _route_request(trace: Trace, index: int) -> RouteRequest:
    r = trace.requests[index]
    return RouteRequest(index, r.request_id, r.session_id, r.input_length)


@pytest.mark.parametrize("model", ["gemma3-bench", "qwen3.5-27b"])
def test_residency_prediction_is_the_managers_hit_without_pressure(model: str) -> None:
    """A pool large enough that nothing is evicted: every hit the residency router
    predicts from the events is exactly the hit the instance's manager then gives, while
    the full-attention-only index over-predicts (window tails / checkpoints it cannot see).
    """
    shape = load_model(model)
    trace = make_workload("agentic", num_sessions=4, num_turns=4, first_prompt_tokens=1600,
                          turn_tokens=900, output_tokens=3)
    config = shape.cache_config(6000 if model == "gemma3-bench" else 400)
    runs = {name: run_router(name, trace, config, "latest", _settings(3))
            for name in ("prefix-fa", "prefix-residency")}
    residency, fa = runs["prefix-residency"], runs["prefix-fa"]
    assert sum(r.evicted_blocks for r in residency.instances) == 0
    assert residency.hit_tokens > 0
    assert residency.phantom_hit_tokens == 0
    assert residency.predicted_hit_tokens == residency.hit_tokens
    if model == "gemma3-bench":  # recurrent: checkpoints sit where FA blocks end here
        assert fa.phantom_hit_tokens > 0


def test_prefix_routers_parallel_equals_serial() -> None:
    trace = make_workload("agentic", num_sessions=5, num_turns=3, first_prompt_tokens=512,
                          turn_tokens=128, output_tokens=3)
    config = load_model("gemma3-bench").cache_config(300)
    for name in ("prefix-fa", "prefix-residency"):
        serial = run_router(name, trace, config, "latest", _settings(3))
        parallel = run_router(name, trace, config, "latest", _settings(3), jobs=2)
        timeless = [{k: v for k, v in run.to_json().items() if k != "wall_seconds"}
                    for run in (serial, parallel)]
        assert timeless[0] == timeless[1]


def test_router_without_events_falls_back_to_least_loaded() -> None:
    trace, config = _tail_trace(), _tiny()
    router: PrefixRouter = make_prefix_router(2, config, trace, residency=True,
                                              load_weight=1.0)
    run = run_cluster(trace, router, serial_backend(trace, config, "latest", _settings(),
                                                    events=False), _settings())
    assert run.predicted_hit_tokens == 0  # no stream, no prediction


def _locality_trace() -> Trace:
    """r0 (P, 33 tokens) runs first: under ``latest`` its instance keeps P's full-attention
    chain but the window tail only at 32. Then z (9 unrelated tokens) and r1 (P[:24] + 16
    new tokens), then r2 (P[:24] + 16 other tokens). No instance ever holds a landable
    point at 24 before r1 runs: only a request computed where P's chain lives creates one
    (its shared-prefix junction)."""
    return Trace("locality", (
        TraceRequest("r0", 33, 1, token_ids=P),
        TraceRequest("z", 9, 1, token_ids=tuple(range(500, 509)), phase=1),
        TraceRequest("r1", 40, 1, token_ids=(*P[:24], *range(600, 616)), phase=1),
        TraceRequest("r2", 40, 1, token_ids=(*P[:24], *range(700, 716)), phase=2),
    ))


def _run_prefix(trace: Trace, config: CacheConfig, *, residency: bool,
                locality: bool = True, self_paying: bool = False) -> ClusterRun:
    settings = _settings()
    router = make_prefix_router(2, config, trace, residency=residency, load_weight=1.0,
                                locality=locality, self_paying=self_paying)
    return run_cluster(trace, router, serial_backend(trace, config, "latest", settings,
                                                     events=True), settings)


def test_residency_router_keeps_locality_where_no_tail_is_landable() -> None:
    """z goes to instance 0 (a tie); r1 has no landable point anywhere. Scoring exact hits
    only (``locality=False``, the session-2 rule) sends r1 to the idle instance 1 and r2
    then finds nothing; the full-attention chain as the locality term keeps r1 with P's
    chain on instance 0, where r1's junction makes 24 landable and r2 hits it, exactly as
    predicted (the full-attention-only index predicts a phantom 24 for r1)."""
    trace, config = _locality_trace(), _tiny()
    scattered = _run_prefix(trace, config, residency=True, locality=False)
    kept = _run_prefix(trace, config, residency=True)
    fa = _run_prefix(trace, config, residency=False)
    assert scattered.routed_by_instance == [3, 1] and scattered.hit_tokens == 0
    assert kept.routed_by_instance == [4, 0] and kept.hit_tokens == 24
    assert kept.predicted_hit_tokens == 24 and kept.phantom_hit_tokens == 0
    assert fa.hit_tokens == 24 and fa.phantom_hit_tokens == 24


def test_an_exact_hit_breaks_a_chain_tie() -> None:
    """Both instances hold r2's 16-token chain (P[:16]); only instance 1 can land a hit
    there (r1's prompt end). Residency scores 16 + 16 there against 0 + 16 on instance 0;
    the full-attention index sees 16 on both and takes the tie's lowest index: a phantom."""
    trace, config = _tail_trace(), _tiny()
    kept = _run_prefix(trace, config, residency=True)
    fa = _run_prefix(trace, config, residency=False)
    assert kept.routed_by_instance == [1, 2] and kept.hit_tokens == 16
    assert fa.routed_by_instance == [2, 1] and fa.hit_tokens == 0


def test_self_paying_rule_caps_the_backlog_a_request_joins() -> None:
    """Instance 1 holds r2's 16-token chain with a landable point at 16 (exact hit 16).
    The self-paying rule lets r2 queue behind at most 16 more tokens than on the least
    loaded instance: 15 extra → instance 1, 17 extra → instance 0. Without the rule the
    score (16 + 16 - 17 = 15 > 0) still sends it to instance 1 at 17."""
    trace, config = _tail_trace(), _tiny()
    instance = Instance(1, trace, config, "latest", InstanceSettings(), events=True)
    events = instance.advance([1], 5).events
    request = _route_request(trace, 2)
    capped = make_prefix_router(2, config, trace, residency=True, load_weight=1.0,
                                self_paying=True)
    free = make_prefix_router(2, config, trace, residency=True, load_weight=1.0)
    for each in (capped, free):
        each.observe(1, events)
    assert capped.route(request, [Load(0, 0), Load(15, 1)]) == Route(1, 16)
    assert capped.route(request, [Load(0, 0), Load(17, 1)]) == Route(0, 0)
    assert free.route(request, [Load(0, 0), Load(17, 1)]) == Route(1, 16)
    # the rule is measured from the least-loaded instance, not from zero
    assert capped.route(request, [Load(100, 1), Load(117, 1)]) == Route(0, 0)
    assert capped.route(request, [Load(100, 1), Load(116, 1)]) == Route(1, 16)


def test_self_paying_rule_keeps_a_landable_hit_and_drops_an_unpaid_chain() -> None:
    """The same two cluster replays as above with the rule on. r2's exact hit on instance
    1 pays for its (empty) extra queue: kept, 16 tokens hit. In the locality trace r1's
    chain on instance 0 has no landable point (exact 0) and instance 0 has z queued: the
    rule sends r1 to the idle instance (the price of the rule: r2 hits nothing)."""
    config = _tiny()
    kept = _run_prefix(_tail_trace(), config, residency=True, self_paying=True)
    assert kept.routed_by_instance == [1, 2] and kept.hit_tokens == 16
    capped = _run_prefix(_locality_trace(), config, residency=True, self_paying=True)
    assert capped.routed_by_instance == [3, 1] and capped.hit_tokens == 0
    assert capped.phantom_hit_tokens == 0


def test_the_cli_residency_router_keeps_locality_that_the_self_paying_rule_drops() -> None:
    """``hybridkv cluster --router prefix-residency`` scores ``h + c - queued`` without the
    self-paying rule (measured to cost hits on held-out traces: docs/benchmarks.md): in the
    locality trace r1 follows P's chain into instance 0's 9-token queue (0 + 24 - 9 > 0),
    builds the junction, and r2 hits it; the rule (above) sends r1 to the idle instance
    and nothing hits."""
    trace, config = _locality_trace(), _tiny()
    default = run_router("prefix-residency", trace, config, "latest", _settings())
    assert default.routed_by_instance == [4, 0] and default.hit_tokens == 24
    assert default.phantom_hit_tokens == 0
    ablation = _run_prefix(trace, config, residency=True, self_paying=True)
    assert ablation.hit_tokens == 0
