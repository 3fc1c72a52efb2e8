"""Synthetic workloads: deterministic traces with explicit token ids, built by name.

Every workload returns a ``Trace`` whose requests carry ``token_ids`` (and, for the agentic
workload, predetermined ``output_token_ids``). Ids are handed out by a ``_TokenIds`` counter
in a namespace chosen by ``seed`` (``0 <= seed < 2048``)::

    content ids   (seed << 37) + k                  fresh prompt tokens, never reused
    output ids    2**48 + (seed << 37) + k          predetermined outputs (agentic)

so two workloads built with different seeds never share a token, and both ranges stay
below ``FILL_TOKEN_BASE`` (``2**50``). The same arguments always give the same trace.

>>> trace = make_workload("aba", prompt_tokens=4, output_tokens=1)
>>> [(r.request_id, r.token_ids, r.phase) for r in trace.requests]
[('A', (0, 1, 2, 3), 0), ('B', (4, 5, 6, 7), 1), ('A-again', (0, 1, 2, 3), 2)]
"""

from __future__ import annotations

import difflib
import inspect
import random
from collections.abc import Callable, Mapping
from typing import Final

from hybridkv.errors import ConfigError
from hybridkv.traces.trace import MAX_PROMPT_TOKENS, Trace, TraceRequest
from hybridkv.traces.workload_limits import check_workload_fits

SEED_BITS: Final = 11
NAMESPACE_BITS: Final = 37
SYNTHETIC_OUTPUT_BASE: Final = 1 << 48

DEFAULT_FRACTIONS: Final = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
"""Prompt fractions of the retention microbenchmark (replay-protocol.md)."""

WORKLOAD_DEFAULTS: Final[Mapping[str, Mapping[str, int]]] = {
    "retention-microbench": {"max_running": 1},
}
"""Replay-protocol overrides a workload needs (the microbenchmark runs one request at a time)."""


class _TokenIds:
    """Hands out fresh, disjoint token ids in the namespace of one seed."""

    def __init__(self, seed: int) -> None:
        _require_int("seed", seed, minimum=0)
        if seed >= 1 << SEED_BITS:
            raise ConfigError("seed", seed, f"must be < {1 << SEED_BITS}")
        self._next_content = seed << NAMESPACE_BITS
        self._next_output = SYNTHETIC_OUTPUT_BASE + (seed << NAMESPACE_BITS)

    def content(self, num_tokens: int) -> tuple[int, ...]:
        start = self._next_content
        self._next_content += num_tokens
        return tuple(range(start, start + num_tokens))

    def outputs(self, num_tokens: int) -> tuple[int, ...]:
        start = self._next_output
        self._next_output += num_tokens
        return tuple(range(start, start + num_tokens))


def retention_microbench(fraction: float = 1.0, num_prompts: int = 16,
                         prompt_tokens: int = 65536, output_tokens: int = 16,
                         seed: int = 0) -> Trace:
    """The vLLM #43447 retention benchmark for one prompt fraction.

    Phase 0 (*fill*, session ``fill``): ``num_prompts`` prompts of ``prompt_tokens``
    distinct tokens, one after another. Phase 1 (*replay*, session ``replay``): the first
    ``round(fraction * prompt_tokens)`` tokens of each prompt, newest prompt first. The
    sessions make both phases sequential even without ``max_running=1``.

    >>> trace = retention_microbench(0.5, num_prompts=2, prompt_tokens=8, output_tokens=1)
    >>> [(r.request_id, r.input_length, r.token_ids[0], r.phase) for r in trace.requests]
    [('fill-0', 8, 0, 0), ('fill-1', 8, 8, 0), ('replay-1', 4, 8, 1), ('replay-0', 4, 0, 1)]
    """
    return retention_microbench_scenarios(num_prompts, prompt_tokens, output_tokens,
                                          (fraction,), seed).popitem()[1]


