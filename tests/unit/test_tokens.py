"""RequestTokens behaves like the list it replaces; LazyPrompt/prompt_slice like expand_prompt."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.tokens import RequestTokens
from hybridkv.traces.prompts import LazyPrompt
from hybridkv.traces.trace import TraceRequest, expand_prompt, prompt_slice


@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=30),
       hashed=st.integers(-2, 40), appended=st.lists(st.integers(0, 99), max_size=10),
       bounds=st.tuples(st.integers(-45, 45), st.integers(-45, 45), st.sampled_from((1, 2))))
def test_request_tokens_reads_like_a_list(prompt: list[int], hashed: int, appended: list[int],
                                          bounds: tuple[int, int, int]) -> None:
    tokens = RequestTokens(tuple(prompt), hashed)
    tokens.extend(appended)
    expected = prompt + appended
    assert len(tokens) == len(expected) and list(tokens) == expected
    start, stop, step = bounds
    assert tokens[start:stop:step] == expected[start:stop:step]
    for i in (start, stop):
        if -len(expected) <= i < len(expected):
            assert tokens[i] == expected[i]


def test_request_tokens_does_not_read_the_prompt_past_the_hashed_part() -> None:
    class Guarded(list[int]):
        def __getitem__(self, idx):  # type: ignore[no-untyped-def,override]
            if isinstance(idx, int) or (idx.start or 0) < 4:
                raise AssertionError(f"prompt read at {idx}")
            return super().__getitem__(idx)

    tokens = RequestTokens(Guarded(range(10)), hashed_tokens=8)
    tokens.extend([77])
    assert tokens[8:] == [8, 9, 77] and tokens[-1] == 77 and len(tokens) == 11


@given(ids=st.lists(st.integers(0, 50), max_size=6), size=st.sampled_from((1, 3, 4)),
       extra=st.integers(-5, 9), index=st.integers(0, 3),
       start=st.integers(0, 40), length=st.integers(0, 40))
def test_prompt_slice_equals_expanded_slice(ids: list[int], size: int, extra: int, index: int,
                                            start: int, length: int) -> None:
    num_tokens = max(1, len(ids) * size + extra)
    request = TraceRequest("r", num_tokens, 1, block_ids=tuple(ids), trace_block_size=size)
    full = expand_prompt(request, index)
    assert prompt_slice(request, index, start, start + length) == full[start : start + length]
    lazy = LazyPrompt(request, index)
    assert list(lazy[start : start + length]) == full[start : start + length]
    assert lazy[-1] == full[-1] and lazy[0] == full[0]
