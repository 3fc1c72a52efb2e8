PY ?= python

.PHONY: install lint type test prop engine check bench demo

install:
	$(PY) -m pip install -e ".[test]"

lint:
	ruff check src tests bench

type:
	mypy

test:
	$(PY) -m pytest

prop:
	HYPOTHESIS_PROFILE=nightly $(PY) -m pytest tests/property

engine:
	$(PY) -m pytest -m engine

check: lint type test

demo:
	hybridkv replay
