"""The manager state machine again, with eviction policies and window-recompute bridges.

``ManagerMachine`` (test_manager_state_machine.py) checks invariants and a content oracle for
the retention policies; here every setup also draws eviction modifiers (``scan``, ``chain``,
``session``, ``predict``) and ``+recompute``. ``predict`` either learns fast (a tiny horizon,
one-sample signatures) or has its verdict forced by the signature's parity, so that
predicted-dead blocks are filed within a test case; its learning runs either way. Checks
that depend on LRU order or on plain hits (free order, hit maximality, retention
guarantees) do not apply and are switched off; the content oracle gets stricter instead:

- a bridge plan hands out full-attention blocks up to ``F`` whose content is exactly the
  prefix, and window blocks only where a warm bridge has a real tail at ``s``;
- window KV a cold bridge computes below the exact tail ending at ``F`` is recorded as
  *inexact*: if any later hit ever hands such a block out, the oracle fails. This is the
  proof that bridges never cache what they cannot compute exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant
from strategies import HybridSetup, hybrid_setups, needed_blocks
from test_manager_state_machine import Content, ManagerMachine

from hybridkv import FullAttentionSpec, PrefixHit, RecurrentStateSpec, SlidingWindowSpec
from hybridkv.eviction import ReusePredictor

INEXACT: Content = (-1, ())


class ParityPredictor(ReusePredictor):
    """Learns as usual, but predicts dead every signature of the given parity."""

    def __init__(self, dead_parity: int) -> None:
        super().__init__(horizon=3, threshold=0.9, min_samples=1)
        self.dead_parity = dead_parity

    def is_live(self, signature: int) -> bool:
        return signature % 2 != self.dead_parity


EVICTIONS = ("", "+scan", "+chain", "+session", "+scan+chain", "+scan+chain+session",
             "+predict", "+scan+predict", "+scan+chain+session+predict",
             "+flops", "+scan+flops", "+chain+flops", "+predict+flops")


class EvictionRecomputeMachine(ManagerMachine):
    @initialize(setup=hybrid_setups(), eviction=st.sampled_from(EVICTIONS),
                recompute=st.booleans(), sparse=st.booleans(),
                dead_parity=st.sampled_from((None, 0, 1)))
    def init_manager(self, setup: HybridSetup, eviction: str, recompute: bool,
                     sparse: bool, dead_parity: int | None = None) -> None:
        retention = setup.policy
        if recompute and sparse:  # bridges need missing tails: favour `latest`
            retention = "latest"
        kinds = {s.kind for s in setup.layers}
        if "flops" in eviction and not (
                "full_attention" in kinds and kinds <= {"full_attention", "recurrent_state"}):
            eviction = eviction.replace("+flops", "")  # hit points of full + recurrent only
        policy = retention + eviction + ("+recompute" if recompute else "")
        super().init_manager(HybridSetup(setup.layers, setup.num_blocks, policy,
                                         setup.use_eagle, setup.eagle_group_ids,
                                         setup.eagle_block_drop))
        self.bridges = 0
        evictor = self.manager.pool.eviction
        if evictor is not None and evictor.predictor is not None:  # learn fast, flip often
            evictor.predictor = ReusePredictor(horizon=3, threshold=0.9, min_samples=1) \
                if dead_parity is None else ParityPredictor(dead_parity)

    # the LRU/plain-hit specific checks of the base machine do not apply here
    def guaranteed_boundaries(self, req_id: str, num_computed: int) -> list[int]:
        return []

    def check_retention(self, tokens: Sequence[int], num_hit: int, num_hashed: int) -> None:
        pass

    def check_free_order(self, tables: list[list[object]]) -> None:  # type: ignore[override]
        pass

    def window_floor(self, req_id: str) -> int:
        return self.manager.prefill_plan(req_id).window_floor_tokens

    def check_hit(self, req_id: str, hit: PrefixHit) -> None:
        tokens = self.tokens(req_id)
        s, f = hit.num_tokens, hit.full_attention_tokens
        assert s % self.align == 0 and f % self.align == 0 and s <= f <= len(tokens) - 1
        if f > s:
            self.bridges += 1
            event("bridge" + (" (cold)" if hit.is_window_missing else " (warm)"))
        for group_id, (spec, table) in enumerate(zip(self.specs, hit.blocks, strict=True)):
            is_window = isinstance(spec, SlidingWindowSpec)
            point = s if is_window else f
            assert len(table) == point // spec.block_size, (group_id, len(table), point)
            needed = range(0) if is_window and hit.is_window_missing else \
                needed_blocks(spec, point)
            for idx, block in enumerate(table):
                if block.is_null:
                    assert idx not in needed, f"group {group_id}: needed block {idx} is null"
                    continue
                got = self.content.get(block.block_id)
                assert got == self.expected(group_id, tokens, idx), (
                    f"group {group_id} hit block {block.block_id} at index {idx} holds {got}")
        if s:
            self.num_hits += 1

    def record_computed(self, req_id: str, start: int, end: int,
                        new_block_ids: Sequence[Sequence[int]]) -> None:
        super().record_computed(req_id, start, end, new_block_ids)
        floor = self.window_floor(req_id)
        if not floor:
            return
        bridge_end = self.manager.prefill_plan(req_id).full_attention_cached_tokens
        for group_id, table in enumerate(self.manager.get_block_ids(req_id)):
            spec = self.specs[group_id]
            if not isinstance(spec, SlidingWindowSpec):
                continue
            first_exact = bridge_end // spec.block_size - spec.num_tail_blocks
            for idx, block_id in enumerate(table[:max(first_exact, 0)]):
                if block_id and start < (idx + 1) * spec.block_size <= end:
                    self.content[block_id] = INEXACT  # bridge KV with incomplete windows

    @invariant()
    def note_predictions(self) -> None:
        evictor = self.manager.pool.eviction
        if evictor is not None and evictor.num_predicted_dead:
            event("predict: blocks filed predicted-dead")

    @invariant()
    def tables_hold_the_right_content(self) -> None:
        """Held blocks a running request still needs hold its prefix (window layers of a
        cold bridge need nothing below the floor)."""
        for req_id in self.running():
            tokens = self.tokens(req_id)
            computed = self.manager.num_computed_tokens(req_id)
            floor = self.window_floor(req_id)
            for group_id, table in enumerate(self.manager.get_block_ids(req_id)):
                spec = self.specs[group_id]
                for idx in needed_blocks(spec, computed):
                    if isinstance(spec, SlidingWindowSpec) and \
                            (idx + 1) * spec.block_size <= floor:
                        continue
                    block_id = table[idx]
                    assert block_id != 0, f"{req_id} group {group_id}: block {idx} needed"
                    got = self.content.get(block_id)
                    if (idx + 1) * spec.block_size <= computed and got != INEXACT:
                        assert got == self.expected(group_id, tokens, idx), (
                            f"{req_id} group {group_id} index {idx}: {block_id} holds {got}")


TestEvictionRecomputeMachine = EvictionRecomputeMachine.TestCase
TestEvictionRecomputeMachine.settings = settings(stateful_step_count=100)


def test_flops_is_dropped_for_a_model_without_full_attention() -> None:
    """``+flops`` values full-attention + recurrent hit points: a recurrent-only model
    (``random_layer_specs`` draws one) gets the setup without it, not a ``ConfigError``."""
    machine = EvictionRecomputeMachine()
    machine.init_manager(HybridSetup((RecurrentStateSpec(2, 1),), 10, "latest", False, None),
                         "+scan+flops", False, False)
    assert machine.manager.pool.eviction is not None
    assert not machine.manager.pool.eviction.options.flops
    assert machine.manager.pool.eviction.options.scan  # the rest of the draw is kept
    machine = EvictionRecomputeMachine()  # with full attention, +flops stays
    machine.init_manager(HybridSetup((FullAttentionSpec(2, 1), RecurrentStateSpec(2, 1)), 10,
                                     "latest", False, None), "+flops", False, False)
    assert machine.manager.pool.eviction is not None
    assert machine.manager.pool.eviction.options.flops
