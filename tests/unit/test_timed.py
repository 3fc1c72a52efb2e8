"""The open-loop loop (``hybridkv.sim.timed``): arrivals, queueing, TTFT and goodput on a
model clock with a fixed step time, where every number can be worked out by hand."""

from __future__ import annotations

import pytest

from hybridkv import KVCacheManager
from hybridkv.errors import ConfigError
from hybridkv.models.shapes import load_model
from hybridkv.sched.driver import ModelClock, drive
from hybridkv.sched.scheduler import SchedRequest, Scheduler, StepPlan
from hybridkv.sim.timed import SLO, arrival_times, summarise


def run(arrivals: list[tuple[float, int, int]], max_running: int = 1) -> dict[str, object]:
    config = load_model("mistral-7b").cache_config(num_blocks=200)
    scheduler = Scheduler(KVCacheManager(config, "latest"), max_running=max_running,
                          chunk_size=4096)
    requests = [(t, SchedRequest(f"r{i}", list(range(i * 1000, i * 1000 + n)), out))
                for i, (t, n, out) in enumerate(arrivals)]
    counter = iter(range(10**9, 2 * 10**9))

    def execute(plan: StepPlan) -> dict[str, int]:
        return {c.req_id: next(counter) for c in plan.chunks if c.samples}

    timed = drive(scheduler, requests, execute, ModelClock(), step_seconds=lambda _: 0.1)
    return {"run": timed, "r": timed.requests}


def test_a_request_queued_behind_another_waits_for_its_slot() -> None:
    out = run([(0.0, 64, 2), (0.05, 64, 2)])
    a, b = out["r"]["r0"], out["r"]["r1"]  # type: ignore[index]
    # step 1 [0, 0.1): a's prefill; step 2 [0.1, 0.2): a's decode, a done; b admitted at 0.2
    assert a.ttft_s == pytest.approx(0.1) and a.e2e_s == pytest.approx(0.2)
    assert b.queue_s == pytest.approx(0.15) and b.ttft_s == pytest.approx(0.25)
    assert b.tpot_s == pytest.approx(0.1)
    summary = summarise(out["run"], SLO.parse("ttft=0.2"))  # type: ignore[arg-type]
    assert summary["makespan_s"] == pytest.approx(0.4)
    assert summary["goodput_rps"] == pytest.approx(1 / 0.4)   # only a meets ttft <= 0.2
    assert summary["busy_fraction"] == pytest.approx(1.0)


def test_idle_time_jumps_to_the_next_arrival() -> None:
    out = run([(0.0, 64, 1), (5.0, 64, 1)], max_running=2)
    b = out["r"]["r1"]  # type: ignore[index]
    assert b.first_token_s == pytest.approx(5.1)
    summary = summarise(out["run"])  # type: ignore[arg-type]
    assert summary["busy_fraction"] == pytest.approx(0.2 / 5.1)


def test_arrival_process_and_bad_input() -> None:
    assert arrival_times([10.0, 12.0], time_scale=2.0) == [0.0, 4.0]
    poisson = arrival_times([None] * 2000, rate=4.0)
    assert poisson[-1] / 1999 == pytest.approx(0.25, rel=0.1)   # mean gap 1 / rate
    with pytest.raises(ConfigError, match=r"rate=None.*pass --rate"):
        arrival_times([None, 1.0])
    with pytest.raises(ConfigError, match="time_scale=0"):
        arrival_times([0.0], time_scale=0)
    # arrival times that overflow to inf would make every latency nan: refused
    with pytest.raises(ConfigError, match=r"--time-scale=1e\+300 is invalid: .*overflow"):
        arrival_times([0.0, 1e300], time_scale=1e300)
    with pytest.raises(ConfigError, match=r"--rate=5e-324 is invalid: .*overflow"):
        arrival_times([None] * 3, rate=5e-324)
    with pytest.raises(ConfigError, match=r"slo='ttft=2,foo=1'.*ttft=SECONDS"):
        SLO.parse("ttft=2,foo=1")
    assert SLO.parse("tpot=40ms").tpot_s == pytest.approx(0.04)
