"""The hook between the core and the optional KV-events package (``hybridkv.events``).

While events are on, the pool appends one raw record per hash-index change to
``BlockPool.event_records`` (``(0, group, hash)`` cached, ``(1, group, hash)`` a cached
copy lost its hash). The façade hands them, with the request that caused them, to an
``EventRecorder`` (``hybridkv.events.log.EventLog`` is the implementation), which turns them
into vLLM-format events. The core knows only this interface: it imports the events package
(and msgspec) once, when a manager turns events on (``KVCacheManager.start_kv_cache_events``).

>>> from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager
>>> manager = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 8), "dense",
...                          enable_kv_cache_events=True)
>>> manager.add_request("a", list(range(9)))
>>> _ = manager.allocate_slots("a", 9)  # blocks [0, 4) and [4, 8) get their hashes
>>> [type(event).__name__ for event in manager.take_events()]
['BlockStored']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hybridkv.hashing import ExtraKeys
from hybridkv.ids import BlockHash

if TYPE_CHECKING:
    from hybridkv.events.schema import KVEvent as KVEvent  # noqa: PLC0414 (re-exported)


@dataclass(slots=True)
class RequestContext:
    """What a stored block's event needs from the request that cached it."""

    req_id: str
    block_hashes: Sequence[BlockHash]
    token_ids: Sequence[int]
    extra_keys: ExtraKeys | None
    session_id: str | None


class EventRecorder(Protocol):
    """What the façade calls while KV events are on."""

    records: list[tuple[int, int, BlockHash]]
    """The pool's raw records (the same list object as ``BlockPool.event_records``)."""

    def flush(self, request: RequestContext | None) -> None:
        """Resolve the pending records, in order (stores need ``request``)."""

    def take_events(self) -> list[KVEvent]:
        """The events resolved since the last call."""

    def forget(self, req_id: str) -> None:
        """The request left."""

    def truncate(self, req_id: str, num_hashes: int) -> None:
        """The request's hashes from ``num_hashes`` on were dropped (``truncate_tokens``);
        the ones that replace them differ."""

    def clear(self) -> None:
        """``reset_prefix_cache`` dropped every hash: one ``AllBlocksCleared``."""
