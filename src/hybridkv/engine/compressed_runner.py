"""The V4-shaped model on hybridkv's paged pool: cache layout, paged rows, and the runner.

**Cache layers.** Each decoder layer owns one cache layer per thing it stores, in this order
(the cache-layer index is the position in ``CompressedCacheLayout.layers``, the ``layer_ids``
of ``CacheConfig.groups``):

=============  ==========================  ====================  =========================
role           one row holds               rows of a block       read by a chunk
=============  ==========================  ====================  =========================
window         raw ``k | v`` of a token    ``block_size``        tokens ``(p - w, p]``
entries        one compressed entry        ``block_size // r``   entries ``[0, (p+1) // r)``
state          ``kv | score+ape`` (token)  ``block_size``        rows pooled by new entries
indexer        one indexer key (C4)        ``block_size // r``   keys ``[0, (p+1) // r)``
indexer_state  the indexer's state rows    ``block_size``        rows pooled by new keys
=============  ==========================  ====================  =========================

Item ``i`` (a token, or entry ``i`` = tokens ``[i*r, (i+1)*r)``) of a cache layer lives in
block ``table[i // rows_per_block]`` at row ``i % rows_per_block``, where ``table`` is the
group's entry of ``KVCacheManager.get_block_ids``: the entries block at table index ``t``
holds the entries of tokens ``[t * block_size, (t + 1) * block_size)``.

**Pool.** ``PagedRows.pages[slot, block, :]``: one page per block id shared by every group
(a group's rows fill its page's first ``rows_per_block * row_width`` elements), so block
``b`` is the same memory whichever group holds it, as in vLLM; ``slot`` is the cache layer's
index in its group. Reading or writing an item whose table entry is the null block 0, past
the table, or out of the pool raises ``InvariantViolation`` naming request, layer, role and
position; with ``poison`` fresh pages hold NaN.

**Specs** (``docs/v4-groups.md``; per layer in vLLM 0.33's registration
order: indexer keys, indexer state, window, entries, state): window
``SlidingWindowMLASpec(bs, w)``; entries and indexer keys ``CompressedAttentionSpec(bs,
tokens_per_state=r, role="kv" | "indexer")`` (full-attention-like: a hit needs every entry
from 0); state and indexer state ``CompressorStateSpec(4 for C4 else 8, halves * r)``.

**One chunk ``[start, end)`` of a compressed layer** (``engine.compressed`` for the math)::

    write raw k|v of [start, end); write state rows of [start, end)
    entries j in [max(start // r, F // r), end // r): pool state rows rows_of_entry(j)
        (earlier rows come from the pages: the residual state), norm, rope, write entry j
    (indexed layers: the same for the indexer's state rows and keys; each query keeps
     the top-k of the entries it may read by indexer score)
    attend over raw [max(start - w + 1, floor), end) and entries [0, end // r)

``F`` / ``floor`` come from ``KVCacheManager.prefill_plan`` (window-recompute bridges): a
bridge never rewrites cached entries (``j < F // r``), and window and state rows start at
the floor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NoReturn

import torch

from hybridkv.cache import KVCacheManager
from hybridkv.config import CacheConfig
from hybridkv.engine.attention import AttentionRule, reference_attention
from hybridkv.engine.bridge import window_read_start
from hybridkv.engine.compressed import (
    completed_entries,
    compressed_attention,
    pool_entries,
    state_rows,
)
from hybridkv.engine.compressed_model import (
    CompressedDecoder,
    CompressedInputs,
    CompressedModelConfig,
    v4_ratios,
)
from hybridkv.engine.gated_delta import Projected
from hybridkv.engine.model import AttendFn, MixFn
from hybridkv.engine.model_config import ModelConfig
from hybridkv.engine.runner import EngineRunner, RunOptions, _Work
from hybridkv.engine.verify import VerifySettings
from hybridkv.errors import ConfigError, InvariantViolation
from hybridkv.sched.scheduler import ScheduledChunk
from hybridkv.specs import (
    CompressedAttentionSpec,
    CompressorStateSpec,
    LayerSpec,
    SlidingWindowMLASpec,
)

CacheRole = Literal["window", "entries", "state", "indexer", "indexer_state"]

V4_STATE_BLOCK_C4 = 4
V4_STATE_BLOCK_OTHER = 8
"""Compressor-state block sizes (tokens) vLLM 0.33 fixes for V4: C4 4, C128 8."""


@dataclass(frozen=True, slots=True)
class CacheLayer:
    """One thing a decoder layer stores: its spec and row geometry.

    ``tokens_per_row``: 1 for token rows, ``r`` for entries; ``row_width``: elements per row.
    """

    layer_id: int
    role: CacheRole
    spec: LayerSpec
    tokens_per_row: int
    row_width: int

    def rows_per_block(self) -> int:
        return self.spec.block_size // self.tokens_per_row


@dataclass(frozen=True, slots=True)
class CompressedCacheLayout:
    """The cache layers of a V4-shaped model and their block sizes.

    Attributes:
        shape: the model.
        window_block_size: tokens per raw-window block (V4: 64).
        compressed_block_size: tokens per entries block (V4: the 256-token scheduler block);
            a multiple of every ratio.
        dtype_bytes: bytes per stored element (spec sizes only).

    >>> layout = CompressedCacheLayout(CompressedModelConfig.tiny())
    >>> [(c.role, c.spec.block_size, c.rows_per_block()) for c in layout.layers[1:6]]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('indexer', 32, 8), ('indexer_state', 4, 4), ('window', 8, 8), ('entries', 32, 8),
     ('state', 4, 4)]
    >>> config = layout.cache_config(num_blocks=64)    # block-outermost packed groups
    >>> config.alignment_tokens, [(g.spec.kind, g.layer_ids) for g in config.groups][2]
    (32, ('compressed_attention', (1, 4, 7, 9, 12)))
    """

    shape: CompressedModelConfig
    window_block_size: int = 8
    compressed_block_size: int = 32
    dtype_bytes: int = 8
    layers: tuple[CacheLayer, ...] = field(init=False)

    def __post_init__(self) -> None:
        for name in ("window_block_size", "compressed_block_size", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(name, value, "must be a positive integer")
        base = self.shape.base
        kvh_d = base.num_kv_heads * base.head_dim
        layers: list[CacheLayer] = []
        for layer_id, ratio in enumerate(self.shape.compress_ratios):
            window = CacheLayer(layer_id, "window", SlidingWindowMLASpec(
                self.window_block_size, 2 * kvh_d * self.dtype_bytes, self.shape.window),
                1, 2 * kvh_d)
            if not ratio:
                layers.append(window)
                continue
            if self.compressed_block_size % ratio:
                raise ConfigError("compressed_block_size", self.compressed_block_size,
                                  f"must be a multiple of every compress ratio (layer "
                                  f"{layer_id}: {ratio})")
            if self.shape.has_indexer(layer_id):
                layers.extend(self._compressor_layers(layer_id, indexer=True))
            layers.append(window)
            layers.extend(self._compressor_layers(layer_id, indexer=False))
        object.__setattr__(self, "layers", tuple(layers))

    def _compressor_layers(self, layer_id: int, *, indexer: bool) -> list[CacheLayer]:
        """The entries (or indexer keys) and the compressor state of one compressor."""
        rule = self.shape.rule(layer_id)
        ratio = rule.compress_ratio
        base = self.shape.base
        dim = self.shape.index_head_dim if indexer else base.num_kv_heads * base.head_dim
        width = self.shape.state_width(layer_id, indexer=indexer)
        state_block = V4_STATE_BLOCK_C4 if rule.halves == 2 else V4_STATE_BLOCK_OTHER
        entries = CacheLayer(layer_id, "indexer" if indexer else "entries",
                             CompressedAttentionSpec(
                                 self.compressed_block_size, tokens_per_state=ratio,
                                 entry_bytes=dim * self.dtype_bytes,
                                 role="indexer" if indexer else "kv"), ratio, dim)
        state = CacheLayer(layer_id, "indexer_state" if indexer else "state",
                           CompressorStateSpec(state_block, 2 * width * self.dtype_bytes,
                                               rule.state_window), 1, 2 * width)
        return [entries, state]

    def cache_layer(self, layer_id: int, role: CacheRole) -> int:
        """Index of decoder layer ``layer_id``'s ``role`` cache layer."""
        for index, layer in enumerate(self.layers):
            if layer.layer_id == layer_id and layer.role == role:
                return index
        raise ConfigError("layer_id", layer_id, f"has no {role} cache layer")

    def cache_config(self, *, num_blocks: int, **options: object) -> CacheConfig:
        """A ``CacheConfig`` over these cache layers (``options`` as ``CacheConfig``)."""
        return CacheConfig.from_layers([c.spec for c in self.layers], num_blocks, **options)


