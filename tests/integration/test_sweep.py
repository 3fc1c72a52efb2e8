"""``hybridkv sweep`` across traces × models × pools × policies: resume from ``--results``,
``--jobs`` and Ray equal to a serial run, the table, CSV / JSON / plot, bad input."""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import pytest
from cli_harness import TINY_MODEL
from cli_harness import alive as _alive
from cli_harness import children as _children
from cli_harness import cpu_seconds as _cpu_seconds
from cli_harness import spawn_cli as _spawn
from cli_harness import wait_for as _wait_for

from hybridkv.cli import main
from hybridkv.sweep import ray as sweep_ray
from hybridkv.sweep import report as report_module
from hybridkv.sweep.cells import ROW_FIELDS, TIMING_FIELDS


def _mooncake(path: Path, shift: int = 0) -> Path:
    """A small Mooncake trace: 12 requests over 4 conversations (shared 512-token blocks);
    ``shift`` changes the content (other block ids after the first)."""
    lines = []
    for i in range(12):
        session = i % 4
        blocks = [100 + session, 200 + session + shift, 300 + i]
        lines.append(json.dumps({"timestamp": i, "input_length": 1400, "output_length": 3,
                                 "hash_ids": blocks}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "tiny.toml").write_text(TINY_MODEL)
    _mooncake(folder / "a.jsonl")
    _mooncake(folder / "b.jsonl", shift=7)
    return folder


def sweep_argv(inputs: Path, *extra: str) -> list[str]:
    return ["sweep", "--trace", str(inputs / "a.jsonl"), "--trace", str(inputs / "b.jsonl"),
            "--model", f"{inputs / 'tiny.toml'},gemma3-bench", "--num-blocks", "800,3000",
            "--policy", "latest,dense", "--quiet", *extra]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as stream:
        return list(csv.DictReader(stream))


def stable(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in TIMING_FIELDS} for row in rows]


def summary(out: str) -> str:
    return next(line for line in out.splitlines() if " cells: " in line)


