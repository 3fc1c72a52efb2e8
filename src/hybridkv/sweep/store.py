"""Finished sweep cells on disk (``hybridkv sweep --results DIR``): what makes a sweep
resumable.

Each finished cell is one file ``DIR/cell-<key>.json`` holding its key material and its
row, written atomically (``StagedOutputs``: a temporary file renamed into place) the
moment the cell finishes, so an interrupted sweep keeps every finished cell and never a
partial one. A re-run reuses a stored row only when the file parses, names the same key
and holds the same key material (``hybridkv.sweep.cells.key_material``); anything else is
recomputed and overwritten. Failed cells are not stored.

>>> import tempfile
>>> store = ResultStore.open(Path(tempfile.mkdtemp()) / "cells")
>>> store.load("k" * 40, {"a": 1}) is None
True
>>> store.save("k" * 40, {"a": 1}, {"hit_rate": 0.25})
>>> store.load("k" * 40, {"a": 1})
{'hit_rate': 0.25}
>>> store.load("k" * 40, {"a": 2}) is None        # same name, other material: recompute
True
"""

from __future__ import annotations

import json
import stat
from collections.abc import Mapping
from pathlib import Path

from hybridkv.errors import ConfigError, OutputPathError
from hybridkv.outputs import StagedOutputs, path_mode, probe_directory, resolved_path

FLAG = "--results"


class ResultStore:
    """A directory of finished cells (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def open(cls, directory: Path | str, *,
             outputs: Mapping[str, Path | None] | None = None) -> ResultStore:
        """Use ``directory``, creating it (not its parents) when missing; raise
        ``OutputPathError`` when it cannot hold files, and ``ConfigError`` when one of the
        ``outputs`` (flag → file) names it (its rename onto the directory would fail after
        the whole sweep)."""
        text = str(directory)
        path = Path(text)
        if not text.strip():
            raise OutputPathError(FLAG, text, "the path is empty", "name a directory")
        mode = path_mode(FLAG, text, path, "it")
        for flag, output in (outputs or {}).items():
            if output is not None and resolved_path(flag, output) == resolved_path(FLAG, path):
                raise ConfigError(flag, str(output), f"is the {FLAG} directory; name a file "
                                  "outside it")
        if mode is not None and not stat.S_ISDIR(mode):
            raise OutputPathError(FLAG, text, "exists and is not a directory",
                                  "name a directory for the finished cells")
        if mode is None and path.is_symlink():
            raise OutputPathError(FLAG, text, "is a symbolic link to a missing directory",
                                  "create the directory it names or choose another")
        if mode is None:
            parent_mode = path_mode(FLAG, text, path.parent, f"parent '{path.parent}'")
            if parent_mode is None or not stat.S_ISDIR(parent_mode):
                raise OutputPathError(FLAG, text, f"parent '{path.parent}' is not an "
                                      "existing directory", "create it first")
            try:
                path.mkdir()
            except OSError as err:
                raise OutputPathError(FLAG, text, f"cannot be created ({err.strerror})",
                                      "choose a writable directory") from err
        probe_directory(FLAG, path)
        return cls(path)

    def path(self, key: str) -> Path:
        return self.directory / f"cell-{key}.json"

    def load(self, key: str, material: Mapping[str, object]) -> dict[str, object] | None:
        """The stored row of ``key``, or ``None`` (missing, unreadable, or made from other
        material)."""
        try:
            document = json.loads(self.path(key).read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return None
        if (not isinstance(document, dict) or document.get("key") != key
                or document.get("material") != json.loads(json.dumps(material, default=str))
                or not isinstance(document.get("row"), dict)):
            return None
        row: dict[str, object] = document["row"]
        return row

    def save(self, key: str, material: Mapping[str, object], row: Mapping[str, object]) -> None:
        """Write one finished cell atomically."""
        text = json.dumps({"key": key, "material": material, "row": row}, default=str,
                          indent=1) + "\n"
        destination = self.path(key)
        with StagedOutputs() as staged:
            staged.stage(FLAG, destination, lambda tmp: tmp.write_text(text))
            staged.commit()


__all__ = ["ResultStore"]
