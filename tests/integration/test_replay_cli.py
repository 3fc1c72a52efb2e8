"""The replay engine and the ``hybridkv`` CLI, driven in-process on tiny inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_harness import TINY_MODEL

from hybridkv.cli import main
from hybridkv.models.shapes import load_model
from hybridkv.sim.ceiling import infinite_cache_ceiling
from hybridkv.sim.replay import ReplaySettings, replay
from hybridkv.traces.trace import Trace, TraceRequest
from hybridkv.traces.workloads import aba


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_MODEL)
    return path


def _json_without_timing(path: Path) -> dict[str, object]:
    doc = json.loads(path.read_text())
    for run in doc["runs"]:
        for key in ("manager_seconds", "hash_seconds", "wall_seconds", "scheduler_seconds"):
            run.pop(key)
    return doc


def test_aba_hit_is_hand_computed_when_the_pool_is_large(tiny_model: Path) -> None:
    # A, B, A again (256 tokens each): only A-again hits, at (256 - 1) // 16 * 16 = 240.
    config = load_model(str(tiny_model)).cache_config(1000)
    for policy in ("dense", "prepend", "latest", "interval:64"):
        result = replay(aba(prompt_tokens=256, output_tokens=2), config, policy)
        assert result.hit_tokens == 240, policy
        assert result.prompt_tokens == 3 * 256
        assert result.by_tag["A-again"].hit_tokens == 240
        assert result.by_tag["B"].hit_tokens == 0


def test_aba_b_evicts_a_when_the_pool_holds_one_prompt(tiny_model: Path) -> None:
    # 256 tokens = 16 blocks per group, 2 groups (1 full + 1 window): B's prefill needs
    # all 32 usable blocks, so every block A left in the cache is reused -> A-again misses.
    config = load_model(str(tiny_model)).cache_config(1 + 16 + 16)
    assert len(config.groups) == 2
    result = replay(aba(prompt_tokens=256, output_tokens=2), config, "dense")
    assert result.by_tag["A-again"].hit_tokens == 0


def test_ceiling_on_a_tiny_hand_checked_trace() -> None:
    # Blocks of 4 tokens, alignment 2. r0 = [1,2] (8 tokens), r1 = [1,2,3] (12 tokens):
    # r1 shares 8 tokens -> 8; r2 = [1] + 2 tokens of block 9 (6 tokens): shares 4 -> 4.
    requests = (
        TraceRequest("r0", 8, 1, block_ids=(1, 2), trace_block_size=4),
        TraceRequest("r1", 12, 1, block_ids=(1, 2, 3), trace_block_size=4),
        TraceRequest("r2", 6, 1, block_ids=(1, 9), trace_block_size=4),
    )
    ceiling = infinite_cache_ceiling(Trace("t", requests), alignment_tokens=2)
    assert (ceiling.hit_tokens, ceiling.prompt_tokens) == (12, 26)
    # an identical resend is capped at prompt - 1, floored to the alignment
    resend = (requests[0], TraceRequest("again", 8, 1, block_ids=(1, 2), trace_block_size=4))
    assert infinite_cache_ceiling(Trace("t", resend), alignment_tokens=4).hit_tokens == 4


def test_replay_is_deterministic_same_json_in_one_or_two_processes(tiny_model: Path,
                                                                  tmp_path: Path) -> None:
    outputs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        code = main(["replay", "--jobs", str(i + 1), "--workload", "agentic", "--model",
                     str(tiny_model),
                     "--num-blocks", "300", "--set", "num_sessions=3", "--set", "num_turns=3",
                     "--set", "first_prompt_tokens=200", "--set", "turn_tokens=50",
                     "--set", "output_tokens=8", "--set", "length_jitter=0.3",
                     "--policy", "dense,latest", "--json", str(out), "--quiet"])
        assert code == 0
        outputs.append(_json_without_timing(out))
    assert outputs[0] == outputs[1]
    doc = outputs[0]
    assert doc["trace"] == "agentic" and doc["model"] == "tiny-hybrid"
    assert 0 < doc["ceiling"] <= 1
    assert [run["policy"] for run in doc["runs"]] == ["dense", "latest"]
    for run in doc["runs"]:
        assert {"num_blocks", "requests", "prompt_tokens", "hit_tokens", "hit_rate",
                "preemptions"} <= set(run)
        assert run["requests"] == 9 and run["num_blocks"] == 300
        assert run["hit_rate"] == pytest.approx(run["hit_tokens"] / run["prompt_tokens"])
        assert run["hit_rate"] <= doc["ceiling"] + 1e-12


def test_microbench_json_has_fractions(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "micro.json"
    code = main(["replay", "--workload", "retention-microbench", "--model", str(tiny_model),
                 "--num-blocks", "200", "--set", "num_prompts=3", "--set", "prompt_tokens=512",
                 "--set", "output_tokens=2", "--policy", "latest", "--json", str(out),
                 "--quiet"])
    assert code == 0
    run = json.loads(out.read_text())["runs"][0]
    assert list(run["fractions"]) == [f"{f / 10:.1f}" for f in range(1, 11)]
    full = run["fractions"]["1.0"]
    # f = 1.0 replays every prompt whole: the pool of 200 blocks holds all three prompts
    # (32 full-attention blocks each), so each hits (512 - 1) // 16 * 16 = 496 tokens.
    assert full["prompt_tokens"] == 3 * 512 and full["hit_tokens"] == 3 * 496


def test_plot_sweep_and_check_trace(tiny_model: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "plot.png"
    assert main(["replay", "--workload", "aba", "--set", "prompt_tokens=128", "--model",
                 str(tiny_model), "--num-blocks", "100", "--plot", str(plot), "--quiet"]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv_path, png = tmp_path / "s.csv", tmp_path / "s.png"
    assert main(["sweep", "--workload", "aba", "--set", "prompt_tokens=128", "--model",
                 str(tiny_model), "--num-blocks", "20,100", "--policy", "dense,latest",
                 "--csv", str(csv_path), "--plot", str(png), "--quiet"]) == 0
    lines = csv_path.read_text().splitlines()
    assert lines[0].startswith("trace,model,num_blocks,kv_memory,pool_bytes,policy")
    assert len(lines) == 1 + 2 * 2
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(
        {"timestamp": i, "input_length": 1024, "output_length": 4, "hash_ids": [1, i + 2]})
        for i in range(3)) + "\n")
    capsys.readouterr()
    assert main(["check-trace", str(trace), "--model", str(tiny_model)]) == 0
    out = capsys.readouterr().out
    assert "requests     3" in out and "ceiling" in out


@pytest.mark.parametrize("argv", [
    ["replay", "--policy", "nonsense", "--quiet"],
    ["replay", "--policy", "interval:30", "--quiet"],
    ["replay", "--num-blocks", "1", "--quiet"],
    ["replay", "--trace", "/does/not/exist", "--quiet"],
    ["replay", "--model", "no-such-model", "--quiet"],
    ["replay", "--workload", "agentic", "--set", "bogus", "--quiet"],
    ["replay", "--kv-memory", "lots", "--quiet"],
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridkv replay: error:") and "\n" not in err


def test_malformed_trace_line_names_path_line_and_field(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        ) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, '
                     '"hash_ids": [1]}\n{"timestamp": 1, "output_length": 1, "hash_ids": [2]}\n')
    assert main(["replay", "--trace", str(trace), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "input_length" in err


def test_paranoid_replay_checks_invariants(tiny_model: Path) -> None:
    config = load_model(str(tiny_model)).cache_config(60)
    settings = ReplaySettings(max_running=4, chunk_size=64, check_invariants=True)
    result = replay(aba(prompt_tokens=300, output_tokens=3), config, "pin:64", settings)
    assert result.requests == 3
