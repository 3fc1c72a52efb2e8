"""Compressed attention (DeepSeek-V4's CSA / HCA layers): ``r`` tokens pooled into one entry.

The compressor of a layer with ratio ``r`` (``compress_ratio``: tokens per entry) projects
each token's layer input into a KV candidate and a gate score, each ``halves`` blocks of
``[kv_heads, head_dim]`` (``halves = 2`` for overlapping C4 layers, ``r == 4``; else 1), and
adds a learned per-offset bias ``ape[p % r]`` to the score. These per-token *state rows*
``(kv, score + ape)`` are the compressor's residual state. When token ``p`` completes chunk
``j = p // r`` (``(p + 1) % r == 0``), entry ``j`` pools the rows of positions
``[(j - halves + 1) * r, (j + 1) * r)`` (those ``>= 0``)::

    row of the chunk itself        -> its last half   (channel block halves - 1)
    row of the chunk before (C4)   -> its first half  (channel block 0)
    pooled = sum_t softmax_t(score[t]) * kv[t]           (softmax over tokens, per channel)
    entry_j = rope(norm(pooled), position j * r)         (one vector: key and value)

Queries at ``p`` read the raw window ``[p - (w - 1), p]`` and the entries of completed chunks
``j < (p + 1) // r``, under one softmax. This is vLLM 0.33's V4 compressor
(``save_partial_states`` + ``compress_norm_rope_store``): state window ``halves * r`` tokens,
entries at the chunk's first position. On C4 layers the lightning indexer (its own
compressor, keys pooled the same way) narrows the entries a query reads to its top-k
(``indexer_selection``). Not modelled: the attention sink, FP8/FP4 storage.

Worked example (``r = 4``, overlapping): entry 2 pools rows 4..11 (chunk 1 through its first
half, chunk 2 through its second half) once token 11 is computed; token 10 still reads only
entries 0 and 1.

>>> rule = CompressionRule(4, window=8)
>>> rule.halves, rule.state_window, rule.rows_of_entry(2)
(2, 8, (4, 12))
>>> rule.num_entries_read(10), rule.num_entries_read(11)
(2, 3)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.errors import ConfigError

OVERLAP_RATIO = 4
"""V4 overlaps the windows of its C4 layers only (``DeepseekCompressor.overlap``)."""


@dataclass(frozen=True, slots=True)
class CompressionRule:
    """Geometry of one compressed layer: the raw window and entries a query reads, the
    state rows and entries a chunk touches.

    >>> rule = CompressionRule(16, window=8)   # non-overlapping (HCA-like)
    >>> rule.halves, rule.state_window, rule.rows_of_entry(0)
    (1, 16, (0, 16))
    >>> rule.entries_written(10, 40), rule.state_rows_read(10, 40)
    ((0, 2), (0, 32))
    """

    compress_ratio: int
    window: int

    def __post_init__(self) -> None:
        if (not isinstance(self.compress_ratio, int) or isinstance(self.compress_ratio, bool)
                or self.compress_ratio < 2):
            raise ConfigError("compress_ratio", self.compress_ratio,
                              "must be an integer >= 2 (tokens per compressed entry)")
        if not isinstance(self.window, int) or self.window < 1:
            raise ConfigError("window", self.window, "must be a positive number of tokens")

    @property
    def halves(self) -> int:
        """Channel blocks per state row: 2 when windows overlap (C4), else 1."""
        return 2 if self.compress_ratio == OVERLAP_RATIO else 1

    @property
    def state_window(self) -> int:
        """Tokens of state rows one entry pools: ``halves * r`` (V4: C4 8, C128 128)."""
        return self.halves * self.compress_ratio

    def rows_of_entry(self, entry: int) -> tuple[int, int]:
        """Half-open positions of the state rows entry ``entry`` pools (clipped at 0)."""
        r = self.compress_ratio
        return max(0, (entry - self.halves + 1) * r), (entry + 1) * r

    def num_entries_read(self, position: int) -> int:
        """Entries a query at ``position`` reads: chunks completed by then, ``(p + 1) // r``."""
        return (position + 1) // self.compress_ratio

    def entries_written(self, start: int, end: int) -> tuple[int, int]:
        """Entries completed by tokens ``[start, end)``: ``[start // r, end // r)``."""
        return start // self.compress_ratio, end // self.compress_ratio

    def state_rows_read(self, start: int, end: int) -> tuple[int, int]:
        """State rows needed to pool the entries tokens ``[start, end)`` complete (empty
        ``(end, end)`` when none completes)."""
        first, last = self.entries_written(start, end)
        if first == last:
            return end, end
        return self.rows_of_entry(first)[0], self.rows_of_entry(last - 1)[1]


