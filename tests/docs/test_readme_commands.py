"""Every command in ``README.md`` runs and exits 0 (issue 24 part 7): a stale or failing
example fails here. New ``bash`` blocks are picked up without touching this file.

How the README is read:

- every fenced ``bash`` block; a line ending in ``\\`` continues on the next; ``#`` starts
  a comment (outside quotes); ``a && b`` is two commands;
- not run: ``pip install …`` and ``python -m pytest`` — the install and this very suite,
  which CI's ``.ci/run`` runs itself;
- a block right after the comment ``<!-- readme-test: skip REASON -->`` is not run (for
  what CI cannot do, e.g. it needs a GPU); the reason is required. Use it only then.

Substitutions, so that the whole README runs in about 3 minutes on 2 cores (each keeps the
command's shape, flags and outputs):

- ``--limit``: a command of ``replay``, ``sweep``, ``cluster`` or ``check-trace`` runs at
  most ``LIMITS`` requests (the flag is added when absent, lowered when larger). The
  README's sweep keeps 250 requests: request ``mooncake-249`` is the one gemma3-bench's
  8 GiB pool cannot hold, so its too-small cells are part of what is checked;
- fixed ports (``tcp://*:5557``, ``--metrics 9400``) become free loopback ports, and
  ``--linger-seconds`` becomes 0.5.

Commands run as ``python -m hybridkv.cli …`` (``hybridkv``) or with this interpreter
(``python …``), on this checkout's source, in a temporary folder that links every
top-level entry of the checkout and sits next to a ``shared`` link (the README's
``../shared``: found beside the checkout, beside the main worktree, or at
``$HYBRIDKV_SHARED``); the outputs the commands write land there.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SKIP_MARK = re.compile(r"<!--\s*readme-test:\s*skip\b(?P<reason>.*?)-->", re.S)
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
NOT_RUN = (("pip",), ("python", "-m", "pip"), ("python", "-m", "pytest"))
"""Command prefixes CI's ``.ci/run`` runs itself."""
LIMITED = ("replay", "sweep", "cluster", "check-trace")
LIMITS = (("sweep", 250), ("weka_cc_agentic", 40), ("retention-microbench", 2), ("", 48))
"""(substring of the command, most requests it runs): the first match applies."""
TIMEOUT_S = 420


@dataclass(frozen=True, slots=True)
class Command:
    line: int
    """README line of the command's first line."""
    argv: tuple[str, ...]
    skip: str | None
    """Why the block is not run (its marker's reason), else ``None``."""

    @property
    def label(self) -> str:
        return f"README:{self.line}:{' '.join(self.argv)[:60]}"


def readme_commands(text: str) -> list[Command]:
    """The commands of ``text``'s ``bash`` blocks, in order (``test_the_parser``)."""
    commands: list[Command] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence is None or fence["lang"] not in ("bash", "sh", "shell", "console"):
            index += 1
            continue
        marks = list(SKIP_MARK.finditer("\n".join(lines[:index])))
        before = "\n".join(lines[:index]).rstrip()
        skip = marks[-1]["reason"].strip() if marks and before.endswith(
            marks[-1].group(0)) else None
        if skip == "":
            raise ValueError(f"README line {index}: a readme-test skip mark needs a reason")
        index += 1
        pending, start = "", index + 1
        while index < len(lines) and not FENCE.match(lines[index]):
            line = lines[index]
            pending = f"{pending} {line.rstrip()}" if pending else line.rstrip()
            index += 1
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            for part in _split_and(pending):
                commands.append(Command(start, tuple(part), skip))
            pending, start = "", index + 1
        index += 1
    return commands


