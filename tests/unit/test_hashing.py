"""Block hashing: chain property, extra keys per block, algorithms, cross-process determinism."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridkv.errors import ConfigError
from hybridkv.hashing import BlockHasher, ExtraKeys, MultiModalFeature, encode_token_ids

TOKENS = list(range(100, 164))  # 64 tokens = 4 blocks of 16


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_chain_property(algo: str) -> None:
    """Block i hashes (hash of block i-1, tokens of block i): it stands for the whole prefix."""
    hasher = BlockHasher(16, algo)  # type: ignore[arg-type]
    hashes = hasher.hash_blocks([*TOKENS, 1, 2, 3])  # the partial tail is never hashed
    assert len(hashes) == 4
    parent = None
    for i, block_hash in enumerate(hashes):
        assert block_hash == hasher.hash_block(parent, TOKENS[16 * i : 16 * (i + 1)])
        parent = block_hash
    assert len(set(hashes)) == 4
    # continuing a chain gives the same hashes as hashing in one go
    tail = hasher.hash_blocks(TOKENS[32:], parent=hashes[1], first_block_idx=2)
    assert tail == hashes[2:]


@pytest.mark.parametrize(("algo", "digest_len"), [("sha256", 32), ("xxhash", 16)])
def test_digest_lengths(algo: str, digest_len: int) -> None:
    hasher = BlockHasher(4, algo)  # type: ignore[arg-type]
    assert len(hasher.root_hash) == digest_len
    assert {len(x) for x in hasher.hash_blocks(list(range(12)))} == {digest_len}


def test_algorithms_and_block_sizes_give_different_chains() -> None:
    sha, xx = BlockHasher(16, "sha256"), BlockHasher(16, "xxhash")
    assert sha.hash_blocks(TOKENS)[0] != xx.hash_blocks(TOKENS)[0]
    # the 32-token block is not the 16-token hash of the same prefix
    assert BlockHasher(32).hash_blocks(TOKENS)[0] != BlockHasher(16).hash_blocks(TOKENS)[1]


def test_parent_and_position_matter() -> None:
    hasher = BlockHasher(2)
    a = hasher.hash_blocks([1, 2, 3, 4])
    b = hasher.hash_blocks([3, 4, 1, 2])
    assert a[0] != b[1] and a[1] != b[0]  # same block tokens, different parents
    assert hasher.hash_blocks([1, 2, 1, 2])[0] != hasher.hash_blocks([1, 2, 1, 2])[1]


def test_extra_keys_per_block_encoding() -> None:
    """LoRA goes into every block, the salt only into the block at token 0, a multimodal item
    into every block it overlaps with its offset from the block start (the doc's example:
    image at [11, 21) with blocks of 16 → offsets 11 and -5, nothing in block 2)."""
    keys = ExtraKeys(lora_name="L", cache_salt="s1",
                     mm_features=(MultiModalFeature("aaa", 11, 10),))
    block0, block1, block2 = (keys.encode_for_block(s, s + 16) for s in (0, 16, 32))
    assert b"L" in block0 and b"L" in block1 and b"L" in block2
    assert b"s1" in block0 and b"s1" not in block1 and b"s1" not in block2
    assert b"aaa" in block0 and b"aaa" in block1 and b"aaa" not in block2
    assert (11).to_bytes(8, "little", signed=True) in block0
    assert (-5).to_bytes(8, "little", signed=True) in block1
    only_lora = ExtraKeys(lora_name="L").encode_for_block(32, 48)
    assert block2 == only_lora
    # an item ending exactly on a block boundary does not touch the next block
    edge = ExtraKeys(mm_features=(MultiModalFeature("img", 0, 16),))
    assert edge.encode_for_block(16, 32) == b""
    assert ExtraKeys().is_empty and not keys.is_empty


def chain_with_extra(hasher: BlockHasher, tokens: list[int], keys: ExtraKeys) -> list[bytes]:
    parent = None
    out: list[bytes] = []
    for i in range(len(tokens) // hasher.block_size):
        start = i * hasher.block_size
        parent = hasher.hash_block(parent, tokens[start : start + hasher.block_size],
                                   keys.encode_for_block(start, start + hasher.block_size))
        out.append(parent)
    return out


@pytest.mark.parametrize("keys", [
    ExtraKeys(lora_name="adapter"),
    ExtraKeys(cache_salt="salt"),
    ExtraKeys(mm_features=(MultiModalFeature("img", 20, 10),)),
    ExtraKeys(lora_name="a", cache_salt="b", mm_features=(MultiModalFeature("i", 40, 20),)),
])
def test_extra_keys_change_hashes_from_the_first_affected_block(keys: ExtraKeys) -> None:
    hasher = BlockHasher(16)
    plain = hasher.hash_blocks(TOKENS)
    keyed = hasher.hash_blocks(TOKENS, extra_keys=keys)
    assert keyed == chain_with_extra(hasher, TOKENS, keys)
    first_affected = min(
        i for i in range(4) if keys.encode_for_block(16 * i, 16 * (i + 1))
    )
    assert keyed[:first_affected] == plain[:first_affected]
    assert all(k != p for k, p in zip(keyed[first_affected:], plain[first_affected:],
                                       strict=True))
    # continuing a keyed chain uses absolute positions for the offsets
    assert hasher.hash_blocks(TOKENS[32:], parent=keyed[1], first_block_idx=2,
                              extra_keys=keys) == keyed[2:]


def test_multimodal_identifier_changes_only_the_blocks_from_the_image_on() -> None:
    hasher = BlockHasher(16)
    a = hasher.hash_blocks(TOKENS, extra_keys=ExtraKeys(
        mm_features=(MultiModalFeature("cat", 20, 10),)))
    b = hasher.hash_blocks(TOKENS, extra_keys=ExtraKeys(
        mm_features=(MultiModalFeature("dog", 20, 10),)))
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_empty_extra_keys_equal_no_extra_keys() -> None:
    hasher = BlockHasher(16)
    assert hasher.hash_blocks(TOKENS, extra_keys=ExtraKeys()) == hasher.hash_blocks(TOKENS)


def test_invalid_hasher_arguments_name_the_field() -> None:
    with pytest.raises(ConfigError, match="hash_algo='md5'"):
        BlockHasher(16, "md5")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block_size=0"):
        BlockHasher(0)


@pytest.mark.parametrize("bad", [[2**63], [1.5], ["a"]])
def test_token_ids_out_of_int64_range_raise_config_error(bad: list[object]) -> None:
    with pytest.raises(ConfigError, match="token_ids"):
        encode_token_ids(bad)  # type: ignore[arg-type]


def test_token_encoding_is_little_endian_int64() -> None:
    assert encode_token_ids([1, -1]) == (1).to_bytes(8, "little") + b"\xff" * 8


_CHILD = """
import sys
from hybridkv.hashing import BlockHasher, ExtraKeys, MultiModalFeature
keys = ExtraKeys(lora_name="lora", cache_salt="salt",
                 mm_features=(MultiModalFeature("image-id", 5, 20),))
for algo in ("sha256", "xxhash"):
    hasher = BlockHasher(8, algo)
    print(algo, *(h.hex() for h in hasher.hash_blocks(list(range(40)), extra_keys=keys)))
"""


def test_hashes_are_identical_across_processes_and_hash_seeds() -> None:
    """Hashes must not depend on PYTHONHASHSEED (no ``hash()``, no pickle): two interpreters
    with different seeds print the same digests as this process."""
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True,
                                capture_output=True, text=True, timeout=60)
        outputs.append(result.stdout)
    keys = ExtraKeys(lora_name="lora", cache_salt="salt",
                     mm_features=(MultiModalFeature("image-id", 5, 20),))
    here = "".join(
        " ".join([algo, *(x.hex() for x in BlockHasher(8, algo).hash_blocks(
            list(range(40)), extra_keys=keys))]) + "\n"
        for algo in ("sha256", "xxhash")
    )
    assert outputs[0] == outputs[1] == here
    assert len(here.splitlines()[0].split()) == 1 + 5
