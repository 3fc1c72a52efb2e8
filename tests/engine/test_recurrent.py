"""Gated DeltaNet layers: the chunked path against the float64 reference, checkpoints
resuming exactly, hits identical to recomputation, and wrong checkpoints caught."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from hybridkv import InvariantViolation, KVCacheManager
from hybridkv.cli import main
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, cache_config_for_model, qwen3_next_pattern
from hybridkv.engine.synthetic import make_engine_workload
from hybridkv.engine.verify import (
    PATTERNS,
    VerifyReport,
    VerifySettings,
    run_verify,
    trace_workload,
)
from hybridkv.errors import ConfigError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

from hybridkv.engine.checkpoints import PagedStateCache  # noqa: E402
from hybridkv.engine.recurrent import (  # noqa: E402
    Chunking,
    RecurrentState,
    causal_conv,
    chunk_loop,
    gated_delta_chunked,
    gated_delta_reference,
    random_inputs,
)

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
    report = _verify(_model(), policies=("latest",), recurrence=chunked, num_blocks=20,
                     chunk_size=24)
    report.raise_on_divergence()
    assert report.outcomes[0].num_preemptions > 0
    assert report.outcomes[0].readmission_hit_tokens > 0


# ------------------------------------------------------------------ sabotage
# Each test corrupts only the checkpoint a prefix hit resumes from (the manager's table
# entry at index hit / bs - 1 of a recurrent group, or what that block holds), so requests
# without a hit run correctly and the damage reaches the outputs only through the hit.
class Tables:
    """Recurrent-group table entries seen so far (block → table index), and the hit of
    each request's latest admission."""

    def __init__(self) -> None:
        self.index_of: dict[int, int] = {}
        self.hits: dict[str, int] = {}


@pytest.fixture
def tables(monkeypatch: pytest.MonkeyPatch, pure_python: None) -> Iterator[Tables]:
    log = Tables()
    original = KVCacheManager.find_longest_hit

    def find_longest_hit(self: KVCacheManager, req_id: str,
                         max_num_tokens: int | None = None):  # type: ignore[no-untyped-def]
        hit = original(self, req_id, max_num_tokens)
        log.hits[req_id] = hit.num_tokens if self.config.enable_caching else 0
        return hit

    monkeypatch.setattr(KVCacheManager, "find_longest_hit", find_longest_hit)
    yield log


def _recurrent_groups(model: HybridDecoder) -> list[int]:
    config = cache_config_for_model(model.config, num_blocks=10, block_size=BLOCK,
                                    dtype_bytes=8)
    return [g.group_id for g in config.groups
            if model.config.layer_types[g.layer_ids[0]] == "linear_attention"]


Edit = Callable[[list[int], int, Tables], None]
"""Edits a recurrent group's table in place, given the hit checkpoint's index."""


def _corrupt_hit_checkpoint(monkeypatch: pytest.MonkeyPatch, log: Tables, group_id: int,
                            edit: Edit) -> None:
    original = KVCacheManager.get_block_ids

    def get_block_ids(self: KVCacheManager, req_id: str) -> tuple[tuple[int, ...], ...]:
        tables = [list(t) for t in original(self, req_id)]
        hit = log.hits.get(req_id, 0)
        index = hit // BLOCK - 1
        if hit >= BLOCK and index < len(tables[group_id]) and tables[group_id][index]:
            edit(tables[group_id], index, log)
        for i, block in enumerate(tables[group_id]):
            if block:
                log.index_of.setdefault(block, i)
        return tuple(tuple(t) for t in tables)

    monkeypatch.setattr(KVCacheManager, "get_block_ids", get_block_ids)


def test_checkpoint_of_another_position_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                  tables: Tables) -> None:
    model = _model()
    group = _recurrent_groups(model)[0]

    def other_position(table: list[int], index: int, log: Tables) -> None:
        others = [b for b, i in log.index_of.items() if i != index]
        if others:
            table[index] = max(others, key=lambda b: log.index_of[b])

    _corrupt_hit_checkpoint(monkeypatch, tables, group, other_position)
    report = _verify(model, policies=("dense",))
    assert not report.ok
    assert report.outcomes[0].max_logit_diff > 1e-6


def test_never_written_checkpoint_is_caught(monkeypatch: pytest.MonkeyPatch,
                                            tables: Tables) -> None:
    model = _model()
    group = _recurrent_groups(model)[-1]

    def fresh_block(table: list[int], index: int, log: Tables) -> None:
        table[index] = max(set(range(1, 256)) - set(log.index_of) - set(table))

    _corrupt_hit_checkpoint(monkeypatch, tables, group, fresh_block)
    report = _verify(model, policies=("dense",))
    assert not report.ok
    assert report.outcomes[0].max_logit_diff == float("inf")   # NaN pages were read


def test_checkpoint_in_a_null_block_is_refused(monkeypatch: pytest.MonkeyPatch,
                                               tables: Tables) -> None:
    model = _model()
    group = _recurrent_groups(model)[-1]

    def drop(table: list[int], index: int, log: Tables) -> None:
        table[index] = 0

    _corrupt_hit_checkpoint(monkeypatch, tables, group, drop)
    with pytest.raises(InvariantViolation, match="null block 0"):
        _verify(model, policies=("dense",))


