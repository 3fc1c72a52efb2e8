"""KVCacheManager: the scheduler-facing façade.

Lifecycle of a request::

    add_request → [find_longest_hit → allocate_slots]  (admission)
                → allocate_slots … append_token_ids …  (running: prefill chunks, decode)
                → free (finish or preemption; may be admitted again) → remove_request

Token ranges at an ``allocate_slots`` call (half-open)::

    [0, num_computed)                 computed in earlier steps (or a prefix hit)
    [num_computed, num_computed + n)  the n new tokens of this step: slots allocated, and
                                      treated as computed once the call returns
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridkv import probes
from hybridkv.block import Block
from hybridkv.branch import BlockCopy
from hybridkv.config import CacheConfig
from hybridkv.coordinator import HybridCoordinator
from hybridkv.errors import (
    ConfigError,
    DoubleFreeError,
    DuplicateRequestError,
    InvariantViolation,
    RequestError,
    StaleHitError,
    UnknownRequestError,
)
from hybridkv.event_hook import EventRecorder, RequestContext
from hybridkv.eviction import EvictionOptions, EvictionPolicy
from hybridkv.hashing import BlockHasher, ExtraKeys
from hybridkv.ids import BlockHash, GroupId, ReqId
from hybridkv.managers import coarse_hashes
from hybridkv.policies import (
    PolicySpec,
    PrependPolicy,
    RetentionPolicy,
    branch_unit_tokens,
    policy_name,
)
from hybridkv.pool import BlockPool
from hybridkv.results import Allocation, PrefillPlan, PrefixHit
from hybridkv.stats import PrefixCacheStats
from hybridkv.tokens import RequestTokens
from hybridkv.views import CacheSnapshot, GroupTables, take_snapshot

if TYPE_CHECKING:
    from hybridkv.event_hook import KVEvent

__all__ = ["Allocation", "KVCacheManager", "PrefillPlan", "PrefixHit"]
"""The result types live in ``results.py``; importable from here as before."""


@dataclass(slots=True)
class _RequestState:
    token_ids: RequestTokens
    num_prompt_tokens: int
    block_hashes: list[BlockHash]
    extra_keys: ExtraKeys | None
    session_id: str | None = None
    external_hashes: bool = False
    """The engine hashes this request (``add_request(external_hashes=True)``)."""
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0
    """Of ``num_computed_tokens``, the last ones whose step has not reported back (their
    ids may be unknown yet; ``allocate_slots(in_flight=True)`` adds, ``settle`` drains)."""
    is_running: bool = False
    num_admissions: int = 0
    junction_tokens: int = 0
    bridge_end_tokens: int = 0
    window_floor_tokens: int = 0


class KVCacheManager:
    """Paged KV-cache manager with prefix caching for hybrid models.

    Args:
        config: the cache configuration (groups, pool size, hashing, EAGLE).
        retention: a ``RetentionPolicy``, a ``PolicySpec`` or a policy string
            (``PolicySpec.parse``; default ``"latest"``).
        eviction: the eviction options when the policy names none (default ``lru``).
        enable_kv_cache_events: record KV events (vLLM 0.33's ``BlockStored`` /
            ``BlockRemoved`` / ``AllBlocksCleared``, plus per-group residency) for
            ``take_events``; needs the ``events`` extra (msgspec). Off: no cost beyond one
            attribute check per pool call.

    Invariants (``check_invariants``): the pool's invariants with holders taken from every
    group's block tables; a request holds blocks ⇔ it is running; each running request's
    tables cover at least its computed tokens.
    """

    def __init__(self, config: CacheConfig,
                 retention: RetentionPolicy | PolicySpec | str = "latest",
                 eviction: EvictionOptions | None = None, *,
                 enable_kv_cache_events: bool = False) -> None:
        spec = PolicySpec.parse(retention) if isinstance(retention, str) else retention
        if isinstance(spec, PolicySpec):
            policy = spec.retention_policy()
            eviction = spec.eviction or eviction
        else:
            policy, spec = spec, PolicySpec(spec.name)
        self.recompute = spec.recompute
        """Window-recompute partial hits (policy modifier ``+recompute``)."""
        self.checkpoints = spec.checkpoints
        """Where recurrent groups write checkpoints (modifier ``+ckpt:chunk|block|branch``)."""
        eviction = eviction or EvictionOptions()
        if not config.enable_caching:
            policy = PrependPolicy()  # nothing is hashed: every freed block is scratch
            eviction = EvictionOptions()
        unit = branch_unit_tokens(self.checkpoints, config.groups[0].spec.block_size)
        if unit is not None and config.prefix_match_unit is None:  # sub-block hash unit
            config = dataclasses.replace(config, prefix_match_unit=unit)
        self.config = config
        self.retention = policy
        self.eviction = eviction
        self.policy_name = policy_name(policy.name, eviction, self.recompute, self.checkpoints)
        chain_group = next((g.group_id for g in config.groups  # compressed kinds too
                            if g.spec.is_full_attention), None)
        self.pool = _make_pool(config, eviction, chain_group)
        self.coordinator = HybridCoordinator(config, self.pool, policy,
                                             chain_group if eviction.chain or eviction.flops
                                             else None,
                                             checkpoints=self.checkpoints)
        self.hasher = BlockHasher(config.hash_block_size, config.hash_algo,
                                  config.hash_lookahead_tokens)
        # config fields read on every call, copied (the config is frozen): a compiled read
        # of an interpreted dataclass's field is a generic attribute lookup
        self._lookahead, self._caching, self._max_len = (
            config.hash_lookahead_tokens, config.enable_caching, config.max_model_len)
        """EAGLE lookahead hashes: a block's hash waits for the L tokens after it."""
        self.stats = PrefixCacheStats(
            hit_blocks_by_group=[0] * len(config.groups),
            evicted_blocks_by_group=self.pool.num_evicted_blocks,
        )
        self._requests: dict[ReqId, _RequestState] = {}
        self._no_hit_tables: tuple[tuple[Block, ...], ...] = ((),) * len(config.groups)
        self._no_new_blocks: tuple[tuple[Block, ...], ...] = self._no_hit_tables
        self.clock: Callable[[], float] = time.perf_counter
        """What ``manager_seconds`` / ``hash_seconds`` are measured with: wall time by
        default; a benchmark on a shared machine may set ``time.thread_time`` (CPU time of
        the calling thread, unaffected by other processes) before the first request."""
        self.manager_seconds = self.hash_seconds = 0.0
        """``clock`` time spent inside lookup/allocate/free (prompt hashing excluded), and
        hashing prompts in ``add_request`` (vLLM does it in its Request)."""
        self._event_log: EventRecorder | None = None
        if enable_kv_cache_events:
            self.start_kv_cache_events()

    def start_kv_cache_events(self) -> None:
        """Turn KV events on (as ``enable_kv_cache_events=True`` does) for a manager
        constructed without them, before its first request: the stream then describes
        every cached block. No-op when already on."""
        if self._event_log is not None:
            return
        if self._requests or any(b.block_hash is not None for b in self.pool.blocks):
            raise RequestError("start_kv_cache_events: the manager already has requests "
                               "or cached blocks; turn events on before the first request")
        try:
            from hybridkv.events.manager_hook import make_event_log
        except ImportError as err:  # the optional dependency is missing
            raise ConfigError("enable_kv_cache_events", True,
                              f"KV events need msgspec: pip install 'hybridkv[events]' "
                              f"({err})") from err
        self._event_log = make_event_log(self.config, self.coordinator, self.hasher.block_size)
        self.pool.event_records = self._event_log.records

    @property
    def enable_kv_cache_events(self) -> bool:
        return self._event_log is not None

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call, in order (vLLM's ``take_events``); ``[]``
        when events are off. Encode a batch with ``hybridkv.events.encode_batch``."""
        if self._event_log is None:
            return []
        return self._event_log.take_events()

    # ------------------------------------------------------------ requests
    def add_request(self, req_id: ReqId, prompt_token_ids: Sequence[int], *,
                    extra_keys: ExtraKeys | None = None, session_id: str | None = None,
                    block_hashes: Sequence[BlockHash] | None = None,
                    external_hashes: bool = False) -> None:
        """Track a request and hash its prompt (``session_id``: its conversation, used by
        session-aware eviction).

        ``external_hashes=True``: the engine hashes the request itself (vLLM's
        ``request.block_hashes``, so KV events and routers see the engine's hashes), and
        ``block_hashes`` are the hashes of its first full blocks — at most one per full
        ``hasher.block_size`` block; blocks past them are never cached until
        ``append_token_ids(block_hashes=...)`` brings theirs. hybridkv then never hashes
        this request. E.g. block 16, a 40-token prompt and an engine whose hashes wait for
        one lookahead token: 2 hashes (``[0, 16)``, ``[16, 32)``); 3 would be refused.

        ``block_hashes`` lets a caller that hashes many prompts sharing prefixes (a trace
        replayer) pass the chain it computed with ``self.hasher`` for exactly these tokens;
        it must hold one hash per full ``hasher.block_size`` block (checked by length;
        under EAGLE lookahead hashes, per block followed by ``L`` more tokens).
        The manager then keeps ``prompt_token_ids`` by reference instead of copying it (it
        reads only the ids past the last full block): the caller must not modify it.
        """
        if req_id in self._requests:
            raise DuplicateRequestError(req_id)
        if len(prompt_token_ids) == 0:
            raise ConfigError("prompt_token_ids", [], "a request needs at least one token")
        started = self.clock()
        hb = self.hasher.block_size
        num_full = self.hasher.num_hashable_blocks(len(prompt_token_ids))
        if external_hashes:
            hashes = list(block_hashes or ()) if self.config.enable_caching else []
            if len(hashes) > len(prompt_token_ids) // hb:
                raise ConfigError("block_hashes", f"<{len(hashes)} hashes>",
                                  f"at most one per full block: {len(prompt_token_ids) // hb}")
            tokens = RequestTokens(list(prompt_token_ids), len(hashes) * hb)
        elif block_hashes is not None and self.config.enable_caching:
            if len(block_hashes) != num_full:
                raise ConfigError("block_hashes", f"<{len(block_hashes)} hashes>",
                                  f"need one per full block: {num_full}")
            hashes = list(block_hashes)
            # kept by reference: only the ids past the hashed blocks are ever read
            tokens = RequestTokens(prompt_token_ids, num_full * hb)
        else:
            copied = list(prompt_token_ids)
            hashes = self.hasher.hash_blocks(copied, extra_keys=extra_keys) \
                if self.config.enable_caching else []
            tokens = RequestTokens(copied, num_full * hb)
        self.hash_seconds += self.clock() - started
        self._requests[req_id] = _RequestState(tokens, len(tokens), hashes, extra_keys,
                                               session_id=session_id,
                                               external_hashes=external_hashes)

    def append_token_ids(self, req_id: ReqId, token_ids: Sequence[int], *,
                         block_hashes: Sequence[BlockHash] | None = None,
                         as_prompt: bool = False) -> None:
        """Append generated tokens; blocks they complete become hashable.

        ``block_hashes``: for a request added with ``external_hashes=True``, the engine's
        hashes of the next full blocks (any number up to the blocks now full); required
        then (hybridkv never mixes its own hashes into an engine's chain).
        ``as_prompt``: the tokens extend the prompt (a streaming session's next input):
        every token of the request then counts as prompt.
        """
        state = self._state(req_id, "append_token_ids")
        tokens = state.token_ids
        tokens.extend(token_ids)
        if as_prompt:
            state.num_prompt_tokens = len(tokens)
        if not self._caching:
            return
        hb = self.hasher.block_size
        num_hashed = len(state.block_hashes)
        if state.external_hashes or block_hashes is not None:
            if not state.external_hashes or block_hashes is None:
                raise RequestError(f"request_id={req_id!r}: block_hashes come with "
                                   "append_token_ids exactly when the request was added "
                                   "with external_hashes=True")
            if num_hashed + len(block_hashes) > len(tokens) // hb:
                raise ConfigError("block_hashes", f"<{len(block_hashes)} hashes>",
                                  f"at most {len(tokens) // hb - num_hashed} more blocks "
                                  "are full")
            state.block_hashes.extend(block_hashes)
            return
        if (len(tokens) - self._lookahead) // hb > num_hashed:
            parent = state.block_hashes[-1] if num_hashed else None
            state.block_hashes.extend(self.hasher.hash_blocks(
                tokens[num_hashed * hb :], parent=parent, first_block_idx=num_hashed,
                extra_keys=state.extra_keys,
            ))

    def remove_request(self, req_id: ReqId) -> None:
        """Forget a request, freeing its blocks if it still holds any."""
        state = self._state(req_id, "remove_request")
        if state.is_running:  # finished: the output length reaches the eviction policy
            self._release(req_id, state, state.session_id,
                          state.token_ids.num_tokens - state.num_prompt_tokens)
        del self._requests[req_id]
        if self._event_log is not None:
            self._event_log.forget(req_id)

    # ---------------------------------------------------------------- lookup
    def find_longest_hit(self, req_id: ReqId, max_num_tokens: int | None = None) -> PrefixHit:
        """Longest prefix hit for a request about to be admitted. Does not modify the cache.

        ``max_num_tokens`` defaults to ``num_tokens - 1``: the last token is always computed.
        """
        started = self.clock()
        state = self._state(req_id, "find_longest_hit")
        if state.is_running:
            raise RequestError(f"request_id={req_id!r} is running; prefix hits apply only "
                               "at admission (free() it first to re-admit)")
        num_groups = len(self.config.groups)
        limit = state.token_ids.num_tokens - 1 if max_num_tokens is None else max_num_tokens
        limit = min(limit, state.token_ids.num_tokens - 1)
        if not self._caching or limit <= 0:
            hit = PrefixHit(req_id, 0, ((),) * num_groups, 0, self.pool.epoch)
        else:
            tables, num_tokens, extra = self.coordinator.find_longest_hit(
                state.block_hashes, limit)
            junction = num_tokens + extra if extra else 0
            replay = self.coordinator.replay_tokens
            if replay and 0 < num_tokens <= replay:  # bounded-replay: recomputing it all
                tables, num_tokens = [[] for _ in range(num_groups)], 0
            fa_tokens, missing = num_tokens, False
            if self.recompute:
                tables, num_tokens, fa_tokens, missing = self.coordinator.plan_recompute(
                    tables, num_tokens)
                if junction <= num_tokens:  # the plan reaches it: no longer a junction
                    junction = 0
            hit = PrefixHit(req_id, num_tokens, tuple(tuple(t) for t in tables), junction,
                            self.pool.epoch, fa_tokens, missing)
        self.manager_seconds += self.clock() - started
        return hit

    # ------------------------------------------------------------ allocation
    def allocate_slots(self, req_id: ReqId, num_new_tokens: int, hit: PrefixHit | None = None,
                       *, num_lookahead_tokens: int = 0, reserve_full_prompt: bool = False,
                       in_flight: bool = False) -> Allocation | None:
        """Allocate slots for ``num_new_tokens`` tokens (plus lookahead), with the hit blocks
        when admitting. Returns ``None`` — changing nothing but window releases — when the
        pool cannot provide them.

        Args:
            hit: the ``PrefixHit`` of this admission (from ``find_longest_hit`` right before).
            num_lookahead_tokens: extra slots for speculative tokens (not cached).
            reserve_full_prompt: admission gate: refuse unless the free blocks cover every
                block the whole request still needs (window groups capped at their
                working set).
            in_flight: the new tokens are *in flight* (unsettled): an engine that plans
                step ``s + 1`` before step ``s`` has reported back (async scheduling,
                draft tokens awaiting verification) allocates them before their ids are
                known, so they may run past the request's known tokens. They count as
                computed at once; only known ones are ever hashed, and window blocks
                stay held for them until ``settle`` says their step is done (or rolls
                rejected ones back). E.g. 16 known tokens, 16 computed: ``n=1,
                in_flight=True`` allocates token 16's slot; ``append_token_ids`` gives
                its id later and ``settle(req, 17)`` caches the block it completes.
        """
        started = self.clock()
        try:
            return self._allocate(req_id, num_new_tokens, hit, num_lookahead_tokens,
                                  reserve_full_prompt, in_flight)
        finally:
            self.manager_seconds += self.clock() - started

    def _allocate(self, req_id: ReqId, num_new_tokens: int,  # noqa: PLR0912 - hot path:
                  hit: PrefixHit | None,  # one function, no helper calls per step
                  num_lookahead_tokens: int, reserve_full_prompt: bool,
                  in_flight: bool = False) -> Allocation | None:
        state = self._state(req_id, "allocate_slots")
        admitting = not state.is_running
        if hit is None:
            hit_tables: Sequence[Sequence[Block]] = self._no_hit_tables
            num_hit = 0
        else:
            hit_tables, num_hit = self._checked_hit(req_id, hit, admitting)
        num_computed = state.num_computed_tokens + num_hit
        num_tokens = state.token_ids.num_tokens
        if num_new_tokens <= 0 or (num_computed + num_new_tokens > num_tokens
                                   and not in_flight):
            raise ConfigError(
                "num_new_tokens", num_new_tokens,
                f"must be in [1, {num_tokens - num_computed}] (request has {num_tokens} "
                f"tokens, {num_computed} computed)",
            )
        coordinator = self.coordinator
        if admitting and reserve_full_prompt:
            need = coordinator.num_blocks_to_allocate(
                req_id, self._cap_len(num_tokens), hit_tables, num_computed,
                apply_admission_cap=True)
            if need > self.pool.num_free_blocks:
                return None
        num_slots = self._cap_len(num_computed + num_new_tokens + num_lookahead_tokens)
        num_main = self._cap_len(num_computed + num_new_tokens)
        if admitting:
            need = coordinator.num_blocks_to_allocate(
                req_id, num_slots, hit_tables, num_computed, apply_admission_cap=False,
                num_main_tokens=num_main)
        else:
            coordinator.remove_skipped_blocks(req_id, num_computed - state.num_in_flight_tokens)
            need = coordinator.num_blocks_to_grow(req_id, num_slots, num_main)
        if need and need > self.pool.num_free_blocks:
            return None
        if admitting:
            coordinator.add_hit_blocks(req_id, hit_tables, num_hit)
            self._record_admission(state, num_hit, hit_tables, hit)
        if need or admitting:
            new_blocks: Sequence[Sequence[Block]] = coordinator.allocate_new_blocks(
                req_id, num_slots, num_main)
        else:
            new_blocks = self._no_new_blocks
        state.num_computed_tokens = num_computed + num_new_tokens
        if in_flight:
            state.num_in_flight_tokens += num_new_tokens
        hb = self.hasher.block_size
        lookahead = self._lookahead
        if self._caching and (
            admitting or in_flight or num_computed // hb != state.num_computed_tokens // hb
            or (lookahead and (lookahead > 1 or (num_computed - 1) // hb
                               != (state.num_computed_tokens - 1) // hb))
            or state.external_hashes
        ):  # no group's full-block count changes while the tokens stay inside one hb block
            # (under lookahead hashes, nor while the hashed tokens do: a decode step's
            # token can complete the hash of the block before it; an engine's hashes may
            # arrive any step after their block was computed)
            cacheable = min(state.num_computed_tokens, num_tokens) - max(0, lookahead - 1)
            coordinator.cache_blocks(req_id, state.block_hashes, cacheable,
                                     state.num_prompt_tokens, state.junction_tokens,
                                     state.bridge_end_tokens if state.window_floor_tokens
                                     else 0)
            if self._event_log is not None:
                self._flush_events(req_id, state)
        return Allocation(num_computed, num_new_tokens, num_hit, tuple(new_blocks))

    def _flush_events(self, req_id: ReqId, state: _RequestState) -> None:
        assert self._event_log is not None
        self._event_log.flush(RequestContext(req_id, state.block_hashes, state.token_ids,
                                             state.extra_keys, state.session_id))

    def settle(self, req_id: ReqId, num_computed_tokens: int,
               num_in_flight_tokens: int = 0) -> None:
        """A running request's steps reported back: it now has ``num_computed_tokens``
        computed tokens (at most as many as before: lower means rejected draft tokens
        roll back), of which the last ``num_in_flight_tokens`` are still in flight. Blocks
        that the settled tokens with known ids fill become cached (vLLM's
        ``cache_blocks(request, num_computed - num_in_flight)``); the slots of rolled-back
        tokens stay allocated for the next step. Tokens below are never un-computed: a
        rollback below known tokens only means recomputing their (identical) KV. Settled
        tokens (``computed - in flight``) never go back: window blocks before them may
        have left the table already (refused with ``ConfigError``).

        E.g. 32 computed after ``allocate_slots(r, 4, in_flight=True)`` (1 token + 3
        drafts, known 29), the step accepts 1 draft: ``append_token_ids(r, [a, b])``
        (accepted + bonus), then ``settle(r, 30)``: 2 draft slots roll back, blocks
        inside ``[0, 30)`` are cached.
        """
        state = self._state(req_id, "settle")
        if not state.is_running:
            raise RequestError(f"request_id={req_id!r} is not running; settle applies to "
                               "a request that holds blocks")
        settled_before = state.num_computed_tokens - state.num_in_flight_tokens
        if not (0 <= num_in_flight_tokens <= num_computed_tokens
                <= state.num_computed_tokens) \
                or num_computed_tokens - num_in_flight_tokens < settled_before:
            raise ConfigError("num_computed_tokens", num_computed_tokens,
                              f"need 0 <= in flight ({num_in_flight_tokens}) <= computed "
                              f"<= {state.num_computed_tokens}, and computed - in flight "
                              f">= {settled_before} (settled tokens never roll back)")
        started = self.clock()
        state.num_computed_tokens = num_computed_tokens
        state.num_in_flight_tokens = num_in_flight_tokens
        if self._caching:
            settled = min(num_computed_tokens - num_in_flight_tokens,
                          state.token_ids.num_tokens)
            self.coordinator.cache_blocks(
                req_id, state.block_hashes, settled - max(0, self._lookahead - 1),
                state.num_prompt_tokens, state.junction_tokens,
                state.bridge_end_tokens if state.window_floor_tokens else 0)
            if self._event_log is not None:
                self._flush_events(req_id, state)
        self.manager_seconds += self.clock() - started

    def truncate_tokens(self, req_id: ReqId, num_tokens: int) -> None:
        """Drop the request's tokens from ``num_tokens`` on (a streaming session
        discarding its last sampled token before the next input arrives), with the
        hashes of blocks no longer full. Computed tokens are never dropped:
        ``num_computed_tokens <= num_tokens <= current``; under EAGLE lookahead hashes
        not the token after them either (a cached block's hash covers it). Nor the
        tokens of the request's cached blocks (with their lookahead), which ``settle``
        may have rolled back below: the block would keep its hash while the step after
        writes the new tokens' KV into it. The prompt shrinks with it. Engine hashes
        (``external_hashes``) are taken to cover the lookahead tokens after their block as
        vLLM's do: ``(num_tokens - L) // hb`` of them stay, as for hybridkv's own.

        E.g. 40 tokens (block 16: 2 hashes), 33 computed: ``truncate_tokens(r, 35)``
        keeps both hashes; ``truncate_tokens(r, 33)`` then too (33 // 16 = 2).
        """
        state = self._state(req_id, "truncate_tokens")
        tokens = state.token_ids
        cached = max(m.num_cached_blocks.get(req_id, 0) * m.block_size
                     for m in self.coordinator.managers)
        least = max(1, state.num_computed_tokens + min(self._lookahead, 1),
                    cached + self._lookahead if cached else 0)
        if not least <= num_tokens <= tokens.num_tokens:
            raise ConfigError("num_tokens", num_tokens,
                              f"must be in [{least}, {tokens.num_tokens}] (computed "
                              f"{state.num_computed_tokens}, cached blocks end at {cached}, "
                              f"lookahead {self._lookahead})")
        tokens.truncate(num_tokens)
        state.num_prompt_tokens = min(state.num_prompt_tokens, num_tokens)
        num_full = max(0, (num_tokens - self._lookahead) // self.hasher.block_size)
        del state.block_hashes[num_full:]
        if self._event_log is not None:
            self._event_log.truncate(req_id, num_full)

    def _checked_hit(self, req_id: ReqId, hit: PrefixHit, admitting: bool,
                     ) -> tuple[Sequence[Sequence[Block]], int]:
        if not (hit.num_tokens or any(hit._tables)):
            return self._no_hit_tables, 0
        if not admitting or hit.req_id != req_id:
            raise RequestError(f"request_id={req_id!r}: a PrefixHit applies only to the "
                               "admission of the request it was looked up for")
        if hit.epoch != self.pool.epoch:
            raise StaleHitError(req_id, hit.epoch, self.pool.epoch)
        return hit._tables, hit.num_tokens

    def _record_admission(self, state: _RequestState, num_hit: int,
                          hit_tables: Sequence[Sequence[Block]], hit: PrefixHit | None) -> None:
        self.stats.record(state.token_ids.num_tokens, num_hit, preempted=state.num_admissions > 0)
        if state.num_admissions == 0:
            self.coordinator.note_admission(state.block_hashes)
        for group_id, table in enumerate(hit_tables):
            self.stats.hit_blocks_by_group[group_id] += sum(1 for b in table if not b.is_null)
        state.num_admissions += 1
        state.is_running = True
        state.junction_tokens = hit.junction_tokens if hit is not None else 0
        state.bridge_end_tokens = hit.full_attention_tokens if hit is not None else 0
        state.window_floor_tokens = num_hit if hit is not None and hit.is_window_missing \
            else 0
        if hit is not None:
            self.stats.record_bridge(hit.num_bridge_tokens)
            if num_hit and self.coordinator.replay_tokens:  # bounded-replay's window
                self.stats.record_bridge(min(num_hit, self.coordinator.replay_tokens))

    def _cap_len(self, num_tokens: int) -> int:
        max_len = self._max_len
        return num_tokens if max_len is None else min(num_tokens, max_len)

    def free(self, req_id: ReqId) -> None:
        """Release all blocks of a request (finish or preemption); it may be admitted again,
        recomputing from token 0 (or a new prefix hit). ``predict`` eviction treats it as a
        preemption (no output-length signal): finished requests leave by ``remove_request``.
        A request never admitted (e.g. aborted while waiting) holds nothing: a no-op."""
        self._release(req_id, self._state(req_id, "free"), None, None)

    def _release(self, req_id: ReqId, state: _RequestState, session_id: str | None,
                 num_output_tokens: int | None) -> None:
        """``num_output_tokens``: tokens appended since the prompt, for a finished request
        (``predict`` eviction's signal); ``None`` on preemption (unknown: treated as live)."""
        started = self.clock()
        if not state.is_running:
            if state.num_admissions == 0:
                return  # never admitted (e.g. aborted while waiting): nothing to free
            raise DoubleFreeError(req_id)
        self.coordinator.free(req_id, session_id, num_output_tokens)
        state.is_running = False
        state.num_computed_tokens = state.num_in_flight_tokens = 0
        state.junction_tokens = 0
        state.bridge_end_tokens = state.window_floor_tokens = 0
        self.manager_seconds += self.clock() - started

    def new_step(self) -> None:
        """Per-step hook: a scheduler calls it before planning each step (recurrent groups
        defer hits on checkpoints hashed in the current step)."""
        self.coordinator.new_step()

    def take_block_copies(self) -> list[BlockCopy]:
        """``ckpt:branch``: the block copies the engine runs for the allocations since the
        last call (copy-on-write hits before the forward pass, snapshots after it); empty
        for every other policy. Undrained copies are dropped at ``new_step``."""
        branch = self.coordinator.branch
        return [] if branch is None else branch.take_copies()

    def align_prefill_chunk(self, req_id: ReqId, num_new_tokens: int,
                            hit: PrefixHit | None = None, *,
                            max_chunk_tokens: int | None = None) -> int:
        """Clip the next chunk of ``num_new_tokens`` tokens (after ``hit`` when admitting)
        so a model with recurrent groups ends it where a checkpoint must be written; 0
        means no aligned chunk fits (schedule the request later). Unchanged for models
        without recurrent groups. ``max_chunk_tokens``: the scheduler's per-step token
        budget (default ``max_num_batched_tokens``)."""
        state = self._state(req_id, "align_prefill_chunk")
        num_computed = state.num_computed_tokens
        junction = state.junction_tokens
        if hit is not None and not state.is_running:
            num_computed += hit.num_tokens
            junction = hit.junction_tokens
        return self.coordinator.align_prefill_chunk(
            num_computed, num_new_tokens, num_tokens=state.token_ids.num_tokens,
            num_prompt_tokens=state.num_prompt_tokens, junction_tokens=junction,
            max_chunk_tokens=max_chunk_tokens or self.config.max_num_batched_tokens)

    # -------------------------------------------------- engine-facing maintenance
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after a weight update), as vLLM's
        ``reset_prefix_cache``: only while no request holds blocks; returns whether it did.

        Every hash is dropped (waiting requests keep theirs: they simply miss), freed
        blocks go back to the free queue as scratch, outstanding ``PrefixHit`` values go
        stale. Not counted as evictions.
        """
        pool = self.pool
        if pool.num_free_blocks != pool.num_blocks - 1:
            return False
        records, pool.event_records = pool.event_records, None
        pool.drop_cached([b for b in pool.blocks if b.block_hash is not None])
        pool.event_records = records
        if self._event_log is not None:
            self._event_log.clear()  # one AllBlocksCleared, as vLLM
        pool.epoch += 1
        return True

    def evict_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None,
                     ) -> int:
        """Drop the cached blocks of one prefix in every group; returns how many.

        ``token_ids`` (with the ``extra_keys`` it was sent with) names the prefix; its full
        blocks are hashed as a request's would be, and every cached copy of each of those
        block hashes, in every group, loses its hash. Blocks a running request holds keep
        their KV for it (they can no longer be hit and free as scratch); free ones move to
        the head of the free queue. Cached blocks of longer prefixes that extend this one
        keep their hashes, but no full-attention hit can reach them without these blocks.
        Outstanding ``PrefixHit`` values go stale when anything was dropped.
        """
        if not self.config.enable_caching:
            return 0
        hashes = self.hasher.hash_blocks(list(token_ids), extra_keys=extra_keys)
        hb = self.hasher.block_size
        doomed: list[Block] = []
        branch = self.coordinator.branch is not None  # its snapshots sit at every unit
        for group in self.config.groups:
            for block_hash in hashes if branch else \
                    coarse_hashes(hashes, group.spec.block_size // hb):
                doomed.extend(self.pool.cached_copies(block_hash, group.group_id))
        return self.pool.drop_cached(doomed)

    def probe_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None,
                     ) -> int:
        """Tokens of ``token_ids`` a request sending exactly them would hit now (at most
        ``len - 1``), without adding a request or changing anything: how much of a prompt
        is cached, for a router or an admission estimate."""
        if not self.config.enable_caching or len(token_ids) < 2:
            return 0
        hashes = self.hasher.hash_blocks(list(token_ids), extra_keys=extra_keys)
        _, num_tokens, _ = self.coordinator.find_longest_hit(hashes, len(token_ids) - 1)
        return num_tokens

    def snapshot(self) -> CacheSnapshot:
        """A frozen copy of the cache's state: every cached block (group, hash, holders,
        free queue), the free-queue order allocation follows, per-group usage. O(pool)."""
        return take_snapshot(self.pool, self.config.groups, self.coordinator.managers)

    # --------------------------------------------------------------- queries
    def get_block_ids(self, req_id: ReqId) -> tuple[tuple[int, ...], ...]:
        """Per group, the request's block table (0 = null block: KV not needed)."""
        self._state(req_id, "get_block_ids")
        return tuple(tuple(m.block_ids(req_id)) for m in self.coordinator.managers)

    def group_tables(self, group_id: GroupId) -> GroupTables:
        """Live read-only view of group ``group_id``'s block tables (``GroupTables``)."""
        manager = self.coordinator.managers[group_id]
        return GroupTables(manager.tables, manager.num_cached_blocks)

    def prefill_plan(self, req_id: ReqId) -> PrefillPlan:
        """How the running request's KV below its computed tokens came to be (engines
        executing a window-recompute bridge read this). Does not modify."""
        state = self._state(req_id, "prefill_plan")
        return PrefillPlan(state.bridge_end_tokens, state.window_floor_tokens)

    def num_computed_tokens(self, req_id: ReqId) -> int:
        return self._state(req_id, "num_computed_tokens").num_computed_tokens

    def num_tokens(self, req_id: ReqId) -> int:
        return self._state(req_id, "num_tokens").token_ids.num_tokens

    def is_running(self, req_id: ReqId) -> bool:
        return self._state(req_id, "is_running").is_running

    def token_ids(self, req_id: ReqId) -> Sequence[int]:
        return self._state(req_id, "token_ids").token_ids

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    # ------------------------------------------------ admission growth probes
    @property
    def lookup_version(self) -> tuple[int, int]:
        """(pool epoch, hashes ever indexed). Equal epochs ⇒ an earlier ``PrefixHit`` is
        still valid and no hash left the index (only allocations evict); equal second
        parts ⇒ no new hash entered it (caching), so no hit grew. Both equal ⇒
        ``find_longest_hit`` answers every request as before. A scheduler probing many
        waiting requests keeps their answers while it holds (``sim/admission.py``)."""
        return probes.lookup_version(self.pool, len(self.config.groups))

    def may_extend(self, req_id: ReqId, num_tokens: int, matched_tokens: int = 0) -> bool:
        """False ⇒ no hit longer than ``num_tokens`` exists for the request now, given that
        full attention matched ``matched_tokens`` (``>= num_tokens``; a junction or bridge
        end) when it was last looked up: no full-attention group has gained the block at
        ``max(num_tokens, matched_tokens)`` (full attention bounds every hybrid hit), and no
        other group holds a block of the request's chain in ``(num_tokens,
        matched_tokens]`` (a window tail there could make a hit). True otherwise, and for a
        model without full attention. Does not modify; dictionary probes only
        (``probes.py``)."""
        state = self._state(req_id, "may_extend")
        if not self.config.enable_caching:
            return False
        return probes.may_extend(self.pool, self.coordinator.managers, state.block_hashes,
                                 self.hasher.block_size, num_tokens, matched_tokens)

    def growth_probes(self, req_id: ReqId, num_tokens: int, matched_tokens: int = 0,
                      ) -> probes.Probes | None:
        """``may_extend``'s dictionary probes, precomputed: ``may_extend(req_id,
        num_tokens, matched_tokens)`` is, at any later time while the request waits,
        ``any(h in index for index, h in probes)`` (the indexes are the pool's live ones).
        ``None``: always true (no full attention)."""
        return probes.flatten(self.growth_probe_parts(req_id, num_tokens, matched_tokens))

    def growth_probe_parts(self, req_id: ReqId, num_tokens: int, matched_tokens: int = 0,
                           ) -> tuple[probes.Probes, probes.WindowProbes] | None:
        """``growth_probes`` split, the long part as slices: the full-attention (index,
        hash) pairs, and per other group its index with the hashes probed inside the
        match (one C-level slice of the chain each, instead of a pair per block: a
        100k-token match whose window tail is gone has ~1,500 of them at 64-token
        blocks). Flattened, the same probes in the same order; ``None`` as there."""
        state = self._state(req_id, "growth_probe_parts")
        if not self.config.enable_caching:
            return (), ()
        return probes.growth_probe_parts(self.pool, self.coordinator.managers,
                                         state.block_hashes, self.hasher.block_size,
                                         num_tokens, matched_tokens)

    def hashes_indexed_since(self, marks: Sequence[int] | None,
                             ) -> tuple[list[int], tuple[list[BlockHash], list[BlockHash]]
                                        | None]:
        """The hashes that entered the full-attention groups' indexes and those that
        entered the other groups' indexes since ``marks`` (this method's earlier answer;
        ``None``: none yet), and the marks for next time. ``None`` for the hashes: not
        known (a first call, or an index that shrank other than by eviction:
        ``reset_prefix_cache``, ``evict_prefix``): the caller checks every probe itself.
        Hashes indexed and evicted since are absent; a few indexed earlier may be listed.
        Does not modify (an admission order marks the waiting requests these concern)."""
        return probes.hashes_indexed_since(self.pool, self.coordinator.managers, marks)

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def request_ids(self) -> list[ReqId]:
        return list(self._requests)

    def _state(self, req_id: ReqId, action: str) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            raise UnknownRequestError(req_id, action)
        return state

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` if any documented invariant is broken."""
        self.pool.check_invariants(self.coordinator.holders())
        for manager in self.coordinator.managers:
            for req_id, table in manager.tables.items():
                state = self._requests.get(req_id)
                if state is None or not state.is_running:
                    raise InvariantViolation(f"group {manager.group_id} holds a table for "
                                             f"{req_id!r}, which is not running")
                if manager.num_cached_blocks.get(req_id, 0) > len(table):
                    raise InvariantViolation(f"{req_id!r}: more cached than held blocks")
                if not manager.covers_computed_tokens:  # a ring: one block, rewritten
                    if len(table) > 1:
                        raise InvariantViolation(f"{req_id!r}: ring of {len(table)} blocks")
                    continue
                covered = len(table) * manager.block_size
                if covered < min(state.num_computed_tokens,
                                 self._cap_len(state.token_ids.num_tokens)):
                    raise InvariantViolation(f"{req_id!r}: table shorter than computed tokens")
                if covered < self.coordinator.covered_tokens(req_id):
                    raise InvariantViolation(f"{req_id!r}: group {manager.group_id} covers "
                                             f"{covered} slots, fewer than remembered")
        for checked in (*self.coordinator.managers, self.coordinator.branch):
            check = getattr(checked, "check_invariants", None)
            if check is not None:
                check()
        for req_id, state in self._requests.items():
            if state.is_running and any(
                req_id not in m.tables for m in self.coordinator.managers
            ):
                raise InvariantViolation(f"{req_id!r} is running without block tables")


def _make_pool(config: CacheConfig, eviction: EvictionOptions, chain_group: GroupId | None,
               ) -> BlockPool:
    """The block pool, with its eviction policy unless that is plain ``lru``."""
    evictor = None if eviction.name == "lru" else \
        EvictionPolicy(eviction, config.num_blocks, chain_group,
                       [g.spec for g in config.groups])
    pool = BlockPool(config.num_blocks, len(config.groups), evictor)
    if evictor is not None:
        evictor.bind(pool)
    return pool
