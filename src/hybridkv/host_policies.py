"""Host-tier policy names → tiers (``--host-policy``): one registry, no per-name branches
elsewhere.

>>> from hybridkv.host_tier import HostGroup, HostShape
>>> from hybridkv.ids import GroupId
>>> shape = HostShape((HostGroup(GroupId(0), 16, None),), 16, 16, 1024)
>>> [make_host_tier(n, shape, 8).name for n in ("aware", "lru", "lru-split", "lru-split:0.25")]
['aware', 'lru', 'lru-split:0.5', 'lru-split:0.25']
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.errors import ConfigError
from hybridkv.host_aware import LandingTier
from hybridkv.host_lru import BlockLRUTier
from hybridkv.host_tier import HostShape, HostTier
from hybridkv.ids import GroupId

DEFAULT_STATE_SHARE = 0.5
"""``lru-split``'s state share when none is given (half the host bytes, as the SGLang
report #39851 measured HiCache's default split)."""


def _split(shape: HostShape, capacity_blocks: int, arg: str | None) -> HostTier:
    share = DEFAULT_STATE_SHARE
    if arg is not None:
        try:
            share = float(arg)
        except ValueError:
            share = -1.0
        if not 0.0 <= share <= 1.0:
            raise ConfigError("--host-policy", f"lru-split:{arg}",
                              "give the state share as a number in [0, 1], e.g. lru-split:0.5")
    return BlockLRUTier(shape, capacity_blocks, state_share=share)


HOST_POLICIES: dict[str, Callable[[HostShape, int, str | None], HostTier]] = {
    "aware": lambda shape, blocks, arg: LandingTier(shape, blocks),
    "lru": lambda shape, blocks, arg: BlockLRUTier(shape, blocks),
    "lru-split": _split,
}
"""Name → factory ``(shape, capacity_blocks, argument after ':')``."""


def check_host_policy(name: str) -> None:
    """Raise ``ConfigError`` unless ``name`` is a host policy (before a run starts).

    >>> check_host_policy("lru-split:2")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    hybridkv.errors.ConfigError: --host-policy='lru-split:2' is invalid: give the state ...
    """
    from hybridkv.host_tier import HostGroup  # a one-group shape: names only

    make_host_tier(name, HostShape((HostGroup(GroupId(0), 1, None),), 1, 1, 1), 0)


def make_host_tier(name: str, shape: HostShape, capacity_blocks: int) -> HostTier:
    """The tier ``name`` (``aware``, ``lru``, ``lru-split[:SHARE]``) of ``capacity_blocks``.

    Raises:
        ConfigError: an unknown name, or an argument where the policy takes none.
    """
    base, _, arg = name.partition(":")
    factory = HOST_POLICIES.get(base)
    if factory is None or (arg and base != "lru-split"):
        raise ConfigError("--host-policy", name,
                          f"use one of {', '.join(sorted(HOST_POLICIES))} "
                          "(lru-split takes a state share: lru-split:0.5)")
    return factory(shape, capacity_blocks, arg or None)