def test_grid_table_csv_json_and_plot(inputs: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, stderr = run(sweep_argv(inputs, "--csv", str(out / "s.csv"), "--json",
                                          str(out / "s.json"), "--plot", str(out / "s.png"),
                                          "--detail"),
                               capsys)
    assert code == 0, stderr
    rows = read_csv(out / "s.csv")
    assert list(rows[0]) == list(ROW_FIELDS)
    # 2 traces × 2 models × 2 pools × 2 policies, in grid order
    assert len(rows) == 16
    assert [(r["trace"], r["model"], r["num_blocks"], r["policy"]) for r in rows[:4]] == [
        ("a", "tiny-hybrid", "800", "latest"), ("a", "tiny-hybrid", "800", "dense"),
        ("a", "tiny-hybrid", "3000", "latest"), ("a", "tiny-hybrid", "3000", "dense")]
    for row in rows:
        hit_rate, ceiling = float(row["hit_rate"]), float(row["ceiling"])
        assert hit_rate == int(row["hit_tokens"]) / int(row["prompt_tokens"])
        assert hit_rate <= float(row["bound"]) + 1e-12 <= ceiling + 2e-12
        missed = sum(int(row[f"miss_{c}"]) for c in
                     ("cold", "evicted", "tail", "alignment", "admission"))
        assert missed == int(row["prompt_tokens"]) - int(row["hit_tokens"])
    doc = json.loads((out / "s.json").read_text())
    assert len(doc["cells"]) == 16 and all(c["status"] == "ok" for c in doc["cells"])
    assert not any(cell["resumed"] for cell in doc["cells"])
    assert (out / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir()) == ["s.csv", "s.json", "s.png"]
    for title in ("a on tiny-hybrid", "b on gemma3-bench"):
        assert title in stdout
    assert "bound_fa" in stdout and "evicted" in stdout
    assert summary(stdout).startswith("16 cells: 16 computed, 0 resumed;")


def test_nothing_is_written_unless_named(inputs: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    code, stdout, stderr = run(sweep_argv(inputs), capsys)
    assert code == 0, stderr
    assert "a on tiny-hybrid" in stdout
    assert list(work.iterdir()) == []


def test_resume_skips_finished_cells_and_recomputes_changed_ones(
        inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    first_csv = tmp_path / "first.csv"
    code, stdout, stderr = run(sweep_argv(inputs, "--results", str(results), "--csv",
                                          str(first_csv)), capsys)
    assert code == 0, stderr
    assert summary(stdout).startswith("16 cells: 16 computed, 0 resumed")
    stored = sorted(results.iterdir())
    assert len(stored) == 16 and all(p.name.startswith("cell-") for p in stored)

    # the same sweep again: every cell comes from disk, the CSV is byte-identical
    again_csv = tmp_path / "again.csv"
    code, stdout, _ = run(sweep_argv(inputs, "--results", str(results), "--csv",
                                     str(again_csv)), capsys)
    assert code == 0
    assert summary(stdout).startswith("16 cells: 0 computed, 16 resumed")
    assert again_csv.read_text() == first_csv.read_text()

    # mark every stored row, so a reused row is visible; then change trace b's content
    for path in stored:
        document = json.loads(path.read_text())
        document["row"]["hit_rate"] = 0.999
        path.write_text(json.dumps(document))
    _mooncake(inputs / "b.jsonl", shift=11)
    third_csv = tmp_path / "third.csv"
    code, stdout, _ = run(sweep_argv(inputs, "--results", str(results), "--csv",
                                     str(third_csv)), capsys)
    assert code == 0
    assert summary(stdout).startswith("16 cells: 8 computed, 8 resumed")
    rows = read_csv(third_csv)
    assert {r["hit_rate"] for r in rows if r["trace"] == "a"} == {"0.999"}
    assert all(r["hit_rate"] != "0.999" for r in rows if r["trace"] == "b")

    # a new pool size computes only its cells; a scheduler setting recomputes all
    code, stdout, _ = run([*sweep_argv(inputs, "--results", str(results)), "--num-blocks",
                           "800,3000,5000"], capsys)
    assert summary(stdout).startswith("24 cells: 8 computed, 16 resumed")
    code, stdout, _ = run(sweep_argv(inputs, "--results", str(results), "--max-running",
                                     "2"), capsys)
    assert summary(stdout).startswith("16 cells: 16 computed, 0 resumed")
    # an edited model file with the same name recomputes that model's cells only
    (inputs / "tiny.toml").write_text(TINY_MODEL.replace("window = 32", "window = 48"))
    code, stdout, _ = run(sweep_argv(inputs, "--results", str(results)), capsys)
    assert summary(stdout).startswith("16 cells: 8 computed, 8 resumed")


def test_a_corrupt_stored_cell_is_recomputed(inputs: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    argv = sweep_argv(inputs, "--results", str(results))
    assert run(argv, capsys)[0] == 0
    victim = sorted(results.iterdir())[3]
    victim.write_text(victim.read_text()[:50])  # a torn file (not from us: we rename)
    code, stdout, _ = run(argv, capsys)
    assert code == 0
    assert summary(stdout).startswith("16 cells: 1 computed, 15 resumed")
    assert json.loads(victim.read_text())["row"]["key"] == victim.stem.removeprefix("cell-")


def test_jobs_give_the_serial_results(inputs: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Too-small pools (8 blocks) included: their results cross the process boundary."""
    serial, parallel = tmp_path / "serial.csv", tmp_path / "jobs.csv"
    pools = ["--num-blocks", "8,800,3000"]
    assert run(sweep_argv(inputs, "--csv", str(serial), *pools), capsys)[0] == 0
    code, _, stderr = run(sweep_argv(inputs, "--csv", str(parallel), "--jobs", "2", *pools),
                          capsys)
    assert code == 0, stderr
    assert stable(read_csv(parallel)) == stable(read_csv(serial))
    assert len(read_csv(serial)) == 24
    assert sum(row["status"] == "too small" for row in read_csv(serial)) == 8


def _ray_or_skip() -> None:
    if not sweep_ray.ray_installed():
        if os.environ.get("CI"):
            pytest.fail("Ray is part of the test extra: pip install -e '.[test]'")
        pytest.skip("Ray is not installed (pip install 'hybridkv[ray]')")


def test_local_ray_gives_the_serial_results(inputs: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _ray_or_skip()
    serial, on_ray = tmp_path / "serial.csv", tmp_path / "ray.csv"
    results = tmp_path / "results"
    argv = sweep_argv(inputs, "--num-blocks", "8,800")  # 16 cells, 8 too small
    assert run([*argv, "--csv", str(serial)], capsys)[0] == 0
    code, stdout, stderr = run([*argv, "--csv", str(on_ray), "--ray", "--jobs", "2",
                                "--results", str(results)], capsys)
    assert code == 0, stderr
    assert stable(read_csv(on_ray)) == stable(read_csv(serial))
    assert summary(stdout).startswith(f"16 cells: 16 computed, 0 resumed in {results}, "
                                      "8 too small")
    assert len(list(results.iterdir())) == 16


def test_missing_ray_is_one_line_naming_the_install(
        inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sweep_ray, "ray_installed", lambda: False)
    out = tmp_path / "out.csv"
    code, stdout, stderr = run(sweep_argv(inputs, "--ray", "--csv", str(out)), capsys)
    assert code == 2
    assert stderr.strip().splitlines() == [
        "hybridkv sweep: error: --ray='local' is invalid: needs Ray, which is not installed: "
        "pip install 'hybridkv[ray]' (or pip install 'ray==2.60.0')"]
    assert not out.exists() and stdout == ""


def test_plot_panels_markers_and_ceiling_colour(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """Panels per trace × model; every policy line has its own marker and colour; equal
    lines nest (smaller marker drawn over a larger one); the ceiling's colour is no
    policy's."""
    import matplotlib.pyplot as plt

    figures: list[object] = []
    monkeypatch.setattr(plt, "close", figures.append)
    rows = [{"trace": trace, "model": model, "num_blocks": pool, "policy": policy,
             "admission": "fcfs", "hit_rate": 0.5, "bound": 0.6, "ceiling": 0.7}
            for trace in ("t1", "t2") for model in ("m1",) for pool in (100, 2000)
            for policy in ("latest", "dense", "prepend")]
    report_module.plot_sweep(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    (figure,) = figures
    axes = [ax for ax in figure.axes if ax.get_visible()]  # type: ignore[attr-defined]
    assert len(axes) == 2
    lines = {line.get_label(): line for line in axes[0].get_lines()}
    policies = [lines[name] for name in ("latest", "dense", "prepend")]
    assert len({line.get_marker() for line in policies}) == 3
    sizes = [line.get_markersize() for line in policies]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3
    colours = {line.get_color() for line in policies}
    assert len(colours) == 3 and lines["ceiling"].get_color() not in colours
    assert report_module.SWEEP_CEILING_COLOR not in report_module.SWEEP_POLICY_COLORS
    assert list(lines["ceiling"].get_ydata()) == [70.0, 70.0]
    assert list(lines["bound"].get_ydata()) == [60.0, 60.0]
    assert axes[0].get_xscale() == "log"  # 100 → 2000 blocks spans 10× and more
    plt.close(figure)  # type: ignore[arg-type]


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--results", "{in}/a.jsonl"], "--results"),
    (["--results", "{tmp}/no/such/dir"], "not an existing directory"),
    (["--csv", "{tmp}/x.csv", "--json", "{tmp}/x.csv"], "same file as --csv"),
    (["--results", "{tmp}/s.csv"], "--csv='{tmp}/s.csv' is invalid: is the --results"),
    (["--results", "{tmp}/r", "--json", "{tmp}/r"], "--json='{tmp}/r' is invalid: is the"),
    (["--jobs", "0"], "--jobs"),
    (["--ray", ""], "--ray: must not be empty"),
    (["--model", "gemma3-bench,,dsv4-bench"], "empty item"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--trace", "{tmp}/missing.jsonl"], "missing.jsonl"),
    (["--workload", "aba", "--set", "prompt_tokens=0"], "prompt_tokens"),
    (["--kv-memory", "1GiB,lots"], "--kv-memory"),
    (["--policy", "lastest"], "did you mean 'latest'"),
    (["--admission", "fcfs,bogus"], "bogus"),
    (["--plot", "{tmp}/p.txt"], "not a plot format"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
        inputs: Path, tmp_path: Path, extra: list[str], fragment: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    filled = [e.replace("{in}", str(inputs)).replace("{tmp}", str(out)) for e in extra]
    argv = sweep_argv(inputs, "--csv", str(out / "s.csv"))
    if "--num-blocks" in filled or "--kv-memory" in filled:
        at = argv.index("--num-blocks")
        del argv[at:at + 2]
    code, stdout, stderr = run([*argv, *filled], capsys)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert fragment.replace("{tmp}", str(out)).lower() in lines[0].lower(), lines[0]
    assert sorted(p.name for p in out.iterdir()) == [], "wrote something"
    del stdout


def test_set_needs_a_workload(inputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = run(sweep_argv(inputs, "--set", "prompt_tokens=64"), capsys)
    assert code == 2 and "need --workload" in stderr


def test_traces_and_workloads_mix(inputs: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mix.csv"
    code, _, stderr = run([
        "sweep", "--trace", str(inputs / "a.jsonl"), "--workload", "aba", "--set",
        "prompt_tokens=64", "--set", "output_tokens=2", "--model", str(inputs / "tiny.toml"),
        "--num-blocks", "300", "--policy", "latest", "--quiet", "--csv", str(out)], capsys)
    assert code == 0, stderr
    assert [r["trace"] for r in read_csv(out)] == ["a", "aba"]


def test_kv_memory_budgets_per_model(inputs: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mem.csv"
    code, _, stderr = run(["sweep", "--trace", str(inputs / "a.jsonl"), "--model",
                           "gemma3-bench,dsv4-bench", "--kv-memory", "8GiB,16GiB", "--policy",
                           "latest", "--quiet", "--csv", str(out)], capsys)
    assert code == 0, stderr
    rows = read_csv(out)
    assert [(r["model"], r["kv_memory"]) for r in rows] == [
        ("gemma3-bench", "8GiB"), ("gemma3-bench", "16GiB"),
        ("dsv4-bench", "8GiB"), ("dsv4-bench", "16GiB")]
    for row in rows:  # each budget converted with its model's bytes per block
        assert int(row["pool_bytes"]) <= (8 if row["kv_memory"] == "8GiB" else 16) << 30
    assert rows[0]["num_blocks"] != rows[2]["num_blocks"]


LONG = ["--workload", "agentic", "--set", "num_sessions=32", "--set", "num_turns=20"]
"""A workload whose cells replay for minutes."""


def test_ctrl_c_keeps_finished_cells_and_writes_no_output(inputs: Path,
                                                          tmp_path: Path) -> None:
    """Quick cells (trace a) first, then long ones: interrupt once the quick ones are
    stored; exit 130, one line saying where they are, no CSV, no temporary file."""
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    process = _spawn(["sweep", "--trace", str(inputs / "a.jsonl"), *LONG, "--model",
                      str(inputs / "tiny.toml"), "--policy", "latest,dense", "--num-blocks",
                      "5000,9000", "--quiet", "--results", str(results), "--csv",
                      str(out / "s.csv")], out)
    assert _wait_for(lambda: process.poll() is not None or (
        results.is_dir() and len(list(results.glob("cell-*.json"))) == 4), 120)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines() == [
        "hybridkv sweep: interrupted (Ctrl-C); no output written; 4 finished cells kept "
        f"in {results} (a re-run resumes)"]
    assert list(out.iterdir()) == []
    assert len(list(results.iterdir())) == 4


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_sigterm_stops_the_jobs_workers(inputs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    process = _spawn(["sweep", *LONG, "--model", str(inputs / "tiny.toml"), "--policy",
                      "latest,dense", "--num-blocks", "5000,9000", "--quiet", "--jobs", "2",
                      "--csv", str(out / "s.csv"), "--results", str(out / "cells")], out)
    assert _wait_for(lambda: len(_children(process.pid)) >= 2 and all(
        _cpu_seconds(w) > 0.3 for w in _children(process.pid)), 120), process.communicate()
    workers = _children(process.pid)  # both replaying (past their start-up)
    process.terminate()
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines() == [
        "hybridkv sweep: terminated (SIGTERM); no output written"]
    assert _wait_for(lambda: not any(_alive(w) for w in workers), 10), "workers still run"
    assert sorted(p.name for p in out.iterdir()) == ["cells"]
    assert list((out / "cells").iterdir()) == []


def test_equal_traces_under_two_names_share_their_cells(
        inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "a.jsonl").write_bytes((inputs / "a.jsonl").read_bytes())
    out = tmp_path / "equal.csv"
    code, stdout, stderr = run([
        "sweep", "--trace", str(inputs / "a.jsonl"), "--trace", str(copy / "a.jsonl"),
        "--model", str(inputs / "tiny.toml"), "--num-blocks", "800", "--policy",
        "latest,dense", "--quiet", "--csv", str(out)], capsys)
    assert code == 0, stderr
    rows = read_csv(out)
    assert [r["trace"] for r in rows] == ["a", "a", "a #2", "a #2"]
    assert stable(rows[:2]) == [{**r, "trace": "a"} for r in stable(rows[2:])]
    assert summary(stdout).startswith("4 cells: 2 computed")


def _descendants(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        found += [child, *_descendants(child)]
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_sigterm_stops_ray_tasks_and_the_local_ray(inputs: Path, tmp_path: Path) -> None:
    """SIGTERM while Ray tasks replay: exit 143 with one line, every process the sweep
    started (Ray's services and workers) gone, nothing written."""
    _ray_or_skip()
    out = tmp_path / "out"
    out.mkdir()
    process = _spawn(["sweep", *LONG, "--model", str(inputs / "tiny.toml"), "--policy",
                      "latest,dense", "--num-blocks", "5000,9000", "--quiet", "--ray",
                      "--jobs", "2", "--csv", str(out / "s.csv")], out)

    def tasks_running() -> bool:
        return process.poll() is not None or sum(
            "_ray_cell" in _cmdline(p) for p in _descendants(process.pid)) >= 2

    assert _wait_for(tasks_running, 120), "no Ray task started"
    assert process.poll() is None, process.communicate()
    started = _descendants(process.pid)
    process.terminate()
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines() == [
        "hybridkv sweep: terminated (SIGTERM); no output written"]
    assert _wait_for(lambda: not any(_alive(p) for p in started), 15), [
        _cmdline(p) for p in started if _alive(p)]
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(("address", "fragment"), [
    ("127.0.0.1:1", "nothing answers there"),
    ("no-port", "is not HOST:PORT"),
    ("host:99999", "is not HOST:PORT"),
])
def test_a_bad_ray_address_is_one_line_at_once(inputs: Path, tmp_path: Path, address: str,
                                               fragment: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before any work (Ray itself would retry a dead address for minutes)."""
    _ray_or_skip()
    out = tmp_path / "s.csv"
    code, _, stderr = run(sweep_argv(inputs, "--ray", address, "--csv", str(out)), capsys)
    assert code == 2
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"hybridkv sweep: error: --ray='{address}'") and fragment in line
    assert not out.exists()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_sigterm_while_the_workers_start(inputs: Path, tmp_path: Path) -> None:
    """SIGTERM the moment the first worker exists (before it set its handlers): the
    signal waits until the pool is owned, then the sweep stops with one line, no hang."""
    process = _spawn(["sweep", *LONG, "--model", str(inputs / "tiny.toml"), "--policy",
                      "latest,dense", "--num-blocks", "5000,9000", "--quiet", "--jobs", "2"],
                     tmp_path)
    assert _wait_for(lambda: bool(_children(process.pid)) or process.poll() is not None, 60)
    workers = _children(process.pid)
    process.terminate()
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines() == [
        "hybridkv sweep: terminated (SIGTERM); no output written"]
    assert _wait_for(lambda: not any(_alive(w) for w in workers), 10), "workers still run"
