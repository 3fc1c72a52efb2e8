"""Workload sizes are bounded by host memory before anything is built (issue 24 part 6b):
every workload has a footprint that never underestimates what its trace holds (measured
with ``tracemalloc``), and every size parameter of every workload, set too large, is one
``ConfigError`` naming that parameter and a value that fits, raised before allocating."""

from __future__ import annotations

import gc
import inspect
import tracemalloc
from collections.abc import Callable

import pytest

from hybridkv.cli import main
from hybridkv.errors import ConfigError
from hybridkv.traces import workload_limits
from hybridkv.traces.workload_limits import FOOTPRINTS, size_parameters, workload_bytes
from hybridkv.traces.workloads import (
    WORKLOADS,
    make_workload,
    retention_microbench_from_params,
    retention_microbench_scenarios,
)

SMALL: dict[str, dict[str, object]] = {
    "retention-microbench": {"num_prompts": 3, "prompt_tokens": 20_000},
    "agentic": {"num_sessions": 6, "num_turns": 5, "first_prompt_tokens": 3000,
                "turn_tokens": 400, "output_tokens": 40, "length_jitter": 0.5},
    "aba": {"prompt_tokens": 40_000},
    "shared-prefix": {"num_groups": 3, "prompts_per_group": 5},
    "long-context": {"num_sessions": 3, "num_turns": 4},
    "shared-prefix-suffix": {"num_prompts": 30},
    "short-prompts": {"num_prompts": 400},
}
"""A few-MB instance of each workload (the measurement's scale)."""


def _defaults(generator: Callable[..., object]) -> dict[str, object]:
    return {k: p.default for k, p in inspect.signature(generator).parameters.items()}


def _peak_bytes(build: Callable[[], object]) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        kept = build()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del kept
    return peak


def test_every_workload_has_a_footprint() -> None:
    assert set(FOOTPRINTS) == set(WORKLOADS) == set(SMALL)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_footprint_bounds_the_measured_memory(name: str) -> None:
    """Never below what building the trace allocates at its peak, and within 2.5× of it
    (a bound that loose would refuse workloads that fit)."""
    params = SMALL[name]
    estimate = workload_bytes(name, {**_defaults(WORKLOADS[name]), **params})
    measured = _peak_bytes(lambda: make_workload(name, **params))
    assert estimate is not None
    assert measured <= estimate <= 2.5 * measured, (measured, estimate)


def test_microbench_scenarios_footprint_bounds_their_memory() -> None:
    params = {"num_prompts": 4, "prompt_tokens": 20_000}
    estimate = workload_bytes("retention-microbench",
                              {**_defaults(retention_microbench_scenarios), **params})
    measured = _peak_bytes(lambda: retention_microbench_from_params(**params))
    assert estimate is not None and measured <= estimate <= 2.5 * measured


SIZE_CASES = [(name, key) for name in sorted(WORKLOADS)
              for key in size_parameters(WORKLOADS[name])]


def test_size_cases_cover_every_workload() -> None:
    assert {name for name, _ in SIZE_CASES} == set(WORKLOADS)


@pytest.mark.parametrize(("name", "key"), SIZE_CASES)
def test_every_size_parameter_is_bounded_before_allocating(
        name: str, key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each size parameter at the smallest value that exceeds a 64 MiB host (found by
    doubling): refused with that parameter named, a value that fits offered, and nothing
    near the workload's size allocated. A parameter no value of which grows the trace past
    the host (a minimum, a block size) is never blamed."""
    available = 64 << 20
    monkeypatch.setattr(workload_limits, "available_memory_bytes", lambda: available)
    base = {**_defaults(WORKLOADS[name]), **SMALL[name]}
    value = int(str(base[key])) or 1
    while value < 1 << 40:
        if (workload_bytes(name, {**base, key: value}) or 0) > available:
            break
        value *= 2
    else:
        return  # this parameter cannot make the trace big (e.g. trace_block_size)
    params = {**SMALL[name], key: value}
    gc.collect()
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as caught:
            make_workload(name, **params)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert peak < 4 << 20, f"{peak:,} bytes allocated before the refusal"
    assert "of token ids in host memory" in message
    blamed = caught.value.field
    assert blamed in params, message
    fitting = int(message.rsplit(f"--set {blamed}=", 1)[1].rstrip(")"))
    assert (workload_bytes(name, {**base, **params, blamed: fitting}) or 0) <= available
    assert (workload_bytes(name, {**base, **params, blamed: fitting + 1}) or 0) > available


def test_agentic_5000_sessions_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case on a host with 4 GiB available: refused at once, naming the
    parameter and the fix (it used to grow past 4 GB)."""
    monkeypatch.setattr(workload_limits, "available_memory_bytes", lambda: 4 << 30)
    code = main(["replay", "--workload", "agentic", "--set", "num_sessions=5000"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err == (
        "hybridkv replay: error: num_sessions=5000 is invalid: workload 'agentic' would "
        "hold ~4.8 GiB of token ids in host memory, but 4.0 GiB are available; lower it to "
        "at most 4,177 (--set num_sessions=4177)\n")


def test_a_workload_too_big_for_any_host_is_refused(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    """Without a patched host: 10 million sessions need ~10 TiB of token ids."""
    code = main(["sweep", "--workload", "agentic", "--set", "num_sessions=10000000",
                 "--num-blocks", "1000"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("hybridkv sweep: error: num_sessions=10000000 is invalid: ")
