"""Synthetic workloads: shapes, sharing structure, phases, determinism and the registry."""

from __future__ import annotations

import itertools

import pytest

from hybridkv import ConfigError
from hybridkv.traces.trace import FILL_TOKEN_BASE, Trace
from hybridkv.traces.workloads import (
    DEFAULT_FRACTIONS,
    WORKLOAD_DEFAULTS,
    WORKLOADS,
    aba,
    agentic,
    make_workload,
    retention_microbench,
    retention_microbench_scenarios,
    shared_prefix,
)


def all_ids(trace: Trace) -> set[int]:
    ids: set[int] = set()
    for request in trace.requests:
        ids.update(request.token_ids or ())
        ids.update(request.output_token_ids or ())
    return ids


def test_retention_microbench_default_scenarios() -> None:
    scenarios = retention_microbench_scenarios()
    assert list(scenarios) == ["0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9",
                               "1.0"]
    assert WORKLOAD_DEFAULTS["retention-microbench"] == {"max_running": 1}
    for key, trace in scenarios.items():
        fill, replay = trace.requests[:16], trace.requests[16:]
        assert len(replay) == 16
        assert all(r.input_length == 65536 and r.output_length == 16 for r in fill)
        assert {(r.phase, r.tag, r.session_id) for r in fill} == {(0, "fill", "fill")}
        assert {(r.phase, r.tag, r.session_id) for r in replay} == {(1, "replay", "replay")}
        assert {r.input_length for r in replay} == {round(float(key) * 65536)}
    # the scenarios share the fill requests: one copy of the 1 M fill tokens
    assert scenarios["0.1"].requests[0] is scenarios["1.0"].requests[0]


def test_retention_microbench_structure() -> None:
    trace = retention_microbench(0.3, num_prompts=4, prompt_tokens=100, output_tokens=2)
    fill, replay = trace.requests[:4], trace.requests[4:]
    assert [r.request_id for r in fill] == ["fill-0", "fill-1", "fill-2", "fill-3"]
    assert [r.request_id for r in replay] == ["replay-3", "replay-2", "replay-1", "replay-0"]
    assert not {r.request_id for r in fill} & {r.request_id for r in replay}
    prompts = [r.token_ids or () for r in fill]
    assert all(len(set(p)) == 100 for p in prompts)
    assert not set(prompts[0]) & set(prompts[1])               # distinct prompts
    for request in replay:                                     # newest first, a 30% prefix
        index = int(request.request_id.split("-")[1])
        assert request.token_ids == prompts[index][:30]
    assert retention_microbench(1.0, num_prompts=1, prompt_tokens=8).requests[1].input_length == 8


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, 0.001])
def test_retention_microbench_rejects_bad_fractions(fraction: float) -> None:
    with pytest.raises(ConfigError, match="fraction"):
        retention_microbench(fraction, prompt_tokens=100)


def test_agentic_turns_resend_the_conversation() -> None:
    trace = agentic()
    assert len(trace) == 8 * 6
    assert [r.request_id for r in trace.requests[:9]] == [
        *(f"agent-{s}-turn-0" for s in range(8)), "agent-0-turn-1"]
    by_id = {r.request_id: r for r in trace.requests}
    for session in range(8):
        previous = by_id[f"agent-{session}-turn-0"]
        assert previous.input_length == 4096 and previous.tag == "first-turn"
        for turn in range(1, 6):
            current = by_id[f"agent-{session}-turn-{turn}"]
            assert current.session_id == f"agent-{session}" and current.tag == "follow-up"
            prompt, outputs = previous.token_ids or (), previous.output_token_ids or ()
            assert (current.token_ids or ())[: len(prompt) + 256] == prompt + outputs
            assert current.input_length == previous.input_length + 256 + 1024
            previous = current
    # sessions share nothing; outputs never appear in another session; all are content ids
    first = [set(by_id[f"agent-{s}-turn-5"].token_ids or ()) for s in range(2)]
    assert not first[0] & first[1]
    assert max(all_ids(trace)) < FILL_TOKEN_BASE


def test_agentic_jitter_is_seeded() -> None:
    a = agentic(num_sessions=2, num_turns=3, length_jitter=0.5, seed=3)
    b = agentic(num_sessions=2, num_turns=3, length_jitter=0.5, seed=3)
    plain = agentic(num_sessions=2, num_turns=3)
    assert a == b
    assert [r.input_length for r in a.requests] != [r.input_length for r in plain.requests]
    with pytest.raises(ConfigError, match="length_jitter"):
        agentic(length_jitter=1.0)


