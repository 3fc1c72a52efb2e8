"""Architecture contracts (``[tool.importlinter]`` in pyproject.toml): the layers
cli → sweep → cluster / engine → sim → sched → traces / models / events / parallel → core
hold, the core imports none of them, and no two modules import each other (directly or
through others) — checked here so that CI runs them with the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def test_import_linter_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    outcome = subprocess.run([str(lint_imports), "--no-cache", str(ROOT / "pyproject.toml")],
                             cwd=ROOT / "src", capture_output=True, text=True, check=False)
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr
    assert "Contracts: 2 kept, 0 broken." in outcome.stdout, outcome.stdout


def test_no_module_import_cycles() -> None:
    """Every import edge a → b has no way back from b to a (``if TYPE_CHECKING:`` imports
    excluded: they never run)."""
    graph = grimp.build_graph("hybridkv", exclude_type_checking_imports=True)
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                cycles.append(f"{importer} -> {' -> '.join(back)}")
    assert not cycles, "\n".join(cycles)