def test_stale_checkpoint_is_caught(monkeypatch: pytest.MonkeyPatch, tables: Tables) -> None:
    """A hit's checkpoint block still holding what it held before its last write (an
    earlier state of the same block, or a previous owner's) must diverge."""
    model = _model()
    group = _recurrent_groups(model)[0]
    previous: dict[tuple[int, int], RecurrentState] = {}
    stale_blocks: set[int] = set()
    stale_reads: list[bool] = []
    write, read = PagedStateCache.write, PagedStateCache.read

    def keeping_write(self: PagedStateCache, layer_id: int, block_id: int,
                      state: RecurrentState) -> None:
        previous[layer_id, block_id] = read(self, layer_id, block_id)
        write(self, layer_id, block_id, state)

    def stale_read(self: PagedStateCache, layer_id: int, block_id: int) -> RecurrentState:
        if block_id in stale_blocks and self.group_of(layer_id) == group:
            old = previous[layer_id, block_id]
            stale_reads.append(not bool(torch.isnan(old.ssm).any()))
            return old
        return read(self, layer_id, block_id)

    def mark(table: list[int], index: int, log: Tables) -> None:
        stale_blocks.add(table[index])

    monkeypatch.setattr(PagedStateCache, "write", keeping_write)
    monkeypatch.setattr(PagedStateCache, "read", stale_read)
    _corrupt_hit_checkpoint(monkeypatch, tables, group, mark)
    report = _verify(model, policies=("dense", "latest"), workload="all", num_blocks=48)
    assert all(not outcome.identical for outcome in report.outcomes)
    assert any(stale_reads), "no hit read an earlier real state (only never-written pages)"


# ------------------------------------------------------------------ verify --trace
def _mooncake_trace(path: Path) -> Path:
    """Three conversations of growing prompts over shared 512-token blocks, plus a lone
    request: later turns share every block of the earlier ones."""
    rows = []
    for conv in range(3):
        base = [100 * conv + i for i in range(8)]
        for turn in range(3):
            blocks = base + [100 * conv + 10 + j for j in range(turn * 2)]
            rows.append({"timestamp": len(rows), "input_length": 512 * len(blocks) - 7,
                         "output_length": 2, "hash_ids": blocks})
    rows.append({"timestamp": 99, "input_length": 300, "output_length": 1, "hash_ids": [999]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verify_trace_slice_every_pattern(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    trace = _mooncake_trace(tmp_path / "trace.jsonl")
    code = main(["verify", "--trace", str(trace), "--limit", "9", "--pattern", "all",
                 "--policy", "dense,latest", "--trace-max-tokens", "96"])
    out = capsys.readouterr().out
    assert code == 0, out
    headers = [line for line in out.splitlines() if line.startswith("verify: trace")]
    assert [h.split(" pattern ")[1].split()[0] for h in headers] == list(PATTERNS)
    assert "first 9 requests" in headers[0]
    hits = [int(line.split("hits")[1].split("/")[0]) for line in out.splitlines()
            if line.startswith(("dense", "latest"))]
    assert len(hits) == 2 * len(PATTERNS) and all(h > 0 for h in hits), out
    *_, verdict, core = out.rstrip().splitlines()  # the report's last line: which core ran
    assert verdict == "all identical" and core.startswith("core: "), out[-300:]


def test_verify_trace_bad_input_is_one_line(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    with pytest.raises(SystemExit) as exit_info:   # rejected by the argument parser
        main(["verify", "--trace", str(_mooncake_trace(tmp_path / "t.jsonl")), "--limit", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "missing.jsonl" in err[0] and "limit" in err[1]


def test_trace_workload_keeps_prefix_sharing(tmp_path: Path) -> None:
    requests, stride = trace_workload(str(_mooncake_trace(tmp_path / "t.jsonl")), limit=10,
                                      max_prompt_tokens=40)
    assert stride > 1 and all(len(r.prompt_token_ids) <= 40 for r in requests)
    first, second = requests[0].prompt_token_ids, requests[1].prompt_token_ids
    assert second[:len(first)] == first                 # turn 2 extends turn 1
    assert requests[3].prompt_token_ids[:4] != first[:4]   # another conversation


def test_quick_recurrent_bench_runs_on_cpu(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    completed = subprocess.run(
        [sys.executable, str(root / "bench" / "recurrent_ttft.py"), "--quick", "--cpu",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=root, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:] + completed.stdout[-2000:]
    results = json.loads((tmp_path / "recurrent_ttft.json").read_text())
    accuracy = [r for r in results["kernels"] if r["section"] == "accuracy"]
    assert accuracy and all(r["rel_err_out"] < 1e-5 for r in accuracy)
    off, hit = results["ttft"]
    assert off["hit_tokens"] == 0 and hit["hit_tokens"] > 0
    assert "same token" in hit["logits_vs_recompute"]
