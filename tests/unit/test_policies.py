"""Retention policies: the §3.4 mask table, boundaries/junctions (§6.1 item 65), free tiers,
parsing and validation.

Naming map to vLLM 0.33 (``prefix_cache_retention_interval`` R): R=None (dense mask) is our
``reachable``/``prepend``; R=0 is ``latest``; R=N is ``interval:N``. Our ``dense`` is the
pre-#42258 behaviour (hash everything) which vLLM no longer has.
"""

from __future__ import annotations

import pytest

from hybridkv import (
    CORE_POLICIES,
    CacheConfig,
    ConfigError,
    FullAttentionSpec,
    KVCacheManager,
    make_retention_policy,
)
from hybridkv.block import Block
from hybridkv.policies import (
    DensePolicy,
    IntervalPolicy,
    LatestPolicy,
    PinPolicy,
    PrependPolicy,
    ReachablePolicy,
    RetentionPolicy,
)
from hybridkv.pool import FreeTier


def kept(policy: RetentionPolicy, start: int, end: int, *, bs: int, align: int, need: int,
         eagle: bool = False, boundaries: tuple[int, ...] = ()) -> set[int] | None:
    """Absolute indices of the blocks the mask keeps (``None``: all of them)."""
    mask = policy.window_mask(start, end, block_size=bs, alignment_tokens=align,
                              num_tail_blocks=need + (1 if eagle else 0),
                              shift=1 if eagle else 0, boundaries=boundaries)
    if mask is None:
        return None
    assert len(mask) == end - start
    return {start + i for i, keep in enumerate(mask) if keep}


# ------------------------------------------------------------- §3.4 table rows
@pytest.mark.parametrize("name", ["reachable", "prepend"])
def test_mask_full32_swa8_w8(name: str) -> None:
    """full bs32 + SWA bs8 w8 (need 1, per 4): 3,7,11,15; with EAGLE (need 2, shift 1):
    3,4,7,8,11,12,15 (16 would be next)."""
    policy = make_retention_policy(name)
    assert kept(policy, 0, 16, bs=8, align=32, need=1) == {3, 7, 11, 15}
    assert kept(policy, 0, 16, bs=8, align=32, need=1, eagle=True) == {3, 4, 7, 8, 11, 12, 15}
    assert kept(policy, 0, 17, bs=8, align=32, need=1, eagle=True) == {
        3, 4, 7, 8, 11, 12, 15, 16}


def test_mask_need_covers_the_segment_means_cache_all() -> None:
    """full bs32 + SWA bs16 w32: need 2 ≥ per 2 → None (every block is some tail)."""
    assert kept(ReachablePolicy(), 0, 7, bs=16, align=32, need=2) is None


def test_mask_dsv4_groups() -> None:
    """DSV4 rows, A = 256: SWA bs64 w128 → i%4 ≥ 2; C4 bs4 w8 → i%64 ≥ 62 (with EAGLE also
    the block after each boundary); C128 bs8 w128 (need 16, per 32) → i%32 ≥ 16."""
    policy = ReachablePolicy()
    assert kept(policy, 0, 16, bs=64, align=256, need=2) == {i for i in range(16) if i % 4 >= 2}
    assert kept(policy, 0, 130, bs=4, align=256, need=2) == {62, 63, 126, 127}
    assert kept(policy, 0, 130, bs=4, align=256, need=2, eagle=True) == {
        62, 63, 64, 126, 127, 128}
    assert kept(policy, 0, 64, bs=8, align=256, need=16) == {
        i for i in range(64) if i % 32 >= 16}