def test_aba_resends_a_after_b() -> None:
    trace = aba(prompt_tokens=64)
    a, b, again = trace.requests
    assert (a.phase, b.phase, again.phase) == (0, 1, 2)
    assert again.token_ids == a.token_ids and a.request_id != again.request_id
    assert not set(a.token_ids or ()) & set(b.token_ids or ())
    assert aba().requests[0].input_length == 32768


def test_shared_prefix_groups() -> None:
    trace = shared_prefix(num_groups=3, prompts_per_group=4, prefix_tokens=50, suffix_tokens=7)
    assert len(trace) == 12
    assert [r.request_id for r in trace.requests[:4]] == ["g0-p0", "g1-p0", "g2-p0", "g0-p1"]
    by_id = {r.request_id: r for r in trace.requests}
    prefixes = {g: (by_id[f"g{g}-p0"].token_ids or ())[:50] for g in range(3)}
    assert not set(prefixes[0]) & set(prefixes[1])
    for request in trace.requests:
        group, index = (int(part[1:]) for part in request.request_id.split("-"))
        tokens = request.token_ids or ()
        assert len(tokens) == 57 and tokens[:50] == prefixes[group]
        assert (request.phase, request.tag) == ((0, "first") if index == 0 else (1, "shared"))
    suffixes = [set((r.token_ids or ())[50:]) for r in trace.requests]
    assert len(set().union(*suffixes)) == 12 * 7
    no_warmup = shared_prefix(warmup=False)
    assert {r.phase for r in no_warmup.requests} == {0} and len(no_warmup) == 32


def test_workloads_are_deterministic_and_seeds_are_disjoint() -> None:
    for name in WORKLOADS:
        assert make_workload(name) == make_workload(name)
    assert not all_ids(make_workload("aba", seed=0)) & all_ids(make_workload("aba", seed=1))


def test_make_workload_converts_strings_and_rejects_unknowns() -> None:
    trace = make_workload("shared-prefix", num_groups="2", prompts_per_group=1,
                          prefix_tokens="10", warmup="false")
    assert len(trace) == 2 and trace.requests[0].input_length == 10 + 1024
    scenario = make_workload("retention-microbench", fraction="0.5", prompt_tokens="10")
    assert scenario.requests[-1].input_length == 5
    with pytest.raises(ConfigError, match="workload"):
        make_workload("abba")
    with pytest.raises(ConfigError, match="accepts only"):
        make_workload("aba", prompt_length=10)
    with pytest.raises(ConfigError, match="must parse as int"):
        make_workload("aba", prompt_tokens="many")
    with pytest.raises(ConfigError, match="seed"):
        make_workload("aba", seed=1 << 11)
    with pytest.raises(ConfigError, match="prompt_tokens"):
        make_workload("aba", prompt_tokens=0)
    assert retention_microbench_scenarios(num_prompts=1, prompt_tokens=10,
                                          fractions=(0.25,)).keys() == {"0.25"}
    assert len(DEFAULT_FRACTIONS) == 10


def test_long_context_grows_each_session_to_about_a_million_tokens() -> None:
    from hybridkv.traces.workloads import make_workload

    trace = make_workload("long-context")
    assert len(trace.requests) == 16 * 8
    lengths = {r.session_id: r.input_length for r in trace.requests}
    assert set(lengths.values()) == {131072 + 7 * 126976} == {1_019_904}
    by_session: dict[str, list[tuple[int, ...]]] = {}
    for request in trace.requests:
        by_session.setdefault(str(request.session_id), []).append(request.block_ids)
    for turns in by_session.values():
        for earlier, later in itertools.pairwise(turns):
            assert later[: len(earlier)] == earlier and len(later) == len(earlier) + 248
    firsts = [turns[0][0] for turns in by_session.values()]
    assert len(set(firsts)) == 16  # sessions share nothing
    with pytest.raises(ConfigError, match="last prompt"):
        make_workload("long-context", num_turns=200)


def test_recurrent_report_workloads() -> None:
    trace = make_workload("shared-prefix-suffix", num_prompts=6)
    assert [r.input_length for r in trace.requests] == [6516, 6852, 7772, 6516, 6852, 7772]
    prefix = trace.requests[0].token_ids[:6476]
    assert all(r.token_ids[:6476] == prefix for r in trace.requests)
    assert len({r.token_ids[6476] for r in trace.requests}) == 6  # unique suffixes
    short = make_workload("short-prompts", num_prompts=10)
    assert all(421 <= r.input_length <= 700 for r in short.requests)
    assert len({r.token_ids[:400] for r in short.requests}) == 1
    with pytest.raises(ConfigError, match="suffix_tokens"):
        make_workload("shared-prefix-suffix", suffix_tokens="40,x")
