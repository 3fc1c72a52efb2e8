"""Compatibility: vLLM 0.33's own event classes decode a captured hybridkv stream.

Replays a workload (``agentic``: sessions re-sending a growing conversation, in pools small
enough to evict) with ``--events`` semantics (the ``KVEventStream`` observer publishing
on a real TCP PUB socket with a replay ROUTER), captures every batch through vLLM's replay
protocol (raw frames: topic, 8-byte seq, payload), then for each payload:

1. decodes it with ``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``
   (vLLM's classes) and with hybridkv's: no error, same event types, and every field vLLM
   defines has the same value on both sides (hybridkv's ``landing_hashes`` is the only
   extra field, which vLLM's decoder skips);
2. re-encodes vLLM's decoded batch with msgspec and checks it is byte-identical to
   hybridkv's encoding of the same batch without the residency field: what vLLM's own
   publisher would have sent for these events.

Run with the interpreter of ``bench/setup_vllm.sh``::

    PYTHONPATH=$PWD/src .venv-vllm/bin/python bench/events_vllm_compat.py \\
        --json out/events_compat.json

Exit status 0 when every payload matched, 1 on a mismatch, 2 when vLLM is missing.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import zmq

from hybridkv.events import AllBlocksCleared, BlockStored, decode_batch, encode_batch
from hybridkv.events.publisher import END_SEQ, ZmqEventPublisher
from hybridkv.models.shapes import load_model
from hybridkv.sim.observe import KVEventStream
from hybridkv.sim.replay import ReplaySettings, replay
from hybridkv.traces.workloads import agentic


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def capture(model: str, num_blocks: int, policy: str, sessions: int, turns: int,
            ) -> list[bytes]:
    """Replay ``agentic`` on ``model`` publishing events; return every payload, in seq
    order, fetched back through the replay ROUTER."""
    port, replay_port = _free_port(), _free_port()
    config = load_model(model).cache_config(num_blocks)
    trace = agentic(num_sessions=sessions, num_turns=turns, first_prompt_tokens=6000,
                    turn_tokens=1500, output_tokens=64)
    with ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}",
                           buffer_steps=1_000_000) as publisher:
        result = replay(trace, config, policy,
                        ReplaySettings(observers=(KVEventStream(publisher),)))
        publisher.publish([AllBlocksCleared()])  # the third event type, as a reset sends it
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        try:
            assert publisher.wait_sent(60), "the publisher did not send every batch"
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            payloads: list[bytes] = []
            while True:
                if not dealer.poll(30_000):
                    raise TimeoutError("no replay answer")
                _, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    break
                assert int.from_bytes(seq, "big") == len(payloads), "sequence gap"
                payloads.append(payload)
        finally:
            dealer.close(linger=0)
    print(f"{model}: {result.requests} requests, hit rate {100 * result.hit_rate:.1f}%, "
          f"{result.evicted_blocks} evictions, {len(payloads)} batches")
    return payloads


def compare(payloads: list[bytes], vllm_events: Any, msgspec: Any) -> dict[str, Any]:
    decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    types: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    mismatches: list[str] = []
    num_landing = num_tail_rule = 0
    byte_identical = 0
    for seq, payload in enumerate(payloads):
        theirs = decoder.decode(payload)
        ours = decode_batch(payload)
        if theirs.ts != ours.ts or theirs.data_parallel_rank != ours.data_parallel_rank:
            mismatches.append(f"batch {seq}: envelope differs")
        if len(theirs.events) != len(ours.events):
            mismatches.append(f"batch {seq}: {len(theirs.events)} != {len(ours.events)} events")
            continue
        for i, (t, o) in enumerate(zip(theirs.events, ours.events, strict=True)):
            name = type(t).__name__
            types[name] += 1
            if name != type(o).__name__:
                mismatches.append(f"batch {seq} event {i}: {name} vs {type(o).__name__}")
                continue
            for field in t.__struct_fields__:
                if getattr(t, field) != _plain(getattr(o, field)):
                    mismatches.append(f"batch {seq} event {i} {name}.{field}: "
                                      f"{getattr(t, field)!r} != {getattr(o, field)!r}")
            if name == "BlockStored":
                kinds[f"{t.group_idx}:{t.kv_cache_spec_kind}"] += 1
            if getattr(o, "landing_hashes", None):
                num_landing += 1
            if getattr(o, "landing_tail_blocks", None) is not None:
                num_tail_rule += 1
        stripped = type(ours)(ts=ours.ts, data_parallel_rank=ours.data_parallel_rank,
                              events=[_without_landings(e) for e in ours.events])
        if encoder.encode(theirs) == encode_batch(stripped):
            byte_identical += 1
        else:
            mismatches.append(f"batch {seq}: vLLM re-encoding differs from ours")
    return {"batches": len(payloads), "events": dict(types), "stored_by_group_kind":
            dict(kinds), "events_with_landing_hashes": num_landing,
            "events_with_landing_tail_rule": num_tail_rule,
            "byte_identical_batches": byte_identical, "mismatches": mismatches[:20],
            "num_mismatches": len(mismatches)}


def _plain(value: Any) -> Any:
    """Our tuples decode as vLLM's (msgspec gives lists for untyped tuple items)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _without_landings(event: Any) -> Any:
    import msgspec
    if isinstance(event, BlockStored):
        return msgspec.structs.replace(event, landing_hashes=None, landing_tail_blocks=None,
                                       landing_alignment_tokens=None,
                                       first_block_index=None)
    return msgspec.structs.replace(event, landing_hashes=None) \
        if hasattr(event, "landing_hashes") else event


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-bench=6000,qwen3.5-27b=60,"
                        "deepseek-v4-flash=3000", help="MODEL=POOL_BLOCKS,… (pools small "
                        "enough to force evictions)")
    parser.add_argument("--policy", default="prepend")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        import msgspec
        from vllm.distributed import kv_events as vllm_events
    except ImportError as err:
        print(f"events_vllm_compat: vLLM is not importable ({err}); run with the "
              "interpreter built by bench/setup_vllm.sh", file=sys.stderr)
        return 2
    import vllm
    report: dict[str, Any] = {"vllm": vllm.__version__, "models": {}}
    ok = True
    for item in args.model.split(","):
        model, _, blocks = item.partition("=")
        num_blocks = int(blocks or 2000)
        payloads = capture(model, num_blocks, args.policy, args.sessions, args.turns)
        result = compare(payloads, vllm_events, msgspec)
        result["num_blocks"] = num_blocks
        report["models"][model] = result
        ok &= result["num_mismatches"] == 0 and result["batches"] > 0
        print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print("OK: vLLM decodes every batch with equal field values" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
