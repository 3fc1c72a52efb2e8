"""The compiled core is selected only for the exact sources it was built from.

No test here compiles (a mypyc build takes minutes); stale-build tests use a fake build
directory whose extension files are garbage, so loading one would fail loudly. When a real
build of the sources under test exists (CI: ``pip install -e .`` made it), the last tests
check that it is in use and that it replays exactly like the pure-Python core.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import hybridkv
import hybridkv.pool
from hybridkv import native
from hybridkv.native_build import build, check

PACKAGE_DIR = Path(hybridkv.__file__).resolve().parent
SUFFIX = str(sysconfig.get_config_var("EXT_SUFFIX"))


def _fake_build(root: Path, fingerprint: str) -> Path:
    """A build directory that looks complete; its 'extensions' cannot be loaded."""
    build_dir = root / fingerprint
    for name in (*native.COMPILED_MODULES, native.GROUP_NAME + "__mypyc"):
        path = native.extension_path(build_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not an ELF file")
    (build_dir / native.MANIFEST).write_text(json.dumps(
        {"fingerprint": fingerprint, "modules": list(native.COMPILED_MODULES)}))
    return build_dir


def _copy_sources(tmp_path: Path) -> Path:
    package = tmp_path / "src" / "hybridkv"
    shutil.copytree(PACKAGE_DIR, package, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "pyproject.toml").write_text("")
    return package


def _import_pool(package: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in (native.PURE_ENV, native.DIR_ENV)}
    return subprocess.run(
        [sys.executable, "-c", "import hybridkv.pool as p; print(p.__file__)"],
        env={**clean, "PYTHONPATH": str(package.parent), **env},
        capture_output=True, text=True, timeout=120, check=False)


def test_fingerprint_covers_every_source_byte(tmp_path: Path) -> None:
    package = _copy_sources(tmp_path)
    before = native.fingerprint_of(native.source_files(package))
    assert before == native.fingerprint_of(native.source_files(PACKAGE_DIR))
    pool = package / "pool.py"
    pool.write_bytes(pool.read_bytes() + b"\n")
    assert native.fingerprint_of(native.source_files(package)) != before


def test_stale_build_is_never_loaded(tmp_path: Path) -> None:
    """A build made from other sources (here: pool.py edited after the build) is ignored:
    the edited source runs, with one notice line, printed once."""
    package = _copy_sources(tmp_path)
    root = tmp_path / "build" / "hybridkv-native"
    _fake_build(root, native.fingerprint_of(native.source_files(package)))
    pool = package / "pool.py"
    pool.write_text(pool.read_text() + "\nEDITED_AFTER_BUILD = 1\n")
    first = _import_pool(package)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == str(pool)
    notice = first.stderr.strip().splitlines()
    assert len(notice) == 1 and "built from other sources" in notice[0], first.stderr
    second = _import_pool(package)
    assert (second.returncode, second.stdout, second.stderr) == (0, first.stdout, "")


def test_matching_build_is_loaded_and_pure_switch_wins(tmp_path: Path) -> None:
    """The finder serves a build whose fingerprint matches (the garbage file proves it
    tried to load it); ``HYBRIDKV_PURE_PYTHON=1`` bypasses it."""
    package = _copy_sources(tmp_path)
    root = tmp_path / "build" / "hybridkv-native"
    _fake_build(root, native.fingerprint_of(native.source_files(package)))
    loaded = _import_pool(package)
    assert loaded.returncode != 0
    assert "hybridkv-native" in loaded.stderr and "ImportError" in loaded.stderr
    pure = _import_pool(package, **{native.PURE_ENV: "1"})
    assert (pure.returncode, pure.stdout.strip(), pure.stderr) == (
        0, str(package / "pool.py"), "")


def test_no_compiler_gives_one_notice_and_pure_python(tmp_path: Path) -> None:
    package = _copy_sources(tmp_path)
    root = tmp_path / "build" / "hybridkv-native"
    saved = os.environ.get("CC")
    os.environ["CC"] = str(tmp_path / "no-such-cc")
    try:
        outcome = build(package, root)
    finally:
        if saved is None:
            del os.environ["CC"]
        else:
            os.environ["CC"] = saved
    assert outcome.startswith("failed: no C compiler")
    assert not any(path.is_dir() and not path.name.startswith("build-")
                   for path in root.iterdir())
    first = _import_pool(package)
    assert first.stdout.strip() == str(package / "pool.py")
    assert first.stderr.strip().splitlines() == [
        "hybridkv: no compiled core (no C compiler found (set CC or install gcc/clang));"
        " using the pure-Python core"]
    assert _import_pool(package).stderr == ""


def test_no_build_at_all_is_silent_pure_python(tmp_path: Path) -> None:
    package = _copy_sources(tmp_path)
    result = _import_pool(package)
    assert (result.returncode, result.stdout.strip(), result.stderr) == (
        0, str(package / "pool.py"), "")


def test_build_never_writes_inside_the_package(tmp_path: Path) -> None:
    package = _copy_sources(tmp_path)
    before = sorted(p.relative_to(package) for p in package.rglob("*"))
    os.environ["CC"] = str(tmp_path / "no-such-cc")
    try:
        build(package, tmp_path / "native")
    finally:
        del os.environ["CC"]
    assert sorted(p.relative_to(package) for p in package.rglob("*")) == before


COMPILED = native.SELECTED is not None and native.SELECTED.mode == "compiled"


@pytest.mark.skipif(not COMPILED, reason="no compiled build of these sources in use")
def test_compiled_core_is_in_use() -> None:
    assert native.is_compiled(hybridkv.pool)
    assert hybridkv.pool.__file__ is not None and hybridkv.pool.__file__.endswith(SUFFIX)


def _replay_json(tmp_path: Path, name: str, **env: str) -> dict[str, object]:
    out = tmp_path / f"{name}.json"
    clean = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    completed = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "replay", "--workload", "agentic",
         "--set", "num_sessions=4", "--set", "num_turns=4", "--model", "gemma3-bench",
         "--num-blocks", "6000", "--policy", "prepend,latest,interval:4096+predict+recompute,"
         "pin:4096,reachable+chain+session,dense+scan", "--json", str(out), "--quiet"],
        env={**clean, "PYTHONPATH": str(PACKAGE_DIR.parent), **env},
        capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:]
    data = json.loads(out.read_text())
    return _without_timings(data)


def _without_timings(value: object) -> dict[str, object]:
    def strip(item: object) -> object:
        if isinstance(item, dict):
            return {k: strip(v) for k, v in item.items()
                    if "second" not in k and "time" not in k and "rss" not in k}
        if isinstance(item, list):
            return [strip(v) for v in item]
        return item
    stripped = strip(value)
    assert isinstance(stripped, dict)
    return stripped


@pytest.mark.skipif(not COMPILED, reason="no compiled build of these sources in use")
def test_compiled_and_pure_replays_are_identical(tmp_path: Path) -> None:
    compiled = _replay_json(tmp_path, "compiled")
    pure = _replay_json(tmp_path, "pure", **{native.PURE_ENV: "1"})
    runs = compiled["runs"]
    assert isinstance(runs, list) and len(runs) == 6
    assert all(run["hit_rate"] > 0.5 for run in runs)  # the policies' code paths ran
    assert compiled == pure


def test_frozen_settings_survive_pickling() -> None:
    """Sweep cells carry ``ReplaySettings`` to ``--jobs`` / Ray workers; on the compiled
    core the default unpickling of a frozen class fails (``FrozenInstanceError``), so it
    pickles through its constructor."""
    import pickle

    from hybridkv.sim.replay import ReplaySettings

    settings = ReplaySettings(max_running=3, chunk_size=512, admission="warm")
    assert pickle.loads(pickle.dumps(settings)) == settings


def test_the_last_build_did_not_fail_on_the_source() -> None:
    """A build that failed because mypyc rejected the source is a bug, not an environment
    limit: the install would silently leave everyone on the pure-Python core, and every
    compiled-core test would skip. (``pip install -e`` builds in an isolated environment
    without the optional extras, e.g. msgspec, so their types are ``Any`` there: an
    ``Any`` returned from a typed function fails the build though plain ``mypy`` passes.)
    A missing compiler or mypyc is an environment limit and is allowed here."""
    root = native.native_root(PACKAGE_DIR)
    status = None if root is None else root / native.STATUS
    if status is None or not status.is_file():
        return
    reason = status.read_text().strip()
    assert not reason.startswith("mypyc failed"), (
        f"the last compiled-core build failed on the source: {reason}")


def test_check_sees_the_compiled_set_as_the_isolated_build_does(tmp_path: Path) -> None:
    """``native_build --check`` (CI's guard) hides site-packages as pip's isolated build
    environment does: a compiled module returning a value typed by an optional extra
    (msgspec here, ``Any`` there) fails it, though plain ``mypy`` with msgspec passes."""
    passed, output = check(PACKAGE_DIR)
    assert passed, output
    package = _copy_sources(tmp_path)
    pool = package / "pool.py"
    pool.write_text(pool.read_text() + (
        "\n\ndef planted(value: int) -> bytes:\n"
        "    import msgspec\n\n    return msgspec.json.encode(value)\n"))
    passed, output = check(package)
    assert not passed
    assert "pool.py" in output and "[no-any-return]" in output, output


def _installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The package as a wheel installs it: ``site-packages/hybridkv`` (no checkout)."""
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    monkeypatch.delenv(native.DIR_ENV, raising=False)
    package = tmp_path / "site-packages" / "hybridkv"
    shutil.copytree(PACKAGE_DIR, package, ignore=shutil.ignore_patterns(
        "__pycache__", native.SHIPPED_DIR))
    assert native.native_root(package) is None
    return package


def test_an_installed_wheel_selects_its_own_build_while_the_sources_match(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = _installed(tmp_path, monkeypatch)
    fingerprint = native.fingerprint_of(native.source_files(package))
    shipped = _fake_build(tmp_path / "staged", fingerprint)
    shipped.rename(package / native.SHIPPED_DIR)
    chosen = native.decide(package)
    assert (chosen.mode, chosen.build_dir, chosen.notice) == (
        "compiled", package / native.SHIPPED_DIR, None)
    pool = package / "pool.py"
    pool.write_text(pool.read_text() + "\nEDITED_AFTER_INSTALL = 1\n")
    chosen = native.decide(package)
    assert (chosen.mode, chosen.build_dir) == ("pure", None)
    assert chosen.notice is not None and "built from other sources" in chosen.notice


def test_a_wheel_built_without_a_compiler_is_pure_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = _installed(tmp_path, monkeypatch)
    assert native.decide(package).reason.startswith("no compiled build")
    assert native.decide(package).notice is None
    (package / native.SHIPPED_DIR).mkdir()
    (package / native.SHIPPED_DIR / native.STATUS).write_text("no C compiler found\n")
    chosen = native.decide(package)
    assert (chosen.mode, chosen.reason) == ("pure", "no C compiler found")
    assert chosen.notice == (
        "hybridkv: this wheel has no compiled core (no C compiler found); "
        "using the pure-Python core")


@pytest.mark.parametrize("reason", [
    "HYBRIDKV_PURE_PYTHON=1", "no compiled build (python -m hybridkv.native_build)",
    "sources changed since the last build", "no C compiler found (set CC or install gcc/clang)",
    "mypyc failed: hybridkv/events/schema.py:124: error: Returning Any from function "
    "declared to return \"bytes\"  [no-any-return]",
    "installed sources differ from the wheel's build", "native root unreadable: " + "x" * 200,
])
def test_the_core_line_fits_80_columns(reason: str) -> None:
    line = native.core_line(native.Selection("pure", reason))
    assert line.startswith("core: pure Python (") and len(line) <= 80, line
    compiled = native.core_line(native.Selection("compiled", "the wheel's mypyc build " + "f" * 24))
    assert len(compiled) <= 80, compiled


def test_help_prints_the_usage_and_unknown_flags_are_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv import native_build

    assert native_build.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m hybridkv.native_build")
    assert native_build.main(["--stauts"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'--stauts'" in err and "--help" in err and len(err.splitlines()) == 1
