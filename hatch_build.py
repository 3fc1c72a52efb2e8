"""Hatch build hook: every install from source also compiles the core (mypyc).

It runs ``hybridkv.native_build.build`` on ``src/hybridkv`` (~1-2 min on 2 cores) into
``build/hybridkv-native/<fingerprint>/`` — outside the package, ignored by git; a second
build of the same sources reuses it.

- ``pip install -e .`` (editable): the import selects that build while the checkout's
  sources keep its fingerprint (``hybridkv.native``).
- ``pip install .`` / ``pip wheel .`` (a wheel): the build goes *into* the wheel as
  ``hybridkv/_compiled/`` (extensions under ``lib/``, ``manifest.json`` with the sources'
  fingerprint) and the wheel is tagged for this interpreter and platform
  (``cp311-cp311-linux_x86_64``); the installed package selects it while its sources keep
  that fingerprint.

It never fails the install: without a C compiler or mypyc, the reason goes to
``last-build-failed.txt`` (the checkout's build root, or the wheel's ``_compiled/``: a
pure-Python ``py3-none-any`` wheel) and the first import prints it once; the pure-Python
core is used. ``HYBRIDKV_PURE_PYTHON=1`` skips the build (a pure wheel, no notice).
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class NativeCoreHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if os.environ.get("HYBRIDKV_PURE_PYTHON", "") not in ("", "0"):
            return
        package_dir = Path(self.root) / "src" / "hybridkv"
        root = Path(self.root) / "build" / "hybridkv-native"
        outcome, build_dir = _build(package_dir, root)
        self.app.display_info(f"hybridkv compiled core: {outcome}")
        if version == "editable":
            return
        if build_dir is not None:
            build_data["force_include"][str(build_dir / "lib")] = "hybridkv/_compiled/lib"
            build_data["force_include"][str(build_dir / "manifest.json")] = (
                "hybridkv/_compiled/manifest.json")
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            return
        self.app.display_warning(f"hybridkv: a pure-Python wheel ({outcome})")
        note = Path(tempfile.mkdtemp(prefix="hybridkv-wheel-")) / "last-build-failed.txt"
        note.write_text(outcome.removeprefix("failed: ") + "\n")
        build_data["force_include"][str(note)] = "hybridkv/_compiled/last-build-failed.txt"


def _build(package_dir: Path, root: Path) -> tuple[str, Path | None]:
    """``native_build.build``; returns its line and the complete build's directory (or
    ``None``). Imports the build modules without the package's ``__init__`` (its
    dependencies are not in the isolated build environment)."""
    package = types.ModuleType("hybridkv")
    package.__path__ = [str(package_dir)]
    saved = sys.modules.get("hybridkv")
    sys.modules["hybridkv"] = package
    os.environ["HYBRIDKV_PURE_PYTHON"] = "1"  # keeps the import of hybridkv.native silent
    build_dir = None
    try:
        from hybridkv.native import build_is_complete, fingerprint_of, source_files
        from hybridkv.native_build import build

        os.environ.pop("HYBRIDKV_PURE_PYTHON")
        outcome = build(package_dir, root)
        done = root / fingerprint_of(source_files(package_dir))
        build_dir = done if build_is_complete(done) else None
    except Exception as error:  # the install must not fail on the optional build
        root.mkdir(parents=True, exist_ok=True)
        (root / "last-build-failed.txt").write_text(f"build hook error: {error}\n")
        outcome = f"failed: build hook error: {error}"
    finally:
        os.environ.pop("HYBRIDKV_PURE_PYTHON", None)
        for name in [n for n in sys.modules if n == "hybridkv" or n.startswith("hybridkv.")]:
            del sys.modules[name]
        if saved is not None:
            sys.modules["hybridkv"] = saved
    return outcome, build_dir
