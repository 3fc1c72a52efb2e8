"""Masking never loses a hit ``dense`` would get where the masked policy retained the state.

Two managers with one random small hybrid model (window sizes from 1 token — which needs no
window KV at all — to two full-attention blocks) and a pool large enough that nothing is
ever evicted run the same request stream (a prefix tree: resends, extensions, branches),
one request at a time: lookup, prefill in one step, a few decode steps, finish. One is
``dense`` (hashes every full block), the other a masking policy. At every lookup:

- the masked hit is at most the dense hit (dense keeps a superset of the hashes);
- it reaches every boundary the policy promises to retain of every earlier request that
  shares that prefix (multiples of ``A`` for ``reachable`` / ``prepend`` / ``pin:T``, of
  ``N`` plus the prompt's replay boundary for ``interval:N``, the replay boundary for
  ``latest``; always the earlier request's own hit) — so where dense's hit is such a
  boundary, both hit the same.

The window-of-1 regression (vLLM 0.33's arithmetic: a hit needed at least one cached window
block, and masks hash none when the tail is empty) fails the second check at once.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from strategies import ALPHABET, extend_prefix, token_lists

from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridkv.specs import LayerSpec

MASKED = ("reachable", "prepend", "latest", "interval", "pin")
MAX_PROMPT = 40


@st.composite
def models(draw: st.DrawFn) -> tuple[LayerSpec, ...]:
    full_bs = draw(st.sampled_from((2, 4, 8)))
    specs: list[LayerSpec] = [FullAttentionSpec(full_bs, 1)]
    for _ in range(draw(st.integers(1, 2))):
        bs = draw(st.sampled_from([b for b in (2, 4, 8) if b <= full_bs]))
        window = draw(st.just(1) | st.integers(1, 2 * full_bs))
        specs.append(SlidingWindowSpec(bs, 1, window))
    return tuple(specs)


def promised(policy: str, align: int, hit: int, prompt_len: int, computed: int) -> list[int]:
    """Boundaries in ``[hit, computed]`` a request's lifetime leaves hittable."""
    kind, _, arg = policy.partition(":")
    step = int(arg) if kind == "interval" else align
    replay = (prompt_len - 1) // align * align
    out = [hit] if hit else []
    if kind != "latest":
        out += [b for b in range(step, computed + 1, step) if b >= hit]
    if kind in ("interval", "latest") and hit <= replay <= computed:
        out.append(replay)
    return out


@given(layers=models(), kind=st.sampled_from(MASKED), data=st.data(),
       requests=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 12),
                                   token_lists(16), st.integers(0, 3)),
                         min_size=2, max_size=8))
def test_masked_hit_reaches_every_retained_boundary(
        layers: tuple[LayerSpec, ...], kind: str, data: st.DataObject,
        requests: list[tuple[int, int, list[int], int]]) -> None:
    align = math.lcm(*(s.block_size for s in layers))
    if kind == "interval":
        policy = f"interval:{align * data.draw(st.integers(1, 3))}"
    elif kind == "pin":
        policy = f"pin:{data.draw(st.sampled_from((2, 8, 32)))}"
    else:
        policy = kind
    config = CacheConfig.from_layers(layers, 4 * len(layers) * 60 * len(requests))
    dense, masked = KVCacheManager(config, "dense"), KVCacheManager(config, policy)
    history: list[tuple[list[int], list[int]]] = []  # (computed tokens, promised boundaries)
    sequences: list[list[int]] = []
    for n, (base, dropped, suffix, num_decode) in enumerate(requests):
        tokens = extend_prefix(sequences, base, dropped, suffix, MAX_PROMPT)
        req = f"r{n}"
        hits = []
        for manager in (dense, masked):
            manager.add_request(req, tokens)
            hit = manager.find_longest_hit(req)
            assert hit.junction_tokens == 0 or hit.junction_tokens > hit.num_tokens
            assert manager.allocate_slots(req, len(tokens) - hit.num_tokens, hit) is not None
            for step in range(num_decode):
                manager.append_token_ids(req, [(n + step) % ALPHABET])
                assert manager.allocate_slots(req, 1) is not None
            hits.append(hit.num_tokens)
        dense_hit, masked_hit = hits
        assert masked_hit <= dense_hit, (policy, masked_hit, dense_hit)
        for computed, boundaries in history:
            shared = 0
            for a, b in zip(computed, tokens, strict=False):
                if a != b:
                    break
                shared += 1
            reachable = [b for b in boundaries if b <= min(shared, len(tokens) - 1)]
            if reachable:
                assert masked_hit >= max(reachable), (
                    f"{policy}: boundary {max(reachable)} retained by an earlier request "
                    f"was lost (hit {masked_hit}, dense {dense_hit})")
        full = list(masked.token_ids(req))
        history.append((full, promised(policy, align, masked_hit, len(tokens), len(full))))
        sequences.append(full)
        for manager in (dense, masked):
            manager.remove_request(req)
            manager.check_invariants()