@dataclass(frozen=True, slots=True)
class RowIndex:
    """Where items ``[first, first + len)`` of one cache layer live: block ids and rows."""

    first: int
    blocks: torch.Tensor
    rows: torch.Tensor

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def tail(self, first: int) -> RowIndex:
        """Items ``[first, end)`` of this index."""
        skip = first - self.first
        return RowIndex(first, self.blocks[skip:], self.rows[skip:])


class PagedRows:
    """Rows of every cache layer in one page pool, addressed through block tables only.

    Args:
        config: the cache configuration (its groups' ``layer_ids`` index ``layers``).
        layers: the cache layers (``CompressedCacheLayout.layers``).
        dtype / device: storage.
        poison: fill with NaN so reading a row nobody wrote spoils the logits.
    """

    def __init__(self, config: CacheConfig, layers: Sequence[CacheLayer], *,
                 dtype: torch.dtype, device: torch.device | str, poison: bool = False) -> None:
        self.config = config
        self.layers = tuple(layers)
        self.location: dict[int, tuple[int, int]] = {}
        for group in config.groups:
            # block-outermost packed groups list a spec per member (``hybridkv.packing``)
            member_specs = getattr(group, "layer_specs", ()) or (group.spec,) * len(
                group.layer_ids)
            for slot, (cache_layer, spec) in enumerate(zip(group.layer_ids, member_specs,
                                                           strict=True)):
                self.location[cache_layer] = (group.group_id, slot)
                if spec != self.layers[cache_layer].spec:
                    raise ConfigError("cache_config", spec,
                                      f"cache layer {cache_layer} has spec "
                                      f"{self.layers[cache_layer].spec}")
        if sorted(self.location) != list(range(len(self.layers))):
            raise ConfigError("cache_config.groups", sorted(self.location),
                              f"must cover cache layers 0..{len(self.layers) - 1}")
        page_elems = max(c.rows_per_block() * c.row_width for c in self.layers)
        self.pages = torch.empty((config.layers_per_group, config.num_blocks, page_elems),
                                 dtype=dtype, device=device)
        if poison:
            self.pages.fill_(float("nan"))

    def group_of(self, cache_layer: int) -> int:
        return self.location[cache_layer][0]

    def _view(self, cache_layer: int) -> torch.Tensor:
        layer = self.layers[cache_layer]
        rows = layer.rows_per_block()
        slot = self.location[cache_layer][1]
        return self.pages[slot, :, : rows * layer.row_width].view(
            self.config.num_blocks, rows, layer.row_width)

    def index(self, *, req_id: str, cache_layer: int, table: Sequence[int], first: int,
              end: int) -> RowIndex:
        """Rows of items ``[first, end)`` (tokens, or entries for an entries layer).

        Raises:
            InvariantViolation: an item maps past the table, to the null block 0 or to a
                block id outside the pool.
        """
        layer = self.layers[cache_layer]
        per_block = layer.rows_per_block()
        items = torch.arange(first, end)
        table_index = items // per_block
        if end > first:
            last = (end - 1) // per_block
            if last >= len(table):
                self._raise(req_id, cache_layer, end - 1,
                            f"needs table index {last} but the block table has "
                            f"{len(table)} entries")
            blocks = table[first // per_block : last + 1]
            if min(blocks) <= 0 or max(blocks) >= self.config.num_blocks:
                for offset, block_id in enumerate(blocks):
                    index = first // per_block + offset
                    if not 0 < block_id < self.config.num_blocks:
                        item = max(first, index * per_block)
                        what = "the null block 0" if block_id == 0 else \
                            f"block id {block_id} outside [1, {self.config.num_blocks})"
                        self._raise(req_id, cache_layer, item,
                                    f"is needed but maps to {what} (table index {index})")
        ids = torch.tensor(list(table), dtype=torch.int64)
        blocks_t = ids[table_index] if end > first else torch.zeros(0, dtype=torch.int64)
        device = self.pages.device
        return RowIndex(first, blocks_t.to(device), (items % per_block).to(device))

    def _raise(self, req_id: str, cache_layer: int, item: int, what: str) -> NoReturn:
        layer = self.layers[cache_layer]
        group = self.group_of(cache_layer)
        noun = "entry" if layer.tokens_per_row > 1 else "position"
        raise InvariantViolation(
            f"request {req_id!r}, layer {layer.layer_id} {layer.role} (cache layer "
            f"{cache_layer}, group {group}): {noun} {item} {what}")

    def read(self, cache_layer: int, index: RowIndex) -> torch.Tensor:
        """Rows ``[N, row_width]`` at ``index``."""
        return self._view(cache_layer)[index.blocks, index.rows]

    def write(self, cache_layer: int, index: RowIndex, rows: torch.Tensor) -> None:
        """Store ``rows`` ``[N, row_width]`` at ``index``."""
        self._view(cache_layer)[index.blocks, index.rows] = rows.reshape(len(index), -1)


@dataclass(slots=True)
class _StreamRows:
    """One compressor's rows for one chunk: state written, state read back to pool the
    new entries (``None``: no entry completes), entries written and read."""

    state_write: RowIndex
    entries_read: RowIndex
    state_read: RowIndex | None = None
    entries_write: RowIndex | None = None


@dataclass(slots=True)
class _LayerRows:
    """One decoder layer's rows for one chunk."""

    window: RowIndex                   # raw tokens read; written from the chunk start
    kv: _StreamRows | None = None      # the compressed entries
    index: _StreamRows | None = None   # the indexer's keys


@dataclass(slots=True)
class _CompressedWork(_Work):
    layers: list[_LayerRows] = field(default_factory=list)


class CompressedRunner(EngineRunner):
    """``EngineRunner`` for a ``CompressedDecoder`` on ``PagedRows`` (reference attention,
    float64 on the CPU is what ``verify`` uses).

    Args:
        model: the V4-shaped decoder.
        layout: its cache layers; ``cache_config`` must be built from them.
        cache_config / options: as ``EngineRunner``.
        pool: reuse pages across runners (same ``CacheConfig`` shape).
    """

    def __init__(self, model: CompressedDecoder, layout: CompressedCacheLayout,
                 cache_config: CacheConfig, options: RunOptions | None = None, *,
                 pool: PagedRows | None = None) -> None:
        # EngineRunner.__init__ plans one attention rule per cache group; here groups hold
        # cache layers of several roles, so the runner sets up its own state.
        if layout.shape != model.shape:
            raise ConfigError("layout", layout.shape, "was built for another model")
        self.model = model
        self.compressed_model = model
        self.layout = layout
        self.cache_config = cache_config
        self.options = options = options or RunOptions()
        if pool is None:
            pool = PagedRows(cache_config, layout.layers, dtype=model.dtype,
                             device=model.device, poison=options.poison)
        elif pool.config.groups != cache_config.groups or \
                pool.config.num_blocks != cache_config.num_blocks:
            raise ConfigError("pool", "<PagedRows>",
                              "pages were built for other cache groups or pool size")
        self.pool = pool
        self.window_rule = AttentionRule("sliding_attention", window=model.shape.window)
        self.scheduler = None
        self.manager = None

    def _resolve(self, manager: KVCacheManager, chunk: ScheduledChunk, row: int) -> _Work:
        start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens
        tables = manager.get_block_ids(chunk.req_id)
        plan = manager.prefill_plan(chunk.req_id)
        raw_start = window_read_start(self.window_rule, start, plan)
        shape, layout, pool = self.model_shape, self.layout, self.pool

        def index(layer_id: int, role: CacheRole, first: int, last: int) -> RowIndex:
            cache_layer = layout.cache_layer(layer_id, role)
            return pool.index(req_id=chunk.req_id, cache_layer=cache_layer,
                              table=tables[pool.group_of(cache_layer)], first=first, end=last)

        def stream(layer_id: int, entries: CacheRole, state: CacheRole) -> _StreamRows:
            rule = shape.rule(layer_id)
            ratio = rule.compress_ratio
            first = max(start // ratio, plan.full_attention_cached_tokens // ratio)
            last = end // ratio
            rows = _StreamRows(index(layer_id, state, start, end),
                               index(layer_id, entries, 0, last))
            if first < last:
                rows.state_read = index(layer_id, state, rule.rows_of_entry(first)[0],
                                        rule.rows_of_entry(last - 1)[1])
                rows.entries_write = index(layer_id, entries, first, last)
            return rows

        layers = []
        for layer_id, ratio in enumerate(shape.compress_ratios):
            rows = _LayerRows(index(layer_id, "window", raw_start, end))
            if ratio:
                rows.kv = stream(layer_id, "entries", "state")
            if shape.has_indexer(layer_id):
                rows.index = stream(layer_id, "indexer", "indexer_state")
            layers.append(rows)
        return _CompressedWork(chunk, row, [], [], [], [], layers=layers)

    @property
    def model_shape(self) -> CompressedModelConfig:
        return self.compressed_model.shape

    def _attend_fn(self, works: list[_Work]) -> AttendFn:
        return _PagedAttend(self, [w for w in works if isinstance(w, _CompressedWork)])

    def _mix_fn(self, works: list[_Work]) -> MixFn:
        def no_recurrent_layers(layer_id: int, projected: Projected) -> torch.Tensor:
            raise ConfigError("layer_id", layer_id, "V4-shaped models have no recurrent layers")

        return no_recurrent_layers


class _PagedAttend:
    """The runner's attend callback for one step (chunks in plan order per layer)."""

    def __init__(self, runner: CompressedRunner, works: list[_CompressedWork]) -> None:
        self.runner = runner
        self.works = works
        self.model = runner.compressed_model
        self.scale = self.model.config.attention_scale

    def _raw(self, layer_id: int, work: _CompressedWork, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the chunk's raw K/V, return the raw window ``[K, KVH, D]`` it reads."""
        pool, layout = self.runner.pool, self.runner.layout
        cache_layer = layout.cache_layer(layer_id, "window")
        index = work.layers[layer_id].window
        rows = slice(work.row, work.row + work.num_tokens)
        pool.write(cache_layer, index.tail(work.start), torch.stack((k[rows], v[rows]), dim=1))
        raw = pool.read(cache_layer, index).reshape(len(index), 2, *k.shape[1:])
        return raw[:, 0], raw[:, 1]

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        outputs = []
        for work in self.works:
            keys, values = self._raw(layer_id, work, k, v)
            outputs.append(reference_attention(
                q[work.row : work.row + work.num_tokens], keys, values, q_start=work.start,
                kv_start=work.layers[layer_id].window.first, rule=self.runner.window_rule,
                scale=self.scale))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _compress(self, layer_id: int, work: _CompressedWork, rows: _StreamRows,
                  kv: torch.Tensor, score: torch.Tensor, *, indexer: bool) -> torch.Tensor:
        """Write the chunk's state rows, pool and write the entries it completes, return
        every entry the chunk reads (``[E, heads, dim]``)."""
        model, pool, layout = self.model, self.runner.pool, self.runner.layout
        shape = model.shape
        rule = shape.rule(layer_id)
        heads, dim = ((1, shape.index_head_dim) if indexer
                      else (shape.base.num_kv_heads, shape.base.head_dim))
        state_layer = layout.cache_layer(layer_id, "indexer_state" if indexer else "state")
        entries_layer = layout.cache_layer(layer_id, "indexer" if indexer else "entries")
        positions = torch.arange(work.start, work.start + work.num_tokens, device=kv.device)
        ape = model.compressor(layer_id, indexer=indexer).ape
        pool.write(state_layer, rows.state_write, state_rows(kv, score, ape, positions, rule))
        if rows.state_read is not None and rows.entries_write is not None:
            first = rows.entries_write.first
            saved = pool.read(state_layer, rows.state_read).reshape(len(rows.state_read), 2, -1)
            pooled = pool_entries(saved, rows.state_read.first, first,
                                  first + len(rows.entries_write), rule, kv_heads=heads)
            pool.write(entries_layer, rows.entries_write,
                       model.entry_keys(layer_id, pooled, first, indexer=indexer))
        return pool.read(entries_layer, rows.entries_read).reshape(
            len(rows.entries_read), heads, dim)

    def compressed(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   inputs: CompressedInputs) -> torch.Tensor:
        model = self.model
        rule = model.shape.rule(layer_id)
        outputs = []
        for work in self.works:
            rows = slice(work.row, work.row + work.num_tokens)
            io, mine = work.layers[layer_id], inputs.rows(rows)
            assert io.kv is not None
            keys, values = self._raw(layer_id, work, k, v)
            entries = self._compress(layer_id, work, io.kv, mine.kv, mine.score, indexer=False)
            allowed = completed_entries(work.start, work.num_tokens, entries.shape[0], rule,
                                        q.device)
            if io.index is not None:
                assert mine.index_kv is not None and mine.index_score is not None
                index_keys = self._compress(layer_id, work, io.index, mine.index_kv,
                                            mine.index_score, indexer=True)
                positions = torch.arange(work.start, work.start + work.num_tokens,
                                         device=q.device)
                allowed = model.select_entries(layer_id, mine, index_keys, allowed, positions)
            outputs.append(compressed_attention(q[rows], keys, values, entries, allowed,
                                                q_start=work.start, rule=rule,
                                                scale=self.scale))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

def compressed_runner_factory(model: CompressedDecoder, layout: CompressedCacheLayout,
                              ) -> Callable[[VerifySettings, RunOptions, bool, bool],
                                            EngineRunner]:
    """``run_verify``'s ``runner_factory`` for a V4-shaped model: each run gets a fresh
    ``CompressedRunner`` on ``layout``'s cache (``settings.num_blocks``, its chunk size)."""
    def make(settings: VerifySettings, options: RunOptions, caching: bool,
             use_eagle: bool) -> EngineRunner:
        config = layout.cache_config(num_blocks=settings.num_blocks, enable_caching=caching,
                                     use_eagle=use_eagle,
                                     max_num_batched_tokens=settings.chunk_size)
        return CompressedRunner(model, layout, config, options)

    return make


def v4_verify_setup(base: ModelConfig, *, window_block_size: int, hca_ratio: int,
                    compressed_block_size: int, index_topk: int, attention: str, seed: int,
                    ) -> tuple[CompressedDecoder, Callable[[VerifySettings, RunOptions, bool,
                                                            bool], EngineRunner],
                               int, tuple[str, ...]]:
    """``hybridkv verify --pattern v4``: the V4-shaped model on ``base`` (``v4_ratios``;
    C4 layers indexed with ``base``'s heads and head_dim when ``index_topk > 0``), its
    runner factory, the hit alignment (tokens) and a label per layer.

    Raises:
        ConfigError: ``attention`` is not the reference path, or a bad ratio / block size.
    """
    if attention != "reference":
        raise ConfigError("attention", attention,
                          "--pattern v4 runs the reference attention path only")
    if isinstance(hca_ratio, bool) or not isinstance(hca_ratio, int) or hca_ratio < 2:
        raise ConfigError("hca_ratio", hca_ratio, "--hca-ratio must be an integer >= 2 "
                          "(tokens per compressed entry)")
    if isinstance(index_topk, bool) or not isinstance(index_topk, int) or index_topk < 0:
        raise ConfigError("index_topk", index_topk,
                          "--index-topk must be an integer >= 0 (0: no indexer)")
    shape = CompressedModelConfig(base, v4_ratios(base.num_layers, hca_ratio=hca_ratio),
                                  index_heads=base.num_heads, index_head_dim=base.head_dim,
                                  index_topk=index_topk)
    model = CompressedDecoder(shape, dtype=torch.float64, seed=seed)
    layout = CompressedCacheLayout(shape, window_block_size=window_block_size,
                                   compressed_block_size=compressed_block_size)
    alignment = layout.cache_config(num_blocks=2).alignment_tokens
    labels = tuple((f"C{r}" + ("+indexer" if shape.has_indexer(i) else "")) if r else "window"
                   for i, r in enumerate(shape.compress_ratios))
    return model, compressed_runner_factory(model, layout), alignment, labels
