"""One bound computation per distinct admission log (``hybridkv.sim.bound_share``): the
shared bound equals each run's own, logs that differ in anything the bound reads never
share, and the parallel paths start one bound task per distinct log."""

from __future__ import annotations

import functools
import random
from array import array
from dataclasses import replace

import pytest

from hybridkv.models.shapes import load_model
from hybridkv.sim.bound import (
    AdmissionLog,
    BoundShape,
    both_optima,
    fa_optimum,
    hybrid_optimum,
    unit_keys,
    unit_keys_by_index,
)
from hybridkv.sim.bound_share import BoundKeys, clear_memo, shared_bounds
from hybridkv.sim.replay import ReplaySettings, replay
from hybridkv.sim.run import run_policies
from hybridkv.sweep.cells import Cell, CellOptions, CellReplay, replay_cell
from hybridkv.sweep.run import SharedCellBounds, SweepWork
from hybridkv.traces.source import Source
from hybridkv.traces.trace import Trace, TraceRequest
from hybridkv.traces.workloads import make_workload

POLICIES = ("dense", "reachable", "prepend", "latest", "interval:2048", "pin:2048")
LOG_FIELDS = ("request_indices", "reads", "held_blocks", "held_units", "release",
              "growth_events", "growth_admissions", "growth_units")


def _block_trace(seed: int = 0, num_sessions: int = 4, num_turns: int = 5) -> Trace:
    """Sessions of 16-token trace blocks; each turn resends the previous prompt's blocks
    (sometimes cut short: a diverging prefix) plus new ones."""
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    history: dict[int, list[int]] = {s: [] for s in range(num_sessions)}
    next_id = 1
    for turn in range(num_turns):
        for s in range(num_sessions):
            ids = history[s]
            if turn and rng.random() < 0.3:
                ids = ids[: rng.randrange(len(ids) + 1)]
            ids = ids + list(range(next_id, next_id + rng.randrange(3, 9)))
            next_id += 9
            history[s] = ids
            requests.append(TraceRequest(f"s{s}t{turn}", 16 * len(ids) + rng.randrange(16),
                                         2, block_ids=tuple(ids), trace_block_size=16,
                                         session_id=f"s{s}"))
    return Trace("blocks", tuple(requests))


SETTINGS = ReplaySettings(chunk_size=512, check_invariants=True)
"""Prefill in chunks: later chunks log growths."""
NUM_BLOCKS = 2200
"""gemma3-bench pool where the sparse retentions log other admissions than the dense
four (3 distinct logs of 6 policies)."""


def _workload() -> Trace:
    return make_workload("agentic", num_sessions=4, num_turns=4, first_prompt_tokens=1600,
                         turn_tokens=900, output_tokens=3)


@functools.cache
def _replayed_logs() -> tuple[Trace, BoundShape, dict[str, AdmissionLog]]:
    trace = _workload()
    config = load_model("gemma3-bench").cache_config(NUM_BLOCKS, max_num_batched_tokens=512)
    shape = BoundShape.of(config)
    assert shape is not None
    logs = {}
    for policy in POLICIES:
        log = replay(trace, config, policy, SETTINGS).log
        assert log is not None
        logs[policy] = log
    return trace, shape, logs


def test_shared_bound_equals_each_runs_own_bound() -> None:
    clear_memo()
    trace, shape, logs = _replayed_logs()
    keys = {policy: BoundKeys.of(trace, log, shape) for policy, log in logs.items()}
    assert len(set(keys.values())) < len(POLICIES)  # some policies really share a log
    for policy, log in logs.items():
        own = (hybrid_optimum(trace, log, shape).hit_tokens,
               fa_optimum(trace, log, shape).hit_tokens)
        assert shared_bounds(trace, log, shape) == own, policy
        assert tuple(t.hit_tokens for t in both_optima(trace, log, shape)) == own, policy
    assert any(pair[0] > 0 for pair in map(lambda log: shared_bounds(trace, log, shape),
                                           logs.values()))


