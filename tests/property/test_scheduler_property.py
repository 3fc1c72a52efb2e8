"""Integration property: the shared ``Scheduler`` drives ``KVCacheManager`` over random small
workloads on a tiny pool. Every step keeps the manager's invariants and the scheduler's
contracts (token budget, sessions serialised, phase barriers, aligned hits), and every
request finishes within a bounded number of steps (no deadlock, no livelock).

The pool holds exactly one request's worst case (every group, prompt + outputs, plus a
little slack), so admissions are refused and running requests are preempted often — but a
request alone in the pool always fits and the oldest running request is never preempted,
which is what makes progress guaranteed, with or without the admission gate.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from strategies import ALPHABET, layer_specs, token_lists

from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, LayerSpec
from hybridkv.sched.scheduler import SchedRequest, Scheduler

POLICIES = ("dense", "reachable", "prepend", "latest", "interval", "pin:8")


@st.composite
def workloads(draw: st.DrawFn) -> tuple[tuple[LayerSpec, ...], list[SchedRequest]]:
    layers = draw(layer_specs())
    num_requests = draw(st.integers(1, 12))
    prompts: list[list[int]] = []
    requests: list[SchedRequest] = []
    for idx in range(num_requests):
        share: int = draw(st.integers(0, 3))  # mostly share a prefix with an earlier prompt
        if prompts and share:
            base = prompts[draw(st.integers(0, len(prompts) - 1))]
            prompt = base[: draw(st.integers(len(base) // 2, len(base)))]
        else:
            prompt = []
        prompt = (prompt + draw(token_lists(24)))[:48] or [0]
        prompts.append(prompt)
        requests.append(SchedRequest(
            req_id=f"q{idx}", prompt_token_ids=prompt,
            max_output_tokens=draw(st.integers(1, 8)),
            session_id=draw(st.sampled_from((None, None, "s0", "s1"))),
            phase=draw(st.integers(0, 1)),
        ))
    return layers, requests


def sampled_token(request: SchedRequest) -> int:
    return (len(request.output_token_ids) + len(request.prompt_token_ids)) % ALPHABET


@given(workload=workloads(), policy=st.sampled_from(POLICIES),
       slack=st.integers(0, 2), max_running=st.integers(1, 6),
       chunk_size=st.integers(1, 48), lookahead_requests=st.integers(1, 8),
       reserve_full_prompt=st.booleans())
def test_scheduler_finishes_every_request(
    workload: tuple[tuple[LayerSpec, ...], list[SchedRequest]], policy: str, slack: int,
    max_running: int, chunk_size: int, lookahead_requests: int, reserve_full_prompt: bool,
) -> None:
    layers, requests = workload
    groups = CacheConfig.from_layers(layers, 2).groups
    alignment = math.lcm(*(g.spec.block_size for g in groups))
    if policy == "interval":
        policy = f"interval:{alignment * 2}"
    worst_case = max(
        sum(-(-(len(r.prompt_token_ids) + r.max_output_tokens) // g.spec.block_size)
            for g in groups)
        for r in requests
    )
    manager = KVCacheManager(CacheConfig(groups, 1 + worst_case + slack), policy)
    scheduler = Scheduler(manager, max_running=max_running, chunk_size=chunk_size,
                          lookahead_requests=lookahead_requests,
                          reserve_full_prompt=reserve_full_prompt)
    for request in requests:
        scheduler.add_request(request)
    total_tokens = sum(len(r.prompt_token_ids) + r.max_output_tokens for r in requests)
    max_steps = 20 * total_tokens + 100
    finished: list[str] = []
    while scheduler.has_unfinished:
        assert scheduler.num_steps < max_steps, (
            f"no progress after {max_steps} steps: waiting "
            f"{[r.req_id for r in scheduler.waiting]}, running "
            f"{[r.req_id for r in scheduler.running]}, {manager.num_free_blocks} of "
            f"{manager.pool.num_blocks - 1} blocks free, "
            f"{scheduler.num_preemptions} preemptions")
        plan = scheduler.schedule()
        manager.check_invariants()
        assert sum(c.num_new_tokens for c in plan.chunks) <= chunk_size
        assert len(scheduler.running) <= max_running
        sessions = [r.session_id for r in scheduler.running if r.session_id is not None]
        assert len(sessions) == len(set(sessions)), "two requests of one session ran together"
        unfinished_phases = [r.phase for r in requests if r.req_id not in finished]
        assert all(r.phase == min(unfinished_phases) for r in scheduler.running), \
            "a later phase ran before an earlier one finished"
        for chunk in plan.chunks:
            assert chunk.num_new_tokens > 0
            assert chunk.num_hit_tokens % alignment == 0
            if chunk.req_id in plan.admitted:
                assert chunk.num_computed_tokens == chunk.num_hit_tokens
        sampled = {c.req_id: sampled_token(scheduler.requests[c.req_id])
                   for c in plan.chunks if c.samples}
        finished += scheduler.update(plan, sampled)
        manager.check_invariants()
    assert sorted(finished) == sorted(r.req_id for r in requests)
    assert all(len(r.output_token_ids) == r.max_output_tokens for r in requests)
    assert manager.request_ids == []
    assert manager.num_free_blocks == manager.pool.num_blocks - 1


def test_phase_barrier_does_not_block_the_lookahead_window() -> None:
    """Regression (found by the property above): with ``lookahead_requests=1`` a phase-1
    request queued before a phase-0 one used to fill the look-ahead window, so the phase-0
    request was never admitted and the phase-1 one waited for it forever."""
    manager = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(2, 1)], 4), "dense")
    scheduler = Scheduler(manager, max_running=1, chunk_size=1, lookahead_requests=1)
    scheduler.add_request(SchedRequest("late", [0], max_output_tokens=1, phase=1))
    scheduler.add_request(SchedRequest("early", [0], max_output_tokens=1, phase=0))
    order: list[str] = []
    while scheduler.has_unfinished and scheduler.num_steps < 10:
        plan = scheduler.schedule()
        order += plan.admitted
        scheduler.update(plan, {c.req_id: 0 for c in plan.chunks if c.samples})
    assert order == ["early", "late"]
    assert not scheduler.has_unfinished
