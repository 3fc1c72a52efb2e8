"""hybridkv's own JSONL trace format (version 1): read with ``load_native``, write with
``dump_native``. The same specification lives in ``docs/trace-format.md``.

An optional first line is a header: ``{"hybridkv_trace": 1, "name": "my-trace"}``. Every other
non-blank line is one request, a JSON object with these keys (unknown keys are errors, so a
typo never passes silently):

====================  ========  ==========================================================
key                   required  meaning
====================  ========  ==========================================================
``output_length``     yes       tokens to sample, integer >= 0
``tokens``            one of    explicit prompt token ids, each in ``[0, 2**50)``
``token_ranges``      the       ``[[start, end], ...]``: half-open id ranges laid end to end
``block_ids``         three     trace block ids; block ``h`` expands to ``h*B … h*B+B-1``
``block_size``        w/ blocks ``B``, tokens per trace block (required with ``block_ids``)
``input_length``      no        prompt tokens; default: the number of expanded ids. The
                                expansion is cut to it; missing positions get ids unique
                                to the request (replay protocol)
``id``                no        unique request id (default ``req-<index>``)
``output_tokens``     no        predetermined output ids (``len == output_length``), each
                                in ``[0, 2**50)``
``session_id``        no        requests of one session run one after another
``arrival_seconds``   no        number >= 0 (the closed-loop replay uses trace order)
``phase``             no        integer >= 0, a barrier: phase k starts after phase < k ends
``tag``               no        label for per-group reporting
====================  ========  ==========================================================

Example (two requests sharing their first 64-token block)::

    {"hybridkv_trace": 1, "name": "tiny"}
    {"id": "a", "block_ids": [7, 8], "block_size": 64, "input_length": 100, "output_length": 4}
    {"id": "b", "block_ids": [7, 9], "block_size": 64, "output_length": 4, "session_id": "s1"}
    {"tokens": [1, 2, 3, 4], "output_length": 2, "output_tokens": [5, 6], "phase": 1}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

from hybridkv.errors import TraceFormatError
from hybridkv.traces.loaders.fields import (
    JsonObject,
    Where,
    check_int_list,
    checked,
    optional_int,
    optional_number,
    optional_str,
    read_json_lines,
    require_field,
    require_int,
    require_int_list,
)
from hybridkv.traces.trace import FILL_TOKEN_BASE, Trace, TraceRequest

FORMAT_VERSION: Final = 1
HEADER_KEY: Final = "hybridkv_trace"
PROMPT_KEYS: Final = ("tokens", "token_ranges", "block_ids")
_REQUEST_KEYS: Final = frozenset({
    *PROMPT_KEYS, "block_size", "input_length", "output_length", "id", "output_tokens",
    "session_id", "arrival_seconds", "phase", "tag",
})


def is_native_object(obj: JsonObject) -> bool:
    """Whether a first line looks like this format (header or a request line)."""
    return HEADER_KEY in obj or any(key in obj for key in PROMPT_KEYS)


def load_native(path: Path, *, limit: int | None = None) -> Trace:
    """Load a native trace; ``limit`` keeps the first N requests in file order."""
    name = path.stem
    requests: list[TraceRequest] = []
    for line_number, obj in read_json_lines(path):
        where = Where(str(path), line_number)
        if HEADER_KEY in obj:
            name = _parse_header(obj, where, is_first=not requests, default_name=name)
            continue
        if limit is not None and len(requests) >= limit:
            break
        requests.append(_parse_request(obj, where, len(requests)))
    try:
        return Trace(name, tuple(requests), source=str(path), format="native")
    except ValueError as err:  # duplicate ids: find the line that repeats one
        raise _duplicate_id_error(path, requests) from err


def _parse_header(obj: JsonObject, where: Where, *, is_first: bool, default_name: str) -> str:
    if not is_first:
        raise where.error(HEADER_KEY, "the header must be the first line")
    version = obj[HEADER_KEY]
    if version != FORMAT_VERSION:
        raise where.error(HEADER_KEY, f"unsupported version {version!r}; "
                                      f"this hybridkv reads version {FORMAT_VERSION}")
    return optional_str(obj, "name", where) or default_name


def _parse_request(obj: JsonObject, where: Where, index: int) -> TraceRequest:
    unknown = sorted(set(obj) - _REQUEST_KEYS)
    if unknown:
        raise where.error(unknown[0], f"unknown key; allowed keys: {sorted(_REQUEST_KEYS)}")
    present = [key for key in PROMPT_KEYS if key in obj]
    if len(present) != 1:
        raise where.error("tokens", f"give exactly one of {list(PROMPT_KEYS)}, got {present}")
    tokens: tuple[int, ...] | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    block_ids: tuple[int, ...] = ()
    block_size = 0
    if present[0] == "tokens":
        tokens = tuple(require_int_list(obj, "tokens", where, limit=FILL_TOKEN_BASE))
        num_expanded = len(tokens)
    elif present[0] == "token_ranges":
        ranges = _parse_ranges(obj, where)
        num_expanded = sum(end - start for start, end in ranges)
    else:
        block_size = require_int(obj, "block_size", where, minimum=1)
        block_ids = tuple(require_int_list(obj, "block_ids", where,
                                           limit=FILL_TOKEN_BASE // block_size))
        num_expanded = len(block_ids) * block_size
    input_length = optional_int(obj, "input_length", where, minimum=1)
    output_tokens = None
    if obj.get("output_tokens") is not None:
        output_tokens = tuple(require_int_list(obj, "output_tokens", where,
                                               limit=FILL_TOKEN_BASE))
    request_id = optional_str(obj, "id", where) or f"req-{index}"
    keys = {"output_token_ids": "output_tokens", "token_ids": "tokens",
            "token_id_ranges": "token_ranges", "block_ids": "block_ids",
            "input_length": "input_length" if input_length is not None else present[0]}
    return checked(where, lambda: TraceRequest(
        request_id=request_id,
        input_length=num_expanded if input_length is None else input_length,
        output_length=require_int(obj, "output_length", where),
        block_ids=block_ids,
        trace_block_size=block_size,
        token_ids=tokens,
        output_token_ids=output_tokens,
        session_id=optional_str(obj, "session_id", where),
        arrival_seconds=optional_number(obj, "arrival_seconds", where),
        phase=optional_int(obj, "phase", where) or 0,
        tag=optional_str(obj, "tag", where),
        token_id_ranges=ranges,
    ), keys=keys)


def _parse_ranges(obj: JsonObject, where: Where) -> tuple[tuple[int, int], ...]:
    raw = require_field(obj, "token_ranges", where)
    if not isinstance(raw, list) or not raw:
        raise where.error("token_ranges", "must be a non-empty list of [start, end] pairs")
    ranges: list[tuple[int, int]] = []
    for idx, pair in enumerate(raw):
        field = f"token_ranges[{idx}]"
        values = check_int_list(pair, field, where, limit=FILL_TOKEN_BASE + 1)
        if len(values) != 2 or values[0] >= values[1]:
            raise where.error(field, f"must be [start, end] with start < end, got {pair!r}")
        ranges.append((values[0], values[1]))
    return tuple(ranges)


def _duplicate_id_error(path: Path, requests: list[TraceRequest]) -> TraceFormatError:
    seen: set[str] = set()
    for idx, request in enumerate(requests):
        if request.request_id in seen:
            return TraceFormatError(str(path), None, "id",
                                    f"request id {request.request_id!r} repeats "
                                    f"(request #{idx + 1})")
        seen.add(request.request_id)
    return TraceFormatError(str(path), None, "id", "request ids repeat")  # pragma: no cover


def dump_native(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` in this format; ``load_native`` reads back equal requests.

    Requests keep their representation (tokens, ranges or blocks) and explicit
    ``input_length``, so fill positions expand the same way after a round trip.
    """
    with Path(path).open("w", encoding="utf-8") as stream:
        header = {HEADER_KEY: FORMAT_VERSION, "name": trace.name}
        stream.write(json.dumps(header) + "\n")
        for request in trace.requests:
            stream.write(json.dumps(_request_object(request), separators=(",", ":")) + "\n")


def _request_object(request: TraceRequest) -> dict[str, object]:
    obj: dict[str, object] = {"id": request.request_id}
    if request.token_ids is not None:
        obj["tokens"] = list(request.token_ids)
    elif request.token_id_ranges:
        obj["token_ranges"] = [list(pair) for pair in request.token_id_ranges]
    else:
        obj["block_ids"] = list(request.block_ids)
        obj["block_size"] = request.trace_block_size or 1
    obj["input_length"] = request.input_length
    obj["output_length"] = request.output_length
    optional: dict[str, object] = {
        "output_tokens": None if request.output_token_ids is None
        else list(request.output_token_ids),
        "session_id": request.session_id,
        "arrival_seconds": request.arrival_seconds,
        "phase": request.phase or None,
        "tag": request.tag,
    }
    obj.update((key, value) for key, value in optional.items() if value is not None)
    return obj
