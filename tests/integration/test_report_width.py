"""The default reports of ``replay``, ``sweep`` and ``cluster`` are readable at 80 and 120
columns and piped: no cell cut (``…``), no row wrapped, every number whole.

Each report is rendered by the CLI (``main``) at ``COLUMNS=80``, ``COLUMNS=120`` and with
no ``COLUMNS`` (standard output is pytest's capture, not a terminal: the piped case). The
check reads each table back: its title, its header, a rule, then exactly one line per row
that starts with the row's label and holds the row's numbers as the ``--json`` document
has them (so a wrapped row, a cut number or a squeezed column all fail), no line wider
than the terminal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.cli.app import MIN_REPORT_WIDTH, PIPED_WIDTH

WIDTHS = (80, 120, None)
"""Terminal widths tested; ``None`` = piped (no ``COLUMNS``: ``PIPED_WIDTH``)."""
SMALL_AGENTIC = ["--set", "num_sessions=3", "--set", "num_turns=3", "--set",
                 "first_prompt_tokens=2048", "--set", "turn_tokens=512"]
"""The default workload (agentic), small: the table's layout depends on its labels and
the digits of its numbers, not on the workload's size."""


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mooncake trace shaped like the README's: 16 requests in 4 conversations of
    growing 20k-token prompts sharing 512-token blocks, then one of 135,000 tokens (like
    its ``mooncake-249``: gemma3-bench's 8 GiB pool cannot hold it)."""
    path = tmp_path_factory.mktemp("width") / "synthetic_trace.jsonl"
    lines = []
    for i in range(16):
        session, turn = i % 4, i // 4
        blocks = [1000 * session + b for b in range(36 + 4 * turn)]
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * len(blocks) - 100,
                                 "output_length": 4, "hash_ids": blocks}))
    lines.append(json.dumps({"timestamp": 16, "input_length": 135_000, "output_length": 4,
                             "hash_ids": list(range(9000, 9264))}))
    path.write_text("\n".join(lines) + "\n")
    return path


def render(argv: list[str], width: int | None, monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture[str]) -> str:
    if width is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(width))
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def table_rows(text: str, title: str, count: int, width: int) -> list[str]:
    """The ``count`` row lines of the table titled ``title`` (checked: one header line, a
    rule; no ``…`` anywhere in the report, no line of it wider than ``width``: the notes
    under the tables are wrapped between words, never by the terminal inside a number)."""
    assert "…" not in text, text
    lines = text.splitlines()
    for line in lines:
        assert len(line.rstrip()) <= width, f"{len(line.rstrip())} > {width}: {line}"
    starts = [i for i, line in enumerate(lines) if line.startswith(title)]
    assert starts, f"no table titled {title!r} in:\n{text}"
    start = starts[0]
    rule = lines[start + 2]  # the header is one line: the rule follows it
    assert set(rule.strip()) == {"─"}, f"header wraps (no rule under it):\n{text}"
    return lines[start + 3:start + 3 + count]


def seconds(json_value: float, digits: int) -> tuple[str, ...]:
    """How the table may print a time the JSON holds rounded to 4 decimals: the table
    rounds the unrounded time, so ``0.15004`` is ``0.2`` there but ``0.15`` → ``0.1`` from
    the JSON (double rounding); either neighbour of the JSON value's rounding is whole.

    >>> seconds(0.15, 1)
    ('0.1', '0.2')
    """
    return tuple(dict.fromkeys(f"{json_value + delta:.{digits}f}"
                               for delta in (-5e-5, 5e-5)))


def assert_row(line: str, label: str, values: list[str | tuple[str, ...]]) -> None:
    """One table line holds the whole row: it starts with its label, and every value
    (or one of its alternatives) appears whole in it, in order."""
    assert line.startswith(label), f"row wrapped or mislabelled: {line!r}, wanted {label!r}"
    rest = line[len(label):]
    for value in values:
        options = (value,) if isinstance(value, str) else value
        found = [option for option in options if f" {option}" in rest]
        assert found, f"{value!r} not whole in {line!r}"
        rest = rest[rest.index(found[0]) + len(found[0]):]


def pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.2f}%"


