"""Per-group managers and the spec → manager map."""

from __future__ import annotations

from hybridkv.managers.base import GroupManager, coarse_hashes
from hybridkv.managers.chunked import ChunkedLocalManager
from hybridkv.managers.compressed import (
    CompressedAttentionManager,
    CompressorStateManager,
    RingBufferManager,
)
from hybridkv.managers.full import FullAttentionManager
from hybridkv.managers.recurrent import RecurrentStateManager
from hybridkv.managers.window import SlidingWindowManager
from hybridkv.specs import (
    ChunkedLocalSpec,
    CompressedAttentionSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    LayerSpec,
    RecurrentStateSpec,
    RingBufferSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

MANAGER_FOR_SPEC: dict[type[LayerSpec], type[GroupManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalSpec: ChunkedLocalManager,
    RecurrentStateSpec: RecurrentStateManager,
    CompressedAttentionSpec: CompressedAttentionManager,
    SlidingWindowMLASpec: SlidingWindowManager,
    CompressorStateSpec: CompressorStateManager,
    RingBufferSpec: RingBufferManager,
}

__all__ = [
    "MANAGER_FOR_SPEC",
    "ChunkedLocalManager",
    "CompressedAttentionManager",
    "CompressorStateManager",
    "FullAttentionManager",
    "GroupManager",
    "RecurrentStateManager",
    "RingBufferManager",
    "SlidingWindowManager",
    "coarse_hashes",
]
