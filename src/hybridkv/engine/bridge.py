"""Window-recompute bridges: which positions one chunk reads and writes under a prefill plan.

A bridge hit (retention policy modifier ``+recompute``) admits a request whose
full-attention KV is cached for ``[0, F)`` while its window KV starts only at ``s < F``.
The scheduler computes positions ``[s, ...)`` as for any hit; ``KVCacheManager.prefill_plan``
tells the engine ``F = full_attention_cached_tokens`` and ``floor = window_floor_tokens``
(``s`` for a cold bridge: window KV before ``s`` does not exist and the window tables hold
null blocks there; 0 for a warm bridge or none). Per chunk ``[start, end)``::

    kind       keys read                                  K/V written
    full       [0, end)  (cached below F: read as is)      [max(start, F), end)
    sliding    [max(start - (w - 1), floor), end)         [start, end)
    chunked    [floor(start / c) * c, end)                [start, end)   (never bridged)

The floor needs no mask of its own: attention masks are built over the gathered keys only,
so a query at ``p`` reads ``[max(p - (w - 1), floor), p]``, and the null-block safety net
(``PagedKVCache.slots``) checks exactly those positions.

Worked example (w = 5, cold bridge s = 16, F = 24, chunk [16, 20)): full layers read the
cached ``[0, 16)`` plus ``[16, 20)`` — also cached, not recomputed — and write nothing;
sliding layers read ``[16, 20)`` (query 17 reads 16..17, not 13..17) and write ``[16, 20)``.

Why it is exact: hidden states right after ``s`` are wrong (their windows are incomplete).
A sliding layer carries the error ``w - 1`` positions further; a full layer does not (its
keys below ``F`` are the cached, exact ones, so a wrong query only spoils its own
position). With ``F - s >= sum over sliding layers of (w - 1)`` every layer's K/V in
``[F - (w - 1), F)`` and every hidden state at ``>= F`` is exact. Full-attention pages
below ``F`` are shared cached blocks: writing them would corrupt other requests, so
``check_span`` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.cache import PrefillPlan
from hybridkv.engine.attention import AttentionRule
from hybridkv.errors import InvariantViolation

NO_BRIDGE = PrefillPlan(full_attention_cached_tokens=0, window_floor_tokens=0)


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Positions one chunk of queries ``[start, end)`` touches in one cache group.

    ``read_start``: first key position gathered (keys ``[read_start, end)``);
    ``write_start``: first position whose K/V the chunk writes (``[write_start, end)``,
    empty when ``write_start == end``).

    >>> span = chunk_span(AttentionRule("full_attention"), 16, 20, PrefillPlan(24, 16))
    >>> (span.read_start, span.write_start, span.num_skipped_writes(16))
    (0, 20, 4)
    """

    read_start: int
    write_start: int
    end: int

    def num_skipped_writes(self, start: int) -> int:
        """Leading query rows of the chunk whose K/V is not written."""
        return self.write_start - start


def full_attention_write_start(start: int, end: int, plan: PrefillPlan) -> int:
    """First position a full-attention chunk ``[start, end)`` writes: never below the
    cached ``F`` (clamped to ``end``: a chunk wholly inside the bridge writes nothing)."""
    return min(end, max(start, plan.full_attention_cached_tokens))


def window_read_start(rule: AttentionRule, start: int, plan: PrefillPlan) -> int:
    """First key a sliding chunk starting at ``start`` reads: its window, cut at the floor.

    >>> window_read_start(AttentionRule("sliding_attention", window=5), 18, PrefillPlan(24, 16))
    16
    """
    return max(rule.first_key(start), plan.window_floor_tokens)


def chunk_span(rule: AttentionRule, start: int, end: int, plan: PrefillPlan) -> ChunkSpan:
    """Keys read and K/V written by queries ``[start, end)`` of a layer under ``plan``."""
    if rule.kind == "full_attention":
        return ChunkSpan(rule.first_key(start), full_attention_write_start(start, end, plan),
                         end)
    if rule.kind == "sliding_attention":
        return ChunkSpan(window_read_start(rule, start, plan), start, end)
    return ChunkSpan(rule.first_key(start), start, end)


def check_span(span: ChunkSpan, rule: AttentionRule, plan: PrefillPlan, *, req_id: str,
               group_id: int) -> None:
    """Refuse a span that would overwrite cached full-attention KV (shared blocks).

    Raises:
        InvariantViolation: a full-attention chunk writes a position below ``F``.
    """
    cached = plan.full_attention_cached_tokens
    if rule.kind == "full_attention" and span.write_start < min(cached, span.end):
        raise InvariantViolation(
            f"request {req_id!r}, group {group_id}: a full-attention chunk would write K/V "
            f"at position {span.write_start} below the cached {cached} (shared cached "
            f"blocks of a window-recompute bridge)")
