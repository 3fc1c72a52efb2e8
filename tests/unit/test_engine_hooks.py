"""Core API for engines that plan ahead (vLLM): in-flight tokens, settle / roll back,
tail truncation, engine-computed hashes, no-op free of a never-admitted request, and the
read-only per-group table view."""

from __future__ import annotations

import pytest

from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridkv.errors import ConfigError, DoubleFreeError, RequestError
from hybridkv.ids import BlockHash


def full_manager(num_blocks: int = 32, policy: str = "latest") -> KVCacheManager:
    return KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], num_blocks),
                          policy)


def test_in_flight_tokens_run_past_the_known_ones_and_settle_later() -> None:
    m = full_manager()
    m.add_request("a", list(range(8)))
    assert m.allocate_slots("a", 8) is not None
    with pytest.raises(ConfigError):  # without in_flight: only known tokens
        m.allocate_slots("a", 1)
    allocation = m.allocate_slots("a", 1, in_flight=True)  # token 8: id not sampled yet
    assert allocation is not None and allocation.new_block_ids == ((3,),)
    assert m.num_computed_tokens("a") == 9 and m.num_tokens("a") == 8
    m.append_token_ids("a", [108, 109, 110, 111])  # fills block [8, 12)
    assert m.group_tables(0).num_cached_blocks("a") == 2  # not yet: the step is unsettled
    m.settle("a", 9)
    assert m.group_tables(0).num_cached_blocks("a") == 2  # only token 8 is settled
    assert m.allocate_slots("a", 3, in_flight=True) is not None
    m.settle("a", 12)
    assert m.group_tables(0).num_cached_blocks("a") == 3
    m.check_invariants()


def test_settle_rolls_rejected_drafts_back_and_refuses_advancing() -> None:
    m = full_manager()
    m.add_request("a", list(range(6)))
    assert m.allocate_slots("a", 5) is not None
    assert m.allocate_slots("a", 4, in_flight=True) is not None  # 1 token + 3 drafts
    assert m.num_computed_tokens("a") == 9
    m.append_token_ids("a", [7, 8])  # one draft accepted, plus the bonus token
    m.settle("a", 7)
    assert m.num_computed_tokens("a") == 7
    assert len(m.get_block_ids("a")[0]) == 3  # the rolled-back slots stay allocated
    with pytest.raises(ConfigError):
        m.settle("a", 8)  # settle never advances
    with pytest.raises(ConfigError):
        m.settle("a", 7, 8)  # more in flight than computed
    m.check_invariants()


def test_window_blocks_stay_held_while_their_step_is_in_flight() -> None:
    window = SlidingWindowSpec(2, 1, sliding_window=2)
    m = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(2, 1), window], 64),
                       "latest")
    m.add_request("a", list(range(10)))
    assert m.allocate_slots("a", 10, in_flight=True) is not None
    m.append_token_ids("a", [1])
    assert m.allocate_slots("a", 1, in_flight=True) is not None
    assert 0 not in m.get_block_ids("a")[1][:3]  # the prefill step is still in flight
    m.settle("a", 11, 1)  # the prefill reported back; the decode step is in flight
    m.append_token_ids("a", [2])
    assert m.allocate_slots("a", 1, in_flight=True) is not None
    assert m.get_block_ids("a")[1][:4] == (0, 0, 0, 0)  # now left the window
    m.check_invariants()


def test_truncate_tokens_drops_the_tail_and_its_hashes() -> None:
    m = full_manager()
    m.add_request("a", list(range(10)))
    assert m.allocate_slots("a", 5) is not None
    m.truncate_tokens("a", 6)
    assert list(m.token_ids("a")) == list(range(6))
    with pytest.raises(ConfigError):
        m.truncate_tokens("a", 4)  # computed tokens are never dropped
    m.append_token_ids("a", [60, 61, 62])
    m.add_request("probe", [*range(6), 60, 61, 62, 63])
    assert m.allocate_slots("a", 4) is not None  # [0, 9) computed; blocks [0, 8) cached
    m.free("a")
    assert m.find_longest_hit("probe").num_tokens == 8  # block [4, 8) = 4, 5, 60, 61


def test_free_of_a_never_admitted_request_is_a_no_op() -> None:
    m = full_manager()
    m.add_request("a", list(range(8)))
    m.free("a")  # aborted while waiting
    assert m.allocate_slots("a", 8) is not None
    m.free("a")
    with pytest.raises(DoubleFreeError):
        m.free("a")  # admitted once: a second free is a caller bug


def test_external_hashes_are_the_only_hashes() -> None:
    m = full_manager()
    engine_hashes = [BlockHash(b"h0"), BlockHash(b"h1")]
    m.add_request("a", list(range(9)), block_hashes=engine_hashes[:1], external_hashes=True)
    with pytest.raises(RequestError):
        m.append_token_ids("a", [9])  # hybridkv never hashes this request itself
    with pytest.raises(ConfigError):  # at most one hash per full block
        m.add_request("b", list(range(5)), block_hashes=engine_hashes, external_hashes=True)
    m.append_token_ids("a", [9, 10], block_hashes=engine_hashes[1:])
    assert m.allocate_slots("a", 11) is not None
    m.remove_request("a")
    m.add_request("c", [7] * 12, block_hashes=engine_hashes, external_hashes=True)
    assert m.find_longest_hit("c").num_tokens == 8  # the engine's hashes decide the hit
    assert m.probe_prefix(list(range(12))) == 0  # hybridkv's own hashes never entered


