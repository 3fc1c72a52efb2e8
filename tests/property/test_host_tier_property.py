"""Host tier (``hybridkv.host_tier``, ``host_aware``, ``host_lru``) under random stores and
lookups, with a content oracle.

Shapes: one full-attention group plus 0–2 window / state groups (block sizes 2, 4, 8; tails
of 1–3 blocks); prompts over a 3-token alphabet (shared prefixes are frequent). A block's
hash *is* its content here: ``b"p" + bytes(prefix)`` for the token prefix it ends, so the
oracle can read back what any host or GPU block holds.

After every store: ``check_invariants()`` of the tier; for ``aware``, every landing point
it holds is a host-only hit on its own (no dead content: no chain without its state).

At every lookup the oracle checks the promotion, independently of the tier's code: a hit
``p`` is aligned, > the GPU hit, ≤ prompt − 1; every block a hit at ``p`` needs (full
attention: all of ``[0, p)``; other groups: the tail ending at ``p``) is on the GPU or the
host *and holds this prompt's prefix*; the blocks reported as loaded are exactly the
needed ones not on the GPU; and no longer aligned point could be served (maximal). A
sabotaged tier (tails cut short, one block off) fails it (``test_oracle_catches_*``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hybridkv.host_policies import make_host_tier
from hybridkv.host_tier import (
    HostGroup,
    HostHit,
    HostShape,
    HostTier,
    ReleasedBlocks,
    Resident,
)
from hybridkv.ids import BlockHash, GroupId

POLICIES = ("aware", "lru", "lru-split", "lru-split:0.25")


def prefix_hash(tokens: Sequence[int]) -> BlockHash:
    return BlockHash(b"p" + bytes(tokens))


def hashes_of(prompt: Sequence[int], hb: int) -> list[BlockHash]:
    return [prefix_hash(prompt[: (i + 1) * hb]) for i in range(len(prompt) // hb)]


@st.composite
def shapes(draw: st.DrawFn) -> HostShape:
    full_bs = draw(st.sampled_from((2, 4)))
    groups = [HostGroup(GroupId(0), full_bs, None)]
    for gid in range(1, draw(st.integers(0, 2)) + 1):
        groups.append(HostGroup(GroupId(gid), draw(st.sampled_from((2, 4, 8))),
                                draw(st.integers(1, 3))))
    sizes = [g.block_size for g in groups]
    a = math.lcm(*sizes)
    bridge = draw(st.sampled_from((None, a, 2 * a))) if len(groups) > 1 else None
    return HostShape(tuple(groups), math.gcd(*sizes), a, 1, bridge)


def needed(shape: HostShape, point: int) -> list[tuple[GroupId, int]]:
    """(group, end token) of every block a hit at ``point`` needs (independent of the tier)."""
    out: list[tuple[GroupId, int]] = []
    for g in shape.groups:
        count = point // g.block_size if g.is_full else min(g.tail_blocks or 0,
                                                             point // g.block_size)
        out.extend((g.group_id, point - k * g.block_size) for k in range(count))
    return out


def check_promotion(shape: HostShape, tier: HostTier, prompt: Sequence[int],
                    gpu: set[tuple[GroupId, BlockHash]], gpu_hit: int,
                    hit: HostHit | None) -> None:
    """The content oracle (module doc); raises ``AssertionError`` on a wrong promotion."""
    def served(point: int) -> bool:
        return all((g, prefix_hash(prompt[:end])) in gpu or tier.holds(g, prefix_hash(
            prompt[:end])) for g, end in needed(shape, point))

    def chain(point: int) -> bool:
        return all((g, prefix_hash(prompt[:end])) in gpu or tier.holds(g, prefix_hash(
            prompt[:end])) for g, end in needed(shape, point) if g == GroupId(0))

    a = shape.alignment_tokens
    top = (len(prompt) - 1) // a * a
    best = next((p for p in range(top, gpu_hit, -a) if served(p)), None)
    reach = next(p for p in range(top, -1, -a) if chain(p))  # 0 is always a chain
    bridge = 0 if shape.bridge_tokens is None else max(0, reach - shape.bridge_tokens)
    if bridge > max(gpu_hit, best or 0):
        best = bridge
    if hit is None:
        assert best is None, f"missed a host hit at {best}"
        return
    p = hit.num_tokens
    assert p % a == 0 and gpu_hit < p <= len(prompt) - 1
    assert p == best, f"hit {p}, longest servable {best}"
    if hit.full_attention_tokens:  # a bridge: the chain to F is read, no tail
        assert p == bridge and hit.full_attention_tokens == reach
        needs = [(g, end) for g, end in needed(shape, reach) if g == GroupId(0)]
    else:
        needs = needed(shape, p)
    want = {(g, prefix_hash(prompt[:end])) for g, end in needs} - gpu
    assert set(hit.loaded) == want, "loaded blocks differ from the needed ones off the GPU"
    for g, h in hit.loaded:
        assert tier.holds(g, h), "a loaded block is not on the host"


def released(shape: HostShape, prompt: Sequence[int], data: st.DataObject) -> ReleasedBlocks:
    cached: list[list[int]] = []
    for g in shape.groups:
        num = len(prompt) // g.block_size
        if g.is_full:
            cached.append(list(range(data.draw(st.integers(0, num)))))
        else:
            cached.append(sorted(data.draw(st.sets(st.integers(0, max(0, num - 1)),
                                                   max_size=num)) if num else []))
    return ReleasedBlocks(hashes_of(prompt, shape.hash_block_size), tuple(cached), len(prompt))


prompts = st.lists(st.integers(0, 2), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(shape=shapes(), policy=st.sampled_from(POLICIES), capacity=st.integers(0, 30),
       data=st.data())
def test_random_stores_and_lookups(shape: HostShape, policy: str, capacity: int,
                                   data: st.DataObject) -> None:
    tier = make_host_tier(policy, shape, capacity)
    gpu: set[tuple[GroupId, BlockHash]] = set()
    seen: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 8))):
        prompt = data.draw(prompts)
        if seen and data.draw(st.booleans()):  # resend a stored prompt, maybe extended
            prompt = data.draw(st.sampled_from(seen)) + prompt[: data.draw(st.integers(0, 8))]
        seen.append(prompt)
        if data.draw(st.booleans()):
            offer = released(shape, prompt, data)
            tier.store(offer)
            tier.check_invariants()
            if data.draw(st.booleans()):  # some of it stays on the GPU too
                gpu |= {(g.group_id, shape.block_hash(offer.hashes, g, i))
                        for g, ix in zip(shape.groups, offer.cached, strict=True)
                        for i in ix[: data.draw(st.integers(0, len(ix)))]}
        else:
            hashes = hashes_of(prompt, shape.hash_block_size)
            gpu_hit = 0  # the GPU's own hit is the manager's business: start from 0
            hit = tier.longest_hit(hashes, _member_of(frozenset(gpu)),
                                   gpu_hit_tokens=gpu_hit, max_tokens=len(prompt) - 1)
            check_promotion(shape, tier, prompt, gpu, gpu_hit, hit)
            event("host hit" if hit is not None else "no host hit")
            if hit is not None:
                tier.promote(hashes, hit, gpu_hit)
                tier.check_invariants()
    if policy == "aware":
        assert_no_dead_content(tier, shape)


def _member_of(keys: frozenset[tuple[GroupId, BlockHash]]) -> Resident:
    return lambda g, h: (g, h) in keys


def assert_no_dead_content(tier: HostTier, shape: HostShape) -> None:
    """Every block ``aware`` holds belongs to a landing point that is a host-only hit."""
    points = tier._points  # type: ignore[attr-defined]
    for key in points:
        prompt = list(key[1:])
        hit = tier.longest_hit(hashes_of([*prompt, 0], shape.hash_block_size),
                               lambda g, h: False, gpu_hit_tokens=0, max_tokens=len(prompt))
        land = shape.bridge_start(len(prompt)) if not points[key] and \
            shape.tail_groups else len(prompt)
        assert hit is not None and hit.num_tokens >= land, \
            f"held point at {len(prompt)} is no host-only hit"


def _tail_case() -> tuple[HostShape, HostTier, list[int]]:
    """One full group (blocks of 2) and a window group (blocks of 2, tail 2); the host holds
    a 9-token prompt's chain and its tail at 8 only."""
    shape = HostShape((HostGroup(GroupId(0), 2, None), HostGroup(GroupId(1), 2, 2)), 2, 2, 1)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    tier = make_host_tier("lru", shape, 100)
    tier.store(ReleasedBlocks(hashes_of(prompt, 2), ([0, 1, 2, 3], [2, 3]), 9))
    return shape, tier, prompt


