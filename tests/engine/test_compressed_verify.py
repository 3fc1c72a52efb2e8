"""``hybridkv verify`` on a small V4-shaped model: hits identical to recomputation under
every policy, and a sabotaged compressed block (or compressor state block) is caught."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from hybridkv import InvariantViolation, KVCacheManager
from hybridkv.cli import main
from hybridkv.engine.compressed_model import CompressedDecoder, CompressedModelConfig
from hybridkv.engine.compressed_runner import (
    CompressedCacheLayout,
    CompressedRunner,
    compressed_runner_factory,
)
from hybridkv.engine.runner import EngineRunner, RunOptions, _Work
from hybridkv.engine.synthetic import make_engine_workload
from hybridkv.engine.verify import VerifyReport, VerifySettings, run_verify
from hybridkv.sched.scheduler import ScheduledChunk

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

SHAPE = CompressedModelConfig.tiny()                       # ratios (0, 4, 16, 4), window 8
LAYOUT = CompressedCacheLayout(SHAPE, compressed_block_size=16)
NUM_BLOCKS = 400
ALIGNMENT = LAYOUT.cache_config(num_blocks=2).alignment_tokens   # lcm(8, 16, 4, 8) = 16
C4_LAYER = 1


def _group_of(layer_id: int, role: str) -> int:
    index = LAYOUT.cache_layer(layer_id, role)  # type: ignore[arg-type]
    config = LAYOUT.cache_config(num_blocks=NUM_BLOCKS)
    return next(g.group_id for g in config.groups if index in g.layer_ids)


def _verify(policies: tuple[str, ...] = ("latest",), *, workload: str = "mixed",
            eagle: bool = False, settings: VerifySettings | None = None,
            runner: type[CompressedRunner] = CompressedRunner) -> VerifyReport:
    model = CompressedDecoder(SHAPE, seed=1)
    factory = compressed_runner_factory(model, LAYOUT)
    if runner is not CompressedRunner:
        def factory(s: VerifySettings, options: RunOptions, caching: bool,
                    use_eagle: bool) -> EngineRunner:
            config = LAYOUT.cache_config(num_blocks=s.num_blocks, enable_caching=caching,
                                         use_eagle=use_eagle, max_num_batched_tokens=s.chunk_size)
            return runner(model, LAYOUT, config, options)
    return run_verify(model, make_engine_workload(workload, alignment_tokens=ALIGNMENT, seed=1),
                      policies=policies, eagle=eagle,
                      settings=settings or VerifySettings(num_blocks=NUM_BLOCKS),
                      runner_factory=factory)


def test_alignment() -> None:
    assert ALIGNMENT == 16


def test_hits_identical_under_every_policy_kind_including_bridges() -> None:
    report = _verify(("prepend", "interval:32", "latest+recompute"), workload="all")
    assert report.ok, report.first_divergence()
    for outcome in report.outcomes:
        assert outcome.hit_tokens > 0
        assert outcome.max_logit_diff < 1e-12
    bridged = report.outcomes[-1]
    assert bridged.bridge_tokens > 0 and bridged.cold_bridges > 0


def test_preemption_readmission_and_eagle_are_identical() -> None:
    report = _verify(("latest", "prepend"), eagle=True,
                     settings=VerifySettings(num_blocks=150, chunk_size=48, max_running=8))
    assert report.ok, report.first_divergence()
    assert any(o.num_preemptions and o.readmission_hit_tokens for o in report.outcomes)
    assert any(o.eagle and o.hit_tokens for o in report.outcomes)


# ------------------------------------------------------------------------------ sabotage
class SabotageRunner(CompressedRunner):
    """Rewrites, in the pool, one cache layer's rows of the last hit block before the hit's
    first chunk reads them (``ROLE`` of layer 1, a C4 layer): a cached block whose content
    is wrong but finite."""

    ROLE: str = "entries"

    @staticmethod
    def sabotage(rows: torch.Tensor) -> torch.Tensor:
        return rows + 0.01

    def _resolve(self, manager: KVCacheManager, chunk: ScheduledChunk, row: int) -> _Work:
        hit = chunk.num_hit_tokens
        if hit and chunk.num_computed_tokens == hit:
            cache_layer = self.layout.cache_layer(C4_LAYER, self.ROLE)  # type: ignore[arg-type]
            layer = self.layout.layers[cache_layer]
            table = manager.get_block_ids(chunk.req_id)[self.pool.group_of(cache_layer)]
            last = hit // layer.spec.block_size - 1
            per_block = layer.rows_per_block()
            index = self.pool.index(req_id=chunk.req_id, cache_layer=cache_layer,
                                    table=table, first=last * per_block,
                                    end=(last + 1) * per_block)
            self.pool.write(cache_layer, index,
                            self.sabotage(self.pool.read(cache_layer, index)))
        return super()._resolve(manager, chunk, row)


class IndexerSabotage(SabotageRunner):
    """Negated indexer keys: the scores (relu) and so the chosen entries change."""

    ROLE = "indexer"

    @staticmethod
    def sabotage(rows: torch.Tensor) -> torch.Tensor:
        return -rows


def test_sabotaged_compressed_block_content_is_caught() -> None:
    report = _verify(runner=SabotageRunner)
    assert not report.ok
    assert all(0 < o.max_logit_diff < float("inf") for o in report.outcomes)
    error = report.first_divergence()
    assert error is not None and error.policy == "latest"


def test_sabotaged_indexer_block_content_is_caught() -> None:
    report = _verify(runner=IndexerSabotage)
    assert not report.ok
    assert all(0 < o.max_logit_diff < float("inf") for o in report.outcomes)


def test_the_unsabotaged_runner_passes_the_same_check() -> None:
    assert _verify().ok


TableEdit = Callable[[list[int], int], None]


@pytest.fixture
def hits(monkeypatch: pytest.MonkeyPatch, pure_python: None) -> Iterator[dict[str, int]]:
    """Per request, its latest hit length (tokens)."""
    log: dict[str, int] = {}
    original = KVCacheManager.find_longest_hit

    def find_longest_hit(self: KVCacheManager, req_id: str,
                         max_num_tokens: int | None = None):  # type: ignore[no-untyped-def]
        hit = original(self, req_id, max_num_tokens)
        log[req_id] = hit.num_tokens
        return hit

    monkeypatch.setattr(KVCacheManager, "find_longest_hit", find_longest_hit)
    yield log


def _corrupt(monkeypatch: pytest.MonkeyPatch, hits: dict[str, int], group_id: int,
             edit: TableEdit) -> None:
    """Edit one group's table where a request's hit lies (``edit(table, hit_blocks)``)."""
    original = KVCacheManager.get_block_ids

    def get_block_ids(self: KVCacheManager, req_id: str) -> tuple[tuple[int, ...], ...]:
        tables = [list(t) for t in original(self, req_id)]
        if self.config.enable_caching and hits.get(req_id, 0):
            size = self.config.groups[group_id].spec.block_size
            edit(tables[group_id], hits[req_id] // size)
        return tuple(tuple(t) for t in tables)

    monkeypatch.setattr(KVCacheManager, "get_block_ids", get_block_ids)


def test_duplicated_compressed_block_diverges(monkeypatch: pytest.MonkeyPatch,
                                              hits: dict[str, int]) -> None:
    """The hit's second entries block replaced by its first: written, finite, wrong."""
    def duplicate(table: list[int], num_hit_blocks: int) -> None:
        if num_hit_blocks >= 2:
            table[1] = table[0]

    _corrupt(monkeypatch, hits, _group_of(C4_LAYER, "entries"), duplicate)
    report = _verify()
    assert not report.ok and report.outcomes[0].max_logit_diff < float("inf")


