"""RAGPulse traces: a directory with ``0_trace.jsonl`` and five content-length files.

``0_trace.jsonl`` lines carry ``timestamp`` (string, seconds), ``input_length``,
``output_length``, ``session_id`` and ``hash_ids``: a dict of *content* ids per prompt
component. Files ``1_sys_prompt.jsonl`` … ``5_web_search.jsonl`` give each id's
``token_length``. Components are laid out in prompt order::

    sys_prompt | passages_ids | history | web_search | user_input | template (6–12 tokens)

Content id ``c`` of component kind ``k`` (1–5, the file number) with ``n`` tokens becomes the
token-id range ``[base, base + n)`` with ``base = (k << 44) | (c << 20)``: distinct content gets
disjoint ids, equal content equal ids, so prefix matching works at any block size. The
template tokens the trace adds (``input_length`` minus the components' sum) are not
identified; they go last and are filled with ids unique to the request.

Arrival: the file is two samples whose timestamps both start at 0 (line 3,801 restarts at
0 s). Trace order is file order; when a timestamp goes backwards, ``arrival_seconds``
continues from the previous request's arrival so it increases with trace order too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from hybridkv.traces.loaders.fields import (
    JsonObject,
    Where,
    checked,
    read_json_lines,
    require_existing,
    require_field,
    require_int,
    require_str,
)
from hybridkv.traces.trace import Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class ComponentKind:
    """One prompt component: its key in ``hash_ids``, its length file and that file's id
    field."""

    kind_id: int
    key: str
    file_name: str
    id_field: str


COMPONENTS: Final = (
    ComponentKind(1, "sys_prompt", "1_sys_prompt.jsonl", "sys_prompt_id"),
    ComponentKind(2, "passages_ids", "2_passages.jsonl", "passage_id"),
    ComponentKind(3, "history", "3_history.jsonl", "history_id"),
    ComponentKind(5, "web_search", "5_web_search.jsonl", "web_search_id"),
    ComponentKind(4, "user_input", "4_user_input.jsonl", "user_input_id"),
)
"""The components in prompt order; ``kind_id`` is the number of the component's file."""

TRACE_FILE_NAME: Final = "0_trace.jsonl"
CONTENT_ID_BITS: Final = 24
TOKEN_OFFSET_BITS: Final = 20
_KIND_SHIFT: Final = CONTENT_ID_BITS + TOKEN_OFFSET_BITS


def content_token_range(kind_id: int, content_id: int, num_tokens: int) -> tuple[int, int]:
    """Token ids of one content chunk, half-open.

    >>> content_token_range(kind_id=2, content_id=3, num_tokens=5)
    (35184375234560, 35184375234565)
    >>> (2 << 44) | (3 << 20)
    35184375234560
    """
    base = (kind_id << _KIND_SHIFT) | (content_id << TOKEN_OFFSET_BITS)
    return base, base + num_tokens


def is_ragpulse_dir(path: Path) -> bool:
    return path.is_dir() and (path / TRACE_FILE_NAME).is_file()


def load_ragpulse(path: Path, *, limit: int | None = None) -> Trace:
    """Load a RAGPulse directory (or its ``0_trace.jsonl``); ``limit`` keeps the first N
    requests in file order."""
    require_existing(path)
    directory = path if path.is_dir() else path.parent
    trace_path = directory / TRACE_FILE_NAME
    require_existing(trace_path)
    lengths = {kind.key: _load_lengths(directory / kind.file_name, kind) for kind in COMPONENTS}
    requests: list[TraceRequest] = []
    last_arrival = 0.0
    arrival_offset = 0.0
    for line_number, obj in read_json_lines(trace_path):
        if limit is not None and len(requests) >= limit:
            break
        where = Where(str(trace_path), line_number)
        timestamp = _parse_timestamp(obj, where)
        if timestamp + arrival_offset < last_arrival:
            arrival_offset = last_arrival - timestamp
        last_arrival = timestamp + arrival_offset
        requests.append(_parse_request(obj, where, lengths, len(requests), last_arrival))
    return Trace(directory.name, tuple(requests), source=str(directory), format="ragpulse")


def _load_lengths(path: Path, kind: ComponentKind) -> dict[int, int]:
    if not path.is_file():
        raise Where(str(path)).error(
            "path", f"is missing; a RAGPulse directory needs {TRACE_FILE_NAME} and the five "
            f"length files ({', '.join(k.file_name for k in COMPONENTS)})")
    lengths: dict[int, int] = {}
    for line_number, obj in read_json_lines(path, allow_empty=True):
        where = Where(str(path), line_number)
        content_id = require_int(obj, kind.id_field, where)
        if content_id >= 1 << CONTENT_ID_BITS:
            raise where.error(kind.id_field, f"must be < 2**{CONTENT_ID_BITS}, got {content_id}")
        num_tokens = require_int(obj, "token_length", where, minimum=1)
        if num_tokens >= 1 << TOKEN_OFFSET_BITS:
            raise where.error("token_length", f"must be < 2**{TOKEN_OFFSET_BITS}, got {num_tokens}")
        if content_id in lengths:
            raise where.error(kind.id_field, f"id {content_id} is listed twice")
        lengths[content_id] = num_tokens
    return lengths


def _parse_timestamp(obj: JsonObject, where: Where) -> float:
    raw = require_field(obj, "timestamp", where)
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise where.error("timestamp", f"must be seconds as a string or number, got {raw!r}")
    try:
        seconds = float(raw)
    except ValueError as err:
        raise where.error("timestamp", f"must be seconds, got {raw!r}") from err
    if not 0.0 <= seconds < float("inf"):
        raise where.error("timestamp", f"must be finite and >= 0, got {raw!r}")
    return seconds


def _parse_request(obj: JsonObject, where: Where, lengths: dict[str, dict[int, int]],
                   index: int, arrival_seconds: float) -> TraceRequest:
    input_length = require_int(obj, "input_length", where, minimum=1)
    output_length = require_int(obj, "output_length", where)
    session_id = require_str(obj, "session_id", where)
    components = require_field(obj, "hash_ids", where)
    if not isinstance(components, dict):
        raise where.error("hash_ids", "must be an object of component id lists")
    unknown = sorted(set(components) - {kind.key for kind in COMPONENTS})
    if unknown:
        raise where.error("hash_ids", f"unknown components {unknown}")
    ranges: list[tuple[int, int]] = []
    inside = Where(where.path, where.line, "hash_ids.")
    for kind in COMPONENTS:
        field = f"hash_ids.{kind.key}"
        content_ids = require_field(components, kind.key, inside)
        if not isinstance(content_ids, list):
            raise where.error(field, f"must be a list of content ids, got {content_ids!r}")
        known = lengths[kind.key]
        for content_id in content_ids:
            if type(content_id) is not int or content_id not in known:
                raise where.error(field, f"unknown content id {content_id!r} "
                                         f"(not in {kind.file_name})")
            ranges.append(content_token_range(kind.kind_id, content_id, known[content_id]))
    num_content_tokens = sum(end - start for start, end in ranges)
    if num_content_tokens > input_length:
        raise where.error("input_length", f"{input_length} is shorter than its components' "
                                          f"{num_content_tokens} tokens")
    return checked(where, lambda: TraceRequest(
        request_id=f"ragpulse-{index}",
        input_length=input_length,
        output_length=output_length,
        session_id=session_id,
        arrival_seconds=arrival_seconds,
        token_id_ranges=tuple(ranges),
    ))
