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

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,  # stateful steps vary a lot in cost; time limits live in the tests
    "suppress_health_check": [HealthCheck.too_slow],
}

settings.register_profile("dev", max_examples=100, **_COMMON)
settings.register_profile("ci", max_examples=300, derandomize=True, **_COMMON)
settings.register_profile("nightly", max_examples=5000, **_COMMON)

settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
)
