"""Miss causes on hand-checked tiny traces, one per cause; the hybrid bound's charge."""

from __future__ import annotations

from hybridkv import CacheConfig, FullAttentionSpec, SlidingWindowSpec
from hybridkv.sim.bound import AdmissionLog, BoundShape, fa_optimum, hybrid_optimum
from hybridkv.sim.misses import MissCauses, split_miss
from hybridkv.sim.replay import ReplaySettings, RunResult, attach_bounds, replay
from hybridkv.traces.trace import Trace, TraceRequest

FULL16 = FullAttentionSpec(16, 8)


def _req(name: str, ids: tuple[int, ...], fill: int = 0, out: int = 1, phase: int = 0,
         ) -> TraceRequest:
    """Trace blocks of 16 tokens (ids) plus ``fill`` request-unique tokens."""
    return TraceRequest(name, 16 * len(ids) + fill, out, block_ids=ids, trace_block_size=16,
                        phase=phase)


def _replay(requests: tuple[TraceRequest, ...], layers: list[object], num_blocks: int,
            policy: str = "dense") -> RunResult:
    config = CacheConfig.from_layers(layers, num_blocks=num_blocks)  # type: ignore[arg-type]
    trace = Trace("t", requests)
    result = replay(trace, config, policy, ReplaySettings(check_invariants=True))
    assert result.misses.total == result.prompt_tokens - result.hit_tokens
    attach_bounds(result, trace, config)
    return result


def test_cold() -> None:
    # One 64-token prompt: nothing was seen before, all 64 tokens are cold.
    result = _replay((_req("a", (1, 2, 3, 4)),), [FULL16], 100)
    assert result.misses == MissCauses(cold=64)


def test_alignment() -> None:
    # Full attention bs 32 + window bs 8 → A 32, hash blocks of 8. The same 50-token
    # prompt twice (phases: one after the other), a large pool. The resend saw 48 tokens
    # (6 hash blocks); an infinite cache hits min(floor(48/32)*32, floor(49/32)*32) = 32,
    # and so does the replay: missed 18 = cold 2 (the unhashed tail 48..50) + alignment 16.
    layers = [FullAttentionSpec(32, 8), SlidingWindowSpec(8, 8, 16)]
    first = TraceRequest("a", 50, 1, token_ids=tuple(range(50)))
    again = TraceRequest("b", 50, 1, token_ids=tuple(range(50)), phase=1)
    result = _replay((first, again), layers, 200)
    assert result.hit_tokens == 32
    assert result.misses == MissCauses(cold=50 + 2, alignment=16)


def test_evicted() -> None:
    # Full attention only, bs 16. A (65 tokens: 4 blocks + 1), B (65), A again, one after
    # another; 5 usable blocks: B's prefill reuses all of A's. A-again saw 64 tokens
    # (A's blocks, computed and cached), the infinite cache would hit 64, the chain is gone:
    # evicted 64, cold 1 (its fill token is request-unique).
    reqs = (_req("a", (1, 2, 3, 4), 1), _req("b", (5, 6, 7, 8), 1, phase=1),
            _req("a2", (1, 2, 3, 4), 1, phase=2))
    result = _replay(reqs, [FULL16], 6)
    assert result.hit_tokens == 0
    assert result.misses == MissCauses(cold=65 + 65 + 1, evicted=64)


def test_tail() -> None:
    # Full + window (bs 16, w 32 → a hit needs the 2 blocks ending at it), ``latest``:
    # r0 = 8 blocks + 1 token keeps window KV only at its boundary (128). r1 shares r0's
    # first 4 blocks (64 tokens): full attention is resident to 64, its window tail at 64
    # was never kept → hit 0, tail 64, and r1's own 4 blocks + 1 token are cold.
    layers = [FULL16, SlidingWindowSpec(16, 8, 32)]
    reqs = (_req("r0", (1, 2, 3, 4, 5, 6, 7, 8), 1), _req("r1", (1, 2, 3, 4, 9, 9, 9, 9), 1,
                                                        phase=1))
    result = _replay(reqs, layers, 200, "latest")
    assert result.hit_tokens == 0
    assert result.misses == MissCauses(cold=129 + 65, tail=64)
    # ``dense`` keeps every window block: r1 hits those 64 tokens instead.
    assert _replay(reqs, layers, 200, "dense").misses == MissCauses(cold=129 + 65)


