"""Shared pytest configuration: hypothesis profiles.

Profiles (select with ``HYPOTHESIS_PROFILE``; default ``ci`` when ``CI`` is set, else ``dev``):

========  ========  =======================================================
dev       100       quick local runs
ci        300       ``derandomize=True``: the same examples on every CI run
nightly   5000      ``make prop``
========  ========  =======================================================
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# no deadline: stateful steps vary a lot in cost; the tests bound their own work
_COMMON = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

settings.register_profile("dev", _COMMON, max_examples=100)
settings.register_profile("ci", _COMMON, max_examples=300, derandomize=True)
settings.register_profile("nightly", _COMMON, max_examples=5000)

settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
)


def pytest_configure(config: pytest.Config) -> None:
    # Hypothesis touches ``mypy_extensions.TypedDict`` while printing a falsifying example;
    # under ``filterwarnings = error`` that DeprecationWarning would replace the report of
    # the real failure with an INTERNALERROR.
    config.addinivalue_line(
        "filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")
