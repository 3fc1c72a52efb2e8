"""Errors: hierarchy, and every misuse raises a typed error whose message names the request
or the field, the value and the fix."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hybridkv import (
    CacheConfig,
    CapacityError,
    ConfigError,
    DoubleFreeError,
    DuplicateRequestError,
    EquivalenceError,
    FullAttentionSpec,
    HybridKVError,
    InvariantViolation,
    KVCacheManager,
    RequestError,
    SlidingWindowSpec,
    StaleHitError,
    TraceFormatError,
    UnknownRequestError,
)


def make(policy: str = "prepend", num_blocks: int = 20) -> KVCacheManager:
    config = CacheConfig.from_layers([FullAttentionSpec(32, 1), SlidingWindowSpec(8, 1, 8)],
                                     num_blocks)
    return KVCacheManager(config, policy)


def test_hierarchy() -> None:
    assert issubclass(ConfigError, HybridKVError) and issubclass(ConfigError, ValueError)
    assert issubclass(TraceFormatError, ValueError)
    for cls in (UnknownRequestError, DuplicateRequestError, DoubleFreeError, StaleHitError):
        assert issubclass(cls, RequestError) and issubclass(cls, HybridKVError)
    assert issubclass(UnknownRequestError, KeyError)
    assert issubclass(InvariantViolation, AssertionError)
    assert issubclass(EquivalenceError, AssertionError)
    assert issubclass(CapacityError, HybridKVError)


ACTIONS: dict[str, Callable[[KVCacheManager], object]] = {
    "append_token_ids": lambda m: m.append_token_ids("ghost", [1]),
    "remove_request": lambda m: m.remove_request("ghost"),
    "find_longest_hit": lambda m: m.find_longest_hit("ghost"),
    "allocate_slots": lambda m: m.allocate_slots("ghost", 1),
    "free": lambda m: m.free("ghost"),
    "get_block_ids": lambda m: m.get_block_ids("ghost"),
    "num_computed_tokens": lambda m: m.num_computed_tokens("ghost"),
    "num_tokens": lambda m: m.num_tokens("ghost"),
    "is_running": lambda m: m.is_running("ghost"),
    "token_ids": lambda m: m.token_ids("ghost"),
}


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_unknown_request_id(action: str) -> None:
    manager = make()
    with pytest.raises(UnknownRequestError) as info:
        ACTIONS[action](manager)
    assert info.value.req_id == "ghost"
    # KeyError would repr() the message: ours reads as a sentence naming id, action, fix
    assert str(info.value) == (
        f"request_id='ghost' is not tracked (during {action}); call add_request() first, "
        "or check that it was not already removed")


def test_duplicate_request() -> None:
    manager = make()
    manager.add_request("a", [1, 2])
    with pytest.raises(DuplicateRequestError, match="request_id='a' is already tracked; use a "
                                                    "fresh id or remove_request"):
        manager.add_request("a", [3])
    assert list(manager.token_ids("a")) == [1, 2]


def test_double_free_and_free_before_allocation() -> None:
    manager = make()
    manager.add_request("a", list(range(40)))
    manager.free("a")  # never admitted (an engine aborting a waiting request): a no-op
    manager.allocate_slots("a", 40, manager.find_longest_hit("a"))
    manager.free("a")
    free_after_first = manager.num_free_blocks
    with pytest.raises(DoubleFreeError, match="free\\(\\) must be called once"):
        manager.free("a")
    assert manager.num_free_blocks == free_after_first
    manager.check_invariants()


def test_stale_hit() -> None:
    """A hit looked up before another request changed the pool cannot be used."""
    manager = make()
    tokens = [i // 8 for i in range(64)]
    manager.add_request("a", tokens)
    manager.allocate_slots("a", 64, manager.find_longest_hit("a"))
    manager.add_request("b", [*tokens, 1])
    hit = manager.find_longest_hit("b")
    assert hit.num_tokens == 64
    manager.free("a")  # mutates the pool (the hit blocks are now free)
    with pytest.raises(StaleHitError) as info:
        manager.allocate_slots("b", 1, hit)
    text = str(info.value)
    assert "request_id='b'" in text and f"epoch {hit.epoch}" in text
    assert "call find_longest_hit() again" in text
    assert not manager.is_running("b")
    fresh = manager.find_longest_hit("b")
    assert manager.allocate_slots("b", 1, fresh) is not None


def test_hit_of_another_request_or_while_running() -> None:
    manager = make()
    tokens = [i // 8 for i in range(64)]
    manager.add_request("a", tokens)
    manager.allocate_slots("a", 64, manager.find_longest_hit("a"))
    manager.add_request("b", [*tokens, 1])
    manager.add_request("c", [*tokens, 2])
    hit_b = manager.find_longest_hit("b")
    with pytest.raises(RequestError, match="applies only to the admission of the request"):
        manager.allocate_slots("c", 1, hit_b)
    with pytest.raises(RequestError, match="request_id='a' is running; prefix hits apply "
                                           "only at admission"):
        manager.find_longest_hit("a")
    with pytest.raises(RequestError, match="applies only to the admission"):
        manager.allocate_slots("a", 1, hit_b)


@pytest.mark.parametrize(("num_new", "computed"), [(0, 0), (-1, 0), (11, 0), (3, 8)])
def test_num_new_tokens_out_of_range(num_new: int, computed: int) -> None:
    manager = make()
    manager.add_request("a", list(range(10)))
    if computed:
        manager.allocate_slots("a", computed, manager.find_longest_hit("a"))
    with pytest.raises(ConfigError) as info:
        manager.allocate_slots("a", num_new)
    assert info.value.field == "num_new_tokens" and info.value.value == num_new
    assert f"must be in [1, {10 - computed}] (request has 10 tokens, {computed} computed)" \
        in str(info.value)


def test_empty_prompt() -> None:
    with pytest.raises(ConfigError, match="prompt_token_ids=\\[\\] is invalid: a request "
                                          "needs at least one token"):
        make().add_request("a", [])


@pytest.mark.parametrize("interval", [33, -32, 16])
def test_interval_not_a_multiple_of_the_lcm(interval: int) -> None:
    """§6.1 item 43 analogue: interval:33 with lcm 32 is rejected at construction; the
    message names both numbers and a valid value."""
    with pytest.raises(ConfigError) as info:
        make(f"interval:{interval}")
    text = str(info.value)
    assert text.startswith(f"interval={interval} is invalid: ")
    assert "multiple of the hit alignment 32 tokens" in text
    assert "e.g. 32" in text
    make("interval:64")  # a multiple is fine


def test_unknown_policy_name() -> None:
    with pytest.raises(ConfigError, match="policy='lru' is invalid: choose one of dense"):
        make("lru")


def test_capacity_error_when_the_pool_is_overdrawn() -> None:
    manager = make(num_blocks=3)
    with pytest.raises(CapacityError, match="use allocate_slots, which returns None"):
        manager.pool.allocate(3)


def test_invariant_violation_names_the_block() -> None:
    manager = make()
    manager.add_request("a", list(range(40)))
    manager.allocate_slots("a", 40, manager.find_longest_hit("a"))
    manager.pool.blocks[1].ref_count += 1
    with pytest.raises(InvariantViolation, match=r"Block\(1, ref=2.*ref_count 2 but 1 holders"):
        manager.check_invariants()


def test_invariant_violation_for_tables_of_requests_that_are_not_running() -> None:
    manager = make()
    manager.add_request("a", list(range(40)))
    manager.allocate_slots("a", 40, manager.find_longest_hit("a"))
    manager._requests["a"].is_running = False
    with pytest.raises(InvariantViolation, match="holds a table for 'a', which is not running"):
        manager.check_invariants()


def test_other_error_messages() -> None:
    err = TraceFormatError("t.jsonl", 3, "input_length", "must be an integer")
    assert str(err) == "t.jsonl:3: field 'input_length': must be an integer"
    assert str(TraceFormatError("t.jsonl", None, "x", "bad")) == "t.jsonl: field 'x': bad"
    eq = EquivalenceError("latest", "r1", 17, "token 5 != 6")
    assert str(eq) == "policy='latest' request='r1' diverged at position 17: token 5 != 6"
    assert (eq.policy, eq.req_id, eq.position) == ("latest", "r1", 17)
