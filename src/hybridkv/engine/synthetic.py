"""Small synthetic workloads for ``hybridkv verify``: prefixes shared on purpose, cut at and
around hit-alignment boundaries, multi-turn sessions, shared system prompts, and prompts
leaving a long document where no window tail is retained (window-recompute bridges).

Content tokens are random ids in ``[0, 2**40)`` (fresh content never repeats by accident);
the engine reduces them modulo its vocabulary for the embedding, while the cache hashes the
ids themselves. Every workload is a function of ``(alignment_tokens, seed)``.

>>> reqs = make_engine_workload("boundaries", alignment_tokens=8, seed=0)
>>> [len(r.prompt_token_ids) for r in reqs][:4]
[40, 12, 13, 14]
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final

from hybridkv.errors import ConfigError
from hybridkv.sched.scheduler import SchedRequest

TOKEN_SPACE: Final = 1 << 40


def _fresh(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(TOKEN_SPACE) for _ in range(num_tokens)]


def boundaries(alignment_tokens: int, seed: int, output_tokens: int = 3) -> list[SchedRequest]:
    """A base document, then prompts sharing its first ``k*A - 1``, ``k*A``, ``k*A + 1``
    tokens (``k`` = 1, 2, 3), an exact repeat and an extension of the base prompt."""
    rng = random.Random(seed)
    a = alignment_tokens
    doc = _fresh(rng, 4 * a + 3)
    base = doc + _fresh(rng, 5)
    reqs = [SchedRequest("base", base, output_tokens)]
    for k in (1, 2, 3):
        for delta in (-1, 0, 1):
            cut = k * a + delta
            reqs.append(SchedRequest(f"cut{k}A{delta:+d}", doc[:cut] + _fresh(rng, a // 2 + k),
                                     output_tokens))
    reqs.append(SchedRequest("repeat", list(base), output_tokens))
    reqs.append(SchedRequest("extend", base + _fresh(rng, 2 * a + 1), output_tokens))
    return reqs


def sessions(alignment_tokens: int, seed: int, num_sessions: int = 3, num_turns: int = 3,
             output_tokens: int = 2) -> list[SchedRequest]:
    """Sessions whose turn ``t`` re-sends turn ``t - 1``'s prompt, a fixed stand-in for its
    answer and a new user message (turns of one session run one after another)."""
    rng = random.Random(seed + 1)
    a = alignment_tokens
    reqs: list[SchedRequest] = []
    for s in range(num_sessions):
        prompt = _fresh(rng, a + rng.randrange(2 * a))
        for t in range(num_turns):
            reqs.append(SchedRequest(f"s{s}t{t}", list(prompt), output_tokens,
                                     session_id=f"s{s}"))
            prompt = prompt + _fresh(rng, 3) + _fresh(rng, rng.randrange(1, 2 * a))
    return reqs


def shared_prefix(alignment_tokens: int, seed: int, num_groups: int = 2,
                  prompts_per_group: int = 4, output_tokens: int = 3) -> list[SchedRequest]:
    """Groups of prompts sharing a system prompt of random (unaligned) length."""
    rng = random.Random(seed + 2)
    a = alignment_tokens
    reqs: list[SchedRequest] = []
    for g in range(num_groups):
        system = _fresh(rng, a + rng.randrange(2 * a + a // 2))
        for i in range(prompts_per_group):
            reqs.append(SchedRequest(f"g{g}p{i}", system + _fresh(rng, 1 + rng.randrange(a)),
                                     output_tokens))
    return reqs


def mixed(alignment_tokens: int, seed: int) -> list[SchedRequest]:
    """``boundaries``, then ``shared-prefix``, then ``sessions``."""
    return (boundaries(alignment_tokens, seed) + shared_prefix(alignment_tokens, seed)
            + sessions(alignment_tokens, seed))


BRIDGE_CUTS: Final = (14, 11, 8, 5, 2)
"""Where ``bridges`` prompts leave the document, in sixteenths of its length."""


def bridges(alignment_tokens: int, seed: int, num_units: int = 16,
            output_tokens: int = 2) -> list[SchedRequest]:
    """A document of ``num_units`` aligned units, then prompts leaving it just after unit
    boundaries ``k * A`` (``k = num_units * BRIDGE_CUTS / 16``, longest first), then a
    sibling of the second prompt.

    Tail-retaining policies keep window KV only near each prompt's end, so full attention
    matches ``k * A`` tokens where no window tail exists: with ``+recompute`` a
    window-recompute bridge ends there (cold when ``k * A`` exceeds the bridge length,
    from 0 otherwise). The sibling then hits at the tail the bridge computed.

    >>> [len(r.prompt_token_ids) for r in bridges(8, 0)]
    [136, 118, 95, 72, 46, 23, 99]
    """
    rng = random.Random(seed + 3)
    a = alignment_tokens
    doc = _fresh(rng, num_units * a + 3)
    reqs = [SchedRequest("doc", doc + _fresh(rng, 5), output_tokens)]
    cuts = [num_units * c // 16 * a + 1 + i % 3 for i, c in enumerate(BRIDGE_CUTS)]
    for cut in cuts:
        reqs.append(SchedRequest(f"leave{cut}", doc[:cut] + _fresh(rng, a // 2 + 1),
                                 output_tokens))
    reqs.append(SchedRequest(f"sibling{cuts[1]}", doc[:cuts[1]] + _fresh(rng, a + 1),
                             output_tokens))
    return reqs


def everything(alignment_tokens: int, seed: int) -> list[SchedRequest]:
    """``mixed``, then ``bridges``."""
    return mixed(alignment_tokens, seed) + bridges(alignment_tokens, seed)


ENGINE_WORKLOADS: Final[dict[str, Callable[[int, int], list[SchedRequest]]]] = {
    "mixed": mixed,
    "all": everything,
    "boundaries": boundaries,
    "bridges": bridges,
    "sessions": sessions,
    "shared-prefix": shared_prefix,
}


def make_engine_workload(name: str, *, alignment_tokens: int, seed: int = 0,
                         ) -> list[SchedRequest]:
    """Build workload ``name`` (one of ``ENGINE_WORKLOADS``) for a hit alignment."""
    if name not in ENGINE_WORKLOADS:
        raise ConfigError("workload", name, f"choose one of {', '.join(ENGINE_WORKLOADS)}")
    if alignment_tokens <= 0:
        raise ConfigError("alignment_tokens", alignment_tokens, "must be positive")
    return ENGINE_WORKLOADS[name](alignment_tokens, seed)
