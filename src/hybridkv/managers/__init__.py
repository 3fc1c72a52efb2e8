"""Per-group managers and the spec → manager map."""

from __future__ import annotations

from hybridkv.managers.base import GroupManager, coarse_hashes
from hybridkv.managers.chunked import ChunkedLocalManager
from hybridkv.managers.full import FullAttentionManager
from hybridkv.managers.recurrent import RecurrentStateManager
from hybridkv.managers.window import SlidingWindowManager
from hybridkv.specs import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    LayerSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)

MANAGER_FOR_SPEC: dict[type[LayerSpec], type[GroupManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalSpec: ChunkedLocalManager,
    RecurrentStateSpec: RecurrentStateManager,
}

__all__ = [
    "MANAGER_FOR_SPEC",
    "ChunkedLocalManager",
    "FullAttentionManager",
    "GroupManager",
    "RecurrentStateManager",
    "SlidingWindowManager",
    "coarse_hashes",
]
