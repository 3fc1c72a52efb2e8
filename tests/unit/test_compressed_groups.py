"""DeepSeek-V4 kinds: compressed attention, indexer, compressor state, ring buffer specs;
block-outermost packing; the V4 presets; hits across the V4 group kinds."""

from __future__ import annotations

import pytest

from hybridkv import CacheConfig, KVCacheManager
from hybridkv.errors import ConfigError
from hybridkv.managers import MANAGER_FOR_SPEC, CompressedAttentionManager, CompressorStateManager
from hybridkv.models.shapes import load_model, num_blocks_for_memory, parse_model
from hybridkv.packing import approximate_gcd, plan_packed_groups
from hybridkv.specs import (
    CompressedAttentionSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    RingBufferSpec,
    SlidingWindowMLASpec,
)


def test_v4_page_bytes_match_vllm_0_33() -> None:
    # vLLM 0.33 page_size_bytes of the real DeepSeek-V4 specs (fp8_ds_mla, FP8 indexer)
    c4 = CompressedAttentionSpec(256, tokens_per_state=4, entry_bytes=584,
                                 page_alignment_bytes=576)
    c128 = CompressedAttentionSpec(256, tokens_per_state=128, entry_bytes=584,
                                   page_alignment_bytes=576)
    idx = CompressedAttentionSpec(256, tokens_per_state=4, entry_bytes=132,
                                  page_alignment_bytes=576, role="indexer")
    swa = SlidingWindowMLASpec(64, 584, 128, page_alignment_bytes=576)
    assert [s.page_bytes for s in (c4, c128, idx, swa)] == [37440, 1728, 8640, 37440]
    assert CompressorStateSpec(4, 8192, 8, page_alignment_bytes=576).page_bytes == 32832
    assert CompressorStateSpec(8, 4096, 128, page_alignment_bytes=576).page_bytes == 32832
    assert CompressorStateSpec(4, 2048, 8, page_alignment_bytes=576).page_bytes == 8640
    assert c4 not in (idx, c128)  # distinct specs, but one packing bucket


