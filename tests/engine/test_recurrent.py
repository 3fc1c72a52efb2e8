"""Gated DeltaNet layers: the chunked path against the float64 reference, checkpoints
resuming exactly, hits identical to recomputation, and wrong checkpoints caught."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from functools import partial

import pytest

from hybridkv import InvariantViolation, KVCacheManager
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, cache_config_for_model, qwen3_next_pattern
from hybridkv.engine.synthetic import make_engine_workload
from hybridkv.engine.verify import VerifyReport, VerifySettings, compare_runs, run_verify
from hybridkv.errors import ConfigError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

from hybridkv.engine import runner as runner_module  # noqa: E402
from hybridkv.engine.recurrent import (  # noqa: E402
    Chunking,
    causal_conv,
    chunk_loop,
    gated_delta_chunked,
    gated_delta_reference,
    random_inputs,
)
from hybridkv.engine.runner import EngineRunner, RunOptions  # noqa: E402

BLOCK = 8


def _inputs(seed: int, num_tokens: int, heads: int = 3, dk: int = 5, dv: int = 4,
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, b = random_inputs(num_tokens, heads, dk, dv, generator=gen)
    s0 = torch.randn(heads, dk, dv, dtype=torch.float64, generator=gen)
    return q, k, v, g, b, s0


@pytest.mark.parametrize("seed", range(6))
def test_chunked_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    num_tokens = rng.randrange(1, 90)
    chunk = rng.choice([1, 2, 4, 7, 16, 64])
    cuts = sorted(rng.sample(range(1, num_tokens), min(3, num_tokens - 1)))
    stops = [*cuts, num_tokens]
    q, k, v, g, b, s0 = _inputs(seed, num_tokens)
    o_ref, s_ref = gated_delta_reference(q, k, v, g, b, s0, stops=stops)
    o, s = gated_delta_chunked(q, k, v, g, b, s0, stops=stops, chunking=Chunking(chunk))
    assert (o - o_ref).abs().max() < 1e-12
    assert len(s) == len(s_ref) == len(stops)
    for got, ref in zip(s, s_ref, strict=True):
        assert (got - ref).abs().max() < 1e-12


@pytest.mark.parametrize(("stops", "chunk", "calls"), [
    ([8, 16, 24, 29], 8, [[1, 2, 3, 4]]),    # block ends a chunk multiple: one pass
    ([3, 11, 19, 20], 8, [[1], [1, 2, 3]]),  # an unaligned stop starts a new segment
    ([6, 16, 32], 4, [[2], [3], [4]]),
])
def test_chunk_aligned_checkpoints_in_one_pass(stops: list[int], chunk: int,
                                               calls: list[list[int]]) -> None:
    """Stops a whole number of chunks into a segment are saved inside one hand-over."""
    q, k, v, g, b, s0 = _inputs(11, stops[-1])
    seen: list[list[int]] = []

    def counting(chunks, state, saves):  # type: ignore[no-untyped-def]
        seen.append(list(saves))
        return chunk_loop(chunks, state, saves)

    o_ref, s_ref = gated_delta_reference(q, k, v, g, b, s0, stops=stops)
    o, s = gated_delta_chunked(q, k, v, g, b, s0, stops=stops,
                               chunking=Chunking(chunk, counting))
    assert (o - o_ref).abs().max() < 1e-12
    assert all((x - y).abs().max() < 1e-12 for x, y in zip(s, s_ref, strict=True))
    assert seen == calls


def test_chunked_float32_is_close_and_a_wrong_state_is_not() -> None:
    q, k, v, g, b, s0 = _inputs(7, 200)
    o_ref, _ = gated_delta_reference(q, k, v, g, b, s0, stops=[200])
    args = [x.float() for x in (q, k, v, g, b)]
    o32, _ = gated_delta_chunked(*args, s0.float(), stops=[200])
    rel = float((o32.double() - o_ref).norm() / o_ref.norm())
    assert rel < 1e-5
    o_bad, _ = gated_delta_chunked(q, k, v, g, b, s0 * 0.99, stops=[200])
    assert float((o_bad - o_ref).norm() / o_ref.norm()) > 1e-4


def test_resuming_from_a_checkpoint_is_exact() -> None:
    """Outputs after a cut, resumed from the states at the cut, equal one pass."""
    q, k, v, g, b, s0 = _inputs(3, 50)
    conv_in = torch.randn(50, 6, dtype=torch.float64)
    weight = torch.randn(6, 4, dtype=torch.float64)
    y_all, conv_states = causal_conv(conv_in, torch.zeros(3, 6, dtype=torch.float64), weight,
                                     stops=[21, 50])
    o_all, states = gated_delta_reference(q, k, v, g, b, s0, stops=[21, 50])
    y_tail, _ = causal_conv(conv_in[21:], conv_states[0], weight, stops=[29])
    o_tail, tail_states = gated_delta_chunked(q[21:], k[21:], v[21:], g[21:], b[21:],
                                              states[0], stops=[29], chunking=Chunking(8))
    assert torch.equal(y_tail, y_all[21:])
    assert (o_tail - o_all[21:]).abs().max() < 1e-12
    assert (tail_states[0] - states[1]).abs().max() < 1e-12
    # the state of another position does not resume correctly
    o_wrong, _ = gated_delta_reference(q[21:], k[21:], v[21:], g[21:], b[21:], states[1],
                                       stops=[29])
    assert (o_wrong - o_all[21:]).abs().max() > 1e-3


def test_bad_stops_are_refused() -> None:
    q, k, v, g, b, s0 = _inputs(0, 5)
    for stops in ([], [3], [0, 5], [3, 3, 5], [6]):
        with pytest.raises(ConfigError):
            gated_delta_reference(q, k, v, g, b, s0, stops=stops)


# ------------------------------------------------------------------ the engine
def _model(pattern: tuple[str, ...] | None = None, seed: int = 1) -> HybridDecoder:
    kinds = pattern or qwen3_next_pattern(4)
    config = ModelConfig.tiny(layer_types=kinds, sliding_window=11)  # type: ignore[arg-type]
    return HybridDecoder(config, dtype=torch.float64, seed=seed)


def _verify(model: HybridDecoder, *, policies: tuple[str, ...] = ("dense", "latest"),
            workload: str = "mixed", recurrence: object = None, **settings: int,
            ) -> VerifyReport:
    requests = make_engine_workload(workload, alignment_tokens=BLOCK, seed=1)
    return run_verify(model, requests, policies=policies,
                      settings=VerifySettings(block_size=BLOCK, **settings),
                      recurrence=recurrence)  # type: ignore[arg-type]


@pytest.mark.parametrize("pattern", [
    qwen3_next_pattern(4),
    ("linear_attention", "sliding_attention", "full_attention", "linear_attention"),
])
def test_hits_with_checkpoints_are_identical(pattern: tuple[str, ...]) -> None:
    report = _verify(_model(pattern), policies=("dense", "latest", "interval:16", "pin:32"))
    report.raise_on_divergence()
    for outcome in report.outcomes:
        assert outcome.hit_tokens > 100, outcome.line()
        assert outcome.max_logit_diff < 1e-12


def test_chunked_recurrence_with_preemption_is_identical() -> None:
    chunked = partial(gated_delta_chunked, chunking=Chunking(4))
    report = _verify(_model(), policies=("latest",), recurrence=chunked, num_blocks=40,
                     chunk_size=24)
    report.raise_on_divergence()
    assert report.outcomes[0].num_preemptions > 0
    assert report.outcomes[0].readmission_hit_tokens > 0


# ------------------------------------------------------------------ sabotage
@pytest.fixture
def hit_lengths(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    log: dict[str, int] = {}
    original = KVCacheManager.find_longest_hit

    def find_longest_hit(self: KVCacheManager, req_id: str,
                         max_num_tokens: int | None = None):  # type: ignore[no-untyped-def]
        hit = original(self, req_id, max_num_tokens)
        log[req_id] = hit.num_tokens
        return hit

    monkeypatch.setattr(KVCacheManager, "find_longest_hit", find_longest_hit)
    yield log


def _recurrent_groups(model: HybridDecoder) -> list[int]:
    config = cache_config_for_model(model.config, num_blocks=10, block_size=BLOCK,
                                    dtype_bytes=8)
    return [g.group_id for g in config.groups
            if model.config.layer_types[g.layer_ids[0]] == "linear_attention"]


def _corrupt_hit_checkpoint(monkeypatch: pytest.MonkeyPatch, hits: dict[str, int],
                            group_id: int, edit: Callable[[list[int], int], None]) -> None:
    """Edit the recurrent group's table of requests with a hit of >= 2 blocks, given the
    index of the hit's checkpoint."""
    original = KVCacheManager.get_block_ids

    def get_block_ids(self: KVCacheManager, req_id: str) -> tuple[tuple[int, ...], ...]:
        tables = [list(t) for t in original(self, req_id)]
        hit = hits.get(req_id, 0) if self.config.enable_caching else 0
        if hit >= 2 * BLOCK:
            edit(tables[group_id], hit // BLOCK - 1)
        return tuple(tuple(t) for t in tables)

    monkeypatch.setattr(KVCacheManager, "get_block_ids", get_block_ids)


def test_checkpoint_of_another_position_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                  hit_lengths: dict[str, int]) -> None:
    model = _model()
    group = _recurrent_groups(model)[0]

    def earlier(table: list[int], index: int) -> None:
        table[index] = table[index - 1]     # the state one block before the hit

    _corrupt_hit_checkpoint(monkeypatch, hit_lengths, group, earlier)
    report = _verify(model, policies=("dense",))
    assert not report.ok
    assert report.outcomes[0].max_logit_diff > 1e-6