@pytest.mark.parametrize("width", [*WIDTHS, 5, 30])
def test_default_replay_report_fits(width: int | None, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``COLUMNS`` below 80 gets the 80-column layout (it cut numbers to ``25.`` and
    dropped the policy column)."""
    doc_path = tmp_path / "r.json"
    out = render(["replay", *SMALL_AGENTIC, "--quiet", "--json", str(doc_path)], width,
                 monkeypatch, capsys)
    doc = json.loads(doc_path.read_text())
    assert len(doc["runs"]) == 6  # the six core policies, the default
    rows = table_rows(out, f"{doc['trace']} on {doc['model']}", len(doc["runs"]),
                      max(width or PIPED_WIDTH, MIN_REPORT_WIDTH))
    assert f"ceiling {pct(doc['ceiling'])}" in out
    for line, run in zip(rows, doc["runs"], strict=True):
        assert_row(line, run["policy"], [pct(run["hit_rate"]), pct(run["bound"]),
                                         seconds(run['wall_seconds'], 2)])


@pytest.mark.parametrize("width", WIDTHS)
def test_time_clock_replay_report_fits(width: int | None, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``--clock time --slo``: the table shows TTFT p99 and the goodput ``*`` is given
    for (3 significant digits; runs equal there all get it), every core policy whole."""
    doc_path = tmp_path / "t.json"
    out = render(["replay", *SMALL_AGENTIC, "--model", "gemma3-1b", "--clock", "time",
                  "--rate", "0.5", "--gpu", "h200", "--slo", "ttft=2,tpot=50ms", "--quiet",
                  "--json", str(doc_path)], width, monkeypatch, capsys)
    runs = json.loads(doc_path.read_text())["runs"]
    assert len(runs) == 6
    rows = table_rows(out, "agentic on gemma3-1b", len(runs), width or PIPED_WIDTH)
    best = max(float(f"{run['time']['goodput_rps']:.3g}") for run in runs)
    for line, run in zip(rows, runs, strict=True):
        goodput = f"{run['time']['goodput_rps']:.3g}"
        label = run["policy"] + (" *" if float(goodput) == best else "")
        assert_row(line, label, [pct(run["hit_rate"]), pct(run["bound"]), goodput])
    assert "* = best goodput" in out


@pytest.mark.parametrize("width", WIDTHS)
def test_readme_shaped_sweep_report_fits(width: int | None, trace: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The README's sweep: two models × three memory sizes × the core policies."""
    doc_path = tmp_path / "s.json"
    out = render(["sweep", "--trace", str(trace), "--model",
                  "dsv4-bench,gemma3-bench", "--kv-memory", "8GiB,16GiB,32GiB", "--policy",
                  "core", "--quiet", "--json", str(doc_path)], width, monkeypatch, capsys)
    cells = json.loads(doc_path.read_text())["cells"]
    assert len(cells) == 36
    for model in ("dsv4-bench", "gemma3-bench"):
        panel = [c for c in cells if c["model"] == model]
        rows = table_rows(out, f"synthetic_trace on {model}", len(panel),
                          width or PIPED_WIDTH)
        for line, cell in zip(rows, panel, strict=True):
            label = f"{cell['num_blocks']:,}"
            values = ([pct(cell["hit_rate"]), pct(cell["bound"])] if cell["status"] == "ok"
                      else ["too small", f"needs ≥ {cell['min_num_blocks']:,}"])
            assert_row(line.lstrip(), label, [cell["kv_memory"], cell["policy"], *values])
    assert sum(c["status"] == "too small" for c in cells) == 6  # gemma3-bench at 8 GiB


@pytest.mark.parametrize("width", WIDTHS)
def test_default_cluster_report_fits(width: int | None, trace: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    doc_path = tmp_path / "c.json"
    out = render(["cluster", "--trace", str(trace), "--num-blocks",
                  "20000", "--quiet", "--json", str(doc_path)], width, monkeypatch, capsys)
    doc = json.loads(doc_path.read_text())
    assert len(doc["runs"]) == 5  # every router, the default
    rows = table_rows(out, "synthetic_trace on", len(doc["runs"]), width or PIPED_WIDTH)
    for line, run in zip(rows, doc["runs"], strict=True):
        assert_row(line, run["router"], [pct(run["hit_rate"]),
                                         f"{run['load_imbalance']:.2f}",
                                         seconds(run['wall_seconds'], 1)])


@pytest.mark.parametrize("command", ["replay", "cluster"])
def test_detail_tables_fit_80_columns(command: str, trace: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    argv = (["replay", *SMALL_AGENTIC] if command == "replay" else
            ["cluster", "--trace", str(trace), "--num-blocks", "20000",
             "--router", "round-robin,prefix-residency"])
    out = render([*argv, "--quiet", "--detail"], 80, monkeypatch, capsys)
    assert "…" not in out and "--detail" not in out  # the hint is left out once given
    titles = (["miss causes", "tokens", "waiting"] if command == "replay" else ["backlogs"])
    runs = 6 if command == "replay" else 2
    for title in titles:
        rows = table_rows(out, title, runs, 80)
        assert all(line.split()[0] in ("dense", "reachable", "prepend", "latest",
                                       "interval:32768", "pin:32768", "round-robin",
                                       "prefix-residency") for line in rows)
