"""vLLM 0.33 schedulers whose KV-cache manager is hybridkv's facade, for ``--scheduler-cls``.

    vllm serve MODEL --scheduler-cls hybridkv.vllm.HybridKVAsyncScheduler \\
        --additional-config '{"hybridkv": {"policy": "interval:32768+predict"}}'

``HybridKVAsyncScheduler`` for async scheduling (vLLM 0.33's default);
``HybridKVScheduler`` with ``--no-async-scheduling``. Each builds vLLM's scheduler with
``HybridKVCacheManager`` constructed in place of vLLM's manager (vLLM's block pool is
never built): ``vllm.v1.core.sched.scheduler`` looks its manager class up as a module
global while ``Scheduler.__init__`` runs, so the global is swapped for exactly that call.

Options (``additional_config["hybridkv"]``): ``policy`` (a hybridkv policy name; default:
the one equal to vLLM's retention interval) and ``admission`` (``fcfs``, vLLM's order, the
default).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import vllm.v1.core.sched.scheduler as _sched_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from hybridkv.vllm.config import UnsupportedFeature
from hybridkv.vllm.manager import HybridKVCacheManager

_SWAP_LOCK = threading.Lock()


def options_from_vllm_config(vllm_config: Any) -> dict[str, Any]:
    """``additional_config["hybridkv"]`` (a dict), checked: unknown keys are refused.

    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(additional_config={"hybridkv": {"policy": "latest"}})
    >>> options_from_vllm_config(config)
    {'policy': 'latest'}
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    options = dict(extra.get("hybridkv", {})) if isinstance(extra, dict) else {}
    unknown = set(options) - {"policy", "admission"}
    if unknown:
        raise UnsupportedFeature(f"additional_config hybridkv options {sorted(unknown)} "
                                 "(known: policy, admission)")
    if options.get("admission", "fcfs") != "fcfs":
        raise UnsupportedFeature(f"admission order {options['admission']!r} (fcfs only)")
    return options


def refuse_unsupported_config(vllm_config: Any) -> None:
    """One ``UnsupportedFeature`` line for vLLM features the facade cannot serve."""
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise UnsupportedFeature("KV connectors (kv_transfer_config)")
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "is_encoder_decoder", False):
        raise UnsupportedFeature("encoder-decoder models")


@contextlib.contextmanager
def manager_swapped(policy: str | None) -> Iterator[None]:
    """While inside, vLLM's Scheduler constructs ``HybridKVCacheManager(policy=policy)``."""
    with _SWAP_LOCK:
        saved = _sched_module.KVCacheManager
        _sched_module.KVCacheManager = functools.partial(HybridKVCacheManager, policy=policy)
        try:
            yield
        finally:
            _sched_module.KVCacheManager = saved


def _vllm_config_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]


def _init_with_hybridkv(base_init: Callable[..., None], args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> None:
    """Run a vLLM scheduler's ``__init__`` (``base_init``, bound) with hybridkv's manager
    swapped in, after refusing what the facade cannot serve."""
    vllm_config = _vllm_config_of(args, kwargs)
    refuse_unsupported_config(vllm_config)
    options = options_from_vllm_config(vllm_config)
    with manager_swapped(options.get("policy")):
        base_init(*args, **kwargs)


class HybridKVScheduler(Scheduler):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's ``Scheduler`` with hybridkv's KV-cache manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _init_with_hybridkv(super().__init__, args, kwargs)


class HybridKVAsyncScheduler(AsyncScheduler):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler`` with hybridkv's KV-cache manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _init_with_hybridkv(super().__init__, args, kwargs)
