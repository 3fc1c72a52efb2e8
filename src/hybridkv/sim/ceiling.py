"""Infinite-cache ceiling: the hit rate a cache that never evicts would reach.

Requests are taken in trace order; a request's ceiling hit is the longest prefix it shares
with any earlier request (its prompt, and its outputs when they are predetermined), floored to
the hit alignment and capped at ``prompt - 1`` tokens — exactly what an infinite pool under
the replay protocol could hit at first admission.

Traces given as trace-block ids are matched block by block (equal chained ids = equal
content; ids of different blocks expand to disjoint token ids, so a match can only end on a
trace-block boundary or inside a block some earlier request covered only partly). Token
traces are matched by chained hashes of ``alignment``-token blocks.

>>> from hybridkv.traces.trace import Trace, TraceRequest
>>> a = TraceRequest("a", 1000, output_length=1, block_ids=(1, 2), trace_block_size=512)
>>> b = TraceRequest("b", 1024, output_length=1, block_ids=(1, 2), trace_block_size=512)
>>> infinite_cache_ceiling(Trace("t", (a, b)), alignment_tokens=256).hit_tokens  # 1000 → 768
768
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from hybridkv.hashing import encode_token_ids
from hybridkv.traces.trace import Trace, TraceRequest, expand_prompt


@dataclass(frozen=True, slots=True)
class HitTotals:
    """Hit tokens out of prompt tokens (the result of the ceiling and of the bound)."""

    prompt_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def infinite_cache_ceiling(trace: Trace, alignment_tokens: int) -> HitTotals:
    """Token-weighted ceiling of ``trace`` for hits aligned to ``alignment_tokens``."""
    block_coverage: dict[int, int] = {}
    token_blocks: set[int] = set()
    prompt_tokens = hit_tokens = 0
    for index, request in enumerate(trace.requests):
        num_tokens = request.input_length
        if request.token_ids is None and request.trace_block_size:
            matched = _match_block_ids(request, block_coverage)
        else:
            matched = _match_tokens(request, index, alignment_tokens, token_blocks)
        cap = ((num_tokens - 1) // alignment_tokens) * alignment_tokens
        hit_tokens += min((matched // alignment_tokens) * alignment_tokens, cap)
        prompt_tokens += num_tokens
    return HitTotals(prompt_tokens, hit_tokens)


def chain_key(parent: int, value: int) -> int:
    """The 64-bit key of ``value`` (taken mod 2**64) after the key ``parent``: xxh3-64 of
    both packed as little-endian unsigned 64-bit integers.

    >>> chain_key(0, 7) == chain_key(0, 7 + 2**64), chain_key(0, 7) == chain_key(1, 7)
    (True, False)
    """
    return int(xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, value & (2**64 - 1))))


def _match_block_ids(request: TraceRequest, coverage: dict[int, int]) -> int:
    """Tokens matched against earlier requests; records this request's own coverage."""
    size = request.trace_block_size
    key = 0
    matched = 0
    matching = True
    for i, block_id in enumerate(request.block_ids):
        key = chain_key(key, block_id)
        covered = max(0, min(size, request.input_length - i * size))
        if covered == 0:
            break
        if matching:
            seen = coverage.get(key, 0)
            matched += min(seen, covered)
            matching = seen >= covered
        if coverage.get(key, 0) < covered:
            coverage[key] = covered
    return matched


def _match_tokens(request: TraceRequest, index: int, alignment: int, seen: set[int]) -> int:
    tokens = expand_prompt(request, index)
    if request.output_token_ids:
        tokens = tokens + list(request.output_token_ids)
    encoded = encode_token_ids(tokens)
    width = 8 * alignment
    key = 0
    matched = 0
    matching = True
    for i in range(len(tokens) // alignment):
        key = int(xxhash.xxh3_64_intdigest(encoded[i * width : (i + 1) * width],
                                            seed=key))
        if matching and key in seen:
            matched += alignment
        else:
            matching = False
            seen.add(key)
    return min(matched, request.input_length)