def test_checkpoint_in_a_null_block_is_refused(monkeypatch: pytest.MonkeyPatch,
                                               hit_lengths: dict[str, int]) -> None:
    model = _model()
    group = _recurrent_groups(model)[-1]

    def drop(table: list[int], index: int) -> None:
        table[index] = 0

    _corrupt_hit_checkpoint(monkeypatch, hit_lengths, group, drop)
    with pytest.raises(InvariantViolation, match="null block 0"):
        _verify(model, policies=("dense",))


def _skip_block_end_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken engine that writes a checkpoint only at chunk ends: a full block that was
    not a chunk's last keeps whatever it held (stale, or NaN when poisoned)."""
    def chunk_end_only(*, start: int, end: int, block_size: int) -> list[int]:
        del start, block_size
        return [end]

    monkeypatch.setattr(runner_module, "checkpoint_stops", chunk_end_only)


def test_never_written_checkpoint_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_block_end_checkpoints(monkeypatch)
    report = _verify(_model(), policies=("dense",))
    assert not report.ok
    assert report.outcomes[0].max_logit_diff == float("inf")   # NaN pages were read


def test_stale_checkpoint_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without poison, a block reused from an earlier request still holds that request's
    state; a hit on it must diverge."""
    model = _model()
    requests = make_engine_workload("mixed", alignment_tokens=BLOCK, seed=1)

    def run(caching: bool) -> runner_module.RunResult:
        config = cache_config_for_model(model.config, num_blocks=60, block_size=BLOCK,
                                        dtype_bytes=8, enable_caching=caching,
                                        max_num_batched_tokens=32)
        options = RunOptions(policy="latest", chunk_size=32, max_running=4, poison=False)
        return EngineRunner(model, config, options).run(requests)

    baseline = run(False)
    _skip_block_end_checkpoints(monkeypatch)
    broken = run(True)
    worst, errors = compare_runs(baseline, broken, policy="latest", atol=1e-9)
    assert broken.hit_tokens > 0
    assert errors and worst > 1e-6
