"""Pick the core's implementation at import: the mypyc build of these very sources, or the
pure-Python source itself.

The hot modules (``COMPILED_MODULES``) can be compiled ahead of time by mypyc from the same
typed source (``hybridkv.native_build``; ``pip install -e .`` runs it, so does
``python -m hybridkv.native_build``). A build is stored *outside* the package, under
``<native root>/<fingerprint>/``, where the fingerprint is a hash of every ``.py`` file of the
package (plus the interpreter's ABI). ``hybridkv/__init__.py`` calls ``select()`` before it
imports anything else: the compiled modules are used only if a build exists for the
fingerprint of the sources being imported right now, so an edited source file can never be
shadowed by a stale extension — the core falls back to pure Python with a one-line notice.

Native root: ``$HYBRIDKV_NATIVE_DIR``, else ``build/hybridkv-native`` of the source checkout
the package is imported from (``<root>/src/hybridkv`` with ``<root>/pyproject.toml``), else
none: an installed wheel, which carries its build inside the package, in ``_compiled/``
(``lib/`` with the extensions, ``manifest.json`` with the fingerprint of the sources it was
compiled from; ``hatch_build.py`` puts it there). It is used only while the installed
sources still have that fingerprint; a wheel built without a C compiler carries only
``_compiled/last-build-failed.txt`` (the reason), which the import turns into its notice.

Switches: ``HYBRIDKV_PURE_PYTHON=1`` selects the pure-Python source (no notice).

States (``Selection.mode`` and whether a notice line goes to stderr):

============  ==========================================================  ======
mode          when                                                        notice
============  ==========================================================  ======
compiled      a complete build for the current fingerprint exists         no
pure          ``HYBRIDKV_PURE_PYTHON=1``, or no native root / no build    no
              was ever made for this checkout
pure          builds exist, but none for these sources (edited since)     once
pure          the last build attempt failed (no C compiler, no mypyc)     once
============  ==========================================================  ======

"once": the first import that falls back prints the line to stderr and leaves a marker
(``notified-<fingerprint>``) in the native root, so later imports of the same sources
(e.g. every subprocess of a test run) stay quiet.

>>> fingerprint_of([("a.py", b"x = 1\\n")]) == fingerprint_of([("a.py", b"x = 1\\n")])
True
>>> fingerprint_of([("a.py", b"x = 1\\n")]) == fingerprint_of([("a.py", b"x = 2\\n")])
False
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr as mypyc_attr  # noqa: PLC0414 (re-export)
else:
    def mypyc_attr(*args: Any, **kwargs: Any) -> Any:
        """mypyc's class attributes (e.g. ``allow_interpreted_subclasses=True`` on a class
        tests subclass); mypyc reads them at compile time, at run time a no-op, so the
        core needs no ``mypy_extensions``."""
        return lambda cls: cls

PURE_ENV = "HYBRIDKV_PURE_PYTHON"
DIR_ENV = "HYBRIDKV_NATIVE_DIR"
GROUP_NAME = "hybridkv_native"
"""mypyc's shared library of the build is the top-level module ``hybridkv_native__mypyc``."""
MANIFEST = "manifest.json"
STATUS = "last-build-failed.txt"
"""Written into the native root when a build could not be made (one line: why)."""
SHIPPED_DIR = "_compiled"
"""A wheel's build, inside the installed package (``hybridkv/_compiled/``)."""

COMPILED_MODULES: tuple[str, ...] = (
    "hybridkv.block",
    "hybridkv.pool",
    "hybridkv.eviction",
    "hybridkv.policies",
    "hybridkv.hashing",
    "hybridkv.tokens",
    "hybridkv.siblings",
    "hybridkv.coordinator",
    "hybridkv.cache",
    "hybridkv.results",
    "hybridkv.probes",
    "hybridkv.managers.base",
    "hybridkv.managers.full",
    "hybridkv.managers.window",
    "hybridkv.managers.chunked",
    "hybridkv.managers.compressed",
    "hybridkv.managers.recurrent",
    "hybridkv.sched.admission",
    "hybridkv.sched.scheduler",
    "hybridkv.sim.misses",
    "hybridkv.traces.prompts",
    "hybridkv.sim.replay",
)
"""Modules compiled together (one mypyc group). A class defined here cannot be subclassed
by interpreted code, nor its methods monkeypatched: subclass in a compiled module."""

