"""Hash laws: equal prefixes give equal hash lists; changing token i changes exactly the hashes
of blocks ⌊i/B⌋ onwards; hashing in pieces equals hashing at once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.hashing import BlockHasher, ExtraKeys, MultiModalFeature

block_sizes = st.sampled_from((1, 2, 3, 4, 8, 16))
algos = st.sampled_from(("sha256", "xxhash"))
tokens = st.lists(st.integers(0, 2**63 - 1) | st.integers(0, 3), max_size=80)


@st.composite
def extra_keys(draw: st.DrawFn) -> ExtraKeys | None:
    if draw(st.booleans()):
        return None
    features = tuple(
        MultiModalFeature(draw(st.sampled_from(("a", "b"))), draw(st.integers(0, 60)),
                          draw(st.integers(1, 20)))
        for _ in range(draw(st.integers(0, 2)))
    )
    return ExtraKeys(lora_name=draw(st.none() | st.just("lora")),
                     cache_salt=draw(st.none() | st.just("salt")), mm_features=features)


@given(bs=block_sizes, algo=algos, a=tokens, b=tokens, keys=extra_keys())
def test_equal_prefixes_give_equal_hash_lists(bs: int, algo: str, a: list[int], b: list[int],
                                              keys: ExtraKeys | None) -> None:
    hasher = BlockHasher(bs, algo)  # type: ignore[arg-type]
    ha = hasher.hash_blocks(a, extra_keys=keys)
    hb = hasher.hash_blocks(b, extra_keys=keys)
    assert len(ha) == len(a) // bs
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        shared += 1
    num_equal = shared // bs
    assert ha[:num_equal] == hb[:num_equal]
    # blocks past the first difference differ (chained), unless a SHA/XXH collision
    assert all(x != y for x, y in zip(ha[num_equal:], hb[num_equal:], strict=False))


@given(bs=block_sizes, algo=algos, base=tokens.filter(bool), data=st.data())
def test_changing_token_i_changes_hashes_from_its_block_on(bs: int, algo: str,
                                                          base: list[int],
                                                          data: st.DataObject) -> None:
    hasher = BlockHasher(bs, algo)  # type: ignore[arg-type]
    i = data.draw(st.integers(0, len(base) - 1))
    changed = list(base)
    changed[i] = base[i] + 1 if base[i] < 2**63 - 1 else 0
    before, after = hasher.hash_blocks(base), hasher.hash_blocks(changed)
    first = i // bs
    assert before[:first] == after[:first]
    assert all(x != y for x, y in zip(before[first:], after[first:], strict=True))


@given(bs=block_sizes, algo=algos, toks=tokens, keys=extra_keys(), data=st.data())
def test_incremental_hashing_equals_hashing_at_once(bs: int, algo: str, toks: list[int],
                                                    keys: ExtraKeys | None,
                                                    data: st.DataObject) -> None:
    """What ``append_token_ids`` relies on: continuing a chain from block k with the same
    extra keys reproduces the one-shot hashes."""
    hasher = BlockHasher(bs, algo)  # type: ignore[arg-type]
    whole = hasher.hash_blocks(toks, extra_keys=keys)
    k = data.draw(st.integers(0, len(whole)))
    parent = whole[k - 1] if k else None
    rest = hasher.hash_blocks(toks[k * bs :], parent=parent, first_block_idx=k, extra_keys=keys)
    assert whole[:k] + rest == whole
