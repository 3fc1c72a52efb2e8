"""Trace schema: one ``TraceRequest`` per request, and the protocol's token-id expansion.

A request's prompt is given in one of three representations (first present wins):

1. ``token_ids``: explicit prompt token ids (native token traces, synthetic workloads);
2. ``token_id_ranges``: concatenated half-open id ranges ``[start, end)`` (RAGPulse: each
   content chunk is one range, so 21 M prompt tokens cost a few numbers per request);
3. ``block_ids`` + ``trace_block_size``: trace block ``h`` of ``B`` tokens stands for the ids
   ``h*B … h*B+B-1`` (Mooncake, WEKA, native block traces).

The expansion is cut to ``input_length``; positions past it are filled with ids unique to the
request (replay-protocol.md, "Requests"). Token-id space (all ids ``< 2**62``)::

    [0, 2**50)          content ids: expanded trace blocks, RAGPulse chunks, native and
                        synthetic prompt tokens (predetermined synthetic outputs included)
    [2**50, 2**61)      fill ids: FILL_TOKEN_BASE + request_index * 2**24 + position
    [2**61, 2**62)      output ids the replay draws for generated tokens

>>> r = TraceRequest("r", input_length=10, output_length=1, block_ids=(3, 5),
...                  trace_block_size=4)
>>> prompt = expand_prompt(r, request_index=2)
>>> prompt[:8]                      # block 3 -> 12..15, block 5 -> 20..23
[12, 13, 14, 15, 20, 21, 22, 23]
>>> [t - FILL_TOKEN_BASE - 2 * FILL_TOKENS_PER_REQUEST for t in prompt[8:]]  # positions 8, 9
[8, 9]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from hybridkv.errors import ConfigError

FILL_TOKEN_BASE: Final = 1 << 50
"""First fill id; every content id (trace blocks, chunks, explicit tokens) is below it."""

FILL_TOKENS_PER_REQUEST: Final = 1 << 24
"""Fill ids reserved per request index; also the longest prompt a request may have."""

MAX_PROMPT_TOKENS: Final = FILL_TOKENS_PER_REQUEST
"""Longest prompt (16,777,216 tokens): fill positions must stay inside the request's range."""

OUTPUT_TOKEN_BASE: Final = 1 << 61
"""First output id the replay draws; generated tokens never collide with prompt ids."""

MAX_REQUEST_INDEX: Final = (OUTPUT_TOKEN_BASE - FILL_TOKEN_BASE) // FILL_TOKENS_PER_REQUEST
"""Request indices ``[0, 2**37 - 64)`` keep fill ids below ``OUTPUT_TOKEN_BASE``."""

