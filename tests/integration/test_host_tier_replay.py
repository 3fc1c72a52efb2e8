"""The host tier in the replay (``--host-memory`` / ``--host-policy``), on hand-checked
inputs: A, B, A again where B evicts A from the GPU pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_harness import TINY_MODEL

from hybridkv.cli import main
from hybridkv.models.shapes import load_model
from hybridkv.sim.replay import ReplaySettings, replay
from hybridkv.traces.workloads import aba, make_workload

BLOCK_BYTES = 2 * 16 * 64  # 2 layers per group × 16 tokens × 64 bytes (the pool's page)


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_MODEL)
    return path


@pytest.mark.parametrize("policy", ["aware", "lru", "lru-split"])
def test_aba_again_hits_on_the_host(tiny_model: Path, policy: str) -> None:
    # 256-token prompts, 16 blocks per group, 33 blocks: B evicts A's blocks, so A-again
    # misses on the GPU (test_replay_cli). A is offered to the host at its release, when
    # its own decode has already reused window blocks 12 and 13 (16 full + 17 window
    # blocks > 32): the deepest tail left is blocks 10–11, ending at 192. A-again hits 192
    # from the host, whatever the policy.
    config = load_model(str(tiny_model)).cache_config(33)
    result = replay(aba(prompt_tokens=256, output_tokens=2), config, "dense",
                    ReplaySettings(host_memory_bytes=64 * BLOCK_BYTES, host_policy=policy,
                                   check_invariants=True))
    assert result.host is not None and result.host.policy.startswith(policy)
    assert result.host.hit_tokens == 192 and result.hit_tokens == 192
    assert result.host.hits == 1 and 0 < result.host.loaded_bytes <= 14 * BLOCK_BYTES
    assert result.misses.total == result.prompt_tokens - result.hit_tokens
    assert result.host.per_request == {"A-again": 192}


def test_a_fixed_state_share_loses_the_tail_and_keeps_dead_kv(tiny_model: Path) -> None:
    # The same run with a fifth of the host for state (13 blocks): B's window blocks push
    # A's out of the state pool, while A's chain stays in the KV pool with no tail to
    # land on — the HiCache failure (sgl-project/sglang #39436). No host hit.
    config = load_model(str(tiny_model)).cache_config(33)
    result = replay(aba(prompt_tokens=256, output_tokens=2), config, "dense",
                    ReplaySettings(host_memory_bytes=64 * BLOCK_BYTES,
                                   host_policy="lru-split:0.2", check_invariants=True))
    assert result.host is not None and result.host.hit_tokens == 0
    assert result.host.kv_bytes == 32 * BLOCK_BYTES  # A's and B's chains, 16 blocks each


def test_a_small_host_keeps_the_longest_units_that_fit(tiny_model: Path) -> None:
    # 10 blocks of host: ``dense`` leaves a tail at every 16 tokens, so a released prompt
    # offers points 16, 32, …; aware keeps the longest prefix of them that fits — points
    # up to 80: 5 full blocks + window blocks 0–4. The last release (A-again) replaced A's
    # and B's units. lru keeps 10 blocks as they come.
    config = load_model(str(tiny_model)).cache_config(33)
    for policy, held in (("aware", 10), ("lru", 10)):
        result = replay(aba(prompt_tokens=256, output_tokens=2), config, "dense",
                        ReplaySettings(host_memory_bytes=10 * BLOCK_BYTES, host_policy=policy,
                                       check_invariants=True))
        assert result.host is not None and result.host.hit_tokens == 0, policy
        assert (result.host.kv_bytes + result.host.state_bytes) // BLOCK_BYTES == held, policy
        if policy == "aware":
            assert result.host.kv_bytes == result.host.state_bytes == 5 * BLOCK_BYTES


def test_host_tier_never_lowers_the_hit_rate_and_reports(tiny_model: Path,
                                                         tmp_path: Path) -> None:
    config = load_model(str(tiny_model)).cache_config(60)
    params = {"num_sessions": 6, "num_turns": 4, "first_prompt_tokens": 128,
              "turn_tokens": 32, "output_tokens": 16}
    trace = make_workload("agentic", **params)
    base = replay(trace, config, "latest")
    out = tmp_path / "host.json"
    sets = [arg for key, value in params.items() for arg in ("--set", f"{key}={value}")]
    assert main(["replay", "--workload", "agentic", *sets, "--model", str(tiny_model),
                 "--num-blocks", "60",
                 "--policy", "latest", "--host-memory", "8x", "--json", str(out),
                 "--quiet", "--paranoid"]) == 0
    run = json.loads(out.read_text())["runs"][0]
    host = run["host"]
    assert run["hit_tokens"] >= base.hit_tokens
    assert host["host_hit_rate"] > 0 and host["hits"] == len(host["per_request_hit_tokens"])
    assert host["capacity_bytes"] == 8 * 60 * BLOCK_BYTES
    assert set(host["occupancy_bytes"]) == {"kv", "state"}
    assert sum(run["miss_tokens"].values()) + run["hit_tokens"] == run["prompt_tokens"]


@pytest.mark.parametrize("argv", [
    ["--host-memory", "lots"],
    ["--host-memory", "0x"],
    ["--host-memory", "1B"],
    ["--host-memory", "8x", "--host-policy", "mru"],
    ["--host-memory", "8x", "--host-policy", "lru-split:1.5"],
    ["--host-memory", "8x", "--host-policy", "aware:2"],
])
def test_bad_host_input_is_one_line_and_exit_2(argv: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--workload", "aba", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridkv replay: error: --host-") and "\n" not in err
