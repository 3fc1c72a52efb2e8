"""``ckpt:branch`` on the reference engine: sub-block hits (branch-point snapshots,
copy-on-write) give the outputs of full recomputation on a float64 Gated DeltaNet +
full-attention model, and every way of getting a snapshot wrong is caught.

The sabotage tests break one thing each and require ``hybridkv verify`` to report a
divergence: a snapshot of another position, a copy-on-write copy not performed, a snapshot
copy not performed, and a stale snapshot (copied before the step that computes it ran).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import pytest

from hybridkv.block import Block
from hybridkv.branch import BlockCopy, BranchSnapshots
from hybridkv.cli import main
from hybridkv.coordinator import HybridCoordinator
from hybridkv.engine.model import HybridDecoder
from hybridkv.engine.model_config import ModelConfig, qwen3_next_pattern
from hybridkv.engine.synthetic import make_engine_workload
from hybridkv.engine.verify import VerifyReport, VerifySettings, run_verify
from hybridkv.ids import BlockHash, ReqId

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

from hybridkv.engine.checkpoints import PagedStateCache  # noqa: E402
from hybridkv.engine.recurrent import Chunking, gated_delta_chunked  # noqa: E402
from hybridkv.engine.runner import EngineRunner  # noqa: E402

BLOCK = 8
BRANCH = ("latest+ckpt:branch:2",)


def _model(seed: int = 1) -> HybridDecoder:
    config = ModelConfig.tiny(layer_types=qwen3_next_pattern(4))
    return HybridDecoder(config, dtype=torch.float64, seed=seed)


def _verify(policies: Sequence[str] = BRANCH, workload: str = "mixed",
            recurrence: object = None, **settings: int) -> VerifyReport:
    requests = make_engine_workload(workload, alignment_tokens=BLOCK, seed=1)
    return run_verify(_model(), requests, policies=policies,
                      settings=VerifySettings(block_size=BLOCK, **settings),
                      recurrence=recurrence)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["latest+ckpt:branch:2", "latest+ckpt:branch",
                                    "prepend+ckpt:branch:4", "interval:16+ckpt:branch:2"])
def test_sub_block_hits_are_identical(policy: str) -> None:
    report = _verify((policy, policy.split("+", maxsplit=1)[0]))
    report.raise_on_divergence()
    branch, plain = report.outcomes
    assert branch.sub_block_hits > 0 and branch.block_copies > 0, branch.line()
    assert branch.hit_tokens > plain.hit_tokens, (branch.line(), plain.line())
    assert plain.block_copies == plain.sub_block_hits == 0
    assert branch.max_logit_diff < 1e-12


def test_sub_block_hits_with_preemption_and_the_chunked_path() -> None:
    chunked = partial(gated_delta_chunked, chunking=Chunking(4))
    report = _verify(BRANCH, workload="all", recurrence=chunked, num_blocks=34,
                     chunk_size=32)  # 2 preemptions, a sub-block hit (deterministic)
    report.raise_on_divergence()
    outcome = report.outcomes[0]
    assert outcome.num_preemptions > 0 and outcome.sub_block_hits > 0, outcome.line()


def test_sub_block_hits_under_eagle_lookahead_hashes_are_identical() -> None:
    """EAGLE (lookahead hashes at the hit unit): sub-block hits still happen and stay
    exact; the drafter side of a snapshot is checked by the property machine."""
    requests = make_engine_workload("mixed", alignment_tokens=BLOCK, seed=1)
    report = run_verify(_model(), requests, policies=BRANCH, eagle=True,
                        settings=VerifySettings(block_size=BLOCK))
    report.raise_on_divergence()
    plain, eagle = report.outcomes
    assert eagle.eagle and eagle.sub_block_hits > 0, eagle.line()
    assert plain.sub_block_hits > 0


def test_verify_command_adds_branch_policies_for_recurrent_models(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--pattern", "qwen3-next", "--workload", "mixed"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {line.split()[0]: line for line in out.splitlines() if " hits " in line}
    assert {"latest+ckpt:branch", "prepend+ckpt:branch:4", "latest"} <= set(rows)
    assert "sub-block hits" in rows["latest+ckpt:branch"], out
    assert "sub-block hits" not in rows["latest"]


# ------------------------------------------------------------------------ sabotage
def _assert_caught(report: VerifyReport) -> None:
    assert not report.ok, [o.line() for o in report.outcomes]
    assert report.outcomes[0].sub_block_hits > 0


def _drop_copies(monkeypatch: pytest.MonkeyPatch, *, after_forward: bool) -> list[int]:
    dropped: list[int] = []
    copy_blocks = EngineRunner.copy_blocks

    def skipping(self: EngineRunner, copies: Sequence[BlockCopy]) -> None:
        kept = [c for c in copies if c.after_forward != after_forward]
        dropped.append(len(copies) - len(kept))
        copy_blocks(self, kept)

    monkeypatch.setattr(EngineRunner, "copy_blocks", skipping)
    return dropped


def test_copy_on_write_not_performed_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hitting request's fresh block never receives the snapshot: it reads an unwritten
    (NaN) page or a previous owner's content."""
    dropped = _drop_copies(monkeypatch, after_forward=False)
    _assert_caught(_verify())
    assert sum(dropped) > 0


