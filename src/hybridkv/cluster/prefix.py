"""Prefix-cache routers fed only by the instances' KV event streams.

Each instance's stream (vLLM 0.33 ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``,
``hybridkv.events``), received as the msgpack payloads vLLM's publisher sends, is decoded
and applied to one ``ResidentReplica`` per instance: per cache group,
the resident block hashes (with their cached copies) and — hybridkv's residency extension —
the *landable* hit points of non-full groups. The router hashes each request's prompt with
the deployment's hash settings (block size, algorithm: what llm-d's indexer is configured
with too) and scores every instance:

- ``prefix-fa`` (what llm-d's precise prefix-cache scorer and Dynamo's KV router do today
  for hybrid models): the longest chain of the request's full-attention block hashes
  resident on the instance (every full-attention-like group: ``full_attention``,
  ``mla_attention``), capped at ``prompt - 1`` tokens. Window tails, recurrent checkpoints
  and compressor state are ignored, so a prefix whose tail was evicted still scores.
- ``prefix-residency``: the longest aligned ``p`` (multiple of the alignment, the lcm of
  the block sizes the streams announced; at most ``prompt - 1``) such that the
  full-attention chain reaches ``p`` *and* ``p``'s landing hash (the chained hash of
  ``[0, p)``) is landable in every non-full group the streams have shown. A
  full-attention match whose tail or checkpoint is gone is not a hit.

**Score.** ``value - load_weight * queued_tokens``; the highest wins, ties go to the
least-loaded instance. With ``load_weight`` 1 the load term is the prefill backlog the
request queues behind, so a prefix is followed only while it is worth more than that
queue (``--load-weight 0`` routes on the value alone). The value:

- ``prefix-fa``: the full-attention chain ``c`` (what it believes the request hits).
- ``prefix-residency``: ``h + c``, the exact landable hit ``h`` plus the chain ``c``
  (``h <= c``). ``h`` is this request's saving. ``c`` is *locality*: what the instance
  holds of the prefix. Where ``h < c`` the request recomputes ``[h, prompt)`` there, but
  the junction policies (``latest``, ``interval``, ``+recompute``…) keep the window tail /
  checkpoint at the shared-prefix junction ``c``, so the next request that shares the
  prefix hits ``c`` on that instance, and only there. ``h + c`` is the saving over a
  two-request horizon (this request now, the next sharer later); scoring ``h`` alone (the
  session-2 rule) sent a request whose prefix had no landable point anywhere to the
  least-loaded instance, scattering a prefix family so that no instance ever built its
  junction. Worked example (one instance holds a 24-token chain without a landable point,
  the other nothing, backlogs 9 and 0): ``0 + 24 - 9 = 15 > 0``, so the request joins the
  chain; with ``h`` alone it went to the idle instance (``tests/unit/test_cluster_prefix.py``).
  Among equal scores the larger exact hit wins (then the lighter load), where the
  full-attention index guesses.

**Balance.** The load term ``- load_weight * queued`` is the only balance rule of both
routers. An extra rule was measured and is kept as an ablation, off by default
(``self_paying=True``, ``self_paying_instances``): before scoring, cut the candidates to
the instances whose backlog exceeds that of the instance with the least work left after
this request (smallest ``queued - exact``) by at most their own exact landable hit,
``queued_i - queued_low <= exact_i``, so that only a certain saving buys a longer queue
and the chain ranks only among what the rule allows. It forbids exactly the moves that
build locality (a request with no landable point follows its prefix's chain into a
short queue and leaves the junction there): on held-out slices (``mooncake_synthetic``
requests 1,501-3,000 and 3,001-3,993, gemma3-bench and qwen3.5-27b, 4 and 8 instances)
``prefix-residency`` with the rule lost to ``prefix-fa`` on cluster hit rate in 6 of 8
rows (e.g. 16.31% vs 25.16%), without it in 1 of 8 (31.60% vs 25.16% there), and the
rule did not bring load balance to session affinity's level either
(``docs/benchmarks.md``). Worked example of the rule: backlogs 0, 500, 900 and exact hits
0, 600, 0 allow instances 0 and 1 (500 <= 600), not 2.

The router never reads an instance's manager: everything above comes from the events and
the load reports (a test feeds a router a stream and checks it against the manager).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridkv.cluster.routers import Load, Route, Router, RouteRequest, least_loaded
from hybridkv.config import CacheConfig
from hybridkv.events.replica import ResidentReplica
from hybridkv.events.schema import BlockStored, decode_batch, external_hash
from hybridkv.hashing import BlockHasher
from hybridkv.ids import BlockHash
from hybridkv.traces.prompts import LazyPrompt, PromptHasher
from hybridkv.traces.trace import Trace, expand_prompt

FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""``kv_cache_spec_kind`` values whose hit needs every block of the prefix."""


