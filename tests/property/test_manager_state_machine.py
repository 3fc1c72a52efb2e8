"""Stateful model-based test of ``KVCacheManager`` with a content oracle.

Random hybrid models (``strategies.hybrid_setups``) receive random request streams drawn
from a prefix tree over a 3-token alphabet (so hits, equal blocks and duplicate hashes are
frequent): admissions with prefix hits, chunked prefill, decode appends, lookahead slots,
preemption (free + re-admission), removal, stale hits. After every step:

- ``check_invariants()`` of the manager (pool tiers, ref counts, hash index, tables);
- the **content oracle**: the test records, per physical block, which group and which token
  prefix it holds — set when a request finishes computing the block's positions, cleared
  when the block is handed out fresh. Every non-null block of every running request must
  hold exactly the prefix its table position says, and every position the request's next
  token reads (``strategies.needed_blocks``) must be non-null;
- with no request running, every non-null block is back in a free tier.

At each admission the hit itself is checked: a multiple of the lcm and ≤ prompt − 1, one
table entry per block of the hit in every group, every needed block present with the right
content (all prefix blocks for full attention, the window tail for sliding windows, the
current chunk for chunked local) and, without EAGLE, maximal: a brute-force search over the
pool's hash index finds no longer aligned hit. Frees are checked against the policy's free
order (scratch to the head in reverse table order, cached blocks to the tail or the pinned
tier).

Retention (without EAGLE): right after each allocation, every block that a boundary the
policy promises to keep needs carries its hash (every multiple of the lcm for ``dense``,
``reachable``, ``prepend``, ``pin:T``; multiples of N and the prompt's replay boundary for
``interval:N``; the replay boundary for ``latest``), and until the next eviction a later
request sharing that prefix hits at least that far. A held block carries a hash only once
it is full, and then exactly the hash of the prefix it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from strategies import (
    ALPHABET,
    HybridSetup,
    extend_prefix,
    hybrid_setups,
    needed_blocks,
    token_lists,
    v4_shaped_specs,
)

from hybridkv import KVCacheManager, PrefixHit, RecurrentStateSpec, StaleHitError
from hybridkv.block import Block
from hybridkv.errors import DoubleFreeError
from hybridkv.hashing import BlockHasher
from hybridkv.ids import BlockHash, GroupId
from hybridkv.managers import coarse_hashes
from hybridkv.pool import FreeTier

MAX_PROMPT = 40
MAX_REQUESTS = 6

Content = tuple[int, tuple[int, ...]]  # (group id, token prefix the block's KV stands for)


class ManagerMachine(RuleBasedStateMachine):
    manager: KVCacheManager
    setup_: HybridSetup

    @initialize(setup=hybrid_setups())
    def init_manager(self, setup: HybridSetup) -> None:
        self.setup_ = setup
        self.manager = setup.build()
        config = self.manager.config
        self.align = config.alignment_tokens
        self.specs = [g.spec for g in config.groups]
        self.has_recurrent = any(isinstance(s, RecurrentStateSpec) for s in self.specs)
        self.every_block = "ckpt:block" in setup.policy.split("+")
        self.hasher = BlockHasher(config.hash_block_size, config.hash_algo,
                                  config.hash_lookahead_tokens)
        self.lookahead = config.hash_lookahead_tokens
        self.drops = config.drops_eagle_block
        self.content: dict[int, Content | None] = {}
        self.drafter_next: dict[int, tuple[int, ...] | None] = {}
        """EAGLE (lookahead hashes): per block, the tokens after it from which its computing
        request's drafter wrote the KV of its last slot (``None`` until they exist)."""
        self.sequences: dict[str, list[int]] = {}
        self.next_id = 0
        self.num_hits = 0
        self.prompt_len: dict[str, int] = {}
        self.hit_at_admission: dict[str, int] = {}
        self.lifetime: dict[str, int] = {}
        self.num_admissions = 0
        self.num_drops = 0
        self.dropped: set[int] = set()
        """Blocks ``evict_prefix`` unhashed while a request held them (until reused)."""
        """Engine-requested hash drops (``evict_prefix``, ``reset_prefix_cache``): they end
        retention promises like evictions do."""
        self.evictions_at_admission: dict[str, int] = {}
        self.ever_admitted: set[str] = set()
        self.external: set[str] = set()
        """Requests added with ``external_hashes=True`` (the test hashes them, as an engine)."""
        self.late_hashes: set[str] = set()
        """External requests added with fewer hashes than full blocks: window blocks that
        left before their hash arrived were never cached, so no retention promise holds."""
        self.written_to: dict[str, int] = {}
        """Per running request: the end of the KV its steps wrote (past its computed tokens
        after a settle rolled known in-flight tokens back; such blocks may be cached)."""
        # (computed tokens, boundaries the policy must keep hittable, evictions at admission)
        self.retained: dict[int, tuple[tuple[int, ...], list[int], int]] = {}

    # ------------------------------------------------------------------ helpers
    def running(self) -> list[str]:
        return [r for r in self.manager.request_ids if self.manager.is_running(r)]

    def waiting(self) -> list[str]:
        return [r for r in self.manager.request_ids if not self.manager.is_running(r)]

    def tokens(self, req_id: str) -> list[int]:
        return list(self.manager.token_ids(req_id))

    def append(self, req_id: str, token_ids: list[int], **kwargs: bool) -> None:
        """``append_token_ids``, with the engine's hashes of the blocks they complete when
        the request's hashes are external."""
        if req_id not in self.external:
            self.manager.append_token_ids(req_id, token_ids, **kwargs)
            return
        have = len(self.manager._requests[req_id].block_hashes)
        hashes = self.hasher.hash_blocks(self.tokens(req_id) + token_ids)[have:]
        self.manager.append_token_ids(req_id, token_ids, block_hashes=hashes, **kwargs)

    def expected(self, group_id: int, tokens: Sequence[int], idx: int) -> Content:
        return group_id, tuple(tokens[: (idx + 1) * self.specs[group_id].block_size])

    def record_computed(self, req_id: str, start: int, end: int,
                        new_block_ids: Sequence[Sequence[int]]) -> None:
        """Positions [start, end) were just computed: fresh blocks forget their old content,
        blocks that became full now hold this request's prefix."""
        for group_ids in new_block_ids:
            for block_id in group_ids:
                self.content[block_id] = None
                self.dropped.discard(block_id)
                self.drafter_next[block_id] = None
        tokens = self.tokens(req_id)
        self.sequences[req_id] = tokens[:end]  # computed prefixes seed later prompts
        self.written_to[req_id] = max(self.written_to.get(req_id, 0), end)
        boundaries = [] if req_id in self.late_hashes else \
            self.guaranteed_boundaries(req_id, end)
        self.retained[self.lifetime[req_id]] = (
            tuple(tokens[:end + self.lookahead]), boundaries,
            self.evictions_at_admission[req_id])
        if not self.drops and not self.has_recurrent:
            self.check_boundaries_hashed(req_id, [b for b in boundaries if start <= b <= end])
        num_known = len(tokens) - self.lookahead
        for group_id, table in enumerate(self.manager.get_block_ids(req_id)):
            if self.is_recurrent(group_id):
                # the step wrote the state after exactly `end` tokens into the last block
                # (ckpt:block: and the state at each block end it passed into that block)
                if self.every_block:
                    bs = self.specs[group_id].block_size
                    for idx, block_id in enumerate(table[:-1]):
                        if block_id and start < (idx + 1) * bs <= end:
                            self.content[block_id] = self.expected(group_id, tokens, idx)
                self.content[table[-1]] = (group_id, tuple(tokens[:end]))
                continue
            bs = self.specs[group_id].block_size
            for idx, block_id in enumerate(table):
                block_end = (idx + 1) * bs
                if block_id and start < block_end <= end:
                    self.content[block_id] = self.expected(group_id, tokens, idx)
                if block_id and self.lookahead and block_end <= min(end, num_known) \
                        and self.drafter_next.get(block_id) is None:
                    self.drafter_next[block_id] = tuple(
                        tokens[block_end : block_end + self.lookahead])

    def is_recurrent(self, group_id: int) -> bool:
        return isinstance(self.specs[group_id], RecurrentStateSpec)

    def num_hashed_tokens(self, req_id: str) -> int:
        """Tokens the request's hashes cover (an external request may have fewer)."""
        return len(self.manager._requests[req_id].block_hashes) * self.hasher.block_size

    def check_hit(self, req_id: str, hit: PrefixHit) -> None:
        tokens = self.tokens(req_id)
        limit = len(tokens) - 1
        hashed = self.num_hashed_tokens(req_id)
        p = hit.num_tokens
        assert p % self.align == 0, (p, self.align)
        assert 0 <= p <= max(limit, 0)
        assert hit.junction_tokens == 0 or p < hit.junction_tokens <= len(tokens)
        for group_id, (spec, table) in enumerate(zip(self.specs, hit.blocks, strict=True)):
            assert len(table) == p // spec.block_size, (group_id, len(table), p)
            needed = needed_blocks(spec, p)
            for idx, block in enumerate(table):
                if block.is_null:
                    assert idx not in needed, f"group {group_id}: needed block {idx} is null"
                    continue
                assert block.hash_group_id == group_id
                got = self.content.get(block.block_id)
                assert got == self.expected(group_id, tokens, idx), (
                    f"group {group_id} hit block {block.block_id} at index {idx} holds "
                    f"{got}, request needs {self.expected(group_id, tokens, idx)}")
                # the drafter KV of its last slot saw our next tokens; a recurrent
                # checkpoint is the state after [0, end) alone (no drafter slot)
                if self.lookahead and not \
                        self.manager.coordinator.managers[group_id].ignores_lookahead:
                    end = (idx + 1) * spec.block_size
                    assert self.drafter_next.get(block.block_id) == \
                        tuple(tokens[end : end + self.lookahead]), (
                        f"group {group_id} hit block {block.block_id}: drafter KV written "
                        f"before {self.drafter_next.get(block.block_id)}, request continues "
                        f"with {tokens[end : end + self.lookahead]}")
        if not self.drops:
            if req_id in self.late_hashes:  # groups needing no block at p may hit past
                # the request's hashes or not (window 1, chunk boundaries): either is exact
                assert self.brute_force_hit(tokens, min(limit, hashed), hashed) <= p \
                    <= self.brute_force_hit(tokens, limit, hashed), "hit is not maximal"
            else:
                assert p == self.brute_force_hit(tokens, limit, hashed), "hit is not maximal"
            if not self.has_recurrent:  # recurrent checkpoints exist at chunk ends only
                self.check_retention(tokens, p, hashed)
        if p:
            self.num_hits += 1
            event("admission with a prefix hit")

    def evictions(self) -> int:
        return sum(self.manager.pool.num_evicted_blocks) + self.num_drops

    def guaranteed_boundaries(self, req_id: str, num_computed: int) -> list[int]:
        """Aligned positions in [hit, computed] where this request's lifetime left a hit for
        every group, by the retention policy's definition (no EAGLE): the hit point itself;
        every multiple of A (``dense``, ``reachable``, ``prepend``, ``pin``), of N
        (``interval:N``) and the prompt's replay boundary (``interval``, ``latest``).
        Earlier positions relied on blocks of other requests, which may be gone."""
        hit, align = self.hit_at_admission[req_id], self.align
        # under lookahead hashes a block is hashed only once the tokens after it exist
        num_computed = min(num_computed, len(self.tokens(req_id)) - self.lookahead,
                           self.num_hashed_tokens(req_id))
        kind, _, arg = self.setup_.policy.partition(":")
        step = int(arg) if kind == "interval" else align
        replay = (self.prompt_len[req_id] - 1) // align * align
        boundaries = [hit] if hit else []
        if kind != "latest":
            boundaries += [b for b in range(step, num_computed + 1, step) if b >= hit]
        if kind in ("interval", "latest") and hit <= replay <= num_computed:
            boundaries.append(replay)
        return boundaries

    def check_boundaries_hashed(self, req_id: str, boundaries: Sequence[int]) -> None:
        """Right after caching, every block a guaranteed boundary needs carries a hash (the
        retention policy's mask kept it), whatever happens to it later."""
        managers = self.manager.coordinator.managers
        for b in boundaries:
            for group_id, spec in enumerate(self.specs):
                table = managers[group_id].tables[req_id]
                for idx in needed_blocks(spec, b):
                    block = table[idx]
                    if block.block_id in self.dropped:
                        continue  # the engine dropped its hash (evict_prefix)
                    assert not block.is_null and block.block_hash is not None, (
                        f"policy {self.setup_.policy}: group {group_id} block {idx} is needed "
                        f"at boundary {b} but was not hashed")

    def check_retention(self, tokens: Sequence[int], num_hit: int, num_hashed: int) -> None:
        """Until an eviction, every guaranteed boundary of an earlier request that this
        request shares (within its ``num_hashed`` hashed tokens) is hit (the policy really
        kept those window tails hashed)."""
        evictions = self.evictions()
        self.retained = {k: v for k, v in self.retained.items() if v[2] == evictions}
        limit = min(len(tokens) - 1, num_hashed)
        for computed, boundaries, _ in self.retained.values():
            shared = 0
            for a, b in zip(computed, tokens, strict=False):
                if a != b:
                    break
                shared += 1
            reachable = [b for b in boundaries
                         if b <= min(shared - self.lookahead, limit)]
            if reachable:
                assert num_hit >= max(reachable), (
                    f"policy {self.setup_.policy}: boundary {max(reachable)} of an earlier "
                    f"request was not retained (hit {num_hit})")

    def brute_force_hit(self, tokens: Sequence[int], limit: int,
                        num_hashed_tokens: int | None = None) -> int:
        """Largest aligned p ≤ limit whose needed blocks are all in the hash index (and
        among the request's ``num_hashed_tokens`` hashed tokens, when given)."""
        hashes = self.hasher.hash_blocks(tokens)
        if num_hashed_tokens is not None:
            del hashes[num_hashed_tokens // self.hasher.block_size:]
        hb = self.hasher.block_size
        views = [coarse_hashes(hashes, s.block_size // hb) for s in self.specs]
        pool = self.manager.pool

        def valid(p: int) -> bool:
            return all(
                i < len(views[g])
                and pool.get_cached_block(BlockHash(views[g][i]), GroupId(g)) is not None
                for g, spec in enumerate(self.specs) for i in needed_blocks(spec, p)
            )

        p = max(limit, 0) // self.align * self.align
        while p > 0 and not valid(p):
            p -= self.align
        return p

    def snapshot(self) -> tuple[list[int], list[int], int]:
        pool = self.manager.pool
        return (list(pool.free_block_ids()), [b.block_id for b in pool.pinned_queue],
                pool.num_free_blocks)

    # -------------------------------------------------------------------- rules
    @precondition(lambda self: len(self.manager.request_ids) < MAX_REQUESTS)
    @rule(base=st.integers(0, 10**6), num_dropped=st.integers(0, 12),
          suffix=token_lists(16), external=st.integers(0, 3))
    def add_request(self, base: int, num_dropped: int, suffix: list[int],
                    external: int = 1) -> None:
        """A quarter of the requests bring their hashes (``external_hashes``, the engine's
        hasher being this test's), a few of them fewer than their full blocks."""
        tokens = extend_prefix(list(self.sequences.values()), base, num_dropped, suffix,
                               MAX_PROMPT)
        req_id = f"r{self.next_id}"
        self.next_id += 1
        if external:
            self.manager.add_request(req_id, tokens)
        else:
            hashes = self.hasher.hash_blocks(tokens)
            given = hashes[:base % 4 or None]
            self.manager.add_request(req_id, tokens, block_hashes=given,
                                     external_hashes=True)
            self.external.add(req_id)
            if len(given) < len(hashes):
                self.late_hashes.add(req_id)
        self.prompt_len[req_id] = len(tokens)
        assert self.manager.num_tokens(req_id) == len(tokens)

    @precondition(lambda self: any(not self.manager.is_running(r)
                                   for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6), chunk=st.integers(1, MAX_PROMPT),
          lookahead=st.sampled_from((0, 0, 0, 1, 3)), reserve=st.booleans())
    def admit(self, pick: int, chunk: int, lookahead: int, reserve: bool) -> None:
        waiting = self.waiting()
        req_id = waiting[pick % len(waiting)]
        hit = self.manager.find_longest_hit(req_id)
        self.check_hit(req_id, hit)
        num_new = min(chunk, self.manager.num_tokens(req_id) - hit.num_tokens)
        before = self.snapshot()
        self.evictions_at_admission[req_id] = self.evictions()
        self.hit_at_admission[req_id] = hit.num_tokens
        self.num_admissions += 1
        self.lifetime[req_id] = self.num_admissions
        allocation = self.manager.allocate_slots(
            req_id, num_new, hit, num_lookahead_tokens=lookahead, reserve_full_prompt=reserve)
        if allocation is None:
            event("admission refused")
            assert not self.manager.is_running(req_id)
            assert self.manager.get_block_ids(req_id) == ((),) * len(self.specs)
            assert self.snapshot() == before, "a refused admission changed the pool"
            return
        assert allocation.num_hit_tokens == allocation.num_computed_tokens == hit.num_tokens
        assert self.manager.num_computed_tokens(req_id) == hit.num_tokens + num_new
        self.ever_admitted.add(req_id)
        self.record_computed(req_id, hit.num_tokens, hit.num_tokens + num_new,
                             allocation.new_block_ids)

    @precondition(lambda self: any(self.manager.is_running(r)
                                   for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6), chunk=st.integers(1, MAX_PROMPT),
          decode=st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=2),
          lookahead=st.sampled_from((0, 0, 1, 2)))
    def step(self, pick: int, chunk: int, decode: list[int], lookahead: int) -> None:
        running = self.running()
        req_id = running[pick % len(running)]
        computed = self.manager.num_computed_tokens(req_id)
        if computed == self.manager.num_tokens(req_id):
            self.append(req_id, decode)  # decode (or accepted drafts)
        num_new = min(chunk, self.manager.num_tokens(req_id) - computed)
        lengths = [len(t) for t in self.manager.get_block_ids(req_id)]
        allocation = self.manager.allocate_slots(req_id, num_new,
                                                 num_lookahead_tokens=lookahead)
        if allocation is None:
            event("running step refused")
            assert self.manager.num_computed_tokens(req_id) == computed
            assert [len(t) for t in self.manager.get_block_ids(req_id)] == lengths
            return
        assert allocation.num_hit_tokens == 0 and allocation.num_computed_tokens == computed
        self.record_computed(req_id, computed, computed + num_new, allocation.new_block_ids)

    @precondition(lambda self: any(self.manager.is_running(r)
                                   for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6), num_drafts=st.integers(0, 3),
          accepted=st.integers(0, 3), sampled=token_lists(4))
    def in_flight_step(self, pick: int, num_drafts: int, accepted: int,
                       sampled: list[int]) -> None:
        """An async / speculative step: the next token plus drafts are allocated in flight
        before their ids exist; the step reports back accepting some drafts (the rest
        roll back): their ids and the bonus token are appended and the step settles."""
        running = self.running()
        req_id = running[pick % len(running)]
        computed = self.manager.num_computed_tokens(req_id)
        known = self.manager.num_tokens(req_id)
        if computed < known - 1:
            return  # still prefilling
        if computed == known:
            self.append(req_id, sampled[:1] or [0])
            known += 1
        if self.has_recurrent:
            num_drafts = 0  # a recurrent state cannot roll back (vLLM keeps draft states)
        num_new = 1 + num_drafts
        lengths = [len(t) for t in self.manager.get_block_ids(req_id)]
        allocation = self.manager.allocate_slots(req_id, num_new, in_flight=True)
        if allocation is None:
            event("in-flight step refused")
            assert self.manager.num_computed_tokens(req_id) == computed
            assert [len(t) for t in self.manager.get_block_ids(req_id)] == lengths
            return
        assert self.manager.num_computed_tokens(req_id) == computed + num_new > known - 1
        accepted = min(accepted, num_drafts)
        ids = sampled or [0]
        self.append(req_id, [ids[i % len(ids)] for i in range(accepted + 1)])
        self.manager.settle(req_id, computed + 1 + accepted)
        if accepted < num_drafts:
            event("in-flight drafts rolled back")
        self.record_computed(req_id, computed, computed + 1 + accepted,
                             allocation.new_block_ids)

    @precondition(lambda self: any(self.manager.is_running(r)
                                   for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6), chunk=st.integers(2, MAX_PROMPT),
          back=st.integers(1, 8))
    def in_flight_chunk_rolled_back(self, pick: int, chunk: int, back: int) -> None:
        """An async prefill chunk of known tokens, allocated in flight (its full blocks
        are cached at once), reports back fewer tokens computed: the rest roll back and
        are recomputed later (their KV, written by the step, is identical)."""
        running = self.running()
        req_id = running[pick % len(running)]
        computed = self.manager.num_computed_tokens(req_id)
        chunk = min(chunk, self.manager.num_tokens(req_id) - computed)
        if chunk < 2 or self.has_recurrent:  # a recurrent state cannot roll back
            return
        allocation = self.manager.allocate_slots(req_id, chunk, in_flight=True)
        if allocation is None:
            event("in-flight chunk refused")
            return
        self.manager.settle(req_id, computed + chunk - min(back, chunk - 1))
        self.record_computed(req_id, computed, computed + chunk, allocation.new_block_ids)
        event("known in-flight tokens rolled back")

    @precondition(lambda self: any(self.manager.is_running(r)
                                   for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6), sampled=token_lists(2))
    def two_steps_in_flight(self, pick: int, sampled: list[int]) -> None:
        """Async decode: step s + 1 is planned before step s reports; s settles while
        s + 1 is still in flight (window blocks stay for it), then s + 1 settles."""
        running = self.running()
        req_id = running[pick % len(running)]
        computed = self.manager.num_computed_tokens(req_id)
        if computed != self.manager.num_tokens(req_id) - 1:
            return  # prefilling, or no sampled token to feed
        ids = [*sampled, 0, 0]
        first = self.manager.allocate_slots(req_id, 1, in_flight=True)
        if first is None:
            return
        # the device runs step s before s + 1: its KV (and state) is written first
        self.record_computed(req_id, computed, computed + 1, first.new_block_ids)
        second = self.manager.allocate_slots(req_id, 1, in_flight=True)
        self.append(req_id, ids[:1])  # step s reports its sampled token
        if second is None:
            self.manager.settle(req_id, computed + 1)  # may hash the block s completed
            self.record_computed(req_id, computed + 1, computed + 1, [])  # (drafter KV)
            return
        self.manager.settle(req_id, computed + 2, 1)
        self.manager.check_invariants()
        for group_id, table in enumerate(self.manager.get_block_ids(req_id)):
            if not self.is_recurrent(group_id):  # step s + 1 reads these
                assert all(table[i] for i in needed_blocks(self.specs[group_id], computed + 1))
        self.append(req_id, ids[1:2])  # step s + 1 reports
        self.manager.settle(req_id, computed + 2)
        self.record_computed(req_id, computed + 1, computed + 2, second.new_block_ids)
        event("two decode steps in flight")

    @precondition(lambda self: any(self.manager.is_running(r)
                                   for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6), cut=st.integers(0, 8), more=token_lists(4))
    def truncate_uncomputed_tail(self, pick: int, cut: int, more: list[int]) -> None:
        """A streaming session replaces output tokens not computed yet: the tail past the
        computed tokens (never into the prompt) is dropped, new ids follow."""
        running = self.running()
        req_id = running[pick % len(running)]
        computed = self.manager.num_computed_tokens(req_id)
        known = self.manager.num_tokens(req_id)
        keep = max(computed + min(self.lookahead, 1), self.prompt_len[req_id], known - cut,
                   self.written_to.get(req_id, 0) + self.lookahead)
        if keep > known:
            return
        before = self.tokens(req_id)
        self.manager.truncate_tokens(req_id, keep)
        assert self.tokens(req_id) == before[:keep]
        if more:
            self.append(req_id, more)
        if keep < known:
            event("tail truncated")

    @precondition(lambda self: len(self.waiting()) > 0)
    @rule(pick=st.integers(0, 10**6))
    def free_waiting(self, pick: int) -> None:
        """``free`` of a request never admitted is a no-op; of a preempted one, an error."""
        waiting = self.waiting()
        req_id = waiting[pick % len(waiting)]
        before = self.manager.snapshot()
        if req_id in self.ever_admitted:
            with pytest.raises(DoubleFreeError):
                self.manager.free(req_id)
        else:
            self.manager.free(req_id)
        assert self.manager.snapshot() == before

    @precondition(lambda self: any(self.manager.is_running(r)
                                   for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6), remove=st.booleans())
    def preempt_or_finish(self, pick: int, remove: bool) -> None:
        running = self.running()
        req_id = running[pick % len(running)]
        managers = self.manager.coordinator.managers
        tables = [list(m.tables[req_id]) for m in managers]
        self.written_to.pop(req_id, None)
        if remove:
            self.manager.remove_request(req_id)
        else:
            self.manager.free(req_id)
            assert self.manager.num_computed_tokens(req_id) == 0
        self.check_free_order(tables)

    def check_free_order(self, tables: list[list[Block]]) -> None:
        """Blocks released by a free, per the policy's tiers: head-tier blocks lead the free
        queue (later groups first, each group tail-first); tail-tier blocks end the free
        queue and pinned ones the pinned queue. Within the tail, hashed blocks keep the
        tail-first order (the end of a prefix chain is evicted first) and so do unhashed
        ones; how the two classes interleave is the pool's choice."""
        kind = self.setup_.policy.split(":")[0]
        scratch_tier = FreeTier.TAIL if kind in ("dense", "reachable") else FreeTier.HEAD
        cached_tier = FreeTier.PINNED if kind == "pin" else FreeTier.TAIL
        head: list[int] = []
        tail: list[Block] = []
        pinned: list[int] = []
        for table in tables:
            released = [b for b in reversed(table) if not b.is_null and b.ref_count == 0]
            tiers = [(b, cached_tier if b.block_hash is not None else scratch_tier)
                     for b in released]
            head = [b.block_id for b, tier in tiers if tier is FreeTier.HEAD] + head
            tail += [b for b, tier in tiers if tier is FreeTier.TAIL]
            pinned += [b.block_id for b, tier in tiers if tier is FreeTier.PINNED]
        free_ids, pinned_ids, _ = self.snapshot()
        assert free_ids[: len(head)] == head
        tail_ids = free_ids[len(free_ids) - len(tail):]
        assert sorted(tail_ids) == sorted(b.block_id for b in tail)
        for is_hashed in (True, False):
            expected = [b.block_id for b in tail if (b.block_hash is not None) == is_hashed]
            assert [i for i in tail_ids if i in expected] == expected
        assert pinned_ids[len(pinned_ids) - len(pinned):] == pinned

    @rule(pick=st.integers(0, 10**6))
    def evict_a_free_cached_block(self, pick: int) -> None:
        """Drop the hash of one free cached block, as reallocating it would (white box:
        ``BlockPool._evict`` is what ``allocate`` calls on a reused hashed block). Groups
        then retain different blocks, which exercises the multi-group fixed point."""
        pool = self.manager.pool
        cached = [b for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None]
        if cached:
            pool._evict(cached[pick % len(cached)])

    @precondition(lambda self: len(self.manager.request_ids) > 0)
    @rule(pick=st.integers(0, 10**6))
    def remove_waiting(self, pick: int) -> None:
        waiting = self.waiting()
        if waiting:
            self.manager.remove_request(waiting[pick % len(waiting)])

    @precondition(lambda self: any(not self.manager.is_running(r)
                                   for r in self.manager.request_ids)
                  and any(self.manager.is_running(r) for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6))
    def stale_hit_is_refused(self, pick: int) -> None:
        """A non-empty hit looked up before another request's allocation changed the pool
        is refused."""
        waiting, running = self.waiting(), self.running()
        req_id = waiting[pick % len(waiting)]
        other = running[pick % len(running)]
        hit = self.manager.find_longest_hit(req_id)
        epoch = self.manager.pool.epoch
        computed = self.manager.num_computed_tokens(other)
        if computed < self.manager.num_tokens(other):
            allocation = self.manager.allocate_slots(other, 1)
            if allocation is not None:
                self.record_computed(other, computed, computed + 1, allocation.new_block_ids)
        if self.manager.pool.epoch == epoch or not (hit.num_tokens or any(hit.blocks)):
            return  # an empty hit holds no blocks, so it cannot be stale
        try:
            self.manager.allocate_slots(req_id, 1, hit)
        except StaleHitError:
            pass
        else:
            raise AssertionError("a stale PrefixHit was accepted")
        assert not self.manager.is_running(req_id)

    # ----------------------------------------------------- engine-facing operations
    def some_prefix(self, pick: int, cut: int) -> list[int]:
        sequences = list(self.sequences.values())
        return sequences[pick % len(sequences)][:cut] if sequences else []

    def cached_copies_of(self, tokens: list[int]) -> set[int]:
        """Ids of every cached copy of ``tokens``' block hashes, in every group."""
        hashes = self.hasher.hash_blocks(tokens)
        hb = self.hasher.block_size
        views = [coarse_hashes(hashes, spec.block_size // hb) for spec in self.specs]
        return {b.block_id for g, view in enumerate(views) for h in view
                for b in self.manager.pool.cached_copies(BlockHash(h), GroupId(g))}

    @rule(pick=st.integers(0, 10**6), cut=st.integers(0, MAX_PROMPT), go=st.integers(0, 2))
    def evict_prefix(self, pick: int, cut: int, go: int) -> None:
        """Drop one known prefix's blocks: exactly every cached copy of its block hashes,
        in every group, loses its hash (held ones included); nothing else changes."""
        if go:
            return  # a third of the draws: hits need caches to survive
        tokens = self.some_prefix(pick, cut)
        pool = self.manager.pool
        doomed = self.cached_copies_of(tokens)
        hashed_before = {b.block_id for b in pool.blocks if b.block_hash is not None}
        dropped = self.manager.evict_prefix(tokens)
        assert dropped == len(doomed)
        assert {b.block_id for b in pool.blocks if b.block_hash is not None} == \
            hashed_before - doomed
        if dropped:
            self.num_drops += 1
            self.dropped |= doomed
            event("evict_prefix dropped blocks")

    @rule(go=st.integers(0, 9))
    def reset_prefix_cache(self, go: int) -> None:
        """Refused (changing nothing) while a request runs; else every hash is gone."""
        if go:
            return
        before = self.manager.snapshot()
        done = self.manager.reset_prefix_cache()
        if self.running():
            assert not done and self.manager.snapshot() == before
            return
        assert done and self.manager.snapshot().cached_blocks == ()
        self.num_drops += 1
        event("prefix cache reset")

    @rule(pick=st.integers(0, 10**6), cut=st.integers(0, MAX_PROMPT + 4),
          suffix=token_lists(4))
    def probe_prefix(self, pick: int, cut: int, suffix: list[int]) -> None:
        """A probe changes nothing and equals the plain lookup of the same tokens."""
        tokens = self.some_prefix(pick, cut) + suffix
        before = self.manager.snapshot()
        probed = self.manager.probe_prefix(tokens)
        assert self.manager.snapshot() == before
        if len(tokens) < 2:
            assert probed == 0
        elif not self.manager.recompute:
            self.manager.add_request("probe", tokens)
            assert probed == self.manager.find_longest_hit("probe").num_tokens
            self.manager.remove_request("probe")
        if not self.drops and len(tokens) >= 2:
            assert probed == self.brute_force_hit(tokens, len(tokens) - 1)

    # --------------------------------------------------------------- invariants
    @invariant()
    def manager_invariants(self) -> None:
        self.manager.check_invariants()

    @invariant()
    def snapshot_agrees_with_the_pool(self) -> None:
        snap = self.manager.snapshot()
        pool = self.manager.pool
        assert snap.num_free_blocks == pool.num_free_blocks == len(snap.free_queue)
        assert len(set(snap.free_queue)) == len(snap.free_queue)
        managers = self.manager.coordinator.managers
        held = [{b.block_id for t in m.tables.values() for b in t if not b.is_null}
                for m in managers]
        assert [g.held_blocks for g in snap.groups] == [len(h) for h in held]
        assert set().union(*held).isdisjoint(snap.free_queue)
        assert {c.block_id for c in snap.cached_blocks} == \
            {b.block_id for b in pool.blocks if b.block_hash is not None}

    @invariant()
    def tables_hold_the_right_content(self) -> None:
        """Needed blocks are held, full blocks hold their prefix, and a block carries a
        hash only once full, and then the hash of the prefix it holds."""
        managers = self.manager.coordinator.managers
        for req_id in self.running():
            tokens = self.tokens(req_id)
            computed = self.manager.num_computed_tokens(req_id)
            hashes = self.hasher.hash_blocks(tokens)
            for group_id, table in enumerate(self.manager.get_block_ids(req_id)):
                spec = self.specs[group_id]
                view = coarse_hashes(hashes, spec.block_size // self.hasher.block_size)
                if self.is_recurrent(group_id):
                    self.check_recurrent_table(req_id, group_id, tokens, computed, view)
                    continue
                for idx, block in enumerate(managers[group_id].tables[req_id]):
                    if block.block_hash is not None:  # (KV a rolled-back step wrote too)
                        assert (idx + 1) * spec.block_size <= max(
                            computed, self.written_to.get(req_id, 0)), (
                            f"{req_id} group {group_id}: block {idx} hashed before it is full")
                        assert block.block_hash == view[idx] and block.hash_group_id == group_id
                for idx in needed_blocks(spec, computed):
                    assert table[idx] != 0, (
                        f"{req_id} group {group_id}: block {idx} is needed at {computed}")
                for idx, block_id in enumerate(table):
                    if block_id and (idx + 1) * spec.block_size <= computed:
                        got = self.content.get(block_id)
                        assert got == self.expected(group_id, tokens, idx), (
                            f"{req_id} group {group_id} index {idx}: block {block_id} "
                            f"holds {got}")

    def check_recurrent_table(self, req_id: str, group_id: int, tokens: Sequence[int],
                              computed: int, view: Sequence[BlockHash]) -> None:
        """The table's last block holds the state after exactly ``computed`` tokens; every
        hashed block holds the state at its own end (so a hit there hands out exactly the
        state at the hit point); at most the source and the target block are held."""
        blocks = self.manager.coordinator.managers[group_id].tables[req_id]
        bs = self.specs[group_id].block_size
        assert not blocks[-1].is_null, f"{req_id} group {group_id}: no state block"
        got = self.content.get(blocks[-1].block_id)
        assert got == (group_id, tuple(tokens[:computed])), (
            f"{req_id} group {group_id}: last block holds {got}, not the state at {computed}")
        live = [b for b in blocks if not b.is_null]
        assert self.every_block or len(live) <= 2, (
            f"{req_id} group {group_id} holds {len(live)} state blocks")
        for idx, block in enumerate(blocks):
            if block.block_hash is None:
                continue
            assert block.block_hash == view[idx] and block.hash_group_id == group_id
            got = self.content.get(block.block_id)
            assert got == self.expected(group_id, tokens, idx), (
                f"{req_id} group {group_id}: hashed block {block.block_id} at index {idx} "
                f"holds {got}, not the state at {(idx + 1) * bs}")

    @rule()
    def new_step(self) -> None:
        """A scheduler step boundary: checkpoints hashed before it become hittable."""
        self.manager.new_step()

    @invariant()
    def idle_pool_is_all_free(self) -> None:
        if not self.running():
            pool = self.manager.pool
            assert pool.num_free_blocks == pool.num_blocks - 1

    def teardown(self) -> None:
        manager = getattr(self, "manager", None)
        if manager is None:
            return
        if sum(manager.pool.num_evicted_blocks):
            event("cached blocks were evicted")
        if self.num_hits >= 3:
            event("three or more hits")
        for req_id in list(manager.request_ids):
            manager.remove_request(req_id)
        manager.check_invariants()
        assert manager.pool.num_free_blocks == manager.pool.num_blocks - 1


TestManagerStateMachine = ManagerMachine.TestCase
# long runs: hits need earlier requests to have computed (and kept) shared prefixes
TestManagerStateMachine.settings = settings(stateful_step_count=200)


class V4ManagerMachine(ManagerMachine):
    """The same machine and content oracle on DeepSeek-V4 shapes only: compressed KV and
    indexer groups (every block of the prefix, entries of r tokens), compressor-state and
    sliding-window MLA groups (window tails), packed block-outermost."""

    @initialize(setup=hybrid_setups(layers_from=v4_shaped_specs()))
    def init_manager(self, setup: HybridSetup) -> None:
        super().init_manager(setup)


TestV4ManagerStateMachine = V4ManagerMachine.TestCase
TestV4ManagerStateMachine.settings = settings(stateful_step_count=200, max_examples=60)
