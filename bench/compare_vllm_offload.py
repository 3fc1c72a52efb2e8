"""Differential check (issue 28 part 3, first step): hybridkv's ``lru`` host tier vs vLLM
0.33.0's ``CPUOffloadingManager`` (``lru`` or ``arc`` policy), decision by decision.

The replay runs with a *shadow* host tier: hybridkv's ``BlockLRUTier`` makes the decisions,
and every offer it gets (a released request's cached blocks) is also given to vLLM's manager
in the same order, with the blocks' end positions set on the request context as vLLM's
offloading scheduler sets them (``ReqContext.set_offload_key_position``), through
``prepare_store`` + ``complete_store``; every host hit's blocks are looked up in vLLM's
manager and read with ``prepare_load`` + ``complete_load``. After each operation the two
resident sets are compared. The report: operations, the operations after which they differ,
and the first difference.

Needs the interpreter with vLLM (``bench/setup_vllm.sh``); runs on hybridkv's sources::

    PYTHONPATH=src /work/venv-vllm/bin/python bench/compare_vllm_offload.py \\
        --trace /work/shared/traces/mooncake_synthetic/synthetic_trace.jsonl --limit 300 \\
        --model mistral-7b --num-blocks 2000 --host-blocks 4000 --cache-policy lru

Exit status: 0 when every operation matched, 1 on any mismatch, 2 when vLLM is missing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from hybridkv.host_lru import BlockLRUTier
from hybridkv.host_policies import HOST_POLICIES
from hybridkv.host_tier import HostHit, HostKey, HostShape, HostTier, ReleasedBlocks
from hybridkv.ids import BlockHash
from hybridkv.models.shapes import load_model
from hybridkv.sim.replay import ReplaySettings, replay
from hybridkv.traces.loaders import load_trace


class ShadowTier(BlockLRUTier):
    """``lru`` deciding; vLLM's manager shadowing every offer and read."""

    def __init__(self, shape: HostShape, capacity_blocks: int, vllm: Any) -> None:
        super().__init__(shape, capacity_blocks)
        self.name = "lru (vLLM shadow)"
        self.vllm = vllm
        self.num_ops = 0
        self.mismatches: list[str] = []
        self._requests = 0

    def _key(self, key: HostKey) -> bytes:
        return bytes(self.vllm.make_offload_key(bytes(key[1]), int(key[0])))

    def store(self, released: ReleasedBlocks) -> None:
        super().store(released)
        self._requests += 1
        ctx = self.vllm.ReqContext(f"r{self._requests}")
        keys: list[bytes] = []
        for group, indexes in zip(self.shape.groups, released.cached, strict=True):
            for i in indexes:
                key = self._key((group.group_id,
                                 self.shape.block_hash(released.hashes, group, i)))
                ctx.set_offload_key_position(key, (i + 1) * group.block_size)
                keys.append(key)
        manager = self.vllm.manager
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        if out is not None:
            manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        self._compare("store")

    def touch(self, hashes: Sequence[BlockHash], hit: HostHit) -> None:
        super().touch(hashes, hit)
        self._requests += 1
        ctx = self.vllm.ReqContext(f"r{self._requests}")
        keys = [self._key(k) for k in hit.loaded]
        manager = self.vllm.manager
        manager.on_new_request(ctx)
        found = [manager.lookup(k, ctx) == self.vllm.HIT for k in keys]
        if not all(found):
            self.mismatches.append(f"op {self.num_ops}: vLLM misses "
                                   f"{found.count(False)} of {len(keys)} blocks a hit read")
        else:
            manager.complete_load(keys, ctx) if manager.prepare_load(keys, ctx) else None
        manager.on_request_finished(ctx)
        self._compare("load")

    def _compare(self, what: str) -> None:
        self.num_ops += 1
        ours = {self._key(k) for k in self._kv}
        theirs = set(self.vllm.manager._policy.chunks)
        if ours != theirs:
            self.mismatches.append(f"op {self.num_ops} ({what}): {len(ours - theirs)} only "
                                   f"ours, {len(theirs - ours)} only vLLM's")


class _Vllm:
    """vLLM's offloading names, imported once."""

    def __init__(self, capacity_blocks: int, cache_policy: str) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.ReqContext = ReqContext
        self.make_offload_key = make_offload_key
        self.HIT = LookupResult.HIT
        self.manager = CPUOffloadingManager(num_chunks=capacity_blocks,
                                            cache_policy=cache_policy)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--model", default="mistral-7b")
    parser.add_argument("--num-blocks", type=int, default=2000)
    parser.add_argument("--host-blocks", type=int, default=4000)
    parser.add_argument("--policy", default="latest")
    parser.add_argument("--cache-policy", choices=("lru", "arc"), default="lru")
    args = parser.parse_args(argv)
    try:
        vllm = _Vllm(args.host_blocks, args.cache_policy)
    except ImportError as err:
        print(f"vLLM is not importable: {err}", file=sys.stderr)
        return 2
    tiers: list[ShadowTier] = []

    def factory(shape: HostShape, blocks: int, arg: str | None) -> HostTier:
        del arg
        tiers.append(ShadowTier(shape, blocks, vllm))
        return tiers[-1]

    HOST_POLICIES["vllm-shadow"] = factory
    config = load_model(args.model).cache_config(args.num_blocks)
    result = replay(load_trace(args.trace, limit=args.limit), config, args.policy,
                    ReplaySettings(host_memory_bytes=args.host_blocks * config.bytes_per_block,
                                   host_policy="vllm-shadow"))
    tier = tiers[0]
    print(f"{args.model} {args.policy}, {args.num_blocks} GPU / {args.host_blocks} host blocks,"
          f" vLLM {args.cache_policy}: {tier.num_ops} operations, {len(tier.mismatches)} "
          f"differ; host hit rate {result.host_hit_tokens / max(1, result.prompt_tokens):.2%}")
    for line in tier.mismatches[:5]:
        print("  " + line)
    return 1 if tier.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
