"""Mooncake JSONL traces: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

Each ``hash_ids`` entry stands for one 512-token block and is *chained* (equal ids mean equal
prefixes), so ``len(hash_ids) == ceil(input_length / 512)``. Ids are global to the file and are
used as trace block ids unchanged; requests have no session.

Example line (2 blocks: tokens ``[0, 512)`` and ``[512, 1000)``)::

    {"timestamp": 27, "input_length": 1000, "output_length": 4, "hash_ids": [0, 1]}
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from hybridkv.traces.loaders.fields import (
    JsonObject,
    Where,
    checked,
    read_json_lines,
    require_int,
    require_int_list,
    require_number,
)
from hybridkv.traces.trace import FILL_TOKEN_BASE, Trace, TraceRequest

MOONCAKE_BLOCK_SIZE: Final = 512
"""Tokens per Mooncake trace block."""

_MAX_BLOCK_ID: Final = FILL_TOKEN_BASE // MOONCAKE_BLOCK_SIZE


def load_mooncake(path: Path, *, limit: int | None = None) -> Trace:
    """Load a Mooncake trace; ``limit`` keeps the first N requests (file order)."""
    requests: list[TraceRequest] = []
    for line_number, obj in read_json_lines(path):
        if limit is not None and len(requests) >= limit:
            break
        where = Where(str(path), line_number)
        requests.append(_parse_request(obj, where, index=len(requests)))
    return Trace(path.stem, tuple(requests), source=str(path), format="mooncake")


def _parse_request(obj: JsonObject, where: Where, index: int) -> TraceRequest:
    timestamp_ms = require_number(obj, "timestamp", where)
    input_length = require_int(obj, "input_length", where, minimum=1)
    output_length = require_int(obj, "output_length", where)
    hash_ids = require_int_list(obj, "hash_ids", where, limit=_MAX_BLOCK_ID)
    num_blocks = -(-input_length // MOONCAKE_BLOCK_SIZE)
    if len(hash_ids) != num_blocks:
        raise where.error(
            "hash_ids",
            f"has {len(hash_ids)} ids but input_length={input_length} needs "
            f"ceil({input_length} / {MOONCAKE_BLOCK_SIZE}) = {num_blocks}",
        )
    return checked(where, lambda: TraceRequest(
        request_id=f"mooncake-{index}",
        input_length=input_length,
        output_length=output_length,
        block_ids=tuple(hash_ids),
        trace_block_size=MOONCAKE_BLOCK_SIZE,
        arrival_seconds=timestamp_ms / 1000.0,
    ))
