"""WEKA / kv-cache-tester agentic traces: one JSON (or gzip JSON) conversation per file.

A conversation has ``block_size`` (64), ``hash_id_scope`` ``"local"`` and ``requests[]``; a
request has ``t`` (seconds from the conversation start), ``in``, ``out`` and ``hash_ids``
(chained ids of the *full* blocks only: ``len == floor(in / 64)``; the partial tail is filled
with ids unique to the request). An entry with ``type: "subagent"`` carries its own
``requests[]`` timed from the sub-agent's start ``t``.

Choices made here (the replay is closed loop, so arrival only orders the queue):

- **Namespacing.** Ids are local to a file (sub-agents share their parent's namespace), so
  file ``i`` (sorted by name) maps id ``h`` to ``(i << 32) | h``; ids must be ``< 2**32``.
  Trace blocks of 64 tokens then expand to token ids ``< 87 * 2**38``, below the fill range.
- **Sessions.** Each conversation is a session named after the file stem
  (``trace_0017``); the k-th sub-agent of a file is its own session ``trace_0017/sub0``, …
- **Offsets.** Every conversation starts at t = 0; a sub-agent request arrives at
  ``entry.t + request.t``. Requests are ordered globally by arrival, ties by file then
  position in the file, so conversations interleave from the first step on.

Example: 87 files → 6,368 requests, 729,711,031 input tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from hybridkv.traces.loaders.fields import (
    JsonObject,
    Where,
    checked,
    read_json_document,
    require_existing,
    require_field,
    require_int,
    require_int_list,
    require_number,
)
from hybridkv.traces.trace import Trace, TraceRequest

WEKA_BLOCK_SIZE: Final = 64
"""Tokens per WEKA trace block (the files' ``block_size``)."""

NAMESPACE_BITS: Final = 32
"""Local ids must be ``< 2**32``; the file index goes above them."""

MAX_FILES: Final = 1 << 12
"""Files one load may merge: keeps ``(index << 32 | id) * 64`` below the fill id range."""


@dataclass(frozen=True, slots=True)
class _Timed:
    arrival_seconds: float
    file_index: int
    position: int
    request: TraceRequest


def is_weka_file(path: Path) -> bool:
    """``*.json`` or ``*.json.gz``: the only file names the WEKA loader reads."""
    return path.name.endswith((".json", ".json.gz"))


def load_weka(path: Path, *, limit: int | None = None) -> Trace:
    """Load one conversation file or a directory of them; ``limit`` keeps the first N
    requests after global ordering."""
    files = _conversation_files(path)
    timed: list[_Timed] = []
    for file_index, file_path in enumerate(files):
        timed.extend(_load_conversation(file_path, file_index))
    timed.sort(key=lambda t: (t.arrival_seconds, t.file_index, t.position))
    if limit is not None:
        timed = timed[:limit]
    name = path.name.removesuffix(".gz").removesuffix(".json")
    return Trace(name, tuple(t.request for t in timed), source=str(path), format="weka")


def _conversation_files(path: Path) -> list[Path]:
    require_existing(path)
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and is_weka_file(p))
    if not files:
        raise Where(str(path)).error("path", "directory holds no *.json or *.json.gz files")
    if len(files) > MAX_FILES:
        raise Where(str(path)).error("path", f"holds {len(files)} files; at most {MAX_FILES}")
    return files


def _load_conversation(path: Path, file_index: int) -> list[_Timed]:
    doc = read_json_document(path)
    where = Where(str(path))
    block_size = WEKA_BLOCK_SIZE
    if doc.get("block_size") is not None:
        block_size = require_int(doc, "block_size", where, minimum=1)
    scope = doc.get("hash_id_scope", "local")
    if scope != "local":
        raise where.error("hash_id_scope", f"only 'local' is supported, got {scope!r}")
    stem = path.name.removesuffix(".gz").removesuffix(".json")
    loader = _ConversationLoader(where, file_index, block_size)
    for idx, entry in enumerate(_entries(doc, where)):
        entry_where = Where(str(path), None, f"requests[{idx}].")
        if entry.get("type") == "subagent":
            start = require_number(entry, "t", entry_where)
            session = f"{stem}/sub{loader.num_subagents}"
            loader.num_subagents += 1
            for sub_idx, sub in enumerate(_entries(entry, entry_where)):
                sub_where = Where(str(path), None, f"requests[{idx}].requests[{sub_idx}].")
                loader.add(sub, sub_where, session, start)
        else:
            loader.add(entry, entry_where, stem, 0.0)
    return loader.timed


def _entries(obj: JsonObject, where: Where) -> list[JsonObject]:
    entries = require_field(obj, "requests", where)
    if not isinstance(entries, list):
        raise where.error("requests", f"must be a list, got {type(entries).__name__}")
    for idx, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise where.error(f"requests[{idx}]", "must be a JSON object")
    return entries


class _ConversationLoader:
    """Turns the requests of one file into ``_Timed`` records, session by session."""

    def __init__(self, where: Where, file_index: int, block_size: int) -> None:
        self.where = where
        self.file_index = file_index
        self.block_size = block_size
        self.namespace = file_index << NAMESPACE_BITS
        self.num_subagents = 0
        self.timed: list[_Timed] = []
        self._session_sizes: dict[str, int] = {}
        # NOTE: one shared int object per distinct id keeps 11 M namespaced ids at 8 bytes each.
        self._interned: dict[int, int] = {}

    def add(self, obj: JsonObject, where: Where, session: str, offset_seconds: float) -> None:
        t = require_number(obj, "t", where)
        input_length = require_int(obj, "in", where, minimum=1)
        output_length = require_int(obj, "out", where)
        hash_ids = require_int_list(obj, "hash_ids", where, limit=1 << NAMESPACE_BITS)
        num_full_blocks = input_length // self.block_size
        if len(hash_ids) != num_full_blocks:
            raise where.error(
                "hash_ids",
                f"has {len(hash_ids)} ids but in={input_length} needs "
                f"floor({input_length} / {self.block_size}) = {num_full_blocks}",
            )
        index_in_session = self._session_sizes.get(session, 0)
        self._session_sizes[session] = index_in_session + 1
        arrival = offset_seconds + t
        block_ids = self._namespaced(hash_ids)
        request = checked(where, lambda: TraceRequest(
            request_id=f"{session}:{index_in_session}",
            input_length=input_length,
            output_length=output_length,
            block_ids=block_ids,
            trace_block_size=self.block_size,
            session_id=session,
            arrival_seconds=arrival,
        ))
        self.timed.append(_Timed(arrival, self.file_index, len(self.timed), request))

    def _namespaced(self, hash_ids: list[int]) -> tuple[int, ...]:
        interned = self._interned
        namespace = self.namespace
        for new_id in set(hash_ids).difference(interned):
            interned[new_id] = namespace | new_id
        return tuple(map(interned.__getitem__, hash_ids))

