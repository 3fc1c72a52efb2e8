"""Output files of the CLI (``--json``, ``--plot``, ``--csv``): checked before a run starts,
written atomically after it.

``check_output_path`` refuses, before any replay, every path that cannot end up holding
the file: a missing or non-directory parent, a path that is a directory or an existing
non-regular file (``/dev/full``, a FIFO), a symbolic-link loop (the file's or a parent's),
a name too long for the file system, a NUL character, a parent the process cannot create files in
(permissions, read-only file system: probed by creating and removing a temporary file),
and a plot extension matplotlib cannot write.

``StagedOutputs`` writes each output to a temporary file in the destination's directory
(same file system, so the final ``os.replace`` is atomic) and renames them all only in
``commit``. Anything that goes wrong before or during the writes, including Ctrl-C,
removes the temporary files: a failed run leaves neither a partial file nor a stray
temporary one, and the destinations keep their old content.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp())
>>> with StagedOutputs() as staged:
...     staged.stage("--csv", folder / "a.csv", lambda tmp: tmp.write_text("x\\n"))
...     staged.commit()
>>> sorted(p.name for p in folder.iterdir())
['a.csv']
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from hybridkv.errors import ConfigError, OutputPathError

_TEMP_PREFIX = ".hybridkv-"
_TEMP_SUFFIX = ".tmp"


def plot_formats() -> frozenset[str]:
    """File extensions matplotlib can save to (``png``, ``pdf``, ``svg``, …)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return frozenset(FigureCanvasBase.get_supported_filetypes())


def check_output_path(flag: str, path: Path | str, *, plot: bool = False) -> Path:
    """Raise ``OutputPathError`` unless ``path`` can be written (atomically) by this process.

    Args:
        flag: the option that named the path (``--json``), for the message.
        path: the destination.
        plot: also require an extension matplotlib can save.
    """
    text = str(path)
    if not text.strip():
        raise OutputPathError(flag, text, "the path is empty", "name a file, e.g. out.json")
    target = Path(text)
    if text.endswith(os.sep):
        raise OutputPathError(flag, text, "is a directory", "name a file inside it")
    parent = target.parent
    parent_mode = path_mode(flag, text, parent, f"directory '{parent}'")
    if parent_mode is None:
        raise OutputPathError(flag, text, f"directory '{parent}' does not exist",
                              "create it first or choose another path")
    if not stat.S_ISDIR(parent_mode):
        raise OutputPathError(flag, text, f"'{parent}' is not a directory",
                              "choose a path inside a directory")
    mode = path_mode(flag, text, target, "it")
    if mode is not None and stat.S_ISDIR(mode):
        raise OutputPathError(flag, text, "is a directory", "name a file inside it")
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputPathError(flag, text, "exists and is not a regular file (a device, "
                              "FIFO or socket)", "write to a regular file")
    if plot:
        formats = plot_formats()
        extension = plot_format(target)
        if extension not in formats:
            raise OutputPathError(
                flag, text, f"extension '.{extension}' is not a plot format" if extension
                else "has no extension", f"end it in one of .{', .'.join(sorted(formats))}")
    _probe_writable(flag, target)
    return target


def path_mode(flag: str, text: str, path: Path, what: str) -> int | None:
    """``path``'s ``st_mode`` through symbolic links, ``None`` when nothing is there (or a
    link points nowhere; writing replaces the link); ``OutputPathError`` when it cannot be
    known: a symbolic-link loop, a name too long, a component that is not a directory
    (``what`` names ``path`` in the message: ``it``, ``directory 'out'``).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> (folder / "loop.json").symlink_to("loop.json")
    >>> path_mode("--json", "loop.json", folder / "loop.json", "it")
    Traceback (most recent call last):
    ...
    hybridkv.errors.OutputPathError: --json 'loop.json': it is a symbolic-link loop ...
    >>> path_mode("--json", "new.json", folder / "new.json", "it") is None
    True
    """
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except ValueError as err:  # a NUL character
        raise OutputPathError(flag, text, f"is not a usable path ({err})",
                              "name a file without NUL characters") from err
    except OSError as err:
        problems = {
            errno.ELOOP: (f"{what} is a symbolic-link loop (never reaches a file)",
                          "remove or fix the link, or choose another path"),
            errno.ENAMETOOLONG: (f"{what}: a name is too long for the file system",
                                 "choose a shorter name"),
            errno.ENOTDIR: (f"{what}: a component of the path is not a directory",
                            "choose a path inside a directory"),
        }
        problem, fix = problems.get(err.errno or 0, (
            f"{what} cannot be inspected ({err.strerror})",
            "check the directory's permissions"))
        raise OutputPathError(flag, text, problem, fix) from err