def state_rows(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
               positions: torch.Tensor, rule: CompressionRule) -> torch.Tensor:
    """The compressor state rows of tokens at ``positions``.

    ``kv`` and ``score`` are ``[T, halves * KVH * D]`` projections, ``ape`` is
    ``[r, halves * KVH * D]``; the result ``[T, 2, halves * KVH * D]`` holds ``kv`` and
    ``score + ape[p % r]`` (what a state page stores per token).
    """
    offsets = torch.remainder(positions, rule.compress_ratio)
    return torch.stack((kv, score + ape.index_select(0, offsets)), dim=1)


def pool_entries(rows: torch.Tensor, rows_start: int, first: int, last: int,
                 rule: CompressionRule, *, kv_heads: int) -> torch.Tensor:
    """Pool entries ``[first, last)`` from state ``rows`` ``[N, 2, halves * KVH * D]`` of
    positions ``[rows_start, rows_start + N)``; returns ``[last - first, KVH, D]`` before
    the norm and rotary.

    Raises:
        ConfigError: the rows do not cover every position the entries pool.
    """
    r, halves = rule.compress_ratio, rule.halves
    need_start, need_end = rule.rows_of_entry(first)[0], rule.rows_of_entry(last - 1)[1]
    if need_start < rows_start or need_end > rows_start + rows.shape[0]:
        raise ConfigError("rows", (rows_start, rows_start + rows.shape[0]),
                          f"entries [{first}, {last}) pool positions [{need_start}, {need_end})")
    width = rows.shape[-1] // halves
    split = rows.reshape(rows.shape[0], 2, halves, width)
    entries = torch.arange(first, last, device=rows.device)
    taps = torch.arange(halves * r, device=rows.device)
    positions = (entries[:, None] - halves + 1) * r + taps[None, :]    # [J, halves * r]
    valid = positions >= 0
    index = (positions - rows_start).clamp(min=0)
    half = (taps // r)[None, :].expand_as(index)                       # 0: earlier chunk
    gathered = split[index, :, half]                                   # [J, halves*r, 2, W]
    kv, score = gathered[:, :, 0], gathered[:, :, 1]
    score = score.masked_fill(~valid[:, :, None], float("-inf"))
    kv = kv.masked_fill(~valid[:, :, None], 0.0)
    pooled = (torch.softmax(score, dim=1) * kv).sum(dim=1)
    return pooled.reshape(last - first, kv_heads, width // kv_heads)


def pool_sequence_reference(rows: torch.Tensor, rule: CompressionRule, *,
                            kv_heads: int) -> torch.Tensor:
    """Every entry of a whole sequence's state ``rows`` (positions ``[0, N)``), one entry
    at a time straight from the definition: the reference ``pool_entries`` must match.

    Returns ``[N // r, KVH, D]``.
    """
    r, halves = rule.compress_ratio, rule.halves
    width = rows.shape[-1] // halves
    out = []
    for entry in range(rows.shape[0] // r):
        kvs, scores = [], []
        for position in range(*rule.rows_of_entry(entry)):
            half = halves - 1 - (entry - position // r)     # this chunk: last half
            kvs.append(rows[position, 0, half * width : (half + 1) * width])
            scores.append(rows[position, 1, half * width : (half + 1) * width])
        weights = torch.softmax(torch.stack(scores), dim=0)
        out.append((weights * torch.stack(kvs)).sum(dim=0))
    if not out:
        return rows.new_zeros((0, kv_heads, width // kv_heads))
    return torch.stack(out).reshape(-1, kv_heads, width // kv_heads)


def completed_entries(q_start: int, num_queries: int, num_entries: int,
                      rule: CompressionRule, device: torch.device | str) -> torch.Tensor:
    """``[Q, E]``: may query ``q_start + i`` read entry ``j`` (``j < (p + 1) // r``)."""
    qp = torch.arange(q_start, q_start + num_queries, device=device)[:, None]
    entry_ids = torch.arange(num_entries, device=device)[None, :]
    return entry_ids < torch.div(qp + 1, rule.compress_ratio, rounding_mode="floor")


def indexer_selection(q_index: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                      allowed: torch.Tensor, *, topk: int) -> torch.Tensor:
    """The lightning indexer: the ``topk`` allowed entries a query reads.

    ``q_index`` ``[Q, IH, ID]``, ``weights`` ``[Q, IH]``, indexer ``keys`` ``[E, ID]``,
    ``allowed`` ``[Q, E]``. Score of entry ``j``: ``sum_h w_h * relu(q_h . k_j)`` (scaled by
    ``(ID * IH) ** -0.5`` as vLLM's ``fused_indexer_q_rope_quant``); the ``topk`` best
    allowed entries win, ties to the lower index (a stable sort: the choice never depends
    on how many not-yet-allowed entries a chunk gathered); all of them when at most
    ``topk`` are allowed. Returns ``[Q, E]`` booleans.

    >>> keys = torch.tensor([[1.0], [3.0], [2.0], [0.5]])
    >>> q, w = torch.ones(2, 1, 1), torch.ones(2, 1)
    >>> allowed = torch.tensor([[True, True, True, True], [True, False, False, True]])
    >>> indexer_selection(q, w, keys, allowed, topk=2).int().tolist()
    [[0, 1, 1, 0], [1, 0, 0, 1]]
    """
    scale = (q_index.shape[-1] * q_index.shape[1]) ** -0.5
    scores = (torch.einsum("qhd,ed->qhe", q_index, keys).relu()
              * (weights * scale)[:, :, None]).sum(dim=1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    chosen = torch.zeros_like(allowed).scatter(1, order, True)
    return chosen & allowed


def compressed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         entries: torch.Tensor, entry_allowed: torch.Tensor, *, q_start: int,
                         rule: CompressionRule, scale: float) -> torch.Tensor:
    """Explicit-mask attention over a raw window and compressed entries (float64 path).

    ``q`` ``[Q, H, D]`` at positions ``[q_start, q_start + Q)``; raw ``k``/``v``
    ``[K, KVH, D]`` at the ``K`` positions ending with the last query's; ``entries``
    ``[E, KVH, D]`` are entries ``0 .. E - 1`` (each both key and value), of which query
    ``i`` reads those with ``entry_allowed[i]`` (``completed_entries``, narrowed by
    ``indexer_selection`` on indexed layers). Query ``p`` reads raw keys
    ``(p - rule.window, p]``.
    """
    group = q.shape[1] // k.shape[1]
    device = q.device
    kv_start = q_start + q.shape[0] - k.shape[0]
    qp = torch.arange(q_start, q_start + q.shape[0], device=device)[:, None]
    kp = torch.arange(kv_start, kv_start + k.shape[0], device=device)[None, :]
    raw_ok = (kp <= qp) & (kp > qp - rule.window)
    keys = torch.cat((k, entries)).repeat_interleave(group, dim=1)
    values = torch.cat((v, entries)).repeat_interleave(group, dim=1)
    allowed = torch.cat((raw_ok, entry_allowed), dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)
