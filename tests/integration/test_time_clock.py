"""``--clock time`` through the CLI: replay and sweep report seconds, errors are one line.

Workload ``agentic`` (8 sessions) on ``mistral-7b`` (a preset with bundled matrix sizes),
Poisson arrivals at ``--rate``: every request appears in the per-request times, TTFT is at
least one step of the cost model, and a slower GPU makes every latency larger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.cli import main

BASE = ["--workload", "agentic", "--set", "num_sessions=4", "--set", "num_turns=3",
        "--model", "mistral-7b", "--kv-memory", "4GiB", "--policy", "latest", "--quiet"]


def replay_json(tmp_path: Path, *extra: str) -> dict[str, object]:
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    assert main(["replay", *BASE, "--json", str(out), *extra]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert isinstance(runs, list)
    run: dict[str, object] = runs[0]
    return run


def test_time_clock_reports_seconds_per_request(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = replay_json(tmp_path, "--clock", "time", "--rate", "0.5", "--slo", "ttft=1000",
                      "--policy", "latest,interval:32768")
    out = capsys.readouterr().out
    assert "TTFT p99" in out and "* = best goodput" in out   # recommended in time
    time = run["time"]
    assert isinstance(time, dict)
    requests = run["request_times"]
    assert isinstance(requests, list) and len(requests) == 12
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in requests)
    assert time["ttft_p50_s"] <= time["ttft_p99_s"]
    assert 0 < time["busy_fraction"] <= 1
    assert time["goodput_rps"] == pytest.approx(12 / time["makespan_s"])   # all meet it
    # the step clock has no time fields and stars the best hit rate
    assert "time" not in replay_json(tmp_path, "--policy", "latest,interval:32768")
    assert "* = best hit rate" in capsys.readouterr().out


def test_a_slower_gpu_gives_longer_latencies(tmp_path: Path) -> None:
    fast = replay_json(tmp_path, "--clock", "time", "--rate", "0.5", "--gpu", "b200")
    slow = replay_json(tmp_path, "--clock", "time", "--rate", "0.5", "--gpu", "l40s")
    assert "scaled" in str(slow["time_gpu"])
    assert slow["time"]["ttft_p50_s"] > fast["time"]["ttft_p50_s"]  # type: ignore[index]


@pytest.mark.parametrize(("flags", "message"), [
    (["--clock", "time"], "--clock='time' is invalid: agentic has no arrival times"),
    (["--clock", "time", "--rate", "1", "--gpu", "v100"], "--gpu='v100' is invalid"),
    (["--clock", "time", "--rate", "1", "--slo", "ttft"], "--slo='ttft' is invalid"),
    (["--clock", "minutes"], "--clock='minutes' is invalid"),
    # time-model flags on the step clock would be ignored: refused, naming --clock time
    (["--slo", "ttft=2"], "--slo='ttft=2' is invalid: it sets the time model"),
    (["--rate", "1"], "--rate=1.0 is invalid: it sets the time model"),
    (["--gpu", "h100"], "add --clock time"),
    (["--tp", "2"], "--tp=2 is invalid"),
    (["--time-scale", "2"], "--time-scale=2.0 is invalid"),
])
def test_bad_time_flags_are_one_line_exit_2(flags: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *BASE, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_sweep_rows_carry_time_columns(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    plot = tmp_path / "sweep.png"
    assert main(["sweep", *BASE[:6], "--model", "mistral-7b", "--kv-memory", "4GiB,8GiB",
                 "--policy", "latest", "--quiet", "--clock", "time", "--rate", "0.5",
                 "--slo", "ttft=1000", "--json", str(out), "--plot", str(plot)]) == 0
    rows = json.loads(out.read_text())["cells"]
    assert rows[0]["ttft_p99_s"] > 0 and rows[0]["time_gpu"] == "NVIDIA H200"
    assert [r["slo_attained"] for r in rows] == [1.0, 1.0]   # a 1,000 s TTFT limit
    assert plot.stat().st_size > 0   # hit rate and goodput panels


def test_cluster_reports_ttft_per_router(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cluster.json"
    assert main(["cluster", *BASE[:6], "--model", "mistral-7b", "--kv-memory", "4GiB",
                 "--policy", "latest", "--quiet", "--instances", "2", "--router",
                 "round-robin,least-loaded", "--clock", "time", "--rate", "0.5",
                 "--json", str(out)]) == 0
    assert "TTFT p99" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["settings"]["time_gpu"] == "NVIDIA H200"
    runs = report["runs"]
    assert [r["router"] for r in runs] == ["round-robin", "least-loaded"]
    for run in runs:
        time = run["time"]
        assert time["requests"] == 12 and 0 < time["ttft_p50_s"] <= time["ttft_p99_s"]
        assert 0 < time["busy_fraction"] <= 1


def test_bounded_load_rule_runs_and_is_recorded(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--bounded-load`` reaches both prefix routers and the report (the rule itself:
    ``cluster.prefix.bounded_load_instances``' worked example); below 1 it is refused."""
    out = tmp_path / "c.json"
    assert main(["cluster", *BASE[:6], "--model", "mistral-7b", "--kv-memory", "4GiB",
                 "--policy", "latest", "--quiet", "--instances", "3", "--router",
                 "prefix-fa,prefix-residency", "--bounded-load", "1.25",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["settings"]["bounded_load"] == 1.25
    with pytest.raises(SystemExit) as exited:
        main(["cluster", *BASE[:6], "--bounded-load", "0.9"])
    assert exited.value.code == 2
    assert "must be a finite number >= 1, got '0.9'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cluster", *BASE[:6], "--bounded-load", "nan"])
    assert "must be a finite number >= 1, got 'nan'" in capsys.readouterr().err


def test_one_instance_cluster_times_like_the_replay(tmp_path: Path) -> None:
    """One instance behind any router is the replay with routing in 50 ms epochs: each
    request reaches the instance at most one epoch after it arrived, so its TTFT is the
    replay's plus at most the epochs it waited (here: within 0.1 s at the median)."""
    replay = replay_json(tmp_path, "--clock", "time", "--rate", "0.2")
    out = tmp_path / "one.json"
    assert main(["cluster", *BASE[:6], "--model", "mistral-7b", "--kv-memory", "4GiB",
                 "--policy", "latest", "--quiet", "--instances", "1", "--router",
                 "round-robin", "--clock", "time", "--rate", "0.2", "--json", str(out)]) == 0
    cluster = json.loads(out.read_text())["runs"][0]["time"]
    assert replay["time"]["ttft_p50_s"] <= cluster["ttft_p50_s"] <= \
        replay["time"]["ttft_p50_s"] + 0.1  # type: ignore[index]
