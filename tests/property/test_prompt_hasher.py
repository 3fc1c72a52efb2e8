"""The replay's memoised prompt hasher (memo + a session's previous prompt) computes exactly
the chain a plain ``BlockHasher`` computes over the expanded prompt."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.hashing import BlockHasher
from hybridkv.traces.prompts import PromptHasher
from hybridkv.traces.trace import TraceRequest, expand_prompt

TRACE_BLOCK_SIZE = 8

request_shapes = st.lists(
    st.tuples(
        st.sampled_from(("s0", "s1", None)),           # session
        st.integers(0, 6),                              # trace blocks kept from the session's last
        st.lists(st.integers(0, 5), max_size=5),        # new trace block ids after them
        st.integers(-7, 7),                             # input length vs whole blocks
    ),
    min_size=1, max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(shapes=request_shapes, hash_block_size=st.sampled_from((2, 4, 8)),
       session_budget=st.sampled_from((0, 5, 20, 1 << 21)))
def test_memoised_hashes_equal_plain_hashes(
        shapes: list[tuple[str | None, int, list[int], int]], hash_block_size: int,
        session_budget: int) -> None:
    hasher = BlockHasher(hash_block_size)
    memoised = PromptHasher(hasher)
    memoised.MAX_SESSION_HASHES = session_budget  # small budgets drop sessions often
    latest: dict[str | None, tuple[int, ...]] = {}
    for index, (session, keep, new_ids, extra_tokens) in enumerate(shapes):
        block_ids = latest.get(session, ())[:keep] + tuple(new_ids)
        latest[session] = block_ids
        input_length = max(1, len(block_ids) * TRACE_BLOCK_SIZE + extra_tokens)
        request = TraceRequest(f"r{index}", input_length=input_length, output_length=1,
                               block_ids=block_ids, trace_block_size=TRACE_BLOCK_SIZE,
                               session_id=session)
        prompt = expand_prompt(request, index)
        assert memoised.hashes(request, prompt) == hasher.hash_blocks(prompt)
        kept = sum(len(hashes) for _, hashes in memoised._latest.values())
        assert kept == memoised._num_session_hashes <= session_budget
