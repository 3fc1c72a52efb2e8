"""EventLog: turns the pool's raw hash-index changes into vLLM-format KV events.

The pool appends one tuple per index change to ``records`` (only while events are on:
``BlockPool.event_records``): ``(STORED, group, hash)`` when a block is cached,
``(REMOVED, group, hash)`` when a cached copy loses its hash (eviction on reuse,
``evict_prefix``). ``KVCacheManager`` calls ``flush(request)`` right after a request's
blocks are cached (every store comes from that request's chain, which gives each block its
position, tokens and parent) and ``take_events`` drains the resolved events.

Event shapes (vLLM 0.33's ``BlockPool``):

- one ``BlockStored`` per group per contiguous run of newly cached table positions:
  ``block_hashes`` of the run, ``parent_block_hash`` = the chain hash of the block before
  it (``None`` at position 0), ``token_ids`` = exactly the run's tokens, the group's
  ``block_size``, ``group_idx``, ``kv_cache_spec_kind`` / ``_sliding_window``, ``session_id``,
  ``extra_keys`` (one entry per block), ``lookahead_token_ids`` under EAGLE hashes;
- one ``BlockRemoved`` per removed copy (a hash cached twice is stored and removed twice);
- ``AllBlocksCleared`` for ``reset_prefix_cache``.

Residency: for each non-full group, where a hit at an aligned ``p`` can land (its tail:
the ``k = manager.hit_tail_blocks(p)`` blocks ending at ``p`` — window tails, the recurrent
checkpoint at ``p``, compressor state — all resident). Two encodings, both ignored by
vLLM's decoder:

- *capped* groups, whose rule is ``k = min(t, blocks before p)`` (sliding windows,
  recurrent checkpoints; checked against the manager's own rule when the log is built):
  their ``BlockStored`` events carry ``landing_tail_blocks`` (``t``),
  ``landing_alignment_tokens`` and ``first_block_index`` (the table position of the
  event's first block), from which a consumer rebuilds the landable points itself
  (``ResidentReplica`` with ``landing.LandingRuns``). The log does no per-block residency
  work for them: the cost of the index is the consumer's, as a router's index is;
- other non-full groups (chunked local attention, compressor state): the log tracks the
  landable points (``LandingRuns`` with the manager's rule) and reports each flip on the
  event that caused it, ``landing_hashes`` (each point named by the chained hash of
  ``[0, p)``, also the hash of the group's block ending at ``p``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridkv.errors import InvariantViolation
from hybridkv.event_hook import RequestContext
from hybridkv.events.landing import LandingRuns
from hybridkv.events.schema import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_hash,
)
from hybridkv.hashing import ExtraKeys
from hybridkv.ids import BlockHash

STORED = 0
REMOVED = 1

RawRecord = tuple[int, int, BlockHash]
"""``(STORED | REMOVED, group id, block hash)`` as the pool appends it."""

@dataclass(frozen=True, slots=True)
class GroupEventInfo:
    """Static facts about one cache group that its events carry."""

    group_id: int
    block_size: int
    hash_ratio: int
    """``block_size // hash_block_size``: the group's block ``i`` has chain hash
    ``hashes[(i + 1) * hash_ratio - 1]``."""
    kind: str
    """vLLM ``kv_cache_spec_kind``."""
    sliding_window: int | None
    tail_blocks: Callable[[int], int | None]
    """``GroupManager.hit_tail_blocks``: blocks ending at ``p`` a hit there needs
    (``None``: every block from 0, a full-attention kind)."""
    max_tail_blocks: int
    capped_prefix_rule: bool = False
    """``tail_blocks(p) == min(max_tail_blocks, p // block_size)`` at every aligned ``p``
    (windows, recurrent checkpoints): the log then skips the call."""

    def need_at(self, position: int) -> int | None:
        """Tail blocks a hit at the end of table position ``position`` needs."""
        if self.capped_prefix_rule:
            return min(self.max_tail_blocks, position + 1)
        return self.tail_blocks((position + 1) * self.block_size)


class EventLog:
    """Resolves raw pool records into events and tracks residency (see module doc).

    Invariants (``check_invariants``): every resident count is positive; every landable
    point's tail hashes are all resident.
    """

    def __init__(self, groups: Sequence[GroupEventInfo], hash_block_size: int,
                 alignment_tokens: int, lookahead_tokens: int = 0,
                 medium: str = MEDIUM_GPU) -> None:
        self.records: list[RawRecord] = []
        self.groups = list(groups)
        self.hash_block_size = hash_block_size
        self.alignment_tokens = alignment_tokens
        self.lookahead_tokens = lookahead_tokens
        self.medium = medium
        self._events: list[KVEvent] = []
        self._positions: dict[str, tuple[dict[BlockHash, int], list[int]]] = {}
        num_groups = len(self.groups)
        self.resident: list[dict[int, int]] = [{} for _ in range(num_groups)]
        """Per group: external hash → cached copies (what the events say is cached)."""
        self._landing: list[LandingRuns | None] = [
            None if info.max_tail_blocks == 0 or info.capped_prefix_rule else
            LandingRuns(info.block_size, alignment_tokens, info.max_tail_blocks, info.need_at)
            for info in self.groups]
        """Per group: the landing tracker of a non-full group whose tail rule only the
        manager knows (``landing_hashes`` are published for it); ``None`` for full groups
        and for capped-rule groups, whose consumers derive landability themselves."""

    # ------------------------------------------------------------------ intake
    def clear(self) -> None:
        """``reset_prefix_cache``: one ``AllBlocksCleared`` after what came before."""
        self.flush(None)
        self._events.append(AllBlocksCleared())
        for resident in self.resident:
            resident.clear()
        for landing in self._landing:
            if landing is not None:
                landing.clear()

    def forget(self, req_id: str) -> None:
        """The request left: drop its hash → position index."""
        self._positions.pop(req_id, None)

    def truncate(self, req_id: str, num_hashes: int) -> None:
        """The request kept only its first ``num_hashes`` hashes: positions from there on
        leave the index, so the hashes that replace them are indexed afresh.

        E.g. 3 indexed hashes, ``truncate(r, 2)``: position 2 is dropped; the next flush
        indexes the request's new third hash at position 2.
        """
        entry = self._positions.get(req_id)
        if entry is None or len(entry[1]) <= num_hashes:
            return
        index, chain = entry
        for block_hash in [h for h, k in index.items() if k >= num_hashes]:
            del index[block_hash]
        del chain[num_hashes:]

    def flush(self, request: RequestContext | None) -> None:
        """Resolve the pending records, in order; stores need ``request``."""
        records = self.records
        if not records:
            return
        index: dict[BlockHash, int] = {}
        if request is not None:
            index = self._indexed(request)[0]
        groups = self.groups
        run: list[int] = []  # consecutive table positions stored in one group
        run_group = -1
        last = -2
        for op, group_id, block_hash in records:
            if op == REMOVED:
                if run:
                    self._emit_run(run_group, run, request)
                    run, run_group, last = [], -1, -2
                self._remove(group_id, block_hash)
                continue
            if request is None:
                raise InvariantViolation("a block was cached outside a request's caching step")
            found = index.get(block_hash)
            ratio = groups[group_id].hash_ratio
            if found is None or (found + 1) % ratio:
                raise InvariantViolation(f"group {group_id} cached a hash that is not a block "
                                         f"end of request {request.req_id!r}")
            position = (found + 1) // ratio - 1
            if group_id != run_group or position != last + 1:
                if run:
                    self._emit_run(run_group, run, request)
                run, run_group = [], group_id
            run.append(position)
            last = position
        if run:
            self._emit_run(run_group, run, request)
        records.clear()

    def take_events(self) -> list[KVEvent]:
        """Every event since the last call, in order; the log keeps none of them."""
        self.flush(None)
        events, self._events = self._events, []
        return events

    # --------------------------------------------------------------- resolving
    def _indexed(self, request: RequestContext) -> tuple[dict[BlockHash, int], list[int]]:
        """The request's hash → chain position index and external chain, extended to its
        current hashes (kept until ``forget``)."""
        entry = self._positions.get(request.req_id)
        if entry is None:
            entry = self._positions[request.req_id] = ({}, [])
        index, chain = entry
        hashes = request.block_hashes
        for k in range(len(chain), len(hashes)):
            index[hashes[k]] = k
            chain.append(external_hash(hashes[k]))
        return entry

    def _external_chain(self, request: RequestContext) -> list[int]:
        return self._indexed(request)[1]

    def _emit_run(self, group_id: int, run: list[int],
                  request: RequestContext | None) -> None:
        if not run or request is None:
            return
        info = self.groups[group_id]
        bs, ratio = info.block_size, info.hash_ratio
        chain = self._external_chain(request)
        first, last = run[0], run[-1]
        keys = chain[(first + 1) * ratio - 1:(last + 1) * ratio:ratio]
        landings: list[int] = []
        resident = self.resident[group_id]
        landing = self._landing[group_id]
        if landing is None:  # full attention or a capped rule: only the copy counts change
            for key in keys:
                resident[key] = resident.get(key, 0) + 1
        else:
            parent = None if first == 0 else chain[first * ratio - 1]
            for position, key in enumerate(keys, first):
                copies = resident.get(key, 0)
                resident[key] = copies + 1
                if not copies:
                    landing.store(position, key, parent, landings)
                parent = key
        derived = info.capped_prefix_rule
        tokens = request.token_ids
        lookahead = self.lookahead_tokens
        extra = request.extra_keys
        self._events.append(BlockStored(
            block_hashes=list(keys),
            parent_block_hash=None if first == 0 else chain[first * ratio - 1],
            token_ids=list(tokens[first * bs : (last + 1) * bs]),
            block_size=bs,
            lora_id=None,
            medium=self.medium,
            lora_name=None if extra is None else extra.lora_name,
            extra_keys=[None] * len(keys) if extra is None or extra.is_empty else
            [_event_extra_keys(extra, i * bs, (i + 1) * bs + lookahead)
             for i in range(first, last + 1)],
            group_idx=group_id,
            kv_cache_spec_kind=info.kind,
            kv_cache_spec_sliding_window=info.sliding_window,
            session_id=request.session_id,
            lookahead_token_ids=[list(tokens[(i + 1) * bs : (i + 1) * bs + lookahead])
                                 for i in range(first, last + 1)] if lookahead else None,
            landing_hashes=landings or None,
            landing_tail_blocks=info.max_tail_blocks if derived else None,
            landing_alignment_tokens=self.alignment_tokens if derived else None,
            first_block_index=first if derived else None,
        ))

    # --------------------------------------------------------------- removals
    def _remove(self, group_id: int, block_hash: BlockHash) -> None:
        key = external_hash(block_hash)
        resident = self.resident[group_id]
        copies = resident.get(key, 0)
        lost: list[int] | None = None
        if copies == 1:
            del resident[key]
            landing = self._landing[group_id]
            if landing is not None:
                lost = landing.unlink(key)
        elif copies:
            resident[key] = copies - 1
        else:
            raise InvariantViolation(f"group {group_id}: removal of a hash never stored")
        self._events.append(BlockRemoved(block_hashes=[key], medium=self.medium,
                                         group_idx=group_id, landing_hashes=lost))

    def check_invariants(self) -> None:
        for group_id, resident in enumerate(self.resident):
            if any(copies <= 0 for copies in resident.values()):
                raise InvariantViolation(f"group {group_id}: a non-positive copy count")
            landing = self._landing[group_id]
            if landing is not None:
                landing.check_invariants(resident)


def _event_extra_keys(keys: ExtraKeys | None, start: int, end: int,
                      ) -> tuple[object, ...] | None:
    """vLLM's untagged per-block extra keys: LoRA name, ``(mm id, offset)`` pairs, cache
    salt (block 0 only); ``None`` when the block has none.

    >>> from hybridkv.hashing import MultiModalFeature
    >>> keys = ExtraKeys(lora_name="a", cache_salt="s",
    ...                  mm_features=(MultiModalFeature("img", 2, 4),))
    >>> _event_extra_keys(keys, 0, 4), _event_extra_keys(keys, 4, 8)
    (('a', ('img', 2), 's'), ('a', ('img', -2)))
    >>> _event_extra_keys(None, 0, 4) is None
    True
    """
    if keys is None or keys.is_empty:
        return None
    parts: list[object] = []
    if keys.lora_name is not None:
        parts.append(keys.lora_name)
    for feature in keys.mm_features:
        if feature.start < end and feature.start + feature.num_tokens > start:
            parts.append((feature.identifier, feature.start - start))
    if keys.cache_salt is not None and start == 0:
        parts.append(keys.cache_salt)
    return tuple(parts) or None
