"""KV events over ZMQ (vLLM's PUB + replay ROUTER protocol) and Prometheus metrics, from
the library, a replay and the ``hybridkv replay`` CLI (issue 17 parts 1 and 2)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import zmq
from cli_harness import TINY_MODEL
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from hybridkv.cli import main
from hybridkv.errors import ConfigError
from hybridkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from hybridkv.events.publisher import END_SEQ, ZmqEventPublisher
from hybridkv.events.replica import ResidentReplica
from hybridkv.events.subscriber import EventSubscriber
from hybridkv.models.shapes import load_model
from hybridkv.sim.metrics import CacheMetrics, ReplayMetrics
from hybridkv.sim.replay import ReplaySettings, RunResult, replay
from hybridkv.traces.workloads import aba

AGENTIC = ["--workload", "agentic", "--set", "num_sessions=3", "--set", "num_turns=3",
           "--set", "first_prompt_tokens=200", "--set", "turn_tokens=50",
           "--set", "output_tokens=8", "--num-blocks", "60", "--quiet"]


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_MODEL)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_publisher_frames_and_replay_follow_vllms_protocol() -> None:
    port, replay_port = free_port(), free_port()
    batches = [[AllBlocksCleared()], [BlockRemoved(block_hashes=[7], medium="GPU",
                                                   group_idx=0)], [AllBlocksCleared()]]
    with ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}",
                           topic="kv") as publisher:
        for i, events in enumerate(batches):
            publisher.publish(events, ts=float(i))
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        try:
            assert publisher.wait_sent()
            dealer.send_multipart((b"", (1).to_bytes(8, "big")))
            frames = []
            while True:
                assert dealer.poll(5000)
                frames.append(dealer.recv_multipart())
                if frames[-1][2] == END_SEQ:
                    break
        finally:
            dealer.close(linger=0)
    assert frames[-1] == [b"", b"", END_SEQ, b""]
    replayed = frames[:-1]  # batches 1 and 2: seq >= the requested start
    assert [f[1] for f in replayed] == [b"kv", b"kv"]
    assert [int.from_bytes(f[2], "big") for f in replayed] == [1, 2]
    from hybridkv.events import decode_batch
    assert decode_batch(replayed[0][3]) == KVEventBatch(ts=1.0, events=batches[1],
                                                        data_parallel_rank=0)


def test_subscriber_fills_a_slow_join_from_the_replay_buffer() -> None:
    port, replay_port = free_port(), free_port()
    with ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}",
                           ) as publisher:
        for i in range(4):  # nobody subscribed yet: PUB drops these
            publisher.publish([AllBlocksCleared()], ts=float(i))
        with EventSubscriber(f"tcp://*:{port}", f"tcp://*:{replay_port}") as subscriber:
            got: list[int] = []
            for i in range(4, 200):
                publisher.publish([AllBlocksCleared()], ts=float(i))
                got.extend(seq for seq, _ in subscriber.receive(timeout_ms=50))
                if len(got) >= 5:
                    break
    assert got == list(range(len(got))) and len(got) >= 5  # every batch once, in order


@pytest.mark.parametrize("endpoint", ["udp://x:1", "tcp://", "5557",
                                      # ZMQ binds 99999 as port 34463; no port at all
                                      "tcp://*:99999", "tcp://*:-1", "tcp://127.0.0.1",
                                      "tcp://*:5557x"])
def test_bad_endpoints_are_one_line_errors(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="--events"):
        ZmqEventPublisher(endpoint)


def test_an_endpoint_in_use_is_a_one_line_error() -> None:
    port = free_port()
    with ZmqEventPublisher(f"tcp://*:{port}"), pytest.raises(ConfigError, match="cannot bind"):
        ZmqEventPublisher(f"tcp://*:{port}")


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
           **labels: str) -> float:
    matches = [v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == v for k, v in labels.items())]
    assert matches, f"{name} {labels} not exported"
    return sum(matches)


def _check_against_result(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float],
                          result: RunResult | dict[str, object]) -> None:
    get = (lambda k: getattr(result, k)) if isinstance(result, RunResult) else result.get
    assert _value(samples, "hybridkv:prefix_cache_queries_total") == get("prompt_tokens")
    assert _value(samples, "hybridkv:prefix_cache_hits_total") == get("hit_tokens")
    assert _value(samples, "hybridkv:num_preemptions_total") == get("preemptions")
    assert _value(samples, "hybridkv:bridge_tokens_total") == get("bridge_tokens")
    assert _value(samples, "hybridkv:group_evicted_blocks_total") == get("evicted_blocks")
    misses = result.misses.as_dict() if isinstance(result, RunResult) else \
        result["miss_tokens"]
    assert isinstance(misses, dict)
    for cause, tokens in misses.items():
        assert _value(samples, "hybridkv:prefix_cache_miss_tokens_total", cause=cause) == tokens


def test_a_real_http_scrape_shows_the_replay_counters(tiny_model: Path) -> None:
    config = load_model(str(tiny_model)).cache_config(1 + 16 + 16)
    metrics = CacheMetrics(model_name="tiny-hybrid")
    server, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        result = replay(aba(prompt_tokens=256, output_tokens=2), config, "dense",
                        ReplaySettings(observers=(ReplayMetrics(metrics),)))
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    samples = _samples(text)
    _check_against_result(samples, result)
    assert result.evicted_blocks > 0  # B evicts A: the eviction counter moved
    hits = _value(samples, "hybridkv:group_hit_blocks_total")
    assert hits == _value(samples, "hybridkv:kind_hit_blocks_total")
    assert _value(samples, "hybridkv:kv_cache_usage_perc") == 0.0  # all freed at the end


def test_cli_metrics_file_matches_the_json_report(tmp_path: Path, tiny_model: Path) -> None:
    prom, out = tmp_path / "run.prom", tmp_path / "run.json"
    assert main(["replay", *AGENTIC, "--model", str(tiny_model), "--policy",
                 "prepend,latest", "--metrics", str(prom), "--json", str(out)]) == 0
    samples = _samples(prom.read_text())
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2
    for run in runs:
        policy = run["policy"]
        mine = {k: v for k, v in samples.items() if dict(k[1]).get("policy") == policy}
        _check_against_result(mine, run)
        assert _value(mine, "hybridkv:prefix_cache_hits_total") > 0


@pytest.mark.parametrize(("flags", "needle"), [
    (["--metrics", "0"], "--metrics"),
    (["--metrics", "70000"], "--metrics"),
    (["--metrics", "/nonexistent-dir/run.prom"], "--metrics"),
    (["--events", "udp://nowhere"], "--events"),
    (["--events-replay", "tcp://*:5558"], "--events-replay"),
    (["--events", "tcp://*:0", "--jobs", "2"], "--jobs"),
    (["--events", "tcp://*:0", "--policy", "prepend,latest"], "--events"),
    (["--metrics", "-1"], "--metrics='-1' is invalid: a port must be in 1-65535"),
    (["--linger-seconds", "5"], "--linger-seconds=5.0 is invalid: keeps --events"),
    (["--linger-seconds", "5", "--metrics", "{tmp}/m.prom"], "--linger-seconds=5.0"),
    (["--events", "tcp://*:70000"], "--events='tcp://*:70000' is invalid: the port"),
])
def test_bad_observer_flags_are_one_line_exit_2(
        flags: list[str], needle: str, tiny_model: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # a flag taken for a relative path writes nothing here
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    argv = ["replay", *AGENTIC, "--model", str(tiny_model), "--policy", "prepend", *flags]
    if "--policy" in flags:
        argv = ["replay", *AGENTIC, "--model", str(tiny_model), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_cli_event_stream_is_served_and_consistent(tmp_path: Path, tiny_model: Path) -> None:
    """A subprocess replays with --events; after its report the test fetches the whole
    stream by replay, decodes it, rebuilds the resident set and checks it against the
    report (every eviction on reuse is one BlockRemoved)."""
    port, replay_port, out = free_port(), free_port(), tmp_path / "run.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridkv.cli", "replay", *AGENTIC, "--model", str(tiny_model),
         "--policy", "prepend", "--events", f"tcp://*:{port}", "--events-replay",
         f"tcp://*:{replay_port}", "--linger-seconds", "60", "--json", str(out)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "serving the event replay" in line, line
        with EventSubscriber(f"tcp://*:{port}", f"tcp://*:{replay_port}") as subscriber:
            batches = subscriber.request_replay(0)
    finally:
        proc.terminate()
        proc.wait(30)
        if proc.stderr is not None:
            proc.stderr.close()
    assert [seq for seq, _ in batches] == list(range(len(batches))) and batches
    replica = ResidentReplica()
    events = [e for _, batch in batches for e in batch.events]
    replica.apply_all(events)  # raises on a removal of a hash never stored
    run = json.loads(out.read_text())["runs"][0]
    removed = sum(isinstance(e, BlockRemoved) for e in events)
    assert removed == run["evicted_blocks"] > 0
    stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    resident = sum(sum(g.values()) for g in replica.resident.values())
    assert stored - removed == resident > 0
    assert {e.kv_cache_spec_kind for e in events if isinstance(e, BlockStored)} == {
        "full_attention", "sliding_window"}


def test_a_host_endpoint_connects_to_a_binding_subscriber() -> None:
    """vLLM's rule: ``tcp://127.0.0.1:PORT`` (no wildcard) is connected, so the subscriber
    binds it (``hybridkv replay --events tcp://127.0.0.1:5557``)."""
    port = free_port()
    with EventSubscriber(f"tcp://127.0.0.1:{port}") as subscriber, \
            ZmqEventPublisher(f"tcp://127.0.0.1:{port}") as publisher:
        got: list[int] = []
        for i in range(200):  # the first messages may go before the connection is up
            publisher.publish([AllBlocksCleared()], ts=float(i))
            got.extend(seq for seq, _ in subscriber.receive(timeout_ms=50))
            if got:
                break
    assert got and got == sorted(got)
