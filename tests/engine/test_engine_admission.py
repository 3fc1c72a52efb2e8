"""The engine admits through the shared scheduler's admission order (issue 18).

An ``EngineRunner`` with ``RunOptions(admission=...)`` must make exactly the admissions a
bare ``Scheduler`` over the same manager makes with that order (same steps, same hits),
the cache-aware order must change them on a workload that needs it, and the records carry
the waiting the order causes (eligibility → first token).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from hybridkv import KVCacheManager
from hybridkv.config import CacheConfig
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, cache_config_for_model, gemma3_pattern
from hybridkv.engine.runner import (
    Admissions,
    EngineRunner,
    RunOptions,
    RunResult,
    scheduler_admissions,
)
from hybridkv.sched.scheduler import SchedRequest, Scheduler

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

BLOCK = 8


def _conversations(num_sessions: int = 4, num_turns: int = 3,
                   seed: int = 3) -> list[SchedRequest]:
    """Sessions whose turn ``t`` resends turn ``t - 1``'s prompt plus new tokens, queued
    turn by turn across sessions (``s0t0, s1t0, …, s0t1, …``), as a trace interleaves
    conversations."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1 << 40) for _ in range(40 + 8 * s)] for s in range(num_sessions)]
    requests = []
    for turn in range(num_turns):
        for s in range(num_sessions):
            requests.append(SchedRequest(f"s{s}t{turn}", list(prompts[s]), 2,
                                         session_id=f"s{s}"))
            prompts[s] = prompts[s] + [rng.randrange(1 << 40) for _ in range(12)]
    return requests


def _setup(num_blocks: int) -> tuple[HybridDecoder, CacheConfig]:
    config = ModelConfig.tiny(layer_types=gemma3_pattern(4, period=4), sliding_window=12)
    model = HybridDecoder(config, dtype=torch.float64, seed=0)
    cache = cache_config_for_model(config, num_blocks=num_blocks, block_size=BLOCK,
                                   dtype_bytes=8, max_num_batched_tokens=32)
    return model, cache


def _engine(admission: str, num_blocks: int = 40) -> tuple[RunResult, CacheConfig]:
    model, cache = _setup(num_blocks)
    options = RunOptions(policy="latest", chunk_size=32, max_running=2, record_logits=False,
                         admission=admission)
    return EngineRunner(model, cache, options).run(_conversations()), cache


def _scheduler_only(cache: CacheConfig, admission: str,
                    outputs: dict[str, Sequence[int]]) -> Admissions:
    """The same requests through a bare ``Scheduler`` (no model), sampling the tokens the
    engine sampled."""
    scheduler = Scheduler(KVCacheManager(cache, "latest"), max_running=2, chunk_size=32,
                          admission=admission)
    for request in _conversations():
        scheduler.add_request(request)
    return scheduler_admissions(scheduler, outputs)


@pytest.mark.parametrize("admission", ["fcfs", "hit", "warm", "session"])
def test_engine_admits_as_the_shared_scheduler(admission: str) -> None:
    result, cache = _engine(admission)
    outputs = {rid: r.output_token_ids for rid, r in result.records.items()}
    assert result.admissions() == _scheduler_only(cache, admission, outputs)


def test_a_cache_aware_order_changes_the_engine_admissions() -> None:
    fcfs, _ = _engine("fcfs")
    warm, _ = _engine("warm")
    order = {name: sorted(r.records, key=lambda rid: (r.records[rid].admitted_step or 0, rid))
             for name, r in (("fcfs", fcfs), ("warm", warm))}
    assert order["fcfs"] != order["warm"]
    assert warm.hit_tokens > fcfs.hit_tokens, (warm.hit_tokens, fcfs.hit_tokens)


def test_records_carry_the_wait_before_admission() -> None:
    result, _ = _engine("warm")
    waited = 0
    for record in result.records.values():
        assert record.eligible_step is not None and record.admitted_step is not None
        assert record.eligible_step <= record.admitted_step
        assert record.eligible_s is not None and record.admitted_s is not None
        assert record.eligible_s <= record.admitted_s
        queued, own = record.queued_ttft_s, record.ttft_s
        assert queued is not None and own is not None and queued >= own
        waited += record.admitted_step > record.eligible_step
    assert waited > 0  # two running slots, four conversations: some turns queue
