"""Retention policies: which sliding-window blocks get hashed, and where freed blocks go.

A policy is a small object the group managers consult; it never owns state. Selectable by
name with ``make_retention_policy``:

========================  ===================================================================
``dense``                 hash every full block of every group; every freed block → queue tail
``reachable``             hash only window tails an aligned hit can use (vLLM #42258); tail
``prepend``               ``reachable`` + unhashed freed blocks → queue *head* (vLLM #43447)
``interval:N``            window tails every N tokens + latest prompt boundary (+ junction)
``latest``                only the latest prompt boundary + shared-prefix junction (vLLM default)
``pin:T``                 ``prepend`` + a pinned tier: window blocks of the last T tokens at each
                          window drop and a finished request's hashed blocks (closed vLLM #40676)
``bounded-replay``        ``latest``, but attention windows are never cached: a hit comes from the
                          other groups, its last window is recomputed, hits ≤ the window are
                          dropped (vLLM 0.33 DeepSeek-V4.1 ``swa_bounded_replay``)
========================  ===================================================================

Mask arithmetic, worked (full bs 32 + window bs 8, w 8 → ``need`` 1 tail block, ``A`` 32):

>>> tail_mask(0, 16, blocks_per_segment=4, num_tail_blocks=1, shift=0)  # every A boundary
... # doctest: +NORMALIZE_WHITESPACE
[False, False, False, True, False, False, False, True, False, False, False, True,
 False, False, False, True]
>>> LatestPolicy().window_mask(0, 16, block_size=8, alignment_tokens=32, num_tail_blocks=1,
...                            shift=0, boundaries=(127,)).index(True)  # 127 → 96 → block 11
11
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from hybridkv.block import Block
from hybridkv.errors import ConfigError
from hybridkv.pool import FreeTier

POLICY_NAMES = ("dense", "reachable", "prepend", "latest", "interval:N", "pin:T",
                "bounded-replay")
CORE_POLICIES = ("dense", "reachable", "prepend", "latest", "interval:32768", "pin:32768")


def tail_mask(start: int, end: int, *, blocks_per_segment: int, num_tail_blocks: int,
              shift: int) -> list[bool]:
    """Mark, over blocks ``[start, end)``, the ``num_tail_blocks`` blocks ending on each
    segment boundary (shifted right by ``shift`` blocks for EAGLE's peek block)."""
    per, first_kept = blocks_per_segment, blocks_per_segment - num_tail_blocks
    return [i >= shift and (i - shift) % per >= first_kept for i in range(start, end)]


def mark_boundary_tails(mask: list[bool], start: int, end: int, *, boundaries: Sequence[int],
                        alignment_tokens: int, block_size: int, num_tail_blocks: int,
                        shift: int) -> None:
    """Also keep the tail ending at each boundary (floored to the alignment)."""
    for boundary in boundaries:
        end_block = (boundary // alignment_tokens) * alignment_tokens // block_size + shift
        for i in range(max(start, end_block - num_tail_blocks), min(end, end_block)):
            mask[i - start] = True


class RetentionPolicy(ABC):
    """What a window group keeps hashed and where freed blocks go."""

    name: str = ""
    clamps_to_alignment = True
    """Hybrid groups cache only up to the last aligned boundary (no hit can end past it)."""
    uses_boundaries = False
    """Whether replay boundaries and the shared-prefix junction are consulted."""
    is_sparse = False
    """Hashes window tails only at chosen boundaries (``latest``, ``interval:N``), not every
    reachable window block: on long traces such replays cost about half (``--jobs``
    schedules the others first)."""

    def validate(self, alignment_tokens: int, has_window_groups: bool) -> None:
        """Raise ``ConfigError`` when the policy cannot apply to this model."""
        del alignment_tokens, has_window_groups

    @abstractmethod
    def window_mask(self, start: int, end: int, *, block_size: int, alignment_tokens: int,
                    num_tail_blocks: int, shift: int, boundaries: Sequence[int],
                    ) -> list[bool] | None:
        """Which window blocks in ``[start, end)`` to hash; ``None`` means all of them."""

    scratch_tier = FreeTier.TAIL
    """Tier of freed blocks without a hash (they can never produce a hit)."""
    cached_tier = FreeTier.TAIL
    """Tier of freed hashed blocks when their request ends (finish or preemption)."""
    replays_attention_windows = False
    """``bounded-replay``: sliding-window attention groups leave prefix caching; the
    coordinator drops hits no longer than their window and counts the replayed window as
    recomputed prefill."""
    pin_drop_tokens: int | None = None
    """When set, hashed window blocks ending within this many tokens of a window drop go to
    the pinned tier (older ones to the tail)."""

    def free_tier(self, block: Block) -> FreeTier:
        """Tier of a block freed with its request (finish or preemption)."""
        return self.scratch_tier if block.block_hash is None else self.cached_tier

    def is_pinned_on_drop(self, block_end_token: int, num_skipped_tokens: int) -> bool:
        """Whether a hashed window block ending at ``block_end_token`` is among the last
        ``pin_drop_tokens`` tokens before the window's new start (``pin:T`` only)."""
        return self.pin_drop_tokens is not None and (
            block_end_token > num_skipped_tokens - self.pin_drop_tokens)

    def drop_tier(self, block: Block, block_end_token: int, num_skipped_tokens: int) -> FreeTier:
        """Tier of a window block released because it left the window."""
        if block.block_hash is None:
            return self.scratch_tier
        if self.is_pinned_on_drop(block_end_token, num_skipped_tokens):
            return FreeTier.PINNED
        return FreeTier.TAIL

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class DensePolicy(RetentionPolicy):
    """Hash everything, free everything to the tail (before vLLM #42258/#43447)."""

    name = "dense"
    clamps_to_alignment = False

    def window_mask(self, start: int, end: int, *, block_size: int, alignment_tokens: int,
                    num_tail_blocks: int, shift: int, boundaries: Sequence[int],
                    ) -> list[bool] | None:
        return None


class ReachablePolicy(RetentionPolicy):
    """Hash the window tail at every aligned boundary only (vLLM #42258 + #44082)."""

    name = "reachable"

    def segment_tokens(self, alignment_tokens: int) -> int | None:
        """Period of retained tails in tokens, ``None`` for boundaries only."""
        return alignment_tokens

    def window_mask(self, start: int, end: int, *, block_size: int, alignment_tokens: int,
                    num_tail_blocks: int, shift: int, boundaries: Sequence[int],
                    ) -> list[bool] | None:
        if alignment_tokens % block_size:
            return None
        segment = self.segment_tokens(alignment_tokens)
        if segment is None:
            mask = [False] * (end - start)
        else:
            per = segment // block_size
            if num_tail_blocks >= per:
                return None  # every block is the tail of some boundary
            mask = tail_mask(start, end, blocks_per_segment=per,
                             num_tail_blocks=num_tail_blocks, shift=shift)
        if self.uses_boundaries:
            mark_boundary_tails(mask, start, end, boundaries=boundaries,
                                alignment_tokens=alignment_tokens, block_size=block_size,
                                num_tail_blocks=num_tail_blocks, shift=shift)
        return mask


class PrependPolicy(ReachablePolicy):
    """``reachable`` + unhashed freed blocks to the queue head (vLLM 0.33, interval None)."""

    name = "prepend"
    scratch_tier = FreeTier.HEAD


class IntervalPolicy(PrependPolicy):
    """Window tails every ``interval_tokens`` plus the latest prompt boundary (+ junction)."""

    uses_boundaries = True
    is_sparse = True

    def __init__(self, interval_tokens: int) -> None:
        self.interval_tokens = interval_tokens
        self.name = f"interval:{interval_tokens}"

    def validate(self, alignment_tokens: int, has_window_groups: bool) -> None:
        n = self.interval_tokens
        if n <= 0 or n % alignment_tokens:
            raise ConfigError(
                "interval", n,
                f"must be a positive multiple of the hit alignment {alignment_tokens} tokens "
                f"(lcm of the groups' block sizes), e.g. "
                f"{alignment_tokens * max(1, n // alignment_tokens)}",
            )

    def segment_tokens(self, alignment_tokens: int) -> int | None:
        return self.interval_tokens


class LatestPolicy(PrependPolicy):
    """Only the latest replayable prompt boundary and the junction (vLLM 0.33 default)."""

    name = "latest"
    uses_boundaries = True
    is_sparse = True

    def segment_tokens(self, alignment_tokens: int) -> int | None:
        return None


class BoundedReplayPolicy(LatestPolicy):
    """vLLM 0.33's ``swa_bounded_replay`` (on by default for DeepSeek-V4.1), for any model.

    Sliding-window attention groups (``sliding_window``, ``sliding_window_mla``) are never
    hashed nor looked up; a hit is what the other groups serve, aligned as usual. The hit's
    last ``W`` tokens (W = the window, 128 on V4) are recomputed to rebuild the window KV,
    so a hit of ``<= W`` tokens saves nothing and is dropped. Other window-like groups
    (compressor state) keep ``latest`` retention, as vLLM keeps them cached. Exact only on
    models where the layers after the last KV-source layer read just the trailing window
    (V4.1); elsewhere it reproduces vLLM's hit accounting, not exact KV.

    Worked example (W 128, alignment 256): the full groups hit 512 → hit 512, tokens
    [384, 512) recomputed; a full-group hit of 0 or of 256 > 128 stays as it is.
    """

    name = "bounded-replay"
    replays_attention_windows = True


class PinPolicy(PrependPolicy):
    """``prepend`` plus a pinned free tier, used only after the free queue is empty."""

    def __init__(self, pin_tokens: int) -> None:
        if pin_tokens <= 0:
            raise ConfigError(
                "pin", pin_tokens, "must be a positive number of tokens, e.g. pin:32768"
            )
        self.pin_tokens = pin_tokens
        self.pin_drop_tokens = pin_tokens
        self.cached_tier = FreeTier.PINNED
        self.name = f"pin:{pin_tokens}"


def split_policy_name(name: str) -> tuple[str, list[str]]:
    """``"interval:32768+scan+chain"`` → ``("interval:32768", ["scan", "chain"])``."""
    retention, *modifiers = [part.strip() for part in name.split("+")]
    return retention, modifiers


def make_retention_policy(name: str) -> RetentionPolicy:
    """Build a policy from its name (``dense``, ``latest``, ``interval:32768``, ``pin:4096``…)."""
    text, modifiers = split_policy_name(name)
    if modifiers:
        raise ConfigError("policy", name, "name a retention policy alone here; eviction "
                          "modifiers (+scan, +chain, +session, +predict) go to KVCacheManager")
    simple: dict[str, type[RetentionPolicy]] = {
        "dense": DensePolicy, "reachable": ReachablePolicy,
        "prepend": PrependPolicy, "latest": LatestPolicy,
        "bounded-replay": BoundedReplayPolicy,
    }
    if text in simple:
        return simple[text]()
    kind, _, arg = text.partition(":")
    if kind in ("interval", "pin"):
        try:
            tokens = int(arg)
        except ValueError:
            raise ConfigError(
                "policy", name, f"{kind} needs a token count, e.g. {kind}:32768"
            ) from None
        return IntervalPolicy(tokens) if kind == "interval" else PinPolicy(tokens)
    raise ConfigError("policy", name, f"choose one of {', '.join(POLICY_NAMES)}")