def test_spec_validation() -> None:
    with pytest.raises(ConfigError, match="tokens_per_state"):
        CompressedAttentionSpec(250, tokens_per_state=4, entry_bytes=1)
    with pytest.raises(ConfigError, match="role"):
        CompressedAttentionSpec(8, tokens_per_state=4, entry_bytes=1, role="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="page_alignment_bytes"):
        CompressorStateSpec(4, 1, 8, page_alignment_bytes=0)
    with pytest.raises(ConfigError, match="kv_bytes_per_token"):
        RingBufferSpec(8, 0)


def test_managers_registered() -> None:
    assert MANAGER_FOR_SPEC[CompressedAttentionSpec] is CompressedAttentionManager
    assert MANAGER_FOR_SPEC[CompressorStateSpec] is CompressorStateManager


def test_approximate_gcd_prefers_least_padding_then_larger() -> None:
    assert approximate_gcd([44, 21, 20], lower_bound=21) == 22
    assert approximate_gcd([45, 21, 20], lower_bound=21) == 23
    assert approximate_gcd([10, 10], lower_bound=3) == 10   # 5 and 10 pad 0: larger wins
    assert approximate_gcd([4], lower_bound=9) == 9


def test_deepseek_v4_flash_groups_as_vllm_plans_them() -> None:
    shape = load_model("deepseek-v4-flash")
    config = shape.cache_config(num_blocks=10)
    summary = [(g.spec.kind, g.spec.block_size, len(g.layer_ids)) for g in config.groups]
    assert summary == [("sliding_window_mla", 64, 22), ("sliding_window_mla", 64, 22),
                       ("compressed_attention", 256, 62), ("compressor_state", 4, 42),
                       ("compressor_state", 8, 20)]
    assert config.alignment_tokens == 256 and config.hash_block_size == 4
    # a block: the compressed group's row = 21 * 37,440 + 21 * 8,640 + 20 * 1,728
    assert shape.bytes_per_block == 1_002_240
    assert num_blocks_for_memory(shape, "1GiB") == 2**30 // 1_002_240
    swa_a, swa_b = config.groups[0].layer_ids, config.groups[1].layer_ids
    assert not set(swa_a) & set(swa_b)  # repeats dealt round-robin, every layer once
    kinds = [s.kind for s in shape.layers]
    assert kinds.count("sliding_window_mla") == 44  # 43 layers + 1 MTP
    roles = [getattr(s, "role", None) for s in shape.layers]
    assert roles.count("indexer") == 21


def test_deepseek_v4_pro_pattern() -> None:
    shape = load_model("deepseek-v4-pro")
    ratios = [s.tokens_per_state for s in shape.layers
              if isinstance(s, CompressedAttentionSpec) and s.role == "kv"]
    assert ratios.count(128) == 31 and ratios.count(4) == 30
    assert ratios[:3] == [128, 128, 4]
    assert [s.kind for s in shape.layers].count("sliding_window_mla") == 62


def test_unbalanced_split_is_refused() -> None:
    # no balanced mixed bucket → windows are a state bucket capped at the widest group
    # (4 B): 5 one-byte and 1 three-byte pages would need 2 groups of 1:1 repeats
    comp = CompressedAttentionSpec(8, tokens_per_state=4, entry_bytes=1)
    w1, w3 = SlidingWindowMLASpec(4, 1, 8), SlidingWindowMLASpec(4, 3, 8)
    with pytest.raises(ConfigError, match="cannot be packed"):
        plan_packed_groups([comp, w1, w1, w1, w1, w1, w3])
    # comp + indexer (2 page sizes, 1 repeat) set R = approximate_gcd([1, 4], >= 1) = 1:
    # the single-page window bucket splits into 4 groups of one repeat
    idx = CompressedAttentionSpec(8, tokens_per_state=4, entry_bytes=3, role="indexer")
    groups = plan_packed_groups([comp, idx, w1, w1, w1, w1])
    assert [g.layer_ids for g in groups] == [(0, 1), (2,), (3,), (4,), (5,)]
    groups = plan_packed_groups([comp, idx, w1, w3, w1, w3])  # mixed buckets stay whole
    assert [g.layer_ids for g in groups] == [(0, 1), (2, 3, 4, 5)]
def test_model_file_kinds_and_errors() -> None:
    text = """
block_size = 8
num_layers = 2
pattern = ["l"]
[kinds.l]
caches = ["w", "kv", "st"]
[kinds.w]
kind = "sliding_window_mla"
block_size = 4
window = 8
kv_bytes_per_token = 3
[kinds.kv]
kind = "compressed_attention"
tokens_per_state = 4
entry_bytes = 5
page_alignment = 16
[kinds.st]
kind = "compressor_state"
block_size = 2
window = 4
kv_bytes_per_token = 7
"""
    shape = parse_model(text)
    assert [s.kind for s in shape.layers] == ["sliding_window_mla", "compressed_attention",
                                              "compressor_state"] * 2
    assert shape.layers[1].page_bytes == 16  # 2 entries * 5 = 10 → 16
    with pytest.raises(ConfigError, match="tokens_per_state"):
        parse_model(text.replace("tokens_per_state = 4", "tokens_per_state = 3"))
    with pytest.raises(ConfigError, match="role"):
        parse_model(text.replace("entry_bytes = 5", "entry_bytes = 5\nrole = \"q\""))
    with pytest.raises(ConfigError, match="caches"):
        parse_model(text.replace('caches = ["w", "kv", "st"]', 'caches = ["w", "nope"]'))
    with pytest.raises(ConfigError, match="window"):
        parse_model(text.replace("entry_bytes = 5", "entry_bytes = 5\nwindow = 3"))
    with pytest.raises(ConfigError, match="tokens_per_state"):
        parse_model("block_size = 4\n[[layers]]\nkind = \"full_attention\"\n"
                    "kv_bytes_per_token = 1\ntokens_per_state = 2\n")


def _v4_mini(num_blocks: int = 200) -> KVCacheManager:
    layers = [SlidingWindowMLASpec(4, 1, 8), CompressedAttentionSpec(16, tokens_per_state=4,
              entry_bytes=1), CompressorStateSpec(2, 1, 8)]
    return KVCacheManager(CacheConfig.from_layers(layers, num_blocks), "dense")


def _run(manager: KVCacheManager, req_id: str, tokens: list[int]) -> int:
    manager.add_request(req_id, tokens)
    hit = manager.find_longest_hit(req_id)
    assert manager.allocate_slots(req_id, len(tokens) - hit.num_tokens, hit) is not None
    manager.remove_request(req_id)
    return hit.num_tokens


def test_state_tail_and_compressed_prefix_decide_the_hit() -> None:
    manager = _v4_mini()
    prompt = list(range(100))
    assert _run(manager, "a", prompt) == 0
    kinds = [g.spec.kind for g in manager.config.groups]
    comp, state = kinds.index("compressed_attention"), kinds.index("compressor_state")

    def probe() -> tuple[int, list[list[object]]]:
        manager.add_request("probe", prompt)
        hit = manager.find_longest_hit("probe")
        manager.remove_request("probe")
        return hit.num_tokens, [list(t) for t in hit.blocks]

    num, tables = probe()
    assert num == 96  # 99 floored to the alignment lcm(4, 16, 2) = 16
    assert len(tables[comp]) == 6 and not any(b.is_null for b in tables[comp])
    assert len(tables[state]) == 48
    live = [i for i, b in enumerate(tables[state]) if not b.is_null]
    assert live[-4:] == [44, 45, 46, 47]  # window 8 → ceil(7 / 2) = 4 blocks: 88..95
    # the state block of tokens [90, 92) leaves: 96 misses, 80 still hits
    manager.pool._evict(manager.pool.blocks[tables[state][45].block_id])
    assert probe()[0] == 80
    # the compressed block of tokens [32, 48) leaves: no hit past 32
    manager.pool._evict(manager.pool.blocks[tables[comp][2].block_id])
    assert probe()[0] == 32
    manager.check_invariants()


def _v4_replay(num_blocks: int = 400, policy: str = "bounded-replay") -> KVCacheManager:
    layers = [SlidingWindowMLASpec(4, 1, 8), CompressedAttentionSpec(16, tokens_per_state=4,
              entry_bytes=1), CompressorStateSpec(2, 1, 8)]
    return KVCacheManager(CacheConfig.from_layers(layers, num_blocks), policy)


def test_bounded_replay_keeps_attention_windows_out_and_drops_short_hits() -> None:
    manager = _v4_replay()
    kinds = [g.spec.kind for g in manager.config.groups]
    swa, state = kinds.index("sliding_window_mla"), kinds.index("compressor_state")
    assert manager.coordinator.replay_tokens == 8
    assert manager.coordinator.replayed_group_ids == frozenset({swa})
    prompt = list(range(100))
    assert _run(manager, "a", prompt) == 0
    assert manager.pool.num_cached_blocks(swa) == 0     # the window is never hashed
    assert manager.pool.num_cached_blocks(state) > 0    # compressor state keeps `latest`
    manager.add_request("b", prompt)
    hit = manager.find_longest_hit("b")
    assert hit.num_tokens == 96 and hit.blocks[swa] == ()
    assert manager.allocate_slots("b", 100 - 96, hit) is not None
    table = manager.get_block_ids("b")[swa]
    # nulls below the window of token 96 (skipped 89 → 22 blocks), real blocks from there
    assert table[:22] == (0,) * 22 and all(table[22:])
    assert manager.stats.bridge_tokens == 8             # the replayed window
    manager.remove_request("b")
    manager.check_invariants()
    # a hit no longer than the window is dropped (alignment 16 > 8, so shrink the window)
    short = KVCacheManager(CacheConfig.from_layers(
        [SlidingWindowMLASpec(4, 1, 16), CompressedAttentionSpec(16, tokens_per_state=4,
                                                                 entry_bytes=1)], 100),
        "bounded-replay")
    assert _run(short, "a", list(range(20))) == 0
    assert _run(short, "b", list(range(20))) == 0      # 16 <= 16: replaying it all → 0
    assert _run(short, "c", list(range(40))) == 0       # 16 again
    assert _run(short, "d", list(range(40))) == 32      # 32 > 16: kept, [16, 32) replayed


def test_latest_differs_from_bounded_replay_only_in_windows() -> None:
    prompt = list(range(100))
    latest, replay = _v4_replay(policy="latest"), _v4_replay()
    for manager in (latest, replay):
        _run(manager, "a", prompt)
    kinds = [g.spec.kind for g in latest.config.groups]
    swa = kinds.index("sliding_window_mla")
    assert latest.pool.num_cached_blocks(swa) > 0 and replay.pool.num_cached_blocks(swa) == 0
    assert _run(latest, "b", prompt) == _run(replay, "b", prompt) == 96


def test_bounded_replay_needs_a_window_and_a_prefix_group() -> None:
    with pytest.raises(ConfigError, match="sliding-window attention"):
        KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 10), "bounded-replay")
    with pytest.raises(ConfigError, match="only windows"):
        KVCacheManager(CacheConfig.from_layers([SlidingWindowMLASpec(4, 1, 8)], 10),
                       "bounded-replay")


