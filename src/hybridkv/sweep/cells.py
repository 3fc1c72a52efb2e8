"""Sweep cells: the grid of traces × models × pool sizes × policies × admission orders,
each cell's identity (its key) and its computation.

A cell is one replay: one source (trace or workload) on one model with one pool size,
one policy and one admission order. ``replay_cell`` replays it and returns its results
with their admission logs' ``BoundKeys``; ``cell_bounds`` computes the bounds of one
distinct log (cells whose policies logged the same admissions share that task:
``hybridkv.sim.bound_share``); ``cell_row`` then gives the row (hit rate, ``bound``,
``bound_fa``, ``ceiling``, miss causes, timings). ``compute_cell`` does all three in one
process (the serial sweep; its bounds are memoized per process). They are plain
top-level functions of picklable values, so a forked ``--jobs`` worker and a Ray task run
the same code (``hybridkv.sweep.run``, ``hybridkv.sweep.ray``).

The cell key (``cell_key``) names everything the row depends on, so that a stored row is
reused only for the very same computation (``hybridkv.sweep.store``):

- the source: a trace's *content* fingerprint (every byte of the file, or of every file
  of a trace directory with its relative name) and ``--limit``, or a workload's name and
  its ``--set`` parameters — never the path, so a moved trace still resumes and an edited
  one does not;
- the model: its name and its layer specs (the parsed shape, so an edited model file
  with the same name recomputes);
- the pool size in blocks, the policy, the admission order;
- the scheduler settings (``--max-running``, ``--chunk-size``, the protocol knobs),
  ``--hash-algo`` and ``--eagle``;
- hybridkv's version and a fingerprint of its source files (a changed simulator never
  reuses an old result, even before the version number moves).

>>> material = {"b": 1, "a": [1, 2]}
>>> cell_key(material) == cell_key({"a": [1, 2], "b": 1})   # order-independent
True
>>> len(cell_key(material))
40
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rich.progress import Progress

import hybridkv
from hybridkv.errors import PoolTooSmallError
from hybridkv.models.shapes import ModelShape
from hybridkv.sim.bound import AdmissionLog, BoundShape
from hybridkv.sim.bound_share import BoundKeys, BoundPair, set_bounds, shared_bounds
from hybridkv.sim.misses import MISS_CAUSES
from hybridkv.sim.replay import ReplaySettings, RunResult
from hybridkv.sim.run import (
    check_pool_holds_requests,
    log_keys,
    policy_run,
    replay_policy,
    source_ceiling,
)
from hybridkv.sim.timed import TimeSettings
from hybridkv.traces.source import Source

KEY_FORMAT = 2
"""Bumped when the key material or the row layout changes (old rows are then ignored)."""

TIMING_FIELDS = ("manager_seconds", "wall_seconds")
"""Row fields that measure this run's speed; every other field is a pure function of the
cell (``--jobs``, Ray and a serial run agree on them exactly)."""

STATUS_OK = "ok"
STATUS_TOO_SMALL = "too small"
"""A row's ``status``: the cell ran, or its pool cannot hold some request of its trace
(``min_num_blocks`` is then the smallest pool that can; the measurements are empty)."""

ROW_FIELDS = (
    "trace", "model", "num_blocks", "kv_memory", "pool_bytes", "policy", "admission",
    "status", "min_num_blocks", "hit_rate", "bound", "bound_fa", "ceiling", "hit_tokens",
    "prompt_tokens",
    *(f"miss_{cause}" for cause in MISS_CAUSES),
    "preemptions", "steps", "evicted_blocks", "wait_p50_steps", "wait_p99_steps",
    "wait_max_steps", *TIMING_FIELDS, "key",
)
"""Columns of the CSV, in order (the JSON has the same fields per cell)."""

TIME_FIELDS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "goodput_rps", "slo_attained",
               "busy_fraction", "time_gpu")
"""``--clock time`` columns, after ``ROW_FIELDS`` (absent on the step clock)."""


@dataclass(frozen=True, slots=True)
class CellOptions:
    """Settings shared by every cell of one sweep."""

    settings: ReplaySettings
    hash_algo: str = "sha256"
    eagle: bool = False


@dataclass(frozen=True, slots=True)
class Cell:
    """One replay of a sweep. ``source`` and ``model`` are labels into the sweep's
    sources and models (``SweepGrid``); ``key`` is ``cell_key`` of its material."""

    source: str
    model: str
    num_blocks: int
    policy: str
    admission: str
    kv_memory: str | None
    key: str


@dataclass(frozen=True, slots=True)
class CellError:
    """A cell whose pool cannot hold some request of its trace (found before the replay,
    or by it): a result, not a failure — its row is ``too_small_row`` — and the rest of
    the sweep goes on."""

    message: str
    min_num_blocks: int
    """The smallest pool (blocks, the null block included) that holds the request."""
    pool_bytes: int


Row = dict[str, object]


def cell_key(material: Mapping[str, object]) -> str:
    """Hex digest (160 bits) of the canonical JSON of ``material``."""
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def file_fingerprint(path: Path) -> str:
    """SHA-256 of a file's bytes, or of a directory's regular files (sorted relative
    names and bytes, recursively): the identity of a trace's content.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "t.jsonl").write_text("a")
    >>> before = file_fingerprint(folder)
    >>> _ = (folder / "t.jsonl").write_text("b")
    >>> before == file_fingerprint(folder)
    False
    """
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(str(file.relative_to(path) if file != path else "").encode() + b"\0")
        with file.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


@functools.cache
def code_fingerprint() -> str:
    """SHA-256 of hybridkv's Python sources (the engine excluded: sweeps never run it)."""
    root = Path(hybridkv.__file__).parent
    digest = hashlib.sha256()
    for file in sorted(root.rglob("*.py")):
        relative = file.relative_to(root)
        if relative.parts[0] == "engine":
            continue
        digest.update(str(relative).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def model_identity(shape: ModelShape) -> dict[str, object]:
    """The model's part of a cell key: its name and its layer specs."""
    layers = hashlib.sha256(repr(shape.layers).encode()).hexdigest()
    return {"name": shape.name, "layers": layers}


def key_material(source_identity: Mapping[str, object], shape: ModelShape, num_blocks: int,
                 policy: str, admission: str, options: CellOptions) -> dict[str, object]:
    """Everything a cell's row depends on (see the module docstring)."""
    settings = options.settings
    return {
        "format": KEY_FORMAT, "hybridkv": hybridkv.__version__, "code": code_fingerprint(),
        "source": dict(source_identity), "model": model_identity(shape),
        "num_blocks": num_blocks, "policy": policy, "admission": admission,
        "settings": {"max_running": settings.max_running, "chunk_size": settings.chunk_size,
                     "reserve_full_prompt": settings.reserve_full_prompt,
                     "lookahead_requests": settings.lookahead_requests,
                     "hash_algo": options.hash_algo, "eagle": options.eagle},
        **({"timing": time_key(settings.timing)} if settings.timing is not None else {}),
    }


@dataclass(slots=True)
class CellReplay:
    """A cell replayed, its bounds still to come: each scenario's result (with its log
    while its bounds are unknown), the logs' ``BoundKeys``, the pool's ``BoundShape`` and
    the ceiling. ``hybridkv.sweep.run`` starts one bound task per distinct key."""

    results: dict[str, RunResult]
    keys: dict[str, BoundKeys]
    shape: BoundShape | None
    ceiling: float

    @property
    def complete(self) -> bool:
        """Every scenario has its bounds (or has none to have)."""
        return all(result.log is None for result in self.results.values())


@dataclass(frozen=True, slots=True)
class CellBoundTask:
    """The bounds of one distinct admission log of a sweep."""

    source: str
    scenario: str
    shape: BoundShape
    log: AdmissionLog
    keys: BoundKeys


def time_key(timing: TimeSettings) -> dict[str, object]:
    """``--clock time`` settings in a cell's key (everything but the per-cell model)."""
    return {"gpu": timing.gpu, "tp": timing.tp, "time_scale": timing.time_scale,
            "rate": timing.rate, "seed": timing.seed,
            "slo": None if timing.slo is None else [timing.slo.ttft_s, timing.slo.tpot_s]}


def time_columns(result: RunResult) -> dict[str, object]:
    """A row's ``--clock time`` columns (none on the step clock)."""
    if result.time is None:
        return {}
    t = result.time
    return {"ttft_p50_s": t["ttft_p50_s"], "ttft_p99_s": t["ttft_p99_s"],
            "tpot_p50_s": t["tpot_p50_s"], "goodput_rps": t.get("goodput_rps"),
            "slo_attained": t.get("slo_attained"),
            "busy_fraction": t["busy_fraction"], "time_gpu": result.time_label}


def replay_cell(source: Source, shape: ModelShape, cell: Cell, options: CellOptions,
                progress: Progress | None = None) -> CellReplay | CellError:
    """Replay one cell (no bounds yet); ``CellError`` when the pool is too small for some
    request."""
    settings = replace(options.settings, admission=cell.admission)
    if settings.timing is not None:  # the cell's own model sizes its steps
        settings = replace(settings, timing=replace(settings.timing, model=shape.name))
    config = shape.cache_config(cell.num_blocks, hash_algo=options.hash_algo,
                                use_eagle=options.eagle,
                                max_num_batched_tokens=settings.chunk_size)
    try:
        check_pool_holds_requests(source, config)
        results = replay_policy(source, config, cell.policy, settings, progress)
    except PoolTooSmallError as err:
        return CellError(str(err), err.blocks_needed + 1,
                         cell.num_blocks * shape.bytes_per_block)
    return CellReplay(results, log_keys(source, config, results), BoundShape.of(config),
                      source_ceiling(source, config.alignment_tokens))


def cell_bounds(source: Source, task: CellBoundTask) -> BoundPair:
    """Run one bound task (memoized per process)."""
    return shared_bounds(source.scenarios[task.scenario], task.log, task.shape, task.keys)


def compute_cell(source: Source, shape: ModelShape, cell: Cell, options: CellOptions,
                 progress: Progress | None = None) -> Row | CellError:
    """Replay one cell and compute its bounds here; its row, or ``CellError`` when the
    pool is too small for some request."""
    replayed = replay_cell(source, shape, cell, options, progress)
    if isinstance(replayed, CellError):
        return replayed
    for scenario, keys in replayed.keys.items():
        log = replayed.results[scenario].log
        assert replayed.shape is not None and log is not None
        task = CellBoundTask(cell.source, scenario, replayed.shape, log, keys)
        set_bounds(replayed.results[scenario], cell_bounds(source, task))
    return cell_row(source, shape, cell, replayed)


def cell_row(source: Source, shape: ModelShape, cell: Cell, replayed: CellReplay) -> Row:
    """The row of a cell whose bounds are all in."""
    assert replayed.complete
    result = policy_run(source, replayed.results).result
    row: Row = {
        "trace": cell.source, "model": cell.model, "num_blocks": cell.num_blocks,
        "kv_memory": cell.kv_memory or "", "pool_bytes": cell.num_blocks * shape.bytes_per_block,
        "policy": cell.policy, "admission": cell.admission, "status": STATUS_OK,
        "min_num_blocks": None, "hit_rate": result.hit_rate, "bound": result.bound,
        "bound_fa": result.bound_fa,
        "ceiling": replayed.ceiling, "hit_tokens": result.hit_tokens,
        "prompt_tokens": result.prompt_tokens,
        **{f"miss_{cause}": tokens for cause, tokens in result.misses.as_dict().items()},
        "preemptions": result.preemptions, "steps": result.steps,
        "evicted_blocks": result.evicted_blocks,
        # floats whichever core ran (the compiled one returns its declared float type)
        "wait_p50_steps": float(result.wait_p50_steps),
        "wait_p99_steps": float(result.wait_p99_steps),
        "wait_max_steps": result.wait_max_steps,
        "manager_seconds": round(result.manager_seconds, 4),
        "wall_seconds": round(result.wall_seconds, 4), "key": cell.key,
        **time_columns(result),
    }
    assert tuple(row) in (ROW_FIELDS, ROW_FIELDS + TIME_FIELDS)
    return row


def too_small_row(cell: Cell, error: CellError) -> Row:
    """The row of a cell whose pool is too small: its labels, ``status`` "too small" and
    ``min_num_blocks``; every measurement ``None`` (empty in the CSV, ``null`` in JSON).

    >>> cell = Cell("mooncake", "gemma3-bench", 8192, "latest", "fcfs", "8GiB", "k")
    >>> row = too_small_row(cell, CellError("…", 8449, 8 << 30))
    >>> row["status"], row["min_num_blocks"], row["hit_rate"], tuple(row) == ROW_FIELDS
    ('too small', 8449, None, True)
    """
    labels: Row = {"trace": cell.source, "model": cell.model, "num_blocks": cell.num_blocks,
                   "kv_memory": cell.kv_memory or "", "pool_bytes": error.pool_bytes,
                   "policy": cell.policy, "admission": cell.admission,
                   "status": STATUS_TOO_SMALL, "min_num_blocks": error.min_num_blocks,
                   "key": cell.key}
    return {name: labels.get(name) for name in ROW_FIELDS}


def is_too_small(row: Mapping[str, object]) -> bool:
    """Whether ``row`` is a too-small cell's (a CSV row's empty cells included)."""
    return row.get("status") == STATUS_TOO_SMALL


def without_timings(rows: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """Rows minus the timing fields, for comparing runs (serial, ``--jobs``, Ray).

    >>> without_timings([{"hit_rate": 0.5, "wall_seconds": 1.2, "manager_seconds": 0.3}])
    [{'hit_rate': 0.5}]
    """
    return [{k: v for k, v in row.items() if k not in TIMING_FIELDS} for row in rows]


def dispatch_order(cells: Sequence[Cell], cost: Mapping[str, int]) -> list[int]:
    """Cell indices, expected-longest first (greedy longest-first shortens a run on few
    workers): by the source's prompt tokens (``cost``), then larger pools, then the
    grid's order.

    >>> cells = [Cell("a", "m", 10, "latest", "fcfs", None, "k1"),
    ...          Cell("b", "m", 10, "latest", "fcfs", None, "k2"),
    ...          Cell("b", "m", 20, "latest", "fcfs", None, "k3")]
    >>> dispatch_order(cells, {"a": 100, "b": 900})
    [2, 1, 0]
    """
    return sorted(range(len(cells)),
                  key=lambda i: (-cost.get(cells[i].source, 0), -cells[i].num_blocks, i))


def default_workers() -> int:
    """Processes a local run may use: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


__all__ = [
    "ROW_FIELDS",
    "STATUS_OK",
    "STATUS_TOO_SMALL",
    "TIME_FIELDS",
    "TIMING_FIELDS",
    "Cell",
    "CellBoundTask",
    "CellError",
    "CellOptions",
    "CellReplay",
    "Row",
    "cell_bounds",
    "cell_key",
    "cell_row",
    "code_fingerprint",
    "compute_cell",
    "default_workers",
    "dispatch_order",
    "file_fingerprint",
    "is_too_small",
    "key_material",
    "model_identity",
    "replay_cell",
    "too_small_row",
    "without_timings",
]
