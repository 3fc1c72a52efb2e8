"""Routers of a cluster replay: which instance a request goes to.

A router sees what a real one sees: the request (its prompt ids and session), each
instance's load as last reported (queued prompt tokens and requests, refreshed every
epoch, plus what it routed itself since), and — for the prefix routers — the KV events the
instances published (``hybridkv.cluster.prefix``). Never an instance's manager.

- ``round-robin``: instance ``k mod N`` for the k-th request.
- ``least-loaded``: fewest queued prompt tokens (ties: fewer requests, lower index).
- ``session``: session affinity, sticky: a session's first request goes to the least
  loaded instance, every later one to the same instance; requests without a session are
  routed least-loaded.
- ``prefix-fa`` / ``prefix-residency``: prefix-cache scorers (``prefix.py``).

>>> loads = [Load(100, 1), Load(0, 0), Load(0, 0)]
>>> LeastLoaded(3).route(RouteRequest(0, "r", None, 10), loads).instance
1
>>> router = SessionAffinity(3)
>>> [router.route(RouteRequest(i, f"r{i}", "s", 10), loads).instance for i in range(2)]
[1, 1]
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from hybridkv.errors import ConfigError


@dataclass(slots=True)
class Load:
    """A router's view of one instance's load."""

    queued_tokens: int
    """Prompt tokens routed to it and not yet computed or loaded from its cache."""
    num_requests: int
    """Requests queued or running there."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router is told about a request (prompt ids come lazily from the trace)."""

    trace_index: int
    request_id: str
    session_id: str | None
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Route:
    """A routing decision and the prefix hit (tokens) the router expected there (0 for
    routers that do not predict)."""

    instance: int
    predicted_hit_tokens: int = 0


def least_loaded(loads: Sequence[Load], among: Sequence[int] | None = None) -> int:
    """Index of the least-loaded instance: fewest queued tokens, then fewest requests,
    then the lowest index.

    >>> least_loaded([Load(5, 1), Load(5, 0), Load(9, 0)])
    1
    """
    candidates = range(len(loads)) if among is None else among
    return min(candidates, key=lambda i: (loads[i].queued_tokens, loads[i].num_requests, i))


class Router:
    """Base class: ``route`` picks an instance; ``observe`` receives an instance's KV
    event payloads (only when ``uses_events``: otherwise its instances publish none)."""

    name: str = ""
    uses_events: ClassVar[bool] = False

    def __init__(self, num_instances: int) -> None:
        self.num_instances = num_instances

    def route(self, request: RouteRequest, loads: Sequence[Load]) -> Route:
        raise NotImplementedError

    def observe(self, instance: int, payloads: Sequence[bytes]) -> None:
        """An instance's published KV event batches (msgpack payloads), in order."""
        del instance, payloads


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self, num_instances: int) -> None:
        super().__init__(num_instances)
        self._next = 0

    def route(self, request: RouteRequest, loads: Sequence[Load]) -> Route:
        chosen = self._next
        self._next = (self._next + 1) % self.num_instances
        return Route(chosen)


class LeastLoaded(Router):
    name = "least-loaded"

    def route(self, request: RouteRequest, loads: Sequence[Load]) -> Route:
        return Route(least_loaded(loads))


class SessionAffinity(Router):
    name = "session"

    def __init__(self, num_instances: int) -> None:
        super().__init__(num_instances)
        self._home: dict[str, int] = {}

    def route(self, request: RouteRequest, loads: Sequence[Load]) -> Route:
        session = request.session_id
        if session is None:
            return Route(least_loaded(loads))
        home = self._home.get(session)
        if home is None:
            home = self._home[session] = least_loaded(loads)
        return Route(home)


RouterFactory = Callable[[int], Router]

SIMPLE_ROUTERS: dict[str, RouterFactory] = {
    RoundRobin.name: RoundRobin, SessionAffinity.name: SessionAffinity,
    LeastLoaded.name: LeastLoaded,
}


def parse_routers(text: str, known: Sequence[str]) -> list[str]:
    """``all`` or a comma-separated list of router names (a typo gets a suggestion).

    >>> parse_routers("session, round-robin", ["round-robin", "session"])
    ['session', 'round-robin']
    >>> parse_routers("sesion", ["round-robin", "session"])
    Traceback (most recent call last):
    ...
    hybridkv.errors.ConfigError: --router='sesion' is invalid: did you mean 'session'? ...
    """
    names = [n.strip() for n in text.split(",")]
    if not any(names):
        raise ConfigError("--router", text, f"name at least one of {', '.join(known)} or all")
    chosen: list[str] = []
    for name in names:
        if name == "all":
            chosen.extend(known)
            continue
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError("--router", name or text,
                              f"{hint}choose from {', '.join(known)} or all")
        chosen.append(name)
    return list(dict.fromkeys(chosen))


__all__ = ["SIMPLE_ROUTERS", "LeastLoaded", "Load", "RoundRobin", "Route", "RouteRequest",
           "Router", "RouterFactory", "SessionAffinity", "least_loaded", "parse_routers"]
