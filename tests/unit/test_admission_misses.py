"""``bench/admission_misses.py``: the per-request miss causes it buckets by waiting add up
to the replay's own miss causes and prompt tokens."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

import hybridkv.sim.misses
from hybridkv import native

BENCH = Path(__file__).resolve().parents[2] / "bench" / "admission_misses.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("admission_misses", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(native.is_compiled(hybridkv.sim.misses),
                    reason="the bench observes pure-Python classes")
@pytest.mark.parametrize("order", ["fcfs", "warm"])
def test_buckets_partition_the_replays_misses(tmp_path: Path, order: str) -> None:
    # 12 requests over 3 shared prefixes, a pool of a few prompts: hits, evictions, waits
    trace = tmp_path / "mc.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 1536, "output_length": 2,
                    "hash_ids": [i % 3, 10 + i % 3, 20 + i]}) + "\n" for i in range(12)))
    record = _bench().run(str(trace), None, "dsv4-bench", 60, "latest", order)
    buckets = record["buckets_pct"].values()
    assert sum(b["requests"] for b in buckets) == 12
    assert sum(b["prompt"] for b in buckets) == pytest.approx(100, abs=0.01)
    assert 100 * record["hit_rate"] == pytest.approx(sum(b["hit"] for b in buckets), abs=0.01)
    for cause, share in record["misses_pct"].items():
        assert share == pytest.approx(sum(b[cause] for b in buckets), abs=0.01)
    for b in buckets:  # hit + every cause = the bucket's prompt tokens
        assert b["prompt"] == pytest.approx(
            b["hit"] + sum(b[c] for c in hybridkv.sim.misses.MISS_CAUSES), abs=0.01)
    assert record["hit_rate"] > 0 and record["misses_pct"]["cold"] > 0
