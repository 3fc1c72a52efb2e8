"""The engine loop around the shared scheduler, and the model/cache configuration glue."""

from __future__ import annotations

import argparse

import pytest

from hybridkv import CapacityError, ConfigError
from hybridkv.cli.verify import add_verify_arguments, cmd_verify
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import (
    ModelConfig,
    alternating_pattern,
    cache_config_for_model,
    gemma3_pattern,
    layer_specs_for_model,
    llama4_pattern,
)
from hybridkv.engine.runner import EngineRunner, RunOptions
from hybridkv.sched.scheduler import SchedRequest
from hybridkv.specs import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine


def test_layer_patterns() -> None:
    assert gemma3_pattern(12).count("full_attention") == 2
    assert gemma3_pattern(12)[5] == "full_attention"
    assert alternating_pattern(4) == ("sliding_attention", "full_attention") * 2
    assert llama4_pattern(8).count("chunked_attention") == 6


def test_cache_specs_match_layers() -> None:
    config = ModelConfig.tiny(layer_types=("sliding_attention", "chunked_attention",
                                           "full_attention"), sliding_window=9,
                              attention_chunk_size=16)
    specs = layer_specs_for_model(config, block_size=8, dtype_bytes=2, full_block_size=16)
    per_token = 2 * config.num_kv_heads * config.head_dim * 2
    assert specs == [SlidingWindowSpec(8, per_token, 9), ChunkedLocalSpec(8, per_token, 16),
                     FullAttentionSpec(16, per_token)]
    gemma = ModelConfig.gemma3_1b_shape()
    cache = cache_config_for_model(gemma, num_blocks=100, block_size=64, dtype_bytes=2)
    assert [len(g.layer_ids) for g in cache.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert cache.groups[0].spec == FullAttentionSpec(64, 2 * 1 * 256 * 2)


def test_model_config_validation() -> None:
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig.tiny(num_kv_heads=3)
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig.tiny(sliding_window=None)
    with pytest.raises(ConfigError, match="attention_chunk_size"):
        ModelConfig.tiny(layer_types=("chunked_attention",))
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.tiny(layer_types=("global",))  # type: ignore[arg-type]


def _runner(num_blocks: int = 200, **options: object) -> EngineRunner:
    config = ModelConfig.tiny(sliding_window=6)
    model = HybridDecoder(config, seed=0)
    cache_config = cache_config_for_model(config, num_blocks=num_blocks, block_size=4,
                                          dtype_bytes=8, max_num_batched_tokens=64)
    return EngineRunner(model, cache_config, RunOptions(chunk_size=64, **options))  # type: ignore[arg-type]


def test_same_step_admission_hits_blocks_written_earlier_in_the_step() -> None:
    """Two identical prompts admitted in one step: the second hits the blocks the first is
    computing in that very step, and reads them after they are written."""
    prompt = list(range(100, 130))
    runner = _runner(max_running=2)
    result = runner.run([SchedRequest("a", prompt, 2), SchedRequest("b", prompt, 2)])
    a, b = result.records["a"], result.records["b"]
    assert b.hit_tokens == [28] and a.hit_tokens == [0]
    assert a.admitted_s == b.admitted_s  # same step
    assert a.output_token_ids == b.output_token_ids
    torch.testing.assert_close(a.sampled_logits[0], b.sampled_logits[0], rtol=0, atol=1e-12)


def test_records_ttft_outputs_and_counters() -> None:
    runner = _runner(record_logits=False)
    result = runner.run([SchedRequest("a", list(range(50)), 3)])
    record = result.records["a"]
    assert len(record.output_token_ids) == 3 and record.sampled_logits == []
    assert record.ttft_s is not None and 0 < record.ttft_s <= result.wall_s
    assert result.computed_tokens == 50 + 2  # the last sampled token is never computed
    assert result.prompt_tokens == 50 and result.num_steps == 3


def test_pool_too_small_for_any_request_raises() -> None:
    with pytest.raises(CapacityError, match="num_blocks"):
        _runner(num_blocks=5).run([SchedRequest("a", list(range(200)), 1)])


def test_kv_cache_must_match_the_cache_config() -> None:
    runner = _runner()
    other = _runner(num_blocks=300)
    with pytest.raises(ConfigError, match=r"kv_cache.*PagedKVCache.*pool size"):
        EngineRunner(runner.model, other.cache_config, kv_cache=runner.kv_cache)
    with pytest.raises(ConfigError, match=r"state_cache.*PagedStateCache.*pool size"):
        EngineRunner(runner.model, other.cache_config, state_cache=runner.state_cache)
    EngineRunner(runner.model, runner.cache_config, kv_cache=runner.kv_cache,
                 state_cache=runner.state_cache)  # the pages' own config: accepted


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_verify_arguments(parser)
    return cmd_verify(parser.parse_args(list(argv)))


def test_verify_cli_reports_each_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("--workload", "boundaries", "--policy", "latest,dense", "--eagle") == 0
    lines = capsys.readouterr().out.splitlines()
    policy_lines = [line for line in lines if line.split()[0] in
                    ("latest", "dense", "latest+eagle", "dense+eagle")]
    assert len(policy_lines) == 4 and all(line.endswith("identical") for line in policy_lines)
    assert lines[-1] == "all identical"


@pytest.mark.usefixtures("pure_python")
def test_verify_cli_exits_1_on_divergence(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv import KVCacheManager

    original = KVCacheManager.get_block_ids

    def broken(self: KVCacheManager, req_id: str) -> tuple[tuple[int, ...], ...]:
        tables = original(self, req_id)
        full = list(tables[0])
        if self.config.enable_caching and len(full) > 2 and full[0] != full[1]:
            full[1] = full[0]  # reads block 0's keys twice, misses block 1's
        return (tuple(full), *tables[1:])

    monkeypatch.setattr(KVCacheManager, "get_block_ids", broken)
    assert _cli("--workload", "boundaries", "--policy", "latest") == 1
    out = capsys.readouterr().out
    assert "DIVERGED" in out and "request=" in out and "position" in out


def test_engine_publishes_events_and_metrics() -> None:
    """The reference engine's KV events rebuild its pool index exactly, and its metrics
    equal the manager's counters (issue 17)."""
    from hybridkv.events import AllBlocksCleared, BlockRemoved, KVEvent, external_hash
    from hybridkv.events.replica import ResidentReplica
    from hybridkv.sim.metrics import CacheMetrics, ReplayMetrics
    from hybridkv.sim.observe import KVEventStream

    published: list[KVEvent] = []

    class Capture:
        def publish(self, events: list[KVEvent]) -> None:
            published.extend(events)

    metrics = CacheMetrics(model_name="tiny")
    stream = KVEventStream(Capture())  # type: ignore[arg-type]
    runner = _runner(num_blocks=80, record_logits=False, policy="prepend",
                     observers=(stream, ReplayMetrics(metrics)))
    prompt = list(range(100, 140))
    result = runner.run([SchedRequest("a", prompt, 2), SchedRequest("b", prompt + [7] * 30, 2),
                         SchedRequest("c", list(range(300, 360)), 2)])
    assert runner.manager is not None
    replica = ResidentReplica()
    replica.apply_all(published)
    truth: dict[int, dict[int | bytes, int]] = {}
    for block in runner.manager.pool.blocks:
        if block.block_hash is not None and block.hash_group_id is not None:
            group = truth.setdefault(block.hash_group_id, {})
            key = external_hash(block.block_hash)
            group[key] = group.get(key, 0) + 1
    assert {g: r for g, r in replica.resident.items() if r} == truth and truth
    assert AllBlocksCleared() not in published
    assert any(isinstance(e, BlockRemoved) for e in published)  # c evicted cached blocks
    assert metrics.value("hybridkv:prefix_cache_queries_total", policy="prepend") == \
        result.prompt_tokens
    assert metrics.value("hybridkv:prefix_cache_hits_total", policy="prepend") == \
        result.total_hit_tokens > 0
