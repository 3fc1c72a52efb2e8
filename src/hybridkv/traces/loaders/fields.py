"""Reading JSON(L) trace files and checking their fields, with ``TraceFormatError`` on misuse.

Every problem names the file, the 1-based line (``None`` for whole-file JSON) and the field,
so a user can open the file at the right place:

>>> require_int({"input_length": -2}, "input_length", Where("t.jsonl", 3))
Traceback (most recent call last):
...
hybridkv.errors.TraceFormatError: t.jsonl:3: field 'input_length': must be an integer >= 0, got -2
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

from hybridkv.errors import ConfigError, TraceFormatError

JsonObject = dict[str, object]
T = TypeVar("T")

MAX_LINE_CHARS: Final = 64 << 20
"""Longest JSONL line read (64 Mi characters: ~4 M explicit token ids, or a Mooncake line
of 7 M blocks); a file without newlines (``/dev/zero`` behind a symlink, a binary) stops
here instead of filling memory."""

MAX_DOCUMENT_CHARS: Final = 512 << 20
"""Largest whole-file JSON document, after decompression (512 Mi characters; the bundled
WEKA conversations decompress to at most 3 MB): a gzip bomb stops here."""


@dataclass(frozen=True, slots=True)
class Where:
    """A place in a trace file: path, 1-based line (``None``: whole-file JSON) and a prefix
    for field names (``"requests[3]."`` inside a WEKA conversation)."""

    path: str
    line: int | None = None
    prefix: str = ""

    def error(self, field: str, problem: str) -> TraceFormatError:
        return TraceFormatError(self.path, self.line, self.prefix + field, problem)


def checked(where: Where, build: Callable[[], T], *,
            keys: Mapping[str, str] | None = None) -> T:
    """Run ``build`` (a record constructor) and turn its ``ConfigError`` into a located
    ``TraceFormatError``; ``keys`` maps the record's field names to the trace's own keys
    (``output_token_ids`` → ``output_tokens``), so the error names what the file says."""
    try:
        return build()
    except ConfigError as err:
        field = (keys or {}).get(err.field, err.field)
        raise where.error(field, f"{err.value!r} is invalid: {err.fix}") from err


def require_existing(path: Path) -> None:
    """Raise ``TraceFormatError`` unless ``path`` is an existing regular file or directory
    (FIFOs, devices and sockets are refused: reading one may never end)."""
    if not str(path).strip():
        raise TraceFormatError(str(path), None, "path", "is empty; name a trace file or "
                               "directory")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise TraceFormatError(str(path), None, "path",
                               "does not exist; check the trace path") from None
    except OSError as err:
        raise TraceFormatError(str(path), None, "path",
                               f"cannot be inspected ({err.strerror}); check its "
                               "permissions") from err
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise TraceFormatError(str(path), None, "path", "is not a regular file or directory "
                               "(a FIFO, device or socket); save the trace to a file first")


def read_json_lines(path: Path, *, allow_empty: bool = False,
                    ) -> Iterator[tuple[int, JsonObject]]:
    """Yield ``(line_number, object)`` for every non-blank line of a JSONL file.

    Raises:
        TraceFormatError: unreadable file, bad JSON, a line that is not an object, or (unless
            ``allow_empty``) no line at all.
    """
    require_existing(path)
    found = False
    try:
        with path.open("r", encoding="utf-8-sig") as stream:
            line_number = 0
            while text := stream.readline(MAX_LINE_CHARS + 1):
                line_number += 1
                if len(text) > MAX_LINE_CHARS:
                    raise TraceFormatError(str(path), line_number, "<line>",
                                           f"longer than {MAX_LINE_CHARS:,} characters; is "
                                           "this a JSONL trace?")
                if not text.strip():
                    continue
                found = True
                yield line_number, _parse_object(text, Where(str(path), line_number))
    except (OSError, UnicodeDecodeError) as err:
        raise TraceFormatError(str(path), None, "file", f"cannot be read: {err}") from err
    if not found and not allow_empty:
        raise TraceFormatError(str(path), None, "file", "is empty (no JSON lines)")


def read_first_object(path: Path) -> tuple[int, JsonObject]:
    """The first non-blank line of a JSONL file, parsed (for format detection)."""
    for line_number, obj in read_json_lines(path):
        return line_number, obj
    raise AssertionError("read_json_lines raises on empty files")  # pragma: no cover


def read_json_document(path: Path) -> JsonObject:
    """Parse a whole ``.json`` or gzip-compressed ``.json.gz`` file holding one object."""
    require_existing(path)
    where = Where(str(path))
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8-sig") as stream:
                text = stream.read(MAX_DOCUMENT_CHARS + 1)
        else:
            with path.open("r", encoding="utf-8-sig") as stream:
                text = stream.read(MAX_DOCUMENT_CHARS + 1)
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as err:
        raise where.error("file", f"cannot be read: {err}") from err
    if len(text) > MAX_DOCUMENT_CHARS:
        raise where.error("file", f"holds more than {MAX_DOCUMENT_CHARS:,} characters "
                                  "(decompressed); split the conversation")
    if not text.strip():
        raise where.error("file", "is empty")
    return _parse_object(text, where)


def _parse_object(text: str, where: Where) -> JsonObject:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise where.error("<json>", f"invalid JSON: {err.msg} at column {err.colno}") from err
    except RecursionError:
        raise where.error("<json>", "nested too deeply (arrays or objects inside each other "
                                    "more than ~1,000 levels)") from None
    except ValueError as err:  # an integer longer than sys.get_int_max_str_digits()
        raise where.error("<json>", f"unreadable value: {str(err).split(':')[0]}") from err
    if not isinstance(obj, dict):
        raise where.error("<json>", f"must be a JSON object, got {type(obj).__name__}")
    return obj


def require_field(obj: JsonObject, field: str, where: Where) -> object:
    """``obj[field]``, or ``TraceFormatError`` naming the missing field."""
    if field not in obj:
        raise where.error(field, "is missing")
    return obj[field]


def require_int(obj: JsonObject, field: str, where: Where, *, minimum: int = 0) -> int:
    """An integer field ``>= minimum`` (JSON floats with an integral value are refused too)."""
    value = require_field(obj, field, where)
    return check_int(value, field, where, minimum=minimum)


def check_int(value: object, field: str, where: Where, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise where.error(field, f"must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise where.error(field, f"must be an integer >= {minimum}, got {value}")
    return value


def optional_int(obj: JsonObject, field: str, where: Where, *, minimum: int = 0) -> int | None:
    if obj.get(field) is None:
        return None
    return require_int(obj, field, where, minimum=minimum)


def require_number(obj: JsonObject, field: str, where: Where) -> float:
    """A finite, non-negative JSON number."""
    value = require_field(obj, field, where)
    return check_number(value, field, where)


def check_number(value: object, field: str, where: Where) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise where.error(field, f"must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not 0.0 <= number < float("inf"):
        raise where.error(field, f"must be a finite number >= 0, got {value!r}")
    return number


def optional_number(obj: JsonObject, field: str, where: Where) -> float | None:
    if obj.get(field) is None:
        return None
    return require_number(obj, field, where)


def require_str(obj: JsonObject, field: str, where: Where) -> str:
    value = require_field(obj, field, where)
    if not isinstance(value, str) or not value:
        raise where.error(field, f"must be a non-empty string, got {value!r}")
    return value


def optional_str(obj: JsonObject, field: str, where: Where) -> str | None:
    if obj.get(field) is None:
        return None
    return require_str(obj, field, where)


def require_int_list(obj: JsonObject, field: str, where: Where, *,
                     limit: int | None = None) -> list[int]:
    """A list of non-negative integers (each ``< limit`` when given)."""
    value = require_field(obj, field, where)
    return check_int_list(value, field, where, limit=limit)


def check_int_list(value: object, field: str, where: Where, *,
                   limit: int | None = None) -> list[int]:
    if not isinstance(value, list):
        raise where.error(field, f"must be a list of integers, got {type(value).__name__}")
    # NOTE: the fast path checks types and bounds at C speed (the WEKA trace has 11 M ids);
    # the slow loop only runs to name the first offending item.
    if value and (set(map(type, value)) != {int} or min(value) < 0):
        for idx, item in enumerate(value):
            if type(item) is not int or item < 0:
                raise where.error(f"{field}[{idx}]", f"must be an integer >= 0, got {item!r}")
    if limit is not None and value and max(value) >= limit:
        raise where.error(field, f"ids must be < {limit}, got {max(value)}")
    return value
