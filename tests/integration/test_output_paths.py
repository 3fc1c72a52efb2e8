"""Unresolvable output paths, for every output flag of every command: a symbolic-link loop
(the file itself, two links naming each other, a loop in the parent directory), a name too
long for the file system, a NUL character. Each is one line on stderr naming the flag and
the problem, exit 2, before any replay, nothing written (issue 24 part 6a: ``--json
loop.json`` used to end in a ``RuntimeError: Symlink loop`` traceback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.errors import OutputPathError
from hybridkv.outputs import StagedOutputs

QUICK = ["--workload", "aba", "--set", "prompt_tokens=64", "--set", "output_tokens=2",
         "--policy", "latest", "--quiet"]
OUTPUT_FLAGS = [
    ("replay", "--json", ".json"), ("replay", "--plot", ".png"),
    ("replay", "--metrics", ".prom"),
    ("sweep", "--csv", ".csv"), ("sweep", "--json", ".json"), ("sweep", "--plot", ".png"),
    ("sweep", "--results", ""),
    ("cluster", "--json", ".json"), ("cluster", "--plot", ".png"),
]
"""(command, flag, file extension): every option that names a file or folder to write."""
POOL = {"replay": [], "sweep": ["--num-blocks", "200"],
        "cluster": ["--num-blocks", "200", "--router", "round-robin"]}
KINDS = {
    "self-loop": ("loop{ext}", "symbolic-link loop"),
    "two-link-loop": ("a{ext}", "symbolic-link loop"),
    "parent-loop": ("loopdir/out{ext}", "symbolic-link loop"),
    "name-too-long": ("{long}{ext}", "too long"),
    "nul-character": ("bad\0name{ext}", "NUL"),
}
"""(path template, fragment of the one-line error)."""


def make_traps(folder: Path, ext: str) -> None:
    (folder / f"loop{ext}").symlink_to(f"loop{ext}")
    (folder / f"a{ext}").symlink_to(f"b{ext}")
    (folder / f"b{ext}").symlink_to(f"a{ext}")
    (folder / "loopdir").symlink_to("loopdir")


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("command", "flag", "ext"), OUTPUT_FLAGS)
def test_unresolvable_output_path_is_one_line_exit_2(
        command: str, flag: str, ext: str, kind: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    make_traps(tmp_path, ext)
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    template, fragment = KINDS[kind]
    path = template.format(ext=ext, long="x" * 300)
    code = main([command, *QUICK, *POOL[command], flag, path])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"hybridkv {command}: error: {flag} "), lines[0]
    assert fragment in lines[0], lines[0]
    assert code == 2
    assert captured.out == ""  # refused before any replay
    assert sorted(os.listdir(tmp_path)) == before


def test_a_link_to_a_writable_file_still_works(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The check is not a refusal of links: a link to a regular file is written through
    the staging rename (the link is replaced by the file)."""
    (tmp_path / "target.json").write_text("old\n")
    (tmp_path / "link.json").symlink_to("target.json")
    assert main(["replay", *QUICK, "--json", str(tmp_path / "link.json")]) == 0, \
        capsys.readouterr().err
    assert (tmp_path / "link.json").read_text().startswith("{")


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_a_failed_rename_names_the_flag(flag: str, tmp_path: Path) -> None:
    """A destination that became a directory while the command ran: the error names the
    option the user typed (it used to name the path twice), and the staged file is gone."""
    destination = tmp_path / "out.json"
    with StagedOutputs() as staged:
        staged.stage(flag, destination, lambda tmp: tmp.write_text("{}"))
        destination.mkdir()
        with pytest.raises(OutputPathError) as caught:
            staged.commit()
    assert str(caught.value).startswith(f"{flag} '{destination}': renaming failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
