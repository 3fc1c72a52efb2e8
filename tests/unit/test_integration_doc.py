"""docs/integration.md's example is executed: a stale example fails here."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "integration.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_integration_example_runs() -> None:
    blocks = python_blocks()
    assert blocks, "docs/integration.md lost its example"
    for code in blocks:
        namespace: dict[str, object] = {"__name__": "integration_example"}
        exec(compile(code, str(DOC), "exec"), namespace)
        assert "manager" in namespace


def test_the_example_can_fail() -> None:
    """The example's assertions are live: the same code with a wrong claim raises."""
    claim = "manager.probe_prefix(prompts[\"b\"]) == 0"
    code = python_blocks()[0]
    assert claim in code
    code = code.replace(claim, claim.replace("== 0", "== 16"))
    namespace: dict[str, object] = {"__name__": "integration_example"}
    try:
        exec(compile(code, str(DOC), "exec"), namespace)
    except AssertionError:
        return
    raise AssertionError("a wrong assertion in the example went unnoticed")
