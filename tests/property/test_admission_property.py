"""Admission orders (``sim/admission.py``) under the shared scheduler, on random small
workloads and tiny pools (the workloads of ``test_scheduler_property``):

- the generic candidate path, asked for the first candidate, makes exactly the decisions
  of the protocol's fcfs path (so ``fcfs`` is the protocol, and the candidate set is the
  one ``_next_eligible`` scans);
- every order finishes every request, keeps the manager's invariants and the scheduler's
  contracts, never admits before eligibility, and keeps its starvation guard's bound.
"""

from __future__ import annotations

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_scheduler_property import sampled_token, workloads

from hybridkv import (
    CacheConfig,
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheManager,
    LayerSpec,
    SlidingWindowSpec,
)
from hybridkv.sched.admission import ORDERS, FirstComeOrder, RankedOrder
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan


class GenericFirstCome(FirstComeOrder):
    """The first candidate, but through the scheduler's generic (non-fcfs) path."""

    name = "first-candidate"


def _copies(requests: list[SchedRequest]) -> list[SchedRequest]:
    return [SchedRequest(r.req_id, r.prompt_token_ids, r.max_output_tokens, r.session_id,
                         r.phase, r.tag) for r in requests]


def _one_by_one(name: str) -> RankedOrder:
    """The order ``name`` with its watchers off: growth is checked candidate by candidate
    (the reference the watchers must agree with; an attribute, not a scheduler subclass,
    so that it runs on the compiled core too)."""
    order = ORDERS[name]()
    assert isinstance(order, RankedOrder)
    order._watching = False
    return order