PACKAGE_DIR = Path(__file__).resolve().parent


def fingerprint_of(files: Iterable[tuple[str, bytes]]) -> str:
    """Hash of ``(relative path, content)`` pairs, in path order, and of the interpreter's
    extension ABI (a build for CPython 3.11 is never loaded by 3.12)."""
    digest = hashlib.sha256()
    digest.update(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    for name, content in sorted(files):
        digest.update(b"\0" + name.encode() + b"\0" + len(content).to_bytes(8, "little"))
        digest.update(content)
    return digest.hexdigest()[:24]


def source_files(package_dir: Path) -> list[tuple[str, bytes]]:
    """Every ``.py`` file under ``package_dir``, as (posix relative path, bytes)."""
    return [(path.relative_to(package_dir).as_posix(), path.read_bytes())
            for path in package_dir.rglob("*.py") if "__pycache__" not in path.parts]


def native_root(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """Where builds of ``package_dir``'s sources live (see the module docstring)."""
    configured = os.environ.get(DIR_ENV, "")
    if configured:
        return Path(configured)
    checkout = package_dir.parent.parent
    if package_dir.parent.name == "src" and (checkout / "pyproject.toml").is_file():
        return checkout / "build" / "hybridkv-native"
    return None


def extension_path(build_dir: Path, module: str) -> Path:
    """``build_dir/lib/hybridkv/pool<EXT_SUFFIX>`` for ``hybridkv.pool``."""
    suffix = str(sysconfig.get_config_var("EXT_SUFFIX"))
    return build_dir / "lib" / (module.replace(".", "/") + suffix)


def build_is_complete(build_dir: Path) -> bool:
    """A build directory counts only once its manifest (written last) lists every file."""
    manifest = build_dir / MANIFEST
    if not manifest.is_file():
        return False
    try:
        modules = json.loads(manifest.read_text())["modules"]
    except (ValueError, KeyError, TypeError):
        return False
    names = [*modules, GROUP_NAME + "__mypyc"]
    return all(extension_path(build_dir, name).is_file() for name in names)


@dataclass(frozen=True, slots=True)
class Selection:
    """What ``select`` decided: ``mode`` is ``"compiled"`` or ``"pure"``."""

    mode: str
    reason: str
    build_dir: Path | None = None
    notice: str | None = None
    notice_marker: Path | None = None
    """Created once the notice was printed: it is printed once per sources and reason."""


def decide(package_dir: Path = PACKAGE_DIR) -> Selection:
    """Decide between the compiled build and the pure-Python source (no side effects)."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return Selection("pure", f"{PURE_ENV}={os.environ[PURE_ENV]}")
    root = native_root(package_dir)
    if root is None:
        return _decide_installed(package_dir)
    if not root.is_dir():
        return Selection("pure", "no compiled build (python -m hybridkv.native_build)")
    fingerprint = fingerprint_of(source_files(package_dir))
    build_dir = root / fingerprint
    if build_is_complete(build_dir):
        return Selection("compiled", f"mypyc build {fingerprint}", build_dir)
    status = root / STATUS
    if status.is_file():
        why = (status.read_text().strip().splitlines() or ["?"])[0]
        return Selection("pure", why, notice=(
            f"hybridkv: no compiled core ({why}); using the pure-Python core"),
            notice_marker=root / f"notified-failed-{fingerprint}")
    if not any(build_is_complete(path) for path in root.iterdir() if path.is_dir()):
        return Selection("pure", "no compiled build (python -m hybridkv.native_build)")
    return Selection("pure", "sources changed since the last build", notice=(
        f"hybridkv: the compiled core in {root} was built from other sources than "
        f"{package_dir} (edited since); using the pure-Python core — rebuild: "
        "python -m hybridkv.native_build"), notice_marker=root / f"notified-{fingerprint}")


def manifest_fingerprint(build_dir: Path) -> str | None:
    """The fingerprint a build's manifest names (``None``: no readable manifest)."""
    try:
        value = json.loads((build_dir / MANIFEST).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


def _decide_installed(package_dir: Path) -> Selection:
    """An installed package (no checkout): the wheel's own build in ``_compiled/``."""
    shipped = package_dir / SHIPPED_DIR
    status = shipped / STATUS
    if build_is_complete(shipped):
        fingerprint = fingerprint_of(source_files(package_dir))
        if manifest_fingerprint(shipped) == fingerprint:
            return Selection("compiled", f"the wheel's mypyc build {fingerprint}", shipped)
        return Selection("pure", "installed sources differ from the wheel's build", notice=(
            f"hybridkv: the compiled core in {shipped} was built from other sources than "
            f"{package_dir} (edited since); using the pure-Python core — reinstall"),
            notice_marker=shipped / f"notified-{fingerprint}")
    if status.is_file():
        why = (status.read_text().strip().splitlines() or ["?"])[0]
        return Selection("pure", why, notice=(
            f"hybridkv: this wheel has no compiled core ({why}); using the pure-Python core"),
            notice_marker=shipped / "notified-failed")
    return Selection("pure", "no compiled build (an install without the build hook)")


class _BuildFinder:
    """Meta-path finder serving the modules of one complete build (and nothing else)."""

    def __init__(self, build_dir: Path, modules: Sequence[str]) -> None:
        self._paths = {name: extension_path(build_dir, name)
                       for name in (*modules, GROUP_NAME + "__mypyc")}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        location = self._paths.get(fullname)
        if location is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(location))
        return importlib.util.spec_from_file_location(fullname, location, loader=loader)


SELECTED: Selection | None = None
"""The selection made by ``select`` in this process (``None`` before)."""


def select() -> Selection:
    """Decide once per process; install the build's finder or print the notice."""
    global SELECTED  # noqa: PLW0603 (one decision per process, made at package import)
    if SELECTED is not None:
        return SELECTED
    try:
        selection = decide()
    except OSError as error:  # an unreadable build directory: never fatal
        selection = Selection("pure", f"native root unreadable: {error}", notice=(
            f"hybridkv: cannot read the compiled core ({error}); using the pure-Python core"))
    if selection.mode == "compiled" and selection.build_dir is not None:
        sys.meta_path.insert(0, _BuildFinder(selection.build_dir, COMPILED_MODULES))
    elif selection.notice and not (selection.notice_marker
                                   and selection.notice_marker.exists()):
        print(selection.notice, file=sys.stderr)
        if selection.notice_marker is not None:
            with contextlib.suppress(OSError):  # read-only root: printed at every import
                selection.notice_marker.touch()
    SELECTED = selection
    return selection


def core_line(selection: Selection | None = None) -> str:
    """The one line every command's report ends with: which core ran, and why.

    >>> core_line(Selection("compiled", "mypyc build 9679ab01799c64044e8410ec"))
    'core: compiled (mypyc build 9679ab01799c64044e8410ec)'
    >>> core_line(Selection("pure", "mypyc failed: hybridkv/x.py:1: error: …"))
    'core: pure Python (mypyc failed)'

    Short enough for an 80-column terminal: the reason's first clause only (the notice on
    stderr and ``python -m hybridkv.native_build --status`` give the whole of it).
    """
    chosen = SELECTED if selection is None else selection
    if chosen is None:
        return "core: not selected yet"
    if chosen.mode == "compiled":
        return f"core: compiled ({chosen.reason})"
    why = chosen.reason.split(": ", 1)[0].split(" (", 1)[0]
    return f"core: pure Python ({why[:56]})"


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from a compiled extension.

    >>> import hybridkv.ids
    >>> is_compiled(hybridkv.ids)
    False
    """
    return str(getattr(module, "__file__", "")).endswith(
        str(sysconfig.get_config_var("EXT_SUFFIX")))


select()
