"""Admission orders and waiting cost (``sim/admission.py``, ``sim/scheduler.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridkv.cli import main
from hybridkv.errors import ConfigError, PoolTooSmallError
from hybridkv.sched.admission import ORDERS, StarvationGuard, parse_admissions
from hybridkv.sched.scheduler import SchedRequest, Scheduler
from hybridkv.sim.replay import ReplaySettings, replay
from hybridkv.traces.trace import Trace, TraceRequest


def _drive(scheduler: Scheduler, max_steps: int = 10_000) -> list[str]:
    """Run to completion; the admission order (first admissions only)."""
    order: list[str] = []
    while scheduler.has_unfinished:
        assert scheduler.num_steps < max_steps
        plan = scheduler.schedule()
        order += [r for r in plan.admitted if scheduler.requests[r].num_admissions == 1]
        scheduler.update(plan, {c.req_id: 7 for c in plan.chunks if c.samples})
    return order


def _full_attention(num_blocks: int, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(
        CacheConfig.from_layers([FullAttentionSpec(block_size, 1)], num_blocks), "latest")


def test_waits_count_steps_from_eligibility_to_first_admission() -> None:
    # One request at a time, each finishing in the step it is admitted (prompt fits the
    # budget, one output token): r0 waits 0 steps, r1 1, r2 2. In a session, s1 becomes
    # eligible only when s0 finished (step 1), and is admitted at once (step 2): wait 0.
    scheduler = Scheduler(_full_attention(64), max_running=1, chunk_size=64)
    requests = [SchedRequest(f"r{i}", [i] * 8, 1) for i in range(3)]
    requests += [SchedRequest("s0", [9] * 8, 1, session_id="s"),
                 SchedRequest("s1", [9] * 12, 1, session_id="s")]
    for request in requests:
        scheduler.add_request(request)
    assert _drive(scheduler) == ["r0", "r1", "r2", "s0", "s1"]
    waits = {r.req_id: (r.eligible_step, r.admitted_step) for r in requests}
    assert waits == {"r0": (1, 1), "r1": (1, 2), "r2": (1, 3), "s0": (1, 4), "s1": (5, 5)}


def _shared_prefix_requests() -> list[SchedRequest]:
    # "a" then three unrelated requests, then "a2" (extends "a"): with a pool that holds
    # about one prompt, fcfs lets the unrelated ones evict "a" before "a2" comes up.
    prefix = list(range(100, 132))  # 32 tokens = 8 blocks
    requests = [SchedRequest("a", prefix, 1)]
    requests += [SchedRequest(f"u{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 32)), 1)
                 for i in range(3)]
    requests.append(SchedRequest("a2", [*prefix, 7, 7, 7, 7], 1))
    return requests


@pytest.mark.parametrize(("admission", "expected"), [
    ("fcfs", ["a", "u0", "u1", "u2", "a2"]),
    ("hit", ["a", "a2", "u0", "u1", "u2"]),
])
def test_longest_usable_hit_admits_the_warm_request_first(admission: str,
                                                          expected: list[str]) -> None:
    manager = _full_attention(1 + 12)  # one 36-token prompt's 9 blocks, plus 3
    scheduler = Scheduler(manager, max_running=1, chunk_size=64, admission=admission)
    requests = _shared_prefix_requests()
    for request in requests:
        scheduler.add_request(request)
    assert _drive(scheduler) == expected
    a2 = next(r for r in requests if r.req_id == "a2")
    assert a2.first_hit_tokens == (32 if admission == "hit" else 0)


def test_usable_hit_needs_the_window_tail_not_just_full_attention() -> None:
    # Hybrid model: "b" shares 16 tokens of full attention with the cache but its window
    # tail was never cached there (``latest`` keeps only the tail at the prompt end), so
    # its *usable* hit is 0 and the request with a real (resend) hit goes first.
    config = CacheConfig.from_layers(
        [FullAttentionSpec(4, 1), SlidingWindowSpec(4, 1, 8)], 64)
    manager = KVCacheManager(config, "latest")
    scheduler = Scheduler(manager, max_running=1, chunk_size=64, admission="hit")
    seed = list(range(40))
    scheduler.add_request(SchedRequest("seed", seed, 1))
    _drive(scheduler)
    partial = SchedRequest("b", [*seed[:16], *range(500, 520)], 1)   # FA match 16, no tail
    resend = SchedRequest("c", [*seed, 1, 2, 3, 4], 1)  # the tail at (40 - 1) // 4 * 4 = 36
    for request in (partial, resend):
        scheduler.add_request(request)
    assert _drive(scheduler) == ["c", "b"]
    assert resend.first_hit_tokens == 36 and partial.first_hit_tokens == 0


@pytest.mark.parametrize(("admission", "expected"), [
    ("fcfs", ["x0", "y0", "x1", "y1"]),
    ("session", ["x0", "x1", "y0", "y1"]),
])
def test_session_order_continues_the_most_recently_finished_session(
        admission: str, expected: list[str]) -> None:
    # When x0 finishes, x1 (its session just finished) goes before y0 (a session that has
    # not run yet), although y0 came first.
    scheduler = Scheduler(_full_attention(64), max_running=1, chunk_size=64,
                          admission=admission)
    for req_id, session in (("x0", "x"), ("y0", "y"), ("x1", "x"), ("y1", "y")):
        scheduler.add_request(SchedRequest(req_id, [len(req_id)] * 8, 1, session_id=session))
    assert _drive(scheduler) == expected


def test_starvation_guard_lets_cheap_requests_pass_until_their_prefill_reaches_the_budget(
) -> None:
    # "cold" (no hit) is first; a stream of warm requests would pass it forever under a
    # pure longest-hit order. max_running = 2 passes are free; beyond them, passing goes on
    # while all passes computed < max_running * chunk_size = 2 * 64 = 128 new tokens: each
    # warm request (a 32-token hit of a 44-token prompt) computes 12, so "cold" is passed
    # by ceil(128 / 12) = 11 of them, then admitted.
    manager = _full_attention(400)
    scheduler = Scheduler(manager, max_running=2, chunk_size=64, admission="hit")
    guard = scheduler.guard
    assert (guard.free_admissions, guard.max_prefill_tokens, guard.max_admissions) == \
        (2, 128, 256)
    warm = list(range(300, 332))
    scheduler.add_request(SchedRequest("seed", warm, 1))
    _drive(scheduler)
    scheduler.add_request(SchedRequest("cold", list(range(900, 932)), 1))
    for i in range(20):
        scheduler.add_request(SchedRequest(f"w{i}", [*warm, *[i] * 12], 1))
    order = _drive(scheduler)
    cold = scheduler.requests["cold"]
    assert order.index("cold") == 11  # 11 * 12 = 132 >= 128 > 10 * 12
    assert (cold.num_overtaken, cold.overtaken_tokens) == (11, 132)
    assert all(scheduler.requests[f"w{i}"].first_hit_tokens == 32 for i in range(20))
    for request in scheduler.requests.values():  # the stated bound: < budget + one prompt
        assert request.num_overtaken <= guard.free_admissions or \
            request.overtaken_tokens < guard.max_prefill_tokens + 44


def test_starvation_guard_always_allows_max_running_passes() -> None:
    # Expensive passes (28 new tokens each, budget 2 * 16 = 32): the work budget is spent
    # after two, but max_running = 2 passes are free anyway, and a third is refused.
    manager = _full_attention(400)
    scheduler = Scheduler(manager, max_running=2, chunk_size=16, admission="hit")
    warm = list(range(300, 308))
    scheduler.add_request(SchedRequest("seed", warm, 1))
    _drive(scheduler)
    scheduler.add_request(SchedRequest("cold", list(range(900, 908)), 1))
    for i in range(5):
        scheduler.add_request(SchedRequest(f"w{i}", [*warm, *[i] * 28], 1))
    order = _drive(scheduler)
    cold = scheduler.requests["cold"]
    assert order.index("cold") == 2 and cold.num_overtaken == 2
    assert cold.overtaken_tokens == 56  # over the budget: due at the 2nd pass


def test_starvation_guard_caps_admissions_that_pass_a_request() -> None:
    # Full hits compute 1 token each (the last prompt token): the token budget would let
    # 128 of them pass; the look-ahead window (4) caps the count of admissions instead.
    manager = _full_attention(400)
    scheduler = Scheduler(manager, max_running=2, chunk_size=64, admission="hit",
                          lookahead_requests=4)
    warm = list(range(300, 333))
    scheduler.add_request(SchedRequest("seed", [*warm, 5, 5, 5], 1))
    _drive(scheduler)
    scheduler.add_request(SchedRequest("cold", list(range(900, 932)), 1))
    for i in range(8):
        scheduler.add_request(SchedRequest(f"w{i}", warm, 1))
    order = _drive(scheduler)
    cold = scheduler.requests["cold"]
    assert order.index("cold") == 4 and cold.num_overtaken == 4
    assert cold.overtaken_tokens == 4  # 32-token hits of 33-token prompts


def test_starvation_guard_tracks_due_requests_while_they_wait() -> None:
    # ``due`` scans the candidates only while some waiting request is due: a pass makes
    # "a" due (1 pass >= 1 free, 20 tokens >= 10); its admission takes it off the due
    # set; a preemption puts it back (its counts still say due).
    guard = StarvationGuard(free_admissions=1, max_prefill_tokens=10, max_admissions=4)
    a, b, c = (SchedRequest(k, [0], 1) for k in "abc")
    assert guard.due([a, b]) is None
    guard.on_admitted([a, b], b, 20)
    assert guard.due([a, c]) is a
    guard.on_admitted([a, c], a, 5)  # "a" admitted: "c", behind it, was not passed
    assert guard.due([c]) is None and c.num_overtaken == 0
    guard.on_requeued(a)  # preempted: waiting again
    assert guard.due([a, c]) is a


def test_parse_admissions_and_bad_names() -> None:
    assert parse_admissions("all") == list(ORDERS)
    assert parse_admissions("hit,fcfs,hit") == ["hit", "fcfs"]
    with pytest.raises(ConfigError, match="--admission"):
        parse_admissions("longest")
    with pytest.raises(ConfigError):
        Scheduler(_full_attention(8), admission="nope")


def test_replay_reports_admission_and_waits() -> None:
    requests = tuple(TraceRequest(f"r{i}", 64, 2, block_ids=(1, 2, i + 10),
                                  trace_block_size=16, session_id=f"s{i % 2}")
                     for i in range(6))
    config = CacheConfig.from_layers([FullAttentionSpec(16, 1)], 40)
    for admission in ORDERS:
        result = replay(Trace("t", requests), config, "latest",
                        ReplaySettings(max_running=2, admission=admission))
        assert result.admission == admission
        assert len(result.wait_steps) == 6 and min(result.wait_steps) >= 0
        assert result.wait_p50_steps <= result.wait_p99_steps <= result.wait_max_steps
        assert result.scheduler_seconds > 0


def test_cli_crosses_admission_orders_with_policies(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = ["replay", "--workload", "agentic", "--set", "num_sessions=3", "--set",
            "num_turns=3", "--set", "first_prompt_tokens=200", "--set", "turn_tokens=50",
            "--model", "gemma3-bench", "--num-blocks", "400", "--policy", "latest,prepend",
            "--detail", "--admission", "fcfs,hit", "--json", str(out), "--quiet"]
    assert main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["policy"], r["admission"]) for r in runs] == [
        ("latest", "fcfs"), ("prepend", "fcfs"), ("latest", "hit"), ("prepend", "hit")]
    assert all(set(r["wait_steps"]) == {"p50", "p99", "max"} for r in runs)
    assert "wait: steps from eligibility" in capsys.readouterr().out
    assert main([*argv[:-5], "--admission", "bogus", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridkv replay: error: --admission='bogus'") and "\n" not in err


def test_may_extend_and_lookup_version_track_what_can_change_a_hit() -> None:
    # Full attention (bs 4) + window 8 (bs 4), ``latest``: "seed" caches 40 tokens of full
    # attention and the window tail at 36 only.
    config = CacheConfig.from_layers(
        [FullAttentionSpec(4, 1), SlidingWindowSpec(4, 1, 8)], 64)
    manager = KVCacheManager(config, "latest")
    scheduler = Scheduler(manager, max_running=1, chunk_size=64)
    seed = list(range(40))
    before = manager.lookup_version
    scheduler.add_request(SchedRequest("seed", seed, 1))
    _drive(scheduler)
    assert manager.lookup_version[1] > before[1]  # hashes were indexed
    manager.add_request("x", [*seed[:24], 999, 999, 999, 999, 999])
    hit = manager.find_longest_hit("x")
    assert hit.num_tokens == 0 and hit.junction_tokens == 24  # no window tail at 24
    # full attention past 24 is not cached for "x", no window block of it in (0, 24]:
    assert not manager.may_extend("x", hit.num_tokens, 24)
    assert manager.may_extend("x", 0, 0)  # (its full-attention block [0, 4) is cached)
    manager.add_request("y", seed[:37])
    assert manager.find_longest_hit("y").num_tokens == 36
    assert manager.may_extend("y", 0, 36)  # the window tail at 36 lies inside the match
    assert not manager.may_extend("y", 36, 36)  # "y" has no whole block past 36
    unchanged = manager.lookup_version
    assert manager.find_longest_hit("y").num_tokens == 36
    assert manager.lookup_version == unchanged  # lookups never move it


def test_growth_probes_answer_as_may_extend_does_later() -> None:
    # The probes precomputed for a waiting request's cached hit give may_extend's answer
    # at any later time: before and after "seed" caches the blocks that extend the hit.
    config = CacheConfig.from_layers(
        [FullAttentionSpec(4, 1), SlidingWindowSpec(4, 1, 8)], 64)
    manager = KVCacheManager(config, "latest")
    seed = list(range(40))
    manager.add_request("first", seed[:5])
    assert manager.allocate_slots("first", 5) is not None  # caches [0, 4)
    manager.free("first")
    questions = [("x", [*seed[:24], 999, 999, 999, 999, 999]), ("y", seed[:37])]
    for req_id, tokens in questions:
        manager.add_request(req_id, tokens)
    asked = [(req_id, n, m) for req_id, _ in questions for n, m in ((0, 0), (4, 4), (0, 24),
                                                                     (4, 36), (36, 36))]
    probes = {q: manager.growth_probes(*q) for q in asked}

    def answers() -> list[bool]:
        now = [manager.may_extend(*q) for q in asked]
        assert now == [p is None or any(h in index for index, h in p)
                       for p in (probes[q] for q in asked)]
        return now

    before = answers()
    manager.add_request("seed", seed)
    assert manager.allocate_slots("seed", 40) is not None
    after = answers()
    assert before != after  # the check above compared something that changed


def test_a_hit_ends_on_a_free_block_only_once_its_holder_released_it() -> None:
    # ``warm`` ranks hits on free blocks (evictable by the next allocation) first: while
    # "seed" runs, "y"'s hit is on blocks "seed" holds; once "seed" is freed, on free ones.
    config = CacheConfig.from_layers([FullAttentionSpec(4, 1), SlidingWindowSpec(4, 1, 8)], 64)
    manager = KVCacheManager(config, "dense")
    seed = list(range(40))
    manager.add_request("seed", seed)
    assert manager.allocate_slots("seed", 40) is not None
    manager.add_request("y", seed[:37])
    held = manager.find_longest_hit("y")
    assert held.num_tokens == 36 and not held.ends_on_free_block
    manager.free("seed")
    free = manager.find_longest_hit("y")
    assert free.num_tokens == 36 and free.ends_on_free_block


@pytest.mark.parametrize("admission", ["fcfs", "warm"])
def test_a_request_no_pool_can_take_is_named_under_every_order(admission: str) -> None:
    # Found by the bound property test under ``warm``: r2 (33 tokens) needs 13 blocks of a
    # 12-block pool. ``warm`` picks it before r1, so the refused request is r2, not the
    # first-come one: the replay must name r2 (PoolTooSmallError), not report a stall.
    requests = (TraceRequest("r0", 17, 1, block_ids=(1,), trace_block_size=16),
                TraceRequest("r1", 1, 1, block_ids=(), trace_block_size=16),
                TraceRequest("r2", 33, 1, block_ids=(1, 1), trace_block_size=16))
    config = CacheConfig.from_layers(
        [FullAttentionSpec(16, 8), SlidingWindowSpec(8, 16, 20), SlidingWindowSpec(8, 16, 20)],
        num_blocks=12, max_num_batched_tokens=16)
    with pytest.raises(PoolTooSmallError, match="'r2'"):
        replay(Trace("t", requests), config, "latest",
               ReplaySettings(max_running=1, chunk_size=16, admission=admission))