@pytest.mark.parametrize("field", LOG_FIELDS)
def test_logs_that_differ_in_any_field_do_not_share(field: str) -> None:
    trace, shape, logs = _replayed_logs()
    log = logs["latest"]
    values: array[int] = getattr(log, field)
    assert len(values), field  # the workload exercises every field
    changed = AdmissionLog(*(array(getattr(log, f).typecode, getattr(log, f))
                             for f in LOG_FIELDS))
    changed_values: array[int] = getattr(changed, field)
    changed_values[len(values) // 2] ^= 1
    assert BoundKeys.of(trace, changed, shape) != BoundKeys.of(trace, log, shape)


def test_keys_cover_the_pool_shape_and_the_prompts() -> None:
    trace, shape, logs = _replayed_logs()
    log = logs["dense"]
    base = BoundKeys.of(trace, log, shape)
    for name in ("num_blocks", "unit_tokens", "unit_blocks", "fa_block_size"):
        other = replace(shape, **{name: getattr(shape, name) * 2})
        assert BoundKeys.of(trace, log, other) != base, name
    first = trace.requests[0]
    for changed in (replace(first, input_length=first.input_length - 1),
                    replace(first, token_ids=(7, *(first.token_ids or ())[1:]))):
        other_trace = Trace(trace.name, (changed, *trace.requests[1:]))
        assert BoundKeys.of(other_trace, log, shape) != base
    renamed = Trace(trace.name, tuple(replace(r, request_id=r.request_id + "'")
                                      for r in trace.requests))
    assert BoundKeys.of(renamed, log, shape) == base  # ids do not enter the bounds


def test_a_key_ignoring_held_blocks_would_share_wrong_bounds() -> None:
    """Why the key must cover every field: the same order with other held blocks has
    another ``bound`` (so a key blind to ``held_blocks`` would hand out a wrong one)."""
    trace, shape, logs = _replayed_logs()
    log = logs["dense"]
    changed = AdmissionLog(*(array(getattr(log, f).typecode, getattr(log, f))
                             for f in LOG_FIELDS))
    for e in range(len(changed.held_blocks)):
        changed.held_blocks[e] += shape.num_blocks // 2
    assert hybrid_optimum(trace, changed, shape) != hybrid_optimum(trace, log, shape)
    assert BoundKeys.of(trace, changed, shape) != BoundKeys.of(trace, log, shape)


@pytest.mark.parametrize("seed", range(4))
def test_session_reused_unit_keys_equal_fresh_ones(seed: int) -> None:
    trace = _block_trace(seed)
    for unit_tokens in (8, 16, 32):
        keys = unit_keys_by_index(trace, range(len(trace.requests)), unit_tokens)
        for i, request in enumerate(trace.requests):
            assert keys[i] == unit_keys(request, i, unit_tokens), (seed, unit_tokens, i)


def test_parallel_replay_starts_one_bound_task_per_distinct_log() -> None:
    clear_memo()
    trace = _workload()
    config = load_model("gemma3-bench").cache_config(NUM_BLOCKS, max_num_batched_tokens=512)
    source = Source("agentic", "agentic", {"": trace}, {})
    settings = SETTINGS
    _, serial = run_policies(source, config, POLICIES, settings, show_progress=False)
    _, parallel = run_policies(source, config, POLICIES, settings, jobs=2, show_progress=False)
    assert [(r.result.bound_hit_tokens, r.result.bound_fa_hit_tokens) for r in parallel] == \
        [(r.result.bound_hit_tokens, r.result.bound_fa_hit_tokens) for r in serial]
    assert all(r.result.bound_hit_tokens is not None for r in parallel)
    assert [r.result.hit_tokens for r in parallel] == [r.result.hit_tokens for r in serial]

    # the sweep's parent: cells whose logs are equal wait on one task
    shape = load_model("gemma3-bench")
    options = CellOptions(settings)
    work = SweepWork({"t": source}, {"m": shape}, {"t": options})
    shared = SharedCellBounds(work)
    started = []
    rows = []
    for index, policy in enumerate(POLICIES):
        cell = Cell("t", "m", NUM_BLOCKS, policy, "fcfs", None, f"k{index}")
        replayed = replay_cell(source, shape, cell, options)
        assert isinstance(replayed, CellReplay)
        tasks, row = shared.replayed(index, cell, replayed)
        started += tasks
        assert row is None  # every cell waits for its bound
    distinct = {t.keys for t in started}
    assert len(started) == len(distinct) < len(POLICIES)
    for task in started:
        rows += shared.bounded(task, work.bounds(task))
    assert sorted(cell.policy for cell, _ in rows) == sorted(POLICIES)
    by_policy = {cell.policy: row for cell, row in rows}
    for run in serial:
        assert by_policy[run.result.policy]["bound"] == run.result.bound
        assert by_policy[run.result.policy]["bound_fa"] == run.result.bound_fa
