"""Trace schema and the protocol's token expansion (replay-protocol.md, "Requests")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv import ConfigError
from hybridkv.traces.trace import (
    FILL_TOKEN_BASE,
    FILL_TOKENS_PER_REQUEST,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_INDEX,
    OUTPUT_TOKEN_BASE,
    TOKEN_ID_LIMIT,
    Trace,
    TraceRequest,
    expand_prompt,
)


def fill(request_index: int, position: int) -> int:
    return FILL_TOKEN_BASE + request_index * FILL_TOKENS_PER_REQUEST + position


def test_id_space_layout() -> None:
    assert OUTPUT_TOKEN_BASE == 1 << 61
    assert FILL_TOKEN_BASE == 1 << 50
    # the last fill id of the last allowed request index stays below the output ids
    assert fill(MAX_REQUEST_INDEX - 1, MAX_PROMPT_TOKENS - 1) < OUTPUT_TOKEN_BASE
    assert fill(MAX_REQUEST_INDEX, 0) >= OUTPUT_TOKEN_BASE
    assert OUTPUT_TOKEN_BASE < TOKEN_ID_LIMIT == 1 << 62


def test_blocks_expand_in_order_then_fill_with_request_unique_ids() -> None:
    # blocks 3 and 5 of 4 tokens: |12 13 14 15|20 21 22 23| fill fill
    request = TraceRequest("r", input_length=10, output_length=1, block_ids=(3, 5),
                           trace_block_size=4)
    assert expand_prompt(request, 7) == [12, 13, 14, 15, 20, 21, 22, 23, fill(7, 8), fill(7, 9)]


def test_expansion_is_cut_to_input_length() -> None:
    request = TraceRequest("r", input_length=6, output_length=1, block_ids=(3, 5, 9),
                           trace_block_size=4)
    assert expand_prompt(request, 0) == [12, 13, 14, 15, 20, 21]


def test_request_without_ids_is_all_fill() -> None:
    request = TraceRequest("r", input_length=3, output_length=0)
    assert expand_prompt(request, 2) == [fill(2, 0), fill(2, 1), fill(2, 2)]


def test_token_ids_win_over_ranges_and_blocks() -> None:
    request = TraceRequest("r", input_length=3, output_length=1, block_ids=(3,),
                           trace_block_size=4, token_ids=(9, 8, 7),
                           token_id_ranges=((100, 110),))
    assert expand_prompt(request, 0) == [9, 8, 7]


def test_ranges_win_over_blocks_and_are_cut_and_filled() -> None:
    ranges = ((100, 103), (7, 9))
    short = TraceRequest("a", input_length=4, output_length=1, token_id_ranges=ranges,
                         block_ids=(1,), trace_block_size=64)
    long = TraceRequest("b", input_length=7, output_length=1, token_id_ranges=ranges)
    assert expand_prompt(short, 0) == [100, 101, 102, 7]
    assert expand_prompt(long, 1) == [100, 101, 102, 7, 8, fill(1, 5), fill(1, 6)]
    assert long.num_explicit_tokens == 5


def test_explicit_tokens_shorter_than_input_are_filled() -> None:
    request = TraceRequest("r", input_length=4, output_length=1, token_ids=(5, 6))
    assert expand_prompt(request, 3) == [5, 6, fill(3, 2), fill(3, 3)]


@given(
    block_ids=st.lists(st.integers(0, 2**20), max_size=6),
    block_size=st.integers(1, 8),
    input_length=st.integers(1, 64),
    request_index=st.integers(0, 1000),
)
def test_expansion_matches_the_protocol_formula(block_ids: list[int], block_size: int,
                                                input_length: int, request_index: int) -> None:
    request = TraceRequest("r", input_length, 1, tuple(block_ids), block_size)
    expected = [h * block_size + k for h in block_ids for k in range(block_size)]
    expected = expected[:input_length]
    expected += [fill(request_index, p) for p in range(len(expected), input_length)]
    prompt = expand_prompt(request, request_index)
    assert prompt == expected
    assert expand_prompt(request, request_index) == prompt  # deterministic


def test_fill_ids_of_distinct_requests_never_collide() -> None:
    a = TraceRequest("a", input_length=100, output_length=1)
    b = TraceRequest("b", input_length=100, output_length=1)
    assert not set(expand_prompt(a, 0)) & set(expand_prompt(b, 1))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_length": 0}, "input_length"),
        ({"input_length": MAX_PROMPT_TOKENS + 1}, "input_length"),
        ({"output_length": -1}, "output_length"),
        ({"block_ids": (1,)}, "trace_block_size"),
        ({"output_token_ids": (1, 2)}, "output_token_ids"),
        ({"phase": -1}, "phase"),
        ({"token_id_ranges": ((5, 5),)}, "token_id_ranges"),
        ({"request_id": ""}, "request_id"),
    ],
)
def test_invalid_requests_name_the_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"request_id": "r", "input_length": 4, "output_length": 1}
    with pytest.raises(ConfigError) as info:
        TraceRequest(**{**base, **kwargs})  # type: ignore[arg-type]
    assert info.value.field == field


def test_request_index_out_of_range() -> None:
    request = TraceRequest("r", input_length=1, output_length=1)
    with pytest.raises(ConfigError, match="request_index"):
        expand_prompt(request, MAX_REQUEST_INDEX)
    with pytest.raises(ConfigError, match="request_index"):
        expand_prompt(request, -1)


def test_trace_rejects_duplicate_ids_and_heads() -> None:
    a = TraceRequest("a", input_length=5, output_length=1)
    b = TraceRequest("b", input_length=7, output_length=1)
    with pytest.raises(ConfigError, match="unique"):
        Trace("t", (a, a))
    trace = Trace("t", (a, b))
    assert len(trace) == 2 and trace.num_input_tokens == 12
    assert trace.head(1).requests == (a,)
    assert trace.head(None) is trace
    with pytest.raises(ConfigError, match="limit"):
        trace.head(-1)
