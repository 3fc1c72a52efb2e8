"""How big a pool the replay may build on this host, checked before it allocates anything.

The simulator allocates no KV memory, but its pool is made of Python objects: one
``Block`` per block, its free-queue links, and, once cached, its hash and hash-index entry.
Measured with ``tracemalloc`` (``tests/unit/test_limits.py`` re-measures it and fails if
the constant below ever underestimates): 160 bytes per block for an empty pool, 293 bytes
per block once every block carries a cached SHA-256 hash. A pool whose worst case exceeds
the memory the host has available (``MemAvailable`` in ``/proc/meminfo``) would thrash or be
killed minutes into a run, so it is refused up front with the numbers.

>>> pool_host_bytes(65_536)          # the default 64 GiB pool of gemma3-bench: 20 MiB
20971520
>>> check_pool_fits(10**12, flag="--num-blocks", value="1000000000000", available=8 << 30)
Traceback (most recent call last):
...
hybridkv.errors.ConfigError: --num-blocks='1000000000000' is invalid: a pool of \
1,000,000,000,000 blocks needs ~291.0 TiB of host memory for its bookkeeping (320 bytes a \
block), but 8.0 GiB are available; use a smaller pool
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from hybridkv.errors import ConfigError

BYTES_PER_POOL_BLOCK: Final = 320
"""Host memory one pool block costs in the simulator, worst case (cached, hashed), rounded up."""

MEMINFO: Final = Path("/proc/meminfo")


def pool_host_bytes(num_blocks: int, *, num_processes: int = 1) -> int:
    """Worst-case host memory of ``num_processes`` pools of ``num_blocks`` blocks each."""
    return num_blocks * BYTES_PER_POOL_BLOCK * num_processes


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of this host in bytes, ``None`` where it cannot be read (not Linux)."""
    try:
        with MEMINFO.open(encoding="ascii") as stream:
            for line in stream:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def format_bytes(num_bytes: float) -> str:
    """``1536`` → ``'1.5 KiB'``.

    >>> format_bytes(1536), format_bytes(3 * 2**40), format_bytes(12)
    ('1.5 KiB', '3.0 TiB', '12 B')
    """
    if num_bytes < 1024:
        return f"{num_bytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        num_bytes /= 1024
        if num_bytes < 1024 or unit == "PiB":
            break
    return f"{num_bytes:.1f} {unit}"


def check_pool_fits(num_blocks: int, *, flag: str, value: object, num_processes: int = 1,
                    available: int | None = None) -> None:
    """Raise ``ConfigError`` (naming ``flag`` and ``value``) when ``num_processes`` pools of
    ``num_blocks`` blocks would not fit the host's available memory."""
    if available is None:
        available = available_memory_bytes()
    if available is None:
        return
    needed = pool_host_bytes(num_blocks, num_processes=num_processes)
    if needed <= available:
        return
    processes = f" in each of {num_processes} processes" if num_processes > 1 else ""
    raise ConfigError(flag, value, f"a pool of {num_blocks:,} blocks{processes} needs "
                      f"~{format_bytes(needed)} of host memory for its bookkeeping "
                      f"({BYTES_PER_POOL_BLOCK} bytes a block), but "
                      f"{format_bytes(available)} are available; use a smaller pool")


__all__ = ["BYTES_PER_POOL_BLOCK", "available_memory_bytes", "check_pool_fits",
           "format_bytes", "pool_host_bytes"]