def retention_microbench_scenarios(
    num_prompts: int = 16, prompt_tokens: int = 65536, output_tokens: int = 16,
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS, seed: int = 0,
) -> dict[str, Trace]:
    """One microbenchmark trace per fraction, keyed ``str(fraction)`` (``"0.1"`` … ``"1.0"``).

    The traces share their fill requests (same objects, same token ids); each replay prompt
    is a slice of its fill prompt, so ten scenarios cost little more memory than one.
    """
    _require_int("num_prompts", num_prompts, minimum=1)
    _require_prompt_tokens("prompt_tokens", prompt_tokens)
    _require_int("output_tokens", output_tokens, minimum=0)
    if not fractions:
        raise ConfigError("fractions", fractions, "give at least one fraction in (0, 1]")
    ids = _TokenIds(seed)
    prompts = [ids.content(prompt_tokens) for _ in range(num_prompts)]
    fill = tuple(
        _request(f"fill-{i}", prompt, output_tokens, session_id="fill", phase=0, tag="fill")
        for i, prompt in enumerate(prompts)
    )
    scenarios: dict[str, Trace] = {}
    for fraction in fractions:
        num_replayed = _replayed_tokens(fraction, prompt_tokens)
        replay = tuple(
            _request(f"replay-{i}", prompts[i][:num_replayed], output_tokens,
                     session_id="replay", phase=1, tag="replay")
            for i in reversed(range(num_prompts))
        )
        key = str(float(fraction))
        scenarios[key] = Trace(f"retention-microbench-f{key}", fill + replay)
    return scenarios


def _replayed_tokens(fraction: float, prompt_tokens: int) -> int:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) \
            or not 0.0 < fraction <= 1.0:
        raise ConfigError("fraction", fraction, "must be a number in (0, 1]")
    num_tokens = round(fraction * prompt_tokens)
    if num_tokens < 1:
        raise ConfigError("fraction", fraction,
                          f"replays round({fraction} * {prompt_tokens}) = 0 tokens; use more")
    return num_tokens


def agentic(num_sessions: int = 8, num_turns: int = 6, first_prompt_tokens: int = 4096,
            turn_tokens: int = 1024, output_tokens: int = 256, length_jitter: float = 0.0,
            seed: int = 0) -> Trace:
    """Multi-turn sessions: each turn re-sends the whole conversation so far.

    Turn ``t + 1``'s prompt is turn ``t``'s prompt + turn ``t``'s predetermined output +
    ``turn_tokens`` new tokens. Sessions are interleaved round-robin in trace order
    (``agent-0-turn-0``, ``agent-1-turn-0``, …); each is a session ``agent-<s>``. With
    ``length_jitter`` j > 0, each new-token count is drawn uniformly from
    ``[n (1 - j), n (1 + j)]`` with ``random.Random(seed)``. Tags: ``first-turn``,
    ``follow-up``.

    >>> trace = agentic(num_sessions=1, num_turns=2, first_prompt_tokens=3, turn_tokens=2,
    ...                 output_tokens=1)
    >>> first, second = trace.requests
    >>> second.token_ids == first.token_ids + first.output_token_ids + (3, 4)
    True
    """
    for field, value in (("num_sessions", num_sessions), ("num_turns", num_turns)):
        _require_int(field, value, minimum=1)
    _require_prompt_tokens("first_prompt_tokens", first_prompt_tokens)
    _require_int("turn_tokens", turn_tokens, minimum=0)
    _require_int("output_tokens", output_tokens, minimum=0)
    if isinstance(length_jitter, bool) or not isinstance(length_jitter, int | float) \
            or not 0.0 <= length_jitter < 1.0:
        raise ConfigError("length_jitter", length_jitter, "must be a number in [0, 1)")
    ids = _TokenIds(seed)
    rng = random.Random(seed)

    def jittered(num_tokens: int) -> int:
        if not length_jitter or not num_tokens:
            return num_tokens
        spread = round(num_tokens * length_jitter)
        return max(1, rng.randint(num_tokens - spread, num_tokens + spread))

    prompts = [ids.content(jittered(first_prompt_tokens)) for _ in range(num_sessions)]
    requests: list[TraceRequest] = []
    for turn in range(num_turns):
        for session, prompt in enumerate(prompts):
            outputs = ids.outputs(output_tokens)
            requests.append(_request(
                f"agent-{session}-turn-{turn}", prompt, output_tokens, outputs,
                session_id=f"agent-{session}", tag="first-turn" if turn == 0 else "follow-up",
            ))
            prompts[session] = prompt + outputs + ids.content(jittered(turn_tokens))
    return Trace("agentic", tuple(requests))


def aba(prompt_tokens: int = 32768, output_tokens: int = 16, seed: int = 0) -> Trace:
    """Prompt A, then B, then A again, each in its own phase (strictly one after another).

    Measures whether B's prefill evicts A: ``A-again`` hits unless it did. Tags equal ids.
    """
    _require_prompt_tokens("prompt_tokens", prompt_tokens)
    _require_int("output_tokens", output_tokens, minimum=0)
    ids = _TokenIds(seed)
    prompt_a, prompt_b = ids.content(prompt_tokens), ids.content(prompt_tokens)
    steps = (("A", prompt_a), ("B", prompt_b), ("A-again", prompt_a))
    return Trace("aba", tuple(
        _request(name, prompt, output_tokens, phase=phase, tag=name)
        for phase, (name, prompt) in enumerate(steps)
    ))