class GroupLayout:
    """What the event streams announced about each cache group (the same model on every
    instance): kind and block size, learned from ``BlockStored``."""

    def __init__(self) -> None:
        self.kind: dict[int, str] = {}
        self.block_size: dict[int, int] = {}

    def learn(self, event: object) -> None:
        if isinstance(event, BlockStored) and event.group_idx is not None \
                and event.group_idx not in self.kind:
            self.kind[event.group_idx] = event.kv_cache_spec_kind or "unknown"
            self.block_size[event.group_idx] = event.block_size

    @property
    def full_groups(self) -> list[int]:
        return sorted(g for g, kind in self.kind.items() if kind in FULL_KINDS)

    @property
    def other_groups(self) -> list[int]:
        return sorted(g for g, kind in self.kind.items() if kind not in FULL_KINDS)

    @property
    def alignment_tokens(self) -> int:
        """lcm of the announced block sizes (1 before any event)."""
        return math.lcm(*self.block_size.values()) if self.block_size else 1


class PrefixRouter(Router):
    """Event-fed prefix scorer (``residency`` selects the residency-aware match)."""

    uses_events = True

    def __init__(self, num_instances: int, trace: Trace, hasher: BlockHasher, *,
                 residency: bool, load_weight: float = 1.0, locality: bool = True,
                 self_paying: bool = False, bounded_load: float | None = None) -> None:
        super().__init__(num_instances)
        self.bounded_load = bounded_load
        self.locality = locality
        self.self_paying = self_paying and residency
        self.name = "prefix-residency" if residency else "prefix-fa"
        self.residency = residency
        self.load_weight = load_weight
        self.trace = trace
        self.hasher = hasher
        self.replicas = [ResidentReplica() for _ in range(num_instances)]
        self.layout = GroupLayout()
        self._prompt_hasher = PromptHasher(hasher)

    def observe(self, instance: int, payloads: Sequence[bytes]) -> None:
        """Decode the instance's published batches (vLLM 0.33 msgpack) and apply them."""
        replica = self.replicas[instance]
        for payload in payloads:
            for event in decode_batch(payload).events:
                self.layout.learn(event)
                replica.apply(event)

    def prompt_hashes(self, trace_index: int) -> list[BlockHash]:
        """The request's chained hashes at the hash block size (the instances' own)."""
        request = self.trace.requests[trace_index]
        prompt = LazyPrompt(request, trace_index)
        hashes = None if self.hasher.lookahead_tokens else \
            self._prompt_hasher.hashes(request, prompt)
        if hashes is None:
            return self.hasher.hash_blocks(expand_prompt(request, trace_index))
        return hashes

    def route(self, request: RouteRequest, loads: Sequence[Load]) -> Route:
        if not self.layout.full_groups:  # nothing cached anywhere yet
            return Route(least_loaded(loads))
        external = [external_hash(h) for h in self.prompt_hashes(request.trace_index)]
        n = self.num_instances
        chains = [self.chain(i, external, request.prompt_tokens) for i in range(n)]
        queued = [load.queued_tokens for load in loads]
        candidates: Sequence[int] = range(n)
        if self.residency:
            exact = [self._landable(self.replicas[i], external, chains[i]) if chains[i] else 0
                     for i in range(n)]
            value = [exact[i] + chains[i] for i in range(n)] if self.locality else exact
            if self.self_paying:
                candidates = self_paying_instances(queued, exact)
        else:
            exact = value = chains
        if self.bounded_load is not None:
            candidates = bounded_load_instances(
                queued, [request.prompt_tokens - exact[i] for i in range(n)],
                self.bounded_load, candidates)
        weight = self.load_weight
        best = min(candidates, key=lambda i: (
            -(value[i] - weight * queued[i]), -exact[i] if self.residency else 0,
            queued[i], loads[i].num_requests, i))
        return Route(best, exact[best])

    def chain(self, instance: int, external: Sequence[int], prompt_tokens: int) -> int:
        """Tokens of the request's full-attention chain resident on ``instance`` in every
        full-attention group (whole full-attention blocks, at most ``prompt - 1``)."""
        hb = self.hasher.block_size
        replica = self.replicas[instance]
        limit = prompt_tokens - 1
        if not self.layout.full_groups:  # no stream has announced a group yet
            return 0
        for group in self.layout.full_groups:
            limit = min(limit, _chain_tokens(replica.resident.get(group, {}), external,
                                             self.layout.block_size[group] // hb, hb))
            if limit <= 0:
                return 0
        full_block = min(self.layout.block_size[g] for g in self.layout.full_groups)
        return limit // full_block * full_block

    def match(self, instance: int, external: Sequence[int], prompt_tokens: int) -> int:
        """Tokens the router expects instance ``instance`` to hit for a prompt of
        ``prompt_tokens`` tokens whose chained hashes (external form, one per hash
        block) are ``external``: the full-attention chain (``prefix-fa``) or the
        longest landable point on it (``prefix-residency``)."""
        chain = self.chain(instance, external, prompt_tokens)
        if not self.residency or not chain:
            return chain
        return self._landable(self.replicas[instance], external, chain)

    def _landable(self, replica: ResidentReplica, external: Sequence[int], limit: int) -> int:
        """The largest aligned ``p <= limit`` landable in every non-full group."""
        hb = self.hasher.block_size
        alignment = self.layout.alignment_tokens
        others = self.layout.other_groups
        if not others:
            return limit // alignment * alignment
        sets = sorted((replica.landable.get(g, set()) for g in others), key=len)
        step = alignment // hb
        top = limit // alignment
        if top == 0 or not sets[0]:
            return 0
        for k in range(top, 0, -1):  # the smallest set first: most candidates fail there
            key = external[k * step - 1]
            if all(key in s for s in sets):
                return k * alignment
        return 0


def _chain_tokens(resident: dict[int | bytes, int], external: Sequence[int], ratio: int,
                  hb: int) -> int:
    """Tokens covered by the leading run of the chain's group blocks resident (a group
    block ``i`` is named by the chained hash ``external[(i + 1) * ratio - 1]``).

    >>> _chain_tokens({11: 1, 12: 1}, [10, 11, 12, 13], ratio=2, hb=4)
    8
    """
    count = 0
    for position in range(ratio - 1, len(external), ratio):
        if external[position] not in resident:
            break
        count += 1
    return count * ratio * hb


def self_paying_instances(queued_tokens: Sequence[int],
                          exact_hit_tokens: Sequence[int]) -> list[int]:
    """The instances a request may be sent to under the self-paying balance rule (an
    ablation, ``PrefixRouter(self_paying=True)``: measured to cost hits, module docstring).

    ``low`` is the instance where the request's prefill would leave the least work queued
    (smallest ``queued - exact hit``; ties: lowest index). Another instance ``i`` is
    allowed only if the extra backlog it queues behind is paid for by its own exact
    landable hit there: ``queued_i - queued_low <= exact_i``. A resident chain without a
    landable point pays nothing: locality then ranks only among equally loaded
    instances. Only a residency index can apply the rule: a full-attention-only index
    would pay with hits that may not exist (phantom tokens).

    >>> self_paying_instances([0, 500, 900], [0, 600, 0])   # 500 queued, paid by a 600-token hit
    [0, 1]
    >>> self_paying_instances([0, 500, 900], [0, 400, 0])   # 400 does not pay for 500
    [0]
    """
    n = len(queued_tokens)
    low = min(range(n), key=lambda i: (queued_tokens[i] - exact_hit_tokens[i], i))
    return [i for i in range(n)
            if queued_tokens[i] - queued_tokens[low] <= exact_hit_tokens[i]]


def bounded_load_instances(queued_tokens: Sequence[int], uncached_tokens: Sequence[int],
                           c: float, candidates: Sequence[int]) -> list[int]:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam), on
    uncached prefill work: instance ``i`` may take the request only if its backlog plus
    the request's uncached tokens there stays within ``c`` times the mean backlog after
    placing it, ``q_i + u_i <= c · (Σ q + u_i) / n``; if none may (or ``candidates`` has
    none that may), every candidate stays. The same rule for ``prefix-fa`` and
    ``prefix-residency`` (only their hit estimate ``u_i = prompt − hit_i`` differs).

    Worked example: backlogs 900, 100, 100, 100 and 200 uncached tokens everywhere: the
    mean after placing is 350, the bound 437.5, so instance 0 (1,100) is out:

    >>> bounded_load_instances([900, 100, 100, 100], [200] * 4, 1.25, range(4))
    [1, 2, 3]
    """
    n = len(queued_tokens)
    total = sum(queued_tokens)
    allowed = [i for i in candidates
               if queued_tokens[i] + uncached_tokens[i]
               <= c * (total + uncached_tokens[i]) / n]
    return allowed or list(candidates)


def make_prefix_router(num_instances: int, config: CacheConfig, trace: Trace, *,
                       residency: bool, load_weight: float,
                       locality: bool = True, self_paying: bool = False,
                       bounded_load: float | None = None) -> PrefixRouter:
    hasher = BlockHasher(config.hash_block_size, config.hash_algo,
                         config.hash_lookahead_tokens)
    return PrefixRouter(num_instances, trace, hasher, residency=residency,
                        load_weight=load_weight, locality=locality,
                        self_paying=self_paying, bounded_load=bounded_load)


__all__ = ["FULL_KINDS", "GroupLayout", "PrefixRouter", "bounded_load_instances",
           "make_prefix_router", "self_paying_instances"]
