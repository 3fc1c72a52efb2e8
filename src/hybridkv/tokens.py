"""RequestTokens: a request's token ids without copying a prompt the caller already hashed.

A trace replayer hands the manager prompts of ~100 k tokens, together with their block hashes
(computed once per shared prefix). The manager then needs the prompt's ids only past its last
hashed block — to hash the blocks that decoding completes — so it keeps the prompt by
reference and copies just that tail. Materialising every prompt as a Python list instead
costs ~30 ns per token to build and free (WEKA: 730 M tokens per replayed policy).

>>> tokens = RequestTokens(range(100, 110), hashed_tokens=8)
>>> tokens.extend([1, 2]); len(tokens), tokens[7:], tokens[-1]
(12, [107, 108, 109, 1, 2], 2)
>>> tokens.truncate(9); tokens[6:]
[106, 107, 108]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import overload


class RequestTokens(Sequence[int]):
    """``prompt`` (by reference, never modified) followed by appended ids.

    Invariants: ``len(self) == len(prompt) + number of appended ids``; ``tail`` holds
    ``prompt[hashed_tokens:]`` followed by the appended ids, so any read at or past
    ``hashed_tokens`` never touches ``prompt``. ``num_tokens`` is ``len(self)`` as a plain
    attribute (the manager reads it on every scheduler step).
    """

    __slots__ = ("_prompt", "_start", "_tail", "num_tokens")

    def __init__(self, prompt: Sequence[int], hashed_tokens: int) -> None:
        self._prompt = prompt
        self.num_tokens = len(prompt)
        self._start = min(max(hashed_tokens, 0), self.num_tokens)
        self._tail = list(prompt[self._start :])

    def extend(self, token_ids: Iterable[int]) -> None:
        self._tail.extend(token_ids)
        self.num_tokens = self._start + len(self._tail)

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` ids (``0 <= num_tokens <= len(self)``); the
        caller's prompt is never modified (a cut inside it keeps a copy of its head)."""
        if num_tokens >= self._start:
            del self._tail[num_tokens - self._start :]
        else:
            self._prompt = list(self._prompt[:num_tokens])
            self._start = num_tokens
            self._tail = []
        self.num_tokens = num_tokens

    def __len__(self) -> int:
        return self.num_tokens

    @overload
    def __getitem__(self, idx: int) -> int: ...
    @overload
    def __getitem__(self, idx: slice) -> list[int]: ...
    def __getitem__(self, idx: int | slice) -> int | list[int]:
        start_of_tail = self._start
        if isinstance(idx, slice):
            first, stop, step = idx.indices(len(self))
            if step != 1:
                return list(self)[idx]
            if first >= start_of_tail:
                return self._tail[first - start_of_tail : max(stop - start_of_tail, 0)]
            ids = list(self._prompt[first : min(stop, start_of_tail)])
            if stop > start_of_tail:
                ids.extend(self._tail[: stop - start_of_tail])
            return ids
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self._tail[idx - start_of_tail] if idx >= start_of_tail else self._prompt[idx]

    def __iter__(self) -> Iterator[int]:
        return chain(self._prompt[: self._start], self._tail)
