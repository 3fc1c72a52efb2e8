"""Chained block hashes over token ids and extra keys; deterministic across processes.

Block ``i`` of a request hashes ``(parent hash, tokens of block i, extra keys of block i)``,
so its hash stands for the whole prefix ``[0, (i + 1) * block_size)``. The encoding is a
canonical byte string (never ``hash()``/pickle), so hashes never depend on
``PYTHONHASHSEED`` or the Python version.

>>> hasher = BlockHasher(block_size=4, algo="sha256")
>>> a = hasher.hash_blocks(list(range(10)))
>>> len(a)  # only full blocks are hashed: floor(10 / 4)
2
>>> b = hasher.hash_blocks(list(range(8)) + [99, 99, 99, 99])
>>> a[:2] == b[:2], len(b)
(True, 3)

With ``lookahead_tokens`` L (EAGLE), block ``i`` also covers the L tokens after it and is
hashed only once they exist, so equal blocks followed by different tokens differ:

>>> eagle = BlockHasher(block_size=4, algo="sha256", lookahead_tokens=1)
>>> len(eagle.hash_blocks(list(range(8)))), len(eagle.hash_blocks(list(range(9))))
(1, 2)
>>> x, y = eagle.hash_blocks([0, 1, 2, 3, 7]), eagle.hash_blocks([0, 1, 2, 3, 8])
>>> x == y
False
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from hybridkv.config import HashAlgo
from hybridkv.errors import ConfigError
from hybridkv.ids import BlockHash

HashFn = Callable[[bytes], bytes]

_ROOT_SEED = b"hybridkv/block-hash/v1"
_LOOKAHEAD_ROOT_SEED = b"hybridkv/block-hash-lookahead/v1/"
_SWAP_TO_LITTLE_ENDIAN = sys.byteorder == "big"


def sha256_digest(data: bytes) -> bytes:
    """Collision-resistant default: 32-byte SHA-256."""
    return hashlib.sha256(data).digest()


def xxhash128_digest(data: bytes) -> bytes:
    """Fast option: 16-byte XXH3-128 (not collision resistant against adversaries)."""
    return bytes(xxhash.xxh3_128_digest(data))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_digest, "xxhash": xxhash128_digest}


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """A multimodal item spliced into the prompt at ``[start, start + num_tokens)``."""

    identifier: str
    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Request-level inputs that change KV beyond the token ids.

    ``lora_name`` applies to every block, ``cache_salt`` only to the block at token 0,
    each multimodal feature to the blocks it overlaps (with its offset from the block start).
    """

    lora_name: str | None = None
    cache_salt: str | None = None
    mm_features: tuple[MultiModalFeature, ...] = ()

    def encode_for_block(self, start_token: int, end_token: int) -> bytes:
        """Canonical bytes of the extra keys of the block ``[start_token, end_token)``."""
        parts: list[bytes] = []
        if self.lora_name is not None:
            parts.append(_tagged(b"L", self.lora_name.encode()))
        for feature in self.mm_features:
            if feature.start < end_token and feature.start + feature.num_tokens > start_token:
                offset = struct.pack("<q", feature.start - start_token)
                parts.append(_tagged(b"M", feature.identifier.encode()) + offset)
        if self.cache_salt is not None and start_token == 0:
            parts.append(_tagged(b"S", self.cache_salt.encode()))
        return b"".join(parts)

    @property
    def is_empty(self) -> bool:
        return self.lora_name is None and self.cache_salt is None and not self.mm_features


