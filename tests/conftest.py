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


# ---------------------------------------------------------------- compiled / pure core
# ``python -m pytest`` tests whichever core ``hybridkv.native`` selected (the header line
# says which); ``HYBRIDKV_PURE_PYTHON=1`` forces the pure-Python one. A test that replaces
# or subclasses a class of the compiled modules (mypyc classes are closed) requests the
# ``pure_python`` fixture: it is skipped on the compiled core and marked ``pure_python``,
# so CI's pure-Python pass can select it (``.ci/run``).


def _core_is_compiled() -> bool:
    import hybridkv.native

    selection = hybridkv.native.SELECTED
    return selection is not None and selection.mode == "compiled"


def pytest_report_header(config: pytest.Config) -> str:
    import hybridkv.native

    selection = hybridkv.native.SELECTED or hybridkv.native.decide()
    return f"hybridkv core: {selection.mode} ({selection.reason})"


@pytest.fixture
def pure_python() -> None:
    """Skip on the compiled core: the test patches or subclasses a compiled class."""
    if _core_is_compiled():
        pytest.skip("patches a compiled (closed) class; runs in CI's pure-Python pass")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "pure_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.pure_python)
