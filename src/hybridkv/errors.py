"""The hybridkv exception hierarchy.

::

    HybridKVError(Exception)
    ├── ConfigError(HybridKVError, ValueError)          invalid spec / config / policy name
    ├── TraceFormatError(HybridKVError, ValueError)     malformed trace: path, line, field
    ├── RequestError(HybridKVError)                     misuse of the request lifecycle
    │   ├── UnknownRequestError(RequestError, KeyError) request id not tracked
    │   ├── DuplicateRequestError(RequestError)         request id already tracked
    │   ├── DoubleFreeError(RequestError)               free of a request that holds no blocks
    │   └── StaleHitError(RequestError)                 a PrefixHit used after the cache changed
    ├── CapacityError(HybridKVError)                    caller ignored a ``None`` from allocate
    ├── PoolTooSmallError(HybridKVError)                a request can never fit the pool
    ├── OutputPathError(HybridKVError)                  an output file cannot be written
    ├── InvariantViolation(HybridKVError, AssertionError) internal bug, with a state summary
    └── EquivalenceError(HybridKVError, AssertionError) engine outputs diverged

Expected outcomes are values, not exceptions: "no room" is ``None`` from
``allocate_slots``, "no hit" is a ``PrefixHit`` with ``num_tokens == 0``.
"""

from __future__ import annotations


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on purpose."""


class ConfigError(HybridKVError, ValueError):
    """A configuration value is invalid.

    The message names the field, the value and the fix.
    """

    def __init__(self, field: str, value: object, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(f"{field}={value!r} is invalid: {fix}")


class TraceFormatError(HybridKVError, ValueError):
    """A trace file is malformed at a given line and field."""

    def __init__(self, path: str, line: int | None, field: str, problem: str) -> None:
        self.path = path
        self.line = line
        self.field = field
        self.problem = problem
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: field {field!r}: {problem}")


class RequestError(HybridKVError):
    """The request lifecycle was used in a way the cache manager does not allow."""


class UnknownRequestError(RequestError, KeyError):
    """A request id is not tracked by the cache manager."""

    def __init__(self, req_id: str, action: str) -> None:
        self.req_id = req_id
        super().__init__(
            f"request_id={req_id!r} is not tracked (during {action}); "
            "call add_request() first, or check that it was not already removed"
        )

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0])


class DuplicateRequestError(RequestError):
    """A request id is already tracked."""

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        super().__init__(
            f"request_id={req_id!r} is already tracked; use a fresh id or remove_request() it first"
        )


class DoubleFreeError(RequestError):
    """``free`` was called again for an admitted request that holds no blocks (a request
    never admitted holds nothing to free: its ``free`` is a no-op)."""

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        super().__init__(
            f"request_id={req_id!r} holds no blocks (already freed since its last admission); "
            "free() must be called once per allocation lifetime"
        )


class StaleHitError(RequestError):
    """A ``PrefixHit`` was passed to ``allocate_slots`` after the cache changed."""

    def __init__(self, req_id: str, hit_epoch: int, cache_epoch: int) -> None:
        super().__init__(
            f"request_id={req_id!r}: PrefixHit from cache epoch {hit_epoch} used at epoch "
            f"{cache_epoch}; call find_longest_hit() again right before allocate_slots()"
        )


class CapacityError(HybridKVError):
    """The pool ran out of blocks where the caller had promised it would not."""


class PoolTooSmallError(HybridKVError):
    """A request needs more blocks than the whole pool holds, so a replay cannot progress.

    >>> str(PoolTooSmallError("r7", 4096, 257, 100, "--num-blocks",
    ...                       origin="trace 't.jsonl'"))
    "request 'r7' (4096 tokens) of trace 't.jsonl' needs at least 257 blocks but the \
pool holds 100 (99 usable); raise --num-blocks (or --kv-memory) to at least 258"
    """

    def __init__(self, req_id: str, num_tokens: int, blocks_needed: int, num_blocks: int,
                 flag: str = "--num-blocks", *, origin: str | None = None) -> None:
        self.req_id = req_id
        self.num_tokens = num_tokens
        self.blocks_needed = blocks_needed
        self.num_blocks = num_blocks
        self.origin = origin
        """Where the request came from (``trace '…'``, ``workload '…'``)."""
        of = "" if origin is None else f" of {origin}"
        super().__init__(
            f"request {req_id!r} ({num_tokens} tokens){of} needs at least {blocks_needed} "
            f"blocks but the pool holds {num_blocks} ({num_blocks - 1} usable); raise {flag} "
            f"(or --kv-memory) to at least {blocks_needed + 1}")


class OutputPathError(HybridKVError):
    """An output path (``--json``, ``--plot``, ``--csv``) cannot be written.

    >>> str(OutputPathError("--json", "out/r.json", "directory 'out' does not exist",
    ...                     "create it first"))
    "--json 'out/r.json': directory 'out' does not exist; create it first"
    """

    def __init__(self, flag: str, path: object, problem: str, fix: str) -> None:
        self.flag = flag
        self.path = str(path)
        super().__init__(f"{flag} {self.path!r}: {problem}; {fix}")


class InvariantViolation(HybridKVError, AssertionError):
    """An internal invariant does not hold; this is a bug in hybridkv."""


class EquivalenceError(HybridKVError, AssertionError):
    """Cached and uncached engine runs diverged."""

    def __init__(self, policy: str, req_id: str, position: int, detail: str) -> None:
        self.policy = policy
        self.req_id = req_id
        self.position = position
        super().__init__(
            f"policy={policy!r} request={req_id!r} diverged at position {position}: {detail}"
        )
