"""The engine loop: the shared ``Scheduler`` drives the model over paged KV, through the one
drive loop (``hybridkv.sched.driver.Driver``; the model's step is its ``execute``).

One step::

    plan = scheduler.schedule()               admissions, prefill chunks, decode tokens
    for each layer, for each chunk in plan order:
        write the chunk's K/V at the slots of its positions (block tables read after
        schedule() returned), gather the K/V its queries read, attend
    sample greedily for chunks that reach their request's last known token
    scheduler.update(plan, sampled)

Window-recompute bridges (policies with ``+recompute``) need nothing from the loop but the
request's ``KVCacheManager.prefill_plan``: ``engine.bridge.chunk_span`` turns it into the
keys each chunk reads and the K/V it writes (full layers never write below the cached end).

Sub-block hits (``ckpt:branch``) add block copies (``KVCacheManager.take_block_copies``,
drained right after ``schedule()``): copy-on-write copies run before the forward pass (a
hitting request's private copy of a snapshot: the KV slots ``[p // bs * bs, p)`` of a
full-attention page, or a recurrent group's state after ``p`` tokens), snapshot copies
after it (a branch point's KV / state, which the step itself writes).

Chunks run in plan order inside each layer, so a request admitted in the same step as the
request that writes its hit blocks reads them after they are written. Token ids are
reduced modulo the vocabulary for the embedding; the cache manager hashes the original ids.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.branch import BlockCopy
from hybridkv.cache import KVCacheManager, PrefillPlan
from hybridkv.config import CacheConfig
from hybridkv.engine.attention import AttentionFn, AttentionRule, reference_attention
from hybridkv.engine.bridge import check_span, chunk_span
from hybridkv.engine.checkpoints import PagedStateCache, checkpoint_stops
from hybridkv.engine.gated_delta import Projected, Recurrence
from hybridkv.engine.model import AttendFn, HybridDecoder, MixFn
from hybridkv.engine.paged import PagedKVCache
from hybridkv.engine.recurrent import gated_delta_reference
from hybridkv.errors import CapacityError, ConfigError
from hybridkv.sched.driver import Driver
from hybridkv.sched.scheduler import SchedRequest, ScheduledChunk, Scheduler, StepPlan
from hybridkv.sim.replay import ReplayObserver


@dataclass(slots=True)
class RequestRecord:
    """What one request did in one run.

    Attributes:
        sampled_logits: per sampled token, the logits row it was drawn from (float64, CPU;
            empty when the runner does not record logits).
        hit_tokens: prefix-hit tokens at each admission (re-admissions after preemption
            append).
        prefill_plans: the manager's ``PrefillPlan`` at each admission: a bridge when
            ``full_attention_cached_tokens`` exceeds the hit, cold when
            ``window_floor_tokens > 0``.
        admitted_s / first_token_s: ``time.perf_counter()`` at the start of the step that
            first admitted the request, and after the step that sampled its first token
            (device synchronised).
        eligible_step / admitted_step: the scheduler's steps (1-based) at which the request
            became eligible (its session's previous request finished, its phase opened) and
            was first admitted; the admission order decides what happens in between.
        eligible_s: ``time.perf_counter()`` at the start of step ``eligible_step``.
    """

    req_id: str
    num_prompt_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    sampled_logits: list[torch.Tensor] = field(default_factory=list)
    hit_tokens: list[int] = field(default_factory=list)
    prefill_plans: list[PrefillPlan] = field(default_factory=list)
    num_computed_tokens: int = 0
    admitted_s: float | None = None
    first_token_s: float | None = None
    eligible_step: int | None = None
    admitted_step: int | None = None
    eligible_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        """Seconds from first admission to the first sampled token."""
        if self.admitted_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.admitted_s

    @property
    def queued_ttft_s(self) -> float | None:
        """Seconds from eligibility to the first sampled token: the TTFT a client sees,
        waiting in the queue included (what an admission order changes)."""
        if self.eligible_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.eligible_s


@dataclass(slots=True)
class RunResult:
    """A finished run: per-request records and run-wide counters."""

    policy: str
    records: dict[str, RequestRecord]
    num_steps: int
    num_preemptions: int
    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int
    wall_s: float
    bridge_tokens: int = 0
    """Tokens recomputed by window-recompute bridges (the manager's ``stats``)."""
    block_copies: int = 0
    """``ckpt:branch`` block copies run (snapshots and copy-on-write hits, per group)."""
    sub_block_hits: int = 0
    """``ckpt:branch`` admissions whose hit ends inside a block (copy-on-write hits)."""

    @property
    def total_hit_tokens(self) -> int:
        """Hit tokens over every admission (re-admissions included)."""
        return sum(sum(r.hit_tokens) for r in self.records.values())

    @property
    def num_cold_bridges(self) -> int:
        """Admissions whose bridge started cold (window KV before the hit missing)."""
        return sum(1 for r in self.records.values() for p in r.prefill_plans
                   if p.window_floor_tokens > 0)

    def admissions(self) -> Admissions:
        """Per request: (eligible step, first admitted step, hit tokens at that admission),
        the shape ``scheduler_admissions`` gives for a bare scheduler."""
        return {rid: (r.eligible_step or 0, r.admitted_step or 0, r.hit_tokens[0])
                for rid, r in self.records.items()}


Admissions = dict[str, tuple[int, int, int]]
"""Request id → (eligible step, first admitted step, hit tokens at that admission)."""


def scheduler_admissions(scheduler: Scheduler,
                         outputs: dict[str, Sequence[int]]) -> Admissions:
    """Drive a bare shared ``Scheduler`` (requests already added, no model) to the end,
    sampling for each request the tokens ``outputs`` lists (what an engine run sampled);
    returns each request's admission, to compare with ``RunResult.admissions()``: an engine
    that admits through the shared admission order gives the same dictionary.

    Example: two requests whose engine run sampled ``{"a": [5], "b": [7]}`` give e.g.
    ``{"a": (0, 0, 0), "b": (0, 0, 0)}`` under fcfs with two running slots."""
    position = dict.fromkeys(outputs, 0)

    def replay_outputs(plan: StepPlan) -> dict[str, int]:
        sampled = {}
        for chunk in plan.chunks:
            if chunk.samples:
                sampled[chunk.req_id] = outputs[chunk.req_id][position[chunk.req_id]]
                position[chunk.req_id] += 1
        return sampled

    Driver(scheduler, replay_outputs).run_to_end()
    return {r.req_id: (r.eligible_step or 0, r.admitted_step or 0, r.first_hit_tokens or 0)
            for r in scheduler.requests.values()}


@dataclass(slots=True)
class _Work:
    """One scheduled chunk, resolved against the block tables."""

    chunk: ScheduledChunk
    row: int
    write_slots: list[torch.Tensor]
    write_skips: list[int]
    read_slots: list[torch.Tensor]
    read_starts: list[int]
    state_reads: dict[int, int] = field(default_factory=dict)
    """Recurrent group → block holding the checkpoint the chunk resumes from (absent at
    token 0)."""
    state_writes: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Recurrent group → ``(token count, block)`` of each checkpoint the chunk writes."""

    @property
    def start(self) -> int:
        return self.chunk.num_computed_tokens

    @property
    def num_tokens(self) -> int:
        return self.chunk.num_new_tokens


def vocab_ids(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Embedding rows of (possibly huge) token ids: ``id mod vocab_size``."""
    return (torch.tensor(token_ids, dtype=torch.int64) % vocab_size).to(device)


def _note_waits(records: dict[str, RequestRecord], scheduler: Scheduler,
                step_starts: Sequence[float]) -> None:
    """Copy each request's eligibility and first admission step from the scheduler, and
    the wall time of its eligibility step (``step_starts[i]``: start of step ``i + 1``)."""
    for req_id, record in records.items():
        request = scheduler.requests[req_id]
        record.eligible_step, record.admitted_step = request.eligible_step, \
            request.admitted_step
        if request.eligible_step is not None:
            record.eligible_s = step_starts[request.eligible_step - 1]


def _copy_request(request: SchedRequest) -> SchedRequest:
    return SchedRequest(request.req_id, list(request.prompt_token_ids),
                        request.max_output_tokens, request.session_id, request.phase,
                        request.tag)


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How a runner schedules and what it records.

    Attributes:
        policy: retention policy name (ignored when caching is off).
        chunk_size / max_running: the scheduler's token budget per step and running cap.
        record_logits: keep every sampled logits row (for ``verify``; costly for a big
            vocabulary).
        poison: fill fresh KV pages with NaN (see ``PagedKVCache``).
    """

    policy: str = "latest"
    chunk_size: int = 8192
    max_running: int = 16
    record_logits: bool = True
    poison: bool = False
    admission: str = "fcfs"
    """Admission order of the shared scheduler (``hybridkv.sched.admission.ORDERS``)."""
    observers: tuple[ReplayObserver, ...] = ()
    """KV events / metrics of the run (``hybridkv.sim.observe.KVEventStream``,
    ``hybridkv.sim.metrics.ReplayMetrics``): attached to the run's manager and scheduler,
    called after every step."""


def _check_reused_pages(argument: str, pages: PagedKVCache | PagedStateCache,
                        cache_config: CacheConfig) -> None:
    """Raise ``ConfigError`` unless ``pages`` (passed as ``argument``) were built for
    ``cache_config``'s groups and pool size: pages of a 64-block pool cannot serve a
    128-block one (block ids 64..127 would index past them)."""
    if (pages.config.groups != cache_config.groups
            or pages.config.num_blocks != cache_config.num_blocks):
        raise ConfigError(argument, f"<{type(pages).__name__}>",
                          "pages were built for other cache groups or pool size")


class EngineRunner:
    """Runs workloads through ``model`` with one cache configuration and policy.

    Args:
        model: the decoder.
        cache_config: groups must cover the model's layers (``cache_config_for_model``).
        options: policy, scheduling and recording (``RunOptions``).
        attention: ``reference_attention`` (exact, float64), ``sdpa_attention`` or a
            ``engine.flex.FlexAttention``.
        kv_cache: reuse pages across runners (same ``CacheConfig`` shape).
        recurrence: the Gated DeltaNet path of ``linear_attention`` layers
            (``gated_delta_reference``: exact, float64; ``gated_delta_chunked``).
        state_cache: reuse checkpoint pages across runners (same ``CacheConfig`` shape).
        state_dtype: storage of recurrent states (default float32, float64 for a float64
            model).
    """

    def __init__(self, model: HybridDecoder, cache_config: CacheConfig,
                 options: RunOptions | None = None, *,
                 attention: AttentionFn = reference_attention,
                 kv_cache: PagedKVCache | None = None,
                 recurrence: Recurrence = gated_delta_reference,
                 state_cache: PagedStateCache | None = None,
                 state_dtype: torch.dtype | None = None) -> None:
        mcfg = model.config
        self.model = model
        self.cache_config = cache_config
        self.options = options = options or RunOptions()
        self.attention = attention
        self.rules = [AttentionRule.for_layer(mcfg, i) for i in range(mcfg.num_layers)]
        self.group_rules = self._group_rules(cache_config)
        if kv_cache is None:
            kv_cache = PagedKVCache(cache_config, num_kv_heads=mcfg.num_kv_heads,
                                    head_dim=mcfg.head_dim, dtype=model.dtype,
                                    device=model.device, poison=options.poison)
        else:
            _check_reused_pages("kv_cache", kv_cache, cache_config)
        self.kv_cache = kv_cache
        self.recurrence = recurrence
        if state_cache is None:
            wide = torch.float64 if model.dtype == torch.float64 else torch.float32
            state_cache = PagedStateCache(cache_config, mcfg, conv_dtype=model.dtype,
                                          state_dtype=state_dtype or wide,
                                          device=model.device, poison=options.poison)
        else:
            _check_reused_pages("state_cache", state_cache, cache_config)
        self.state_cache = state_cache
        self.scheduler: Scheduler | None = None
        self.manager: KVCacheManager | None = None

    def _group_rules(self, cache_config: CacheConfig) -> list[AttentionRule]:
        covered = sorted(i for g in cache_config.groups for i in g.layer_ids)
        if covered != list(range(len(self.rules))):
            raise ConfigError("cache_config.groups", covered,
                              f"must cover layers 0..{len(self.rules) - 1} exactly once")
        rules = []
        for group in cache_config.groups:
            kinds = {self.rules[i] for i in group.layer_ids}
            if len(kinds) != 1:
                raise ConfigError("cache_config.groups", group.layer_ids,
                                  "layers of one cache group must share one attention rule")
            rules.append(kinds.pop())
        return rules

    # ------------------------------------------------------------------ loop
    def run(self, requests: Iterable[SchedRequest]) -> RunResult:
        """Run ``requests`` (copied; the originals are not mutated) to completion."""
        opts = self.options
        manager = KVCacheManager(self.cache_config, opts.policy)
        scheduler = Scheduler(manager, max_running=opts.max_running, chunk_size=opts.chunk_size,
                              admission=opts.admission)
        self.manager, self.scheduler = manager, scheduler
        for observer in opts.observers:
            observer.attach(manager, scheduler, opts.policy)
        records: dict[str, RequestRecord] = {}
        for request in requests:
            scheduler.add_request(_copy_request(request))
            records[request.req_id] = RequestRecord(request.req_id,
                                                    len(request.prompt_token_ids))
        run_started = time.perf_counter()
        loop = _EngineLoop(self, manager, records)
        driver = Driver(scheduler, loop.execute, clock=_PerfCounter(), on_step=loop.on_step)
        loop.driver = driver
        driver.run_to_end()
        for observer in opts.observers:
            observer.detach(manager, scheduler, None)
        _note_waits(records, scheduler, loop.step_starts)
        stats = manager.stats
        return RunResult(opts.policy, records, scheduler.num_steps, scheduler.num_preemptions,
                         stats.queries, stats.hits, loop.computed,
                         time.perf_counter() - run_started, stats.bridge_tokens,
                         loop.num_copies, loop.sub_block_hits)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Run ``ckpt:branch`` block copies in order: a recurrent group's checkpoint, or
        the full-attention KV of the copy's position inside its block (``num_tokens % bs``
        slots: a copy at token 400 of 784-token blocks moves slots ``[0, 400)``)."""
        for copy in copies:
            if copy.group_id in self.state_cache.group_ids:
                self.state_cache.copy_block(group_id=copy.group_id,
                                            src_block_id=copy.src_block_id,
                                            dst_block_id=copy.dst_block_id)
            else:
                bs = self.cache_config.groups[copy.group_id].spec.block_size
                self.kv_cache.copy_block(group_id=copy.group_id,
                                         src_block_id=copy.src_block_id,
                                         dst_block_id=copy.dst_block_id,
                                         num_tokens=copy.num_tokens % bs)

    def _execute(self, manager: KVCacheManager, plan: StepPlan,
                 records: dict[str, RequestRecord]) -> dict[str, int]:
        works: list[_Work] = []
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        logit_rows: list[int] = []
        for chunk in plan.chunks:
            start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens
            works.append(self._resolve(manager, chunk, len(token_ids)))
            token_ids.extend(manager.token_ids(chunk.req_id)[start:end])
            positions.append(torch.arange(start, end))
            if chunk.samples:
                logit_rows.append(len(token_ids) - 1)
        device = self.model.device
        logits = self.model(vocab_ids(token_ids, self.model.config.vocab_size, device),
                            torch.cat(positions).to(device), self._attend_fn(works),
                            torch.tensor(logit_rows, dtype=torch.int64).to(device),
                            self._mix_fn(works))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samplers = [w.chunk.req_id for w in works if w.chunk.samples]
        tokens = logits.argmax(dim=-1).tolist()
        if self.options.record_logits:
            rows = logits.to("cpu", torch.float64)
            for index, req_id in enumerate(samplers):
                records[req_id].sampled_logits.append(rows[index])
        return dict(zip(samplers, tokens, strict=True))

    def _resolve(self, manager: KVCacheManager, chunk: ScheduledChunk, row: int) -> _Work:
        start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens
        tables = manager.get_block_ids(chunk.req_id)
        plan = manager.prefill_plan(chunk.req_id)
        write, skips, read, read_starts = [], [], [], []
        empty = torch.empty(0, dtype=torch.int64)
        state_reads: dict[int, int] = {}
        state_writes: dict[int, list[tuple[int, int]]] = {}
        for group_id, rule in enumerate(self.group_rules):
            if group_id in self.state_cache.group_ids:
                self._resolve_states(chunk, group_id, tables[group_id], state_reads,
                                     state_writes)
                write.append(empty)
                skips.append(0)
                read.append(empty)
                read_starts.append(start)
                continue
            span = chunk_span(rule, start, end, plan)
            check_span(span, rule, plan, req_id=chunk.req_id, group_id=group_id)
            slots = self.kv_cache.slots(req_id=chunk.req_id, group_id=group_id,
                                        table=tables[group_id], start=span.read_start, end=end)
            read.append(slots)
            read_starts.append(span.read_start)
            write.append(slots[span.write_start - span.read_start :])
            skips.append(span.num_skipped_writes(start))
        return _Work(chunk, row, write, skips, read, read_starts, state_reads, state_writes)

    def _resolve_states(self, chunk: ScheduledChunk, group_id: int, table: Sequence[int],
                        reads: dict[int, int], writes: dict[int, list[tuple[int, int]]]) -> None:
        """The checkpoint a recurrent group's chunk resumes from and those it writes: at
        every block end inside the chunk and at its end, into the table's entry for that
        token count; entries the manager left null (not kept) are not written."""
        start = chunk.num_computed_tokens
        end = start + chunk.num_new_tokens
        cache = self.state_cache
        if start > 0:
            reads[group_id] = cache.block_for(req_id=chunk.req_id, group_id=group_id,
                                              table=table, num_tokens=start)
        bs = self.cache_config.groups[group_id].spec.block_size
        targets = []
        for stop in checkpoint_stops(start=start, end=end, block_size=bs):
            index = (stop - 1) // bs
            if index < len(table) and table[index] != 0:
                targets.append((stop, cache.block_for(req_id=chunk.req_id, group_id=group_id,
                                                      table=table, num_tokens=stop)))
        writes[group_id] = targets

    def _mix_fn(self, works: list[_Work]) -> MixFn:
        cache, model, recurrence = self.state_cache, self.model, self.recurrence

        def mix(layer_id: int, projected: Projected) -> torch.Tensor:
            group_id = cache.group_of(layer_id)
            mixer = model.mixer(layer_id)
            outputs = []
            for work in works:
                rows = slice(work.row, work.row + work.num_tokens)
                block = work.state_reads.get(group_id)
                state = (mixer.zero_state(state_dtype=cache.ssm.dtype) if block is None
                         else cache.read(layer_id, block))
                targets = work.state_writes[group_id]
                stops = [stop - work.start for stop, _ in targets]
                if not stops or stops[-1] != work.num_tokens:
                    stops.append(work.num_tokens)
                out, states = mixer.mix_from(projected.qkv[rows], projected.g[rows],
                                             projected.beta[rows], state, stops=stops,
                                             recurrence=recurrence)
                by_stop = dict(zip(stops, states, strict=True))
                for stop, target in targets:
                    cache.write(layer_id, target, by_stop[stop - work.start])
                outputs.append(out)
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

        return mix

    def _attend_fn(self, works: list[_Work]) -> AttendFn:
        cache, rules = self.kv_cache, self.rules
        attention, scale = self.attention, self.model.config.attention_scale

        def attend(layer_id: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            group_id = cache.group_of(layer_id)
            outputs = []
            for work in works:
                rows = slice(work.row, work.row + work.num_tokens)
                written = slice(work.row + work.write_skips[group_id], rows.stop)
                if written.start < written.stop:
                    cache.write(layer_id, work.write_slots[group_id], k[written], v[written])
                keys, values = cache.read(layer_id, work.read_slots[group_id])
                outputs.append(attention(q[rows], keys, values, q_start=work.start,
                                         kv_start=work.read_starts[group_id],
                                         rule=rules[layer_id], scale=scale))
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

        return attend


class _PerfCounter:
    """The engine's clock: wall seconds (``time.perf_counter``); steps take their time."""

    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, t: float) -> None:
        """Nothing: every request is queued when the run starts."""

    def advance(self, seconds: float) -> None:
        """Nothing: real steps already took their time."""


class _EngineLoop:
    """One engine run's step work for the ``Driver``: ``execute`` records each chunk,
    runs the ``ckpt:branch`` copies and the model's forward pass and stamps the sampled
    tokens; ``on_step`` calls the run's observers."""

    def __init__(self, runner: EngineRunner, manager: KVCacheManager,
                 records: dict[str, RequestRecord]) -> None:
        self.runner = runner
        self.manager = manager
        self.records = records
        self.driver: Driver | None = None
        self.computed = 0
        self.num_copies = 0
        self.sub_block_hits = 0
        self.step_starts: list[float] = []

    def execute(self, plan: StepPlan) -> dict[str, int]:
        assert self.driver is not None
        step_started = self.driver.step_started
        self.step_starts.append(step_started)
        manager, records, runner = self.manager, self.records, self.runner
        if not plan.chunks:
            raise CapacityError(
                f"step {self.driver.scheduler.num_steps}: nothing could be scheduled; "
                f"num_blocks={runner.cache_config.num_blocks} cannot hold the next request")
        for chunk in plan.chunks:
            record = records[chunk.req_id]
            record.num_computed_tokens += chunk.num_new_tokens
            self.computed += chunk.num_new_tokens
            if chunk.req_id in plan.admitted:
                record.hit_tokens.append(chunk.num_hit_tokens)
                self.sub_block_hits += manager.coordinator.is_partial_hit(chunk.num_hit_tokens)
                record.prefill_plans.append(manager.prefill_plan(chunk.req_id))
                if record.admitted_s is None:
                    record.admitted_s = step_started
        copies = manager.take_block_copies()
        self.num_copies += len(copies)
        runner.copy_blocks([c for c in copies if not c.after_forward])
        sampled = runner._execute(manager, plan, records)
        runner.copy_blocks([c for c in copies if c.after_forward])
        step_done = time.perf_counter()
        for req_id, token in sampled.items():
            record = records[req_id]
            record.output_token_ids.append(token)
            if record.first_token_s is None:
                record.first_token_s = step_done
        return sampled

    def on_step(self, plan: StepPlan, finished: Sequence[str]) -> None:
        del plan, finished
        assert self.driver is not None
        for observer in self.runner.options.observers:
            observer.on_step(self.manager, self.driver.scheduler)
