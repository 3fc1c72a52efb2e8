"""Window-recompute bridges (``+recompute``) run exactly, and a broken bridge is caught.

Workload: ``synthetic.bridges`` — a long document, then prompts leaving it just after unit
boundaries where tail-retaining policies keep no window KV, so full attention matches
further than any window tail: the manager plans a bridge ``[s, F)``. Every cached run is
compared with the uncached one (float64, NaN-poisoned pages, tolerance ``DEFAULT_ATOL``).

Bridge kinds, read from each admission's ``PrefillPlan`` (hit ``q``, cached end ``F``,
floor)::

    cold       F > q, floor > 0        window KV before s = q missing (null blocks)
    warm       F > q > 0, floor == 0   a retained window tail at q
    from zero  F > q == 0              F <= bridge length B: recompute from token 0
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from hybridkv import InvariantViolation, KVCacheManager
from hybridkv import coordinator as coordinator_module
from hybridkv.cache import PrefillPlan
from hybridkv.cli.verify import add_verify_arguments, cmd_verify
from hybridkv.engine import bridge as bridge_module
from hybridkv.engine import runner as runner_module
from hybridkv.engine.attention import (
    AttentionFn,
    AttentionRule,
    reference_attention,
    sdpa_attention,
)
from hybridkv.engine.flex import FlexAttention
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import (
    LayerKind,
    ModelConfig,
    cache_config_for_model,
    gemma3_pattern,
)
from hybridkv.engine.paged import PagedKVCache
from hybridkv.engine.runner import EngineRunner, RunOptions, RunResult
from hybridkv.engine.synthetic import bridges, make_engine_workload
from hybridkv.engine.verify import (
    DEFAULT_ATOL,
    DEFAULT_POLICIES,
    VerifySettings,
    compare_runs,
    run_verify,
)
from hybridkv.errors import EquivalenceError
from hybridkv.sched.scheduler import SchedRequest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

GEMMA = gemma3_pattern(4, period=4)  # 3 sliding layers, then 1 full


@dataclass(frozen=True)
class Case:
    """One model + cache shape; ``bridge_tokens`` is the manager's ``B``."""

    kinds: tuple[LayerKind, ...]
    window: int | None
    block_size: int
    num_units: int = 16
    layer_windows: tuple[int, ...] | None = None
    full_block_size: int | None = None
    chunk_size: int = 16
    eagle: bool = False
    seed: int = 0

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.tiny(layer_types=self.kinds, sliding_window=self.window,
                                layer_windows=self.layer_windows)

    @property
    def bridge_tokens(self) -> int:
        config = self.config
        span = sum(config.window_of(i) - 1 for i, kind in enumerate(config.layer_types)
                   if kind == "sliding_attention")
        alignment = math.lcm(self.block_size, self.full_block_size or self.block_size)
        return -(-span // alignment) * alignment


@dataclass
class Outcome:
    baseline: RunResult
    cached: RunResult
    max_logit_diff: float
    errors: list[EquivalenceError]

    def admissions(self) -> list[tuple[int, int, int]]:
        """(hit q, cached end F, floor) of every admission."""
        return [(hit, plan.full_attention_cached_tokens, plan.window_floor_tokens)
                for record in self.cached.records.values()
                for hit, plan in zip(record.hit_tokens, record.prefill_plans, strict=True)]

    def bridges(self, kind: str) -> list[tuple[int, int, int]]:
        """Admissions with a bridge of ``kind``: cold, warm or zero (see the module)."""
        def matches(q: int, f: int, floor: int) -> bool:
            if kind == "cold":
                return f > q and floor > 0
            if kind == "warm":
                return f > q > 0 and floor == 0
            return f > q == 0

        return [a for a in self.admissions() if matches(*a)]

    def assert_exact(self) -> None:
        assert not self.errors, self.errors[0]
        assert self.max_logit_diff <= DEFAULT_ATOL


def _run(case: Case, policy: str, *, caching: bool = True,
         attention: AttentionFn = reference_attention,
         workload: list[SchedRequest] | None = None) -> RunResult:
    model = HybridDecoder(case.config, dtype=torch.float64, seed=case.seed)
    cache_config = cache_config_for_model(
        case.config, num_blocks=1500, block_size=case.block_size,
        full_block_size=case.full_block_size, dtype_bytes=8,
        enable_caching=caching, use_eagle=case.eagle and caching,
        max_num_batched_tokens=case.chunk_size)
    options = RunOptions(policy=policy, chunk_size=case.chunk_size, max_running=4,
                         poison=True)
    alignment = math.lcm(case.block_size, case.full_block_size or case.block_size)
    requests = workload or bridges(alignment, case.seed, num_units=case.num_units)
    return EngineRunner(model, cache_config, options, attention=attention).run(requests)


def _compare(case: Case, policy: str = "latest+recompute", *,
             attention: AttentionFn = reference_attention) -> Outcome:
    baseline = _run(case, "latest", caching=False)
    cached = _run(case, policy, attention=attention)
    worst, errors = compare_runs(baseline, cached, policy=policy, atol=DEFAULT_ATOL)
    return Outcome(baseline, cached, worst, errors)


# ------------------------------------------------------------------ exact bridges
@pytest.mark.parametrize("case", [
    Case(GEMMA, window=5, block_size=8, chunk_size=8),    # window < block, B = 16
    Case(GEMMA, window=13, block_size=8),                 # window > block, B = 40
    Case(GEMMA, window=24, block_size=4, num_units=32),   # six blocks wide, B = 72
], ids=lambda c: f"w{c.window}-bs{c.block_size}")
def test_cold_bridges_are_exact(case: Case) -> None:
    out = _compare(case)
    out.assert_exact()
    assert out.cached.bridge_tokens > 0
    cold = out.bridges("cold")
    assert cold, out.admissions()
    for hit, fa_end, floor in cold:  # s = F - B on the alignment, floor = s
        assert floor == hit == fa_end - case.bridge_tokens
    assert max(f - q for q, f, _ in cold) > case.chunk_size  # a bridge spans chunks
    assert out.bridges("zero"), "a prompt leaving within B tokens bridges from 0"
    # the sibling hits at the tail its bridge computed: a plain hit on bridge-written KV
    assert any(q == f and floor == 0 and q in {c[1] for c in cold}
               for q, f, floor in out.admissions())


def test_bridge_tail_blocks_published_by_the_manager_are_exact() -> None:
    """Exposes a manager bug (core, not fixed here).

    Window bs 4, w 30 (8 tail blocks = 32 tokens > w - 1 = 29), full bs 8 (alignment 8):
    B = 3 x 29 = 87 -> 88. ``leave113`` bridges cold [24, 112); the third sliding layer's
    input is inexact on [24, 24 + 2 x 29) = [24, 82), so its K/V at 80 and 81 is inexact,
    yet the manager hashes the whole tail [80, 112) (block 20 = [80, 84) included: only
    [83, 112) is guaranteed). ``sibling90`` then hits at 88, its window reads [59, 88),
    and the lookup hands it leave113's block 20: logits off by ~3e-4. A bridge of 96
    (every hashed tail block exact: 2 x 29 + 32 = 90 -> 96) is identical.
    """
    case = Case(GEMMA, window=30, block_size=4, full_block_size=8)
    out = _compare(case)
    assert out.bridges("cold")
    out.assert_exact()


def test_several_window_sizes_in_one_model() -> None:
    """Windows 5 and 9, full layers between them: B = 4 + 8 + 4 = 16."""
    case = Case(("sliding_attention", "full_attention", "sliding_attention",
                 "sliding_attention", "full_attention"), window=None, block_size=4,
                layer_windows=(5, 1, 9, 5, 1), num_units=24)
    assert case.bridge_tokens == 16
    out = _compare(case)
    out.assert_exact()
    assert out.cached.bridge_tokens > 0 and out.bridges("cold")


def test_eagle_bridges_are_exact() -> None:
    case = Case(GEMMA, window=7, block_size=4, num_units=24, eagle=True)
    out = _compare(case)
    out.assert_exact()
    assert out.cached.bridge_tokens > 0 and out.bridges("cold")


def test_warm_bridges_from_a_retained_tail() -> None:
    """interval:16 keeps window tails every 16 tokens: a prompt leaving at 88 hits the
    tail at 80 and bridges [80, 88) warm (B = 16 covers it)."""
    case = Case(GEMMA, window=5, block_size=8)
    out = _compare(case, "interval:16+recompute")
    out.assert_exact()
    warm = out.bridges("warm")
    assert warm and not out.bridges("cold")
    assert all(floor == 0 and q % 16 == 0 for q, _, floor in warm)


def test_bridges_from_zero_only() -> None:
    """A document shorter than B: every bridge starts at token 0 (nothing cold)."""
    case = Case(GEMMA, window=13, block_size=8, num_units=4)
    out = _compare(case)
    out.assert_exact()
    assert out.bridges("zero") and not out.bridges("cold")


def test_bridges_under_preemption() -> None:
    """A small pool preempts requests (bridged ones among them) and re-admits them."""
    model = HybridDecoder(ModelConfig.tiny(layer_types=GEMMA, sliding_window=9),
                          dtype=torch.float64, seed=0)
    report = run_verify(model, make_engine_workload("all", alignment_tokens=8, seed=0),
                        policies=("latest+recompute", "interval:16+recompute"),
                        settings=VerifySettings(num_blocks=40, chunk_size=24, max_running=8))
    for outcome in report.outcomes:
        assert outcome.identical, outcome.line()
        assert outcome.bridge_tokens > 0 and outcome.cold_bridges > 0
    assert sum(o.num_preemptions for o in report.outcomes) > 0
    assert sum(o.readmission_hit_tokens for o in report.outcomes) > 0


@pytest.mark.parametrize("path", ["sdpa", "flex"])
def test_fast_paths_execute_bridges(path: str) -> None:
    """SDPA and flex's block-sparse masks (unfused on the CPU) honour the window floor."""
    attention: AttentionFn = sdpa_attention if path == "sdpa" else \
        FlexAttention(min_tokens=16, block=16, compile=False)
    case = Case(GEMMA, window=13, block_size=8, chunk_size=32)
    out = _compare(case, attention=attention)
    out.assert_exact()
    assert out.bridges("cold")


@pytest.mark.parametrize(("num_q", "q_start", "floor"), [(40, 50, 45), (64, 100, 96),
                                                          (20, 30, 30)])
def test_flex_reads_only_keys_above_the_floor(num_q: int, q_start: int, floor: int) -> None:
    rule = AttentionRule("sliding_attention", window=24)
    kv_start = max(rule.first_key(q_start), floor)
    gen = torch.Generator().manual_seed(num_q)
    num_kv = q_start + num_q - kv_start
    case = {"q": torch.randn(num_q, 4, 8, generator=gen, dtype=torch.float64),
            "k": torch.randn(num_kv, 2, 8, generator=gen, dtype=torch.float64),
            "v": torch.randn(num_kv, 2, 8, generator=gen, dtype=torch.float64),
            "q_start": q_start, "kv_start": kv_start, "rule": rule, "scale": 0.37}
    expected = reference_attention(**case)
    flex = FlexAttention(min_tokens=16, block=16, compile=False)
    torch.testing.assert_close(flex(**case), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(sdpa_attention(**case), expected, rtol=0, atol=1e-12)


def test_chunk_spans() -> None:
    plan = PrefillPlan(24, 16)
    full, window = AttentionRule("full_attention"), AttentionRule("sliding_attention", window=5)
    assert bridge_module.chunk_span(full, 16, 20, plan) == bridge_module.ChunkSpan(0, 20, 20)
    assert bridge_module.chunk_span(full, 20, 28, plan) == bridge_module.ChunkSpan(0, 24, 28)
    assert bridge_module.chunk_span(window, 16, 20, plan) == bridge_module.ChunkSpan(16, 16, 20)
    assert bridge_module.chunk_span(window, 22, 26, plan) == bridge_module.ChunkSpan(18, 22, 26)
    no_bridge = bridge_module.NO_BRIDGE
    assert bridge_module.chunk_span(window, 16, 20, no_bridge).read_start == 12
    with pytest.raises(InvariantViolation, match="below the cached 24"):
        bridge_module.check_span(bridge_module.ChunkSpan(0, 16, 20), full, plan, req_id="r",
                                 group_id=0)


# ---------------------------------------------------------------- broken bridges
CASE = Case(GEMMA, window=5, block_size=8)


def _ignore_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    def first_key(rule: AttentionRule, start: int, plan: object) -> int:
        del plan
        return rule.first_key(start)

    monkeypatch.setattr(bridge_module, "window_read_start", first_key)


def _write_below_cached_end(monkeypatch: pytest.MonkeyPatch) -> None:
    def from_start(start: int, end: int, plan: object) -> int:
        del end, plan
        return start

    monkeypatch.setattr(bridge_module, "full_attention_write_start", from_start)


def _assert_diverged(out: Outcome) -> None:
    assert out.errors, "the broken bridge went unnoticed"
    assert out.max_logit_diff > 1e-6


def test_attending_below_the_floor_hits_the_safety_net(monkeypatch: pytest.MonkeyPatch,
                                                       ) -> None:
    _ignore_floor(monkeypatch)
    with pytest.raises(InvariantViolation, match="null block 0"):
        _compare(CASE)


def test_attending_below_the_floor_reads_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the safety net off too, the null block's never-written page (NaN) reaches the
    logits: the comparison catches it."""
    _ignore_floor(monkeypatch)
    monkeypatch.setattr(PagedKVCache, "_raise_bad_block", lambda *args: None)
    out = _compare(CASE)
    _assert_diverged(out)
    assert math.isinf(out.max_logit_diff)  # NaN logits count as an infinite difference


def test_overwriting_cached_full_attention_kv_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                         ) -> None:
    _write_below_cached_end(monkeypatch)
    with pytest.raises(InvariantViolation, match="would write K/V at position"):
        _compare(CASE)


def test_overwriting_cached_full_attention_kv_diverges(monkeypatch: pytest.MonkeyPatch,
                                                       ) -> None:
    """Guard off: recomputed (inexact) K/V lands in shared cached blocks."""
    _write_below_cached_end(monkeypatch)
    monkeypatch.setattr(runner_module, "check_span", lambda *a, **k: None)
    _assert_diverged(_compare(CASE))


def _shrink_bridge(monkeypatch: pytest.MonkeyPatch, by: Callable[[int, int], int]) -> None:
    real = coordinator_module._bridge_tokens

    def shorter(config: object) -> int | None:
        tokens = real(config)  # type: ignore[arg-type]
        return None if tokens is None else by(tokens, config.alignment_tokens)  # type: ignore[attr-defined]

    monkeypatch.setattr(coordinator_module, "_bridge_tokens", shorter)


@pytest.mark.usefixtures("pure_python")
def test_bridge_one_alignment_short_diverges(monkeypatch: pytest.MonkeyPatch) -> None:
    """B - A < sum (w - 1): the first keys of the last windows before F are inexact."""
    _shrink_bridge(monkeypatch, lambda b, a: b - a)
    out = _compare(Case(GEMMA, window=13, block_size=8))
    assert out.bridges("cold")
    _assert_diverged(out)


@pytest.mark.usefixtures("pure_python")
def test_bridge_formula_is_tight_to_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block size 1 (no rounding): B = 3 x (5 - 1) = 12 is exact, 11 diverges."""
    case = Case(GEMMA, window=5, block_size=1, num_units=48, chunk_size=32)
    exact = _compare(case)
    exact.assert_exact()
    assert exact.bridges("cold")
    _shrink_bridge(monkeypatch, lambda b, a: b - 1)
    _assert_diverged(_compare(case))


def test_manager_plan_matches_the_engine_view() -> None:
    """The runner records the manager's plan at admission (what the engine executed)."""
    out = _compare(CASE)
    manager = KVCacheManager(cache_config_for_model(CASE.config, num_blocks=10, block_size=8,
                                                    dtype_bytes=8), "latest+recompute")
    assert manager.coordinator.bridge_tokens == CASE.bridge_tokens == 16
    assert sum(f - q for q, f, _ in out.admissions() if f > q) == out.cached.bridge_tokens


def test_verify_cli_runs_and_reports_bridges(capsys: pytest.CaptureFixture[str]) -> None:
    assert {"latest+recompute", "interval:32+recompute"} <= set(DEFAULT_POLICIES)
    parser = argparse.ArgumentParser()
    add_verify_arguments(parser)
    argv = ["--workload", "bridges", "--policy", "latest,latest+recompute", "--eagle"]
    assert cmd_verify(parser.parse_args(argv)) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert "bridges    0 tok (0 cold)" in lines["latest"]
    for label in ("latest+recompute", "latest+recompute+eagle"):
        assert lines[label].endswith("identical")
        assert " 0 tok" not in lines[label] and "(0 cold)" not in lines[label]
