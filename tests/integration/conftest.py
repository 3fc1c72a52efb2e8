"""Integration-test fixtures: spawned CLI processes never outlive their test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cli_harness import reap_spawned


@pytest.fixture(autouse=True)
def _reap_spawned_cli() -> Iterator[None]:
    yield
    reap_spawned()
