"""ResidentReplica: what a consumer learns from the event stream alone.

Applies decoded events in order and keeps, per group, the resident hashes (external form,
with their number of cached copies) and the landable hit points of non-full groups
(``landing_hashes``). A router holds one per instance; the property test checks that it
equals the manager's own index after every step.

>>> from hybridkv.events.schema import BlockRemoved, BlockStored
>>> replica = ResidentReplica()
>>> replica.apply(BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=[],
...     block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=1,
...     landing_hashes=[8]))
>>> replica.apply(BlockRemoved(block_hashes=[7], medium="GPU", group_idx=1))
>>> replica.resident[1], replica.landable[1]
({8: 1}, {8})
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.errors import InvariantViolation
from hybridkv.events.landing import LandingRuns
from hybridkv.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class ResidentReplica:
    """Per group: external hash → cached copies, and the landable points."""

    def __init__(self) -> None:
        self.resident: dict[int, dict[int | bytes, int]] = {}
        self.landable: dict[int, set[int]] = {}
        self.kinds: dict[int, str] = {}
        """group → ``kv_cache_spec_kind`` as learned from its ``BlockStored`` events."""
        self._derived: dict[int, LandingRuns] = {}
        """Groups whose stream announces the capped tail rule: landability rebuilt here."""

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def apply(self, event: KVEvent) -> None:
        """Apply one event. Raises ``InvariantViolation`` on a removal of a hash the
        stream never stored (a gap in the stream)."""
        if isinstance(event, AllBlocksCleared):
            self.resident.clear()
            self.landable.clear()
            self._derived.clear()
            return
        group = -1 if event.group_idx is None else event.group_idx
        resident = self.resident.setdefault(group, {})
        if isinstance(event, BlockStored):
            if event.kv_cache_spec_kind is not None:
                self.kinds[group] = event.kv_cache_spec_kind
            if event.landing_tail_blocks is not None:
                self._store_derived(group, resident, event)
                return
            landable = self.landable.setdefault(group, set())
            for block_hash in event.block_hashes:
                resident[block_hash] = resident.get(block_hash, 0) + 1
            landable.update(event.landing_hashes or ())
            return
        assert isinstance(event, BlockRemoved)
        derived = self._derived.get(group)
        for block_hash in event.block_hashes:
            copies = resident.get(block_hash, 0)
            if copies == 0:
                raise InvariantViolation(f"group {group}: BlockRemoved of {block_hash!r}, "
                                         "which the stream never stored")
            if copies == 1:
                del resident[block_hash]
                if derived is not None and isinstance(block_hash, int):
                    derived.unlink(block_hash)
            else:
                resident[block_hash] = copies - 1
        if event.landing_hashes:
            self.landable.setdefault(group, set()).difference_update(event.landing_hashes)

    def _store_derived(self, group: int, resident: dict[int | bytes, int],
                       event: BlockStored) -> None:
        derived = self._derived.get(group)
        if derived is None:
            assert event.landing_tail_blocks is not None
            derived = self._derived[group] = LandingRuns(
                event.block_size, event.landing_alignment_tokens or event.block_size,
                event.landing_tail_blocks)
            self.landable[group] = derived.landable
        parent = event.parent_block_hash
        first = event.first_block_index or 0
        added: list[int] = []
        for offset, block_hash in enumerate(event.block_hashes):
            copies = resident.get(block_hash, 0)
            resident[block_hash] = copies + 1
            if not copies and isinstance(block_hash, int):
                derived.store(first + offset, block_hash,
                              parent if isinstance(parent, int) else None, added)
            parent = block_hash
