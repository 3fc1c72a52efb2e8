"""Engine tests: tiny float64 models on the CPU (skipped when torch is not installed).

Every test here runs single-threaded: the matrices are a few dozen wide, and on a shared
2-core CI runner OpenMP's thread hand-off costs ~30x the work itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