def shared_prefix(num_groups: int = 4, prompts_per_group: int = 8, prefix_tokens: int = 8192,
                  suffix_tokens: int = 1024, output_tokens: int = 64, warmup: bool = True,
                  seed: int = 0) -> Trace:
    """Groups of prompts sharing a per-group system prompt, each with its own suffix.

    Prompt ``p`` of group ``g`` is ``prefix_g + suffix_{g,p}`` (id ``g<g>-p<p>``); prompts
    are interleaved round-robin across groups. With ``warmup`` (default), each group's first
    prompt runs in phase 0 (tag ``first``) and the rest in phase 1 (tag ``shared``), so the
    shared prompts can hit regardless of concurrency; without it all run in phase 0.
    """
    for field, value in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group)):
        _require_int(field, value, minimum=1)
    _require_int("prefix_tokens", prefix_tokens, minimum=0)
    _require_int("suffix_tokens", suffix_tokens, minimum=0)
    _require_prompt_tokens("prefix_tokens + suffix_tokens", prefix_tokens + suffix_tokens)
    _require_int("output_tokens", output_tokens, minimum=0)
    if not isinstance(warmup, bool):
        raise ConfigError("warmup", warmup, "must be true or false")
    ids = _TokenIds(seed)
    prefixes = [ids.content(prefix_tokens) for _ in range(num_groups)]
    requests = [
        _request(f"g{group}-p{index}", prefixes[group] + ids.content(suffix_tokens),
                 output_tokens, phase=1 if warmup and index > 0 else 0,
                 tag="first" if index == 0 else "shared")
        for index in range(prompts_per_group)
        for group in range(num_groups)
    ]
    return Trace("shared-prefix", tuple(requests))


