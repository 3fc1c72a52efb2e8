"""Identifier types shared by every module."""

from __future__ import annotations

from typing import Final, NewType

BlockId = NewType("BlockId", int)
"""Index of a physical block in the pool, ``0 <= block_id < num_blocks``."""

GroupId = NewType("GroupId", int)
"""Index of a cache group (a set of layers sharing one block table)."""

BlockHash = NewType("BlockHash", bytes)
"""Chained hash of a token prefix ending at a block boundary."""

ReqId = str
"""Request identifier chosen by the caller."""

NULL_BLOCK_ID: Final = BlockId(0)
"""Block 0 is reserved: it fills table positions whose KV is no longer needed."""