def test_mask_gemma_like_rows() -> None:
    """SWA bs16 w1024 (need 64), A = 32, 4096-token prompt (blocks 0..255), boundary 4095."""
    boundary = (4095,)
    # R = None: per 2 ≤ need → all
    assert kept(ReachablePolicy(), 0, 256, bs=16, align=32, need=64) is None
    # R = 512: per 32 ≤ need 64 → all (sparsification silently off when R ≲ w)
    assert kept(IntervalPolicy(512), 0, 256, bs=16, align=32, need=64,
                boundaries=boundary) is None
    # R = 0: 4095 → 4064 → end block 254 → 190..253 (64 blocks)
    assert kept(LatestPolicy(), 0, 256, bs=16, align=32, need=64,
                boundaries=boundary) == set(range(190, 254))
    # R = 2048 (per 128): 64..127 and 192..255 + the replay tail 190..253 → 130 blocks
    got = kept(IntervalPolicy(2048), 0, 256, bs=16, align=32, need=64, boundaries=boundary)
    assert got == set(range(64, 128)) | set(range(190, 256))
    assert got is not None and len(got) == 130


def test_mask_alignment_not_a_multiple_of_block_size_is_dense() -> None:
    assert kept(ReachablePolicy(), 0, 8, bs=16, align=8, need=1) is None


def test_mask_uses_absolute_indices() -> None:
    """The mask over a sub-range equals the slice of the whole mask (stable across chunked
    prefill steps and requests of different lengths)."""
    for policy in (ReachablePolicy(), IntervalPolicy(64), LatestPolicy()):
        whole = kept(policy, 0, 40, bs=8, align=32, need=2, eagle=True, boundaries=(200, 97))
        assert whole is not None
        for start, end in ((0, 5), (5, 23), (23, 40), (13, 14)):
            part = kept(policy, start, end, bs=8, align=32, need=2, eagle=True,
                        boundaries=(200, 97))
            assert part == {i for i in whole if start <= i < end}


# ------------------------------------------ boundaries and junctions (§6.1 item 65)
@pytest.mark.parametrize(("name", "window", "junction", "expected"), [
    ("latest", 16, 96, {5, 14}),
    ("latest", 16, 100, {5, 14}),  # 100 floors to 96
    ("latest", 48, 96, {3, 4, 5, 12, 13, 14}),  # need 3
    ("interval:64", 16, 96, {3, 5, 7, 11, 14, 15}),
    ("latest", 16, 0, {14}),
    ("latest", 16, 512, {14}),  # out of range
])
def test_mask_boundaries_and_junction(name: str, window: int, junction: int,
                                      expected: set[int]) -> None:
    """SWA bs16, A16, 256-token prompt: replay boundary 255 plus junction j."""
    need = -(-(window - 1) // 16)
    assert kept(make_retention_policy(name), 0, 16, bs=16, align=16, need=need,
                boundaries=(255, junction)) == expected


@pytest.mark.parametrize("name", ["reachable", "prepend"])
def test_boundaries_are_ignored_without_sparse_retention(name: str) -> None:
    """R = None: dense mask; bs16 = A16 with need 1 → None (cache all), whatever the junction."""
    assert kept(make_retention_policy(name), 0, 16, bs=16, align=16, need=1,
                boundaries=(255, 96)) is None
    assert kept(make_retention_policy(name), 0, 16, bs=8, align=32, need=1,
                boundaries=(255, 96)) == {3, 7, 11, 15}


def test_dense_never_masks_and_never_clamps() -> None:
    policy = DensePolicy()
    assert kept(policy, 0, 16, bs=8, align=32, need=1, boundaries=(127,)) is None
    assert not policy.clamps_to_alignment and not policy.uses_boundaries


# ---------------------------------------------------------------- free tiers
def hashed_block(block_id: int) -> Block:
    return Block(block_id, block_hash=b"h")  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "unhashed", "hashed"), [
    ("dense", FreeTier.TAIL, FreeTier.TAIL),
    ("reachable", FreeTier.TAIL, FreeTier.TAIL),
    ("prepend", FreeTier.HEAD, FreeTier.TAIL),
    ("latest", FreeTier.HEAD, FreeTier.TAIL),
    ("interval:64", FreeTier.HEAD, FreeTier.TAIL),
    ("pin:64", FreeTier.HEAD, FreeTier.PINNED),
])
def test_free_tier(name: str, unhashed: FreeTier, hashed: FreeTier) -> None:
    policy = make_retention_policy(name)
    assert policy.free_tier(Block(1)) is unhashed
    assert policy.free_tier(hashed_block(2)) is hashed
    # window drops use the same tiers, except for pin:T
    if name != "pin:64":
        assert policy.drop_tier(Block(1), 8, 100) is unhashed
        assert policy.drop_tier(hashed_block(2), 8, 100) is hashed


