"""LandingRuns: where a non-full group can land a hit, from its resident blocks alone.

A hit at an aligned ``p`` in a window, recurrent or compressor group needs the ``k`` blocks
ending at ``p`` (its tail: window tokens, the checkpoint at ``p``, compressor state). This
structure keeps, per resident block of one group, its table position, its chain
predecessor and how many resident blocks in a row end at it along its chain (the *run*,
capped at the largest tail); the block ending at ``p`` is *landable* when its run reaches
the tail ``p`` needs. A store or removal updates the runs of the resident blocks after it
on its chains (usually none: runs are stored in order and freed tail first) and reports
the landability flips.

Who runs it: the KV event log (``log.py``) for groups whose tail rule only the manager
knows (chunked local attention, compressor state), publishing the flips as
``landing_hashes``; the consumer (``ResidentReplica``) for groups with the *capped* rule
``k = min(tail, blocks before p)`` (sliding windows, recurrent checkpoints), whose
``BlockStored`` events announce the tail, the alignment and the block positions instead —
so the serving side pays nothing per block for them.

Worked example (bs 4, tail 2 blocks, alignment 4): storing blocks 0-2 of a chain
``h0 h1 h2`` lands 4 (block 0: a run from the chain's start suffices), 8 and 12; removing
block 1 then loses 8 and 12 (both need it), and 4 stays landable.

>>> runs = LandingRuns(block_size=4, alignment_tokens=4, max_tail_blocks=2)
>>> added: list[int] = []
>>> for position, (key, parent) in enumerate([(10, None), (11, 10), (12, 11)]):
...     runs.store(position, key, parent, added)
>>> added, runs.unlink(11), sorted(runs.landable)
([10, 11, 12], [11, 12], [10])
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.errors import InvariantViolation


class LandingRuns:
    """Resident runs and landable points of one non-full group (see module doc).

    Invariants (``check_invariants``): landable keys have run entries; every run equals
    its predecessor's run + 1 (1 without a resident predecessor), capped at the largest
    tail; a landable key's run reaches the tail its point needs.
    """

    __slots__ = ("alignment_tokens", "block_size", "children", "landable",
                 "max_tail_blocks", "need_at", "nodes", "runs")

    def __init__(self, block_size: int, alignment_tokens: int, max_tail_blocks: int,
                 need_at: Callable[[int], int | None] | None = None) -> None:
        """``need_at(position)``: tail blocks a hit at the end of table position
        ``position`` needs; ``None`` means the capped rule ``min(max_tail_blocks,
        position + 1)``."""
        self.block_size = block_size
        self.alignment_tokens = alignment_tokens
        self.max_tail_blocks = max_tail_blocks
        self.need_at = need_at
        self.runs: dict[int, int] = {}
        """Resident key → resident blocks in a row ending at it (capped)."""
        self.nodes: dict[int, tuple[int, int | None]] = {}
        """Resident key → (table position, chain predecessor key)."""
        self.children: dict[int, set[int]] = {}
        """Key → resident keys whose predecessor it is."""
        self.landable: set[int] = set()
        """Keys of resident blocks ending at a point where a hit can land."""

    def clear(self) -> None:
        self.runs.clear()
        self.nodes.clear()
        self.children.clear()
        self.landable.clear()

    def _need(self, position: int) -> int | None:
        if (position + 1) * self.block_size % self.alignment_tokens:
            return None
        if self.need_at is None:
            cap = self.max_tail_blocks
            return position + 1 if position < cap else cap
        return self.need_at(position)

    def store(self, position: int, key: int, parent: int | None, added: list[int]) -> None:
        """The first copy of ``key`` (the group's block at table ``position``, after
        ``parent`` on its chain) is resident; append the points it made landable."""
        self.nodes[key] = (position, parent)
        runs, children = self.runs, self.children
        run = 1
        if parent is not None:
            siblings = children.get(parent)
            if siblings is None:
                children[parent] = {key}
            else:
                siblings.add(key)
            run = min(runs.get(parent, 0) + 1, self.max_tail_blocks)
        if key in children:  # resident blocks after it: carry the run down
            self._propagate(key, run, added)
            return
        runs[key] = run  # the common case: the newest block of its chain
        need = self._need(position)
        if need and run >= need:
            self.landable.add(key)
            added.append(key)

    def unlink(self, key: int) -> list[int] | None:
        """The last copy of ``key`` left: its point and those whose tail ran through it
        (resident descendants within the largest tail) may stop being landable. Returns
        the points lost (``None``: none, or ``key`` was never stored here)."""
        if self.runs.pop(key, None) is None:
            return None
        _, parent = self.nodes.pop(key)
        children = self.children
        if parent is not None:
            siblings = children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del children[parent]
        lost: list[int] = []
        if key in self.landable:
            self.landable.discard(key)
            lost.append(key)
        below = children.get(key)
        if below:
            for child in list(below):
                self._propagate(child, 1, lost)
        return lost or None

    def _propagate(self, key: int, run: int, changed: list[int]) -> None:
        """Set the run ending at ``key`` and carry the change down to resident
        descendants; record landability flips."""
        runs, nodes, children, landable = self.runs, self.nodes, self.children, self.landable
        cap = self.max_tail_blocks
        need_of = self._need
        stack = [(key, run)]
        while stack:
            node, value = stack.pop()
            if runs.get(node) == value:
                continue
            runs[node] = value
            need = need_of(nodes[node][0])
            if need:
                if value >= need:
                    if node not in landable:
                        landable.add(node)
                        changed.append(node)
                elif node in landable:
                    landable.discard(node)
                    changed.append(node)
            below = children.get(node)
            if below:
                next_value = min(value + 1, cap)
                for child in below:
                    stack.append((child, next_value))

    def check_invariants(self, resident: dict[int, int]) -> None:
        """Raise ``InvariantViolation`` unless the runs match ``resident`` (the group's
        resident keys) and the rule."""
        if not self.landable <= self.runs.keys() <= resident.keys():
            raise InvariantViolation("landable or run entries of blocks that are not resident")
        for key, run in self.runs.items():
            position, parent = self.nodes[key]
            expected = 1 if parent not in self.runs else min(
                self.max_tail_blocks, self.runs[parent] + 1)
            if run != expected:
                raise InvariantViolation(f"run {run} != {expected}")
            need = self._need(position)
            if (key in self.landable) != bool(need and run >= need):
                raise InvariantViolation(f"landability of the block at {position} is stale")


__all__ = ["LandingRuns"]
