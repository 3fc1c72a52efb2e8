"""``Source``: what a replay runs — one loaded trace, or a workload's scenarios (the
retention microbenchmark has one per fraction) — and ``load_source``, which builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.errors import ConfigError
from hybridkv.traces.loaders import load_trace
from hybridkv.traces.trace import Trace
from hybridkv.traces.workloads import (
    WORKLOAD_DEFAULTS,
    make_workload,
    retention_microbench_from_params,
)

DEFAULT_WORKLOAD = "agentic"
DEFAULT_WORKLOAD_PARAMS: dict[str, object] = {
    "num_sessions": 32, "num_turns": 8, "first_prompt_tokens": 8192, "turn_tokens": 2048,
    "length_jitter": 0.5,
}
"""The bundled default run (``hybridkv replay`` with no arguments): 32 interleaved agentic
sessions of 8 turns (8k-token start, ~2k new tokens a turn, contexts up to ~27k tokens) on
``gemma3-bench`` with 64 GiB of KV memory, where dense window tails flush the prefixes of
other sessions and sparse retention keeps them."""
MICROBENCH = "retention-microbench"


@dataclass(frozen=True, slots=True)
class Source:
    """A resolved trace or workload: one trace, or scenarios keyed by fraction."""

    name: str
    workload: str | None
    scenarios: dict[str, Trace]
    protocol_defaults: dict[str, int]
    params: dict[str, object] = field(default_factory=dict)
    """The workload parameters given with ``--set`` (and the default run's)."""

    def describe(self) -> str:
        """One line for the report: the workload and its parameters, or the trace.

        >>> Source("aba", "aba", {}, {}, {"prompt_tokens": "64"}).describe()
        'workload aba (prompt_tokens=64)'
        """
        if self.workload is None:
            trace = next(iter(self.scenarios.values()))
            return f"trace {trace.source or trace.name} ({len(trace.requests):,} requests)"
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"workload {self.workload}" + (f" ({params})" if params else "")

    @property
    def is_multi_scenario(self) -> bool:
        return self.workload == MICROBENCH


    @property
    def has_sessions(self) -> bool:
        """Whether any request names a session (``--policy all`` then adds ``+session``)."""
        return any(r.session_id is not None
                   for t in self.scenarios.values() for r in t.requests)


def load_source(trace: str | None, workload: str | None, params: dict[str, object],
                limit: int | None) -> Source:
    """The trace at path ``trace``, else workload ``workload`` (default: the bundled default
    run, its parameters under ``params``), cut to the first ``limit`` requests.

    >>> source = load_source(None, "aba", {}, 2)
    >>> source.name, len(source.scenarios[""].requests), source.has_sessions
    ('aba', 2, False)
    """
    if trace is not None:
        if params:
            raise ConfigError("--set", params, "workload parameters need --workload, not --trace")
        loaded = load_trace(trace, limit=limit)
        if not loaded.requests:
            raise ConfigError("--trace", trace, "holds no requests")
        return Source(loaded.name, None, {"": loaded}, {})
    name = workload or DEFAULT_WORKLOAD
    if workload is None:
        params = {**DEFAULT_WORKLOAD_PARAMS, **params}
    defaults = dict(WORKLOAD_DEFAULTS.get(name, {}))
    if name == MICROBENCH:
        scenarios = retention_microbench_from_params(**params)
    else:
        scenarios = {"": make_workload(name, **params)}
    if limit is not None:
        scenarios = {k: Trace(t.name, t.requests[:limit]) for k, t in scenarios.items()}
    return Source(name, name, scenarios, defaults, params)


__all__ = ["DEFAULT_WORKLOAD", "DEFAULT_WORKLOAD_PARAMS", "MICROBENCH", "Source", "load_source"]