def _run(layers: tuple[LayerSpec, ...], requests: list[SchedRequest], admission: object,
         slack: int, max_running: int, chunk_size: int, lookahead_requests: int,
         ) -> tuple[Scheduler, list[StepPlan]]:
    groups = CacheConfig.from_layers(layers, 2).groups
    worst_case = max(
        sum(-(-(len(r.prompt_token_ids) + r.max_output_tokens) // g.spec.block_size)
            for g in groups)
        for r in requests
    )
    manager = KVCacheManager(CacheConfig(groups, 1 + worst_case + slack), "latest")
    scheduler = Scheduler(manager, max_running=max_running, chunk_size=chunk_size,
                          lookahead_requests=lookahead_requests,
                          admission=admission)  # type: ignore[arg-type]
    for request in requests:
        scheduler.add_request(request)
    total_tokens = sum(len(r.prompt_token_ids) + r.max_output_tokens for r in requests)
    plans: list[StepPlan] = []
    alignment = math.lcm(*(g.spec.block_size for g in groups))
    while scheduler.has_unfinished:
        assert scheduler.num_steps < 20 * total_tokens + 100, "no progress"
        plan = scheduler.schedule()
        manager.check_invariants()
        assert len(scheduler.running) <= max_running
        for chunk in plan.chunks:
            assert chunk.num_hit_tokens % alignment == 0
        for req_id in plan.admitted:
            request = scheduler.requests[req_id]
            assert request.eligible_step is not None
            assert request.eligible_step <= scheduler.num_steps
        plans.append(plan)
        scheduler.update(plan, {c.req_id: sampled_token(scheduler.requests[c.req_id])
                                for c in plan.chunks if c.samples})
        manager.check_invariants()
    assert manager.request_ids == []
    return scheduler, plans


@given(workload=workloads(), slack=st.integers(0, 2), max_running=st.integers(1, 6),
       chunk_size=st.integers(1, 48), lookahead_requests=st.integers(1, 8))
def test_generic_path_with_first_candidate_is_fcfs(
    workload: tuple[tuple[LayerSpec, ...], list[SchedRequest]], slack: int, max_running: int,
    chunk_size: int, lookahead_requests: int,
) -> None:
    layers, requests = workload
    fcfs, fcfs_plans = _run(layers, _copies(requests), "fcfs", slack, max_running,
                            chunk_size, lookahead_requests)
    generic, generic_plans = _run(layers, _copies(requests), GenericFirstCome(), slack,
                                  max_running, chunk_size, lookahead_requests)
    assert generic_plans == fcfs_plans
    for req_id, request in fcfs.requests.items():
        other = generic.requests[req_id]
        assert (other.eligible_step, other.admitted_step) == \
            (request.eligible_step, request.admitted_step)


@settings(max_examples=150)
@given(workload=workloads(), admission=st.sampled_from(sorted(ORDERS)),
       slack=st.integers(0, 2), max_running=st.integers(1, 6),
       chunk_size=st.integers(1, 48), lookahead_requests=st.integers(1, 8))
def test_every_order_finishes_and_keeps_its_guard(
    workload: tuple[tuple[LayerSpec, ...], list[SchedRequest]], admission: str, slack: int,
    max_running: int, chunk_size: int, lookahead_requests: int,
) -> None:
    layers, requests = workload
    scheduler, plans = _run(layers, requests, admission, slack, max_running, chunk_size,
                            lookahead_requests)
    admitted = [req_id for plan in plans for req_id in plan.admitted]
    longest = max(len(r.prompt_token_ids) + r.max_output_tokens for r in requests)
    assert sorted(set(admitted)) == sorted(r.req_id for r in requests)
    for request in requests:
        assert request.admitted_step is not None and request.eligible_step is not None
        assert request.admitted_step >= request.eligible_step
        guard = scheduler.guard
        assert request.num_overtaken <= guard.max_admissions
        assert request.num_overtaken <= guard.free_admissions or \
            request.overtaken_tokens < guard.max_prefill_tokens + longest
        if admission == "fcfs":
            assert request.num_overtaken == request.overtaken_tokens == 0


def _pinned(layers: tuple[LayerSpec, ...], *prompts: tuple[list[int], int, int],
            ) -> tuple[tuple[LayerSpec, ...], list[SchedRequest]]:
    """A workload of (prompt, output tokens, phase) requests q0, q1, …"""
    return layers, [SchedRequest(f"q{i}", prompt, out, None, phase)
                    for i, (prompt, out, phase) in enumerate(prompts)]


@settings(max_examples=150)
# a window group with blocks larger than full attention's: the full-attention block past
# the hit was already indexed at the probe (the hit stops at the window's block), so no
# later indexing of it marks the candidate; it is checked one by one
@example(workload=_pinned((FullAttentionSpec(2, 1), SlidingWindowSpec(4, 1, 1)),
                          ([0] * 4, 1, 1), ([0], 1, 0), ([0], 1, 1), ([0] * 5, 1, 1),
                          ([0, 0, 1], 2, 0), ([0], 1, 0)),
         admission="hit", slack=0, max_running=1, chunk_size=1, lookahead_requests=3)
# no full attention: the growth check always holds (no probes to watch)
@example(workload=_pinned((SlidingWindowSpec(2, 1, 1), ChunkedLocalSpec(2, 1, 4)),
                          ([0, 0], 1, 0), ([0], 1, 0), ([0, 0, 0], 1, 0)),
         admission="hit", slack=0, max_running=1, chunk_size=1, lookahead_requests=3)
# a watched hash indexed, then evicted before the ranking that lists the candidate: the
# mark alone would probe again where the check one by one finds nothing
@example(workload=_pinned((FullAttentionSpec(4, 1), SlidingWindowSpec(2, 1, 2)),
                          ([0] * 9, 1, 0), ([0], 1, 0), ([0] * 5, 1, 0), ([0], 1, 0),
                          ([0], 1, 0), ([0], 1, 0), ([0] * 6, 1, 0), ([0], 1, 0),
                          ([0], 1, 0), ([0], 1, 1), ([0] * 5, 1, 0), ([0], 1, 0)),
         admission="hit", slack=0, max_running=1, chunk_size=1, lookahead_requests=7)
@given(workload=workloads(), admission=st.sampled_from(["hit", "warm"]),
       slack=st.integers(0, 2), max_running=st.integers(1, 6),
       chunk_size=st.integers(1, 48), lookahead_requests=st.integers(1, 8))
def test_watching_new_hashes_decides_as_checking_every_candidate(
    workload: tuple[tuple[LayerSpec, ...], list[SchedRequest]], admission: str, slack: int,
    max_running: int, chunk_size: int, lookahead_requests: int,
) -> None:
    """Growth found by watchers (each ranking looks only at candidates a newly indexed
    hash concerns) makes exactly the plans of the check one candidate at a time."""
    layers, requests = workload
    args = (slack, max_running, chunk_size, lookahead_requests)
    watched, watched_plans = _run(layers, _copies(requests), admission, *args)
    scanned, scanned_plans = _run(layers, _copies(requests), _one_by_one(admission), *args)
    assert watched_plans == scanned_plans
    assert getattr(watched.admission, "_watching", False)  # the watchers did decide
    assert not getattr(scanned.admission, "_watching", True)  # the reference did scan
