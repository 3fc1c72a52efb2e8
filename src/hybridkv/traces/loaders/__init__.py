"""Trace loaders, one module per format, behind ``load_trace`` (format auto-detection).

Detection, in order (``format=`` overrides it):

=========================================  =========
path                                       format
=========================================  =========
directory containing ``0_trace.jsonl``     ragpulse
directory of ``*.json`` / ``*.json.gz``    weka
file ``*.json`` / ``*.json.gz``            weka
file ``0_trace.jsonl``                     ragpulse (its directory)
other file, first line has ``hash_ids``    mooncake (a list) / ragpulse (an object)
other file, first line has ``tokens``,     native
``token_ranges``, ``block_ids`` or the
native header
=========================================  =========

Every problem raises ``TraceFormatError`` naming the path, line and field.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal

from hybridkv.errors import TraceFormatError
from hybridkv.traces.loaders.fields import read_first_object, require_existing
from hybridkv.traces.loaders.mooncake import load_mooncake
from hybridkv.traces.loaders.native import dump_native, is_native_object, load_native
from hybridkv.traces.loaders.ragpulse import TRACE_FILE_NAME, is_ragpulse_dir, load_ragpulse
from hybridkv.traces.loaders.weka import is_weka_file, load_weka
from hybridkv.traces.trace import Trace

TraceFormat = Literal["mooncake", "weka", "ragpulse", "native"]

LOADERS: Final[dict[str, Callable[..., Trace]]] = {
    "mooncake": load_mooncake,
    "weka": load_weka,
    "ragpulse": load_ragpulse,
    "native": load_native,
}


def load_trace(path: str | Path, *, limit: int | None = None,
               format: TraceFormat | None = None) -> Trace:
    """Load a trace file or directory, detecting its format unless ``format`` is given.

    Args:
        path: file or directory.
        limit: keep the first N requests in trace order (WEKA: after global ordering).
        format: ``"mooncake"``, ``"weka"``, ``"ragpulse"`` or ``"native"``.

    Raises:
        TraceFormatError: missing path, unknown format, or a malformed line.
    """
    if not str(path).strip():  # Path("") would be the current directory
        raise TraceFormatError(str(path), None, "path", "is empty; name a trace file or "
                               "directory")
    trace_path = Path(path)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 0):
        raise TraceFormatError(str(trace_path), None, "limit",
                               f"must be a non-negative integer, got {limit!r}")
    chosen = format if format is not None else detect_format(trace_path)
    if chosen not in LOADERS:
        raise TraceFormatError(str(trace_path), None, "format",
                               f"unknown format {chosen!r}; choose one of {sorted(LOADERS)}")
    require_existing(trace_path)
    try:
        return LOADERS[chosen](trace_path, limit=limit)
    except OSError as err:  # an unreadable file or directory inside the trace
        raise TraceFormatError(err.filename or str(trace_path), None, "path",
                               f"cannot be read ({err.strerror}); check its permissions",
                               ) from err


def detect_format(path: Path) -> TraceFormat:
    """Guess the format of ``path`` (see the module docstring's table)."""
    require_existing(path)
    if path.is_dir():
        try:
            if is_ragpulse_dir(path):
                return "ragpulse"
            if any(is_weka_file(p) for p in path.iterdir()):
                return "weka"
        except OSError as err:
            raise TraceFormatError(str(path), None, "path", f"cannot be listed "
                                   f"({err.strerror}); check its permissions") from err
        raise TraceFormatError(str(path), None, "path",
                               f"directory holds neither {TRACE_FILE_NAME} nor *.json(.gz) "
                               "conversation files")
    if is_weka_file(path):
        return "weka"
    if path.name == TRACE_FILE_NAME:
        return "ragpulse"
    line_number, first = read_first_object(path)
    hash_ids = first.get("hash_ids")
    if isinstance(hash_ids, list):
        return "mooncake"
    if isinstance(hash_ids, dict):
        return "ragpulse"
    if is_native_object(first):
        return "native"
    raise TraceFormatError(str(path), line_number, "<format>",
                           "cannot tell the format: expected 'hash_ids' (Mooncake), "
                           "'tokens'/'token_ranges'/'block_ids' (native); pass format=")


__all__ = ["LOADERS", "TraceFormat", "detect_format", "dump_native", "load_trace"]