def long_context(num_sessions: int = 16, num_turns: int = 8, first_prompt_tokens: int = 131072,
                 turn_tokens: int = 126976, output_tokens: int = 1024,
                 trace_block_size: int = 512, seed: int = 0) -> Trace:
    """vLLM #43447's long-context scenario: ``num_sessions`` conversations whose contexts
    grow by appended turns to about 1 M tokens (defaults: 128 Ki + 7 × 124 Ki + outputs →
    the last turn's prompt is 1,019,904 tokens), all running at once.

    Each session's turn ``t + 1`` resends turn ``t``'s prompt and appends ``turn_tokens``
    new tokens (tool output, files: new trace blocks), as the agentic traces of the PR do;
    the model's ``output_tokens`` are generated by the replay and, as in Mooncake and WEKA
    block traces, are not part of the next prompt's ids (a coding agent's next request
    re-renders its own output, so it rarely hashes the same). Prompts are block-id traces
    (``trace_block_size`` tokens a block) so a session's hashes are reused across turns
    instead of recomputed. Sessions are interleaved round-robin (session ``ctx-<s>``; turns
    of one session run one after another). Tags: ``first-turn``, ``follow-up``.

    >>> trace = long_context(num_sessions=2, num_turns=2, first_prompt_tokens=8,
    ...                      turn_tokens=4, output_tokens=1, trace_block_size=4)
    >>> [(r.request_id, r.input_length, r.block_ids) for r in trace.requests]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('ctx-0-turn-0', 8, (0, 1)), ('ctx-1-turn-0', 8, (2, 3)),
     ('ctx-0-turn-1', 12, (0, 1, 4)), ('ctx-1-turn-1', 12, (2, 3, 5))]
    """
    for field, value in (("num_sessions", num_sessions), ("num_turns", num_turns),
                         ("trace_block_size", trace_block_size)):
        _require_int(field, value, minimum=1)
    _require_int("output_tokens", output_tokens, minimum=0)
    _require_int("turn_tokens", turn_tokens, minimum=0)
    for field, value in (("first_prompt_tokens", first_prompt_tokens),
                         ("last prompt (first_prompt_tokens + (num_turns - 1) * turn_tokens)",
                          first_prompt_tokens + (num_turns - 1) * turn_tokens)):
        _require_prompt_tokens(field, value)
    _TokenIds(seed)  # validates the seed
    next_block = (seed << NAMESPACE_BITS) // trace_block_size  # ids * B stay in the namespace

    def new_blocks(num_tokens: int) -> tuple[int, ...]:
        nonlocal next_block
        count = -(-num_tokens // trace_block_size)
        start, next_block = next_block, next_block + count
        return tuple(range(start, start + count))

    contexts = [(first_prompt_tokens, new_blocks(first_prompt_tokens))
                for _ in range(num_sessions)]
    requests: list[TraceRequest] = []
    for turn in range(num_turns):
        for session, (length, blocks) in enumerate(contexts):
            requests.append(TraceRequest(
                f"ctx-{session}-turn-{turn}", input_length=length, output_length=output_tokens,
                block_ids=blocks, trace_block_size=trace_block_size,
                session_id=f"ctx-{session}", tag="first-turn" if turn == 0 else "follow-up"))
            whole = length // trace_block_size  # a partial last block is not resent as is
            contexts[session] = (whole * trace_block_size + turn_tokens,
                                 blocks[:whole] + new_blocks(turn_tokens))
    return Trace("long-context", tuple(requests))


def shared_prefix_suffix(num_prompts: int = 48, prefix_tokens: int = 6476,
                         suffix_tokens: str = "40,376,1296", output_tokens: int = 16,
                         seed: int = 0) -> Trace:
    """One shared prefix, then unique suffixes whose lengths cycle through
    ``suffix_tokens`` (the SGLang Mamba radix-cache report, sgl#22935: a 6,476-token prefix
    hit 0.992 with 40-token suffixes and 0.000 with 376 or 1,296). The first prompt runs
    in phase 0 (tag ``first``), the rest in phase 1 (tag ``suffix-<n>``).

    >>> t = make_workload("shared-prefix-suffix", num_prompts=3, prefix_tokens=4,
    ...                   suffix_tokens="1,2")
    >>> [(r.input_length, r.tag) for r in t.requests]
    [(5, 'first'), (6, 'suffix-2'), (5, 'suffix-1')]
    """
    _require_int("num_prompts", num_prompts, minimum=1)
    _require_int("prefix_tokens", prefix_tokens, minimum=0)
    _require_int("output_tokens", output_tokens, minimum=0)
    suffixes = _int_list("suffix_tokens", suffix_tokens)
    _require_prompt_tokens("prefix_tokens + suffix_tokens", prefix_tokens + max(suffixes))
    ids = _TokenIds(seed)
    prefix = ids.content(prefix_tokens)
    requests = []
    for index in range(num_prompts):
        suffix = suffixes[index % len(suffixes)]
        requests.append(_request(f"p{index}", prefix + ids.content(suffix), output_tokens,
                                 phase=0 if index == 0 else 1,
                                 tag="first" if index == 0 else f"suffix-{suffix}"))
    return Trace("shared-prefix-suffix", tuple(requests))


def short_prompts(num_prompts: int = 64, system_tokens: int = 400, min_user_tokens: int = 20,
                  max_user_tokens: int = 300, output_tokens: int = 16, seed: int = 0) -> Trace:
    """Many prompts shorter than a hybrid model's unified block (Qwen3.5: 528-784 tokens)
    that share one system prompt (vllm#40696: 0% hits under 528 tokens). User turns have
    ``min_user_tokens``-``max_user_tokens`` unique tokens (seeded). The first prompt runs in
    phase 0, the rest in phase 1.

    >>> t = make_workload("short-prompts", num_prompts=2, system_tokens=3,
    ...                   min_user_tokens=1, max_user_tokens=1)
    >>> [r.token_ids for r in t.requests]
    [(0, 1, 2, 3), (0, 1, 2, 4)]
    """
    _require_int("num_prompts", num_prompts, minimum=1)
    _require_int("system_tokens", system_tokens, minimum=0)
    _require_int("min_user_tokens", min_user_tokens, minimum=1)
    _require_int("max_user_tokens", max_user_tokens, minimum=min_user_tokens)
    _require_prompt_tokens("system_tokens + max_user_tokens", system_tokens + max_user_tokens)
    _require_int("output_tokens", output_tokens, minimum=0)
    ids = _TokenIds(seed)
    rng = random.Random(seed)
    system = ids.content(system_tokens)
    requests = [
        _request(f"p{index}", system + ids.content(rng.randint(min_user_tokens,
                                                               max_user_tokens)),
                 output_tokens, phase=0 if index == 0 else 1)
        for index in range(num_prompts)
    ]
    return Trace("short-prompts", tuple(requests))


def _int_list(field: str, text: object) -> list[int]:
    """``"40,376,1296"`` → ``[40, 376, 1296]`` (positive integers)."""
    try:
        values = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise ConfigError(field, text, "give comma-separated token counts, e.g. 40,376,1296") \
            from None
    for value in values:
        _require_int(field, value, minimum=1)
    return values


WorkloadFn = Callable[..., Trace]

WORKLOADS: Final[Mapping[str, WorkloadFn]] = {
    "retention-microbench": retention_microbench,
    "agentic": agentic,
    "aba": aba,
    "shared-prefix": shared_prefix,
    "long-context": long_context,
    "shared-prefix-suffix": shared_prefix_suffix,
    "short-prompts": short_prompts,
}
"""Workload name → generator; each generator's keyword defaults document its shape."""


def make_workload(name: str, **params: object) -> Trace:
    """Build workload ``name`` with ``params`` overriding its defaults.

    String values (from a command line) are converted to the default's type: ``"1024"`` →
    1024, ``"0.5"`` → 0.5, ``"true"`` → True, ``"0.1,0.5"`` → (0.1, 0.5).

    Raises:
        ConfigError: unknown workload, unknown parameter, or a value the workload refuses.
    """
    if name not in WORKLOADS:
        close = difflib.get_close_matches(name, list(WORKLOADS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError("workload", name, f"{hint}choose one of {sorted(WORKLOADS)}")
    converted = converted_params(name, WORKLOADS[name], params)
    _check_fits(name, WORKLOADS[name], converted)
    return WORKLOADS[name](**converted)


def retention_microbench_from_params(**params: object) -> dict[str, Trace]:
    """``retention_microbench_scenarios`` with ``params`` checked and converted like
    ``make_workload``'s (``fractions="0.1,0.5"`` → ``(0.1, 0.5)``).

    >>> sorted(retention_microbench_from_params(fractions="0.5,1", prompt_tokens="8",
    ...                                         num_prompts="1"))
    ['0.5', '1.0']
    """
    converted = converted_params("retention-microbench", retention_microbench_scenarios,
                                 params)
    _check_fits("retention-microbench", retention_microbench_scenarios, converted)
    return retention_microbench_scenarios(**converted)  # type: ignore[arg-type]


def _check_fits(name: str, generator: Callable[..., object],
                converted: Mapping[str, object]) -> None:
    """Refuse, before building it, a workload whose trace would not fit in host memory
    (``hybridkv.traces.workload_limits``)."""
    defaults = {k: p.default for k, p in inspect.signature(generator).parameters.items()}
    check_workload_fits(name, {**defaults, **converted}, given=set(converted),
                        generator=WORKLOADS[name])


def converted_params(name: str, function: Callable[..., object], params: Mapping[str, object],
                     ) -> dict[str, object]:
    """``params`` checked against ``function``'s keywords, strings converted to the type of
    each keyword's default (an unknown key is a ``ConfigError`` with a suggestion)."""
    signature = inspect.signature(function)
    converted: dict[str, object] = {}
    for key, value in params.items():
        if key not in signature.parameters:
            close = difflib.get_close_matches(key, list(signature.parameters), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(key, value, f"{hint}workload {name!r} accepts only "
                                          f"{sorted(signature.parameters)}")
        default = signature.parameters[key].default
        converted[key] = _convert(key, value, default) if isinstance(value, str) else value
    return converted


def _convert(key: str, text: str, default: object) -> object:
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, tuple):
            return tuple(float(part) for part in text.split(","))
        if isinstance(default, str) and not text:
            raise ValueError(text)
    except ValueError as err:
        raise ConfigError(key, text, f"must parse as {type(default).__name__}") from err
    return text


def _request(request_id: str, prompt: tuple[int, ...], output_tokens: int,
             outputs: tuple[int, ...] | None = None, *, session_id: str | None = None,
             phase: int = 0, tag: str | None = None) -> TraceRequest:
    return TraceRequest(request_id, input_length=len(prompt), output_length=output_tokens,
                        token_ids=prompt, output_token_ids=outputs, session_id=session_id,
                        phase=phase, tag=tag)


def _require_int(field: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, value, f"must be an integer >= {minimum}")
    return value


def _require_prompt_tokens(field: str, value: object) -> None:
    if _require_int(field, value, minimum=1) > MAX_PROMPT_TOKENS:
        raise ConfigError(field, value, f"prompts are at most {MAX_PROMPT_TOKENS} tokens")
