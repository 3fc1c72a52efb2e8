"""Host-memory limit of the simulated pool, output-path checks and argparse value types."""

from __future__ import annotations

import argparse
import hashlib
import tracemalloc
from pathlib import Path

import pytest

from hybridkv.cli.argtypes import non_empty_str, non_negative_float, positive_int
from hybridkv.errors import ConfigError, OutputPathError
from hybridkv.limits import BYTES_PER_POOL_BLOCK, available_memory_bytes, check_pool_fits
from hybridkv.outputs import StagedOutputs, check_output_path
from hybridkv.pool import BlockPool


def test_bytes_per_block_covers_a_full_cached_pool() -> None:
    """Re-measure what one block costs (empty pool, then every block cached with a
    SHA-256 hash); the constant the limit uses must not underestimate it."""
    num_blocks = 20_000
    tracemalloc.start()
    try:
        pool = BlockPool(num_blocks, 1)
        blocks = pool.allocate(num_blocks - 1)
        for i, block in enumerate(blocks):
            pool.cache_block(block, hashlib.sha256(i.to_bytes(8, "little")).digest(), 0)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_block = used / num_blocks
    assert 150 < per_block <= BYTES_PER_POOL_BLOCK, per_block


def test_pool_limit_counts_processes() -> None:
    check_pool_fits(1000, flag="--num-blocks", value=1000, available=1000 * 320)
    with pytest.raises(ConfigError, match="in each of 2 processes"):
        check_pool_fits(1000, flag="--num-blocks", value=1000, num_processes=2,
                        available=1000 * 320)


def test_available_memory_is_read_on_linux() -> None:
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo")
    available = available_memory_bytes()
    assert available is not None and available > 1 << 20


def test_check_output_path_accepts_a_new_file(tmp_path: Path) -> None:
    assert check_output_path("--json", tmp_path / "r.json") == tmp_path / "r.json"
    assert list(tmp_path.iterdir()) == []  # the writability probe cleaned up


@pytest.mark.parametrize("name", ["r.png", "r.PDF", "r.svg"])
def test_plot_extensions(tmp_path: Path, name: str) -> None:
    check_output_path("--plot", tmp_path / name, plot=True)


def test_staged_outputs_are_removed_unless_committed(tmp_path: Path) -> None:
    with StagedOutputs() as staged:
        staged.stage("--json", tmp_path / "a.json", lambda p: p.write_text("{}"))
        assert len(list(tmp_path.iterdir())) == 1  # the temporary file, not a.json
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutputPathError, match="writing failed"), StagedOutputs() as staged:
        staged.stage("--json", tmp_path / "a.json", lambda p: p.write_text("{}"))
        staged.stage("--csv", tmp_path / "b.csv", _raise_disk_full)
    assert list(tmp_path.iterdir()) == []


def _raise_disk_full(path: Path) -> None:
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize(("parse", "text"), [
    (positive_int, "0"), (positive_int, "-1"), (positive_int, ""), (positive_int, "1.5"),
    (non_empty_str, ""), (non_empty_str, "  "), (non_negative_float, "nan"),
    (non_negative_float, "-0.5"), (non_negative_float, "inf"),
])
def test_argtypes_refuse(parse: object, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)  # type: ignore[operator]