def test_deepseek_v4_1_flash_kv_sources_and_rings() -> None:
    shape = load_model("deepseek-v4.1-flash")
    config = shape.cache_config(num_blocks=10)
    summary = [(g.spec.kind, g.spec.block_size, len(g.layer_ids)) for g in config.groups]
    assert summary == [("sliding_window_mla", 32, 11)] * 3 + [
        ("sliding_window_mla", 32, 10), ("compressed_attention", 256, 8),
        ("ring_buffer", 8, 3)]
    ratios = sorted(s.tokens_per_state for s in shape.layers
                    if isinstance(s, CompressedAttentionSpec) and s.role == "kv")
    assert ratios == [1, 2, 2, 2]  # kv sources 2, 8, 14 (ratio 2) and 20 (ratio 1)
    assert config.alignment_tokens == 256 and config.hash_block_size == 32  # rings excluded


def test_ring_buffer_holds_one_block_and_never_limits_a_hit() -> None:
    layers = [CompressedAttentionSpec(8, tokens_per_state=2, entry_bytes=1),
              SlidingWindowMLASpec(4, 1, 8), RingBufferSpec(4, 1)]
    manager = KVCacheManager(CacheConfig.from_layers(layers, 60), "latest")
    ring = [g.spec.kind for g in manager.config.groups].index("ring_buffer")
    assert all(ring not in sg.group_ids for sg in manager.coordinator.spec_groups)
    prompt = list(range(50))
    manager.add_request("a", prompt)
    hit = manager.find_longest_hit("a")
    assert manager.allocate_slots("a", 16, hit) is not None
    assert len(manager.get_block_ids("a")[ring]) == 1
    assert manager.allocate_slots("a", 16) is not None     # chunked prefill: still one
    assert len(manager.get_block_ids("a")[ring]) == 1
    manager.check_invariants()
    assert manager.allocate_slots("a", 18) is not None
    manager.remove_request("a")
    assert manager.pool.num_cached_blocks(ring) == 0         # never hashed
    assert _run(manager, "b", prompt) == 48                  # the ring does not limit hits
    manager.check_invariants()
    assert manager.pool.num_free_blocks == manager.pool.num_blocks - 1
