"""EAGLE lookahead block hashes (vLLM 0.33's default; issue 12 part 5).

An EAGLE/MTP drafter writes its KV at position ``p`` from the hidden state at ``p`` and the
token at ``p + 1``: the drafter KV in a block's last slot depends on the token *after* the
block. The older drop mode peeks one block past the hit (proving that *some* cached copy of
the last kept block was followed by this request's next token) and drops it; when two copies
of that block exist, the one handed out may have been followed by another token. Lookahead
hashes make the next token part of the block's hash instead, so copies followed by
different tokens have different hashes and no drop is needed.

The drafter oracle here records, per physical block, the token that followed it when its
computing request wrote it, and checks every hit block against the admitted request's
token at that position.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridkv.specs import LayerSpec

X = list(range(100, 108))  # two shared 4-token blocks


class DrafterOracle:
    """Runs whole prompts through a manager, recording each block's drafter next token."""

    def __init__(self, layers: Sequence[LayerSpec], **options: object) -> None:
        config = CacheConfig.from_layers(layers, 64, **options)  # type: ignore[arg-type]
        self.manager = KVCacheManager(config, "dense")
        self.next_token: dict[int, int] = {}  # block id -> token after it when written

    def run(self, req_id: str, tokens: list[int]) -> list[tuple[int, int, int]]:
        """Admit and prefill ``tokens``; return the hit's wrong drafter slots as
        (group, block index, block id)."""
        manager = self.manager
        manager.add_request(req_id, tokens)
        hit = manager.find_longest_hit(req_id)
        wrong = [
            (g, idx, block.block_id)
            for g, (spec, table) in enumerate(zip(
                (grp.spec for grp in manager.config.groups), hit.blocks, strict=True))
            for idx, block in enumerate(table)
            if not block.is_null
            and self.next_token.get(block.block_id) != tokens[(idx + 1) * spec.block_size]
        ]
        allocation = manager.allocate_slots(req_id, len(tokens) - hit.num_tokens, hit)
        assert allocation is not None
        for g, new_ids in enumerate(allocation.new_block_ids):
            bs = manager.config.groups[g].spec.block_size
            first = len(manager.get_block_ids(req_id)[g]) - len(new_ids)
            for k, block_id in enumerate(new_ids):
                end = (first + k + 1) * bs
                if end < len(tokens):  # the drafter wrote its last slot from this token
                    self.next_token[block_id] = tokens[end]
        manager.check_invariants()
        return wrong


def duplicate_copy_case(oracle: DrafterOracle) -> list[tuple[int, int, int]]:
    """A and B share X, then differ; B recomputes X's second block (a second copy, written
    with B's next token 2). C continues like B: the drop-mode peek finds B's third block,
    but X's second block comes back as A's copy, written with token 1."""
    assert oracle.run("A", [*X, 1, 1, 1, 1, 5]) == []
    assert oracle.run("B", [*X, 2, 2, 2, 2, 5]) == []
    return oracle.run("C", [*X, 2, 2, 2, 2, 6])


def test_drop_mode_hands_out_the_wrong_copy() -> None:
    """Why lookahead hashes are the default: the drop mode's hazard, reproduced."""
    oracle = DrafterOracle([FullAttentionSpec(4, 1)], use_eagle=True, eagle_block_drop=True)
    wrong = duplicate_copy_case(oracle)
    assert wrong == [(0, 1, oracle.manager.get_block_ids("A")[0][1])]


@pytest.mark.parametrize("layers", [
    [FullAttentionSpec(4, 1)],
    [FullAttentionSpec(4, 1), SlidingWindowSpec(4, 1, 5)],
    [FullAttentionSpec(4, 1), SlidingWindowSpec(2, 1, 3)],
])
def test_lookahead_hashes_never_hand_out_the_wrong_copy(layers: list[LayerSpec]) -> None:
    oracle = DrafterOracle(layers, use_eagle=True)
    assert oracle.manager.config.hash_lookahead_tokens == 1
    assert duplicate_copy_case(oracle) == []
    manager = oracle.manager
    table_b, table_c = manager.get_block_ids("B")[0], manager.get_block_ids("C")[0]
    # C hits 8 tokens on B's copies (X's second block followed by token 2, as in C), not
    # A's; B's third block was followed by 5, C's by 6, so C computes its own
    assert manager.stats.hits == 4 + 8
    assert table_c[:2] == table_b[:2] and table_c[2] != table_b[2]


def test_lookahead_hash_waits_for_the_next_token() -> None:
    """A prompt ending on a block boundary cannot hash its last block until a token
    follows it; a decode step's token completes the hash, and the next lookup hits it."""
    manager = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 16,
                                                     use_eagle=True), "dense")
    manager.add_request("a", X)
    manager.allocate_slots("a", 8, manager.find_longest_hit("a"))
    manager.add_request("b", [*X, 7, 7])
    assert manager.find_longest_hit("b").num_tokens == 4  # block 1's next token unknown
    manager.append_token_ids("a", [7])
    assert manager.allocate_slots("a", 1) is not None
    assert manager.find_longest_hit("b").num_tokens == 8
    manager.add_request("c", [*X, 9, 9])
    assert manager.find_longest_hit("c").num_tokens == 4  # followed by 9, not 7
    manager.check_invariants()


def test_lookahead_hits_equal_plain_hits_on_resends() -> None:
    """Without duplicate copies the lookahead mode loses nothing on a resend: the hit is
    at most ``prompt - 1`` tokens, so the token after it always exists."""
    plain = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 32), "dense")
    eagle = KVCacheManager(CacheConfig.from_layers([FullAttentionSpec(4, 1)], 32,
                                                   use_eagle=True), "dense")
    for manager in (plain, eagle):
        for req, length in (("a", 17), ("b", 17), ("c", 13), ("d", 16)):
            tokens = list(range(length))
            manager.add_request(req, tokens)
            manager.allocate_slots(req, length - (hit := manager.find_longest_hit(req))
                                   .num_tokens, hit)
            manager.remove_request(req)
    assert plain.stats.hits == eagle.stats.hits > 0