def test_admission() -> None:
    # The same 4-block prompt twice, one after the other, with prefix caching off: the
    # resend saw 64 tokens (the infinite cache would hit 48, capped at 64 - 1), none was
    # ever cached: admission 48, alignment 16.
    reqs = (_req("r0", (1, 2, 3, 4)), _req("r1", (1, 2, 3, 4), phase=1))
    config = CacheConfig.from_layers([FULL16], num_blocks=100, enable_caching=False)
    result = replay(Trace("t", reqs), config, "dense")
    assert result.misses == MissCauses(cold=64, admission=48, alignment=16)
    # with caching on the resend hits those 48 tokens
    result = _replay(reqs, [FULL16], 100)
    assert result.hit_tokens == 48 and result.misses == MissCauses(cold=64, alignment=16)


def test_split_adds_up_and_never_goes_negative() -> None:
    for args in ((100, 0, 72, 32, 32, True), (100, 64, 72, 32, 96, False), (1, 0, 0, 16, 0, False),
                 (64, 48, 40, 16, 0, True)):
        causes = split_miss(*args[:5], was_cached=bool(args[5]))
        assert causes.total == args[0] - args[1]
        assert min(causes.as_dict().values()) >= 0


def test_hybrid_bound_charges_what_running_requests_hold() -> None:
    # Two admissions of the same 4-unit prompt (A 16). bound_fa's pool holds 9 units: the
    # second hits 3 units (capped at 63 tokens → 48). When the first admission leaves 6
    # held non-item blocks (9 - 6 = 3 units), the bound still hits 48; with 7 held it
    # keeps 2 units: 32.
    reqs = (_req("r0", (1, 2, 3, 4)), _req("r1", (1, 2, 3, 4)))
    trace = Trace("t", reqs)
    shape = BoundShape(num_blocks=10, unit_tokens=16, unit_blocks=1, fa_block_size=16)
    for held, hit in ((0, 48), (6, 48), (7, 32), (9, 0)):
        log = AdmissionLog.in_trace_order(trace)
        log.held_blocks[0] = held
        assert hybrid_optimum(trace, log, shape).hit_tokens == hit, held


def test_hybrid_bound_pins_what_running_requests_hold() -> None:
    # Pool of 2 units (3 blocks, A 16, nothing else held). r0 computes x and finishes; r1
    # and r2 compute y and z (never read again) and both still run at r2's admission, so
    # the pool holds y and z and x must have gone: r3's read of x cannot hit. bound_fa
    # (nothing pinned) keeps x; the hybrid bound pins y and z and evicts x.
    reqs = (_req("r0", (1,), 1), _req("r1", (2,), 1), _req("r2", (3,), 1), _req("r3", (1,), 1))
    trace = Trace("t", reqs)
    shape = BoundShape(num_blocks=3, unit_tokens=16, unit_blocks=1, fa_block_size=16)
    log = AdmissionLog()
    log.append(0, True, 0, held_units=1)
    log.release_at(0, 0)  # r0 finished before r1's admission
    log.append(1, True, 0, held_units=1)
    log.append(2, True, 0, held_units=1)
    log.release_at(1, 2)
    log.release_at(2, 2)  # both finished after r2's admission
    log.append(3, True, 0, held_units=1)
    assert fa_optimum(trace, log, shape).hit_tokens == 16
    assert hybrid_optimum(trace, log, shape).hit_tokens == 0
    log.release[1] = 1  # r1 finished before r2's admission: room for x again
    assert hybrid_optimum(trace, log, shape).hit_tokens == 16


def test_units_enter_the_bound_when_allocated() -> None:
    # r0's 2-unit prompt is allocated in two chunks: unit 1 only after r1's admission, so
    # r1 (reading both units) can hit unit 0 only, whatever the capacity.
    reqs = (_req("r0", (1, 2), 1), _req("r1", (1, 2), 1))
    trace = Trace("t", reqs)
    shape = BoundShape(num_blocks=10, unit_tokens=16, unit_blocks=1, fa_block_size=16)
    log = AdmissionLog()
    log.append(0, True, 0, held_units=1)
    log.append(1, True, 0, held_units=0)
    log.grow(2, 0, 2)  # seen holding unit 1 only after event 1
    assert hybrid_optimum(trace, log, shape).hit_tokens == 16
    assert fa_optimum(trace, log, shape).hit_tokens == 16
    log.growth_events[0] = 1  # allocated before r1's lookup: r1 hits both
    assert hybrid_optimum(trace, log, shape).hit_tokens == 32