TOKEN_ID_LIMIT: Final = 1 << 62
"""Every token id is ``< 2**62`` (packs as a signed 64-bit integer with room to spare)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        request_id: unique within the trace.
        input_length: prompt tokens (``1 <= input_length <= MAX_PROMPT_TOKENS``).
        output_length: tokens to sample (0 is kept as the trace says; the replay decides).
        block_ids: trace block ids, already namespaced so equal ids mean equal prefix
            content across the whole trace.
        trace_block_size: tokens per trace block (512 Mooncake, 64 WEKA, or native).
        token_ids: explicit prompt tokens; win over every other representation.
        output_token_ids: predetermined outputs (``len == output_length``), else the replay
            draws unique ids.
        session_id: requests of one session run strictly one after another.
        arrival_seconds: arrival time; the closed-loop replay only uses trace order.
        phase: barrier: a request of phase k is admitted only after every request of a
            phase ``< k`` finished.
        tag: label for per-group reporting (e.g. ``"fill"``, ``"replay"``).
        token_id_ranges: compact prompt: half-open id ranges ``(start, end)`` laid out one
            after another; used when ``token_ids`` is ``None``, before ``block_ids``.
    """

    request_id: str
    input_length: int
    output_length: int
    block_ids: tuple[int, ...] = ()
    trace_block_size: int = 0
    token_ids: tuple[int, ...] | None = None
    output_token_ids: tuple[int, ...] | None = None
    session_id: str | None = None
    arrival_seconds: float | None = None
    phase: int = 0
    tag: str | None = None
    token_id_ranges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ConfigError("request_id", self.request_id, "must be a non-empty string")
        if not _is_int(self.input_length) or not 1 <= self.input_length <= MAX_PROMPT_TOKENS:
            raise ConfigError("input_length", self.input_length,
                              f"must be an integer in [1, {MAX_PROMPT_TOKENS}]")
        if not _is_int(self.output_length) or self.output_length < 0:
            raise ConfigError("output_length", self.output_length,
                              "must be a non-negative integer")
        if self.block_ids and (not _is_int(self.trace_block_size) or self.trace_block_size < 1):
            raise ConfigError("trace_block_size", self.trace_block_size,
                              "block_ids need a positive trace_block_size")
        if self.output_token_ids is not None and len(self.output_token_ids) != self.output_length:
            raise ConfigError("output_token_ids", f"<{len(self.output_token_ids)} ids>",
                              f"must hold exactly output_length={self.output_length} ids")
        if not _is_int(self.phase) or self.phase < 0:
            raise ConfigError("phase", self.phase, "must be a non-negative integer")
        for start, end in self.token_id_ranges:
            if not 0 <= start < end <= TOKEN_ID_LIMIT:
                raise ConfigError("token_id_ranges", (start, end),
                                  f"each range needs 0 <= start < end <= 2**62 ({self.request_id})")

    @property
    def num_explicit_tokens(self) -> int:
        """Prompt tokens the representation spells out before cutting or filling.

        >>> TraceRequest("r", 100, 1, block_ids=(1, 2), trace_block_size=64).num_explicit_tokens
        128
        """
        if self.token_ids is not None:
            return len(self.token_ids)
        if self.token_id_ranges:
            return sum(end - start for start, end in self.token_id_ranges)
        return len(self.block_ids) * self.trace_block_size


@dataclass(frozen=True, slots=True)
class Trace:
    """An ordered tuple of requests plus where they came from.

    Attributes:
        name: short label (file stem, directory name or workload name).
        requests: in trace order (the replay's queue order).
        source: path the trace was loaded from, ``None`` for generated traces.
        format: ``"mooncake"``, ``"weka"``, ``"ragpulse"``, ``"native"`` or ``"synthetic"``.
    """

    name: str
    requests: tuple[TraceRequest, ...]
    source: str | None = None
    format: str = "synthetic"

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for request in self.requests:
            if request.request_id in seen:
                raise ConfigError("request_id", request.request_id,
                                  f"request ids must be unique within trace {self.name!r}")
            seen.add(request.request_id)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def origin(self) -> str:
        """Where the requests came from, for messages: the file, or the generated workload.

        >>> Trace("agentic", ()).origin, Trace("t", (), "traces/t.jsonl", "mooncake").origin
        ("workload 'agentic'", "trace 'traces/t.jsonl'")
        """
        return (f"trace {self.source!r}" if self.source is not None
                else f"workload {self.name!r}")

    @property
    def num_input_tokens(self) -> int:
        """Sum of prompt lengths over all requests."""
        return sum(r.input_length for r in self.requests)

    def head(self, limit: int | None) -> Trace:
        """The first ``limit`` requests in trace order (all of them for ``None``)."""
        if limit is None:
            return self
        if not _is_int(limit) or limit < 0:
            raise ConfigError("limit", limit, "must be a non-negative integer or None")
        return Trace(self.name, self.requests[:limit], self.source, self.format)


