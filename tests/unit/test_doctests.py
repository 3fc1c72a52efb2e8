"""The worked examples in docstrings are executed: a stale example fails here."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import hybridkv

HAS_VLLM = importlib.util.find_spec("vllm") is not None
MODULES = sorted(m.name for m in pkgutil.walk_packages(hybridkv.__path__, "hybridkv.")
                 if ".engine" not in m.name  # engine examples need torch tensors: none yet
                 and not m.name.endswith(".__main__")  # runs the command on import
                 and (HAS_VLLM or not m.name.startswith("hybridkv.vllm")))  # its own venv


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_examples_exist() -> None:
    attempted = sum(doctest.testmod(importlib.import_module(n), optionflags=doctest.ELLIPSIS)
                    .attempted for n in MODULES)
    assert attempted >= 20
