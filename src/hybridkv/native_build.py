"""Build the compiled core: mypyc over ``native.COMPILED_MODULES`` of a snapshot of the
sources, stored under ``<native root>/<fingerprint of the snapshot>/``.

``pip install -e .`` runs ``build`` (the hatch hook in ``hatch_build.py``); by hand::

    python -m hybridkv.native_build            # build for the sources of this checkout
    python -m hybridkv.native_build --status   # which core an import selects now, and why

The sources are copied first and the copy is both fingerprinted and compiled, so a file
edited during the (~1–2 min) compile gives a build for the old fingerprint, which the
edited sources then do not select. The build is written to a temporary directory and
renamed into place complete (manifest last); only the newest ``KEEP_BUILDS`` builds stay.
Nothing is ever written inside the package. A machine without a C compiler or without
mypyc gets no build and a one-line reason in ``<native root>/last-build-failed.txt``,
which the next import turns into its notice; the pure-Python core stays in use.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hybridkv.native import (
    COMPILED_MODULES,
    GROUP_NAME,
    MANIFEST,
    PACKAGE_DIR,
    STATUS,
    build_is_complete,
    decide,
    fingerprint_of,
    native_root,
    source_files,
)

KEEP_BUILDS = 3

_COMPILE = """
import os, sys
src, lib, tmp, group, jobs = sys.argv[1:6]
modules = sys.argv[6:]
os.chdir(src)
from mypyc.build import mypycify
from setuptools import setup
extensions = mypycify(
    ["--ignore-missing-imports", *[m.replace(".", "/") + ".py" for m in modules]],
    opt_level="3", group_name=group, target_dir=os.path.join(tmp, "c"), strip_asserts=False)
setup(name="hybridkv-native", ext_modules=extensions, script_args=[
    "-q", "build_ext", "--build-lib", lib, "--build-temp", os.path.join(tmp, "o"), "-j", jobs])
"""


def c_compiler() -> str | None:
    """The C compiler setuptools would use (``$CC`` or Python's own), if it is installed."""
    command = os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc")
    words = shlex.split(command)
    return shutil.which(words[0]) if words else None


def _fail(root: Path, why: str) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / STATUS).write_text(why + "\n")
    return f"failed: {why}"


def _prune(root: Path, keep: int) -> None:
    builds = sorted((path for path in root.iterdir()
                     if path.is_dir() and (path / MANIFEST).is_file()),
                    key=lambda path: (path / MANIFEST).stat().st_mtime, reverse=True)
    for old in builds[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def build(package_dir: Path, root: Path, python: str = sys.executable) -> str:
    """Compile ``package_dir``'s hot modules into ``root``; returns one line: ``built …``,
    ``up to date …`` or ``failed: why`` (never raises for a missing tool)."""
    if c_compiler() is None:
        return _fail(root, "no C compiler found (set CC or install gcc/clang)")
    check = subprocess.run([python, "-c", "import mypyc.build, setuptools"],
                           capture_output=True, check=False)
    if check.returncode != 0:
        return _fail(root, "mypyc or setuptools is not installed (pip install mypy setuptools)")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=root) as work_name:
        work = Path(work_name)
        snapshot = work / "src" / "hybridkv"
        files = source_files(package_dir)
        for name, content in files:
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).write_bytes(content)
        fingerprint = fingerprint_of(files)
        final = root / fingerprint
        if build_is_complete(final):
            return f"up to date: {final}"
        staged = work / "out"
        started = time.perf_counter()
        compiled = subprocess.run(
            [python, "-c", _COMPILE, str(work / "src"), str(staged / "lib"), str(work / "tmp"),
             GROUP_NAME, str(os.cpu_count() or 1), *COMPILED_MODULES],
            capture_output=True, text=True, check=False)
        if compiled.returncode != 0:
            tail = (compiled.stderr or compiled.stdout).strip().splitlines()[-1:] or ["?"]
            return _fail(root, f"mypyc failed: {tail[0][:300]}")
        (staged / MANIFEST).write_text(json.dumps({
            "fingerprint": fingerprint, "modules": list(COMPILED_MODULES),
            "seconds": round(time.perf_counter() - started, 1)}))
        shutil.rmtree(final, ignore_errors=True)
        staged.rename(final)
    (root / STATUS).unlink(missing_ok=True)
    _prune(root, KEEP_BUILDS)
    return f"built: {final}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hybridkv.native_build [--status]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--status"]:
        selection = decide()
        print(f"{selection.mode}: {selection.reason}")
        return 0
    if args:
        print(f"hybridkv.native_build: unknown arguments {' '.join(args)!r}; "
              "use no argument (build) or --status", file=sys.stderr)
        return 2
    root = native_root(PACKAGE_DIR)
    if root is None:
        print("hybridkv.native_build: not a source checkout; set HYBRIDKV_NATIVE_DIR to "
              "the directory the build should go to", file=sys.stderr)
        return 2
    outcome = build(PACKAGE_DIR, root)
    print(outcome)
    return 0 if outcome.startswith(("built", "up to date")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
