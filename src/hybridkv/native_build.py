"""Build the compiled core: mypyc over ``native.COMPILED_MODULES`` of a snapshot of the
sources, stored under ``<native root>/<fingerprint of the snapshot>/``.

``pip install -e .`` runs ``build`` (the hatch hook in ``hatch_build.py``); by hand::

    python -m hybridkv.native_build            # build for the sources of this checkout
    python -m hybridkv.native_build --status   # which core an import selects now, and why
    python -m hybridkv.native_build --check    # mypy --strict as the build sees the code

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
    ["--config-file", os.path.join(tmp, "mypy-build.ini"),
     *[m.replace(".", "/") + ".py" for m in modules]],
    opt_level="3", group_name=group, target_dir=os.path.join(tmp, "c"), strip_asserts=False)
setup(name="hybridkv-native", ext_modules=extensions, script_args=[
    "-q", "build_ext", "--build-lib", lib, "--build-temp", os.path.join(tmp, "o"), "-j", jobs])
"""


BUILD_MYPY_CONFIG = """\
[mypy]
ignore_missing_imports = True

[mypy-hybridkv.*]
follow_imports = silent
"""
"""mypy's options for the mypyc build, passed explicitly (never a config found by walking up
from the snapshot, which differs between a clone, an sdist and a wheel build). The compiled
modules are the sources, so their own errors stop the build; every other module of the
package is followed *silently*: mypyc needs its types, not its lint. An optional package
that the isolated build environment lacks (msgspec, pyzmq, rich …) is then ``Any`` in the
modules that use it, which does not change one compiled instruction — so a module outside
the compiled set can never again fail the build for a missing extra (issue 24). Strictness
is the job of ``--check`` (CI), not of a user's install."""

STRICT_CHECK_ARGS = ("--strict", "--no-site-packages")
"""``--check`` = the build's view made strict: site-packages hidden, as in pip's isolated
build environment, where none of the optional extras is installed."""


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
    ``up to date …`` or ``failed: why`` (never raises for a missing tool). A complete
    build of these very sources is reused, with or without a compiler."""
    existing = root / fingerprint_of(source_files(package_dir))
    if build_is_complete(existing):
        return f"up to date: {existing}"
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
        (work / "tmp").mkdir()
        (work / "tmp" / "mypy-build.ini").write_text(BUILD_MYPY_CONFIG)
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


def check(package_dir: Path = PACKAGE_DIR, python: str = sys.executable) -> tuple[bool, str]:
    """Type-check the compiled modules as the build sees them, made strict (CI's guard).

    Returns (passed, mypy's output). Catches, before any user's install does, a compiled
    module whose own code needs an optional package's types (it is ``Any`` in the build).
    """
    files = [module.removeprefix("hybridkv.").replace(".", "/") + ".py"
             for module in COMPILED_MODULES]
    root = native_root(package_dir)
    with tempfile.TemporaryDirectory(prefix="hybridkv-check-") as work_name:
        config = Path(work_name) / "mypy-build.ini"
        config.write_text(BUILD_MYPY_CONFIG)
        cache = Path(work_name) / "cache" if root is None else root / "mypy-check-cache"
        result = subprocess.run(
            [python, "-m", "mypy", "--config-file", str(config), *STRICT_CHECK_ARGS,
             "--cache-dir", str(cache), *[f"{package_dir.name}/{name}" for name in files]],
            cwd=package_dir.parent, capture_output=True, text=True, check=False)
    return result.returncode == 0, (result.stdout + result.stderr).strip()


USAGE = """usage: python -m hybridkv.native_build [--status | --require-compiled | --check]

Compile the core with mypyc into the checkout's build/hybridkv-native/ (no argument), or:
  --status            say which core an import selects and why
  --require-compiled  the same; exit 1 unless it is the compiled core (CI)
  --check             type-check the compiled modules as the isolated build sees them"""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hybridkv.native_build [--status | --require-compiled | --check]``.

    ``--status`` prints which core an import selects and why (exit 0); ``--require-compiled``
    prints the same and exits 1 unless it is the compiled core (CI); ``--check`` type-checks
    the compiled modules the way the isolated build sees them, strictly (exit 1 on errors).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["--help"], ["-h"]):
        print(USAGE)
        return 0
    if args in (["--status"], ["--require-compiled"]):
        selection = decide()
        print(f"{selection.mode}: {selection.reason}")
        return 1 if args == ["--require-compiled"] and selection.mode != "compiled" else 0
    if args == ["--check"]:
        passed, output = check()
        print(output)
        return 0 if passed else 1
    if args:
        print(f"hybridkv.native_build: unknown arguments {' '.join(args)!r}; "
              "use no argument (build), --status, --require-compiled, --check or --help",
              file=sys.stderr)
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
