"""hybridkv's facade against vLLM 0.33's own ``KVCacheManager`` (needs vLLM: CI runs these
in the vLLM venv of ``bench/setup_vllm.sh``; elsewhere they are skipped)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (bench/setup_vllm.sh)")

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from hybridkv.vllm import HybridKVCacheManager, UnsupportedFeature
from hybridkv.vllm.config import UnsupportedInternal

BLOCK = 4


def kv_config(num_blocks: int = 40, retention: int | None = 0) -> Any:
    common = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["full"], FullAttentionSpec(**common)),
                         KVCacheGroupSpec(["swa"], SlidingWindowSpec(sliding_window=8,
                                                                     **common))],
        prefix_cache_retention_interval=retention)


def manager_kwargs(retention: int | None = 0) -> dict[str, Any]:
    return {"kv_cache_config": kv_config(retention=retention), "max_model_len": 4096,
            "scheduler_block_size": BLOCK, "hash_block_size": BLOCK,
            "max_in_flight_tokens": 64, "log_stats": True}


def make_request(req_id: str, tokens: list[int]) -> Any:
    init_none_hash(sha256)
    return Request(request_id=req_id, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=8), pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


TWO_REQUESTS = (("a", [90, 91, 92, 93, 94]), ("b", [70, 71, 72]))


def run_scenario(manager: Any, suffixes: tuple[tuple[str, list[int]], ...] = TWO_REQUESTS,
                 ) -> list[Any]:
    """Requests sharing a 16-token prefix (default: two), one after the other, driven as
    vLLM's scheduler drives its manager (synchronous steps); returns what the Scheduler
    would see."""
    seen: list[Any] = []
    for req_id, suffix in suffixes:
        request = make_request(req_id, list(range(16)) + suffix)
        blocks, hit, junction = manager.get_computed_blocks(request)
        request.shared_prefix_boundary = junction  # as vLLM's Scheduler stores it
        seen.append(junction)
        new = manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_tokens
        seen.append((hit, new.get_block_ids(), manager.get_block_ids(req_id)))
        for token in (5, 6, 7):  # three decode steps
            request.append_output_token_ids(token)
            manager.new_step_starts()
            new = manager.allocate_slots(request, 1)
            request.num_computed_tokens += 1
            seen.append(new.get_block_ids())
        seen.append((manager.estimate_cached_tokens(request), manager.usage))
        request.status = RequestStatus.FINISHED_STOPPED
        manager.free(request)
    seen.append(manager.block_pool.get_num_free_blocks())
    return seen


@pytest.mark.parametrize(("retention", "policy", "hit"),
                         [(None, "prepend", 16), (0, "latest", 0), (8, "interval:8", 16)])
def test_the_facade_answers_as_vllms_manager(retention: int | None, policy: str,
                                             hit: int) -> None:
    theirs = run_scenario(KVCacheManager(**manager_kwargs(retention)))
    ours = run_scenario(HybridKVCacheManager(**manager_kwargs(retention), policy=policy))
    assert theirs[7][0] == hit and ours == theirs


@pytest.mark.parametrize(("retention", "policy"), [(0, "latest"), (32, "interval:32")])
def test_a_missed_lookups_junction_is_retained_for_the_next_request(
        retention: int | None, policy: str) -> None:
    """Under sparse retention ``b`` (28 tokens) misses, as the window group kept only
    ``a``'s tail at its prompt end, but full attention matched 16 tokens: vLLM keeps the
    window blocks ending at that junction when ``b`` runs (``b``'s own prompt-end tail
    ends at 24), so ``c`` hits 16 tokens. The facade used to drop a 0-token hit at
    admission, and with it the junction (``c`` then hit 0)."""
    three = (TWO_REQUESTS[0], ("b", list(range(70, 82))), ("c", [50, 51, 52]))
    theirs = run_scenario(KVCacheManager(**manager_kwargs(retention)), three)
    ours = run_scenario(HybridKVCacheManager(**manager_kwargs(retention), policy=policy),
                        three)
    b_junction, b_hit, c_hit = theirs[6], theirs[7][0], theirs[13][0]
    assert (b_junction, b_hit, c_hit) == (16, 0, 16)
    assert ours == theirs


def test_the_constructor_and_methods_track_vllms_signatures() -> None:
    """Drift test: the facade keeps the keyword signature of the installed
    ``KVCacheManager.__init__`` and every public method with its parameter names."""
    theirs = inspect.signature(KVCacheManager.__init__).parameters
    ours = inspect.signature(HybridKVCacheManager.__init__).parameters
    assert [(p.name, p.default) for p in theirs.values()] == \
        [(p.name, p.default) for p in ours.values() if p.name != "policy"]
    for name, member in inspect.getmembers(KVCacheManager):
        if name.startswith("_"):
            continue
        assert hasattr(HybridKVCacheManager, name), f"facade lacks {name}"
        if inspect.isfunction(member):
            assert list(inspect.signature(member).parameters) == \
                list(inspect.signature(getattr(HybridKVCacheManager, name)).parameters), name


@pytest.mark.parametrize(("kwargs", "feature"), [
    ({"dcp_world_size": 2}, "context parallelism"),
    ({"watermark": 0.01}, "watermark"),
    ({"policy": "latest+recompute"}, "recompute"),
])
def test_unsupported_settings_are_refused_in_one_line(kwargs: dict[str, Any],
                                                      feature: str) -> None:
    with pytest.raises(UnsupportedFeature, match=feature) as info:
        HybridKVCacheManager(**{**manager_kwargs(), **kwargs})
    assert "\n" not in str(info.value)


def test_unmodelled_internals_and_connector_calls_are_refused() -> None:
    manager = HybridKVCacheManager(**manager_kwargs())
    with pytest.raises(UnsupportedInternal, match=r"BlockPool\.get_new_blocks"):
        _ = manager.block_pool.get_new_blocks
    assert getattr(manager.block_pool, "hash_block_size", None) is None  # probes work
    request = make_request("a", list(range(8)))
    with pytest.raises(UnsupportedFeature, match="KV connectors"):
        manager.allocate_slots(request, 8, num_external_computed_tokens=4)
    manager.free(request)  # never seen: a no-op, as vLLM frees an aborted waiting request


@pytest.mark.parametrize("name", ["hybridkv.vllm.config", "hybridkv.vllm.scheduler",
                                  "hybridkv.vllm.testing"])
def test_docstring_examples_of_the_plugin(name: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0
