"""DeepSeek-V4 group kinds: compressed attention (KV and indexer) and compressor state.

Both reuse an existing search, because vLLM 0.33 drives them through the same managers:

- ``CompressedAttentionManager`` (``CompressedAttentionSpec``, vLLM's
  ``MLAAttentionSpec(tokens_per_state=r)`` under its ``FullAttentionManager``): table index
  ``i`` covers tokens ``[i * bs, (i + 1) * bs)`` and holds the ``bs / r`` entries
  compressing them (entry ``j``: tokens ``[i * bs + j * r, i * bs + (j + 1) * r)``).
  A hit at ``p`` (a multiple of the alignment, hence of ``bs`` and ``r``) needs blocks
  ``[0, p / bs)``: every entry of the prefix, as full attention needs every token.
- ``CompressorStateManager`` (``CompressorStateSpec``, vLLM's ``SlidingWindowMLASpec`` of
  the compressor's ``state_cache``): residual rows of the last ``w`` tokens; a hit at ``p``
  needs the ``ceil((w - 1) / bs)`` blocks ending at ``p`` (C4: 2 blocks of 4 tokens,
  C128: 16 blocks of 8), released as they leave the window, like sliding window.

Retention applies to the window-like kinds (compressor state, sliding-window MLA) exactly
as to sliding window; the compressed kinds are full-attention-like: always hashed, never
released early (see ``docs/design.md``, "DeepSeek-V4 groups").
"""

from __future__ import annotations

from hybridkv.managers.full import FullAttentionManager
from hybridkv.managers.window import SlidingWindowManager


class CompressedAttentionManager(FullAttentionManager):
    """Compressed KV / indexer keys: every block of the prefix, never released early.

    Worked example (bs 256, r 4 → 64 entries a block): a 1,000-token prompt fills blocks
    0–2 (768 tokens, 192 entries) and block 3 partly; a later hit at 768 takes blocks 0–2.
    """


class CompressorStateManager(SlidingWindowManager):
    """Compressor residual state: a window of ``w`` tokens in ``bs``-token blocks.

    Worked example (C128: bs 8, w 128 → 15.9 → 16 tail blocks): a hit at 512 needs blocks
    48–63 (tokens 384–511); blocks before 48 may have been released.
    """