def test_pin_drop_tier_pins_only_the_last_t_tokens() -> None:
    """pin:T pins a dropped hashed block when it ends within the last T skipped tokens."""
    policy = PinPolicy(16)
    assert policy.drop_tier(hashed_block(1), 100, 110) is FreeTier.PINNED  # 100 > 94
    assert policy.drop_tier(hashed_block(1), 95, 110) is FreeTier.PINNED
    assert policy.drop_tier(hashed_block(1), 94, 110) is FreeTier.TAIL
    assert policy.drop_tier(Block(1), 100, 110) is FreeTier.HEAD


# ------------------------------------------------------------ parsing, validation
def test_make_retention_policy_names_and_classes() -> None:
    expected = {"dense": DensePolicy, "reachable": ReachablePolicy, "prepend": PrependPolicy,
                "latest": LatestPolicy, "interval:64": IntervalPolicy, "pin:8": PinPolicy}
    for name, cls in expected.items():
        policy = make_retention_policy(f" {name} ")
        assert type(policy) is cls
        assert policy.name == name
        assert repr(policy) == f"<{cls.__name__} {name!r}>"
    assert make_retention_policy("interval:96").interval_tokens == 96  # type: ignore[attr-defined]
    assert make_retention_policy("pin:4096").pin_tokens == 4096  # type: ignore[attr-defined]
    assert [make_retention_policy(n).name for n in CORE_POLICIES] == list(CORE_POLICIES)


@pytest.mark.parametrize(("name", "message"), [
    ("bogus", "policy='bogus' is invalid: choose one of dense, reachable, prepend, latest, "
              "interval:N, pin:T"),
    ("interval:abc", "interval needs a token count, e.g. interval:32768"),
    ("pin:", "pin needs a token count, e.g. pin:32768"),
    ("pin:0", "pin=0 is invalid: must be a positive number of tokens"),
    ("pin:-5", "pin=-5 is invalid"),
])
def test_make_retention_policy_rejects_bad_names(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_retention_policy(name)


@pytest.mark.parametrize("interval", [33, -32, 0, 48])
def test_interval_must_be_a_positive_multiple_of_the_alignment(interval: int) -> None:
    """§3.5.4 analogue: 33 and -32 (although -32 % 32 == 0) are rejected; the message names
    the value, the alignment and a valid example."""
    policy = IntervalPolicy(interval)
    with pytest.raises(ConfigError) as info:
        policy.validate(32, True)
    text = str(info.value)
    assert text.startswith(f"interval={interval} is invalid")
    assert "multiple of the hit alignment 32 tokens" in text
    example = int(text.rsplit("e.g. ", 1)[1])
    assert example > 0 and example % 32 == 0
    IntervalPolicy(64).validate(32, True)


def test_interval_on_a_full_attention_only_model() -> None:
    """§6.1 items 44–45: vLLM accepts R=0 but rejects R>0 when no sliding-window group
    exists. We deliberately accept every policy on such a model (so one policy list can be
    swept over any model): full attention ignores retention and hashes every block. The
    alignment check still applies."""
    config = CacheConfig.from_layers([FullAttentionSpec(16, 1)], 10)
    for name in ("latest", "interval:16", "interval:64"):
        manager = KVCacheManager(config, name)
        manager.add_request("r", list(range(40)))
        manager.allocate_slots("r", 40, manager.find_longest_hit("r"))
        table = manager.coordinator.managers[0].tables["r"]
        assert [b.block_hash is not None for b in table] == [True, True, False]
    with pytest.raises(ConfigError, match="multiple of the hit alignment 16"):
        KVCacheManager(config, "interval:24")
