"""How much host memory a synthetic workload's trace takes, known from its parameters
before it is built, and the refusal of a workload that would not fit.

A workload (``hybridkv.traces.workloads``) holds every prompt as a tuple of token ids: one
8-byte reference per prompt token of every request, plus one Python ``int`` per distinct
token (at most 48 bytes: output ids are above ``2**48``). Each workload has a *footprint*,
a closed form of its parameters counting those references, distinct tokens and requests;
``workload_bytes`` prices them and ``check_workload_fits`` compares the total with the
memory this host has available (``MemAvailable``, the limit pools are held to:
``hybridkv.limits``). A workload too big is refused before any token is allocated,
naming the parameter that made it big and the largest value of it that fits.

Worked example: ``--workload agentic --set num_sessions=5000`` (the generator's defaults:
6 turns, 4,096-token first prompts, 1,024-token turns, 256-token outputs) holds 30,000
requests, ~285 million token references and ~59 million distinct tokens (~4.8 GiB); on
a host with 4 GiB available it is refused at once, and 4,177 sessions would fit:

>>> defaults = {"num_turns": 6, "first_prompt_tokens": 4096, "turn_tokens": 1024,
...             "output_tokens": 256, "length_jitter": 0.0, "seed": 0}
>>> from hybridkv.traces.workloads import agentic
>>> check_workload_fits("agentic", {"num_sessions": 5000, **defaults},
...                     given={"num_sessions"}, generator=agentic, available=4 << 30)
Traceback (most recent call last):
...
hybridkv.errors.ConfigError: num_sessions=5000 is invalid: workload 'agentic' would hold \
~4.8 GiB of token ids in host memory, but 4.0 GiB are available; lower it to at most 4,177 \
(--set num_sessions=4177)

``tests/unit/test_workload_limits.py`` measures every workload with ``tracemalloc`` and
fails if a footprint ever underestimates.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Final

from hybridkv.errors import ConfigError
from hybridkv.limits import available_memory_bytes, format_bytes

BYTES_PER_TOKEN_REF: Final = 8
"""A tuple slot."""
BYTES_PER_DISTINCT_TOKEN: Final = 48
"""An ``int`` object of up to 3 × 30-bit digits (token ids stay below ``2**50``)."""
BYTES_PER_REQUEST: Final = 1024
"""A ``TraceRequest``, its id, session and tag strings and two tuple headers, rounded up."""


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a workload's trace holds.

    Attributes:
        token_refs: token-id references over every request's prompt and output tuples
            (and the generator's working tuples alive at its end).
        distinct_tokens: token ids created (each one ``int`` object).
        requests: requests in the trace.
    """

    token_refs: int
    distinct_tokens: int
    requests: int

    @property
    def host_bytes(self) -> int:
        """Bytes: 8 a reference, 48 a distinct token, 1 KiB a request.

        >>> Footprint(1000, 100, 2).host_bytes
        14848
        """
        return (self.token_refs * BYTES_PER_TOKEN_REF
                + self.distinct_tokens * BYTES_PER_DISTINCT_TOKEN
                + self.requests * BYTES_PER_REQUEST)


def _jittered_max(num_tokens: int, jitter: float) -> int:
    return num_tokens + round(num_tokens * jitter)


def _agentic(num_sessions: int, num_turns: int, first_prompt_tokens: int, turn_tokens: int,
             output_tokens: int, length_jitter: float, **_: object) -> Footprint:
    first = _jittered_max(first_prompt_tokens, length_jitter)
    growth = output_tokens + _jittered_max(turn_tokens, length_jitter)
    turns = num_turns
    prompt_refs = turns * first + growth * turns * (turns - 1) // 2  # one session's prompts
    last = first + turns * growth  # each session's next prompt, alive at the end
    return Footprint(num_sessions * (prompt_refs + turns * output_tokens + last),
                     num_sessions * (first + turns * growth), num_sessions * turns)


def _aba(prompt_tokens: int, **_: object) -> Footprint:
    return Footprint(2 * prompt_tokens, 2 * prompt_tokens, 3)  # A-again reuses A's tuple


def _retention_microbench(num_prompts: int, prompt_tokens: int,
                          fractions: tuple[float, ...] = (), fraction: float = 1.0,
                          **_: object) -> Footprint:
    chosen = fractions or (fraction,)  # the scenarios' list, or the one trace's fraction
    replayed = sum(round(min(max(float(f), 0.0), 1.0) * prompt_tokens) for f in chosen)
    return Footprint(num_prompts * (prompt_tokens + replayed), num_prompts * prompt_tokens,
                     num_prompts * (1 + len(chosen)))


def _shared_prefix(num_groups: int, prompts_per_group: int, prefix_tokens: int,
                   suffix_tokens: int, **_: object) -> Footprint:
    prompts = num_groups * prompts_per_group
    return Footprint(num_groups * prefix_tokens + prompts * (prefix_tokens + 2 * suffix_tokens),
                     num_groups * prefix_tokens + prompts * suffix_tokens, prompts)