def _split_and(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    parts: list[list[str]] = [[]]
    for token in lexer:
        if token == "&&":
            parts.append([])
        else:
            parts[-1].append(token)
    return [p for p in parts if p]


def runnable(command: Command) -> bool:
    argv = ("python", *command.argv[1:]) if command.argv[0] == "python3" else command.argv
    return not any(argv[:len(prefix)] == prefix for prefix in NOT_RUN)


def substituted(argv: tuple[str, ...]) -> list[str]:
    """``argv`` with the documented substitutions (limits, ports, linger)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if re.fullmatch(r"tcp://\*:\d+", arg):
            out[i] = f"tcp://127.0.0.1:{free_port()}"
        elif i and out[i - 1] == "--metrics" and arg.isdigit():
            out[i] = str(free_port())
        elif i and out[i - 1] == "--linger-seconds":
            out[i] = "0.5"
    if len(out) > 1 and out[0] == "hybridkv" and out[1] in LIMITED:
        text = " ".join(out)
        limit = next(n for key, n in LIMITS if key in text)
        if "--limit" in out:
            at = out.index("--limit") + 1
            out[at] = str(min(int(out[at]), limit))
        else:
            out += ["--limit", str(limit)]
    return out


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def shared_folder() -> Path | None:
    """The README's ``../shared``: ``$HYBRIDKV_SHARED``, beside this checkout, beside the
    main worktree of this repository (a linked worktree has none of its own), or beside
    the local repository this one was cloned from (CI's fresh clone)."""
    candidates = [Path(os.environ["HYBRIDKV_SHARED"])] if "HYBRIDKV_SHARED" in os.environ \
        else []
    candidates += _beside(ROOT)
    origin = _git(ROOT, "remote", "get-url", "origin")
    if origin and Path(origin).is_dir():
        candidates += _beside(Path(origin))
    return next((c for c in candidates if (c / "traces").is_dir()), None)


def _beside(repo: Path) -> list[Path]:
    """``shared`` beside ``repo`` and beside its main worktree."""
    common = _git(repo, "rev-parse", "--git-common-dir")
    main = [(repo / common).resolve().parent.parent / "shared"] if common else []
    return [repo.resolve().parent / "shared", *main]


def _git(repo: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=repo, text=True, capture_output=True,
                              check=False, timeout=30)
    except OSError:  # no git
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("readme")
    checkout = base / "checkout"
    checkout.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "build"):
            (checkout / entry.name).symlink_to(entry)
    shared = shared_folder()
    if shared is not None:
        (base / "shared").symlink_to(shared)
    return checkout


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    if argv[0] == "hybridkv":
        argv = [sys.executable, "-m", "hybridkv.cli", *argv[1:]]
    elif argv[0] in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run(argv, cwd=cwd, env=env, text=True, capture_output=True,
                          timeout=TIMEOUT_S, check=False)


COMMANDS = readme_commands(README.read_text(encoding="utf-8"))


def test_the_readme_has_commands() -> None:
    assert sum(runnable(c) and c.skip is None for c in COMMANDS) >= 8


@pytest.mark.parametrize("command", [c for c in COMMANDS if runnable(c)],
                         ids=lambda c: c.label)
def test_readme_command_exits_0(command: Command, workdir: Path) -> None:
    if command.skip is not None:
        pytest.skip(f"marked in the README: {command.skip}")
    if any("../shared" in arg for arg in command.argv) and shared_folder() is None:
        pytest.fail("the README reads ../shared/traces: put the shared folder beside the "
                    "checkout or set HYBRIDKV_SHARED")
    argv = substituted(command.argv)
    done = run(argv, workdir)
    assert done.returncode == 0, (
        f"README line {command.line}: `{shlex.join(argv)}` exited {done.returncode}\n"
        f"{done.stderr[-3000:]}")
    assert "Traceback" not in done.stderr


def test_a_failing_command_fails_the_check(workdir: Path) -> None:
    """The check can fail: a README command that exits non-zero is caught."""
    (command,) = readme_commands("```bash\nhybridkv replay --policy lastest\n```\n")
    done = run(substituted(command.argv), workdir)
    assert done.returncode == 2 and "did you mean 'latest'" in done.stderr


def test_skip_marks_need_a_reason() -> None:
    text = "<!-- readme-test: skip needs a GPU -->\n```bash\nhybridkv verify\n```\n"
    assert readme_commands(text)[0].skip == "needs a GPU"
    assert readme_commands(text.replace("<!--", "<!-- x -->\n\n<!--", 1))[0].skip
    with pytest.raises(ValueError, match="needs a reason"):
        readme_commands(text.replace(" needs a GPU", ""))
    assert readme_commands("<!-- readme-test: skip gpu -->\ntext\n```bash\nhybridkv x\n```"
                           )[0].skip is None  # the mark must sit right before the block


def test_the_parser() -> None:
    text = ("x\n```bash\npip install . && hybridkv replay \\\n  --limit 3  # fast\n"
            "hybridkv cluster --events 'tcp://*:5557'\n```\n```python\nx = 1\n```\n")
    commands = readme_commands(text)
    assert [(c.line, c.argv) for c in commands] == [
        (3, ("pip", "install", ".")), (3, ("hybridkv", "replay", "--limit", "3")),
        (5, ("hybridkv", "cluster", "--events", "tcp://*:5557"))]
    assert [runnable(c) for c in commands] == [False, True, True]


def test_the_substitutions() -> None:
    assert substituted(("hybridkv", "sweep", "--trace", "t", "--limit", "1000")) == [
        "hybridkv", "sweep", "--trace", "t", "--limit", "250"]
    assert substituted(("hybridkv", "replay", "--limit", "7")) == [
        "hybridkv", "replay", "--limit", "7"]
    events = substituted(("hybridkv", "replay", "--events", "tcp://*:5557", "--metrics",
                          "9400", "--linger-seconds", "30"))
    assert events[3].startswith("tcp://127.0.0.1:") and events[3] != "tcp://127.0.0.1:5557"
    assert events[5].isdigit() and events[7] == "0.5" and events[-2:] == ["--limit", "48"]
    assert substituted(("hybridkv", "verify")) == ["hybridkv", "verify"]
