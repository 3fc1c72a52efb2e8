"""``ckpt:branch`` under the stateful model-based test and its content oracle.

The machine of ``test_manager_state_machine`` on full attention + recurrent models with
sub-block hits (hit unit ``U`` smaller than the block), plus rules that prefill in the
chunks ``align_prefill_chunk`` plans (so chunks end at branch points and snapshots are
taken). The oracle additionally tracks what a partially filled full-attention block holds
(the KV of the request's tokens so far) and follows every block copy the manager reports
(``take_block_copies``): a snapshot must copy exactly the state / KV of its position from
the producing request, a copy-on-write hit must start from a snapshot of exactly the
hitting request's prefix. With EAGLE (lookahead hashes, ``L`` = 1) the oracle also tracks
the tokens the drafter saw after a partial block's last written slot (its KV at slot
``p - 1`` is computed from token ``p``): a sub-block hit at ``p`` must hand out a
full-attention snapshot whose drafter saw the hitting request's own ``[p, p + L)``.
At a hit inside a block, every group hands out a snapshot whose content is exactly
the prefix ``[0, p)`` (the state after ``p`` tokens; the KV of ``[p // bs * bs, p)``),
the full-attention blocks before it their own prefixes, and the hit is maximal over
block-aligned and sub-block positions (brute force over the hash index).
A full-attention part served by an alias (the producer's block ``k``, full, cached under
its own hash) must hold the KV of a prompt that agrees with the hitter's on ``[0, p)`` and
be block ``k`` of it: its slots ``[k * bs, p)`` are then exactly the hitter's (with EAGLE,
the drafter KV of slot ``p - 1`` came from that prompt's token ``p``: it must be the
hitter's too).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import test_manager_state_machine as base
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test
from strategies import HybridSetup, token_lists

from hybridkv import FullAttentionSpec, LayerSpec, PrefixHit, RecurrentStateSpec
from hybridkv.block import Block
from hybridkv.branch import BranchSnapshots
from hybridkv.coordinator import HybridCoordinator
from hybridkv.hashing import BlockHasher, ExtraKeys
from hybridkv.ids import BlockHash, GroupId, ReqId
from hybridkv.managers import coarse_hashes


@st.composite
def branch_setups(draw: st.DrawFn, eagle: bool | None = None) -> HybridSetup:
    """Full attention + one or two recurrent groups (bs 4 or 8), a hit unit below the
    block, a vLLM retention policy combined with ``ckpt:branch:U``, a small pool, EAGLE
    (lookahead hashes) in a third of the setups."""
    bs = draw(st.sampled_from((4, 8)))
    unit = draw(st.sampled_from([u for u in (1, 2, 4) if u < bs]))
    layers: tuple[LayerSpec, ...] = (FullAttentionSpec(bs, 1),) + \
        (RecurrentStateSpec(bs, 1),) * draw(st.integers(1, 2))
    kind = draw(st.sampled_from(("latest", "prepend", "interval")))
    policy = f"interval:{bs * draw(st.integers(1, 3))}" if kind == "interval" else kind
    per_request = -(-24 // bs) * len(layers)
    num_blocks = 1 + draw(st.integers(max(2, per_request // 2), per_request * 4))
    use_eagle = draw(st.integers(0, 2)) == 0 if eagle is None else eagle
    eviction = draw(st.sampled_from(("", "", "+flops", "+scan+flops")))
    return HybridSetup(layers, num_blocks, f"{policy}{eviction}+ckpt:branch:{unit}",
                       use_eagle, None)


class BranchMachine(base.ManagerMachine):
    @initialize(setup=branch_setups())
    def init_manager(self, setup: HybridSetup) -> None:
        super().init_manager(setup)
        self.unit = self.manager.config.hash_block_size
        assert self.unit < self.align
        branch = self.manager.coordinator.branch
        assert branch is not None
        if setup.num_blocks % 2:  # half the setups snapshot at every first divergence
            branch.min_divergences = 1
        self.partial_next: dict[int, tuple[int, ...] | None] = {}
        """Full-attention blocks holding a partial prefix: the ``L`` tokens after its last
        written slot from which the drafter KV of that slot was computed (``None``:
        not known when it was computed)."""

    # The base machine's engine-hook rules (external hashes, in-flight rollback, two steps
    # in flight) are left out: ckpt:branch engines plan synchronously, and the branch
    # rules keep their share of the steps (the sabotage runs below rely on it).
    @precondition(lambda self: len(self.manager.request_ids) < base.MAX_REQUESTS)
    @rule(base=st.integers(0, 10**6), num_dropped=st.integers(0, 12),
          suffix=token_lists(16))
    def add_request(self, base: int, num_dropped: int, suffix: list[int],
                    external: int = 1) -> None:
        super().add_request(base, num_dropped, suffix, external)

    in_flight_chunk_rolled_back = None  # type: ignore[assignment]
    two_steps_in_flight = None  # type: ignore[assignment]

    def is_full(self, group_id: int) -> bool:
        return not self.is_recurrent(group_id)

    def guaranteed_boundaries(self, req_id: str, num_computed: int) -> list[int]:
        return []  # retention promises are not checked on recurrent models

    def check_free_order(self, tables: list[list[Block]]) -> None:
        if "flops" not in self.setup_.policy:  # flops links releases segment by segment
            super().check_free_order(tables)

    # ------------------------------------------------------------------- oracle
    def record_computed(self, req_id: str, start: int, end: int,
                        new_block_ids: Sequence[Sequence[int]]) -> None:
        tokens = self.tokens(req_id)
        copies = self.manager.take_block_copies()
        for copy in copies:
            if copy.after_forward:
                continue  # copy-on-write hit: before the forward pass
            got = self.content.get(copy.src_block_id)
            assert self.serves(got, copy.group_id, tokens, copy.num_tokens), (
                f"{req_id}: copy-on-write from block {copy.src_block_id} holding {got}")
            assert copy.num_tokens == start
            self.content[copy.dst_block_id] = (copy.group_id, tuple(tokens[:start]))
            self.forget_old_life(copy.dst_block_id)
            if self.is_full(copy.group_id):
                drafter = self.drafter_at(copy.src_block_id, got, start)
                assert drafter == tuple(tokens[start : start + self.lookahead]), (
                    f"{req_id}: copy-on-write at {start} from a snapshot whose drafter saw "
                    f"{drafter}, the request continues with "
                    f"{tokens[start : start + self.lookahead]}")
                self.partial_next[copy.dst_block_id] = drafter
            event("copy-on-write hit")
        tables = self.manager.get_block_ids(req_id)
        for group_id, table in enumerate(tables):
            bs = self.specs[group_id].block_size
            if self.is_full(group_id) and start % bs:  # a partial block being extended
                got = self.content.get(table[start // bs])
                assert got == (group_id, tuple(tokens[:start])), (
                    f"{req_id} group {group_id}: partial block {table[start // bs]} holds "
                    f"{got}, not the KV of {start} tokens")
        super().record_computed(req_id, start, end, new_block_ids)
        for group_id, table in enumerate(tables):
            bs = self.specs[group_id].block_size
            if self.is_full(group_id) and end % bs:
                self.content[table[end // bs]] = (group_id, tuple(tokens[:end]))
                self.partial_next[table[end // bs]] = \
                    tuple(tokens[end : end + self.lookahead]) \
                    if end + self.lookahead <= len(tokens) else None
        for copy in copies:
            if not copy.after_forward:
                continue
            assert copy.num_tokens == end and end % self.align
            got = self.content.get(copy.src_block_id)
            assert got == (copy.group_id, tuple(tokens[:end])), (
                f"{req_id}: snapshot at {end} copies block {copy.src_block_id} holding {got}")
            self.content[copy.dst_block_id] = got
            self.forget_old_life(copy.dst_block_id)
            if self.is_full(copy.group_id):
                self.partial_next[copy.dst_block_id] = self.partial_next.get(copy.src_block_id)
            event("branch snapshot")

    def forget_old_life(self, block_id: int) -> None:
        """A copy destination (copy-on-write hit or snapshot) is a block reused from the
        free queue, not one reported in ``new_block_ids``: the drafter record of its last
        slot from its previous life no longer holds (kept, it made a later hit through the
        block look like it saw another token — a false alarm, 2026-11-28)."""
        self.drafter_next[block_id] = None

    def check_hit(self, req_id: str, hit: PrefixHit) -> None:
        p = hit.num_tokens
        if p % self.align == 0:
            super().check_hit(req_id, hit)
            return
        tokens = self.tokens(req_id)
        assert p % self.unit == 0 and 0 < p <= len(tokens) - 1
        for group_id, table in enumerate(hit.blocks):
            k = p // self.specs[group_id].block_size
            assert len(table) == k + 1, (group_id, len(table), p)
            snapshot = table[-1]
            assert not snapshot.is_null and snapshot.hash_group_id == group_id
            got = self.content.get(snapshot.block_id)
            if self.is_full(group_id) and got != (group_id, tuple(tokens[:p])):
                event("hit through a full-attention alias")
            assert self.serves(got, group_id, tokens, p), \
                self.unserved(got, group_id, tokens, p, snapshot.block_id)
            if self.is_full(group_id):
                drafter = self.drafter_at(snapshot.block_id, got, p)
                assert drafter == tuple(tokens[p : p + self.lookahead]), (
                    f"group {group_id}: snapshot {snapshot.block_id}'s drafter KV saw "
                    f"{drafter}, the hit at {p} continues with "
                    f"{tokens[p : p + self.lookahead]}")
            for idx, block in enumerate(table[:-1]):
                if self.is_full(group_id):
                    assert self.content.get(block.block_id) == \
                        self.expected(group_id, tokens, idx)
                else:
                    assert block.is_null
        assert p == self.brute_force_hit(tokens, len(tokens) - 1,
                                         self.num_hashed_tokens(req_id)), "hit is not maximal"
        self.num_hits += 1
        event("hit inside a block" + (" (EAGLE)" if self.lookahead else ""))

    def snapshot_key(self, unit_hash: BlockHash) -> BlockHash:
        """The index key of the snapshot at a unit whose chained hash is ``unit_hash``."""
        return unit_hash

    def serves(self, got: object, group_id: int, tokens: Sequence[int], p: int) -> bool:
        """Whether a block holding ``got`` serves a hit at ``p`` inside a block: exactly
        the prefix ``[0, p)``, or (full attention, an alias) block ``p // bs`` of a longer
        prompt that agrees with ``tokens`` on ``[0, p)``."""
        if got == (group_id, tuple(tokens[:p])):
            return True
        if not self.is_full(group_id) or not isinstance(got, tuple) or got[0] != group_id:
            return False
        bs = self.specs[group_id].block_size
        held = got[1]
        return len(held) == (p // bs + 1) * bs and tuple(held[:p]) == tuple(tokens[:p])

    def unserved(self, got: object, group_id: int, tokens: Sequence[int], p: int,
                 block_id: int) -> str:
        """Why a block holding ``got`` does not serve the hit at ``p`` (the failure line):
        a full-attention alias of the wrong block of its prompt, or any other content."""
        bs = self.specs[group_id].block_size
        if self.is_full(group_id) and isinstance(got, tuple) and got[0] == group_id \
                and len(got[1]) > p and len(got[1]) % bs == 0:
            agrees = tuple(got[1][:p]) == tuple(tokens[:p])
            return (f"group {group_id}: alias {block_id} is block {len(got[1]) // bs - 1} of "
                    f"a prompt that {'agrees' if agrees else 'disagrees'} on [0, {p}); the "
                    f"hit at {p} needs block {p // bs}")
        return (f"group {group_id}: snapshot {block_id} holds {got}, the hit at {p} needs "
                f"{tuple(tokens[:p])}")

    def drafter_at(self, block_id: int, got: object, p: int) -> tuple[int, ...] | None:
        """The tokens the drafter KV of slot ``p - 1`` of a full-attention source block
        was computed from: a partial snapshot's recorded ones, or (an alias: a full
        block of a longer prompt) that prompt's own ``[p, p + L)``."""
        assert isinstance(got, tuple)
        held = got[1]
        if len(held) == p:
            return self.partial_next.get(block_id)
        seen = tuple(held[p : p + self.lookahead])
        if len(seen) < self.lookahead:  # past the block: what its last slot's drafter saw
            after = self.drafter_next.get(block_id)
            if after is None:
                return None
            seen += tuple(after[: self.lookahead - len(seen)])
        return seen

    def brute_force_hit(self, tokens: Sequence[int], limit: int,
                        num_hashed_tokens: int | None = None) -> int:
        """The aligned answer, or a deeper sub-block position whose full-attention blocks
        before it and snapshots in every group are in the hash index (among the first
        ``num_hashed_tokens`` tokens' hashes, when given)."""
        aligned = super().brute_force_hit(tokens, limit, num_hashed_tokens)
        hashes = self.hasher.hash_blocks(tokens)
        if num_hashed_tokens is not None:
            del hashes[num_hashed_tokens // self.hasher.block_size:]
        pool = self.manager.pool
        u = self.unit
        for p in range(max(limit, 0) // u * u, aligned, -u):
            if p % self.align == 0 or p // u > len(hashes):
                continue
            ok = True
            for g, spec in enumerate(self.specs):
                if self.is_full(g):
                    view = coarse_hashes(hashes, spec.block_size // u)
                    ok = all(pool.get_cached_block(BlockHash(view[i]), GroupId(g))
                             is not None for i in range(p // spec.block_size))
                key = self.snapshot_key(hashes[p // u - 1])
                branch = self.manager.coordinator.branch
                assert branch is not None
                ok = ok and (pool.get_cached_block(key, GroupId(g)) is not None
                             or (self.is_full(g) and branch.full_source(key, GroupId(g))
                                 is not None))
                if not ok:
                    break
            if ok:
                return p
        return aligned

    # -------------------------------------------------------------------- rules
    @precondition(lambda self: any(not self.manager.is_running(r)
                                   for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6), reserve=st.booleans())
    def admit_aligned(self, pick: int, reserve: bool) -> None:
        """Admit with the first chunk ``align_prefill_chunk`` plans (it stops at the
        branch point or the replay boundary, where snapshots are taken)."""
        waiting = self.waiting()
        req_id = waiting[pick % len(waiting)]
        hit = self.manager.find_longest_hit(req_id)
        num_new = self.manager.align_prefill_chunk(
            req_id, self.manager.num_tokens(req_id) - hit.num_tokens, hit)
        if num_new:
            self.admit(pick, num_new, 0, reserve)

    @precondition(lambda self: any(self.manager.is_running(r)
                                   for r in self.manager.request_ids))
    @rule(pick=st.integers(0, 10**6))
    def step_aligned(self, pick: int) -> None:
        running = self.running()
        req_id = running[pick % len(running)]
        computed = self.manager.num_computed_tokens(req_id)
        remaining = self.manager.num_tokens(req_id) - computed
        if remaining <= 0:
            return
        num_new = self.manager.align_prefill_chunk(req_id, remaining)
        if num_new:
            self.step(pick, num_new, [0], 0)

    @precondition(lambda self: len(self.manager.request_ids) < base.MAX_REQUESTS
                  and bool(self.sequences))
    @rule(pick=st.integers(0, 10**6), at=st.integers(1, base.MAX_PROMPT),
          extra=st.integers(0, 16))
    def add_branching_request(self, pick: int, at: int, extra: int) -> None:
        """A prompt that leaves a computed one at a unit inside a block, ending inside
        that block or running past its end (then its branch-point snapshot aliases its own
        full block); two of them leaving at one point make it a branch point."""
        seqs = [s for s in self.sequences.values() if len(s) > self.unit]
        if not seqs:
            return
        seq = seqs[pick % len(seqs)]
        j = at % len(seq) // self.unit * self.unit
        if j == 0 or j % self.align == 0:
            return
        fill = (pick // 2) % 3  # two branchings at one point may diverge right there
        tokens = [*seq[:j], (seq[j] + 1 + pick % 2) % 3, *[fill] * extra]
        tokens = tokens[: base.MAX_PROMPT]
        req_id = f"r{self.next_id}"
        self.next_id += 1
        self.manager.add_request(req_id, tokens)
        self.prompt_len[req_id] = len(tokens)
        event("branching request")

    def cached_copies_of(self, tokens: list[int]) -> set[int]:
        """Every cached copy of the prefix's hashes at every unit, in every group (block
        hashes and sub-block snapshots alike): what ``evict_prefix`` must drop."""
        hashes = self.hasher.hash_blocks(tokens)
        return {b.block_id for g in range(len(self.specs)) for h in hashes
                for b in self.manager.pool.cached_copies(BlockHash(h), GroupId(g))}


class EagleBranchMachine(BranchMachine):
    """Every setup with EAGLE (lookahead hashes at the hit unit)."""

    @initialize(setup=branch_setups(eagle=True))
    def init_manager(self, setup: HybridSetup) -> None:
        super().init_manager(setup)
        assert self.lookahead == 1


TestEagleBranchMachine = EagleBranchMachine.TestCase
TestEagleBranchMachine.settings = settings(stateful_step_count=200, max_examples=40)


CONTENT_CHECKS = (r"snapshot \d+ holds .*, the hit at \d+ needs|hit block \d+ at index \d+ holds"
                  r"|snapshot at \d+ copies block \d+ holding|copy-on-write from block \d+ holding"
                  r"|alias \d+ is block \d+ of a prompt")
"""The oracle's content checks (what a hit or a copy hands out is not the prefix it
stands for) — and not the drafter check, the maximality check or an invariant: a content
sabotage in a random run must be caught by one of these. Which one depends on the
example that meets the sabotage first (a shifted snapshot key may even land on a block
boundary, and then the aligned hit check sees it); each sabotage also has a scripted
scenario where exactly one check, with its own message, must fire."""


def _sabotaged_run(monkeypatch: pytest.MonkeyPatch, target: object, name: str,
                   replacement: object, *, match: str,
                   machine: type[BranchMachine] = BranchMachine) -> None:
    """Run the machine with a sabotage; every setup snapshots at the first divergence
    (the sabotages hit the snapshot and copy machinery, not the branch-point rule)."""
    monkeypatch.setattr(BranchSnapshots, "min_divergences", 1)
    monkeypatch.setattr(target, name, replacement)
    with pytest.raises(AssertionError, match=match):
        run_state_machine_as_test(machine, settings=settings(
            max_examples=400, stateful_step_count=200, derandomize=True, database=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck)))


def test_a_snapshot_of_the_wrong_position_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                   pure_python: None, no_events: None) -> None:
    """Sabotage: snapshots keyed one unit early (the state after ``p`` handed out as the
    state after ``p - U``). The content oracle must fail the run."""
    original = BranchSnapshots.take_snapshot

    def shifted(self: BranchSnapshots, req_id: ReqId, block_hash: BlockHash,
                num_tokens: int, sources: Sequence[Block], full_hash: BlockHash | None = None,
                parent_hash: BlockHash | None = None) -> bool:
        hashes = shifted.hashes  # type: ignore[attr-defined]
        return original(self, req_id, hashes.get(block_hash, block_hash), num_tokens,
                        sources, full_hash, parent_hash)

    shifted.hashes = {}  # type: ignore[attr-defined]
    real_snapshot_point = HybridCoordinator._snapshot_branch_point

    def remember(self: HybridCoordinator, req_id: ReqId, hashes: Sequence[BlockHash],
                 num_tokens: int, num_prompt_tokens: int, junction_tokens: int) -> None:
        u = self.branch.unit_tokens if self.branch is not None else 1
        j = num_tokens // u - 1
        if 0 < j < len(hashes):
            shifted.hashes[hashes[j]] = hashes[j - 1]  # type: ignore[attr-defined]
        real_snapshot_point(self, req_id, hashes, num_tokens, num_prompt_tokens,
                            junction_tokens)

    monkeypatch.setattr(HybridCoordinator, "_snapshot_branch_point", remember)
    monkeypatch.setattr(BranchSnapshots, "take_snapshot", shifted)
    with pytest.raises(AssertionError, match=(  # the snapshot at 12 is found at 10
            r"group 0: snapshot \d+ holds \(0, \(1, 2, 0, 1, 2, 0, 2, 2, 1, 0, 1, 1\)\), "
            r"the hit at 10 needs")):
        _drive_copy(BranchMachine())
    shifted.hashes.clear()  # type: ignore[attr-defined]
    _sabotaged_run(monkeypatch, BranchSnapshots, "take_snapshot", shifted,
                   match=CONTENT_CHECKS)


def test_a_copy_from_the_wrong_block_is_caught(monkeypatch: pytest.MonkeyPatch,
                                               pure_python: None, no_events: None) -> None:
    """Sabotage: the full-attention snapshot copies the block before the one holding
    ``[p // bs * bs, p)``."""
    real = HybridCoordinator._snapshot_branch_point

    def wrong_source(self: HybridCoordinator, req_id: ReqId, hashes: Sequence[BlockHash],
                     num_tokens: int, num_prompt_tokens: int, junction_tokens: int) -> None:
        table = self.managers[0].tables[req_id]
        bs = self.managers[0].block_size
        k = num_tokens // bs
        if k >= 1 and num_tokens % bs:
            table[k], table[k - 1] = table[k - 1], table[k]
            try:
                real(self, req_id, hashes, num_tokens, num_prompt_tokens, junction_tokens)
            finally:
                table[k], table[k - 1] = table[k - 1], table[k]
            return
        real(self, req_id, hashes, num_tokens, num_prompt_tokens, junction_tokens)

    monkeypatch.setattr(HybridCoordinator, "_snapshot_branch_point", wrong_source)
    with pytest.raises(AssertionError, match=(  # c's block 0 copied instead of its block 1
            r"c: snapshot at 12 copies block \d+ holding \(0, \(1, 2, 0, 1, 2, 0, 2, 2\)\)")):
        _drive_copy(BranchMachine())
    _sabotaged_run(monkeypatch, HybridCoordinator, "_snapshot_branch_point", wrong_source,
                   match=CONTENT_CHECKS)


@pytest.fixture
def no_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machines record hypothesis ``event``s, which only a running test may do: driven
    by hand, they record nothing."""
    monkeypatch.setattr(base, "event", lambda *args, **kwargs: None)
    monkeypatch.setitem(globals(), "event", lambda *args, **kwargs: None)


def _serve_one_by_one(machine: BranchMachine, setup: HybridSetup,
                      prompts: Sequence[tuple[str, list[int]]]) -> None:
    """Through the machine's own rules and oracle (invariants after each): each prompt is
    admitted alone, prefilled in the chunks ``align_prefill_chunk`` plans, and finished."""
    machine.init_manager(setup)

    def check() -> None:
        machine.manager_invariants()
        machine.snapshot_agrees_with_the_pool()
        machine.tables_hold_the_right_content()

    for req_id, tokens in prompts:
        machine.manager.add_request(req_id, tokens)
        machine.prompt_len[req_id] = len(tokens)
        machine.new_step()
        machine.admit_aligned(0, False)
        check()
        for _ in range(len(tokens)):
            if machine.manager.num_computed_tokens(req_id) == len(tokens):
                break
            machine.new_step()
            machine.step_aligned(0)
            check()
        assert machine.manager.num_computed_tokens(req_id) == len(tokens)
        machine.new_step()
        machine.preempt_or_finish(0, True)  # finished: the next request runs alone


SYSTEM = [1, 2, 0, 1, 2, 0, 2, 2, 1, 0, 1, 1]
"""A 12-token shared prefix."""


def _drive_eagle_divergence(machine: EagleBranchMachine) -> None:
    """``a`` and ``b`` share a 12-token prefix ``S`` and diverge at token 12, so the branch
    point is 10 (the unit ``[10, 12)`` is hashed with token 12); ``c`` leaves there as
    well, its first chunk stops at 10 and leaves a snapshot (a second prompt leaving a
    branch point takes it); ``e`` shares ``[0, 10)`` but diverges at token 10."""
    _serve_one_by_one(machine, HybridSetup(
        (FullAttentionSpec(8, 1), RecurrentStateSpec(8, 1)), 64, "latest+ckpt:branch:2",
        True, None), [
        ("a", [*SYSTEM, 0, 0, 0]),
        ("b", [*SYSTEM, 2, 2]),      # leaves a's prompt at the branch point 10
        ("c", [*SYSTEM, 1, 1]),      # leaves there too: its first chunk ends at 10, snapshot
        ("e", [*SYSTEM[:10], 2, 2, 2]),
    ])


def _drive_copy(machine: BranchMachine) -> None:
    """No EAGLE, block 8, unit 2: ``a`` and ``b`` diverge at 12 (a branch point inside
    block 1); ``c`` leaves there too, its first chunk ends at 12 and it takes the snapshot
    — a *copy* of its partial block 1 (its prompt ends at 14). ``e`` agrees with them on
    ``[0, 10)`` only: its hit is the aligned 8."""
    _serve_one_by_one(machine, HybridSetup(
        (FullAttentionSpec(8, 1), RecurrentStateSpec(8, 1)), 64, "latest+ckpt:branch:2",
        False, None), [
        ("a", [*SYSTEM, 0, 0, 0]),
        ("b", [*SYSTEM, 2, 2]),
        ("c", [*SYSTEM, 1, 1]),
        ("e", [*SYSTEM[:10], 2, 2, 2]),
    ])


def _drive_alias(machine: BranchMachine) -> None:
    """No EAGLE, block 8, unit 2: ``a`` and ``b`` diverge at 12 (a branch point inside
    block 1); ``c`` leaves there too and its first chunk ends at 12, so it takes the
    snapshot — and, running on past 24, its full-attention part is an *alias* of its own
    full block 1 (cached under its own hash), not a copy. ``e`` agrees with ``c`` on
    ``[0, 12)`` only: its hit at 12 is served by that alias."""
    _serve_one_by_one(machine, HybridSetup(
        (FullAttentionSpec(8, 1), RecurrentStateSpec(8, 1)), 64, "latest+ckpt:branch:2",
        False, None), [
        ("a", [*SYSTEM, *[0] * 14]),
        ("b", [*SYSTEM, *[2] * 14]),
        ("c", [*SYSTEM, *[1] * 14]),
        ("e", [*SYSTEM, 2, 0, 0]),
    ])


def test_the_eagle_scenario_passes_the_oracle(no_events: None) -> None:
    machine = EagleBranchMachine()
    _drive_eagle_divergence(machine)
    assert machine.manager.coordinator.branch is not None
    assert machine.manager.coordinator.branch.num_snapshots == 1  # c's, at 10
    assert machine.hit_at_admission["e"] == 8  # not 10: e's token 10 differs from c's
    machine.teardown()


def test_the_copy_scenario_passes_the_oracle(no_events: None) -> None:
    machine = BranchMachine()
    _drive_copy(machine)
    assert machine.hit_at_admission["e"] == 8
    branch = machine.manager.coordinator.branch
    assert branch is not None and branch.num_snapshots == 1  # c's, at 12
    hashes = machine.hasher.hash_blocks([*SYSTEM, 1, 1])
    copy = branch.full_source(hashes[12 // 2 - 1], GroupId(0))
    assert copy is not None and machine.content.get(copy.block_id) == (0, tuple(SYSTEM))
    machine.teardown()


def test_the_alias_scenario_passes_the_oracle(no_events: None) -> None:
    machine = BranchMachine()
    _drive_alias(machine)
    assert machine.hit_at_admission["e"] == 12
    branch = machine.manager.coordinator.branch
    assert branch is not None and branch.num_snapshots == 1  # c's, at 12
    hashes = machine.hasher.hash_blocks([*SYSTEM, 2, 0, 0])
    alias = branch.full_source(hashes[12 // 2 - 1], GroupId(0))
    assert alias is not None  # served by c's full block 1, not by a copy
    assert machine.content.get(alias.block_id) == (0, tuple([*SYSTEM, 1, 1, 1, 1]))
    machine.teardown()


def test_sub_block_hits_ignoring_the_lookahead_are_caught(monkeypatch: pytest.MonkeyPatch,
                                                         pure_python: None,
                                                         no_events: None) -> None:
    """Sabotage (EAGLE): snapshots keyed and looked up by lookahead-free ``U``-hashes (the
    hash of ``[0, p)`` instead of ``[0, p + L)``), as a sub-block cache that ignored EAGLE
    would: ``e``, diverging right at 10, gets ``c``'s snapshot at 10, whose drafter KV at
    slot 9 was computed from ``c``'s token 10. The oracle's drafter check must object."""
    plain_of: dict[BlockHash, BlockHash] = {}
    hash_with_lookahead = BlockHasher._hash_with_lookahead

    def recording(self: BlockHasher, token_ids: Sequence[int], prev: BlockHash,
                  num_full: int, first_block_idx: int, keys: ExtraKeys | None,
                  ) -> list[BlockHash]:
        hashes = hash_with_lookahead(self, token_ids, prev, num_full, first_block_idx, keys)
        plain = BlockHasher(self.block_size, self.algo).hash_blocks(
            token_ids[: num_full * self.block_size], parent=plain_of.get(prev))
        plain_of.update(zip(hashes, plain, strict=True))
        return hashes

    find_partial_hit, take_snapshot = BranchSnapshots.find_partial_hit, \
        BranchSnapshots.take_snapshot

    def plain_lookup(self: BranchSnapshots, hashes: Sequence[BlockHash],
                     *args: object) -> object:
        return find_partial_hit(self, [plain_of.get(h, h) for h in hashes],
                                *args)  # type: ignore[arg-type]

    def plain_snapshot(self: BranchSnapshots, req_id: ReqId, block_hash: BlockHash,
                       num_tokens: int, sources: Sequence[Block],
                       full_hash: BlockHash | None = None,
                       parent_hash: BlockHash | None = None) -> bool:
        return take_snapshot(self, req_id, plain_of.get(block_hash, block_hash), num_tokens,
                             sources, full_hash, parent_hash)

    class PlainKeys(EagleBranchMachine):
        """The oracle's maximality agrees with the sabotaged index, so only the drafter
        check can object."""

        def snapshot_key(self, unit_hash: BlockHash) -> BlockHash:
            return plain_of.get(unit_hash, unit_hash)

    monkeypatch.setattr(BlockHasher, "_hash_with_lookahead", recording)
    monkeypatch.setattr(BranchSnapshots, "find_partial_hit", plain_lookup)
    monkeypatch.setattr(BranchSnapshots, "take_snapshot", plain_snapshot)
    with pytest.raises(AssertionError, match="drafter KV saw"):
        _drive_eagle_divergence(PlainKeys())


def test_an_alias_of_the_wrong_block_is_caught(monkeypatch: pytest.MonkeyPatch,
                                             pure_python: None, no_events: None) -> None:
    """Sabotage: the full-attention alias names block ``k + 1`` of the producer (its
    KV holds a longer prefix, but not in the slots ``[k * bs, p)``). Driven through the
    alias scenario, where ``e``'s hit at 12 is served by ``c``'s alias: the random machine
    caught this sabotage only in some example orders (and, before the oracle's
    ``forget_old_life``, sometimes only through a false drafter alarm)."""
    original = BranchSnapshots.take_snapshot
    next_block: dict[BlockHash, BlockHash] = {}

    def wrong_alias(self: BranchSnapshots, req_id: ReqId, block_hash: BlockHash,
                    num_tokens: int, sources: Sequence[Block],
                    full_hash: BlockHash | None = None,
                    parent_hash: BlockHash | None = None) -> bool:
        if full_hash is not None:
            full_hash = next_block.get(full_hash, full_hash)
        return original(self, req_id, block_hash, num_tokens, sources, full_hash, parent_hash)

    real_snapshot_point = HybridCoordinator._snapshot_branch_point

    def remember(self: HybridCoordinator, req_id: ReqId, hashes: Sequence[BlockHash],
                 num_tokens: int, num_prompt_tokens: int, junction_tokens: int) -> None:
        assert self.branch is not None
        ratio = self.branch.block_size // self.branch.unit_tokens
        k = num_tokens // self.branch.block_size
        if (k + 2) * ratio <= len(hashes):
            next_block[hashes[(k + 1) * ratio - 1]] = hashes[(k + 2) * ratio - 1]
        real_snapshot_point(self, req_id, hashes, num_tokens, num_prompt_tokens,
                            junction_tokens)

    monkeypatch.setattr(HybridCoordinator, "_snapshot_branch_point", remember)
    monkeypatch.setattr(BranchSnapshots, "take_snapshot", wrong_alias)
    with pytest.raises(AssertionError, match=(
            r"group 0: alias \d+ is block 2 of a prompt that agrees on \[0, 12\); the hit "
            r"at 12 needs block 1")):
        _drive_alias(BranchMachine())