def _long_context(num_sessions: int, num_turns: int, first_prompt_tokens: int,
                  turn_tokens: int, trace_block_size: int, **_: object) -> Footprint:
    first = -(-first_prompt_tokens // trace_block_size)
    turn = -(-turn_tokens // trace_block_size)
    refs = num_turns * first + turn * num_turns * (num_turns + 1) // 2
    return Footprint(num_sessions * refs, num_sessions * (first + num_turns * turn),
                     num_sessions * num_turns)


def _shared_prefix_suffix(num_prompts: int, prefix_tokens: int, suffix_tokens: object,
                          **_: object) -> Footprint:
    longest = max((int(s) for s in str(suffix_tokens).split(",") if s.strip().isdigit()),
                  default=0)
    return Footprint(prefix_tokens + num_prompts * (prefix_tokens + 2 * longest),
                     prefix_tokens + num_prompts * longest, num_prompts)


def _short_prompts(num_prompts: int, system_tokens: int, max_user_tokens: int,
                   **_: object) -> Footprint:
    return Footprint(system_tokens + num_prompts * (system_tokens + 2 * max_user_tokens),
                     system_tokens + num_prompts * max_user_tokens, num_prompts)


FOOTPRINTS: Final[Mapping[str, Callable[..., Footprint]]] = {
    "retention-microbench": _retention_microbench,
    "agentic": _agentic,
    "aba": _aba,
    "shared-prefix": _shared_prefix,
    "long-context": _long_context,
    "shared-prefix-suffix": _shared_prefix_suffix,
    "short-prompts": _short_prompts,
}
"""Workload name → footprint of its keyword parameters (one per ``WORKLOADS`` entry)."""


def size_parameters(generator: Callable[..., object]) -> list[str]:
    """The integer parameters of a workload generator but ``seed`` (its sizes).

    >>> def w(num_prompts: int = 4, warmup: bool = True, jitter: float = 0.0, seed: int = 0):
    ...     pass
    >>> size_parameters(w)
    ['num_prompts']
    """
    return [name for name, p in inspect.signature(generator).parameters.items()
            if type(p.default) is int and name != "seed"]


def workload_bytes(name: str, params: Mapping[str, object]) -> int | None:
    """Host bytes of workload ``name`` with ``params`` (complete: every keyword); ``None``
    when a value is not a valid size (the generator refuses it with its own message)."""
    try:
        return int(FOOTPRINTS[name](**params).host_bytes)
    except (TypeError, ValueError, ArithmeticError):
        return None


def check_workload_fits(name: str, params: Mapping[str, object], *,
                        given: Collection[str], generator: Callable[..., object],
                        available: int | None = None) -> None:
    """Raise ``ConfigError`` when workload ``name`` with ``params`` (every keyword) would
    not fit the host's available memory, naming the one of the ``given`` parameters (those
    the user set) whose reset to its default saves the most and the largest value of it
    that fits (bisection over the footprint: nothing is allocated). ``generator``: the
    workload's function (``traces.workloads.WORKLOADS[name]``), whose keyword defaults the
    reset uses."""
    needed = workload_bytes(name, params)
    if needed is None or name not in FOOTPRINTS:
        return
    if available is None:
        available = available_memory_bytes()
    if available is None or needed <= available:
        return
    defaults = {k: p.default for k, p in inspect.signature(generator).parameters.items()}
    sizes = [k for k in size_parameters(generator) if k in given]
    reason = (f"workload {name!r} would hold ~{format_bytes(needed)} of token ids in host "
              f"memory, but {format_bytes(available)} are available")
    if not sizes:
        raise ConfigError("--workload", name, f"{reason}; set smaller sizes with --set")
    blamed = min(sizes, key=lambda k: workload_bytes(name, {**params, k: defaults[k]}) or 0)
    value = params[blamed]
    assert isinstance(value, int)
    fitting = _largest_fitting(name, params, blamed, value, available)
    fix = (f"lower it to at most {fitting:,} (--set {blamed}={fitting})" if fitting
           else "lower it and the other sizes")
    raise ConfigError(blamed, value, f"{reason}; {fix}")


def _largest_fitting(name: str, params: Mapping[str, object], key: str, value: int,
                     available: int) -> int:
    """The largest ``params[key]`` in ``[1, value)`` that fits (0: none does)."""
    low, high = 0, value  # invariant: low fits (or is 0), high does not
    while high - low > 1:
        middle = (low + high) // 2
        if (workload_bytes(name, {**params, key: middle}) or 0) <= available:
            low = middle
        else:
            high = middle
    return low


__all__ = ["FOOTPRINTS", "Footprint", "check_workload_fits", "size_parameters",
           "workload_bytes"]