def test_group_tables_is_a_live_read_only_view() -> None:
    m = full_manager()
    tables = m.group_tables(0)
    m.add_request("a", list(range(6)))
    assert dict(tables) == {}
    assert m.allocate_slots("a", 6) is not None
    assert dict(tables) == {"a": (1, 2)} and tables.num_cached_blocks("a") == 1
    assert not hasattr(tables, "__setitem__")
    m.remove_request("a")
    assert len(tables) == 0 and tables.num_cached_blocks("a") == 0


def test_events_after_truncation_index_the_replacing_hashes() -> None:
    m = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 32), "latest",
                       enable_kv_cache_events=True)
    m.add_request("a", list(range(10)))
    assert m.allocate_slots("a", 5) is not None  # the log indexes both hashes of [0, 8)
    m.take_events()
    m.truncate_tokens("a", 6)  # block [4, 8)'s hash goes; 60, 61 replace 6, 7
    m.append_token_ids("a", [60, 61, 62])
    assert m.allocate_slots("a", 4) is not None  # caches the new [4, 8)
    stored = [e for e in m.take_events() if type(e).__name__ == "BlockStored"]
    assert [list(e.token_ids) for e in stored] == [[4, 5, 60, 61]]
    m.check_invariants()


def test_settled_tokens_never_roll_back() -> None:
    """A window block leaves the table once the settled tokens pass it: a settle below
    them would have the next step recompute tokens whose window KV is gone (a null block
    where the table needs KV), so it is refused and changes nothing."""
    window = SlidingWindowSpec(4, 1, sliding_window=4)
    m = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1), window], 32),
                       "latest")
    m.add_request("a", list(range(20)))
    assert m.allocate_slots("a", 20) is not None  # settled: window blocks [0, 16) leave
    m.append_token_ids("a", [5])
    assert m.allocate_slots("a", 1, in_flight=True) is not None
    tables = m.get_block_ids("a")
    assert tables[1][:4] == (0, 0, 0, 0)
    with pytest.raises(ConfigError):
        m.settle("a", 10)  # token 10 would read window blocks 1 and 2: released
    with pytest.raises(ConfigError):
        m.settle("a", 21, 2)  # 19 settled: below the 20 reported before
    assert m.num_computed_tokens("a") == 21 and m.get_block_ids("a") == tables
    m.settle("a", 20)  # the in-flight token rolls back: allowed
    m.check_invariants()


def test_truncation_keeps_the_tokens_of_cached_blocks_after_a_rollback() -> None:
    """Known tokens allocated in flight are cached at once; a settle rolling them back
    leaves the cached block ending past the computed tokens. Truncating into it would keep
    the block hashed as [0, 12) while the next step writes other tokens' KV into it, and a
    later request sending [0, 12) would hit that KV: refused."""
    m = full_manager()
    m.add_request("a", list(range(12)))
    assert m.allocate_slots("a", 8) is not None
    assert m.allocate_slots("a", 4, in_flight=True) is not None  # caches [8, 12)
    m.settle("a", 9)  # the in-flight tokens [9, 12) roll back
    assert m.group_tables(0).num_cached_blocks("a") == 3
    with pytest.raises(ConfigError):
        m.truncate_tokens("a", 10)
    m.truncate_tokens("a", 12)  # the cached block's tokens stay: allowed
    m.append_token_ids("a", [70, 71])
    assert m.allocate_slots("a", 5) is not None
    m.add_request("b", [*range(12), 5])
    assert m.find_longest_hit("b").num_tokens == 12  # the block holds [0, 12) indeed
    m.check_invariants()


def test_truncation_drops_an_engine_hash_whose_lookahead_token_went() -> None:
    """Under lookahead hashes an engine's hash of block [4, 8) covers token 8 too (vLLM's
    hasher): truncating token 8 away drops that hash, so the engine's hash over the new
    token 8 replaces it (it was refused as one hash too many, and the block would have
    been cached under the old token's hash)."""
    m = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 32,
                                               use_eagle=True), "latest")
    engine = m.hasher  # lookahead 1, as the engine's own hasher
    old = list(range(9))
    m.add_request("a", old, block_hashes=engine.hash_blocks(old), external_hashes=True)
    assert m.allocate_slots("a", 7) is not None
    m.truncate_tokens("a", 8)
    new = [*range(8), 80]
    m.append_token_ids("a", [80], block_hashes=engine.hash_blocks(new)[1:])
    assert m.allocate_slots("a", 2) is not None  # [0, 9) computed: block [4, 8) cached
    m.free("a")
    for tokens, hit in (([*new, 1], 8), ([*old, 1], 4)):
        m.add_request(str(tokens), tokens, block_hashes=engine.hash_blocks(tokens),
                      external_hashes=True)
        assert m.find_longest_hit(str(tokens)).num_tokens == hit
    m.check_invariants()


def test_an_engine_hash_arriving_after_its_block_was_computed_caches_it() -> None:
    """Block [0, 4) is computed before the engine's hash of it arrives: the next step
    caches it (it waited for the next block boundary the computed tokens crossed, so a
    request finishing first never cached it)."""
    m = full_manager()
    m.add_request("a", [1, 2, 3, 4], block_hashes=[], external_hashes=True)
    assert m.allocate_slots("a", 4) is not None
    m.append_token_ids("a", [5], block_hashes=[BlockHash(b"h0")])
    assert m.allocate_slots("a", 1) is not None
    assert m.group_tables(0).num_cached_blocks("a") == 1
    m.remove_request("a")
    m.add_request("b", [1, 2, 3, 4, 6], block_hashes=[BlockHash(b"h0")],
                  external_hashes=True)
    assert m.find_longest_hit("b").num_tokens == 4