def resolved_path(flag: str, path: Path) -> Path:
    """``path`` made absolute with every symbolic link followed; ``OutputPathError`` when
    that cannot be done (a link loop: Python 3.11 raises ``RuntimeError``, later ones
    ``OSError``)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as err:
        raise OutputPathError(flag, path, f"cannot be resolved ({err})",
                              "remove or fix the symbolic link, or choose another path"
                              ) from err


def check_output_paths(named: Sequence[tuple[str, Path | str | None]],
                       ) -> dict[str, Path | None]:
    """``check_output_path`` for each ``(flag, path)`` (``None``: not asked for; a flag
    named ``--plot`` needs a plot extension), and two flags naming one file are refused:
    the second write would replace the first.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> paths = check_output_paths([("--json", folder / "r.json"), ("--plot", None)])
    >>> paths["--json"].name, paths["--plot"]
    ('r.json', None)
    >>> check_output_paths([("--json", folder / "r.png"), ("--plot", folder / "r.png")])
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: --plot=... is invalid: is the same file as --json
    """
    checked: dict[str, Path | None] = {}
    first_flag: dict[Path, str] = {}
    for flag, value in named:
        if value is None:
            checked[flag] = None
            continue
        path = check_output_path(flag, value, plot=flag == "--plot")
        resolved = resolved_path(flag, path)
        if resolved in first_flag:
            raise ConfigError(flag, str(value), f"is the same file as {first_flag[resolved]}")
        first_flag[resolved] = flag
        checked[flag] = path
    return checked


def _temporary_file(flag: str, destination: Path) -> Path:
    """A new empty file (``.hybridkv-*.tmp``) in ``destination``'s directory; an
    ``OSError`` becomes ``OutputPathError`` naming ``flag``."""
    try:
        handle, name = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX,
                                        dir=destination.parent)
    except OSError as err:
        raise OutputPathError(flag, destination, f"cannot create files in "
                              f"'{destination.parent}' ({err.strerror})",
                              "choose a writable directory") from err
    os.close(handle)
    return Path(name)


def _probe_writable(flag: str, target: Path) -> None:
    """Create and remove a temporary file next to ``target`` (catches read-only file
    systems and missing permissions, also for root, where ``os.access`` says yes)."""
    _temporary_file(flag, target).unlink()


def probe_directory(flag: str, directory: Path) -> None:
    """Raise ``OutputPathError`` unless this process can create files in ``directory``."""
    _probe_writable(flag, directory / "probe")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class StagedOutputs:
    """Outputs written to temporary files now and renamed into place together in
    ``commit``; used as a context manager that removes whatever was not committed."""

    def __init__(self) -> None:
        self._staged: list[tuple[str, Path, Path]] = []
        """(flag, temporary file, destination), in staging order."""

    def stage(self, flag: str, path: Path, write: Callable[[Path], object]) -> None:
        """Call ``write(temporary_path)``; an ``OSError`` becomes ``OutputPathError``."""
        temporary = _temporary_file(flag, path)
        self._staged.append((flag, temporary, path))
        try:
            os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's 0600 → what open() would give
            write(temporary)
            with temporary.open("rb+") as stream:  # data on disk before the rename
                os.fsync(stream.fileno())
        except OSError as err:
            raise OutputPathError(flag, path, f"writing failed ({err.strerror or err})",
                                  "free disk space or choose another path") from err

    def commit(self) -> None:
        """Rename every staged file onto its destination."""
        while self._staged:
            flag, temporary, destination = self._staged[0]
            try:
                os.replace(temporary, destination)
            except OSError as err:
                raise OutputPathError(flag, destination,
                                      f"renaming failed ({err.strerror})",
                                      "choose another path") from err
            self._staged.pop(0)

    def discard(self) -> None:
        """Remove every staged, uncommitted temporary file."""
        for _, temporary, _ in self._staged:
            with contextlib.suppress(OSError):
                temporary.unlink()
        self._staged.clear()

    def __enter__(self) -> StagedOutputs:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.discard()


def plot_format(path: Path) -> str:
    """The format matplotlib saves ``path`` in: its extension, lower case, no dot.

    >>> plot_format(Path("runs/hit.SVG"))
    'svg'
    """
    return path.suffix.lower().lstrip(".")


Write = tuple[str, Path | None, Callable[[Path], object]]
"""``(flag, destination or None when the flag was not given, write(temporary_path))``."""


def plot_output(destination: Path | None, draw: Callable[[Path, str], object]) -> Write:
    """The ``--plot`` entry of ``write_outputs``: ``draw(temporary_path, format)`` with the
    format ``destination``'s extension names (``plot_format``).

    >>> flag, where, write = plot_output(Path("hit.pdf"), lambda tmp, fmt: print(tmp, fmt))
    >>> flag, where, write(Path(".hybridkv-1.tmp"))
    .hybridkv-1.tmp pdf
    ('--plot', PosixPath('hit.pdf'), None)
    """
    fmt = "" if destination is None else plot_format(destination)  # None: never drawn
    return "--plot", destination, lambda tmp: draw(tmp, fmt)


def write_outputs(writes: Sequence[Write]) -> None:
    """Stage every output whose destination is given, in order, and rename them into place
    together (none of them when any write fails).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> write_outputs([("--json", folder / "r.json", lambda tmp: tmp.write_text("{}")),
    ...                ("--plot", None, lambda tmp: tmp.write_text("not written"))])
    >>> sorted(p.name for p in folder.iterdir())
    ['r.json']
    """
    with StagedOutputs() as staged:
        for flag, destination, write in writes:
            if destination is not None:
                staged.stage(flag, destination, write)
        staged.commit()


__all__ = ["StagedOutputs", "Write", "check_output_path", "path_mode", "plot_format",
           "plot_formats", "plot_output", "probe_directory", "resolved_path", "write_outputs"]