def test_oracle_accepts_the_real_tier() -> None:
    shape, tier, prompt = _tail_case()
    hit = tier.longest_hit(hashes_of(prompt, 2), lambda g, h: False, gpu_hit_tokens=0,
                           max_tokens=8)
    assert hit is not None and hit.num_tokens == 8
    check_promotion(shape, tier, prompt, set(), 0, hit)


def test_oracle_catches_a_tail_cut_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the tier believes a hit needs one tail block less; the host then lands
    at 6 with half a tail — the oracle sees the missing window block."""
    shape, tier, prompt = _tail_case()
    monkeypatch.setattr(HostGroup, "tail_at", lambda self, n: (
        n // self.block_size if self.tail_blocks is None
        else max(0, min(self.tail_blocks, n // self.block_size) - 1)))
    hit = tier.longest_hit(hashes_of(prompt[:7], 2), lambda g, h: False, gpu_hit_tokens=0,
                           max_tokens=6)
    with pytest.raises(AssertionError, match=r"longest servable|loaded blocks"):
        check_promotion(shape, tier, prompt[:7], set(), 0, hit)


def test_oracle_catches_a_block_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the tier looks for each tail block one position early (its window then
    misses the block ending at the hit, and holds one the hit does not read)."""
    shape, tier, prompt = _tail_case()
    tier.store(ReleasedBlocks(hashes_of(prompt, 2), ([0, 1, 2, 3], [1]), 9))
    original = HostShape.block_hash
    monkeypatch.setattr(HostShape, "landing_keys", lambda self, hashes, point: [
        (g.group_id, original(self, hashes, g, max(0, i - 1)))
        for g in self.tail_groups
        for i in range(point // g.block_size - g.tail_at(point), point // g.block_size)])
    hit = tier.longest_hit(hashes_of(prompt, 2), lambda g, h: False, gpu_hit_tokens=0,
                           max_tokens=8)
    assert hit is not None and hit.num_tokens == 8  # wrongly: it read the window at 4–6
    with pytest.raises(AssertionError, match="loaded blocks"):
        check_promotion(shape, tier, prompt, set(), 0, hit)
