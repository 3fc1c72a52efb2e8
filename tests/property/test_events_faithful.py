"""KV events are a faithful log (issue 17): replaying the stream rebuilds the manager's
resident set exactly, after every step, for every group kind.

The manager state machine (``test_manager_state_machine.ManagerMachine``: random hybrid
models incl. recurrent and DeepSeek-V4 shapes, random admissions, chunked prefill, decode,
preemption, ``evict_prefix``, ``reset_prefix_cache``) runs with events on. After every step
the events since the last step go through the wire (``encode_batch`` → ``decode_batch``)
into a ``ResidentReplica``, which must hold, per group, exactly the pool's hash index
(hash → number of cached copies), and whose landable points must be exactly those whose
tail blocks (``GroupManager.hit_tail_blocks``) the pool holds — checked by brute force
over every request chain seen so far. ``test_a_dropped_event_is_caught`` shows the check
failing when any one event of a run is lost.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import initialize, invariant
from strategies import HybridSetup, hybrid_setups, recurrent_hybrid_specs, v4_shaped_specs
from test_manager_state_machine import ManagerMachine

from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridkv.errors import InvariantViolation
from hybridkv.events import KVEvent, KVEventBatch, decode_batch, encode_batch, external_hash
from hybridkv.events.replica import ResidentReplica
from hybridkv.ids import BlockHash


def pool_resident(manager: KVCacheManager) -> dict[int, dict[int | bytes, int]]:
    """Per group: external hash → cached copies, read from the pool's blocks."""
    resident: dict[int, dict[int | bytes, int]] = {}
    for block in manager.pool.blocks:
        if block.block_hash is None or block.hash_group_id is None:
            continue
        group = resident.setdefault(block.hash_group_id, {})
        key = external_hash(block.block_hash)
        group[key] = group.get(key, 0) + 1
    return resident


def mismatch(manager: KVCacheManager, replica: ResidentReplica) -> str | None:
    """Why the replica differs from the pool's index, or ``None``."""
    truth = pool_resident(manager)
    for group in set(truth) | set(replica.resident):
        if truth.get(group, {}) != replica.resident.get(group, {}):
            return f"group {group}: pool {truth.get(group)} != stream {replica.resident.get(group)}"
    return None


def expected_landable(manager: KVCacheManager, chains: list[list[BlockHash]],
                      ) -> dict[int, set[int]]:
    """Brute force: per non-full group, the landing hashes of every aligned point of every
    chain whose ``hit_tail_blocks`` blocks the pool holds."""
    hb = manager.hasher.block_size
    align = manager.coordinator.alignment_tokens
    expected: dict[int, set[int]] = {}
    for group_manager in manager.coordinator.managers:
        if group_manager.max_hit_tail_blocks() == 0:
            continue
        group_id = group_manager.group_id
        bs = group_manager.block_size
        ratio = bs // hb
        index = manager.pool.group_index(group_id)
        found = expected.setdefault(group_id, set())
        for chain in chains:
            for p in range(align, len(chain) * hb + 1, align):
                k = group_manager.hit_tail_blocks(p)
                if not k:
                    continue
                end = p // bs
                if all(chain[(j + 1) * ratio - 1] in index for j in range(end - k, end)):
                    found.add(external_hash(chain[p // hb - 1]))
    return expected


class EventsMachine(ManagerMachine):
    @initialize(setup=hybrid_setups())
    def init_manager(self, setup: HybridSetup) -> None:
        super().init_manager(setup)
        self.manager = KVCacheManager(self.manager.config, setup.policy,
                                      enable_kv_cache_events=True)
        self.replica = ResidentReplica()
        self.chains: dict[BlockHash, list[BlockHash]] = {}
        self.ts = 0.0

    @invariant()
    def events_rebuild_the_resident_set(self) -> None:
        self.ts += 1.0
        batch = KVEventBatch(ts=self.ts, events=self.manager.take_events(),
                             data_parallel_rank=0)
        decoded = decode_batch(encode_batch(batch))
        assert decoded == batch
        self.replica.apply_all(decoded.events)
        problem = mismatch(self.manager, self.replica)
        assert problem is None, problem
        self.manager._event_log.check_invariants()  # type: ignore[union-attr]

    @invariant()
    def landable_points_are_exactly_the_resident_tails(self) -> None:
        for req_id in self.manager.request_ids:
            hashes = self.manager._requests[req_id].block_hashes
            if hashes:  # keyed by the last hash: a chain truncate_tokens replaced stays
                self.chains[hashes[-1]] = list(hashes)  # (its cached blocks still land)
        expected = expected_landable(self.manager, list(self.chains.values()))
        for group_id, points in expected.items():
            got = self.replica.landable.get(group_id, set())
            assert got == points, f"group {group_id}: stream {got} != pool {points}"


TestEventsMachine = EventsMachine.TestCase
TestEventsMachine.settings = settings(stateful_step_count=120, max_examples=60)


class RecurrentEventsMachine(EventsMachine):
    @initialize(setup=hybrid_setups(layers_from=recurrent_hybrid_specs()))
    def init_manager(self, setup: HybridSetup) -> None:
        super().init_manager(setup)


TestRecurrentEventsMachine = RecurrentEventsMachine.TestCase
TestRecurrentEventsMachine.settings = settings(stateful_step_count=120, max_examples=30)


class V4EventsMachine(EventsMachine):
    @initialize(setup=hybrid_setups(layers_from=v4_shaped_specs()))
    def init_manager(self, setup: HybridSetup) -> None:
        super().init_manager(setup)


TestV4EventsMachine = V4EventsMachine.TestCase
TestV4EventsMachine.settings = settings(stateful_step_count=120, max_examples=30)


def _scenario() -> tuple[KVCacheManager, list[list[KVEvent]]]:
    """Stores, evictions on reuse and duplicates in a tiny pool, one batch per step."""
    config = CacheConfig.from_layers([FullAttentionSpec(2, 1), SlidingWindowSpec(2, 1, 3)],
                                     num_blocks=12)
    manager = KVCacheManager(config, "prepend", enable_kv_cache_events=True)
    steps: list[list[KVEvent]] = []
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5],
               [1, 2, 3, 4, 5, 6, 8]]
    for i, prompt in enumerate(prompts):
        req = f"r{i}"
        manager.add_request(req, prompt)
        hit = manager.find_longest_hit(req)
        assert manager.allocate_slots(req, len(prompt) - hit.num_tokens, hit) is not None
        steps.append(manager.take_events())
        manager.remove_request(req)
    return manager, steps


def test_a_dropped_event_is_caught() -> None:
    """Losing any single event of the run makes the replica disagree with the pool (or
    refuse a removal it never saw stored) by the end of the run."""
    manager, steps = _scenario()
    flat = [(s, i) for s, events in enumerate(steps) for i in range(len(events))]
    assert len(flat) >= 10 and any(
        type(e).__name__ == "BlockRemoved" for events in steps for e in events)
    whole = ResidentReplica()
    for events in steps:
        whole.apply_all(events)
    assert mismatch(manager, whole) is None
    for dropped in flat:
        replica = ResidentReplica()
        try:
            for s, events in enumerate(steps):
                replica.apply_all(e for i, e in enumerate(events) if (s, i) != dropped)
        except InvariantViolation:
            continue  # a removal of a hash the lossy stream never stored
        assert mismatch(manager, replica) is not None, f"dropping {dropped} went unnoticed"