def test_snapshot_not_performed_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    dropped = _drop_copies(monkeypatch, after_forward=True)
    _assert_caught(_verify())
    assert sum(dropped) > 0


def test_stale_snapshot_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots copied before the forward pass of the step that computes them: each holds
    what the producer's block held before (the state at the chunk's start, or a previous
    owner's content)."""
    real_states: list[bool] = []
    take_snapshot, copy_state = BranchSnapshots.take_snapshot, PagedStateCache.copy_block

    def too_early(self: BranchSnapshots, req_id: ReqId, block_hash: BlockHash,
                  num_tokens: int, sources: Sequence[Block], *args: BlockHash | None) -> bool:
        before = len(self.copies)
        taken = take_snapshot(self, req_id, block_hash, num_tokens, sources, *args)
        self.copies[before:] = [replace(c, after_forward=False) for c in self.copies[before:]]
        return taken

    def noting(self: PagedStateCache, *, group_id: int, src_block_id: int,
               dst_block_id: int) -> None:
        real_states.append(not bool(torch.isnan(self.ssm[:, src_block_id]).any()))
        copy_state(self, group_id=group_id, src_block_id=src_block_id,
                   dst_block_id=dst_block_id)

    monkeypatch.setattr(BranchSnapshots, "take_snapshot", too_early)
    monkeypatch.setattr(PagedStateCache, "copy_block", noting)
    _assert_caught(_verify(workload="all", num_blocks=48))  # small pool: blocks get reused
    assert any(real_states), "no stale snapshot held a real (earlier) state"


def test_snapshot_of_another_position_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                pure_python: None) -> None:
    """Snapshots keyed one unit early: the state (and KV) after ``p`` tokens handed out
    as the state after ``p - U``."""
    parent: dict[BlockHash, BlockHash] = {}
    shifted: list[int] = []
    take_snapshot = BranchSnapshots.take_snapshot
    snapshot_point = HybridCoordinator._snapshot_branch_point

    def remember(self: HybridCoordinator, req_id: ReqId, hashes: Sequence[BlockHash],
                 num_tokens: int, num_prompt_tokens: int, junction_tokens: int) -> None:
        j = num_tokens // (self.branch.unit_tokens if self.branch else 1) - 1
        if 0 < j < len(hashes):
            parent[hashes[j]] = hashes[j - 1]
        snapshot_point(self, req_id, hashes, num_tokens, num_prompt_tokens, junction_tokens)

    def one_unit_early(self: BranchSnapshots, req_id: ReqId, block_hash: BlockHash,
                       num_tokens: int, sources: Sequence[Block],
                       *args: BlockHash | None) -> bool:
        if block_hash in parent:
            shifted.append(num_tokens)
        return take_snapshot(self, req_id, parent.get(block_hash, block_hash), num_tokens,
                             sources, *args)

    monkeypatch.setattr(HybridCoordinator, "_snapshot_branch_point", remember)
    monkeypatch.setattr(BranchSnapshots, "take_snapshot", one_unit_early)
    _assert_caught(_verify())
    assert shifted