def expand_prompt(request: TraceRequest, request_index: int) -> list[int]:
    """Expand ``request`` into its prompt token ids (replay-protocol.md, "Requests").

    Args:
        request: the request.
        request_index: its position in the trace; selects the request's private fill range
            ``FILL_TOKEN_BASE + request_index * FILL_TOKENS_PER_REQUEST + position``.
            Distinct requests of one replay must pass distinct indices.

    Returns:
        Exactly ``request.input_length`` ids.

    >>> r = TraceRequest("r", input_length=5, output_length=1,
    ...                  token_id_ranges=((100, 103), (7, 9)))
    >>> expand_prompt(r, 0)
    [100, 101, 102, 7, 8]
    """
    _check_request_index(request_index)
    num_tokens = request.input_length
    if request.token_ids is not None:
        prompt = list(request.token_ids[:num_tokens])
    elif request.token_id_ranges:
        prompt = _expand_ranges(request.token_id_ranges, num_tokens)
    else:
        prompt = _expand_blocks(request.block_ids, request.trace_block_size, num_tokens)
    num_explicit = len(prompt)
    if num_explicit < num_tokens:
        base = FILL_TOKEN_BASE + request_index * FILL_TOKENS_PER_REQUEST
        prompt.extend(range(base + num_explicit, base + num_tokens))
    return prompt


def _check_request_index(request_index: int) -> None:
    """``ConfigError`` unless ``request_index`` is an integer in ``[0, MAX_REQUEST_INDEX)``
    (index ``i`` owns the fill ids from ``FILL_TOKEN_BASE + i * FILL_TOKENS_PER_REQUEST``).

    >>> _check_request_index(3)
    >>> _check_request_index(True)
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: request_index=True is invalid: must be an integer in [0, ...)
    """
    if not _is_int(request_index) or not 0 <= request_index < MAX_REQUEST_INDEX:
        raise ConfigError("request_index", request_index,
                          f"must be an integer in [0, {MAX_REQUEST_INDEX})")


def prompt_slice(request: TraceRequest, request_index: int, start: int, stop: int,
                 ) -> list[int]:
    """``expand_prompt(request, request_index)[start:stop]`` (``0 <= start``), expanding only
    those positions for block-id traces (a replayer reads a 100 k-token prompt's last
    partial block without building the whole list).

    >>> r = TraceRequest("r", input_length=10, output_length=1, block_ids=(5, 2),
    ...                  trace_block_size=4)
    >>> prompt_slice(r, 0, 3, 6) == expand_prompt(r, 0)[3:6] == [23, 8, 9]
    True
    """
    if request.token_ids is not None or request.token_id_ranges or not request.trace_block_size:
        return expand_prompt(request, request_index)[start:stop]
    _check_request_index(request_index)
    num_tokens = request.input_length
    start, stop = min(start, num_tokens), min(stop, num_tokens)
    size = request.trace_block_size
    num_explicit = min(len(request.block_ids) * size, num_tokens)
    ids: list[int] = []
    position = start
    while position < min(stop, num_explicit):
        offset = position % size
        take = min(size - offset, min(stop, num_explicit) - position)
        first = request.block_ids[position // size] * size + offset
        ids.extend(range(first, first + take))
        position += take
    if stop > num_explicit:
        base = FILL_TOKEN_BASE + request_index * FILL_TOKENS_PER_REQUEST
        ids.extend(range(base + max(start, num_explicit), base + stop))
    return ids


def _expand_blocks(block_ids: Sequence[int], block_size: int, num_tokens: int) -> list[int]:
    # NOTE: extend(range(...)) per block runs the per-token loop in C (~19 ns/token), which
    # matters for the 730 M tokens of the WEKA trace; a nested comprehension is ~50% slower.
    num_blocks = min(len(block_ids), -(-num_tokens // block_size)) if block_size else 0
    prompt: list[int] = []
    extend = prompt.extend
    for block_id in block_ids[:num_blocks]:
        start = block_id * block_size
        extend(range(start, start + block_size))
    del prompt[num_tokens:]
    return prompt


def _expand_ranges(ranges: Sequence[tuple[int, int]], num_tokens: int) -> list[int]:
    prompt: list[int] = []
    for start, end in ranges:
        remaining = num_tokens - len(prompt)
        if remaining <= 0:
            break
        prompt.extend(range(start, min(end, start + remaining)))
    return prompt


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slice comparisons, no
    per-element Python loop).

    >>> common_prefix_length((1, 2, 3, 4), (1, 2, 9)), common_prefix_length((), (1,))
    (2, 0)
    >>> common_prefix_length((5, 6), (5, 6, 7))
    2
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