def _tagged(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<I", len(payload)) + payload


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian signed 64-bit integers."""
    try:
        packed = array("q", token_ids)
    except (OverflowError, TypeError) as err:
        raise ConfigError(
            "token_ids", "…", f"token ids must be integers in [0, 2**63): {err}"
        ) from err
    if _SWAP_TO_LITTLE_ENDIAN:  # pragma: no cover - no big-endian CI machine
        packed.byteswap()
    return packed.tobytes()


class BlockHasher:
    """Computes chained hashes of full ``block_size``-token blocks.

    Args:
        block_size: tokens per hashed block (the config's ``hash_block_size``).
        algo: ``"sha256"`` or ``"xxhash"``.
        lookahead_tokens: tokens after each block its hash also covers (EAGLE's drafter KV
            at the block's last slot depends on them; the config's ``hash_lookahead_tokens``).
            Their ids join the block's bytes and the extra keys cover them too; the chain
            has its own root, so it never meets a chain without lookahead.
    """

    def __init__(self, block_size: int, algo: HashAlgo = "sha256",
                 lookahead_tokens: int = 0) -> None:
        if algo not in HASH_FUNCTIONS:
            raise ConfigError("hash_algo", algo, f"choose one of {sorted(HASH_FUNCTIONS)}")
        if block_size <= 0:
            raise ConfigError("block_size", block_size, "must be a positive number of tokens")
        if lookahead_tokens < 0:
            raise ConfigError("lookahead_tokens", lookahead_tokens, "must be >= 0")
        self.block_size = block_size
        self.algo = algo
        self.lookahead_tokens = lookahead_tokens
        self._fn = HASH_FUNCTIONS[algo]
        seed = _ROOT_SEED if not lookahead_tokens else \
            _LOOKAHEAD_ROOT_SEED + str(lookahead_tokens).encode()
        self.root_hash = BlockHash(self._fn(seed))

    def num_hashable_blocks(self, num_tokens: int) -> int:
        """Blocks of a ``num_tokens``-token sequence that have a hash:
        ``max(0, num_tokens - lookahead) // block_size``."""
        return max(0, num_tokens - self.lookahead_tokens) // self.block_size

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                   extra: bytes = b"") -> BlockHash:
        """Hash one block given its parent's hash (``None`` for the first block)."""
        prefix = self.root_hash if parent is None else parent
        return BlockHash(self._fn(prefix + encode_token_ids(token_ids) + extra))

    def hash_blocks(self, token_ids: Sequence[int], *, parent: BlockHash | None = None,
                    first_block_idx: int = 0, extra_keys: ExtraKeys | None = None,
                    ) -> list[BlockHash]:
        """Hash every full block of ``token_ids``, continuing a chain at ``first_block_idx``.

        ``token_ids`` starts at token ``first_block_idx * block_size`` of the request.
        """
        bs = self.block_size
        fn = self._fn
        hashes: list[BlockHash] = []
        prev = self.root_hash if parent is None else parent
        lookahead = self.lookahead_tokens
        num_full = max(0, len(token_ids) - lookahead) // bs
        if num_full == 0:
            return hashes
        keys = None if extra_keys is None or extra_keys.is_empty else extra_keys
        if lookahead:
            return self._hash_with_lookahead(token_ids, prev, num_full, first_block_idx, keys)
        encoded = encode_token_ids(token_ids[: num_full * bs])
        width = 8 * bs
        for i in range(num_full):
            chunk = encoded[i * width : (i + 1) * width]
            if keys is not None:
                start = (first_block_idx + i) * bs
                chunk += keys.encode_for_block(start, start + bs)
            prev = BlockHash(fn(prev + chunk))
            hashes.append(prev)
        return hashes

    def _hash_with_lookahead(self, token_ids: Sequence[int], prev: BlockHash, num_full: int,
                             first_block_idx: int, keys: ExtraKeys | None) -> list[BlockHash]:
        """``hash_blocks`` with each block's bytes followed by the next L token ids (and the
        extra keys of the block plus those tokens)."""
        bs, lookahead, fn = self.block_size, self.lookahead_tokens, self._fn
        encoded = encode_token_ids(token_ids[: num_full * bs + lookahead])
        width, span = 8 * bs, 8 * (bs + lookahead)
        hashes: list[BlockHash] = []
        for i in range(num_full):
            chunk = encoded[i * width : i * width + span]
            if keys is not None:
                start = (first_block_idx + i) * bs
                chunk += keys.encode_for_block(start, start + bs + lookahead)
            prev = BlockHash(fn(prev + chunk))
            hashes.append(prev)
        return hashes
