"""Miss causes: why each missed prompt token of a replay missed, counted once.

At its first admission a request of ``n`` prompt tokens hits ``h``; the ``n - h`` missed
tokens split into (``M`` = tokens of the prompt's longest prefix admitted before, at the
hash-block granularity; ``R = min(floor(M / A) * A, floor((n - 1) / A) * A)`` = what an
infinite cache could hit; ``F`` = the full-attention groups' own resident prefix at the
lookup, floored to ``A`` and capped at ``R``):

========== ======================== ===================================================
cause      tokens                   meaning
========== ======================== ===================================================
cold       ``n - M``                never seen before (no earlier prompt shares them)
alignment  ``M - R``                seen, but below the alignment unit ``A`` (or the last
                                    prompt token, which is always computed)
tail       ``F - h``                full-attention KV resident, but a non-full group's
                                    state (window tail, checkpoint) for a longer hit is not
evicted    ``R - F`` when the block full-attention KV was cached before and evicted
           ending the chain was
           cached once
admission  ``R - F`` otherwise      never cached: the policy did not cache it (caching
                                    off), or no request had computed it yet
host_      ``R - F`` when that      with a host tier (``--host-memory``): the host had
evicted    block was also on the    held it too and evicted it (``F`` and ``h`` then
           host once                count GPU ∪ host)
========== ======================== ===================================================

Worked example (``A`` 32, hash blocks of 8, ``n`` 100, ``M`` 72, ``R`` 64, ``F`` 32,
``h`` 0, the block at 32 was evicted): cold 28, alignment 8, tail 32, evicted 32.

>>> split_miss(100, 0, 72, 32, 32, was_cached=True)
MissCauses(cold=28, evicted=32, tail=32, alignment=8, admission=0, host_evicted=0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from hybridkv.cache import Allocation, KVCacheManager, PrefixHit
from hybridkv.config import CacheConfig
from hybridkv.host_tier import HostHit
from hybridkv.ids import BlockHash, ReqId
from hybridkv.sim.bound import AdmissionLog
from hybridkv.sim.host_replay import HostLink

MISS_CAUSES = ("cold", "evicted", "tail", "alignment", "admission", "host_evicted")


@dataclass(slots=True)
class MissCauses:
    """Missed prompt tokens by cause (first admissions); they sum to prompt − hit tokens."""

    cold: int = 0
    evicted: int = 0
    tail: int = 0
    alignment: int = 0
    admission: int = 0
    host_evicted: int = 0

    @property
    def total(self) -> int:
        return (self.cold + self.evicted + self.tail + self.alignment + self.admission
                + self.host_evicted)

    def add(self, other: MissCauses) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def shares(self) -> dict[str, float]:
        """Each cause's share of the missed tokens (all 0 when nothing missed).

        >>> MissCauses(cold=3, tail=1).shares()["cold"]
        0.75
        """
        total = self.total
        return {name: (getattr(self, name) / total if total else 0.0) for name in MISS_CAUSES}

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MISS_CAUSES}


def split_miss(num_tokens: int, hit_tokens: int, seen_tokens: int, alignment_tokens: int,
               resident_tokens: int, *, was_cached: bool, was_on_host: bool = False,
               ) -> MissCauses:
    """Split one request's ``num_tokens - hit_tokens`` missed tokens (see the module doc).

    ``seen_tokens`` = ``M``; ``resident_tokens`` = the full-attention answer; ``was_cached``:
    the full-attention block where that answer ends had been cached before; ``was_on_host``:
    the host tier had held it too (its evicted tokens are ``host_evicted``).

    >>> split_miss(100, 0, 72, 32, 32, was_cached=True, was_on_host=True).host_evicted
    32

    >>> split_miss(50, 32, 48, 32, 32, was_cached=False)  # resend: R = 32, 2 + 16 missed
    MissCauses(cold=2, evicted=0, tail=0, alignment=16, admission=0, host_evicted=0)
    """
    a = alignment_tokens
    seen = min(num_tokens, max(seen_tokens, hit_tokens))
    reachable = max(hit_tokens, min((seen // a) * a, ((num_tokens - 1) // a) * a))
    resident = max(hit_tokens, min(resident_tokens, reachable))
    lost = reachable - resident
    evicted = lost if was_cached else 0
    return MissCauses(cold=num_tokens - seen, alignment=seen - reachable,
                      tail=resident - hit_tokens,
                      evicted=0 if was_on_host else evicted,
                      admission=0 if was_cached else lost,
                      host_evicted=evicted if was_on_host else 0)


_ADMITTED = 1
_COMPUTED = 2


class ObservedManager(KVCacheManager):
    """The replay's cache manager: a ``KVCacheManager`` that also records, per admission,
    what the offline bound needs (``log``: order, first or not, held non-item blocks) and,
    per first admission, the miss causes (``misses_by_tag``).

    ``item_tokens`` gives each request's tokens the bound models as cache items (its
    prompt, plus predetermined outputs); ``trace_index`` its position in the trace.
    Memory: one entry per distinct hash-block hash admitted (WEKA, gemma3-bench: ~2 M).
    """

    def __init__(self, config: CacheConfig, retention: str,
                 trace_index: Mapping[ReqId, int], item_tokens: Mapping[ReqId, int],
                 tags: Mapping[ReqId, str] | None = None) -> None:
        super().__init__(config, retention)
        self.log = AdmissionLog()
        self.misses_by_tag: dict[str, MissCauses] = {}
        """Per request tag (``"all"`` for untagged requests)."""
        self._tags = tags or {}
        self._trace_index = trace_index
        self._item_tokens = item_tokens
        self._seen: dict[BlockHash, int] = {}
        """Hash-block hash → _ADMITTED (some admitted prompt holds it) or _COMPUTED (a
        request that held it has been released: it was computed and cached)."""
        self._admitted: set[ReqId] = set()
        self._lookup: dict[ReqId, tuple[int, int]] = {}
        """Per request, (hit, full-attention answer) of its latest lookup."""
        self._full_managers = [m for m in self.coordinator.managers if m.is_full_attention]
        self._chain_block_size = self._full_managers[0].block_size if self._full_managers \
            else 0
        self._admission_of: dict[ReqId, int] = {}
        """Per running request, the event index of its (latest) admission."""
        self._units_held: dict[ReqId, int] = {}
        """Per running request, the item units it was last seen holding."""
        self.host: HostLink | None = None
        """A host tier behind the pool (``hybridkv.sim.host_replay``), set before the
        first request: first admissions also look there, releases offer it their blocks."""
        self._host_hit: dict[ReqId, tuple[HostHit | None, int, int]] = {}
        """Per request being admitted: a host hit past its GPU hit (or ``None``), the GPU
        hit, and the full-attention reach on GPU ∪ host."""

    @property
    def misses(self) -> MissCauses:
        """Miss causes over every request."""
        total = MissCauses()
        for causes in self.misses_by_tag.values():
            total.add(causes)
        return total

    def find_longest_hit(self, req_id: ReqId, max_num_tokens: int | None = None) -> PrefixHit:
        hit = super().find_longest_hit(req_id, max_num_tokens)
        num_tokens = self.num_tokens(req_id)
        ran = self.config.enable_caching and min(
            num_tokens - 1, num_tokens if max_num_tokens is None else max_num_tokens) > 0
        resident = hit.num_tokens
        if ran and self._full_managers:
            resident = max(resident, self.coordinator._last_full_attention[0],
                           hit.full_attention_tokens)
        self._lookup[req_id] = (hit.num_tokens, resident)
        return hit

    def allocate_slots(self, req_id: ReqId, num_new_tokens: int, hit: PrefixHit | None = None,
                       *, num_lookahead_tokens: int = 0, reserve_full_prompt: bool = False,
                       in_flight: bool = False) -> Allocation | None:
        admitting = not self.is_running(req_id)
        host = self.host
        if host is not None and admitting and req_id not in self._admitted and hit is not None:
            state = self._requests[req_id]
            found, reach = host.lookup(self, state.block_hashes, hit.num_tokens,
                                       state.num_prompt_tokens)
            self._host_hit[req_id] = (found, hit.num_tokens, reach)
        allocation = super().allocate_slots(req_id, num_new_tokens, hit,
                                            num_lookahead_tokens=num_lookahead_tokens,
                                            reserve_full_prompt=reserve_full_prompt,
                                            in_flight=in_flight)
        if allocation is None or not admitting:
            self._host_hit.pop(req_id, None)
            return allocation
        is_first = req_id not in self._admitted
        if is_first:
            self._admitted.add(req_id)
            self._classify(req_id, allocation.num_hit_tokens)
        event = len(self.log)
        held_non_items, units = self._held_now(event, req_id)
        self.log.append(self._trace_index[req_id], is_first, held_non_items, units)
        self._admission_of[req_id] = event
        self._units_held[req_id] = units
        return allocation

    def free(self, req_id: ReqId) -> None:
        self._offer_host(req_id)
        self._mark_computed(req_id)
        self._log_release(req_id)
        super().free(req_id)

    def remove_request(self, req_id: ReqId) -> None:
        if self.is_running(req_id):
            self._offer_host(req_id)
            self._mark_computed(req_id)
            self._log_release(req_id)
        self._lookup.pop(req_id, None)
        super().remove_request(req_id)

    def _log_release(self, req_id: ReqId) -> None:
        """The request's blocks go back now, after the last logged event: units allocated
        since it was last seen enter the bound's cache (unheld) at the next event."""
        admission = self._admission_of.pop(req_id, None)
        if admission is None:
            return
        units = self._item_units(req_id)
        if units > self._units_held.pop(req_id, 0):
            self.log.grow(len(self.log), admission, units)
        self.log.release_at(admission, len(self.log) - 1)

    def _offer_host(self, req_id: ReqId) -> None:
        host = self.host
        if host is not None and self.config.enable_caching:
            state = self._requests[req_id]
            if state.is_running:
                host.release(self, req_id, state.block_hashes, state.num_computed_tokens)

    # ----------------------------------------------------------------- helpers
    def _hashes(self, req_id: ReqId) -> Sequence[BlockHash]:
        return self._requests[req_id].block_hashes

    def _classify(self, req_id: ReqId, hit_tokens: int) -> None:
        state = self._requests[req_id]
        hashes: Sequence[BlockHash] = state.block_hashes
        if not self.config.enable_caching:  # nothing is hashed: hash for the breakdown only
            hashes = self.hasher.hash_blocks(list(state.token_ids[: state.num_prompt_tokens]))
        seen = self._seen
        hb = self.hasher.block_size
        num_seen = 0
        for block_hash in hashes:
            if block_hash not in seen:
                break
            num_seen += 1
        looked_hit, resident = self._lookup.pop(req_id, (hit_tokens, hit_tokens))
        if looked_hit != hit_tokens:  # the hit came from elsewhere: no full-attention answer
            resident = hit_tokens
        host_hit, gpu_hit, host_reach = self._host_hit.pop(req_id, (None, 0, 0))
        if host_hit is not None and self.host is not None:  # promoted: reached further
            self.host.promote(req_id, hashes, host_hit, gpu_hit)
            hit_tokens = host_hit.num_tokens
            resident = max(resident, hit_tokens)
        resident = max(resident, host_reach)
        was_cached = was_on_host = False
        a = self.coordinator.alignment_tokens
        reachable = min((num_seen * hb // a) * a, ((state.num_prompt_tokens - 1) // a) * a)
        if self.config.enable_caching and resident < reachable and self._chain_block_size:
            # the first full-attention block missing (a ckpt:branch hit ends inside a block)
            end = resident // a * a + self._chain_block_size
            was_cached = seen.get(hashes[end // hb - 1]) == _COMPUTED
            was_on_host = was_cached and self.host is not None and \
                self.host.was_stored(hashes[end // hb - 1])
        tag = self._tags.get(req_id) or "all"
        self.misses_by_tag.setdefault(tag, MissCauses()).add(split_miss(
            state.num_prompt_tokens, hit_tokens, num_seen * hb, a, resident,
            was_cached=was_cached, was_on_host=was_on_host))
        for block_hash in hashes:
            seen.setdefault(block_hash, _ADMITTED)

    def _mark_computed(self, req_id: ReqId) -> None:
        """The request's cached full-attention blocks: its computed ones (to the last
        aligned boundary when the retention policy clamps there)."""
        state = self._requests[req_id]
        if not state.is_running or not self.config.enable_caching:
            return
        num_cached = state.num_computed_tokens
        if self.retention.clamps_to_alignment:
            a = self.coordinator.alignment_tokens
            num_cached = (num_cached // a) * a
        seen = self._seen
        for block_hash in state.block_hashes[: num_cached // self.hasher.block_size]:
            seen[block_hash] = _COMPUTED

    def _held_now(self, event: int, admitted: ReqId) -> tuple[int, int]:
        """Right after admission ``event``'s allocation: the blocks held that are not
        full-attention item KV of their request (an upper estimate of the items: blocks
        shared by two running requests count twice), and the admitted request's held item
        units. Logs every other running request seen holding more units than before (a
        later chunk allocated since the previous event)."""
        held = self.pool.num_blocks - 1 - self.pool.num_free_blocks
        items = 0
        units: dict[ReqId, int] = {}
        for g, manager in enumerate(self._full_managers):
            per_unit = manager.alignment_tokens // manager.block_size
            for req_id, table in manager.tables.items():
                num_items = manager.bound_item_blocks(len(table), self._item_tokens[req_id])
                items += num_items
                if g == 0 or req_id in units:  # a unit is held in every group or not at all
                    units[req_id] = min(units.get(req_id, num_items // per_unit),
                                        num_items // per_unit)
            if g:
                for req_id in [r for r in units if r not in manager.tables]:
                    del units[req_id]
        last = self._units_held
        for req_id, num_units in units.items():
            if req_id != admitted and num_units > last.get(req_id, 0) \
                    and req_id in self._admission_of:
                self.log.grow(event, self._admission_of[req_id], num_units)
                last[req_id] = num_units
        return max(0, held - items), units.get(admitted, 0)

    def _item_units(self, req_id: ReqId) -> int:
        """Whole item units the request holds in every full-attention group."""
        num_units: int | None = None
        for manager in self._full_managers:
            table = manager.tables.get(req_id)
            n = 0 if table is None else manager.bound_item_blocks(
                len(table), self._item_tokens[req_id]) // (
                manager.alignment_tokens // manager.block_size)
            num_units = n if num_units is None else min(num_units, n)
        return num_units or 0
