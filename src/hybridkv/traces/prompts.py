"""The tokens of trace requests as the manager sees them: ``LazyPrompt`` (prompt ids
expanded on first use) and ``PromptHasher`` (memoised block hashes of block-id traces).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import overload

from hybridkv.hashing import BlockHasher
from hybridkv.ids import BlockHash
from hybridkv.traces.trace import TraceRequest, common_prefix_length, expand_prompt, prompt_slice


class LazyPrompt(Sequence[int]):
    """Prompt ids expanded on first use and dropped by the manager when the request ends."""

    __slots__ = ("_index", "_request")

    def __init__(self, request: TraceRequest, index: int) -> None:
        self._request = request
        self._index = index

    def _expand(self) -> list[int]:
        return expand_prompt(self._request, self._index)

    def __len__(self) -> int:
        return self._request.input_length

    @overload
    def __getitem__(self, idx: int) -> int: ...
    @overload
    def __getitem__(self, idx: slice) -> Sequence[int]: ...
    def __getitem__(self, idx: int | slice) -> int | Sequence[int]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step == 1:
                return prompt_slice(self._request, self._index, start, stop)
            return self._expand()[idx]
        position = idx + len(self) if idx < 0 else idx
        if not 0 <= position < len(self):
            raise IndexError(idx)
        return prompt_slice(self._request, self._index, position, position + 1)[0]

    def __iter__(self) -> Iterator[int]:
        return iter(self._expand())


class PromptHasher:
    """Memoised block hashes of block-id traces.

    Requests of a conversation resend the same trace blocks again and again (WEKA: 96 % of
    730 M prompt tokens are repeats); a trace block's engine-block hashes depend only on the
    hash before it and its id, so each distinct (parent hash, trace block id) pair is hashed
    once. Tokens past the last whole trace block (the partial tail, fill) are hashed as usual.
    The result is the chain ``hasher.hash_blocks`` would compute for the expanded prompt.

    A session's next prompt usually extends its previous one: the hashes of the trace blocks
    the two share from the start are copied from the previous prompt's (one list slice),
    and only the rest walks the memo.
    """

    MAX_ENTRIES = 1 << 18
    """Memo size cap (oldest entries dropped first), so memory stays flat on long traces."""

    MAX_SESSION_HASHES = 1 << 21
    """Hashes kept across the sessions' latest prompts (least recently used sessions dropped
    first), so memory stays bounded however many sessions a trace has (WEKA's 88 sessions
    end at ~1 M)."""

    def __init__(self, hasher: BlockHasher) -> None:
        self._hasher = hasher
        self._memo: dict[tuple[BlockHash | None, int], list[BlockHash]] = {}
        self._latest: dict[str, tuple[tuple[int, ...], list[BlockHash]]] = {}
        """Session id → (whole trace block ids, their engine-block hashes) of its latest
        prompt, least recently used first."""
        self._num_session_hashes = 0
        self.seconds = 0.0

    def for_request(self, request: TraceRequest,
                    ) -> Callable[[Sequence[int]], list[BlockHash] | None] | None:
        if request.token_ids is not None or request.token_id_ranges or \
                not request.trace_block_size or request.trace_block_size % self._hasher.block_size \
                or self._hasher.lookahead_tokens:  # EAGLE lookahead: the manager hashes
            return None

        def hash_prompt(tokens: Sequence[int]) -> list[BlockHash] | None:
            started = time.perf_counter()
            try:
                return self.hashes(request, tokens)
            finally:
                self.seconds += time.perf_counter() - started

        return hash_prompt

    def hashes(self, request: TraceRequest, tokens: Sequence[int]) -> list[BlockHash] | None:
        size, hb = request.trace_block_size, self._hasher.block_size
        if request.token_ids is not None or request.token_id_ranges or not size or size % hb:
            return None
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        num_whole = min(len(request.block_ids), request.input_length // size)
        whole_ids = request.block_ids[:num_whole]
        session = request.session_id
        first = 0
        latest = None if session is None else self._latest.pop(session, None)
        if latest is not None:
            self._num_session_hashes -= len(latest[1])
            first = common_prefix_length(latest[0], whole_ids)
            if first:
                hashes = latest[1][: first * (size // hb)]
                parent = hashes[-1]
        for i in range(first, num_whole):
            key = (parent, request.block_ids[i])
            chunk = self._memo.get(key)
            if chunk is None:  # a whole trace block's ids are a range (see expand_prompt)
                first = request.block_ids[i] * size
                chunk = self._hasher.hash_blocks(range(first, first + size),
                                                 parent=parent, first_block_idx=i * size // hb)
                if len(self._memo) >= self.MAX_ENTRIES:
                    del self._memo[next(iter(self._memo))]
                self._memo[key] = chunk
            hashes.extend(chunk)
            parent = chunk[-1]
        if session is not None:
            self._latest[session] = (whole_ids, hashes.copy())
            self._num_session_hashes += len(hashes)
            while self._num_session_hashes > self.MAX_SESSION_HASHES:
                oldest = next(iter(self._latest))
                self._num_session_hashes -= len(self._latest.pop(oldest)[1])
        done = num_whole * size
        hashes.extend(self._hasher.hash_blocks(tokens[done:], parent=parent,
                                               first_block_idx=done // hb))
        return hashes


__all__ = ["LazyPrompt", "PromptHasher"]
