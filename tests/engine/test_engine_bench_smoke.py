"""``bench/engine_ttft.py --quick`` runs on the CPU (tiny model, tiny WEKA-format trace), and so
does ``bench/bridge_ttft.py --quick``."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def _write_trace(directory: Path) -> None:
    """One conversation of three turns, each re-sending the previous prompt."""
    requests, ids = [], list(range(1, 500))
    for turn in range(3):
        num_blocks = 470 + 10 * turn
        requests.append({"t": turn, "type": "n", "in": num_blocks * 64 + 5, "out": 3,
                         "hash_ids": ids[:num_blocks]})
    data = {"id": "trace_9999", "block_size": 64, "hash_id_scope": "local",
            "requests": requests}
    with gzip.open(directory / "trace_9999.json.gz", "wt") as handle:
        json.dump(data, handle)


def test_quick_bench_runs_on_cpu(tmp_path: Path) -> None:
    traces, out = tmp_path / "traces", tmp_path / "out"
    traces.mkdir()
    _write_trace(traces)
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "engine_ttft.py"), "--quick", "--cpu", "--no-hf",
         "--trace-dir", str(traces), "--conversations", "1", "--policies", "latest,dense",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:]
    results = json.loads((out / "engine_ttft.json").read_text())
    assert [row["tokens"] for row in results["prefill"]] == [256, 512]
    replay = {row["policy"]: row for row in results["replay"]}
    assert set(replay) == {"caching off", "latest", "dense"}
    assert replay["caching off"]["hit_rate"] == 0.0
    assert replay["latest"]["hit_tokens"] > 0
    assert (out / "engine_ttft.md").read_text().startswith("Device: ")


def test_quick_bridge_bench_runs_on_cpu(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bridge_ttft.py"), "--quick", "--cpu",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:] + completed.stdout[-2000:]
    rows = {row["label"]: row for row in
            json.loads((tmp_path / "bridge_ttft.json").read_text())["rows"]}
    assert rows["latest"]["hit_tokens"] == 0
    bridged = rows["latest+recompute"]
    assert bridged["bridge_tokens"] == 240 and bridged["window_floor_tokens"] > 0
    assert "same token" in bridged["logits_vs_off"]
    assert (tmp_path / "bridge_ttft.md").read_text().startswith("Device: ")


def test_quick_admission_bench_runs_on_cpu(tmp_path: Path) -> None:
    """Four conversations of three turns, two running at once in a small pool: ``warm``
    keeps following turns of a resident conversation, fcfs interleaves them."""
    traces, out = tmp_path / "traces", tmp_path / "out"
    traces.mkdir()
    for conv in range(4):
        ids = [1000 * (conv + 1) + i for i in range(20)]
        requests = [{"t": 10 * turn + conv, "type": "n", "in": (8 + 2 * turn) * 64 + 5,
                     "out": 3, "hash_ids": ids[: 8 + 2 * turn]} for turn in range(3)]
        data = {"id": f"trace_{conv:04d}", "block_size": 64, "hash_id_scope": "local",
                "requests": requests}
        with gzip.open(traces / f"trace_{conv:04d}.json.gz", "wt") as handle:
            json.dump(data, handle)
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "admission_ttft.py"), "--quick", "--cpu",
         "--trace-dir", str(traces), "--admission", "fcfs,warm", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:] + completed.stdout[-2000:]
    rows = {row["order"]: row for row in
            json.loads((out / "admission_ttft.json").read_text())["rows"]}
    assert set(rows) == {"fcfs", "warm"}
    assert all(row["admissions_match_scheduler"] for row in rows.values())
    assert all(row["requests"] == 12 and row["ttft_p99_s"] >= row["ttft_p50_s"] > 0
               for row in rows.values())
    assert rows["warm"]["hit_tokens"] > rows["fcfs"]["hit_tokens"]
