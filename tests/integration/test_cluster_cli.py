"""``hybridkv cluster`` end to end: outputs, bad input, backends agree, signals."""

from __future__ import annotations

import importlib.util
import json
import signal
import time
from pathlib import Path

import pytest
from cli_harness import alive as _alive
from cli_harness import children as _children
from cli_harness import cpu_seconds as _cpu_seconds
from cli_harness import needs_proc
from cli_harness import spawn_cli as _spawn
from cli_harness import wait_for as _wait_for

from hybridkv.cli import main

SMALL = ["cluster", "--workload", "agentic", "--set", "num_sessions=5", "--set", "num_turns=3",
         "--set", "first_prompt_tokens=512", "--set", "turn_tokens=128",
         "--set", "output_tokens=3", "--instances", "3", "--num-blocks", "300", "--quiet"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run([*SMALL, "--json", str(tmp_path / "c.json"),
                           "--plot", str(tmp_path / "c.png")], capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "c.json").read_text())
    routers = [run["router"] for run in data["runs"]]
    assert {"round-robin", "session", "least-loaded"} <= set(routers)
    for run in data["runs"]:
        assert len(run["instances"]) == 3
        assert run["requests"] == 15
        assert sum(i["hit_tokens"] for i in run["instances"]) == run["hit_tokens"]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    for router in routers:
        assert router in out


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--instances", "0"], "--instances"),
    (["--router", "sesion"], "did you mean 'session'"),
    (["--policy", "latest,dense"], "one policy"),
    (["--admission", "fcfs,hit"], "one admission order"),
    (["--sync-steps", "-1"], "--sync-steps"),
    (["--load-weight", "nan"], "--load-weight"),
    (["--plot", "{out}/p.txt"], "plot format"),
    (["--json", "{out}/missing/x.json"], "does not exist"),
    (["--json", "{out}/same.png", "--plot", "{out}/same.png"], "same file as --json"),
    (["--num-blocks", "20"], "needs at least"),
    (["--instances", "3000"], "at most"),
    # prefix routers' options without a prefix router would be ignored
    (["--router", "round-robin,session", "--load-weight", "2"],
     "--load-weight=2.0 is invalid: shapes the prefix routers only"),
    (["--router", "least-loaded", "--bounded-load", "1.25"],
     "--bounded-load=1.25 is invalid: shapes the prefix routers only"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
        extra: list[str], fragment: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*SMALL, *[e.format(out=tmp_path) for e in extra],
            "--json", str(tmp_path / "ok.json")]
    if "--json" in extra:
        argv = argv[:-2]
    code, _, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert fragment.lower() in lines[0].lower(), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_microbenchmark_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["cluster", "--workload", "retention-microbench", "--quiet"], capsys)
    assert code == 2 and "one trace" in err


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed")
def test_ray_actors_give_the_serial_numbers(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    outputs = {}
    for mode, extra in (("serial", []), ("ray", ["--ray", "--jobs", "2"])):
        code, _, err = _run([*SMALL, *extra, "--json", str(tmp_path / f"{mode}.json")], capsys)
        assert code == 0, err
        runs = json.loads((tmp_path / f"{mode}.json").read_text())["runs"]
        outputs[mode] = [{k: v for k, v in run.items() if k != "wall_seconds"}
                         for run in runs]
    assert outputs["serial"] == outputs["ray"]
    assert any(run["hit_tokens"] for run in outputs["serial"])


# ---------------------------------------------------------------- signals (subprocess)
LONG = ["cluster", "--workload", "agentic", "--set", "num_sessions=32", "--set", "num_turns=8",
        "--instances", "4", "--paranoid", "--quiet", "--json", "c.json", "--plot", "c.png"]

@needs_proc
def test_ctrl_c_is_one_line_exit_130_no_output(tmp_path: Path) -> None:
    process = _spawn(LONG, tmp_path)
    assert _wait_for(lambda: process.poll() is not None or _cpu_seconds(process.pid) >= 2.5,
                     120)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines() == [
        "hybridkv cluster: interrupted (Ctrl-C); no output written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@needs_proc
def test_sigterm_stops_the_jobs_workers(tmp_path: Path) -> None:
    process = _spawn([*LONG, "--jobs", "2"], tmp_path)
    assert _wait_for(lambda: len(_children(process.pid)) >= 2, 60), process.communicate()
    workers = _children(process.pid)
    time.sleep(0.5)
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines() == [
        "hybridkv cluster: terminated (SIGTERM); no output written"]
    assert _wait_for(lambda: not any(_alive(w) for w in workers), 5), "workers still run"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
