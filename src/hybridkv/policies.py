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
from dataclasses import dataclass

from hybridkv.block import Block
from hybridkv.errors import ConfigError
from hybridkv.eviction import EvictionOptions, parse_eviction
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


CHUNK_CHECKPOINTS = "ckpt:chunk"
"""vLLM 0.33 align mode: a state is written at each step's end only (chunk ends aligned)."""
BLOCK_CHECKPOINTS = "ckpt:block"
"""Every block end a step passes gets its own block and state (the engine exports the
state at each block end of a chunk, as chunked scans compute it anyway); chunks are not
clipped, and the retention policy decides which of these checkpoints stay hashed."""
BRANCH_CHECKPOINTS = "ckpt:branch"
"""``ckpt:chunk`` plus sub-block hits (``hybridkv.branch``): hashes every ``u`` tokens
(``ckpt:branch:U``; default 16, or 1 for blocks of at most 16 tokens), chunks end at
branch points, snapshots there are hit with copy-on-write. Not vLLM 0.33 behaviour: an
opt-in policy."""
CHECKPOINT_POLICIES = (CHUNK_CHECKPOINTS, BLOCK_CHECKPOINTS, BRANCH_CHECKPOINTS)
DEFAULT_BRANCH_UNIT_TOKENS = 16


def parse_checkpoint_policy(name: str) -> str:
    """Validate a checkpoint policy name (``ckpt:chunk``, ``ckpt:block``, ``ckpt:branch``
    or ``ckpt:branch:U`` with a positive unit ``U`` in tokens).

    >>> parse_checkpoint_policy("ckpt:block"), parse_checkpoint_policy("ckpt:branch:32")
    ('ckpt:block', 'ckpt:branch:32')
    """
    if name in CHECKPOINT_POLICIES:
        return name
    prefix = BRANCH_CHECKPOINTS + ":"
    if name.startswith(prefix) and name[len(prefix):].isdigit() \
            and int(name[len(prefix):]) > 0:
        return name
    raise ConfigError("policy", name,
                      f"unknown checkpoint policy; choose {', '.join(CHECKPOINT_POLICIES)} "
                      "or ckpt:branch:U (U = hit unit in tokens, e.g. ckpt:branch:16)")


def branch_unit_tokens(name: str, block_size: int) -> int | None:
    """The hit unit of a ``ckpt:branch`` policy for ``block_size``-token blocks, ``None``
    for the other checkpoint policies. The default is 16 tokens (vLLM's kernel block), or
    1 token when a block holds at most 16.

    >>> branch_unit_tokens("ckpt:branch", 784), branch_unit_tokens("ckpt:branch", 8)
    (16, 1)
    >>> branch_unit_tokens("ckpt:branch:4", 8), branch_unit_tokens("ckpt:chunk", 784)
    (4, None)
    """
    if not name.startswith(BRANCH_CHECKPOINTS):
        return None
    if name != BRANCH_CHECKPOINTS:
        unit = int(name[len(BRANCH_CHECKPOINTS) + 1:])
    elif block_size > DEFAULT_BRANCH_UNIT_TOKENS and block_size % DEFAULT_BRANCH_UNIT_TOKENS == 0:
        unit = DEFAULT_BRANCH_UNIT_TOKENS
    else:
        unit = 1
    if block_size % unit:
        raise ConfigError("policy", name,
                          f"the hit unit must divide the block size {block_size}")
    return unit


def make_retention_policy(name: str) -> RetentionPolicy:
    """Build a policy from its name (``dense``, ``latest``, ``interval:32768``, ``pin:4096``…)."""
    text, *modifiers = [part.strip() for part in name.split("+")]
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


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A policy string, parsed: ``RETENTION[+MODIFIER]...``.

    ``RETENTION`` is a ``make_retention_policy`` name; each modifier is an eviction component
    (``scan``, ``chain``, ``session``, ``predict``, ``flops``; ``lru`` is the default and
    names nothing), ``recompute`` (window-recompute partial hits) or a checkpoint policy
    (``ckpt:chunk``, ``ckpt:block``, ``ckpt:branch[:U]``; the last one given applies).
    Parts are stripped; modifiers may come in any order. The one parser of policy strings:
    the manager, the replay, sweep and cluster commands and the engine's verify use it.

    Attributes:
        retention: the retention policy's canonical name (``interval:32768``).
        eviction: the eviction options the modifiers name; ``None`` when they name none
            but ``lru`` (a manager then uses its ``eviction`` argument).
        recompute: ``+recompute`` given.
        checkpoints: the checkpoint policy (default ``ckpt:chunk``, vLLM's align mode).

    >>> spec = PolicySpec.parse("latest+recompute+chain+ckpt:branch")
    >>> spec.retention, spec.eviction.name, spec.recompute, spec.checkpoints
    ('latest', 'chain', True, 'ckpt:branch')
    >>> spec.name  # canonical: eviction components, then recompute, then checkpoints
    'latest+chain+recompute+ckpt:branch'
    >>> PolicySpec.parse(spec.name) == spec, PolicySpec.parse("interval:32768").name
    (True, 'interval:32768')
    >>> PolicySpec.parse("latest+sacn")
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: policy='sacn' is invalid: unknown eviction policy; \
choose from lru, scan, chain, session, predict, flops
    """

    retention: str
    eviction: EvictionOptions | None = None
    recompute: bool = False
    checkpoints: str = CHUNK_CHECKPOINTS

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        """Parse and validate ``text``; ``ConfigError`` names the part that is wrong
        (checked in order: the retention name, checkpoint policies, eviction names)."""
        retention, *modifiers = [part.strip() for part in text.split("+")]
        policy = make_retention_policy(retention)
        checkpoints = [parse_checkpoint_policy(m) for m in modifiers if m.startswith("ckpt:")]
        eviction = parse_eviction([m for m in modifiers
                                   if m != "recompute" and not m.startswith("ckpt:")])
        repeated = [m for i, m in enumerate(modifiers)
                    if m in modifiers[:i] and not m.startswith("ckpt:")]
        if repeated:  # a typo of another modifier, not a stronger setting
            raise ConfigError("policy", repeated[0], "is given twice; name each modifier "
                              "once")
        return cls(policy.name, None if eviction == EvictionOptions() else eviction,
                   "recompute" in modifiers,
                   checkpoints[-1] if checkpoints else CHUNK_CHECKPOINTS)

    def retention_policy(self) -> RetentionPolicy:
        """A new ``RetentionPolicy`` object for ``retention``."""
        return make_retention_policy(self.retention)

    @property
    def name(self) -> str:
        """The canonical string: ``PolicySpec.parse(spec.name) == spec``."""
        return policy_name(self.retention, self.eviction or EvictionOptions(), self.recompute,
                           self.checkpoints)


def policy_name(retention: str, eviction: EvictionOptions, recompute: bool,
                checkpoints: str) -> str:
    """The canonical policy string of its parts (what a manager reports as
    ``policy_name``): the defaults ``lru`` and ``ckpt:chunk`` are left out.

    >>> policy_name("interval:32768", EvictionOptions(predict=True), True, "ckpt:chunk")
    'interval:32768+predict+recompute'
    """
    name = retention if eviction.name == "lru" else f"{retention}+{eviction.name}"
    if recompute:
        name += "+recompute"
    if checkpoints != CHUNK_CHECKPOINTS:
        name += f"+{checkpoints}"
    return name
