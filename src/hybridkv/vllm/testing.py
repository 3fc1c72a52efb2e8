"""pytest plugin: every Scheduler that vLLM 0.33's own tests build gets hybridkv's manager.

    python -m pytest -p hybridkv.vllm.testing tests/v1/core    # inside vLLM's sdist tree
    HYBRIDKV_VLLM_POLICY=interval:32768+predict python -m pytest -p hybridkv.vllm.testing ...

It rebinds ``vllm.v1.core.sched.scheduler.KVCacheManager`` (the name ``Scheduler.__init__``
constructs) to ``HybridKVCacheManager`` with the policy of ``$HYBRIDKV_VLLM_POLICY``
(default ``latest``; ``vllm`` keeps vLLM's own manager, for the baseline). Tests that
construct vLLM's manager or block pool themselves (``test_prefix_caching.py``, ...) are
untouched. ``skiplist.SKIPPED`` lists the test cases the facade refuses, each with its
reason (plus ``POLICY_SKIPPED`` for one policy); they are reported as skipped.

``$HYBRIDKV_VLLM_REPORT=path.json``: per test case, its outcome and whether it built a
Scheduler (a manager was constructed through the rebound name), as
``{"nodeid": ["failed", true, "first line of the error"], ...}`` (``bench/vllm_tests.py``
reads it).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from hybridkv.vllm.skiplist import POLICY_SKIPPED, SKIPPED

STOCK = "vllm"
"""``$HYBRIDKV_VLLM_POLICY`` value that keeps vLLM's own manager (recording only)."""

_state: dict[str, Any] = {"current": None, "built": set(), "outcomes": {}}


def _recording(factory: Any) -> Any:
    """``factory`` (a manager class), noting that the running test built a Scheduler."""

    def build(*args: Any, **kwargs: Any) -> Any:
        if _state["current"] is not None:
            _state["built"].add(_state["current"])
        return factory(*args, **kwargs)

    return build


def pytest_configure(config: Any) -> None:
    import vllm.v1.core.sched.scheduler as sched_module

    policy = os.environ.get("HYBRIDKV_VLLM_POLICY", "latest")
    if policy == STOCK:
        factory = sched_module.KVCacheManager
    else:
        from hybridkv.vllm.manager import HybridKVCacheManager
        factory = functools.partial(HybridKVCacheManager, policy=policy)
    sched_module.KVCacheManager = _recording(factory)


def pytest_report_header(config: Any) -> str:
    return f"hybridkv.vllm.testing: policy {os.environ.get('HYBRIDKV_VLLM_POLICY', 'latest')}"


def skip_reason(nodeid: str, policy: str) -> str | None:
    """Why the facade refuses this test case under ``policy`` (``None``: it must pass).

    >>> skip_reason("tests/v1/core/test_scheduler.py::test_add_requests", "latest") is None
    True
    """
    extra = POLICY_SKIPPED.get(policy, {})
    for key in (nodeid, nodeid.split("[", 1)[0]):
        reason = SKIPPED.get(key) or extra.get(key)
        if reason is not None:
            return reason
    return None


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    policy = os.environ.get("HYBRIDKV_VLLM_POLICY", "latest")
    if policy == STOCK:
        return
    import pytest

    for item in items:
        reason = skip_reason(item.nodeid, policy)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"hybridkv refuses: {reason}"))


def pytest_runtest_setup(item: Any) -> None:
    _state["current"] = item.nodeid


def pytest_runtest_logreport(report: Any) -> None:
    outcomes = _state["outcomes"]
    if (report.when == "call" or report.outcome != "passed") and \
            (report.nodeid not in outcomes or outcomes[report.nodeid][0] == "passed"):
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message.split("\n", 1)[0] if crash is not None else ""
        if report.skipped and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])
        outcomes[report.nodeid] = (report.outcome, message)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("HYBRIDKV_VLLM_REPORT")
    if not path:
        return
    built = _state["built"]
    rows = {nodeid: [outcome, nodeid in built, message]
            for nodeid, (outcome, message) in sorted(_state["outcomes"].items())}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(rows, handle, indent=0)
