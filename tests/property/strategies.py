"""Shared hypothesis strategies and oracles for the property tests.

``hybrid_setups()`` draws small hybrid models (1–3 groups of full / sliding-window /
chunked-local layers, block sizes in {2, 4, 8}, or a DeepSeek-V4 shape of compressed,
indexer, compressor-state and sliding-window MLA groups), a retention policy, EAGLE off /
lookahead hashes / drop mode and a
small pool that forces eviction and refusals. ``needed_blocks`` is the reference answer to
"which blocks of group g must a request hold to compute position p next".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from hybridkv import (
    CacheConfig,
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheManager,
    LayerSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)
from hybridkv.specs import CompressedAttentionSpec, CompressorStateSpec, SlidingWindowMLASpec

BLOCK_SIZES = (2, 4, 8)
ALPHABET = 3  # tokens 0..2: shared prefixes and equal blocks are frequent
POLICY_KINDS = ("dense", "reachable", "prepend", "latest", "interval", "pin")


@dataclass(frozen=True)
class HybridSetup:
    layers: tuple[LayerSpec, ...]
    num_blocks: int
    policy: str
    use_eagle: bool
    eagle_group_ids: tuple[int, ...] | None
    eagle_block_drop: bool = False
    """EAGLE in the older drop mode (else lookahead hashes, the default)."""

    def build(self) -> KVCacheManager:
        config = CacheConfig.from_layers(
            self.layers, self.num_blocks, use_eagle=self.use_eagle,
            eagle_group_ids=self.eagle_group_ids, eagle_block_drop=self.eagle_block_drop)
        return KVCacheManager(config, self.policy)


def layer_specs() -> st.SearchStrategy[tuple[LayerSpec, ...]]:
    """Random layer mixes, or (as often) a typical hybrid whose window groups have smaller
    blocks than the hit alignment, which is where sparse retention masks apply."""
    return st.one_of(random_layer_specs(), typical_hybrid_specs(), v4_shaped_specs(),
                     recurrent_hybrid_specs())


@st.composite
def v4_shaped_specs(draw: st.DrawFn) -> tuple[LayerSpec, ...]:
    """A small DeepSeek-V4 shape: compressed KV (one entry per r tokens) with or without
    an indexer cache, compressor state (window 2r overlapping, or r) in blocks smaller
    than the alignment, and a sliding-window MLA branch; packed block-outermost."""
    bs = draw(st.sampled_from((4, 8)))
    ratio = draw(st.sampled_from([r for r in (2, 4, 8) if bs % r == 0]))
    state_bs = draw(st.sampled_from([b for b in (1, 2, 4) if b < bs]))
    specs: list[LayerSpec] = []
    if draw(st.booleans()):
        specs.append(CompressedAttentionSpec(bs, tokens_per_state=ratio, entry_bytes=1,
                                             role="indexer"))
    specs.append(SlidingWindowMLASpec(draw(st.sampled_from((2, 4))), 1,
                                      draw(st.integers(2, 2 * bs))))
    specs.append(CompressedAttentionSpec(bs, tokens_per_state=ratio, entry_bytes=2))
    window = ratio * draw(st.sampled_from((1, 2)))
    specs.append(CompressorStateSpec(state_bs, 4, window))
    return tuple(specs)


@st.composite
def recurrent_hybrid_specs(draw: st.DrawFn) -> tuple[LayerSpec, ...]:
    """Full attention plus one or two recurrent groups (siblings), as Qwen3.5 or
    Nemotron-H: one block size (unified, as vLLM plans them), sometimes a window group."""
    bs = draw(st.sampled_from(BLOCK_SIZES))
    specs: list[LayerSpec] = [FullAttentionSpec(bs, 1)]
    specs += [RecurrentStateSpec(bs, 1)] * draw(st.integers(1, 2))
    if draw(st.integers(0, 3)) == 0:
        specs.append(SlidingWindowSpec(bs, 1, draw(st.integers(2, 2 * bs))))
    return tuple(specs)


@st.composite
def typical_hybrid_specs(draw: st.DrawFn) -> tuple[LayerSpec, ...]:
    full_bs = draw(st.sampled_from((4, 8)))
    specs: list[LayerSpec] = [FullAttentionSpec(full_bs, 1)]
    for _ in range(draw(st.integers(1, 2))):
        bs = draw(st.sampled_from([b for b in BLOCK_SIZES if b < full_bs]))
        specs.append(SlidingWindowSpec(bs, 1, draw(st.integers(1, 2 * full_bs))))
    return tuple(specs)


@st.composite
def random_layer_specs(draw: st.DrawFn) -> tuple[LayerSpec, ...]:
    """1–3 layers; identical specs are allowed (they become sibling groups of one spec)."""
    num_layers = draw(st.sampled_from((1, 2, 2, 3, 3)))  # mostly hybrid
    kinds = draw(st.lists(st.sampled_from(("full", "swa", "chunked", "recurrent")),
                          min_size=num_layers, max_size=num_layers))
    sizes = draw(st.lists(st.sampled_from(BLOCK_SIZES), min_size=num_layers,
                          max_size=num_layers))
    if "chunked" in kinds:
        # a chunked-local group needs block_size == lcm of all block sizes (the largest
        # here, since sizes are powers of two)
        sizes = [max(sizes) if k == "chunked" else s for k, s in zip(kinds, sizes, strict=True)]
    specs: list[LayerSpec] = []
    for kind, bs in zip(kinds, sizes, strict=True):
        if kind == "full":
            specs.append(FullAttentionSpec(bs, 1))
        elif kind == "recurrent":
            specs.append(RecurrentStateSpec(bs, 1))
        elif kind == "swa":
            # windows from 1 token to 3 blocks of the largest size: smaller and larger
            # than one block, small ones favoured (they make sparse retention masks);
            # w = 1 needs no window KV at all (an empty tail: issue 12's regression)
            window = draw(st.integers(1, 9) | st.integers(1, 3 * max(BLOCK_SIZES)))
            specs.append(SlidingWindowSpec(bs, 1, window))
        else:
            specs.append(ChunkedLocalSpec(bs, 1, bs * draw(st.integers(1, 3))))
    if draw(st.booleans()) and len(specs) < 3:
        specs.append(specs[draw(st.integers(0, len(specs) - 1))])  # a sibling group
    return tuple(specs)


@st.composite
def hybrid_setups(draw: st.DrawFn, *, typical_tokens: int = 24,
                  layers_from: st.SearchStrategy[tuple[LayerSpec, ...]] | None = None,
                  ) -> HybridSetup:
    """A model (from ``layers_from``, default ``layer_specs()``), a policy and a pool of
    0.5–4 times the blocks of a ``typical_tokens`` request (so pools both refuse
    admissions and evict cached blocks)."""
    layers = draw(layers_from if layers_from is not None else layer_specs())
    alignment = math.lcm(*(s.block_size for s in layers))
    kind = POLICY_KINDS[draw(st.integers(0, 10**6)) % len(POLICY_KINDS)]  # ~uniform
    if kind == "interval":
        policy = f"interval:{alignment * draw(st.integers(1, 3))}"
    elif kind == "pin":
        policy = f"pin:{draw(st.sampled_from((2, 8, 32)))}"
    else:
        policy = kind
    if kind in ("prepend", "latest") and any(isinstance(s, RecurrentStateSpec) for s in layers) \
            and draw(st.booleans()):
        policy += "+ckpt:block"  # a checkpoint at every block end (not vLLM's chunk ends)
    groups = CacheConfig.from_layers(layers, 2).groups
    has_chunked = any(isinstance(s, ChunkedLocalSpec) for s in layers)
    use_eagle = draw(st.integers(0, 2)) == 0
    eagle_group_ids = None
    eagle_block_drop = use_eagle and not has_chunked and draw(st.booleans())
    if eagle_block_drop and draw(st.booleans()):
        eagle_group_ids = tuple(sorted(draw(st.sets(
            st.integers(0, len(groups) - 1), min_size=1, max_size=len(groups)))))
    per_request = sum(-(-typical_tokens // g.spec.block_size) for g in groups)
    num_blocks = 1 + draw(st.integers(max(2, per_request // 2), per_request * 4))
    return HybridSetup(layers, num_blocks, policy, use_eagle, eagle_group_ids, eagle_block_drop)


def needed_blocks(spec: LayerSpec, num_tokens: int) -> range:
    """Table indices whose KV computing position ``num_tokens`` next reads.

    Full attention: every block before it. Sliding window: the blocks of
    ``[p - (w - 1), p)``. Chunked local: the blocks of the current chunk before ``p``.
    Recurrent state, at a hit position ``p`` (a block multiple): the checkpoint block
    ending at ``p`` (a running request's state is its table's last block instead).
    """
    bs = spec.block_size
    end = -(-num_tokens // bs)
    if isinstance(spec, RecurrentStateSpec):
        return range(max(end - 1, 0), end)
    if isinstance(spec, SlidingWindowSpec):
        first = max(0, num_tokens - spec.sliding_window + 1)
    elif isinstance(spec, ChunkedLocalSpec):
        first = (num_tokens // spec.attention_chunk_size) * spec.attention_chunk_size
    else:
        first = 0
    return range(min(first // bs, end), end)


def token_lists(max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, ALPHABET - 1), max_size=max_size)


def extend_prefix(bases: Sequence[Sequence[int]], base_idx: int, num_dropped: int,
                  suffix: Sequence[int], max_len: int) -> list[int]:
    """A prompt from a prefix tree: an earlier sequence minus its last ``num_dropped``
    tokens, plus new tokens (``base_idx`` past the last sequence starts a fresh tree)."""
    choice = base_idx % (len(bases) + 1)
    base = list(bases[choice]) if choice < len(bases) else []
    tokens = base[: max(0, len(base) - num_dropped)] + list(suffix)
    return (tokens or [0])[:max_len]
