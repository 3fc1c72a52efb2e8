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
from hybridkv.limits import available_memory_bytes, format_bytes
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
    if limit is None:
        check_trace_fits(trace_path)
    try:
        return LOADERS[chosen](trace_path, limit=limit)
    except OSError as err:  # an unreadable file or directory inside the trace
        raise TraceFormatError(err.filename or str(trace_path), None, "path",
                               f"cannot be read ({err.strerror}); check its permissions",
                               ) from err


BYTES_PER_TRACE_BYTE: Final = 12
"""Host memory a loaded trace holds per byte of its file, worst case, rounded up (peak with
``tracemalloc``: 5.0 for the Mooncake trace, 5.5 for one-block Mooncake lines, 7.8 for
RAGPulse's ``0_trace.jsonl``, 9.9 for one-token native lines; ``tests/unit/test_loaders.py``
re-measures it)."""


def check_trace_fits(path: Path, *, available: int | None = None) -> None:
    """Refuse, before reading it, a trace file whose requests would not fit the host's
    available memory (``hybridkv.limits``; a 10 GB file of one-block Mooncake lines is ~55 GB
    of Python objects): the error names the sizes and ``--limit``. Directories (WEKA,
    RAGPulse) are not checked.

    >>> import tempfile
    >>> trace = Path(tempfile.mkdtemp()) / "t.jsonl"
    >>> _ = trace.write_text("x" * 2048)
    >>> check_trace_fits(trace, available=1 << 20)
    >>> check_trace_fits(trace, available=8 << 10)
    Traceback (most recent call last):
    ...
    hybridkv.errors.TraceFormatError: ...: field 'file': is 2.0 KiB: loading it whole needs \
~24.0 KiB of host memory, but 8.0 KiB are available; pass --limit N to load its first N \
requests
    """
    if not path.is_file():
        return
    if available is None:
        available = available_memory_bytes()
    size = path.stat().st_size
    if available is None or size * BYTES_PER_TRACE_BYTE <= available:
        return
    raise TraceFormatError(str(path), None, "file", f"is {format_bytes(size)}: loading it "
                           f"whole needs ~{format_bytes(size * BYTES_PER_TRACE_BYTE)} of host "
                           f"memory, but {format_bytes(available)} are available; pass "
                           "--limit N to load its first N requests")


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


__all__ = ["BYTES_PER_TRACE_BYTE", "LOADERS", "TraceFormat", "check_trace_fits", "detect_format",
           "dump_native", "load_trace"]
