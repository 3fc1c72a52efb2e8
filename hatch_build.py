"""Hatch build hook: an editable install (``pip install -e .``) also compiles the core.

It runs ``hybridkv.native_build.build`` on ``src/hybridkv`` (mypyc, ~1-2 min on 2 cores)
into ``build/hybridkv-native/<fingerprint>/`` — outside the package, ignored by git. It
never fails the install: without a C compiler or mypyc, the reason goes to
``build/hybridkv-native/last-build-failed.txt`` and the first import prints it once; the
pure-Python core is used. ``HYBRIDKV_PURE_PYTHON=1`` skips the build. Wheels (non-editable)
are pure Python.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class NativeCoreHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version != "editable" or os.environ.get("HYBRIDKV_PURE_PYTHON", "") not in ("", "0"):
            return
        package_dir = Path(self.root) / "src" / "hybridkv"
        root = Path(self.root) / "build" / "hybridkv-native"
        # Import the two build modules without the package's __init__ (its dependencies are
        # not in the isolated build environment); the pure switch keeps the import silent.
        package = types.ModuleType("hybridkv")
        package.__path__ = [str(package_dir)]
        saved = sys.modules.get("hybridkv")
        sys.modules["hybridkv"] = package
        os.environ["HYBRIDKV_PURE_PYTHON"] = "1"
        try:
            from hybridkv.native_build import build

            os.environ.pop("HYBRIDKV_PURE_PYTHON")
            outcome = build(package_dir, root)
        except Exception as error:  # the install must not fail on the optional build
            root.mkdir(parents=True, exist_ok=True)
            (root / "last-build-failed.txt").write_text(f"build hook error: {error}\n")
            outcome = f"failed: {error}"
        finally:
            os.environ.pop("HYBRIDKV_PURE_PYTHON", None)
            for name in [n for n in sys.modules if n == "hybridkv" or n.startswith("hybridkv.")]:
                del sys.modules[name]
            if saved is not None:
                sys.modules["hybridkv"] = saved
        self.app.display_info(f"hybridkv compiled core: {outcome}")