def test_null_compressed_block_raises(monkeypatch: pytest.MonkeyPatch,
                                      hits: dict[str, int]) -> None:
    def drop_first(table: list[int], num_hit_blocks: int) -> None:
        table[0] = 0

    _corrupt(monkeypatch, hits, _group_of(C4_LAYER, "entries"), drop_first)
    with pytest.raises(InvariantViolation,
                       match=r"layer 1 entries .*: entry 0 is needed but maps to the null "
                             r"block 0"):
        _verify()


def test_never_written_compressed_block_poisons_logits(monkeypatch: pytest.MonkeyPatch,
                                                       hits: dict[str, int]) -> None:
    def unwritten(table: list[int], num_hit_blocks: int) -> None:
        table[num_hit_blocks - 1] = NUM_BLOCKS - 1

    _corrupt(monkeypatch, hits, _group_of(C4_LAYER, "entries"), unwritten)
    report = _verify()
    assert not report.ok and report.outcomes[0].max_logit_diff == float("inf")


def test_stale_compressor_state_diverges(monkeypatch: pytest.MonkeyPatch,
                                         hits: dict[str, int]) -> None:
    """The C4 layer's residual state before the hit (rows ``[h - 4, h)``, the chunk the
    next entry overlaps) read from the block before it: the next entry is wrong."""
    def stale(table: list[int], num_hit_blocks: int) -> None:
        if num_hit_blocks >= 2 and table[num_hit_blocks - 2]:
            table[num_hit_blocks - 1] = table[num_hit_blocks - 2]

    _corrupt(monkeypatch, hits, _group_of(C4_LAYER, "state"), stale)
    report = _verify()
    assert not report.ok and report.outcomes[0].max_logit_diff < float("inf")


def test_cli_verify_pattern_v4(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--pattern", "v4", "--workload", "boundaries", "--policy",
                 "latest", "--compressed-block-size", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "('window', 'C4+indexer', 'C16', 'C4+indexer')" in out and "all identical" in out
    assert main(["verify", "--pattern", "v4", "--compressed-block-size", "24"]) == 2
    assert "must be a multiple of every compress ratio" in capsys.readouterr().err
    assert main(["verify", "--pattern", "v4", "--hca-ratio", "1"]) == 2
    assert "--hca-ratio must be an integer >= 2" in capsys.readouterr().err
    assert main(["verify", "--pattern", "v4", "--index-topk", "-1"]) == 2
    assert "--index-topk must be an integer >= 0" in capsys.readouterr().err
